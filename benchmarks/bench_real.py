"""Real trials per minute on CPUs: one persistent launch for a list of trials vs one launch per trial.

    python benchmarks/bench_real.py [--model micro-llama] [--trials 4] [--repeats 3]

Each repeat evaluates the same list of configurations (micro-batch 1..N, 2 gloo ranks) both
ways and times the whole evaluate_many call; the script prints the median trials per minute of
each mode and the ratio of the medians. Measured wall-clock figures on this machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from autotune.backends.real import RealBackend
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec


def trial_specs(model_name: str, count: int, *, world: int, seq_len: int) -> list[TrialSpec]:
    model = resolve_model(model_name)
    return [TrialSpec(model=model, cluster=Cluster(num_gpus=world), seq_len=seq_len,
                      train=TrainConfig(micro_batch_size=1 + i % 4,
                                        activation_checkpointing="full" if i % 2 else "none"))
            for i in range(count)]


def trials_per_minute(specs: list[TrialSpec], *, persistent: bool) -> tuple[float, int]:
    with RealBackend(device="cpu", persistent=persistent, warmup_steps=1, timed_steps=1) as backend:
        start = time.perf_counter()
        results = backend.evaluate_many(specs)
        elapsed = time.perf_counter() - start
        launches = backend.launches
    bad = [r.message for r in results if r.status != "ok"]
    assert not bad, bad
    return len(specs) / elapsed * 60, launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="micro-llama")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    specs = trial_specs(args.model, args.trials, world=args.world, seq_len=args.seq_len)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, no GPU; {args.world} gloo ranks; "
          f"{args.model}, seq {args.seq_len}; {args.trials} trials per repeat (1 warm-up + 1 timed step)")
    rates: dict[str, list[float]] = {"persistent": [], "per-trial": []}
    for repeat in range(args.repeats):
        for mode in rates:
            rate, launches = trials_per_minute(specs, persistent=mode == "persistent")
            rates[mode].append(rate)
            print(f"  repeat {repeat + 1}: {mode:10s} {rate:6.2f} trials/min ({launches} launches)", flush=True)
    persistent = statistics.median(rates["persistent"])
    per_trial = statistics.median(rates["per-trial"])
    print(f"median persistent: {persistent:.2f} trials/min (measured)")
    print(f"median one launch per trial: {per_trial:.2f} trials/min (measured)")
    ratios = [a / b for a, b in zip(rates["persistent"], rates["per-trial"])]
    print(f"ratio of the medians, persistent / per-trial: {persistent / per_trial:.2f}x "
          f"(per repeat: {', '.join(f'{r:.2f}x' for r in ratios)}; median {statistics.median(ratios):.2f}x)")


if __name__ == "__main__":
    main()
