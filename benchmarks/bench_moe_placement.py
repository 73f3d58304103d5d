"""Per-GPU memory of MoE models as GPUs are added, with FSDP2's default dim-0 shard placement and
with `--shard-placement largest` (issue 32).

    python benchmarks/bench_moe_placement.py [--models mixtral-8x7b,qwen3-30b-a3b] [--gpus 8,16,32,64,128]
                                              [--placements dim0,largest] [--ep 1] [--json out.json]

Each row is the simulator's prediction (the real model traced under fake tensors and a fake
process group of that many ranks, 8 GPUs a node, H100 80GB) of one configuration: micro-batch 1,
every block checkpointed, the model's default sequence length. Printed per GPU: the predicted peak
(tensor peak plus the runtime terms, `predicted+estimated`), and from the trace's breakdown the
parameters (sharded, with dim-0 padding) and the optimizer state. Fused expert weights are
[experts, ...]: sharded on dimension 0 over more ranks than experts, each rank holds a whole
expert slice or padding, so memory stops falling (mixtral-8x7b: 8 experts) and then grows (the
padding is allocated, and the all-gather buffers with it). `largest` shards them on their largest
evenly divisible dimension, as torchtitan does; memory must fall monotonically with the GPU count.
`--ep 1,8`: each placement also with expert parallelism over 8 GPUs (`--ep`: each GPU holds and
gathers 1/8 of the experts; the all-to-all's split sizes balanced in the trace).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GIB = 2**30


def predict(model_name: str, gpus: int, placement: str, ep: int = 1):
    from autotune.backends.sim import SimBackend
    from autotune.problem.catalog.gpus import GPUS
    from autotune.problem.catalog.models import resolve_model
    from autotune.problem.config import Cluster, TrainConfig, TrialSpec

    model = resolve_model(model_name)
    spec = TrialSpec(model=model, cluster=Cluster(num_gpus=gpus, num_nodes=max(1, gpus // 8), gpu=GPUS["h100-80gb"]),
                     seq_len=model.default_seq_len,
                     train=TrainConfig(micro_batch_size=1, activation_checkpointing="full", shard_placement=placement,
                                       expert_parallel=ep))
    with SimBackend(device_kind="cuda", screen=False) as sim:
        return sim.evaluate(spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mixtral-8x7b,qwen3-30b-a3b")
    parser.add_argument("--gpus", default="8,16,32,64,128")
    parser.add_argument("--placements", default="dim0,largest")
    parser.add_argument("--ep", default="1", help="expert-parallel degrees, comma-separated")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    configurations = [(p, int(e)) for p in args.placements.split(",") for e in args.ep.split(",")]
    rows = []
    print(f"{'model':<15} {'GPUs':>5} {'placement':<14} {'peak GiB':>9} {'params GiB':>10} {'optim GiB':>9} "
          f"{'trace s':>7}")
    for model_name in args.models.split(","):
        for gpus in (int(g) for g in args.gpus.split(",")):
            for placement, ep in configurations:
                began = time.monotonic()
                result = predict(model_name, gpus, placement, ep)
                placement = placement if ep == 1 else f"{placement} ep={ep}"
                seconds = time.monotonic() - began
                breakdown = result.memory_breakdown
                row = dict(model=model_name, gpus=gpus, placement=placement, status=result.status,
                           peak_gib=(result.peak_bytes or 0) / GIB,
                           peak_source=result.peak_memory.source if result.peak_memory else None,
                           params_gib=breakdown.get("parameters", 0) / GIB,
                           optimizer_gib=breakdown.get("optimizer_state", 0) / GIB, trace_seconds=seconds,
                           message=result.message if result.status != "ok" else "")
                rows.append(row)
                print(f"{model_name:<15} {gpus:>5} {placement:<14} {row['peak_gib']:>9.2f} {row['params_gib']:>10.2f} "
                      f"{row['optimizer_gib']:>9.2f} {seconds:>7.1f}"
                      + (f"  {result.status}: {result.message[:80]}" if result.status not in ("ok", "oom") else ""),
                      flush=True)
    for model_name in args.models.split(","):
        for placement in dict.fromkeys(r["placement"] for r in rows):
            peaks = [r["peak_gib"] for r in rows if r["model"] == model_name and r["placement"] == placement]
            falling = all(b < a for a, b in zip(peaks, peaks[1:]))
            print(f"{model_name} {placement}: per-GPU peak {'falls' if falling else 'does NOT fall'} monotonically "
                  f"({' -> '.join(f'{p:.1f}' for p in peaks)} GiB, predicted+estimated)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
