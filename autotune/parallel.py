"""The one FSDP2 wrapping function: real trials apply it, the simulator traces it, exports describe it.

Order matters, as in torchtitan's parallelize_llama: activation checkpointing wraps blocks
first (fully_shard must see the wrapper so the recompute also all-gathers), then each decoder
block is sharded bottom-up, then the root.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from autotune.config import PARAM_DTYPE_NAMES, TrainConfig, is_checkpointed
from autotune.errors import UnsupportedModelError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo2", "and other "
                      "transformers decoders whose blocks sit in one nn.ModuleList")

PARAM_DTYPES = {precision: getattr(torch, name) for precision, name in PARAM_DTYPE_NAMES.items()}


@dataclass(frozen=True)
class Blocks:
    """Where the repeated decoder blocks live: `parent.<attr>` is an nn.ModuleList."""

    parent: nn.Module
    attr: str
    class_name: str

    @property
    def layers(self) -> nn.ModuleList:
        return getattr(self.parent, self.attr)


def find_decoder_blocks(model: nn.Module) -> Blocks:
    """The largest nn.ModuleList of identical block classes: the decoder layers."""
    best: tuple[int, nn.Module, str, str] | None = None
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            if not isinstance(child, nn.ModuleList) or len(child) == 0:
                continue
            classes = {_block_class_name(m) for m in child}
            if len(classes) != 1:
                continue
            size = sum(p.numel() for p in child.parameters())
            if best is None or size > best[0]:
                best = (size, parent, attr, classes.pop())
    if best is None:
        raise UnsupportedModelError(
            f"{model.__class__.__name__} has no repeated decoder blocks (an nn.ModuleList of one "
            f"block class) for FSDP to wrap; supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    _, parent, attr, class_name = best
    return Blocks(parent, attr, class_name)


def _block_class_name(module: nn.Module) -> str:
    """The block's own class, seen through checkpoint_wrapper and through the FSDP<Class>
    subclass fully_shard swaps in: a parallelized model still shows its decoder blocks."""
    module = getattr(module, "_checkpoint_wrapped_module", module)
    return next(c.__name__ for c in type(module).__mro__ if not c.__name__.startswith("FSDP"))


def mixed_precision_policy(precision: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "fp32":
        return MixedPrecisionPolicy()
    # Gradients are always reduced in fp32: written explicitly, since the default moved.
    return MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[precision], reduce_dtype=torch.float32)


def apply_ac(blocks: Blocks, mode: str) -> int:
    """Wrap checkpointed blocks in place (non-reentrant). Returns how many were wrapped."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    wrapped = 0
    layers = blocks.layers
    for index in range(len(layers)):
        if is_checkpointed(mode, index):
            layers[index] = checkpoint_wrapper(layers[index], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            wrapped += 1
    return wrapped


def apply_fsdp(model: nn.Module, blocks: Blocks, mesh, train: TrainConfig, *, allow_offload: bool = True) -> None:
    """fully_shard each block, then the root. The root is never resharded after forward
    (its parameters are needed again at once in backward), as FSDP2's default does."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    offload = OffloadPolicy()
    if train.cpu_offload:
        if allow_offload:
            offload = CPUOffloadPolicy(pin_memory=True)
        else:
            warnings.warn("cpu_offload requested but not applied here (no accelerator): "
                          "its memory is modelled, not traced", stacklevel=2)
    mp = mixed_precision_policy(train.precision)
    for block in blocks.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=train.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)


def parallelize(model: nn.Module, mesh, train: TrainConfig, *, allow_offload: bool = True) -> Blocks:
    """Apply the tuned configuration to a freshly built model, in place.

    `allow_offload=False` is for places that cannot pin host memory (no accelerator): the
    simulator then models offload from the trace instead of applying it.
    """
    blocks = find_decoder_blocks(model)
    apply_ac(blocks, train.activation_checkpointing)
    apply_fsdp(model, blocks, mesh, train, allow_offload=allow_offload)
    return blocks
