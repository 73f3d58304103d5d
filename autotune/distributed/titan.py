"""torchtitan's own model and step (`--stack torchtitan`, step `torchtitan`): what the simulator traces
and a real trial runs where torchtitan 0.3 is importable and the model is a family it has
(config.TORCHTITAN_FAMILIES).

Each piece is torchtitan's own code, called as its trainer calls it (torchtitan 0.3.0,
trainer.py, models/llama3/parallelize.py `parallelize_llama`, components/loss.py):
- the model: `Llama3Model` built from torchtitan's own layer builder (`_build_llama3_layers`: fused
  wqkv, depth-scaled inits), or `Qwen3Model` (`_build_qwen3_layers`) for dense qwen3, with the
  Hugging Face config's shapes (hidden size, layers, heads, KV heads, vocabulary, FFN width, RoPE
  theta, norm eps), fp32 master weights, the RoPE cache sized to the sequence (its trainer's
  `update_from_config` does the same);
- the parallelisation: `parallelize_llama`'s two steps without tensor/context parallelism (none is
  tuned): torchtitan's activation-checkpointing policy (`FullAC`, `SelectiveAC`) applied to every
  block, then `apply_fsdp_to_decoder` (its FSDP2 units: the embeddings, each block, norm + head
  together, then the root; bf16 parameters, fp32 reduction, `cast_forward_inputs=False`);
- the loss: `ChunkedLossWrapper` over `CrossEntropyLoss` (its llama3 configs' loss): the decoder runs
  with `_skip_lm_head`, and the head and loss run chunk by chunk, each chunk's backward inside the
  loss call; the returned loss's backward carries the accumulated fp32 gradient into the decoder.

Not torchtitan's: the attention kernel. torchtitan 0.3's llama3 attention is FlexAttention, run as
`torch.compile(flex_attention)` with inductor (a class attribute compiled once). Inductor's kernels
cannot run on fake tensors, and on CPUs its C++ template allocates buffers a dispatch-mode tracker
never sees; so the blocks use torchtitan's own `ScaledDotProductAttention` module (causal), whose
flash kernel returns and saves what FlexAttention's kernel does (output and log-sum-exp; q, k, v
saved). FlexAttention's BlockMask (int32 block indices, B x S/128 x S/128 of them) is not counted:
133,120 B for 2 x 8,192 tokens (`flex_block_mask_bytes`).

Knobs torchtitan 0.3 cannot express are traced as torchtitan runs them, the way the torchtitan
export writes them (export/_torchtitan.py): every-K checkpointing as FullAC on every block, op-level
`mm` as SelectiveAC (every other matmul), any shard placement as torchtitan's own (dimension 0).
compile, float8 and expert parallelism are not built here (`TitanUnsupported`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from autotune.problem.catalog.blocks import Blocks
from autotune.problem.catalog.models import ModelSpec
from autotune.problem.config import MASTER_DTYPE_NAMES, PARAM_DTYPE_NAMES, TORCHTITAN_FAMILIES, TrainConfig
from autotune.util.errors import UsageError
from autotune.problem.knobs import Checkpointing

NUM_LOSS_CHUNKS = 8
"""ChunkedLossWrapper.Config.num_chunks' default (torchtitan 0.3), which its llama3 configs keep."""
FLEX_BLOCK = 128
"""FlexAttention's default sparse block size (torchtitan's `_DEFAULT_SPARSE_BLOCK_SIZE`)."""


class TitanUnsupported(UsageError):
    """A knob the torchtitan step is not built with here."""


def titan_ac(ac: Checkpointing) -> str:
    """torchtitan 0.3's activation-checkpointing subcommand for a tuned policy: `none`, `full` (every
    block; every-K too, which torchtitan has not) or `selective` (its op-level SAC: every other matmul
    saved)."""
    if ac.mode == "none":
        return "none"
    if ac.mode == "op":
        return "selective"
    return "full"


