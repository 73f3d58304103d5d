"""Time to train as runs see it: the benchmark time (train tokens / tokens per second) plus what
real pretraining runs lose that a step's throughput does not show.

    wall = startup + T / g * (1 + eval) + saves * write + failures * (restart + reload + interval / 2)

- T = train tokens / tokens/s: the benchmark time (what `autotune plan` printed alone before).
- g, the goodput factor: the one fitted constant (FITTED_GOODPUT below). What sustained runs
  lose per step that no term here names (data stalls, stragglers, slower steps than the estimate,
  the estimate's own bias on another stack), as a factor on the throughput.
- eval: evaluation as a fraction of training time (default EVAL_FRACTION, settable).
- saves: one checkpoint every `checkpoint_every_s` of training time (default: the Young/Daly
  interval sqrt(2 x write x the job's mean time between failures), at most one hour), each
  blocking the job for `write` seconds: the checkpoint's size (the fp32 weights and AdamW state,
  12 bytes per parameter: autotune/estimate/checkpoint_plan.py's PARAM_BYTES + OPTIMIZER_BYTES) over
  the write bandwidth (default WRITE_BYTES_PER_S_PER_NODE per node: every rank writes its own
  shard of a sharded DCP save, as the checkpoint advice recommends), unless the write time is given.
- failures: interruptions at `failure_rate` per GPU-hour of the whole job (wall-clock x GPUs:
  the job stands still while one GPU is down), each costing detection + restart (`restart_s`),
  reloading the checkpoint (taken as its write time) and on average half a checkpoint interval
  of lost work.
- startup: once, the first start (scheduling, loading, the first slow steps).

The failure term depends on the wall time it lengthens, so the expected wall time solves
wall = A + rate x GPUs x wall x cost per failure: wall = A / (1 - rate x GPUs x cost). A run
whose failures cost more than they leave (the denominator <= 0) never finishes: its wall time is
infinite, and `autotune plan` says so instead of a figure.

Failure rate (FAILURES_PER_GPU_HOUR): "The Llama 3 Herd of Models" (Meta, 2024; arXiv 2407.21783)
§3.3.4: "During a 54-day snapshot period of pre-training, we experienced a total of 466 job
interruptions. Of these, 47 were planned ... The remaining 419 were unexpected interruptions", on
up to 16,384 H100 GPUs: 419 / (16,384 x 54 x 24 GPU-hours) = 1.97e-5 per GPU-hour, about one
every 50,700 GPU-hours. Other large runs agree in order of magnitude: BLOOM-176B (BigScience,
arXiv 2211.05100, as summarized in secondary sources) saw about 1-2 GPU failures a week on 384
A100s (1.6-3.1e-5 per GPU-hour); the OPT-175B logbook (Meta, 2022) records dozens of restarts
over about two months on 992 A100s. The range carried: 1e-5 to 4e-5 per GPU-hour.

Ranges: the expected figure uses each assumption's stated value; the low end the throughput's high
end, the fitted goodput's high end and each loss term's low end (the *_RANGE constants), the high end
the reverse. Only the goodput factor and its spread are fitted (benchmarks/bench_time_to_train.py,
on benchmarks/results/published_pretraining_runs.json, held out by publisher): see FITTED_GOODPUT.
Standard library only (and the checkpoint advice's byte counts): the bottom import layer, like
autotune/util/units.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from autotune.estimate.checkpoint_plan import OPTIMIZER_BYTES, PARAM_BYTES
from autotune.util.errors import UsageError

CHECKPOINT_BYTES_PER_PARAM = PARAM_BYTES + OPTIMIZER_BYTES
"""fp32 master weights (4 B) + AdamW's two fp32 moments (8 B), as the checkpoint advice counts them."""

