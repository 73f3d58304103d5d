"""The ranges printed around estimated throughput, earned out of sample (issue 60).

Each range is a quantile of the errors of estimates of rows that were *not* used to set the figures the
estimate rests on, by estimate kind and GPU family:

- "roofline" (the default GPU estimate, compute-bound): the published eager FSDP runs
  (autotune/estimate/data/published_runs.json) held out **by publisher**: every table of one publisher left out
  of the fit at once (costmodel_fit.held_out_by_publisher), each publisher weighted equally, so the
  publisher with the longest tables does not set the quantile;
- "roofline-host-bound", "per-op", "per-op-host-bound" (host-bound default estimates; the per-operation
  model on a calibrated GPU profile): the real trials benchmarks/gpu_check.py recorded on H100s
  (benchmarks/results/gpu_recorded_estimates.json), none of which any figure was fitted to;
- "cpu" (the per-operation model on a calibrated CPU profile): the CPU grid runs of docs/BENCHMARKS.md.

A GPU family no held-out row ran on has no range: the estimate says "not validated on <gpu>".

The figures are stored here (a fit per publisher takes seconds, too long for every estimate);
`python -m autotune.drivers.constants --held-out` recomputes them and tests/test_validation.py fails where they
are stale. Plain data: nothing of autotune is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass

RANGE_QUANTILE = 0.90
"""The quantile of held-out |error| a printed range spans (publishers weighted equally)."""


@dataclass(frozen=True)
class HeldOut:
    """The held-out errors behind one kind of estimate on one GPU family."""

    kind: str
    family: str
    half_width: float
    """The range's half width: RANGE_QUANTILE of |error|, publishers weighted equally ("worst" where
    the per-row errors are not stored: `statistic` says which)."""
    median: float
    """Median |error|, publishers weighted equally."""
    worst: float
    rows: tuple[tuple[str, int], ...]
    """(publisher, held-out rows) pairs."""
    gpus: tuple[str, ...]
    """The GPUs the held-out rows ran on."""
    how: str
    """How the rows were held out."""
    statistic: str = f"{RANGE_QUANTILE:.0%} quantile"

    @property
    def count(self) -> int:
        return sum(n for _, n in self.rows)

    def short(self) -> str:
        """'from 61 held-out rows (IBM (fms-fsdp) 4, ...)': what the console prints beside a range (which
        compile's and float8's factors may have widened: the estimate's basis says by what)."""
        return (f"from {self.count} held-out rows ("
                + ", ".join(f"{name} {n}" for name, n in self.rows) + ")")

    def label(self) -> str:
        """'+-15%: 90% quantile of |error| over 40 held-out rows on h100-80gb (IBM (fms-fsdp) 4, ...); ...'"""
        publishers = ", ".join(f"{name} {n}" for name, n in self.rows)
        return (f"+-{self.half_width:.0%}: {self.statistic} of |error| over {self.count} held-out rows on "
                f"{', '.join(self.gpus)} ({publishers}; {self.how}), publishers weighted equally: "
                f"median {self.median:.1%}, worst {self.worst:.1%}")


def weighted_quantile(errors: list[tuple[str, float]], q: float) -> float:
    """The q-quantile of |error| over (publisher, error) pairs, each publisher weighing 1 in all, shared
    equally by its rows: the smallest |error| whose cumulative weight reaches q of the total."""
    counts: dict[str, int] = {}
    for publisher, _ in errors:
        counts[publisher] = counts.get(publisher, 0) + 1
    items = sorted((abs(e), 1.0 / counts[p]) for p, e in errors)
    total, acc = sum(w for _, w in items), 0.0
    for value, weight in items:
        acc += weight
        if acc >= q * total - 1e-12:
            return value
    return items[-1][0]


def summarize(kind: str, family: str, errors: list[tuple[str, str, float]], how: str) -> HeldOut:
    """A HeldOut from (publisher, gpu, relative error) rows."""
    pairs = [(p, e) for p, _, e in errors]
    rows: dict[str, int] = {}
    for p, _, _ in errors:
        rows[p] = rows.get(p, 0) + 1
    return HeldOut(kind=kind, family=family, half_width=round(weighted_quantile(pairs, RANGE_QUANTILE), 4),
                   median=round(weighted_quantile(pairs, 0.5), 4), worst=round(max(abs(e) for _, e in pairs), 4),
                   rows=tuple(sorted(rows.items())), gpus=tuple(sorted({g for _, g, _ in errors})), how=how)


def gpu_family(gpu: str) -> str:
    """The GPUs that share one fitted matmul efficiency (costmodel_fit.gpu_family: an A100's, a Hopper's)."""
    return "a100" if gpu.startswith("a100") else "hopper" if gpu.startswith(("h100", "h200")) else gpu


LOPO = "leave-one-publisher-out: each publisher's tables left out of the fit together"
RECORDED = "real trials on H100s (benchmarks/gpu_check.py), no figure fitted to them"

# --- the stored figures: `python -m autotune.drivers.constants --held-out` prints them afresh -------------------
HELD_OUT: dict[tuple[str, str], HeldOut] = {}
_A100_PUBLISHERS = (("IBM (fms-fsdp)", 7), ("MosaicML (llm-foundry)", 72), ("PyTorch (torchtitan)", 8),
                    ("TinyLlama (SUTD StatNLP)", 1))
_HOPPER_PUBLISHERS = (("IBM (fms-fsdp)", 4), ("MosaicML (llm-foundry)", 34), ("PyTorch (torchtitan)", 2),
                      ("autotune gpu_check (H100 VMs)", 21))
_GPU_CHECK = "autotune gpu_check (H100 VMs)"
for _entry in (
    HeldOut(kind="roofline", family="a100", half_width=0.1109, median=0.0577, worst=0.191, rows=_A100_PUBLISHERS,
            gpus=("a100-40gb", "a100-80gb"), how=LOPO),
    HeldOut(kind="roofline", family="hopper", half_width=0.1513, median=0.078, worst=0.2321, rows=_HOPPER_PUBLISHERS,
            gpus=("h100-80gb",), how=f"{LOPO}; {RECORDED}"),
    HeldOut(kind="roofline-host-bound", family="hopper", half_width=0.3113, median=0.1152, worst=0.3397,
            rows=((_GPU_CHECK, 31),), gpus=("h100-80gb",), how=RECORDED),
    HeldOut(kind="per-op", family="hopper", half_width=0.3686, median=0.1726, worst=0.3793,
            rows=((_GPU_CHECK, 18),), gpus=("h100-80gb",), how=RECORDED),
    HeldOut(kind="per-op-host-bound", family="hopper", half_width=0.6147, median=0.3653, worst=0.8257,
            rows=((_GPU_CHECK, 34),), gpus=("h100-80gb",), how=RECORDED),
    # The CPU grid's per-row errors are not stored (docs/BENCHMARKS.md keeps each run's median and worst):
    # the range is the worst row of runs 32-34, its median the middle run's median; the profile is the
    # user's own calibration, nothing fitted to the grid's trials.
    HeldOut(kind="cpu", family="cpu", half_width=0.291, median=0.056, worst=0.291,
            rows=(("autotune CPU grid runs 32-34 (2-core VM)", 72),), gpus=("cpu",),
            how="real gloo trials on a calibrated CPU profile, nothing fitted to them (docs/BENCHMARKS.md)",
            statistic="worst (per-row errors not stored; the median is the middle run's)"),
):
    HELD_OUT[(_entry.kind, _entry.family)] = _entry


def held_out(kind: str, gpu: str | None) -> HeldOut | None:
    """The held-out errors behind an estimate of `kind` on `gpu` (a catalog name; None or "cpu" for a CPU
    profile), or None where no held-out row ran on its family: the estimate is not validated there."""
    family = "cpu" if kind == "cpu" else gpu_family(gpu or "")
    return HELD_OUT.get((kind, family))