def check_titan_train(train: TrainConfig, stack: str = "torchtitan") -> None:
    """Knobs a stack's own step (torchtitan's, LitGPT's: config.OWN_STEPS) is not built with here: one line
    each (a trial's error)."""
    for name, value, default in (("compile", train.compile, "none"), ("float8", train.float8, "none"),
                                 ("expert_parallel", train.expert_parallel, 1)):
        if value != default:
            raise TitanUnsupported(f"--stack {stack}: {name}={value} is not traced on {stack}'s model here "
                                   f"(only with {name}={default})")


def flex_block_mask_bytes(micro_batch_size: int, seq_len: int) -> int:
    """What FlexAttention's causal BlockMask holds (torch 2.13's create_block_mask with full blocks
    separated, as torchtitan builds it): kv_num_blocks, kv_indices, full_kv_num_blocks,
    full_kv_indices and their four q_* transposes, int32, one head."""
    blocks = math.ceil(seq_len / FLEX_BLOCK)
    return 4 * micro_batch_size * 4 * (blocks + blocks * blocks)


@dataclass(frozen=True)
class TitanBlocks(Blocks):
    """torchtitan keeps its blocks in a ModuleDict (`model.layers`, keyed '0', '1', ...): the blocks
    as a list, read anew each time (checkpointing replaces the entries)."""

    @property
    def layers(self) -> nn.ModuleList:
        return nn.ModuleList(getattr(self.parent, self.attr).values())


@dataclass(frozen=True)
class StackShapes:
    """The Hugging Face config's shapes a stack's own model is built with (torchtitan's, LitGPT's), read from
    the config alone: a trial's rank builds one without building the transformers model beside it."""

    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    layers: int
    seq_len: int
    norm_eps: float
    rope_theta: float | None
    tie_embeddings: bool

    @classmethod
    def of(cls, model: ModelSpec, *, num_layers: int | None, seq_len: int | None) -> "StackShapes":
        c = model.config_dict
        dim, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        theta = c.get("rope_theta")
        return cls(dim=dim, heads=heads, kv_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or dim // heads), ffn=int(c["intermediate_size"]),
                   vocab=int(c["vocab_size"]), layers=num_layers or int(c["num_hidden_layers"]),
                   seq_len=int(seq_len or c.get("max_position_embeddings", 2048)),
                   norm_eps=float(c.get("rms_norm_eps", 1e-5)), rope_theta=None if theta is None else float(theta),
                   tie_embeddings=bool(c.get("tie_word_embeddings", False)))


def build_titan_model(model: ModelSpec, *, num_layers: int | None = None, precision: str = "bf16",
                      seq_len: int | None = None) -> nn.Module:
    """torchtitan's model of the family (config.TORCHTITAN_FAMILIES: Llama3Model, or Qwen3Model for dense
    qwen3) with the shapes of `model`'s Hugging Face config, on the current default device, parameters in
    fp32 (torchtitan's master weights)."""
    if MASTER_DTYPE_NAMES[precision] != "float32":
        raise TitanUnsupported(f"--stack torchtitan keeps float32 master weights: precision {precision} is not built")
    if TORCHTITAN_FAMILIES.get(model.model_type) == "qwen3":
        return _build_qwen3(model, num_layers=num_layers, seq_len=seq_len)
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init
    from torchtitan.models.llama3.model import Llama3Model

    c, shape = model.config_dict, StackShapes.of(model, num_layers=num_layers, seq_len=seq_len)
    dim, vocab, eps = shape.dim, shape.vocab, shape.norm_eps
    norm_init = dict(_NORM_INIT)
    layers = _build_llama3_layers(
        n_layers=shape.layers, dim=dim, n_heads=shape.heads, n_kv_heads=shape.kv_heads, hidden_dim=shape.ffn,
        rope=ComplexRoPE.Config(dim=shape.head_dim, max_seq_len=shape.seq_len,
                                theta=shape.rope_theta if shape.rope_theta is not None else 10000.0,
                                scaling="llama" if (c.get("rope_scaling") or {}).get("rope_type") == "llama3"
                                else "none"),
        attn_backend="flex", fuse_qkv=True)
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention_norm = RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=norm_init)
        layer.ffn_norm = RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=norm_init)
    config = Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=norm_init),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        enable_weight_tying=shape.tie_embeddings,
        layers=layers)
    # Built in the default dtype, float32, as torchtitan builds it (a Module.to(dtype) would also turn
    # the complex RoPE cache real).
    return config.build()


