"""Pipeline parallelism: the simulator's predicted worst-stage tensor peak against real gloo runs on CPUs.

    .venv/bin/python benchmarks/bench_pipeline.py            # the matrix below (~3 min on 2 cores)
    .venv/bin/python benchmarks/bench_pipeline.py --quick    # PP2 1F1B on the three families only
    .venv/bin/python benchmarks/bench_pipeline.py --tp       # PP2 x TP2 on 4 ranks only (1F1B, Interleaved1F1B)
    .venv/bin/python benchmarks/bench_pipeline.py --compile  # compiled blocks (op checkpointing under TP): PP2 on
        # 2 ranks (three schedules) and PP2 x TP2 on 4, tiny-llama and tiny-qwen2 (inductor's CPU code in the real runs)
    PYTHONPATH=.float8-site .venv/bin/python benchmarks/bench_pipeline.py --float8  # float8 linears (torchao):
        # tiny-llama PP2 1F1B tensorwise eager, rowwise compiled, and PP2 x TP2 tensorwise compiled (op checkpointing)
    .venv/bin/python benchmarks/bench_pipeline.py --timing llama3-8b --pp 4 --gpus 8 --schedule 1F1B
        # the simulator alone on a catalog model (no real run): seconds per pipeline candidate with each rank traced
        # whole and with depth extrapolation (_pipeline.trace_pipeline_rank_extrapolated), and both predictions

For each case (family x PP2 / PP4 x schedule; on 4 ranks PP4, PP2 x FSDP2 and PP2 x TP2), tiny models at 64 tokens, 2
sequences per micro-batch, 4 micro-batches (the accumulation steps) per step: the real trial (one warm-up and
one timed step on gloo ranks, backends/real: each rank's tracked tensor peak) and the simulator's prediction
(backends/sim/_pipeline.py: every pipeline rank traced at its own rank of a fake group). Prints predicted and
measured peaks of the worst rank and of each pipeline rank, in bytes, and the difference.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.backends.real import RealBackend  # noqa: E402
from autotune.backends.sim import SimBackend  # noqa: E402
from autotune.problem.catalog.models import MODELS, resolve_model  # noqa: E402
from autotune.problem.catalog.shrink import shrunk_config  # noqa: E402
from autotune.problem.config import Cluster, TrainConfig, TrialSpec  # noqa: E402

SEQ, MICRO_BATCH, ACCUM = 64, 2, 4
FAMILIES = ("tiny-llama", "tiny-qwen2", "olmo2")
NO_TP = ("olmo2",)  # its plan's colwise_gather_output / rowwise_split_input entries: refused under --tp
# (ranks, pipeline parallel, schedule[, tensor parallel])
LAYOUTS = [(2, 2, "1F1B"), (2, 2, "Interleaved1F1B"), (2, 2, "GPipe"), (4, 4, "1F1B"), (4, 2, "Interleaved1F1B"),
           (4, 2, "1F1B", 2), (4, 2, "Interleaved1F1B", 2)]

# Compiled blocks: the two families whose blocks compile whole (fullgraph) on every layout; under TP op-level
# checkpointing (torch cannot compile a whole-block checkpoint under TP: knobs._check_tensor_parallel).
COMPILED_FAMILIES = ("tiny-llama", "tiny-qwen2")
COMPILED_LAYOUTS = [(2, 2, "1F1B"), (2, 2, "Interleaved1F1B"), (2, 2, "GPipe"), (4, 2, "1F1B", 2)]
# float8 linears (ranks, knobs), tiny-llama PP2 under 1F1B.
FLOAT8_CASES = [(2, dict(float8="tensorwise")), (2, dict(float8="rowwise", compile="blocks")),
                (4, dict(float8="tensorwise", tensor_parallel=2, activation_checkpointing="op", compile="blocks"))]


def _model(name: str, folder: Path):
    if name in MODELS:
        return resolve_model(name)
    path = folder / name
    if not (path / "config.json").exists():
        shrunk_config(name).save_pretrained(path)
    return resolve_model(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="PP2 1F1B on the three families only")
    parser.add_argument("--tp", action="store_true", help="PP2 x TP2 on 4 ranks only")
    parser.add_argument("--compile", action="store_true", help="compiled blocks: PP2 (three schedules) and PP2 x TP2")
    parser.add_argument("--float8", action="store_true", help="float8 linears (torchao on the path): three tiny-llama "
                        "cases")
    parser.add_argument("--timing", metavar="MODEL", help="time the simulator on one pipeline candidate of this "
                        "catalog model, whole and depth-extrapolated (no real run)")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--accum", type=int, default=8, help="the pipeline's micro-batches")
    parser.add_argument("--ac", default="full", help="activation checkpointing")
    parser.add_argument("--only", choices=("whole", "extrapolated"), help="--timing: one of the two only")
    args = parser.parse_args()
    if args.timing:
        _timing(args)
        return
    specs = _specs(args, Path(tempfile.mkdtemp(prefix="bench-pipeline-")))
    start = time.perf_counter()
    with SimBackend(device_kind="cpu") as sim:
        predicted = [sim.evaluate(spec) for spec in specs]
    sim_s = time.perf_counter() - start
    start = time.perf_counter()
    with RealBackend(device="cpu", persistent=True, warmup_steps=1, timed_steps=1) as real:
        measured = real.evaluate_many(specs)
    real_s = time.perf_counter() - start
    print(f"{'model':<11} {'ranks':>5} {'pp':>3} {'tp':>3} {'schedule':<16} {'predicted B':>13} {'measured B':>13} {'diff B':>7}"
          "  per pipeline rank: predicted / measured (worst rank of its block)")
    for spec, sim_result, real_result in zip(specs, predicted, measured):
        name = spec.model.name if spec.model.name in MODELS else Path(spec.model.name).name
        if sim_result.status != "ok" or real_result.status != "ok":
            print(f"{name:<11} {spec.cluster.num_gpus:>5} {spec.train.pipeline_parallel:>3} "
                  f"{spec.train.tensor_parallel:>3} {spec.train.pipeline_schedule:<16} sim {sim_result.status}: {sim_result.message[:80]}; "
                  f"real {real_result.status}: {real_result.message[:80]}")
            continue
        sim_peak, real_peak = sim_result.extras["tensor_peak_bytes"], real_result.extras["tensor_peak_bytes"]
        traced = sim_result.extras["per_pipeline_rank_tensor_peak_bytes"]
        real_per = real_result.extras["per_pipeline_rank_tensor_peak_bytes"]
        per = ", ".join(f"{k}: {traced[k]:,} / {real_per[int(k)]:,}" for k in sorted(traced, key=int))
        print(f"{name:<11} {spec.cluster.num_gpus:>5} {spec.train.pipeline_parallel:>3} "
              f"{spec.train.tensor_parallel:>3} {spec.train.pipeline_schedule:<16} {sim_peak:>13,} {real_peak:>13,} {sim_peak - real_peak:>7,}  {per}")
    print(f"simulator {sim_s:.0f} s, real trials {real_s:.0f} s")


def _specs(args, folder: Path) -> list[TrialSpec]:
    """The cases the flags name: the matrix, --quick, --tp, --compile or --float8 (torchao on the path)."""
    def spec(name: str, ranks: int, **knobs) -> TrialSpec:
        return TrialSpec(model=_model(name, folder), cluster=Cluster(num_gpus=ranks), seq_len=SEQ,
                         train=TrainConfig(micro_batch_size=MICRO_BATCH, **knobs), grad_accum_steps=ACCUM)

    if args.float8:
        import torchao  # noqa: F401  (the float8 extra: PYTHONPATH=.float8-site)

        return [spec("tiny-llama", ranks, pipeline_parallel=2, **knobs) for ranks, knobs in FLOAT8_CASES]
    layouts = (LAYOUTS[:1] if args.quick else [row for row in LAYOUTS if len(row) > 3] if args.tp else
               COMPILED_LAYOUTS if args.compile else LAYOUTS)
    compiled = dict(compile="blocks") if args.compile else {}
    return [spec(name, ranks, pipeline_parallel=pp, pipeline_schedule=schedule, tensor_parallel=tp[0] if tp else 1,
                 **compiled, **(dict(activation_checkpointing="op") if compiled and tp else {}))
            for name in (COMPILED_FAMILIES if args.compile else FAMILIES) for ranks, pp, schedule, *tp in layouts
            if not (tp and name in NO_TP)]


def _timing(args) -> None:
    """One pipeline candidate on the simulator (a GPU run's trace: no gloo copy), each rank traced whole
    (SimBackend(extrapolate=False)) and depth-extrapolated (the default): seconds and predicted peaks. The result
    cache is off (AUTOTUNE_CACHE=off): every figure is a trace."""
    import os

    os.environ["AUTOTUNE_CACHE"] = "off"
    spec = TrialSpec(model=resolve_model(args.timing), cluster=Cluster(num_gpus=args.gpus), seq_len=args.seq,
                     train=TrainConfig(pipeline_parallel=args.pp, pipeline_schedule=args.schedule,
                                       micro_batch_size=args.micro_batch, activation_checkpointing=args.ac),
                     grad_accum_steps=args.accum)
    print(f"{args.timing}: {spec.model.num_layers} blocks, {args.gpus} GPUs, pp {args.pp} {args.schedule}, seq "
          f"{args.seq}, micro-batch {args.micro_batch}, {args.accum} micro-batches, checkpointing {args.ac}",
          flush=True)
    peaks = {}
    for label, extrapolate in (("whole", False), ("extrapolated", True)):
        if args.only and args.only != label:
            continue
        start, cpu_start = time.perf_counter(), time.process_time()
        with SimBackend(device_kind="cuda", extrapolate=extrapolate, screen=False) as sim:  # traced, never screened
            result = sim.evaluate(spec)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if "per_pipeline_rank_tensor_peak_bytes" not in result.extras:  # an error, not a prediction ('oom' is one)
            print(f"{label}: {result.status}: {result.message[:300]}")
            continue
        peaks[label] = result.extras["per_pipeline_rank_tensor_peak_bytes"]
        print(f"{label:<13} [{result.status}] {seconds:8.1f} s per candidate ({cpu:.1f} s of CPU: a shared "
              f"machine's wall time is longer); tensor peak {result.extras['tensor_peak_bytes']:,} B; "
              f"per pipeline rank {peaks[label]}", flush=True)
        for rank, how in (result.extras.get("pipeline_ranks_extrapolated") or {}).items():
            print(f"    rank {rank}: {how}")
    if len(peaks) == 2:
        print("per-rank peaks identical" if peaks["whole"] == peaks["extrapolated"] else
              f"per-rank peaks DIFFER: {peaks}")


if __name__ == "__main__":
    main()
