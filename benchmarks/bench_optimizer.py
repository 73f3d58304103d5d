"""What each AdamW implementation costs in memory, measured and predicted.

    python benchmarks/bench_optimizer.py

1. tiny-llama, 2 gloo ranks, seq 256, micro-batch 1, full checkpointing: the real cpu backend's
   tensor peak (measured, MemTracker) against the simulator's (predicted), per implementation.
2. llama-7b shape cut to 4 blocks, world size 8, seq 4096, full checkpointing: the traced peak of
   the whole step and of the optimizer step alone, per implementation (predicted).
"""

from __future__ import annotations

import dataclasses

from autotune.backends.real import RealBackend
from autotune.backends.sim import SimBackend
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec
from autotune.problem.knobs import OPTIMIZER_IMPLS

MiB = 2**20


def tiny_real_vs_predicted() -> None:
    model = resolve_model("tiny-llama")
    specs = [TrialSpec(model=model, cluster=Cluster(num_gpus=2), seq_len=256,
                       train=TrainConfig(activation_checkpointing="full", optimizer_impl=impl))
             for impl in OPTIMIZER_IMPLS]
    with RealBackend(device="cpu", warmup_steps=1, timed_steps=1) as real:
        measured = real.evaluate_many(specs)
    with SimBackend(device_kind="cpu", screen=False) as sim:
        predicted = [sim.evaluate(spec) for spec in specs]
    print("tiny-llama, 2 gloo ranks, seq 256, mb 1, full AC: tensor peak per rank (bytes)")
    print(f"{'AdamW':<10} {'measured':>14} {'predicted':>14} {'difference':>11}")
    for impl, m, p in zip(OPTIMIZER_IMPLS, measured, predicted):
        real_peak, sim_peak = m.extras.get("tensor_peak_bytes"), p.extras.get("tensor_peak_bytes")
        print(f"{impl:<10} {real_peak:>14,} {sim_peak:>14,} {sim_peak - real_peak:>+11,}")


def llama7b_optimizer_step() -> None:
    model = resolve_model("llama-7b")
    cut = dataclasses.replace(model, config_dict={**model.config_dict, "num_hidden_layers": 4})
    print("\nllama-7b shape, 4 blocks, world size 8, seq 4096, mb 1, full AC: predicted per GPU")
    print(f"{'AdamW':<10} {'step peak MiB':>14} {'optimizer-step peak MiB':>24}")
    for impl in OPTIMIZER_IMPLS:
        with SimBackend(device_kind="cpu", extrapolate=False, screen=False) as sim:
            spec = TrialSpec(model=cut, cluster=Cluster(num_gpus=8), seq_len=4096,
                             train=TrainConfig(activation_checkpointing="full", optimizer_impl=impl))
            result = sim.evaluate(spec)
            trace = next(iter(sim._traces.values()))
            in_step = max(sum(c.values()) for key, c in trace.sites.items() if key[0] == "opt")
        print(f"{impl:<10} {result.extras['tensor_peak_bytes'] / MiB:>14,.1f} {in_step / MiB:>24,.1f}")


if __name__ == "__main__":
    tiny_real_vs_predicted()
    llama7b_optimizer_step()
