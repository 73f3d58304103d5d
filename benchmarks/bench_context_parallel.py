"""Context parallelism (--cp, autotune/distributed/parallel/context.py) on CPUs: the tool's own trials of tiny-llama on 2 gloo
ranks, FSDP alone against CP2 at a few sequence lengths, each against the simulator's prediction of the same run.

    .venv/bin/python benchmarks/bench_context_parallel.py [--seq 256,1024] [--model tiny-llama]
    PYTHONPATH=.float8-site .venv/bin/python benchmarks/bench_context_parallel.py --compile-float8 [--seq 512]
        # CP2 with compiled blocks and float8 linears (torchao): eager, compiled, compiled and fully checkpointed,
        # tensorwise eager, rowwise compiled, and CP2 x TP2 on 4 ranks tensorwise compiled (op checkpointing)

Printed per configuration: the measured tensor peak (the highest rank's), the predicted one (the trace is rank
0's), their difference, and the measured step time (2 CPU cores: for shape, not for reference). The real trials
and the trace run one `parallelize` and one `train_step`, as every trial does."""

from __future__ import annotations

import argparse

from autotune.backends.real import RealBackend
from autotune.backends.sim import SimBackend
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec


# CP2 with compiled blocks and float8 linears (ranks, knobs); under TP, op-level checkpointing (knobs: torch cannot
# compile a tensor-parallel block checkpointed whole).
COMPILED_FLOAT8 = [(2, dict()), (2, dict(compile="blocks")), (2, dict(compile="blocks", activation_checkpointing="full")),
                   (2, dict(float8="tensorwise")), (2, dict(float8="rowwise", compile="blocks")),
                   (4, dict(tensor_parallel=2, float8="tensorwise", compile="blocks", activation_checkpointing="op"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="256,1024", help="sequence lengths, comma-separated (multiples of 4)")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--compile-float8", action="store_true", help="CP2 with compiled blocks and float8 linears "
                        "(torchao on the path), at the first --seq (default 512), micro-batch 2")
    args = parser.parse_args()
    model = resolve_model(args.model)
    if args.compile_float8:
        import torchao  # noqa: F401  (the float8 extra: PYTHONPATH=.float8-site)

        seq = int(args.seq.split(",")[0]) if args.seq != parser.get_default("seq") else 512
        specs = [TrialSpec(model=model, cluster=Cluster(num_gpus=ranks), seq_len=seq,
                           train=TrainConfig(context_parallel=2, micro_batch_size=2, **knobs))
                 for ranks, knobs in COMPILED_FLOAT8]
    else:
        specs = [TrialSpec(model=model, cluster=Cluster(num_gpus=2), seq_len=int(seq),
                           train=TrainConfig(context_parallel=cp, activation_checkpointing="none"))
                 for seq in args.seq.split(",") for cp in (1, 2)]
    with SimBackend(device_kind="cpu") as sim:
        predicted = [sim.evaluate(spec) for spec in specs]
    with RealBackend(device="cpu", persistent=True, warmup_steps=1, timed_steps=2) as real:
        measured = real.evaluate_many(specs)
    print(f"## {model.name} on gloo ranks: FSDP alone vs context parallelism\n")
    print("| seq | configuration | ranks | measured peak | per rank | predicted | difference | step (s) |\n"
          "|---|---|---|---:|---|---:|---:|---:|")
    for spec, p, m in zip(specs, predicted, measured):
        if p.status != "ok" or m.status != "ok":
            print(f"| {spec.seq_len} | {spec.train.label()} | sim {p.status}: {p.message[:80]}; real {m.status}: "
                  f"{m.message[:80]} |")
            continue
        real_peak, sim_peak = m.extras["tensor_peak_bytes"], p.extras["tensor_peak_bytes"]
        ranks = ", ".join(f"{peak:,}" for peak in m.extras["per_rank_tensor_peak_bytes"])
        print(f"| {spec.seq_len} | {spec.train.label()} | {spec.cluster.num_gpus} | {real_peak:,} | {ranks} | "
              f"{sim_peak:,} | {sim_peak - real_peak:+,} B | {m.extras.get('step_seconds', float('nan')):.2f} |")


if __name__ == "__main__":
    main()
