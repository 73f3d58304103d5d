"""Context parallelism (--cp, autotune/distributed/parallel/context.py) on CPUs: the tool's own trials of tiny-llama on 2 gloo
ranks, FSDP alone against CP2 at a few sequence lengths, each against the simulator's prediction of the same run.

    .venv/bin/python benchmarks/bench_context_parallel.py [--seq 256,1024] [--model tiny-llama]

Printed per configuration: the measured tensor peak (the highest rank's), the predicted one (the trace is rank
0's), their difference, and the measured step time (2 CPU cores: for shape, not for reference). The real trials
and the trace run one `parallelize` and one `train_step`, as every trial does."""

from __future__ import annotations

import argparse

from autotune.backends.real import RealBackend
from autotune.backends.sim import SimBackend
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="256,1024", help="sequence lengths, comma-separated (multiples of 4)")
    parser.add_argument("--model", default="tiny-llama")
    args = parser.parse_args()
    model = resolve_model(args.model)
    specs = [TrialSpec(model=model, cluster=Cluster(num_gpus=2), seq_len=int(seq),
                       train=TrainConfig(context_parallel=cp, activation_checkpointing="none"))
             for seq in args.seq.split(",") for cp in (1, 2)]
    with SimBackend(device_kind="cpu") as sim:
        predicted = [sim.evaluate(spec) for spec in specs]
    with RealBackend(device="cpu", persistent=True, warmup_steps=1, timed_steps=2) as real:
        measured = real.evaluate_many(specs)
    print(f"## {model.name} on 2 gloo ranks: FSDP alone vs context parallelism 2\n")
    print("| seq | cp | measured peak | per rank | predicted | difference | step (s) |\n|---|---|---:|---|---:|---:|---:|")
    for spec, p, m in zip(specs, predicted, measured):
        real_peak, sim_peak = m.extras["tensor_peak_bytes"], p.extras["tensor_peak_bytes"]
        ranks = ", ".join(f"{peak:,}" for peak in m.extras["per_rank_tensor_peak_bytes"])
        print(f"| {spec.seq_len} | {spec.train.context_parallel} | {real_peak:,} | {ranks} | {sim_peak:,} | "
              f"{sim_peak - real_peak:+,} B | {m.extras.get('step_seconds', float('nan')):.2f} |")


if __name__ == "__main__":
    main()
