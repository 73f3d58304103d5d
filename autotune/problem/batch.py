"""Global batch arithmetic: hit the target global tokens exactly, whatever the micro-batch.

global tokens = micro_batch x GPUs x grad_accum x seq_len. Unlike DeepSpeed's autotuner, the
global batch never drifts with the micro-batch: the accumulation steps absorb it.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.util.errors import UsageError

DEFAULT_TOLERANCE = 0.01


@dataclass(frozen=True)
class GlobalBatch:
    micro_batch_size: int
    grad_accum_steps: int
    global_tokens: int
    target_tokens: int
    spread_tokens: float = 0.0
    """Token-budget batches (autotune/problem/packing.py): the standard deviation of a step's tokens around
    global_tokens, their expectation; 0 for rows of whole sequences, whose count is exact."""

    @property
    def deviation(self) -> float:
        """Relative deviation of the achieved global tokens from the target."""
        return (self.global_tokens - self.target_tokens) / self.target_tokens


def data_ranks_text(gpus: int, tensor_parallel: int = 1, context_parallel: int = 1, pipeline_parallel: int = 1) -> str:
    """Who takes a batch each, in words: the GPUs, or their tensor-, context-parallel groups or pipelines (one batch a group)."""
    splits = [f"{name} parallel {n}" for name, n in (("tensor", tensor_parallel), ("context", context_parallel),
                                                     ("pipeline", pipeline_parallel)) if n > 1]
    if not splits:
        return f"{gpus} GPUs"
    return f"{gpus // (tensor_parallel * context_parallel * pipeline_parallel)} data ranks ({gpus} GPUs / {' x '.join(splits)})"


MAX_GRAD_ACCUM_STEPS = 100_000
"""More accumulation steps than this per optimizer step is a typo, not a training run."""


def check_target(*, target_tokens: int, num_gpus: int, seq_len: int, ranks: str = "") -> None:
    """`num_gpus`: the ranks that each take a batch; `ranks` says who they are where they are not the GPUs."""
    ranks = ranks or data_ranks_text(num_gpus)
    smallest = num_gpus * seq_len
    if target_tokens > MAX_GRAD_ACCUM_STEPS * smallest:
        raise UsageError(
            f"--global-tokens {target_tokens:,} would take more than {MAX_GRAD_ACCUM_STEPS:,} accumulation steps "
            f"at micro-batch 1 ({ranks} x {seq_len} seq_len = {smallest:,} tokens each): check the value "
            "(4M = 4,000,000)")
    if target_tokens < smallest:
        raise UsageError(
            f"--global-tokens {target_tokens:,} is smaller than one sequence per GPU "
            f"({ranks} x {seq_len} seq_len = {smallest:,}): raise it or lower --seq-len"
        )


def plan_global_batch(*, target_tokens: int, num_gpus: int, seq_len: int, micro_batch_size: int,
                      packed: tuple[float, float] | None = None) -> GlobalBatch:
    """The accumulation steps (>= 1) whose global tokens come closest to the target (one micro-step may
    overshoot it: callers check a target reachable up front, check_target; a configuration past the batch
    wall then misses the tolerance). `packed`: token-budget batches' (expected tokens, their standard
    deviation) per micro-batch (packing.PackingStats): the target is hit in expectation."""
    per_micro_step = packed[0] if packed else micro_batch_size * seq_len
    per_step = per_micro_step * num_gpus
    low = max(1, int(target_tokens // per_step))
    candidates = {low, low + 1}
    best = min(candidates, key=lambda n: (abs(n * per_step - target_tokens), n))
    spread = packed[1] * (best * num_gpus) ** 0.5 if packed else 0.0
    return GlobalBatch(micro_batch_size, best, round(best * per_step), target_tokens, spread)


def check_reachable(*, target_tokens: int, num_gpus: int, seq_len: int, tolerance: float, ranks: str = "") -> None:
    """Refuse a target no micro-batch can reach within tolerance. Micro-batch 1 has the finest
    granularity (multiples of GPUs x seq_len), so if it misses, every micro-batch misses."""
    finest = plan_global_batch(target_tokens=target_tokens, num_gpus=num_gpus, seq_len=seq_len,
                               micro_batch_size=1)
    if not within_tolerance(finest, tolerance):
        unit = num_gpus * seq_len
        below, above = (target_tokens // unit) * unit, (target_tokens // unit + 1) * unit
        nearest = ", ".join(f"{t:,}" for t in (below, above) if t > 0)
        raise UsageError(
            f"--global-tokens {target_tokens:,} cannot be reached within {tolerance:.1%}: global batches "
            f"come in steps of {ranks or data_ranks_text(num_gpus)} x {seq_len} seq_len = {unit:,} tokens; use {nearest} or "
            f"raise --global-tolerance (closest now {finest.deviation:+.2%})"
        )


def within_tolerance(batch: GlobalBatch, tolerance: float = DEFAULT_TOLERANCE) -> bool:
    return abs(batch.deviation) <= tolerance + 1e-12
