"""torch.compile (`--compile blocks`): the simulator's compiled tensor peak against real compiled
gloo trials, and what compilation costs in time.

    python benchmarks/bench_compile.py            # the matrix below, 2 gloo ranks, seq 256
    python benchmarks/bench_compile.py --steps 6  # more steps: when tokens/s is steady

Each row runs for real (the cpu backend: torchrun, gloo, inductor's CPU backend compiling each
block; persistent launch, no warm-up step, so the first step's time includes compilation) and is
predicted by the simulator for that CPU run (SimBackend(device_kind="cpu"): AOT autograd with
inductor's decompositions and min-cut partitioner on fake tensors). Prints one row per
configuration: measured and predicted tensor peaks (bytes), their difference, and every step's
time (measured, slowest rank). docs/COMPILE.md has the figures of the last run.
"""

from __future__ import annotations

import argparse
import time

from autotune.backends.real import RealBackend
from autotune.backends.sim import SimBackend
from autotune.catalog.models import resolve_model
from autotune.config import Cluster, TrainConfig, TrialSpec

MATRIX = [  # (model, checkpointing, micro-batch, compile)
    ("tiny-llama", "none", 2, "none"),
    ("tiny-llama", "none", 2, "blocks"),
    ("tiny-llama", "full", 2, "none"),
    ("tiny-llama", "full", 2, "blocks"),
    ("tiny-qwen2", "none", 2, "none"),
    ("tiny-qwen2", "none", 2, "blocks"),
    ("tiny-qwen2", "full", 2, "none"),
    ("tiny-qwen2", "full", 2, "blocks"),
    ("tiny-llama", "op", 2, "none"),
    ("tiny-llama", "op", 2, "blocks"),
]


def spec(model: str, ac: str, mb: int, compile: str, *, seq_len: int = 256) -> TrialSpec:
    return TrialSpec(model=resolve_model(model), cluster=Cluster(num_gpus=2), seq_len=seq_len,
                     train=TrainConfig(activation_checkpointing=ac, micro_batch_size=mb, compile=compile))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per trial, all timed (the first compiles)")
    parser.add_argument("--rows", default="", help="comma-separated row indices (default: all)")
    args = parser.parse_args()
    rows = [MATRIX[int(i)] for i in args.rows.split(",")] if args.rows else MATRIX
    specs = [spec(*row) for row in rows]
    started = time.perf_counter()
    with RealBackend(device="cpu", warmup_steps=0, timed_steps=args.steps, timeout_s=1200) as real:
        measured = real.evaluate_many(specs)
    real_s = time.perf_counter() - started
    started = time.perf_counter()
    with SimBackend(device_kind="cpu") as sim:
        predicted = [sim.evaluate(s) for s in specs]
    sim_s = time.perf_counter() - started
    print(f"| model | ac | mb | compile | measured B | predicted B | predicted - measured | step times s (measured) |")
    print("|---|---|---|---|---:|---:|---:|---|")
    for row, m, p in zip(rows, measured, predicted):
        mp = m.extras.get("tensor_peak_bytes") if m.status == "ok" else None
        pp = p.extras.get("tensor_peak_bytes") if p.status == "ok" else None
        diff = f"{pp - mp:+,} ({(pp - mp) / mp:+.3%})" if mp and pp else f"{m.status}/{p.status}: {m.message or p.message}"
        times = max(m.extras.get("step_times_s") or [[]], key=sum) if m.status == "ok" else []
        print(f"| {row[0]} | {row[1]} | {row[2]} | {row[3]} | {mp or 0:,} | {pp or 0:,} | {diff} | "
              f"{', '.join(f'{t:.2f}' for t in times)} |")
    print(f"\nreal trials {real_s:.0f} s (one launch), simulator {sim_s:.0f} s")


if __name__ == "__main__":
    main()