FAILURES_PER_GPU_HOUR = 419 / (16_384 * 54 * 24)
"""Llama 3 (arXiv 2407.21783 §3.3.4): 419 unexpected interruptions, 54 days, 16,384 H100s: 1.97e-5."""
FAILURE_RATE_RANGE = (1e-5, 4e-5)
CHECKPOINT_EVERY_MAX_S = 3600.0
"""The default interval's ceiling: one save per hour of training. Below it the default is Young's
(1974) / Daly's (2006) first-order optimum sqrt(2 x write time x mean time between failures):
saving more often costs more writes, less often more lost work."""
WRITE_BYTES_PER_S_PER_NODE = 1e9
"""1 GB/s per node into a parallel file system or object store (a stated assumption: local NVMe
writes faster, a shared file system under a thousand nodes slower)."""
WRITE_RANGE = (0.5, 2.0)
"""Factor on the write time, low to high."""
RESTART_S = 600.0
"""Detection + restart of a failed job: 10 min. Llama 3 kept "higher than 90% effective training
time" with an unexpected interruption every 3.1 h (§3.3.4): at most 0.31 h lost per interruption,
lost work included, so restarts were automated and quick; a job restarted by hand (the OPT-175B
logbook) loses hours: the high end."""
RESTART_RANGE_S = (300.0, 3600.0)
EVAL_FRACTION = 0.01
EVAL_RANGE = (0.0, 0.03)
STARTUP_S = 3600.0
STARTUP_RANGE_S = (900.0, 4 * 3600.0)

FITTED_GOODPUT = 0.66
"""Sustained tokens/s over autotune's estimate: the one fitted constant. Fitted by
benchmarks/bench_time_to_train.py on benchmarks/results/published_pretraining_runs.json: the
factor for which the mean over publishers (each publisher's rows averaged first, so each
publisher weighs the same) of log(published / predicted GPU-hours) is zero; 0.660 on all 11 rows,
from 9 publishers (LLaMA-65B, Llama 3.1 405B, BLOOM-176B, MPT-7B, Falcon-180B, StableLM-3B-4E1T,
SmolLM3-3B, StarCoderBase-15.5B, BloombergGPT-50B, Pythia-12B and 6.9B; the 405B and Falcon rows past
FSDP's batch wall, answered with tensor parallelism). Rows whose published figure is step time x
steps (LLaMA-65B's Table 15, Pythia's Table 5) are fitted on the compute term alone (benchmark time /
g), the rest on the whole wall-clock. The benchmark refits it without each row's publisher. It stands
for what sustained runs lose per step that no term here names and for the throughput estimate's bias
on these runs' stacks (mostly Megatron-style 3D parallelism on A100s), which one factor cannot tell
apart; the second dominates. Where a publisher states its measured step throughput, the run kept
most of it: Llama 3.1 405B's 400 TFLOP/s per GPU on 16,384 GPUs (arXiv 2407.21783 Table 4) is
150-164 tokens/s per GPU (as attention is counted), its 30.84M GPU-hours imply 141: 0.86-0.94, as its
">90% effective training time" says; LLaMA-65B's Table 15 is its 380 tokens/s per GPU to 0.1%. Yet
the factors the publishers' rows give alone span 1.7x (FITTED_GOODPUT_RANGE): autotune's estimate of
their steps, not their losses, is what one factor cannot carry."""
FITTED_GOODPUT_RANGE = (0.49, 0.85)
"""The fitted factor's spread (the second fitted figure): the smallest and largest factor one
publisher's rows give alone in the same fit (Bloomberg 0.49 ... Meta 0.85: LLaMA-65B and Llama 3.1 405B
sustained 0.84 and 0.80 times autotune's estimate of their clusters), so the range carries how far one publisher's runs sit
from the others'."""


