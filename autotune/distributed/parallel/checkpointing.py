"""Activation checkpointing: whole blocks, every K-th, or op-level selective (torchtitan's)."""

from __future__ import annotations

import torch

from autotune.problem.catalog.blocks import Blocks
from autotune.problem.knobs import Checkpointing


def op_sac_policy(policy: str):
    """The op-level selective checkpointing policy: which op outputs a checkpointed block saves
    (the rest is recomputed in backward). `mm` saves every matmul output; `alt-mm` every other
    one (torchtitan's `op` selective AC, whose save list this is: matmuls, attention kernels,
    the reduce-scatter of tensor parallelism, max). Returns a fresh policy per forward: the
    matmul count must restart for each forward and each recompute."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    matmuls = {aten.mm.default, aten.addmm.default, aten.linear.default}
    save = set(matmuls) | {aten.max.default, torch.ops._c10d_functional.reduce_scatter_tensor.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            save.add(getattr(aten, name).default)
    counts = {"forward": 0, "recompute": 0}

    def decide(ctx, func, *args, **kwargs):
        if func in matmuls:
            phase = "recompute" if ctx.is_recompute else "forward"
            counts[phase] += 1
            if policy == "alt-mm" and counts[phase] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return decide


def apply_ac(blocks: Blocks, ac: Checkpointing) -> int:
    """Wrap checkpointed blocks in place (non-reentrant); op-level checkpointing wraps every
    block with a selective policy. Returns how many were wrapped."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    def contexts(policy: str):
        return create_selective_checkpoint_contexts(op_sac_policy(policy))

    options = {}
    if ac.mode == "op":
        options = dict(context_fn=partial(contexts, ac.policy), preserve_rng_state=False)
    wrapped = 0
    layers = blocks.layers
    for index in range(len(layers)):
        if ac.wraps_block(index):
            layers[index] = checkpoint_wrapper(layers[index], checkpoint_impl=CheckpointImpl.NO_REENTRANT, **options)
            wrapped += 1
    return wrapped
