"""LitGPT's own model and step (`--stack litgpt`, step `litgpt`): what the simulator traces and a real trial
runs where LitGPT 0.5 is importable and the model is a family it is built for here (config.LITGPT_FAMILIES).

Each piece is LitGPT's own code, called as its `litgpt pretrain` script calls it (litgpt 0.5.13,
pretrain.py `setup`/`fit`, utils.py `chunked_cross_entropy`; Lightning Fabric 2.6's FSDPPrecision):
- the model: `litgpt.model.GPT` from a `litgpt.Config` with the Hugging Face config's shapes (n_layer,
  n_head, n_query_groups, n_embd, head_size, intermediate_size, vocabulary as padded_vocab_size, rope_base,
  norm_eps; LLaMAMLP, RMSNorm, no biases, sequential residual), its RoPE cache sized to the sequence
  (pretrain sets `model.max_seq_length`);
- the precision (config.LITGPT_PRECISIONS, as export/_litgpt.py writes it): `bf16-true` (tuned bf16-pure)
  is the whole model in bf16 (Fabric's `convert_module`); `bf16-mixed` (tuned bf16) keeps fp32 parameters,
  gathers them in bf16 and reduces gradients in bf16 (FSDPPrecision's MixedPrecision: param, reduce and
  buffer dtype bf16, so the RoPE cache is bf16 too), and runs the forward under `torch.autocast` (its
  `forward_context`: autocast("cuda"), here on the run's device, so a CPU run autocasts as a GPU's does);
  `32-true` (tuned fp32) is fp32 throughout;
- the FSDP units: one per `Block` (its scripts' `auto_wrap_policy={Block}`) and the root; the tuned
  checkpointing on the Blocks (finetune_full hard-codes `activation_checkpointing_policy={Block}`, pretrain
  none: the tuned knob says which);
- the loss: pretrain's `chunked_cross_entropy(model(input_ids), targets)`, default chunk_size 128: the full
  logits, then cross-entropy over 128-row chunks of them.

Not LitGPT's: Fabric's FSDPStrategy is FSDP1 (flat parameters per unit); the units here are FSDP2's
(fully_shard per Block), whose gathered and sharded bytes per unit are the same but whose buffers are
per-parameter. finetune_full slices the logits (`logits[..., :-1, :]`) before the loss, a copy of the
logits pretrain does not make (not traced: the pretrain step is). LoRA (finetune_lora), compile, float8
and expert parallelism are not built here.
"""

from __future__ import annotations

import torch
from torch import nn

from autotune.problem.catalog.blocks import Blocks
from autotune.problem.catalog.models import ModelSpec
from autotune.problem.config import LITGPT_FAMILIES, LITGPT_PRECISIONS, TrainConfig
from autotune.util.errors import UsageError
from autotune.distributed.titan import StackShapes, check_titan_train


def build_litgpt_model(model: ModelSpec, *, num_layers: int | None = None, precision: str = "bf16",
                       seq_len: int | None = None) -> nn.Module:
    """LitGPT's GPT with the shapes of `model`'s Hugging Face config, on the current default device, in the
    dtype Fabric's precision gives it (bf16-true: bf16; bf16-mixed and 32-true: fp32)."""
    from litgpt import Config
    from litgpt.model import GPT

    if precision not in LITGPT_PRECISIONS:
        raise UsageError(f"--stack litgpt: precision {precision} is not one LitGPT trains in "
                         f"({', '.join(LITGPT_PRECISIONS)})")
    shape = StackShapes.of(model, num_layers=num_layers, seq_len=seq_len)
    config = Config(
        name=model.name, block_size=shape.seq_len, vocab_size=shape.vocab, padded_vocab_size=shape.vocab,
        n_layer=shape.layers, n_head=shape.heads, n_embd=shape.dim, head_size=shape.head_dim,
        n_query_groups=shape.kv_heads, intermediate_size=shape.ffn, rotary_percentage=1.0, parallel_residual=False,
        bias=False, norm_class_name="RMSNorm", norm_eps=shape.norm_eps,
        mlp_class_name=LITGPT_FAMILIES[model.model_type],
        rope_base=int(shape.rope_theta if shape.rope_theta is not None else 10000))
    net = GPT(config)
    net.max_seq_length = shape.seq_len
    if LITGPT_PRECISIONS[precision] != "32-true":
        # bf16-true: Fabric's convert_module, model.to(bf16). bf16-mixed: the parameters stay fp32 and FSDP's
        # buffer_dtype casts the RoPE cache (the only buffers) to bf16.
        net.to(torch.bfloat16) if LITGPT_PRECISIONS[precision] == "bf16-true" else _bf16_buffers(net)
    return net


def _bf16_buffers(net: nn.Module) -> None:
    net.cos, net.sin = net.cos.to(torch.bfloat16), net.sin.to(torch.bfloat16)


def is_litgpt_model(net: nn.Module) -> bool:
    return type(net).__module__.startswith("litgpt.")


def litgpt_blocks(net: nn.Module) -> Blocks:
    return Blocks(net.transformer, "h", "Block")


def init_litgpt(net: nn.Module) -> None:
    """After `to_empty`: pretrain's init (normal weights, its `reset_parameters`: RMSNorm's ones and the
    RoPE cache) in the dtype the cache had."""
    dtype = net.cos.dtype
    for module in net.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif module is not net and hasattr(module, "reset_parameters"):
            module.reset_parameters()
    net.cos, net.sin = (t.to(dtype) for t in net.rope_cache(device=net.cos.device))


def check_litgpt_train(train: TrainConfig) -> None:
    check_titan_train(train, stack="litgpt")


def prepare_litgpt_step(net: nn.Module, *, precision: str, device_type: str) -> None:
    """Fabric's forward_context under bf16-mixed: the forward inside torch.autocast(bf16); the instance's
    `forward` is replaced, so FSDP2's hooks (in `__call__`) run outside it, as FSDP runs outside Fabric's
    wrapper."""
    if LITGPT_PRECISIONS[precision] != "bf16-mixed":
        return
    from types import MethodType

    net.forward = MethodType(torch.autocast(device_type=device_type, dtype=torch.bfloat16)(net.forward.__func__), net)


def litgpt_loss(net: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """pretrain's `fit` up to its backward: `chunked_cross_entropy(model(input_ids), targets)` (the targets
    here the input tokens: the same shape and dtype as pretrain's shifted ones)."""
    from litgpt.utils import chunked_cross_entropy

    return chunked_cross_entropy(net(tokens), tokens)  # its default chunk_size (128), as pretrain calls it
