"""The analytic backend: closed-form FSDP2 memory and roofline throughput, every figure estimated.

Memory per rank is the largest of the moments where FSDP2 training peaks (docs/COSTMODEL.md):

* the loss backward: every block's saved activations plus the fp32 logits, their
  log-softmax and two fp32 gradients of them (12 bytes x tokens x vocab);
* the backward of decoder block i (each i): saved activations of blocks 0..i, the block's
  recomputed activations when it is checkpointed, its gathered parameters and gradient
  temporaries, the next block's prefetched all-gather, the previous block's fp32 reduce-scatter
  input and the sharded gradients reduced so far;
* the optimizer step: parameters, gradients and AdamW state, all sharded.

Op-level checkpointing keeps each block's input, the matmul outputs its policy saves and the
attention kernel's output; backward recomputes the rest, and only the unsaved matmuls cost FLOPs.

Per-layer activation bytes follow Korthikanti et al. 2022 ("Reducing Activation Recomputation
in Large Transformer Models", sbh(34 + 5as/h) for GPT), re-derived for the Hugging Face Llama
block as autograd saves it: fp32 RMSNorm inputs, SwiGLU's four ffn-wide tensors, grouped K/V,
and fused SDPA, which keeps no s x s matrix (only a per-head logsumexp).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from functools import lru_cache

from autotune.estimate import costmodel
from autotune.problem import knobs
from autotune.estimate.runtime_memory import async_tp_workspace_bytes, runtime_memory
from autotune.backends.base import MEMORY_CATEGORIES, Figure, TrialBackend, TrialResult
from autotune.problem.config import (MASTER_DTYPE_BYTES, MASTER_DTYPE_NAMES, PARAM_DTYPE_BYTES, TRL_STEPS, TrialSpec,
                             reduce_dtype_name)
from autotune.util.units import format_bytes
from autotune.problem.catalog.models import ModelSpec

SCREEN_MARGIN = 1.25
"""A configuration whose closed-form peak is over the memory limit by more than this factor cannot
fit: the closed form is within a few percent of traces (docs/COSTMODEL.md), so the simulator
and the sampler skip tracing it."""

__all__ = ["AnalyticBackend", "ModelShape", "model_shape", "MemoryEstimate", "estimate_memory",
           "activation_bytes_per_token", "step_work", "pipeline_parallel_work", "pipeline_ranks"]

COMPILED_PEAK_FLOOR = 0.7
"""The least a compiled configuration's peak is taken to be of the closed form's (eager) peak when
screening: the closed form does not know what the partitioner recomputes. Traced on the simulator
(docs/COMPILE.md): 0.79 (llama-7b, micro-batch 2, no checkpointing, 51.26 against 64.64 GiB) and
0.82 (llama3-8b, micro-batch 1, 67.80 against 82.80 GiB); with full checkpointing about 1.0."""


def screen_margin(compiled: bool) -> float:
    """How far over the memory limit a closed-form peak may be and still be traced."""
    return SCREEN_MARGIN / COMPILED_PEAK_FLOOR if compiled else SCREEN_MARGIN


PARAM_BYTES = PARAM_DTYPE_BYTES  # the compute dtype's, by precision


def master_bytes(precision: str) -> int:
    """Bytes per element of the sharded trained parameters, their gradients (reduce-scattered in
    this dtype: parallel.mixed_precision_policy) and each of AdamW's two states: fp32, or bf16
    in pure bf16."""
    return MASTER_DTYPE_BYTES[MASTER_DTYPE_NAMES[precision]]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The numbers the closed form needs, from a model config and one meta-built block."""

    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    kv_width: int
    """num_key_value_heads * head_dim."""
    vocab: int
    block_params: int
    root_params: int
    """Parameters outside the decoder blocks: embeddings, final norm, LM head (once if tied)."""

    @property
    def num_parameters(self) -> int:
        return self.root_params + self.num_layers * self.block_params


@lru_cache(maxsize=64)
def _shape_from_config(model_type: str, config_json: str, trust_remote_code: bool) -> ModelShape:
    """The shape as transformers completes the config (defaults included), counted once per
    machine and library version: a repeated plan reads it back without importing transformers."""
    from autotune.util import cache

    key = cache.key_of("model-shape", [model_type, config_json, trust_remote_code])
    cached = cache.load("model-shape", key)
    if cached is not None:
        return ModelShape(**cached)
    shape = _count_shape(model_type, config_json, trust_remote_code)
    cache.store("model-shape", key, asdict(shape))
    return shape


def _count_shape(model_type: str, config_json: str, trust_remote_code: bool) -> ModelShape:
    config = json.loads(config_json)
    spec = ModelSpec(name="shape", model_type=model_type, config_dict=config, default_seq_len=1,
                     source="", trust_remote_code=trust_remote_code)
    # Read through ModelSpec, where each number is defined once: from transformers' own accessors
    # or measured from the meta-built blocks (the MLP width), whatever the family names it.
    return ModelShape(hidden=spec.hidden_size, intermediate=spec.mlp_width, num_layers=spec.num_layers,
                      num_heads=spec.num_attention_heads, kv_width=spec.num_key_value_heads * spec.head_dim,
                      vocab=spec.vocab_size, block_params=spec.block_parameters, root_params=spec.root_parameters)


def model_shape(model: ModelSpec) -> ModelShape:
    """The model's shape; exact parameter counts from a 1-layer meta build, cached per config."""
    key = json.dumps(model.config_dict, sort_keys=True, default=str)
    return _shape_from_config(model.model_type, key, model.trust_remote_code)


def activation_bytes_per_token(shape: ModelShape, param_bytes: int) -> float:
    """Bytes one decoder block saves for backward per token (no checkpointing).

    Two RMSNorms: fp32 input + normalised + weighted output (4h + 2dh each); attention: rotated
    q, SDPA output and the o_proj input (3dh), rotated k and v (2d * kv width), fp32 logsumexp
    per head; SwiGLU MLP: gate, silu(gate), up and their product (4d * ffn). d is the compute
    dtype's size. Matches a fake-tensor trace of the transformers Llama block to 0.1%.
    """
    h, d = shape.hidden, param_bytes
    norms = 2 * (4 * h + 2 * d * h)
    attention = 3 * d * h + 2 * d * shape.kv_width + 4 * shape.num_heads
    mlp = 4 * d * shape.intermediate
    return norms + attention + mlp


ADAPTED_INPUT_OF = {"q_proj": "attention", "k_proj": "attention", "v_proj": "attention", "o_proj": "sdpa",
                    "gate_proj": "mlp", "up_proj": "mlp"}
"""Which input an adapted linear of the Llama-style block reads, where several read the same tensor
(q, k, v: the attention's normed input; gate, up: the MLP's); o_proj reads SDPA's output, which
attention saves anyway. Any other name is taken to read an input of its own."""


def lora_activation_bytes_per_token(shape: ModelShape, adapted: tuple[tuple[str, int], ...], *, rank: int,
                                    dropout: float, param_bytes: int) -> float:
    """Bytes one decoder block saves for backward per token (no checkpointing) with LoRA's frozen
    base: no weight gradient, so the base linears and norms keep no inputs of their own. Two
    RMSNorms keep their fp32 input and its reciprocal RMS (4h + 4 each); attention as in
    `activation_bytes_per_token` but the o_proj input (rotated q and SDPA's output, 2dh, rotated k
    and v, logsumexp); SwiGLU keeps gate, silu(gate) and up (3d * ffn). Each adapter (`adapted`:
    name, input width) keeps its rank-wide A output, and under dropout the dropout's mask and
    output (2d x width: the trace runs torch's CPU dropout, whose mask is in the input's dtype),
    else the input itself, once per tensor however many adapters read it (ADAPTED_INPUT_OF).
    Within 0.4% of traces of Llama 3 8B and Qwen2.5 7B (tests/test_analytic.py: tiny ones)."""
    h, d = shape.hidden, param_bytes
    base = 2 * (4 * h + 4) + 2 * d * h + 2 * d * shape.kv_width + 4 * shape.num_heads + 3 * d * shape.intermediate
    adapters = d * rank * len(adapted)
    if dropout:
        return base + adapters + 2 * d * sum(width for _, width in adapted)
    inputs = {ADAPTED_INPUT_OF.get(name, name): width for name, width in adapted}
    inputs.pop("sdpa", None)
    return base + adapters + d * sum(inputs.values())


def _op_checkpoint_matmuls(shape: ModelShape, policy: str) -> list[tuple[int, int, bool]]:
    """(input width, output width, saved) of a decoder block's matmuls in forward order: q, k, v, o,
    then the SwiGLU MLP's gate, up, down. Op-level checkpointing keeps every output (`mm`) or the
    1st, 3rd, 5th... (`alt-mm`, counting in this order: autotune/distributed/parallel.py, op_sac_policy)."""
    h, kv, ffn = shape.hidden, shape.kv_width, shape.intermediate
    widths = [(h, h), (h, kv), (h, kv), (h, h), (h, ffn), (h, ffn), (ffn, h)]
    return [(fan_in, out, policy == "mm" or i % 2 == 0) for i, (fan_in, out) in enumerate(widths)]


