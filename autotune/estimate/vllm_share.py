"""GRPO's vLLM share (`--workload grpo`): what colocated vLLM needs of each GPU, estimated, and the
share a tune gives it when the user does not fix `--vllm-gpu-memory-utilization`.

What TRL 1.16 asks of vLLM in colocate mode (trl/generation/vllm_generation.py, VLLMGeneration with
the arguments GRPOTrainer.__init__ passes): one `LLM` per training process, tensor-parallel 1 (the
whole model on every GPU), `max_num_seqs = per_device_train_batch_size x steps_per_generation`
(steps_per_generation defaults to the accumulation steps: the per-GPU share of the global batch,
generated at once every optimizer step), `max_num_batched_tokens=4096`, and `max_model_len` =
vllm_max_model_length, which the trl export sets to seq_len (prompt + completion).

vLLM's own accounting (vllm/utils/mem_utils.py, MemoryProfilingResult): the share is weights +
the profile run's torch peak + non-torch memory, and the rest becomes KV cache; vLLM refuses to
start when the KV cache cannot hold one max_model_len sequence. Every figure here is estimated:
vLLM measures its profile at start-up, autotune does not run vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.problem.batch import plan_global_batch, within_tolerance
from autotune.problem.catalog.models import ModelSpec
from autotune.problem.config import Workload
from autotune.util.errors import UsageError
from autotune.util.units import format_bytes

SHARE_STEP = 0.05
"""The grid a tune chooses vLLM's share on: 0.05, 0.10, ... 0.95 of each GPU."""
SHARE_GRID: tuple[float, ...] = tuple(round(SHARE_STEP * i, 2) for i in range(1, 20))
VLLM_DTYPE_BYTES = 2
"""vLLM loads the weights and keeps the KV cache in the model's bf16 (kv_cache_dtype "auto")."""
TRL_MAX_NUM_BATCHED_TOKENS = 4096
"""trl 1.16 pins LLM(max_num_batched_tokens=4096) (vllm_generation.py): the profile run's token count."""
RUNTIME_ALLOWANCE_BYTES = 1 << 30
"""CUDA graphs and non-torch memory: an allowance, not derived (vLLM measures both at start-up;
its logs put CUDA-graph capture at a few hundred MiB to about 1 GiB for 7-8B models). The CUDA
context is the training process's own (colocate mode runs vLLM inside it)."""


