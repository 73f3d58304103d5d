"""Token-budget batches (--token-budget, autotune/problem/packing.py): the figures docs/KNOBS.md states.

1. Memory: the simulator's tensor peak against real gloo trials of the same packed micro-batches (2 ranks,
   documents of 8-64 tokens at seq_len 64), two families, three budgets each.
2. How much the split of a filled row into documents moves the predicted peak (the trace runs one split:
   packing.Packing.worst_case_documents): llama3-8b on 8 x h100-80gb, seq 8,192, budgets of 1-3 rows, under
   three length distributions.
3. The packing's arithmetic at those budgets: expected fill, documents and the attention work against
   rows of whole sequences.

    .venv/bin/python benchmarks/bench_token_budget.py            # all (about 2 minutes on 2 cores)
    .venv/bin/python benchmarks/bench_token_budget.py --no-real  # 2 and 3 only
"""

from __future__ import annotations

import argparse

from autotune.backends.sim import SimBackend
from autotune.problem.catalog.gpus import GPUS
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec
from autotune.problem.packing import DocumentLengths, Packing
from autotune.util.units import format_bytes

SHORT = Packing(DocumentLengths(loguniform=(8, 64), source="loguniform:8:64"))
DISTRIBUTIONS = {"loguniform:64:8192 (default)": Packing(),
                 "loguniform:16:1024 (short)": Packing(DocumentLengths(loguniform=(16, 1024), source="short")),
                 "8192 only (one per row)": Packing(DocumentLengths(lengths=(8192,), weights=(1.0,), source="8192"))}


def real_vs_predicted() -> None:
    from autotune.backends.real import RealBackend

    specs = [TrialSpec(model=resolve_model(family), cluster=Cluster(num_gpus=2), seq_len=64, packing=SHORT,
                       train=TrainConfig(micro_batch_size=mb, activation_checkpointing=ac))
             for family in ("tiny-llama", "tiny-qwen2") for mb, ac in ((1, "none"), (2, "full"), (4, "none"))]
    with SimBackend(device_kind="cpu") as sim:
        predicted = [sim.evaluate(spec) for spec in specs]
    with RealBackend(device="cpu", persistent=True, warmup_steps=1, timed_steps=1) as real:
        measured = real.evaluate_many(specs)
    print("## Packed micro-batches: predicted vs measured tensor peak (2 gloo ranks, seq_len 64)\n")
    print("| model | budget | ac | documents | measured | predicted | error |\n|---|---|---|---|---|---|---|")
    for spec, p, m in zip(specs, predicted, measured):
        real_peak, sim_peak = m.extras["tensor_peak_bytes"], p.extras["tensor_peak_bytes"]
        print(f"| {spec.model.name} | {spec.token_budget} | {spec.train.activation_checkpointing} | "
              f"{len(spec.documents)} | {real_peak:,} | {sim_peak:,} | {sim_peak / real_peak - 1:+.4%} |")


def splits() -> None:
    model, cluster = resolve_model("llama3-8b"), Cluster(num_gpus=8, gpu=GPUS["h100-80gb"])
    print("\n## The split of a filled row: predicted peak by length distribution (llama3-8b, 8 x h100-80gb, "
          "seq 8,192, full checkpointing)\n")
    print("| budget | distribution | documents traced | predicted peak | fill (expected) | documents (expected) |"
          " attention work vs rows |\n|---|---|---|---|---|---|---|")
    with SimBackend() as sim:
        for rows in (1, 2, 3):
            for name, packing in DISTRIBUTIONS.items():
                spec = TrialSpec(model=model, cluster=cluster, seq_len=8192, packing=packing, grad_accum_steps=4,
                                 train=TrainConfig(micro_batch_size=rows, activation_checkpointing="full"))
                result = sim.evaluate(spec)
                stats = packing.stats(spec.token_budget, 8192)
                print(f"| {spec.token_budget:,} | {name} | {len(spec.documents)} | {format_bytes(result.peak_bytes)} | "
                      f"{stats.fill:.1%} | {stats.documents:.1f} | {stats.squares / (rows * 8192 ** 2):.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-real", action="store_true", help="skip the real gloo trials")
    args = parser.parse_args()
    if not args.no_real:
        real_vs_predicted()
    splits()
