"""Every causal-LM architecture of the installed transformers: planned, and matched with a real run.

    python benchmarks/bench_families.py [--families gpt2,opt] [--no-real] [--resolve-only] [--json out.json] [--markdown out.md]

For every model_type in transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: build its default config,
shrink it (autotune/problem/catalog/shrink.py) at a depth that makes the simulator trace two shallow
copies and extrapolate in depth, save it with `save_pretrained` and read it back through
`resolve_model`, as `--model PATH` does. A family autotune refuses is recorded with its one-line
reason. Each one that plans is predicted by the simulator (2 ranks, seq 64, micro-batch 2,
checkpointing none and full) and, unless --no-real, run for real at full depth in ONE torchrun
launch of the cpu backend (2 gloo ranks); the predicted tensor peak is compared with the measured
one (`extras["tensor_peak_bytes"]`, within 1%).

Statuses: `matched` (every trial within 1%), `mismatch` (a trial off by more), `planned` (predicted,
not run: --no-real), `failed` (the simulator or the real run could not run a trial; the reason),
`refused` (autotune's one-line UsageError), `skipped` (the shrunk model is still too large to run on
CPUs: multimodal towers the shrinker does not reach), `not-buildable` (plain transformers cannot build the
family's default config: not counted), `not-shrinkable` (the default builds, the generic shrinker's
tiny config does not).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

CHECKPOINTING = ("none", "full")
SEQ_LEN = 64
MICRO_BATCH = 2
TOLERANCE = 0.01
MAX_PARAMETERS = 20_000_000

RUN_FOR_REAL = ("import json, sys\n"
                "from autotune.backends.real import RealBackend\n"
                "from autotune.problem.config import TrialSpec\n"
                "specs = [TrialSpec.from_dict(d) for d in json.load(sys.stdin)]\n"
                "with RealBackend(device='cpu', warmup_steps=1, timed_steps=1, timeout_s=300) as real:\n"
                "    print(json.dumps([r.to_dict() for r in real.evaluate_many(specs)]))\n")


@dataclass
class Row:
    family: str
    status: str = ""
    reason: str = ""
    layers: int = 0
    period: int = 0
    block_class: str = ""
    parameters: int = 0
    predicted: dict[str, int] = field(default_factory=dict)
    measured: dict[str, int] = field(default_factory=dict)
    error: dict[str, float] = field(default_factory=dict)
    frozen: int = 0
    """Parameters with requires_grad False (the real backend's memory tracker cannot hook them)."""


def one_line(text: str, limit: int = 240) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def depth_for(family: str) -> tuple[int, dict]:
    """The shrunk config at the smallest depth >= 6 at which the simulator extrapolates."""
    from autotune.backends.sim._extrapolate import shallow_depths
    from autotune.problem.catalog.models import ModelSpec, canonical_config
    from autotune.problem.catalog.shrink import shrink_config

    first = None
    for depth in range(6, 25):
        data = canonical_config(family, shrink_config(family, num_layers=depth))
        first = first or (depth, data)
        try:
            period = ModelSpec(name=family, model_type=family, config_dict=data, default_seq_len=SEQ_LEN,
                               source="").layer_period
        except Exception:  # noqa: BLE001 - resolve_model says why, below
            return depth, data
        if shallow_depths(depth, period) is not None:
            return depth, data
        if period == depth and depth >= 14:  # a pattern that does not repeat (a dense prefix): traced whole
            break
    return first


def prepare(family: str, folder: Path, *, text_only: bool = False) -> tuple[Row, object | None]:
    from transformers import AutoConfig

    from autotune.drivers.api import check_precision_runs
    from autotune.problem.catalog.models import resolve_model
    from autotune.util.errors import UsageError

    row = Row(family)
    try:
        depth, data = depth_for(family)
        config = AutoConfig.for_model(family, **data)
        path = folder / family
        config.save_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - transformers' own refusal of its defaults, or the shrinker's limit
        default = default_build_error(family)
        row.status = "not-buildable" if default else "not-shrinkable"
        row.reason = one_line(f"transformers: {default}" if default else f"{type(exc).__name__}: {exc}")
        return row, None
    try:
        try:
            model = resolve_model(str(path))
        except UsageError as exc:
            if not (text_only and "pass --text-only" in str(exc)):
                raise
            model = resolve_model(str(path), text_only=True)  # a multimodal config's language model alone
            left = model.text_tower_of
            row.reason = (f"--text-only: its language model ({model.model_type}), {left['left_out_parameters']:,} "
                          f"of {left['parameters']:,} parameters left out")
        row.layers, row.period, row.block_class = model.num_layers, model.layer_period, model.block_class
        row.parameters = model.num_parameters
        check_precision_runs(model, "bf16")  # as `autotune tune` refuses it, before any trial
    except UsageError as exc:
        row.status, row.reason = "refused", one_line(str(exc).replace(str(path / "config.json"), "config.json"))
        if "transformers cannot build" in row.reason or "is not a valid" in row.reason:
            default = default_build_error(family)
            if default:  # transformers itself cannot build it: not a gap in autotune (still refused cleanly)
                row.status, row.reason = "not-buildable", one_line(f"transformers: {default}")
            elif plain_build_error(path):
                row.status = "not-shrinkable"
        return row, None
    except Exception as exc:  # noqa: BLE001 - an internal error: what this benchmark is for
        row.status, row.reason = "failed", one_line(f"resolve: internal error {type(exc).__name__}: {exc}")
        return row, None
    try:
        # --text-only: the whole model's count is not the language model's (tests/test_text_only.py
        # checks that one against transformers' language-model submodule)
        counted, row.frozen = plain_parameter_count(path) if model.text_tower_of is None else (row.parameters, 0)
    except Exception:  # noqa: BLE001 - plain transformers cannot read back its own save: nothing to compare
        counted = row.parameters
    if counted != row.parameters:
        row.status = "failed"
        row.reason = (f"autotune counts {row.parameters:,} parameters, the model transformers builds from the "
                      f"same config.json has {counted:,}")
        return row, None
    if row.parameters > MAX_PARAMETERS:
        row.status = "skipped"
        row.reason = (f"the shrunk model still has {row.parameters:,} parameters (sub-models the generic "
                      "shrinker does not reach): too large for a CPU run")
        return row, None
    return row, model


def _meta_build_error(make_config) -> str:
    """Why plain transformers cannot build `make_config()` on the meta device ('' if it can)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(make_config())
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return ""


def default_build_error(family: str) -> str:
    """Why plain transformers cannot build the family's default config ('' if it can)."""
    from transformers import AutoConfig

    return _meta_build_error(lambda: AutoConfig.for_model(family))


def plain_parameter_count(path: Path) -> tuple[int, int]:
    """Parameters of the model plain transformers builds from the saved config (meta device):
    an independent count to check autotune's (one period of layers, scaled in depth) with; and
    how many of them are frozen (requires_grad False)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters()), sum(1 for p in model.parameters() if not p.requires_grad)


def plain_build_error(path: Path) -> str:
    """Why plain transformers cannot build the saved config ('' if it can)."""
    from transformers import AutoConfig

    return _meta_build_error(lambda: AutoConfig.from_pretrained(path))


def specs_of(model, checkpointing=CHECKPOINTING) -> list:
    from autotune.problem.config import Cluster, TrainConfig, TrialSpec

    return [TrialSpec(model=model, cluster=Cluster(num_gpus=2), seq_len=SEQ_LEN,
                      train=TrainConfig(micro_batch_size=MICRO_BATCH, activation_checkpointing=ac))
            for ac in checkpointing]


def launch_real(specs: list) -> subprocess.Popen:
    """The real runs, in a fresh process (see tests/test_model_families.py: never a thread here)."""
    log = open(Path(tempfile.gettempdir()) / "bench_families_real.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", RUN_FOR_REAL], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=log, text=True)
    proc.stdin.write(json.dumps([s.to_dict() for s in specs]))
    proc.stdin.close()
    return proc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated model_types (default: every causal LM)")
    parser.add_argument("--no-real", action="store_true", help="predict only; no real gloo launch")
    parser.add_argument("--checkpointing", default=",".join(CHECKPOINTING),
                        help="activation checkpointing modes to compare (default: none,full)")
    parser.add_argument("--resolve-only", action="store_true", help="shrink and resolve only: no simulation")
    parser.add_argument("--text-only", action="store_true",
                        help="multimodal families: their language model alone, as `--text-only` tunes it")
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--markdown", help="write the table as Markdown here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging as hf_logging

    from autotune.backends.base import TrialResult
    from autotune.backends.sim import SimBackend
    from autotune.backends.sim._extrapolate import shallow_depths

    hf_logging.set_verbosity_error()
    families = args.families.split(",") if args.families else list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    start = time.perf_counter()
    rows: list[Row] = []
    planned: list[tuple[Row, list]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            row, model = prepare(family, Path(tmp), text_only=args.text_only)
            rows.append(row)
            if model is not None:
                planned.append((row, specs_of(model, args.checkpointing.split(","))))
            print(f"  resolved {family}: {row.status or 'ok'} {row.reason[:120]}", file=sys.stderr, flush=True)
        if args.resolve_only:
            for row, _ in planned:
                row.status = "resolved"
            planned = []
        to_run = planned  # frozen parameters too: the real backend's tracker counts them (issue 25)
        real = None if args.no_real or not to_run else launch_real([s for _, specs in to_run for s in specs])
        sim = SimBackend(device_kind="cpu", screen=False)
        try:
            for row, specs in planned:
                for spec in specs:
                    ac = str(spec.train.activation_checkpointing)
                    try:
                        result = sim.evaluate(spec)
                    except Exception as exc:  # noqa: BLE001
                        row.status, row.reason = "failed", one_line(f"sim {ac}: {type(exc).__name__}: {exc}")
                        continue
                    # A layer pattern that does not repeat, or not twice within this depth (lfm3: a
                    # period of 5 in 6 layers): the simulator traces the whole depth.
                    whole = row.period == row.layers or shallow_depths(row.layers, row.period) is None
                    if result.status != "ok" or not (result.extras.get("extrapolated") or whole):
                        if not row.status:
                            why = result.message if result.status != "ok" else "not extrapolated in depth"
                            row.status, row.reason = "failed", one_line(f"sim {ac}: {result.status}: {why}")
                        continue
                    note = "traced whole: its layer pattern does not repeat (no depth extrapolation)"
                    if whole and note not in row.reason:
                        row.reason = f"{row.reason}; {note}" if row.reason else note
                    row.predicted[ac] = int(result.extras["tensor_peak_bytes"])
                if not row.status:
                    row.status = "planned"
                print(f"  predicted {row.family}: {row.status} {row.reason[:120]}", file=sys.stderr, flush=True)
        finally:
            sim.close()
        if real is not None:
            out = real.stdout.read()
            code = real.wait()
            results = [TrialResult.from_dict(r) for r in json.loads(out.strip().splitlines()[-1])] if code == 0 else None
            index = 0
            for row, specs in to_run:
                for spec in specs:
                    ac = str(spec.train.activation_checkpointing)
                    result = results[index] if results else None
                    index += 1
                    if result is None or result.status != "ok":
                        if row.status in ("planned", "matched", "mismatch"):
                            why = result.message if result else f"the launch exited {code}"
                            row.status, row.reason = "failed", one_line(f"real {ac}: "
                                                                         f"{result.status if result else 'error'}: {why}")
                        continue
                    row.measured[ac] = int(result.extras["tensor_peak_bytes"])
                    if ac in row.predicted:
                        row.error[ac] = (row.predicted[ac] - row.measured[ac]) / row.measured[ac]
                if row.status == "planned":
                    bad = [ac for ac, e in row.error.items() if abs(e) > TOLERANCE]
                    row.status = "mismatch" if bad else "matched"
                    if bad:
                        row.reason = ", ".join(f"{ac}: {row.error[ac]:+.2%}" for ac in bad) + \
                            (f"; {row.reason}" if row.reason else "")
    elapsed = time.perf_counter() - start
    print_table(rows, transformers.__version__, elapsed)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(transformers=transformers.__version__, seconds=elapsed,
                                                   rows=[asdict(r) for r in rows]), indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, transformers.__version__))
    return 0


def _mib(value: int | None) -> str:
    return f"{value / 2**20:.2f}" if value else "-"


def _fmt_row(row: Row) -> tuple[str, ...]:
    pred = " / ".join(_mib(row.predicted.get(ac)) for ac in CHECKPOINTING) if row.predicted else "-"
    meas = " / ".join(_mib(row.measured.get(ac)) for ac in CHECKPOINTING) if row.measured else "-"
    err = " / ".join(f"{row.error[ac]:+.3%}" if ac in row.error else "-" for ac in CHECKPOINTING) \
        if row.error else "-"
    return row.family, row.status, pred, meas, err, row.reason


def counts(rows: list[Row]) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in rows:
        out[row.status] = out.get(row.status, 0) + 1
    return out


def print_table(rows: list[Row], version: str, elapsed: float) -> None:
    header = ("family", "status", "predicted MiB (none / full)", "measured MiB", "error", "reason")
    table = [header] + [_fmt_row(r) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    for r in table:
        print("  ".join(r[i].ljust(widths[i]) for i in range(5)) + "  " + r[5])
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts(rows).items()))
    print(f"\ntransformers {version}: {len(rows)} causal-LM architectures: {summary} ({elapsed:.0f} s)")


def markdown(rows: list[Row], version: str) -> str:
    lines = [f"transformers {version}; {len(rows)} architectures: "
             + ", ".join(f"{n} {s}" for s, n in sorted(counts(rows).items())), "",
             "| family | status | predicted MiB (none / full) | measured MiB | error | reason |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        cells = [c.replace("|", "\\|") for c in _fmt_row(row)]
        lines.append("| " + " | ".join(f"`{cells[0]}`" if i == 0 else c for i, c in enumerate(cells)) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