@dataclass(frozen=True)
class Assumptions:
    """What the expected time assumes; every field settable (`autotune plan` flags)."""

    checkpoint_every_s: float | None = None
    """None: the Young/Daly interval, at most CHECKPOINT_EVERY_MAX_S."""
    write_bytes_per_s_per_node: float = WRITE_BYTES_PER_S_PER_NODE
    failures_per_gpu_hour: float = FAILURES_PER_GPU_HOUR
    restart_s: float = RESTART_S
    eval_fraction: float = EVAL_FRACTION
    startup_s: float = STARTUP_S
    goodput: float = FITTED_GOODPUT
    goodput_range: tuple[float, float] = FITTED_GOODPUT_RANGE

    def check(self) -> "Assumptions":
        for name in ("checkpoint_every_s", "write_bytes_per_s_per_node", "goodput"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise UsageError(f"time to train: {name} must be positive, not {getattr(self, name)!r}")
        for name in ("failures_per_gpu_hour", "restart_s", "startup_s"):
            if not getattr(self, name) >= 0:
                raise UsageError(f"time to train: {name} must not be negative, not {getattr(self, name)!r}")
        if not 0 <= self.eval_fraction < 1:
            raise UsageError(f"time to train: the evaluation fraction must be in [0, 1), not {self.eval_fraction!r}")
        return self


def checkpoint_bytes(parameters: int) -> int:
    """A training checkpoint's size: fp32 weights + AdamW state (checkpoint_plan's 12 B/param)."""
    return CHECKPOINT_BYTES_PER_PARAM * int(parameters)


def checkpoint_interval(a: "Assumptions", *, gpus: int, write_s: float, failure_rate: float) -> float:
    """The stated interval, or Young/Daly's sqrt(2 x write x MTBF) capped at one hour."""
    if a.checkpoint_every_s is not None:
        return a.checkpoint_every_s
    if failure_rate <= 0 or write_s <= 0:
        return CHECKPOINT_EVERY_MAX_S
    mtbf_s = 3600 / (failure_rate * gpus)
    return min(CHECKPOINT_EVERY_MAX_S, math.sqrt(2 * write_s * mtbf_s))


def _wall(train_s: float, *, gpus: int, write_s: float, a: Assumptions, goodput: float,
          eval_fraction: float, failure_rate: float, restart_s: float, startup_s: float) -> dict[str, float]:
    """The terms of one evaluation of the model (seconds), failures solved for the wall time; a run
    whose failures take all its time (it never finishes) has an infinite wall time."""
    interval = checkpoint_interval(a, gpus=gpus, write_s=write_s, failure_rate=failure_rate)
    compute = train_s / goodput
    evaluation = compute * eval_fraction
    saves = compute / interval
    checkpointing = saves * write_s
    base = startup_s + compute + evaluation + checkpointing
    per_failure = restart_s + write_s + interval / 2
    load = failure_rate * gpus * per_failure / 3600  # failures' share of each wall-clock second
    wall = base / (1 - load) if load < 1 else math.inf
    failures = failure_rate * gpus * wall / 3600
    return {"wall_s": wall, "benchmark_s": train_s, "goodput_loss_s": compute - train_s, "evaluation_s": evaluation,
            "checkpoint_every_s": interval, "checkpoint_saves": saves, "checkpointing_s": checkpointing,
            "failures": failures, "failure_loss_s": failures * per_failure, "startup_s": startup_s,
            "per_failure_s": per_failure, "failure_share": load}


def expected_time(*, train_tokens: float, tokens_per_sec: float, gpus: int, nodes: int | None = None,
                  checkpoint_size_bytes: float, write_s: float | None = None,
                  tokens_per_sec_range: tuple[float, float] | None = None,
                  assumptions: Assumptions | None = None) -> dict[str, Any]:
    """Expected wall-clock and GPU-hours with what runs lose, each term, and a range (low, high)
    carrying the throughput's range, the goodput's spread and each loss term's stated range."""
    a = (assumptions or Assumptions()).check()
    if not tokens_per_sec > 0 or not train_tokens > 0 or gpus < 1:
        raise UsageError("time to train needs positive train tokens, tokens/s and GPUs")
    nodes = nodes or max(1, math.ceil(gpus / 8))
    write_given = write_s is not None
    write = float(write_s) if write_given else checkpoint_size_bytes / (a.write_bytes_per_s_per_node * nodes)
    train_s = train_tokens / tokens_per_sec
    expected = _wall(train_s, gpus=gpus, write_s=write, a=a, goodput=a.goodput, eval_fraction=a.eval_fraction,
                     failure_rate=a.failures_per_gpu_hour, restart_s=a.restart_s, startup_s=a.startup_s)
    low_tps, high_tps = tokens_per_sec_range or (tokens_per_sec, tokens_per_sec)
    # Each loss term's range is relative to its stated value, so a user's setting moves its range with it.
    rate_lo, rate_hi = (a.failures_per_gpu_hour * r / FAILURES_PER_GPU_HOUR for r in FAILURE_RATE_RANGE)
    g_lo, g_hi = min(a.goodput_range[0], a.goodput), max(a.goodput_range[1], a.goodput)
    w_lo, w_hi = (write, write) if write_given else (write * WRITE_RANGE[0], write * WRITE_RANGE[1])
    low = _wall(train_tokens / high_tps, gpus=gpus, write_s=w_lo, a=a, goodput=g_hi,
                eval_fraction=a.eval_fraction * EVAL_RANGE[0] / EVAL_FRACTION,
                failure_rate=rate_lo, restart_s=a.restart_s * RESTART_RANGE_S[0] / RESTART_S,
                startup_s=a.startup_s * STARTUP_RANGE_S[0] / STARTUP_S)
    high = _wall(train_tokens / low_tps, gpus=gpus, write_s=w_hi, a=a, goodput=g_lo,
                 eval_fraction=a.eval_fraction * EVAL_RANGE[1] / EVAL_FRACTION,
                 failure_rate=rate_hi, restart_s=a.restart_s * RESTART_RANGE_S[1] / RESTART_S,
                 startup_s=a.startup_s * STARTUP_RANGE_S[1] / STARTUP_S)
    hours = lambda s: s / 3600 * gpus  # noqa: E731
    return {
        "wall_s": expected["wall_s"], "wall_range_s": [low["wall_s"], high["wall_s"]],
        "gpu_hours": hours(expected["wall_s"]), "gpu_hours_range": [hours(low["wall_s"]), hours(high["wall_s"])],
        "terms": expected, "checkpoint_size_bytes": checkpoint_size_bytes, "checkpoint_write_s": write,
        "checkpoint_write_basis": "given" if write_given else
        f"{checkpoint_size_bytes / 1e9:,.1f} GB / ({a.write_bytes_per_s_per_node / 1e9:g} GB/s per node x {nodes} nodes)",
        "assumptions": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(a).items()},
    }