def _build_qwen3(model: ModelSpec, *, num_layers: int | None, seq_len: int | None) -> nn.Module:
    """torchtitan's dense Qwen3Model from its own layer builder (qk-norm, cos/sin RoPE; its norms' eps is
    its constant 1e-6, Qwen3's)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_layers, _qwen3_norm
    from torchtitan.models.qwen3.model import Qwen3Model

    shape = StackShapes.of(model, num_layers=num_layers, seq_len=seq_len)
    dim, vocab = shape.dim, shape.vocab
    layers = _build_qwen3_layers(
        n_layers=shape.layers, dim=dim, n_heads=shape.heads, n_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        hidden_dim=shape.ffn, attn_backend="flex",
        rope=CosSinRoPE.Config(dim=shape.head_dim, max_seq_len=shape.seq_len,
                               theta=shape.rope_theta if shape.rope_theta is not None else 1000000.0))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        enable_weight_tying=shape.tie_embeddings, layers=layers).build()


def is_titan_model(net: nn.Module) -> bool:
    return type(net).__module__.startswith("torchtitan.")


def titan_blocks(net: nn.Module) -> TitanBlocks:
    return TitanBlocks(net, "layers", type(next(iter(net.layers.values()))).__name__)


def parallelize_titan(net: nn.Module, mesh, train: TrainConfig, *, allow_offload: bool = True) -> Blocks:
    """torchtitan's parallelize_llama for the tuned knobs (no tensor, context or pipeline parallelism):
    its checkpointing policy on every block, then its FSDP2 units (apply_fsdp_to_decoder)."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    check_titan_train(train)
    policy = titan_ac(train.activation_checkpointing)
    if policy != "none":
        config = FullAC.Config() if policy == "full" else SelectiveAC.Config()
        config.build(dump_folder="").apply(net)
    apply_fsdp_to_decoder(
        net, mesh, param_dtype=getattr(torch, PARAM_DTYPE_NAMES[train.precision]),
        reduce_dtype=getattr(torch, MASTER_DTYPE_NAMES[train.precision]), pp_enabled=False,
        cpu_offload=train.cpu_offload and allow_offload,
        reshard_after_forward_policy="always" if train.reshard_after_forward else "never")
    _sum_reduction_on_gloo(net, mesh)
    return titan_blocks(net)


def _sum_reduction_on_gloo(net: nn.Module, mesh) -> None:
    """apply_fsdp_to_decoder sets every unit's gradient divide factor to 1 (its trainer divides the loss
    by the global token count), which FSDP2 reduces with PREMUL_SUM(1.0): gloo has no PREMUL_SUM. On a
    gloo mesh, SUM, with the division by 1 FSDP2 then skips: the same tensors (autotune's EP does the same)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if dist.get_backend(mesh.get_group(mesh.ndim - 1)) != "gloo":
        return
    for module in net.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def prepare_titan_step(net: nn.Module) -> None:
    """What torchtitan's trainer does before training with its chunked loss: the model skips its head
    (the loss runs it), and the loss is given the (FSDP-wrapped) head."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    loss = ChunkedLossWrapper.Config(num_chunks=NUM_LOSS_CHUNKS,
                                     loss_fn=CrossEntropyLoss.Config(global_vocab_size=net.config.vocab_size)).build()
    loss.set_lm_head(net.lm_head)
    net._skip_lm_head = True
    net._autotune_chunked_loss = loss


def titan_loss(net: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """torchtitan's `_forward_backward_body` up to its `loss.backward()`: the decoder's hidden states,
    then the chunked head and loss (each chunk's backward runs here), normalised by the tokens.
    The head is called once per chunk outside any module's forward, each chunk's backward in between:
    the memory trackers take that for what it is, not a next iteration (sim._trace._SiteTracker,
    backends.real._capacity.CapacityTracker)."""
    loss, _ = net._autotune_chunked_loss(net(tokens), tokens, torch.tensor(tokens.numel(), device=tokens.device))
    return loss
