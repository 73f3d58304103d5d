"""Global batch arithmetic: hit the target global tokens exactly, whatever the micro-batch.

global tokens = micro_batch x GPUs x grad_accum x seq_len. Unlike DeepSpeed's autotuner, the
global batch never drifts with the micro-batch: the accumulation steps absorb it.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.errors import UsageError

DEFAULT_TOLERANCE = 0.01


@dataclass(frozen=True)
class GlobalBatch:
    micro_batch_size: int
    grad_accum_steps: int
    global_tokens: int
    target_tokens: int

    @property
    def deviation(self) -> float:
        """Relative deviation of the achieved global tokens from the target."""
        return (self.global_tokens - self.target_tokens) / self.target_tokens

    def describe(self) -> str:
        return (f"{self.micro_batch_size} x GPUs x {self.grad_accum_steps} accum -> "
                f"{self.global_tokens:,} tokens ({self.deviation:+.2%} vs target {self.target_tokens:,})")


def check_target(*, target_tokens: int, num_gpus: int, seq_len: int) -> None:
    smallest = num_gpus * seq_len
    if target_tokens < smallest:
        raise UsageError(
            f"--global-tokens {target_tokens:,} is smaller than one sequence per GPU "
            f"({num_gpus} GPUs x {seq_len} seq_len = {smallest:,}): raise it or lower --seq-len"
        )


def plan_global_batch(*, target_tokens: int, num_gpus: int, seq_len: int, micro_batch_size: int) -> GlobalBatch:
    """The accumulation steps (>= 1) whose global tokens come closest to the target."""
    check_target(target_tokens=target_tokens, num_gpus=num_gpus, seq_len=seq_len)
    per_step = micro_batch_size * num_gpus * seq_len
    low = max(1, target_tokens // per_step)
    candidates = {low, low + 1}
    best = min(candidates, key=lambda n: (abs(n * per_step - target_tokens), n))
    return GlobalBatch(micro_batch_size, best, best * per_step, target_tokens)


def within_tolerance(batch: GlobalBatch, tolerance: float = DEFAULT_TOLERANCE) -> bool:
    return abs(batch.deviation) <= tolerance + 1e-12


def exact_micro_batches(*, target_tokens: int, num_gpus: int, seq_len: int, limit: int) -> list[int]:
    """Micro-batch sizes up to `limit` that divide the global batch exactly (deviation 0)."""
    if target_tokens % (num_gpus * seq_len):
        return []
    sequences_per_gpu = target_tokens // (num_gpus * seq_len)
    return [m for m in range(1, limit + 1) if sequences_per_gpu % m == 0]