def op_checkpoint_saved_bytes_per_token(shape: ModelShape, policy: str, param_bytes: int) -> float:
    """Bytes an op-level checkpointed block keeps for backward per token besides its input: the
    matmul outputs its policy saves and the attention kernel's output and fp32 logsumexp."""
    kept = sum(out for _, out, saved in _op_checkpoint_matmuls(shape, policy) if saved)
    return param_bytes * (kept + shape.hidden) + 4 * shape.num_heads


def checkpointed_block_bytes(shape: ModelShape, ac: knobs.Checkpointing, param_bytes: int, tokens: float, tensor_parallel: int) -> float:
    """What a checkpointed block keeps for backward on one GPU: its input, and under op-level checkpointing the op
    outputs its policy saves; a tp-th of each under tensor parallelism (sequence parallel)."""
    kept = shape.hidden * param_bytes * tokens
    if ac.mode == "op":
        kept += op_checkpoint_saved_bytes_per_token(shape, ac.policy, param_bytes) * tokens
    return kept / tensor_parallel


def block_backward_temp_bytes(shape: ModelShape, param_bytes: int, tokens: float, *, largest_weight_grad: float,
                              scores_held: float, tensor_parallel: int) -> float:
    """A block's backward temporaries on one GPU: the gradients of its input and of two ffn-wide tensors, the
    unsharded gradient of its largest weight in flight (fitted to traces: docs/COSTMODEL.md) and eager attention's
    held scores; a tp-th of each under tensor parallelism (the input's by sequence, the rest by column)."""
    return (2 * param_bytes * (shape.hidden + shape.intermediate) * tokens + largest_weight_grad
            + scores_held) / tensor_parallel


