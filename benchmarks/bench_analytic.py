"""The analytic backend: how fast it is, and how far its estimates are from what they model.

Prints three tables (all on this machine's CPU; no GPU needed):
1. seconds per evaluated configuration (median over a sweep), first call apart;
2. estimated tokens/s/GPU against the published FSDP runs (autotune/estimate/data/published_runs.json);
3. closed-form tensor peak against a fake-tensor trace of the same configuration
   (FSDPMemTracker, the simulator's method; shallow copies of the catalog shapes, so it stays quick).

    python benchmarks/bench_analytic.py            # all three
    python benchmarks/bench_analytic.py --no-trace # skip the traces (~1 minute of CPU)
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

from autotune.drivers.costmodel_fit import published_runs, published_spec
from autotune.backends.analytic import AnalyticBackend, estimate_memory
from autotune.problem.catalog.gpus import GPUS
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec

MiB = 2**20

# (model, world size, layers, micro-batch, seq, activation checkpointing)
TRACE_CASES = [
    ("tiny-llama", 2, 4, 4, 256, "none"),
    ("tiny-llama", 2, 4, 4, 256, "every:2"),
    ("tiny-llama", 2, 4, 4, 256, "full"),
    ("tiny-qwen2", 4, 4, 2, 256, "none"),
    ("llama-7b", 8, 4, 1, 4096, "none"),
    ("llama-7b", 8, 4, 1, 4096, "full"),
    ("llama-7b", 8, 4, 2, 4096, "full"),
    ("llama3-8b", 8, 4, 1, 8192, "every:2"),
    ("llama-70b", 64, 4, 1, 8192, "full"),
    ("tiny-llama", 2, 4, 4, 256, "op"),
    ("tiny-llama", 2, 4, 4, 256, "op:mm"),
    ("tiny-qwen2", 4, 4, 2, 256, "op"),
    ("llama-7b", 8, 4, 1, 4096, "op"),
    ("llama-7b", 8, 4, 1, 4096, "op:mm"),
    ("llama3-8b", 8, 4, 1, 8192, "op"),
]


def spec_for(model, gpus, nodes, seq, gpu="h100-80gb", layers=None, **train) -> TrialSpec:
    spec = resolve_model(model)
    if layers is not None:
        spec = replace(spec, config_dict={**spec.config_dict, "num_hidden_layers": layers})
    return TrialSpec(model=spec, cluster=Cluster(num_gpus=gpus, num_nodes=nodes, gpu=GPUS[gpu]),
                     seq_len=seq, train=TrainConfig(**train))


def bench_speed(backend: AnalyticBackend) -> None:
    first_start = time.perf_counter()
    backend.evaluate(spec_for("llama3-70b", 64, 8, 8192))
    first = time.perf_counter() - first_start
    timings = []
    for mb in (1, 2, 4, 8):
        for ac in ("none", "every:2", "every:4", "full"):
            for offload in (False, True):
                spec = spec_for("llama3-70b", 64, 8, 8192, micro_batch_size=mb, activation_checkpointing=ac,
                                cpu_offload=offload)
                start = time.perf_counter()
                backend.evaluate(spec)
                timings.append(time.perf_counter() - start)
    print("## Speed (llama3-70b, 64 GPUs, 32 configurations)")
    print(f"- first call (imports transformers, builds one block on the meta device): {first * 1e3:.0f} ms")
    print(f"- median per configuration after it: {statistics.median(timings) * 1e3:.2f} ms "
          f"(max {max(timings) * 1e3:.2f} ms)\n")


def bench_published(backend: AnalyticBackend) -> None:
    print("## Throughput against published FSDP runs (tokens/s/GPU)")
    print("| model | GPUs | config | published | estimated | diff | source |")
    print("|---|---|---|---|---|---|---|")
    for run in published_runs():
        spec = published_spec(run)  # shapes the catalog lacks (MPT, TinyLlama) come from the data file
        estimate = backend.evaluate(spec).throughput / run.num_gpus
        diff = estimate / run.tokens_per_sec_per_gpu - 1
        print(f"| {run.model} | {run.num_gpus}x {run.gpu} | mb={run.micro_batch_size} seq={run.seq_len} "
              f"ac={run.activation_checkpointing} ({run.note}) | {run.tokens_per_sec_per_gpu:,.0f} | "
              f"{estimate:,.0f} | {diff:+.1%} | {run.source} |")
    print()


def traced_peak(model, world, layers, mb, seq, ac) -> float:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autotune.distributed.parallel import parallelize
    from autotune.distributed.training import build_model, make_optimizer, token_batches, train_step

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        spec = resolve_model(model)
        with FakeTensorMode():
            net = build_model(spec, num_layers=layers)
            parallelize(net, mesh, TrainConfig(activation_checkpointing=ac))
            opt = make_optimizer(net)
            tracker = FSDPMemTracker(net, opt)
            tracker.track_external(net, opt)
            batches = token_batches(vocab_size=spec.config_dict["vocab_size"], micro_batch_size=mb,
                                    seq_len=seq, device="cpu")
            with tracker:
                for step in range(2):
                    if step:
                        tracker.reset_mod_stats()
                    train_step(net, opt, batches, grad_accum_steps=1)
        return max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    finally:
        dist.destroy_process_group()


def bench_traces() -> None:
    print("## Closed-form tensor peak against a fake-tensor trace (MiB per rank)")
    print("| model (layers) | world | mb x seq | AC | traced | closed form | diff | peak at |")
    print("|---|---|---|---|---|---|---|---|")
    diffs = []
    traced_models = set()
    for model, world, layers, mb, seq, ac in TRACE_CASES:
        if (model, world) not in traced_models:
            # A process's first trace of a model can peak at the optimizer step with the whole
            # unsharded AdamW state counted (seen with op-level checkpointing first): trace it once
            # untimed, as the simulator's warm-up step does.
            traced_peak(model, world, layers, mb, seq, ac)
            traced_models.add((model, world))
        traced = traced_peak(model, world, layers, mb, seq, ac)
        estimate = estimate_memory(spec_for(model, world, 1, seq, layers=layers, micro_batch_size=mb,
                                            activation_checkpointing=ac))
        diff = estimate.tensor_peak_bytes / traced - 1
        diffs.append(abs(diff))
        print(f"| {model} ({layers}) | {world} | {mb} x {seq} | {ac} | {traced / MiB:,.1f} | "
              f"{estimate.tensor_peak_bytes / MiB:,.1f} | {diff:+.2%} | {estimate.peak_at} |")
    print(f"\nmedian |diff| {statistics.median(diffs):.2%}, max {max(diffs):.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-trace", action="store_true", help="skip the fake-tensor traces")
    args = parser.parse_args()
    backend = AnalyticBackend()
    bench_speed(backend)
    bench_published(backend)
    if not args.no_trace:
        bench_traces()


if __name__ == "__main__":
    main()