def basis(result: dict[str, Any], *, gpus: int) -> str:
    """One line naming every term of an expected time (plan.json's basis strings)."""
    t, a = result["terms"], result["assumptions"]
    h = lambda s: f"{s / 3600:,.1f} h"  # noqa: E731
    return (f"benchmark {h(t['benchmark_s'])} / goodput {a['goodput']:.2f} (fitted on published runs) + evaluation "
            f"{a['eval_fraction']:.0%} + {t['checkpoint_saves']:,.0f} checkpoint saves x {result['checkpoint_write_s']:,.0f} s "
            f"(one per {t['checkpoint_every_s'] / 60:,.0f} min{'' if a['checkpoint_every_s'] else ', Young/Daly'}; "
            f"{result['checkpoint_write_basis']}) + "
            f"{t['failures']:,.1f} failures ({a['failures_per_gpu_hour'] * 1e6:.3g} per million GPU-hours on {gpus} GPUs; "
            f"Llama 3 §3.3.4) x {t['per_failure_s'] / 3600:.2f} h (restart {a['restart_s'] / 60:g} min + reload + half "
            f"an interval) + startup {h(a['startup_s'])}")


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d)?\s*$", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def parse_duration(text: str | float, *, what: str) -> float:
    """'1h', '30m', '90s', '2d' or seconds ('600') -> seconds."""
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        match = _DURATION.match(str(text))
        if not match:
            raise UsageError(f"cannot parse {what} {text!r}: use a duration such as 30m, 1h, 90s or 2d")
        seconds = float(match.group(1)) * _SECONDS[(match.group(2) or "").lower()]
    if seconds < 0:
        raise UsageError(f"{what} must not be negative")
    return seconds


def with_overrides(a: Assumptions | None = None, **changes: Any) -> Assumptions:
    """Assumptions with the given fields changed (None: left at its default), checked."""
    return replace(a or Assumptions(), **{k: v for k, v in changes.items() if v is not None}).check()