def op_checkpoint_recompute_flops_per_token(shape: ModelShape, policy: str) -> float:
    """Forward FLOPs per token backward runs again in an op-level checkpointed block: the matmuls
    its policy did not save (attention's output is saved, so attention is not recomputed;
    elementwise ops are not counted, as elsewhere in the closed form)."""
    return sum(2 * fan_in * out for fan_in, out, saved in _op_checkpoint_matmuls(shape, policy) if not saved)


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Per-rank device bytes at the peak, by category, plus what the host must hold."""

    breakdown: dict[str, int]
    tensor_peak_bytes: int
    peak_bytes: int
    """Tensors plus runtime overhead."""
    host_bytes_per_node: int
    peak_at: str
    """Which moment of the step peaks: 'loss backward', 'backward of block i', 'optimizer step'."""
    offloaded_activation_bytes: int = 0
    """Activation offload: the saved activations one micro-batch moves to the host (each way)."""


TRL_TOKEN_TILE, TRL_VOCAB_TILE = 4096, 32768
"""TRL 1.16's fused LM head tiles (kernels/chunked_logprob.py TOKEN_CHUNK_SIZE; trainer/utils.py
_CHUNKED_LOGPROB_CHUNK_SIZE): the logits exist one tile at a time, in a buffer of the full tile width
whatever the vocabulary."""


LOSS_PARALLEL_BYTES_PER_LOGIT = 16
"""What torch's loss_parallel holds at the start of backward per logit of a GPU's vocabulary share: the fp32 logits,
the log-softmax, its gradient and, beyond the 12 bytes of the whole-vocabulary loss (loss_backward_bytes), the
shifted logits its log-softmax keeps (counted on the simulator's traces of llama3-8b at TP2 and TP4)."""


def loss_backward_bytes(step: str, *, tokens: int, vocab: int, hidden: int, d: int, head_trains: bool = True) -> float:
    """What the loss holds at the start of backward, beyond the blocks' activations.

    autotune's and Accelerate's step ('hf'): the fp32 logits' log-softmax and two fp32 gradients
    (12 bytes x tokens x vocab). Accelerate's fp32 copy of the outputs never reaches this moment: it
    is made at the end of forward, next to the bf16 logits and the log-softmax (10 bytes a logit,
    as the loss itself holds while it runs), and dropped before backward (docs/STACKS.md).
    TRL SFT's fused head ('trl'): no full logits; its backward holds fp32 gradients of the head
    weight and of the hidden states with their bf16 casts (6 bytes each), one logits tile, and the
    hidden states it saved (no head-weight gradient where the head is frozen: LoRA).
    torchtitan's chunked loss ('torchtitan', autotune/distributed/titan.py): the head's last chunk, when its gradient
    is reduce-scattered: one chunk's logits as autotune's loss holds them (12 bytes a logit), the head's
    gradient accumulated in fp32 and its fp32 reduce-scatter input, and the fp32 gradient of the hidden
    states the loss accumulates (an estimate of the traced moment, not fitted).
    LitGPT's chunked_cross_entropy ('litgpt', autotune/distributed/litgpt_step.py): the logits in the compute dtype and
    every chunk's log-softmax saved in it, at the end of the loss's forward (2 x d bytes a logit; the
    traced peak's moment, docs/STACKS.md)."""
    if step == "litgpt":
        return 2 * d * tokens * vocab
    if step == "torchtitan":
        from autotune.distributed.titan import NUM_LOSS_CHUNKS

        return 12 * tokens / NUM_LOSS_CHUNKS * vocab + 8 * vocab * hidden + 4 * tokens * hidden
    if step not in TRL_STEPS:
        return 12 * tokens * vocab
    tile = min(tokens, TRL_TOKEN_TILE) * TRL_VOCAB_TILE * d  # allocated at the tile's full width
    return 6 * vocab * hidden * head_trains + (6 + d) * tokens * hidden + tile


def attention_span(spec: TrialSpec) -> int:
    """The keys each query's attention runs over, as SDPA computes it: the sequence, or a padding-free
    micro-batch's every token ('trl-padding-free': one row under a block-diagonal mask, which SDPA
    computes densely; the trace counts the same FLOPs); a token-budget row's documents each attend within
    themselves (autotune/problem/packing.py): their token-weighted mean length, the expected sum of squared lengths
    over the tokens."""
    if spec.packing is not None:
        stats = spec.packing.stats(spec.token_budget, spec.seq_len)
        return max(1, round(stats.squares / max(stats.tokens, 1.0)))
    return spec.train.micro_batch_size * spec.seq_len if spec.step == "trl-padding-free" else spec.seq_len


def packed_mask_bytes(step: str, *, tokens: int, d: int) -> tuple[float, float]:
    """A padding-free micro-batch of `tokens` under SDPA ('trl-padding-free'): (the bool block-diagonal
    mask transformers builds once per forward from position_ids, tokens squared bytes; the mask in the
    compute dtype that SDPA converts it to in every attention call, saved for backward by each block
    that keeps its activations). (0, 0) for batches of rows of one sequence each (is_causal, no mask)."""
    if step != "trl-padding-free":
        return 0.0, 0.0
    return float(tokens * tokens), float(d * tokens * tokens)


def runs_eager_attention(spec: TrialSpec) -> bool:
    """Whether the trial runs transformers' eager attention: stated or the model's default, unless context
    parallelism's ring or packed rows switch the model to SDPA (parallel/context.py, training.varlen_attention)."""
    return (spec.model.attention_implementation == "eager" and spec.train.context_parallel == 1
            and spec.packing is None)


def eager_score_memory(spec: TrialSpec, *, tokens: int, d: int) -> tuple[float, float, float]:
    """Transformers' eager attention (--attention eager, or a model's default without SDPA) on `tokens` tokens
    of this rank attending over the sequence: (what each block that keeps its activations saves for backward of
    the seq x seq scores: the fp32 softmax output and its compute-dtype cast, and under attention dropout the
    mask and the dropped copy, both in the compute dtype as the CPU's dropout makes them; the fp32 gradient of
    the softmax a block's backward holds beside them; the additive causal mask built once per forward in the
    compute dtype). (0, 0, 0) for the fused kernels, which keep no scores. From llama-7b's traces at seq 2048
    (docs/KNOBS.md): 6.0 bytes per score saved, 4.2 held in backward, at bf16."""
    if not runs_eager_attention(spec):
        return 0.0, 0.0, 0.0
    scores = float(tokens) * spec.seq_len * model_shape(spec.model).num_heads
    dropout = knobs.attention_dropout(spec.model.config_dict) > 0
    saved = scores * ((4 + d) + (2 * d if dropout else 0))
    return saved, scores * 4, float(tokens) * spec.seq_len * d


def estimate_memory(spec: TrialSpec) -> MemoryEstimate:
    """Closed-form per-rank memory of one FSDP2 training step (see the module docstring); under pipeline
    parallelism the worst stage's (estimate_pipeline_memory)."""
    if spec.train.pipeline_parallel > 1:
        return estimate_pipeline_memory(spec)
    shape = model_shape(spec.model)
    # Parameters are sharded over the shard group: every GPU, or an HSDP group.
    train, world = spec.train, spec.train.shard_group_size or spec.cluster.num_gpus
    d = PARAM_BYTES[train.precision]
    cp = train.context_parallel  # each GPU of a context-parallel group holds a cp-th of every sequence
    master = master_bytes(train.precision)
    # Gradients are reduce-scattered in the master dtype, or in the compute dtype under Accelerate's policy.
    reduce = MASTER_DTYPE_BYTES[reduce_dtype_name(train.precision, spec.step)]
    tokens = train.micro_batch_size * spec.seq_len // cp
    num_layers, block = shape.num_layers, shape.block_params
    total = shape.num_parameters
    # What trains: every parameter, or LoRA's adapters on a frozen base stored in the compute dtype.
    trained, block_trained, frozen = total, block, 0
    lora = spec.finetuning.lora
    # QLoRA: the frozen base's storage as built (packed 4-bit codes), gathered per block, and its
    # quantization statistics on every rank; both counted on a meta build by bnb's own quantizer.
    frozen_bytes = block_gathered = quant_states = dequantized = 0.0
    if lora:
        from autotune.distributed.training import parameter_counts

        counts = parameter_counts(spec.model, spec.finetuning)
        trained, block_trained, frozen = counts.trainable, counts.block_trainable, counts.total - counts.trainable
        block = counts.block_total
        if spec.finetuning.qlora:
            frozen_bytes = counts.root_frozen_bytes + counts.blocks_frozen_bytes
            block_gathered = counts.block_frozen_bytes + block_trained * d
            quant_states = counts.blocks_quant_state_bytes
            # backward dequantizes each 4-bit weight to the compute dtype: the block's largest at once
            dequantized = d * shape.hidden * shape.intermediate
    frozen_bytes = frozen_bytes or d * frozen
    block_gathered = block_gathered or gathered_block_params(spec, block) * d  # expert parallel: 1/ep of the experts

    # Model states (sharded): on the host instead when offloading. Under tensor parallelism the blocks are split over
    # the tp GPUs of a group and the root (embeddings, head) left whole on each (tensor.apply_tp), so FSDP shards each
    # root parameter over the data ranks only: the world holds tp copies of it.
    # Loss parallelism splits the head by vocabulary over the tp GPUs: only the embeddings (and norm) stay whole.
    _, head_params = _root_split(shape)
    whole_root = shape.root_params - (head_params if train.loss_parallel else 0)
    held = trained + (whole_root * (train.tensor_parallel - 1) if not lora else 0)
    states_on_device = 0 if train.cpu_offload else 1
    sharded_params = states_on_device * (master * held + frozen_bytes) / world + quant_states
    optimizer = states_on_device * 2 * master * held / world
    accumulated_grads = states_on_device * master * held / world if spec.grad_accum_steps > 1 else 0.0
    block_grad_shard = states_on_device * master * block_trained / world
    # Offloaded shards are copied to the device before each all-gather.
    h2d_staging = (1 - states_on_device) * master * block / world

    # The root is never resharded after forward; under loss parallelism each GPU gathers its vocabulary share of the
    # head, and computes that share of the logits.
    vocab_share = 1 / train.tensor_parallel if train.loss_parallel else 1
    root_gathered = (whole_root + (shape.root_params - whole_root) * vocab_share) * d
    # LM head (or tied embedding) gradient, unsharded; none when it is frozen (LoRA).
    head_grad = 0 if lora else shape.vocab * shape.hidden * d * vocab_share
    shared_mask, layer_mask = packed_mask_bytes(spec.step, tokens=tokens, d=d)
    if lora:
        per_token = lora_activation_bytes_per_token(shape, counts.adapted_inputs, rank=spec.finetuning.rank,
                                                    dropout=spec.finetuning.dropout, param_bytes=d)
    else:
        per_token = activation_bytes_per_token(shape, d)
    scores_saved, scores_held, causal_mask = eager_score_memory(spec, tokens=tokens, d=d)
    per_layer = per_token * tokens + layer_mask + scores_saved
    if train.tensor_parallel > 1:
        # Tensor parallelism (with sequence parallelism): a lower bound, each block's gathered weights and
        # activations as if all of them split (attention's and the MLP's gathered inputs are whole): it
        # screens out no configuration the trace would fit. The blocks' parameters, gradients and optimizer
        # state stay sharded over every GPU (dp x tp), the root's over the data ranks (below).
        block_gathered /= train.tensor_parallel
        per_layer /= train.tensor_parallel
    checkpoint_input = checkpointed_block_bytes(shape, train.activation_checkpointing, d, tokens, train.tensor_parallel)
    saved = [checkpoint_input if train.activation_checkpointing.wraps_block(i) else per_layer
             for i in range(num_layers)]
    # The final norm's fp32 input, and its output for the head's weight gradient unless the head is frozen (LoRA).
    final_norm = (4 * shape.hidden + (0 if lora else 2 * d * shape.hidden)) * tokens
    logits = (LOSS_PARALLEL_BYTES_PER_LOGIT * tokens * shape.vocab * vocab_share if train.loss_parallel else
              loss_backward_bytes(spec.step, tokens=tokens, vocab=shape.vocab, hidden=shape.hidden, d=d,
                                  head_trains=not lora))
    backward_temps = block_backward_temp_bytes(
        shape, d, tokens, largest_weight_grad=dequantized if lora else d * shape.hidden * shape.intermediate,
        scores_held=scores_held, tensor_parallel=train.tensor_parallel)
    inputs = 16 * tokens + shared_mask + causal_mask  # int64 input ids and labels (and a batch's mask)

    # Activation offload: what forward saves waits on the host; backward brings back one block's at
    # a time (and the loss's). The held bytes are the saved activations of every block and the norm.
    offloaded_host = 0.0
    if train.activation_offload:
        offloaded_host = sum(saved) + final_norm
        on_device = [0.0] * num_layers
        final_norm_on_device = 0.0
    else:
        on_device, final_norm_on_device = saved, final_norm
    candidates: list[tuple[str, dict[str, float]]] = []
    # Resharded to groups of g GPUs after forward: each block keeps 1/g of its gathered parameters.
    kept_share = 1 / train.reshard_group_size if train.reshard_group_size else 0.0
    if train.reshard_after_forward:
        kept_blocks, prefetch = num_layers * block_gathered * kept_share, block_gathered
    else:
        kept_blocks, prefetch = num_layers * block_gathered, 0.0
    candidates.append(("loss backward", dict(
        parameters=sharded_params + root_gathered + kept_blocks,
        gradients=accumulated_grads,
        optimizer_state=optimizer,
        activations=sum(on_device) + final_norm_on_device + logits,
        communication_buffers=prefetch,
        other=inputs + h2d_staging,
    )))
    for i in reversed(range(num_layers)):
        done = num_layers - 1 - i
        gathered = block_gathered * (1 + i * kept_share if train.reshard_after_forward else i + 1)
        # Recomputing a checkpointed block rebuilds what it did not keep (all of it unless op-level).
        recompute = per_layer + checkpoint_input - saved[i] if train.activation_checkpointing.wraps_block(i) else 0.0
        candidates.append((f"backward of block {i}", dict(
            parameters=sharded_params + root_gathered + gathered,
            gradients=max(accumulated_grads, done * block_grad_shard) + head_grad,
            optimizer_state=optimizer,
            activations=sum(on_device[:i]) + saved[i] + recompute + backward_temps,
            communication_buffers=(prefetch if i > 0 else 0.0) + (block_trained * reduce if done else 0.0),
            other=inputs + h2d_staging,
        )))
    candidates.append(("optimizer step", dict(
        parameters=sharded_params, gradients=states_on_device * master * held / world,
        optimizer_state=optimizer, other=2 * master * block_trained / world,
    )))

    peak_at, parts = max(candidates, key=lambda item: sum(item[1].values()))
    breakdown = dict.fromkeys(MEMORY_CATEGORIES, 0) | {name: int(value) for name, value in parts.items()}
    tensor_peak = sum(breakdown.values())
    # No fragmentation term (no largest allocation or root shard passed, unlike the pipeline form and the simulator):
    # passing them put five published runs that trained over the limit (tests/test_costmodel.py).
    breakdown["runtime_overhead"] = runtime_memory(
        spec.cluster.gpu, world_size=spec.cluster.num_gpus, gpus_per_node=spec.cluster.gpus_per_node,
        tensor_peak_bytes=tensor_peak, symmetric_memory_bytes=symmetric_memory_bytes(spec)).total_bytes

    per_rank_host = costmodel.HOST_PROCESS_BYTES
    if train.cpu_offload:
        per_rank_host += (4 * master * held + frozen_bytes) / world
    per_rank_host += offloaded_host
    return MemoryEstimate(breakdown=breakdown, tensor_peak_bytes=tensor_peak,
                          peak_bytes=sum(breakdown.values()),
                          host_bytes_per_node=int(per_rank_host * spec.cluster.gpus_per_node),
                          peak_at=peak_at, offloaded_activation_bytes=int(offloaded_host))


@dataclass(frozen=True, kw_only=True)
class PipelineRank:
    """One pipeline rank's share of the model: its stages' decoder blocks (global indices, stage by stage), whether
    it holds the embeddings (the first stage) and the final norm, head and loss (the last stage)."""

    rank: int
    blocks: tuple[tuple[int, ...], ...]
    first: bool
    last: bool

    @property
    def num_blocks(self) -> int:
        return sum(len(stage) for stage in self.blocks)

    @property
    def block_indices(self) -> tuple[int, ...]:
        return tuple(i for stage in self.blocks for i in stage)


def pipeline_virtual_stages(spec: TrialSpec) -> int:
    """Stages each pipeline rank holds under the spec's schedule (knobs.PIPELINE_VIRTUAL_STAGES)."""
    from autotune.problem import knobs

    return knobs.PIPELINE_VIRTUAL_STAGES[spec.train.pipeline_schedule]


def pipeline_ranks(num_layers: int, pp: int, virtual_stages: int = 1) -> list[PipelineRank]:
    """The pipeline's ranks as the stages are laid out: pp x v contiguous stages of decoder blocks
    (costmodel.pipeline_stage_layers), stage s on rank s mod pp (torch's interleaved layout, Narayanan et al.'s),
    the embeddings on stage 0 (rank 0), norm, head and loss on the last stage (rank pp - 1)."""
    layers = costmodel.pipeline_stage_layers(num_layers, pp * virtual_stages)
    starts = [sum(layers[:i]) for i in range(len(layers))]
    stages = [tuple(range(start, start + n)) for start, n in zip(starts, layers)]
    return [PipelineRank(rank=r, blocks=tuple(stages[r + k * pp] for k in range(virtual_stages)), first=r == 0,
                         last=r == pp - 1) for r in range(pp)]


def _root_split(shape: ModelShape) -> tuple[int, int]:
    """(embedding parameters, final norm + head parameters) of the root: the head is its own V x h unless tied
    (then the last stage holds a copy: torch's pipelining cannot share one tensor between stages)."""
    embed = shape.vocab * shape.hidden
    return embed, max(shape.root_params - embed, shape.vocab * shape.hidden)


def _rank_flops_per_token(spec: TrialSpec, rank: PipelineRank, span: int) -> float:
    """Executed FLOPs per token (recompute included, before the tp x cp split) of one pipeline rank: its blocks'
    6 P_b + 12 h s each, a checkpointed block's forward again (2 P_b + 4 h s; op-level: its unsaved matmuls), the
    head's 6 V h on the last stage; the embedding lookup computes nothing."""
    shape = model_shape(spec.model)
    ac = spec.train.activation_checkpointing
    per_block = 6 * shape.block_params + 12 * shape.hidden * span
    recompute = (op_checkpoint_recompute_flops_per_token(shape, ac.policy) if ac.mode == "op"
                 else 2 * shape.block_params + 4 * shape.hidden * span)
    checkpointed = sum(ac.wraps_block(i) for i in rank.block_indices)
    return rank.num_blocks * per_block + checkpointed * recompute + (6 * shape.vocab * shape.hidden if rank.last else 0)


def pipeline_costed_rank(spec: TrialSpec, virtual_stages: int | None = None) -> PipelineRank:
    """The pipeline rank whose work sets the pace: the most FLOPs per token (ties: the later rank, which holds the
    head); every rank waits for it once the pipeline is full."""
    v = pipeline_virtual_stages(spec) if virtual_stages is None else virtual_stages
    span = attention_span(spec)
    return max(reversed(_pipeline_layout(spec, virtual_stages)), key=lambda r: _rank_flops_per_token(spec, r, span))


def pipeline_float8_counts(spec: TrialSpec, virtual_stages: int | None = None) -> tuple[float, float]:
    """(converted matmul FLOPs, cast elements) of the slowest pipeline rank's step (pipeline_costed_rank) with
    float8 linears, counted in closed form as the simulator's trace counts them without a pipeline
    (`float8_matmul_flops`, `float8_cast_elements`; the pipeline's traces count memory, not ops): every linear of
    its blocks (q, k, v, o, gate, up, down) runs its forward, input-gradient and weight-gradient GEMMs in float8 (6
    FLOPs per weight per token, 2 more for a checkpointed block's recompute), and each GEMM casts its two operands:
    the input twice and the output gradient twice (T x width each), the weight three times with the recompute;
    column-wise linears of a tensor-parallel GPU keep the whole input and a tp-th of the output, row-wise ones the
    reverse. Under tensor parallelism with tensorwise float8 the column-wise linears' inputs (attention's, the
    MLP's) and the row-wise ones' output gradients arrive by float8 all-gathers: cast once each on the sequence
    shard (T / tp x hidden: two a forward pass, with the recompute's, and two in backward), and read by the matmuls
    without a cast of their own (rowwise float8 gathers in high precision: each matmul casts its own). An estimate
    of what a trace would count, not checked against one at this size (the trace's own count is checked on
    micro-llama TP2: tests/test_float8.py)."""
    shape, train = model_shape(spec.model), spec.train
    rank = pipeline_costed_rank(spec, virtual_stages)
    tp, cp = train.tensor_parallel, train.context_parallel
    h = shape.hidden
    linears = _float8_linears(shape)
    tokens = train.micro_batch_size * spec.seq_len // cp
    checkpointed = sum(train.activation_checkpointing.wraps_block(i) for i in rank.block_indices)
    weights = sum(i * o for i, o, _ in linears)
    flops = tokens * spec.grad_accum_steps * weights / tp * (6 * rank.num_blocks + 2 * checkpointed)
    if tp > 1 and train.float8 != "rowwise":  # the gathered operands cast on the shard instead
        per_block = sum((0 if col else 3 * tokens * i / tp) + (2 * tokens * o / tp if col else 0) + 3 * i * o / tp
                        for i, o, col in linears) + 6 * tokens / tp * h
    else:  # each GEMM casts its own operands, a column-wise linear's output and a row-wise one's input a tp-th
        local = [(i, o / tp) if col else (i / tp, o) for i, o, col in linears]
        per_block = sum(3 * tokens * i + 2 * tokens * o + 3 * i * o for i, o in local)
    return flops, per_block * rank.num_blocks * spec.grad_accum_steps


def _float8_linears(shape) -> list[tuple[int, int, bool]]:
    """(in, out, column-wise) of a block's linears float8 converts: q, k, v, o, gate, up, down."""
    h, kv, f = shape.hidden, shape.kv_width, shape.intermediate
    return [(h, h, True), (h, kv, True), (h, kv, True), (h, h, False), (h, f, True), (h, f, True), (f, h, False)]


def float8_gathered_weight_seconds(spec: TrialSpec, *, float8_flops: float, block_params: int | None = None,
                                   virtual_stages: int | None = None) -> tuple[float, str]:
    """What FSDP's float8 all-gather (tensorwise) changes in one step's casts on the costed GPU, in seconds
    (costmodel.float8_gathered_weight_seconds): `block_params`, a block's weights gathered in float8 (the trace's
    count; the closed form's q, k, v, o, gate, up, down where None), a tp-th of them on each GPU, sharded over the
    data ranks. Each converted GEMM a weight feeds, of `float8_flops` (the step's: 2 x tokens x weights a GEMM, one
    weight gradient a micro-batch), reads it as gathered, not as a cast of its own. FSDP gathers once a micro-batch's
    forward, once more for its backward where blocks reshard after forward; a pipeline stage keeps its blocks
    gathered from the first micro-batch to the last. (0, "") for rowwise, which gathers in high precision."""
    train = spec.train
    if train.float8 == "rowwise":
        return 0.0, ""
    pipelined, accum = train.pipeline_parallel > 1, spec.grad_accum_steps
    blocks = pipeline_costed_rank(spec, virtual_stages).num_blocks if pipelined else spec.model.num_layers
    per_block = block_params if block_params is not None else sum(i * o for i, o, _ in _float8_linears(model_shape(spec.model)))
    weights = per_block * blocks / train.tensor_parallel
    if not weights:
        return 0.0, ""
    shard_ranks = train.shard_group_size or spec.cluster.num_gpus // (train.tensor_parallel * train.pipeline_parallel)
    tokens = train.micro_batch_size * spec.seq_len / train.context_parallel
    return costmodel.float8_gathered_weight_seconds(
        gpu=spec.cluster.gpu, weight_elements=weights, shard_elements=weights / shard_ranks,
        gathers=1 if pipelined else accum * (2 if train.reshard_after_forward else 1),
        weight_operands=max(float8_flops / (2 * tokens * weights) - accum, 0.0), input_gradients=accum,
        compiled=train.compile != "none", master_bytes=MASTER_DTYPE_BYTES[MASTER_DTYPE_NAMES[train.precision]])


def _pipeline_layout(spec: TrialSpec, virtual_stages: int | None = None) -> list[PipelineRank]:
    """The pipeline's ranks: autotune's own as parallel/pipeline.py builds them (knobs.split_stages, the schedule's
    stages per rank); a published run's stated stages per rank (`virtual_stages` given) as its publisher lays them
    out (costmodel.pipeline_stage_layers: the end stages the fewer blocks, possibly none)."""
    pp, layers = spec.train.pipeline_parallel, spec.model.num_layers
    if virtual_stages is None:
        return _built_pipeline_ranks(layers, pp, pipeline_virtual_stages(spec))
    return pipeline_ranks(layers, pp, virtual_stages)


def pipeline_parallel_work(spec: TrialSpec, virtual_stages: int | None = None) -> dict:
    """fsdp_step_work's pipeline-parallel arguments for `spec` (nothing without pipeline parallelism): the degree,
    schedule and stages per rank (`virtual_stages` replaces the schedule's, knobs.PIPELINE_VIRTUAL_STAGES, where a
    published run states its own), the stage-to-stage sends (costmodel.pp_p2p_bytes; across nodes where consecutive
    stages are world / pp >= a node's GPUs apart: pp outermost in the mesh, torchtitan's order), and the slowest
    rank's blocks and root parameters, which its stage's FSDP gathers and reduces."""
    pp = spec.train.pipeline_parallel
    if pp == 1:
        return {}
    v = pipeline_virtual_stages(spec) if virtual_stages is None else virtual_stages
    shape = model_shape(spec.model)
    rank = pipeline_costed_rank(spec, virtual_stages)
    embed, head = _root_split(shape)
    return dict(
        pipeline_parallel=pp, pipeline_schedule=spec.train.pipeline_schedule, pipeline_virtual_stages=v,
        pp_p2p_bytes=costmodel.pp_p2p_bytes(
            tokens_per_microbatch=spec.train.micro_batch_size * spec.seq_len, hidden_size=shape.hidden,
            activation_bytes=PARAM_DTYPE_BYTES[spec.train.precision], num_microbatches=spec.grad_accum_steps,
            virtual_stages=v, tensor_parallel=spec.train.tensor_parallel, context_parallel=spec.train.context_parallel),
        pp_p2p_inter_node=spec.cluster.num_gpus // pp >= spec.cluster.gpus_per_node,
        pipeline_stage_blocks=rank.num_blocks,
        pipeline_root_params=(embed if rank.first else 0) + (head if rank.last else 0))


def _built_pipeline_ranks(num_layers: int, pp: int, virtual_stages: int) -> list[PipelineRank]:
    """The pipeline ranks as parallel/pipeline.py builds them (split_stages' blocks, stage s on rank s mod pp)."""
    bounds = knobs.split_stages(num_layers, pp * virtual_stages)
    return [PipelineRank(rank=r, blocks=tuple(tuple(range(*bounds[r + k * pp])) for k in range(virtual_stages)),
                         first=r == 0, last=r == pp - 1) for r in range(pp)]


def _backwards_in_flight(schedule: str, *, pp: int, m: int, rank: int, v: int) -> tuple[int, int]:
    """(micro-batches, or stage chunks, that rank `rank` holds at its first backward; at its second), as torch's
    schedules run them: the first backward follows the warm-up (costmodel.pipeline_in_flight); before the second
    one forward more has run where one is left (1F1B, Interleaved1F1B's steady state), none under GPipe (all m
    forwards first)."""
    first = costmodel.pipeline_in_flight(schedule, stages=pp, microbatches=m, rank=rank, virtual_stages=v)
    if schedule == "GPipe":
        return first, max(first - 1, 0)
    return first, min(m * v, first + 1) - 1


def pipeline_rank_memory(spec: TrialSpec, virtual_stages: int | None = None) -> list[tuple[int, str, dict[str, float]]]:
    """Each pipeline rank's closed-form tensor peak: (rank, the moment, bytes by category). See
    estimate_pipeline_memory for the terms."""
    shape = model_shape(spec.model)
    train = spec.train
    pp, tp, cp, m = train.pipeline_parallel, train.tensor_parallel, train.context_parallel, spec.grad_accum_steps
    v = pipeline_virtual_stages(spec) if virtual_stages is None else virtual_stages
    d = PARAM_BYTES[train.precision]
    master = master_bytes(train.precision)
    reduce = MASTER_DTYPE_BYTES[reduce_dtype_name(train.precision, spec.step)]
    stage_gpus = spec.cluster.num_gpus // pp
    tokens = train.micro_batch_size * spec.seq_len // cp
    h, vocab = shape.hidden, shape.vocab
    ac = train.activation_checkpointing
    scores_saved, scores_held, _ = eager_score_memory(spec, tokens=tokens, d=d)
    per_layer = (activation_bytes_per_token(shape, d) * tokens + scores_saved) / tp
    checkpoint_input = checkpointed_block_bytes(shape, ac, d, tokens, tp)
    backward_temps = block_backward_temp_bytes(shape, d, tokens, largest_weight_grad=d * h * shape.intermediate,
                                               scores_held=scores_held, tensor_parallel=tp)
    hidden_states = h * d * tokens / tp  # one micro-batch's hidden states between stages
    logits = d * tokens * vocab  # one micro-batch's logits, the last stage's output (in fwd_cache to its backward)
    embed, head = _root_split(shape)
    out = []
    for rank in _pipeline_layout(spec, virtual_stages):
        n, blocks = rank.num_blocks, rank.num_blocks * shape.block_params
        root = (embed if rank.first else 0) + (head if rank.last else 0)
        # Under tensor parallelism each GPU holds a tp-th of the blocks (their norms taken as split too: a lower
        # bound) and the whole root (apply_tp_stage splits the embeddings' output and gathers the head's input,
        # leaving both whole on every tp rank): FSDP shards the blocks over the stage's GPUs, the root over its
        # data ranks; the accumulated unsharded gradients are a tp-th of the blocks' and all of the root's.
        params = blocks / tp + root
        sharded = master * (blocks + root * tp) / stage_gpus
        states = dict(parameters=sharded, optimizer_state=2 * sharded)
        # Receive buffers torch's PipelineStage makes for every micro-batch up front, each stage its own: the
        # activations from the previous stage, the gradients from the next.
        stages_receiving = sum(rank.rank + k * pp > 0 for k in range(v))
        stages_sending = sum(rank.rank + k * pp < pp * v - 1 for k in range(v))
        buffers = m * hidden_states * (stages_receiving + stages_sending)
        # A micro-batch in flight: each block's saved activations (a checkpointed block its input), and the stage's
        # output, held for its backward (fwd_cache); a chunk of an interleaved rank its stages' on average.
        saved = sum(checkpoint_input if ac.wraps_block(i) else per_layer for i in rank.block_indices) / v
        per_microbatch = saved + hidden_states
        if rank.last:  # the final norm's fp32 input and its output, saved for the head
            per_microbatch += (4 * h + 2 * d * h) * tokens / v
        first_held, steady_held = _backwards_in_flight(train.pipeline_schedule, pp=pp, m=m, rank=rank.rank, v=v)
        gathered_block = d * shape.block_params / tp
        gpipe = train.pipeline_schedule == "GPipe"
        # The stage whose backward is costed (the rank's largest); under an interleaved schedule the rank's other
        # stages' blocks are taken as gathered by their own backwards.
        chunk = max(rank.blocks, key=len)
        chunk_saved = [checkpoint_input if ac.wraps_block(i) else per_layer for i in chunk]
        others = n - len(chunk)
        candidates = []

        def backward(label: str, held: int, *, accumulated: bool, all_gathered: bool) -> None:
            """The backward of each block j of the costed stage (j from the last): the micro-batches in flight
            but the current one whole, the current one's blocks below j, block j's saved activations, recompute
            and backward temporaries; the blocks gathered so far (the current and the prefetched next), or all
            where no forward resharded them since the previous backward. On the last stage also the logits of each
            micro-batch in flight (the current one's held by backward_one_chunk through its blocks' backward, the
            others' in fwd_cache: GPipe) and each other one's log-softmax, saved by its loss (GPipe); no logits of
            the micro-batches done: the step runs with return_outputs=False, nothing kept in output_chunks."""
            kept = 0.0
            if rank.last:
                kept = (held if gpipe else 1) * logits + (4 * tokens * vocab * (held - 1) if gpipe else 0.0)
            for j in reversed(range(len(chunk))):
                done = len(chunk) - 1 - j
                gathered = n if all_gathered or not train.reshard_after_forward else min(len(chunk), done + 2) + (
                    others if accumulated else 0)
                recompute = per_layer + checkpoint_input - chunk_saved[j] if ac.wraps_block(chunk[j]) else 0.0
                candidates.append((label, dict(
                    states, parameters=sharded + d * root + gathered_block * gathered,
                    gradients=(reduce * params if accumulated else 0.0) + gathered_block,
                    activations=(held - 1) * per_microbatch + sum(chunk_saved[:j + 1]) + hidden_states + recompute
                    + backward_temps + kept,
                    communication_buffers=buffers)))

        # The first backward: the most in flight, nothing accumulated yet; the root (the stage's FSDP root, never
        # resharded after forward) gathered throughout.
        backward("first backward", first_held, accumulated=False, all_gathered=False)
        if m > 1:
            # A later backward: every gradient of the rank accumulated unsharded in the reduce dtype (torch's
            # PipelineStage: set_requires_gradient_sync(False) until the last; FSDP2 upcasts each micro-batch's),
            # plus one block's gradients in the compute dtype before their upcast; the blocks gathered by the
            # previous backward stay gathered (set_reshard_after_backward(False)) until a forward reshards them:
            # after the warm-up one forward runs between two backwards (1F1B), none under GPipe or in the cool-down.
            backward("backward of a later micro-batch", steady_held, accumulated=True, all_gathered=gpipe)
            if not gpipe and first_held > 1:
                backward("cool-down backward", first_held - 1, accumulated=True, all_gathered=True)
        if rank.last:
            # The loss backward (the model's own: fp32 log-softmax and two fp32 gradients, loss_backward_bytes): the
            # logits of each micro-batch whose loss ran before its backward are alive (the step runs with
            # return_outputs=False: no output_chunks kept to the end), each (GPipe: all m) with its fp32 log-softmax; the
            # stage's blocks just resharded by the micro-batch's forward (GPipe: gathered by the previous backward;
            # an interleaved rank's other stages' gathered by their own).
            loss = loss_backward_bytes(spec.step, tokens=tokens, vocab=vocab, hidden=h, d=d)
            for k, held in enumerate((first_held, steady_held)):
                if k and m == 1:
                    continue
                returned = held if gpipe else 1
                losses = (held if gpipe else 1) - 1
                candidates.append((f"loss backward of {'a later' if k else 'the first'} micro-batch", dict(
                    states, parameters=sharded + d * root + gathered_block * (0 if not k else n if gpipe else others),
                    gradients=reduce * params if k else 0.0,
                    activations=returned * logits + loss + 4 * tokens * vocab * losses + held * per_microbatch,
                    communication_buffers=buffers)))
        moment, parts = max(candidates, key=lambda item: sum(item[1].values()))
        parts["other"] = 16 * tokens if rank.first or rank.last else 0.0
        out.append((rank.rank, f"stage {rank.rank} of {pp} ({moment}, {first_held} "
                               f"{'chunks' if v > 1 else 'micro-batches'} in flight, {train.pipeline_schedule})", parts))
    return out


def _largest_allocation(spec: TrialSpec, *, first: bool, last: bool) -> int:
    """The largest single tensor of a rank's step, for the runtime's fragmentation term (as the simulator passes its
    traced one): where the rank computes the loss, its fp32 logits; where it holds the embeddings, their gradient
    accumulated in the reduce dtype; else a block's flat fp32 gradients."""
    shape = model_shape(spec.model)
    train = spec.train
    d = PARAM_BYTES[train.precision]
    reduce = MASTER_DTYPE_BYTES[reduce_dtype_name(train.precision, spec.step)]
    tokens = train.micro_batch_size * spec.seq_len // train.context_parallel
    embed, head = _root_split(shape)
    largest = reduce * shape.block_params / train.tensor_parallel
    if first:
        largest = max(largest, reduce * embed)
    if last:
        share = train.tensor_parallel if train.loss_parallel else 1  # loss parallelism: a vocabulary share
        largest = max(largest, reduce * head / share, 4 * tokens * shape.vocab / share)
    return int(largest)


def estimate_pipeline_memory(spec: TrialSpec, virtual_stages: int | None = None) -> MemoryEstimate:
    """Closed-form memory of the worst pipeline rank (pipeline_rank_memory: each rank's, the largest wins), the
    ranks' blocks as parallel/pipeline.py splits them, at the rank's costliest moment of the traced step (the
    simulator's, sim/_pipeline.py; benchmarks/bench_pipeline_closed_form.py compares the two):

    * its stages' parameters and AdamW state, sharded over the stage's world / pp GPUs in the master dtype (after
      zero_grad no sharded gradients are held until the last backward reduce-scatters them);
    * the stage's FSDP root (the embeddings on the first stage, final norm and head on the last) gathered throughout;
      the blocks gathered one at a time (and the next prefetched) in the first backward, all of them in every later
      one: torch's PipelineStage keeps them gathered until the last backward (set_reshard_after_backward(False));
    * from the second backward on, every gradient of the rank accumulated unsharded in the reduce dtype
      (set_requires_gradient_sync(False); FSDP2 upcasts each micro-batch's gradients into it), plus one block's
      gradients in the compute dtype;
    * the micro-batches (stage chunks) in flight at the first backward (costmodel.pipeline_in_flight) and at the
      second, each with its blocks' saved activations (a checkpointed block its input) and the stage's output (and
      on the last stage the final norm's), plus one block's recompute and backward temporaries;
    * the receive buffers PipelineStage allocates up front for every micro-batch: a micro-batch's hidden states from
      the previous stage and gradients from the next, per stage of the rank;
    * on the last stage, the logits of each micro-batch in flight only (1F1B: the current one; GPipe: every one
      whose backward has not run, in fwd_cache): the step runs with return_outputs=False (parallel/pipeline.py,
      as torchtitan does), so the schedule keeps no micro-batch's logits in output_chunks to the end of the step
      and merges none; the loss's fp32 log-softmax and two fp32 gradients (loss_backward_bytes) at its backward
      and the log-softmax of every other micro-batch whose loss has run (GPipe: all of them in flight).

    Runtime memory: as the simulator passes it, the rank's largest allocation (_largest_allocation: on the
    last stage one micro-batch's fp32 logits in the loss) and the root's fp32 shard over the data ranks."""
    shape = model_shape(spec.model)
    train = spec.train
    pp = train.pipeline_parallel
    v = pipeline_virtual_stages(spec) if virtual_stages is None else virtual_stages
    ranks = pipeline_rank_memory(spec, virtual_stages)
    worst, peak_at, parts = max(ranks, key=lambda item: sum(item[2].values()))
    breakdown = dict.fromkeys(MEMORY_CATEGORIES, 0) | {name: int(value) for name, value in parts.items()}
    tensor_peak = sum(breakdown.values())
    rank = _pipeline_layout(spec, virtual_stages)[worst]
    data_ranks = spec.cluster.num_gpus // (pp * train.tensor_parallel * train.context_parallel)
    breakdown["runtime_overhead"] = runtime_memory(
        spec.cluster.gpu, world_size=spec.cluster.num_gpus, gpus_per_node=spec.cluster.gpus_per_node,
        tensor_peak_bytes=tensor_peak, largest_allocation_bytes=_largest_allocation(spec, first=rank.first, last=rank.last),
        root_shard_bytes=shape.root_params * PARAM_DTYPE_BYTES["fp32"] // (data_ranks * train.context_parallel),
    ).total_bytes
    return MemoryEstimate(breakdown=breakdown, tensor_peak_bytes=tensor_peak, peak_bytes=sum(breakdown.values()),
                          host_bytes_per_node=int(costmodel.HOST_PROCESS_BYTES * spec.cluster.gpus_per_node),
                          peak_at=peak_at)


def trainable_split(spec: TrialSpec) -> tuple[int, int] | None:
    """(per block, root) parameters that take gradients where some are frozen (LoRA), else None:
    what FSDP2 reduce-scatters and the optimizer steps (costmodel). Counted on the model as peft
    wraps it (torch is imported for LoRA only: a full fine-tune's plan stays torch-free)."""
    if not spec.finetuning.lora:
        return None
    from autotune.distributed.training import parameter_counts

    counts = parameter_counts(spec.model, spec.finetuning)
    return counts.block_trainable, counts.root_trainable


def offload_fresh_page_bytes(spec: TrialSpec) -> float:
    """CPU offload: bytes of one rank's fp32 gradient shards that land in fresh host mappings each
    accumulating micro-batch (costmodel.fresh_page_bytes over the model's parameters, sharded over
    the shard group). 0 without offload, and under LoRA, whose adapters' gradients are small."""
    if not spec.train.cpu_offload or spec.finetuning.lora:
        return 0.0
    n, group = spec.cluster.num_gpus, spec.train.shard_group_size
    return costmodel.fresh_page_bytes(spec.model.param_shapes, shard_ranks=group if 0 < group < n else n)


def gathered_block_params(spec: TrialSpec, block_params: int) -> int:
    """Parameters of a block one GPU gathers: all of them, or under expert parallelism its own
    1/ep of the experts with the rest (the same count the simulator's trace holds per rank)."""
    experts, ep = spec.model.block_expert_parameters, spec.train.expert_parallel
    return block_params - experts + experts // ep if ep > 1 else block_params


def expert_parallel_work(spec: TrialSpec) -> dict:
    """fsdp_step_work's all-to-all arguments for `spec` (nothing without expert parallelism)."""
    ep = spec.train.expert_parallel
    if ep == 1:
        return {}
    model, ac = spec.model, spec.train.activation_checkpointing
    # MoE blocks checkpointed: every block is MoE in the catalog's MoE models; else in proportion.
    checkpointed = sum(ac.wraps_block(i) for i in range(model.num_layers)) * model.moe_layers // model.num_layers
    return dict(all_to_all_bytes=costmodel.expert_all_to_all_bytes(
        tokens_per_microbatch=spec.train.micro_batch_size * spec.seq_len, experts_per_token=model.experts_per_token,
        hidden_size=model.hidden_size, activation_bytes=PARAM_DTYPE_BYTES[spec.train.precision],
        moe_layers=model.moe_layers, expert_parallel=ep, checkpointed_moe_layers=checkpointed,
        num_microbatches=spec.grad_accum_steps), all_to_all_inter_node=ep > spec.cluster.gpus_per_node)


def fused_bytes_saved(spec: TrialSpec) -> float:
    """costmodel.compile_fused_bytes_saved of a TrialSpec on one GPU: its model's shape, its micro-batches'
    tokens (a tensor- or context-parallel GPU's share), its checkpointed blocks, its compute dtype."""
    shape = model_shape(spec.model)
    ac = spec.train.activation_checkpointing
    return costmodel.compile_fused_bytes_saved(
        tokens=spec.train.micro_batch_size * spec.seq_len * spec.grad_accum_steps / spec.train.ranks_per_batch,
        num_layers=shape.num_layers, checkpointed_blocks=sum(ac.wraps_block(i) for i in range(shape.num_layers)),
        hidden=shape.hidden, ffn=shape.intermediate, kv_width=shape.kv_width,
        param_bytes=PARAM_BYTES[spec.train.precision])


def _costed_blocks(spec: TrialSpec, virtual_stages: int | None = None) -> tuple[int, ...]:
    """The decoder blocks one GPU computes: all of them, or under pipeline parallelism the slowest rank's."""
    if spec.train.pipeline_parallel > 1:
        return pipeline_costed_rank(spec, virtual_stages).block_indices
    return tuple(range(spec.model.num_layers))


def _blocks_recomputing_forward(spec: TrialSpec, virtual_stages: int | None = None) -> int:
    """Blocks (of those one GPU computes) whose forward runs again in backward: the wholly checkpointed ones
    (op-level: none whole)."""
    ac = spec.train.activation_checkpointing
    return 0 if ac.mode == "op" else sum(ac.wraps_block(i) for i in _costed_blocks(spec, virtual_stages))


def symmetric_memory_bytes(spec: TrialSpec) -> int:
    """Async TP's symmetric-memory workspace on each GPU (runtime_memory.async_tp_workspace_bytes); 0 without it."""
    train = spec.train
    if not train.async_tensor_parallel:
        return 0
    return async_tp_workspace_bytes(
        tokens_per_microbatch=train.micro_batch_size * spec.seq_len // train.context_parallel,
        hidden_size=model_shape(spec.model).hidden, tensor_parallel=train.tensor_parallel,
        activation_bytes=PARAM_DTYPE_BYTES[train.precision])


def tensor_parallel_work(spec: TrialSpec, virtual_stages: int | None = None) -> dict:
    """fsdp_step_work's tensor-parallel arguments for `spec` (nothing without tensor parallelism)."""
    tp = spec.train.tensor_parallel
    if tp == 1:
        return {}
    # With context parallelism each tensor-parallel group holds a cp-th of the sequence: its exchanges carry those
    # tokens only.
    exchanges = dict(
        tokens_per_microbatch=spec.train.micro_batch_size * spec.seq_len // spec.train.context_parallel,
        hidden_size=spec.model.hidden_size, activation_bytes=PARAM_DTYPE_BYTES[spec.train.precision],
        num_blocks=len(_costed_blocks(spec, virtual_stages)), tensor_parallel=tp,
        checkpointed_blocks=_blocks_recomputing_forward(spec, virtual_stages), num_microbatches=spec.grad_accum_steps,
        float8_gathers=spec.train.float8 == "tensorwise")
    work = dict(tensor_parallel=tp, tp_all_reduce_bytes=costmodel.tp_all_reduce_bytes(**exchanges))
    if spec.train.async_tensor_parallel:
        shape = model_shape(spec.model)
        q_width = (spec.model.config_dict.get("head_dim") or shape.hidden // shape.num_heads) * shape.num_heads
        # Gated MLPs (gate and up beside each other) hold three ffn x hidden matrices, plain ones two.
        mlp_params = shape.block_params - shape.hidden * (2 * q_width + 2 * shape.kv_width)
        gated = mlp_params >= 2.5 * shape.hidden * shape.intermediate
        work.update(async_tensor_parallel=True, tp_overlap=costmodel.tp_exchanges(
            **exchanges, q_width=q_width, kv_width=shape.kv_width, ffn=shape.intermediate,
            mlp_in_width=(2 if gated else 1) * shape.intermediate, gathers_fuse=spec.train.float8 != "rowwise"))
    return work


def context_parallel_work(spec: TrialSpec, virtual_stages: int | None = None) -> dict:
    """fsdp_step_work's context-parallel arguments for `spec` (nothing without context parallelism)."""
    cp = spec.train.context_parallel
    if cp == 1:
        return {}
    # With tensor parallelism each GPU holds and passes on its tp-th of the key and value heads.
    return dict(context_parallel=cp, cp_ring_bytes=costmodel.cp_ring_bytes(
        tokens_per_microbatch=spec.train.micro_batch_size * spec.seq_len,
        kv_width=model_shape(spec.model).kv_width // spec.train.tensor_parallel,
        activation_bytes=PARAM_DTYPE_BYTES[spec.train.precision], num_blocks=len(_costed_blocks(spec, virtual_stages)),
        context_parallel=cp, checkpointed_blocks=_blocks_recomputing_forward(spec, virtual_stages),
        num_microbatches=spec.grad_accum_steps))


def step_work(spec: TrialSpec, *, reduce_bytes: int = 4, kernels: str = "eager",
              attention_kernel: str | None = None, pipeline_virtual_stages: int | None = None) -> costmodel.StepWork:
    """FLOPs, collective and offload bytes of one optimizer step on one GPU, gradients reduced in
    `reduce_bytes` per element (fp32, as autotune's trials reduce); attention's FLOPs apart, as counted
    and as the `attention_kernel` executes them, and the memory-bound ops' bytes of `kernels`
    (costmodel.MEMORY_BYTES_PER_TOKEN: "eager" is transformers' and torchtitan's code, what autotune
    runs; the published runs name their stack's). Under pipeline parallelism the work is the slowest rank's
    (pipeline_costed_rank: its blocks, the head on the last stage) with `pipeline_virtual_stages` stages per rank
    (default: the schedule's). `attention_kernel` None: the one the model's attention runs: "eager" (its products
    at the matmul rate) or "flash2" (sdpa and both flash kernels, at FlashAttention-2's rate: catalog/attention.py)."""
    from autotune.problem.catalog.models import model_flops_per_token

    attention_kernel = attention_kernel or ("eager" if runs_eager_attention(spec) else "flash2")
    if spec.train.pipeline_parallel > 1:
        return _pipeline_step_work(spec, reduce_bytes=reduce_bytes, kernels=kernels, attention_kernel=attention_kernel,
                                   virtual_stages=pipeline_virtual_stages)

    shape = model_shape(spec.model)
    train = spec.train
    tokens_per_gpu = train.micro_batch_size * spec.seq_len * spec.grad_accum_steps
    model_flops = model_flops_per_token(spec.model, spec.seq_len, num_parameters=shape.num_parameters)
    span = attention_span(spec)  # the attention computed: over the sequence, or a padding-free row
    executed = model_flops_per_token(spec.model, span, num_parameters=shape.num_parameters)
    # A checkpointed block runs its forward again: 2 FLOPs per parameter plus attention's 4*h*s;
    # op-level checkpointing only the matmuls its policy did not save.
    ac = train.activation_checkpointing
    num_checkpointed = sum(ac.wraps_block(i) for i in range(shape.num_layers))
    # A MoE block recomputes with the experts each token is routed to (catalog: active parameters).
    active_block = shape.block_params - spec.model.idle_expert_parameters // max(spec.model.moe_layers, 1)
    per_block = (op_checkpoint_recompute_flops_per_token(shape, ac.policy) if ac.mode == "op"
                 else 2 * active_block + 4 * shape.hidden * span)
    recompute = num_checkpointed * per_block
    # Attention apart: counted as above (12 h s per token per block, a checkpointed block's forward
    # 4 h s again, none under op-level checkpointing, which saves attention's output), and as a causal
    # flash kernel runs it (forward 2 h s, backward 2.5x that, the recompute's forward 2 h s again).
    attention_recomputed = 0 if ac.mode == "op" else num_checkpointed
    width = shape.hidden
    attention = dict(
        attention_flops_per_gpu=float(tokens_per_gpu * width * span * (12 * shape.num_layers + 4 * attention_recomputed)),
        attention_kernel_flops_per_gpu=float(tokens_per_gpu * width * span * (7 * shape.num_layers
                                                                            + 2 * attention_recomputed)),
        attention_span=span, attention_head_dim=shape.hidden // max(shape.num_heads, 1),
        attention_kernel=attention_kernel,
        memory_bytes_per_gpu=tokens_per_gpu * PARAM_BYTES[train.precision] / 2 * (
            shape.num_layers * costmodel.memory_bytes_per_token(kernels, hidden=shape.hidden, ffn=shape.intermediate,
                                                               kv_width=shape.kv_width)
            + num_checkpointed * costmodel.memory_bytes_per_token(kernels, hidden=shape.hidden, ffn=shape.intermediate,
                                                                  kv_width=shape.kv_width, forward=True))
        + _eager_score_bytes(spec, attention_kernel, tokens=tokens_per_gpu, span=span, blocks=shape.num_layers,
                             recomputed=attention_recomputed))
    # Tensor parallelism: each GPU of a group does a tp-th of its tokens' work (attention by heads too);
    # context parallelism a cp-th (its tokens; attention load-balanced, in ring steps of a cp-th of the keys).
    tp, cp = train.tensor_parallel, train.context_parallel
    if tp * cp > 1:
        attention = {k: v / (tp * cp) if k.endswith("_per_gpu") else v for k, v in attention.items()}
        attention["attention_span"] = max(1, attention["attention_span"] // cp)
    return costmodel.fsdp_step_work(
        flops_per_gpu=tokens_per_gpu * (executed + recompute) / (tp * cp),
        model_flops_per_gpu=tokens_per_gpu * model_flops / (tp * cp),
        tokens_per_gpu_step=tokens_per_gpu, num_gpus=spec.cluster.num_gpus,
        block_params=gathered_block_params(spec, shape.block_params),
        num_blocks=shape.num_layers, root_params=shape.root_params, param_bytes=PARAM_BYTES[train.precision],
        reshard_after_forward=train.reshard_after_forward, cpu_offload=train.cpu_offload,
        num_microbatches=spec.grad_accum_steps, hidden_size=shape.hidden, reduce_bytes=reduce_bytes,
        trainable=trainable_split(spec), attention=attention, precision=train.precision,
        offload_fresh_page_bytes=offload_fresh_page_bytes(spec), **expert_parallel_work(spec),
        **tensor_parallel_work(spec), **context_parallel_work(spec))


def _eager_score_bytes(spec: TrialSpec, attention_kernel: str, *, tokens: int, span: int, blocks: int,
                       recomputed: int) -> float:
    """The memory-bound bytes eager attention adds on the score tensors (costmodel.EAGER_SCORE_BYTES) for
    `tokens` tokens attending over `span` keys each, in the trial's compute dtype; 0 for a fused kernel."""
    if attention_kernel != "eager":
        return 0.0
    heads = model_shape(spec.model).num_heads
    return costmodel.eager_score_bytes(scores=float(tokens) * span * heads, blocks=blocks,
                                       recomputed=recomputed) * PARAM_BYTES[spec.train.precision] / 2


def _pipeline_step_work(spec: TrialSpec, *, reduce_bytes: int, kernels: str, attention_kernel: str,
                        virtual_stages: int | None) -> costmodel.StepWork:
    """step_work under pipeline parallelism: the slowest rank's blocks (and the head, on the last stage) for every
    micro-batch, a tp x cp-th of each as without a pipeline; MFU's model FLOPs are the average GPU's."""
    from autotune.problem.catalog.models import model_flops_per_token

    shape = model_shape(spec.model)
    train = spec.train
    v = pipeline_virtual_stages(spec) if virtual_stages is None else virtual_stages
    rank = pipeline_costed_rank(spec, virtual_stages)
    tp, cp, pp = train.tensor_parallel, train.context_parallel, train.pipeline_parallel
    tokens_per_gpu = train.micro_batch_size * spec.seq_len * spec.grad_accum_steps
    span = attention_span(spec)
    ac = train.activation_checkpointing
    blocks = rank.num_blocks
    checkpointed = sum(ac.wraps_block(i) for i in rank.block_indices)
    attention_recomputed = 0 if ac.mode == "op" else checkpointed
    width = shape.hidden
    shape_bytes = dict(hidden=shape.hidden, ffn=shape.intermediate, kv_width=shape.kv_width)
    attention = dict(
        attention_flops_per_gpu=float(tokens_per_gpu * width * span * (12 * blocks + 4 * attention_recomputed)) / (tp * cp),
        attention_kernel_flops_per_gpu=float(tokens_per_gpu * width * span * (7 * blocks + 2 * attention_recomputed))
        / (tp * cp),
        attention_span=max(1, span // cp), attention_head_dim=shape.hidden // max(shape.num_heads, 1),
        attention_kernel=attention_kernel,
        memory_bytes_per_gpu=tokens_per_gpu * PARAM_BYTES[train.precision] / 2 * (
            blocks * costmodel.memory_bytes_per_token(kernels, **shape_bytes)
            + checkpointed * costmodel.memory_bytes_per_token(kernels, **shape_bytes, forward=True)) / (tp * cp)
        + _eager_score_bytes(spec, attention_kernel, tokens=tokens_per_gpu, span=span, blocks=blocks,
                             recomputed=attention_recomputed) / (tp * cp))
    model_flops = model_flops_per_token(spec.model, spec.seq_len, num_parameters=shape.num_parameters)
    return costmodel.fsdp_step_work(
        flops_per_gpu=tokens_per_gpu * _rank_flops_per_token(spec, rank, span) / (tp * cp),
        model_flops_per_gpu=tokens_per_gpu * model_flops / (tp * cp * pp),
        tokens_per_gpu_step=tokens_per_gpu, num_gpus=spec.cluster.num_gpus,
        block_params=shape.block_params, num_blocks=blocks, root_params=shape.root_params,
        param_bytes=PARAM_BYTES[train.precision], reshard_after_forward=train.reshard_after_forward,
        cpu_offload=train.cpu_offload, num_microbatches=spec.grad_accum_steps, hidden_size=shape.hidden,
        reduce_bytes=reduce_bytes, trainable=trainable_split(spec), attention=attention, precision=train.precision,
        **tensor_parallel_work(spec, v), **context_parallel_work(spec, v), **pipeline_parallel_work(spec, v))


class AnalyticBackend(TrialBackend):
    """Closed-form estimates: instant, for exploring before a trace or a real run confirms."""

    name = "analytic"
    memory_source = "estimated"
    throughput_source = "estimated"

    def evaluate(self, spec: TrialSpec) -> TrialResult:
        started = time.perf_counter()
        try:
            memory = estimate_memory(spec)
            step = costmodel.estimate_step_time(step_work(spec), spec.cluster,
                                                shard_group_size=spec.train.shard_group_size,
                                                reshard_group_size=spec.train.reshard_group_size)
        except (KeyError, TypeError, ValueError) as exc:  # a config the closed form cannot read
            return TrialResult(status="error", message=f"analytic estimate failed: {type(exc).__name__}: {exc}",
                               duration_s=time.perf_counter() - started)
        gpu = spec.cluster.gpu.name
        host = Figure(memory.host_bytes_per_node, "estimated", costmodel.ESTIMATE_BASIS["host_memory"])
        tokens_per_sec, tps_basis = step.tokens_per_sec, step.basis
        compile_speedup = None
        if spec.train.compile != "none":
            # The same step with the blocks' memory-bound ops fused (costmodel.compiled_work). The closed
            # form's memory stays eager's: what a compiled block saves is the partitioner's choice, which only
            # the trace sees (docs/COMPILE.md).
            work = step_work(spec)
            saved = fused_bytes_saved(spec)
            compiled = costmodel.estimate_step_time(costmodel.compiled_work(work, fused_bytes_saved=saved),
                                                    spec.cluster, shard_group_size=spec.train.shard_group_size,
                                                    reshard_group_size=spec.train.reshard_group_size, describe=False)
            tokens_per_sec, _, _, ratio, compiled_basis = costmodel.compiled_throughput(
                tokens_per_sec, eager_step=step.to_dict(), compiled_step=compiled.to_dict(), fused_bytes_saved=saved)
            tps_basis += f"; {compiled_basis}"
            compile_speedup = dict(ratio=ratio, source="estimated", basis=compiled_basis)
        if spec.train.float8 != "none":
            # The closed form counts neither the converted matmuls nor the casts (the simulator traces them).
            tps_basis += ("; float8 not costed by the closed form: the high-precision estimate (the simulator "
                          "traces the float8 matmuls and casts, docs/COMPILE.md)")
        if memory.offloaded_activation_bytes:
            # The copies to the host and back, on the compute stream (not overlapped), at the host link's rate.
            gbps = costmodel.host_link_gbps(spec.cluster.gpu)
            transfer_s = costmodel.activation_transfer_s(spec.cluster.gpu, moved_bytes=memory.offloaded_activation_bytes,
                                                         num_microbatches=spec.grad_accum_steps)
            tokens = spec.tokens_per_step  # a tensor-parallel group's GPUs share one batch: tokens per GPU overcount
            tokens_per_sec = tokens / (tokens / tokens_per_sec + transfer_s)
            tps_basis += f"; plus {transfer_s:.3f} s per step of activation offload copies at {gbps:g} GB/s"
        status, message = "ok", f"peak at the {memory.peak_at}"
        host_limit = spec.cluster.host_memory_bytes
        if host_limit is not None and memory.host_bytes_per_node > host_limit:
            status = "oom"
            message = (f"host memory: a node needs {format_bytes(memory.host_bytes_per_node)} "
                       f"(offloaded state of {spec.cluster.gpus_per_node} ranks), it has "
                       f"{format_bytes(host_limit)}")
        elif memory.peak_bytes > spec.limit_bytes:
            status = "oom"
            message = (f"GPU memory: {format_bytes(memory.peak_bytes)} per GPU at the {memory.peak_at} "
                       f"exceeds the {format_bytes(spec.limit_bytes)} limit")
        if spec.workload.weight_sync:
            # The sim backend traces it; in the traces so far it stayed below the step's peak.
            message += "; the weight sync to vLLM is not in the closed form (the sim backend traces it)"
        return TrialResult(
            status=status,
            peak_memory=Figure(memory.peak_bytes, "estimated",
                               f"{costmodel.ESTIMATE_BASIS['memory']} ({gpu})"),
            memory_breakdown=memory.breakdown,
            tokens_per_sec=Figure(tokens_per_sec, "estimated", tps_basis),
            host_memory_per_node=host,
            message=message,
            # MFU of the figure reported (compiled, with activation copies), not of the eager step's.
            extras=dict(step_time=step.to_dict(), mfu=step.mfu * tokens_per_sec / step.tokens_per_sec
                        if step.tokens_per_sec else step.mfu, tensor_peak_bytes=memory.tensor_peak_bytes,
                        peak_at=memory.peak_at, **({"compile_speedup": compile_speedup} if compile_speedup else {})),
            duration_s=time.perf_counter() - started,
        )
