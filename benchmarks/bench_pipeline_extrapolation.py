"""Depth extrapolation of a pipeline rank against its whole trace (backends/sim/_pipeline.py): every traced rank
of each row traced whole and extrapolated from two shallow copies of its stages, the tensor peaks and their
categories compared to the byte, with the seconds each took.

    python benchmarks/bench_pipeline_extrapolation.py        # the 9 rows: several minutes on a 2-core VM

tests/test_pipeline_parallel.py runs one of the rows (SUITE_ROWS there) with the same `compare`.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.problem.config import Cluster, TrainConfig, TrialSpec  # noqa: E402

# (family, blocks, pp, schedule, checkpointing, gloo, seq, vocabulary: None = the shrunk config's): the layouts
# split_stages gives these (blocks per stage) put every rank's stages deep enough to extrapolate, but for a few stages
# of 3-4 blocks that keep their full count in both shallow copies (20 blocks on 4 stages: 3, 6, 6, 5; 38 on 8: 4, 5,
# 5, 5, 5, 5, 5, 4). The last row is llama3.1-8b's vocabulary and a 16k sequence on stages of 16 blocks: the last
# stage's logits (4 GiB in bf16) live through the ops the step's end runs per parameter, the run of ops whose length
# grows with the depth (_extrapolate._from_both_ends; matched from its start only, rank 1 extrapolated to 54.8 GB
# against its whole trace's 29.6 GB).
ROWS = [
    ("llama", 12, 2, "1F1B", "none", True, 32, None),
    ("qwen2", 12, 2, "1F1B", "full", False, 32, None),
    ("llama", 20, 2, "Interleaved1F1B", "none", False, 32, None),
    ("qwen2", 20, 2, "Interleaved1F1B", "full", True, 32, None),
    ("llama", 22, 4, "1F1B", "none", False, 32, None),
    ("qwen2", 22, 4, "1F1B", "full", True, 32, None),
    ("llama", 38, 4, "Interleaved1F1B", "none", True, 32, None),
    ("qwen2", 38, 4, "Interleaved1F1B", "full", False, 32, None),
    ("llama", 32, 2, "1F1B", "full", False, 16384, 128256),
]


def compare(row: tuple, folder: Path) -> list[tuple[int, dict, dict]]:
    """(rank, extrapolated, whole) for every rank the simulator traces of `row`, on a shrunk model saved in `folder`."""
    from autotune.backends.sim._pipeline import (ranks_to_trace, shallow_layouts, trace_pipeline_rank,
                                                 trace_pipeline_rank_extrapolated)
    from autotune.backends.sim._trace import period_of
    from autotune.problem.catalog.models import resolve_model
    from autotune.problem.catalog.shrink import shrunk_config

    family, blocks, pp, schedule, ac, gloo, seq, vocabulary = row
    config = shrunk_config(family, num_layers=blocks)
    if vocabulary:
        config.vocab_size = vocabulary
    config.max_position_embeddings = max(seq, config.max_position_embeddings)
    config.save_pretrained(folder / family)
    spec = TrialSpec(model=resolve_model(str(folder / family)), cluster=Cluster(num_gpus=pp), seq_len=seq,
                     train=TrainConfig(pipeline_parallel=pp, pipeline_schedule=schedule, micro_batch_size=1,
                                       activation_checkpointing=ac), grad_accum_steps=4)
    period = period_of(spec.train, spec.model)
    out = []
    for rank in ranks_to_trace(blocks, pp, schedule):
        assert shallow_layouts(blocks, pp, schedule, rank, period) is not None
        extrapolated = trace_pipeline_rank_extrapolated(spec, rank, gloo=gloo, period=period, only_if_cheaper=False)
        whole = trace_pipeline_rank(spec, rank, gloo=gloo)
        out.append((rank, extrapolated, whole))
    return out


def main() -> None:
    print("| family | blocks | pp | schedule | checkpointing | trace | seq | vocabulary | ranks | peaks equal | "
          "categories equal | s |")
    print("|---|---:|---:|---|---|---|---:|---|---:|---|---|---:|")
    failed = 0
    for row in ROWS:
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder:
            ranks = compare(row, Path(folder))
        peaks = all(e["tensor_peak_bytes"] == w["tensor_peak_bytes"] for _, e, w in ranks)
        categories = all(e["categories"] == w["categories"] for _, e, w in ranks)
        failed += not (peaks and categories)
        family, blocks, pp, schedule, ac, gloo, seq, vocabulary = row
        print(f"| {family} | {blocks} | {pp} | {schedule} | {ac} | {'cpu (gloo)' if gloo else 'gpu'} | {seq} | "
              f"{vocabulary or 'shrunk'} | {len(ranks)} "
              f"| {'yes' if peaks else 'NO'} | {'yes' if categories else 'NO'} | {time.perf_counter() - started:.0f} |")
    print(f"\n{len(ROWS) - failed} of {len(ROWS)} rows exact to the byte")


if __name__ == "__main__":
    main()