@dataclass(frozen=True)
class VllmNeed:
    """vLLM's estimated memory on each GPU for one GRPO configuration (bytes)."""

    weights_bytes: int
    kv_bytes_per_token: int
    tokens_per_sequence: int
    sequences: int
    activation_bytes: int
    allowance_bytes: int = RUNTIME_ALLOWANCE_BYTES

    @property
    def fixed_bytes(self) -> int:
        return self.weights_bytes + self.activation_bytes + self.allowance_bytes

    @property
    def sequence_kv_bytes(self) -> int:
        return self.kv_bytes_per_token * self.tokens_per_sequence

    @property
    def kv_bytes(self) -> int:
        """The KV cache for every sequence of the generation batch at full length at once."""
        return self.sequence_kv_bytes * self.sequences

    @property
    def total_bytes(self) -> int:
        return self.fixed_bytes + self.kv_bytes

    @property
    def minimum_bytes(self) -> int:
        """Below this vLLM does not start: its KV cache must hold one max_model_len sequence."""
        return self.fixed_bytes + self.sequence_kv_bytes

    def concurrent(self, share_bytes: int) -> int:
        """Sequences whose full-length KV fits in `share_bytes` (the rest wait for a slot)."""
        return max(0, min(self.sequences, (share_bytes - self.fixed_bytes) // self.sequence_kv_bytes))

    def describe(self) -> str:
        return (f"bf16 weights {format_bytes(self.weights_bytes)} + KV cache {format_bytes(self.kv_bytes)} "
                f"({self.sequences} sequences x {self.tokens_per_sequence} tokens x "
                f"{format_bytes(self.kv_bytes_per_token)} a token) + profile-run activations "
                f"{format_bytes(self.activation_bytes)} + CUDA graphs and non-torch memory "
                f"{format_bytes(self.allowance_bytes)} = {format_bytes(self.total_bytes)} (estimated)")

    def to_dict(self) -> dict[str, Any]:
        return {"source": "estimated", "weights_bytes": self.weights_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token, "tokens_per_sequence": self.tokens_per_sequence,
                "sequences": self.sequences, "kv_bytes": self.kv_bytes, "activation_bytes": self.activation_bytes,
                "allowance_bytes": self.allowance_bytes, "total_bytes": self.total_bytes,
                "minimum_bytes": self.minimum_bytes}


def kv_bytes_per_token(model: ModelSpec) -> int:
    """K and V for every layer in bf16: 2 x layers x kv_heads x head_dim x 2 bytes (vLLM's full-attention
    page size per token; sliding-window layers would need less, so it is an upper bound there)."""
    return 2 * model.num_layers * model.num_key_value_heads * model.head_dim * VLLM_DTYPE_BYTES


def generation_sequences(*, target_tokens: int, num_gpus: int, seq_len: int, max_micro_batch: int,
                         tolerance: float) -> int:
    """Sequences vLLM generates on each GPU at once: TRL's max_num_seqs, micro-batch x accumulation
    steps (the per-GPU global batch), the largest over the micro-batches whose global batch the tune
    accepts (within the tolerance)."""
    batches = [plan_global_batch(target_tokens=target_tokens, num_gpus=num_gpus, seq_len=seq_len, micro_batch_size=m)
               for m in range(1, max(1, max_micro_batch) + 1)]
    return max(b.global_tokens // (num_gpus * seq_len) for b in batches if within_tolerance(b, tolerance) or
               b.micro_batch_size == 1)


def vllm_need(model: ModelSpec, *, seq_len: int, sequences: int) -> VllmNeed:
    """vLLM's estimated memory on each GPU: the whole model in bf16 (tensor-parallel 1), the KV cache for
    `sequences` of `seq_len` tokens, the profile run's largest activations (TRL's 4096 tokens through
    the MLP: gate/up output and its activation, for MoE per routed expert, and a few hidden-sized
    buffers; fp32 logits and log-probabilities of `sequences` rows for the sampler) and an allowance."""
    tokens = TRL_MAX_NUM_BATCHED_TOKENS
    routed = max(1, model.experts_per_token)
    mlp = tokens * 3 * model.mlp_width * routed * VLLM_DTYPE_BYTES
    hidden = tokens * 4 * model.hidden_size * VLLM_DTYPE_BYTES
    sampler = sequences * model.vocab_size * 4 * 2
    return VllmNeed(weights_bytes=model.num_parameters * VLLM_DTYPE_BYTES, kv_bytes_per_token=kv_bytes_per_token(model),
                    tokens_per_sequence=seq_len, sequences=sequences, activation_bytes=mlp + hidden + sampler)


def check_completion(workload: Workload, seq_len: int, *, given: bool) -> tuple[Workload, str]:
    """The completion length against seq_len (prompt + completion): the user's must leave room for a
    prompt; TRL's default, where it leaves none (a short seq_len), becomes half of seq_len, said so."""
    import dataclasses

    completion = workload.max_completion_length
    if workload.kind != "grpo" or completion < seq_len:
        return workload, f"max completion {completion}"
    if given:
        raise UsageError(f"--max-completion-length {completion} leaves no room for the prompt in --seq-len {seq_len} "
                         "(prompt + completion, vLLM's max_model_len): lower it or raise --seq-len")
    half = max(1, seq_len // 2)
    return (dataclasses.replace(workload, max_completion_length=half),
            f"max completion {half} (TRL's {completion} leaves no prompt in seq_len {seq_len}: half of it)")


def _smallest(need_bytes: int, capacity_bytes: int) -> float | None:
    return next((s for s in SHARE_GRID if int(capacity_bytes * s) >= need_bytes), None)


def choose_share(workload: Workload, need: VllmNeed, capacity_bytes: int, *, fixed: bool,
                 completion: str = "", fixed_by: str = "--vllm-gpu-memory-utilization") -> tuple[Workload, dict]:
    """The share vLLM gets and why. A fixed (user's) share is kept if vLLM can start in it; otherwise
    the smallest share on SHARE_GRID that holds the whole need, the rest to training; if none does,
    the smallest that holds one full-length sequence (vLLM then queues the rest)."""
    import dataclasses

    minimum = _smallest(need.minimum_bytes, capacity_bytes)
    if fixed:
        share = workload.vllm_gpu_memory_utilization
        if int(capacity_bytes * share) < need.minimum_bytes:
            least = f"use at least {minimum:g}" if minimum else "no share below 1 holds it: add GPUs with more memory"
            raise UsageError(
                f"--vllm-gpu-memory-utilization {share:g} gives vLLM {format_bytes(capacity_bytes * share)} of each GPU; "
                f"it needs at least {format_bytes(need.minimum_bytes)} (estimated: bf16 weights "
                f"{format_bytes(need.weights_bytes)}, activations and CUDA graphs, one {need.tokens_per_sequence}-token "
                f"sequence's KV cache): {least}")
        why = f"fixed by {fixed_by}"
    else:
        share = _smallest(need.total_bytes, capacity_bytes)
        why = (f"the smallest share in steps of {SHARE_STEP:g} that holds vLLM's estimated need, the rest to training"
               if share else None)
        if share is None:
            share = minimum
            if share is None:
                raise UsageError(f"vLLM needs at least {format_bytes(need.minimum_bytes)} of each GPU (estimated: bf16 "
                                 f"weights {format_bytes(need.weights_bytes)}, tensor-parallel 1), more than 0.95 of "
                                 f"{format_bytes(capacity_bytes)}: use GPUs with more memory")
            why = (f"no share up to {SHARE_GRID[-1]:g} holds every sequence at once; the smallest that holds one "
                   "full-length sequence (vLLM's minimum)")
        workload = dataclasses.replace(workload, vllm_gpu_memory_utilization=share)
    held = need.concurrent(int(capacity_bytes * share))
    chosen_by = "autotune" if not fixed else "user" if fixed_by.startswith("--") else "fixed"
    record = {"chosen_by": chosen_by, "why": why, "grid_step": SHARE_STEP,
              "completion": completion or f"max completion {workload.max_completion_length}",
              "need": need.to_dict(), "concurrent_sequences": held,
              "not_modelled": "generation throughput (tokens/s counts the training step only)"}
    return workload, record


def share_note(workload: Workload, record: dict) -> str:
    """One line for the console and the decision path."""
    need = record["need"]
    held, sequences = record["concurrent_sequences"], need["sequences"]
    waits = ("" if held >= sequences else
             f"; vLLM holds {held} of the {sequences} sequences at once (estimated), the rest wait: slower generation, "
             "not modelled")
    chosen = "chosen by autotune: " if record["chosen_by"] == "autotune" else ""
    return (f"vLLM's share {workload.vllm_gpu_memory_utilization:g} ({chosen}{record['why']}); "
            f"vLLM needs {format_bytes(need['total_bytes'])} of each GPU (estimated: weights "
            f"{format_bytes(need['weights_bytes'])}, KV cache {format_bytes(need['kv_bytes'])} for {sequences} "
            f"sequences of {need['tokens_per_sequence']} tokens, {record['completion']}; "
            f"profile activations and CUDA graphs {format_bytes(need['activation_bytes'] + need['allowance_bytes'])})"
            f"{waits}")
