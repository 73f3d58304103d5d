"""torch.compile per decoder block, as torchtitan's apply_compile."""

from __future__ import annotations

import torch

from autotune.problem.catalog.blocks import Blocks
from autotune.problem.knobs import COMPILE_BACKEND


def apply_compile(blocks: Blocks, mode: str, *, backend: str = COMPILE_BACKEND) -> int:
    """torch.compile each decoder block in place (`mode` 'blocks'; 'none' does nothing), after
    checkpointing wraps it (the checkpoint is inside the compiled region, as AOT autograd's
    partitioner then decides what is saved) and before FSDP2 shards it, as torchtitan's
    apply_compile orders it; `fullgraph=True` (a graph break is an error, not a silent eager
    fallback), `dynamic=False` (a trial's shapes are fixed). The block's `forward` is compiled
    rather than its `__call__` (torchtitan's `block.compile()`): FSDP2's hooks are excluded from
    compilation either way (torch._dynamo.config.skip_fsdp_hooks), and module hooks such as a
    memory tracker's stay outside the graph. The simulator passes `backend` (docs/COMPILE.md).
    Returns how many blocks were compiled."""
    if mode == "none":
        return 0
    if mode != "blocks":
        raise ValueError(f"unknown compile mode {mode!r}")
    import torch._dynamo

    # Every block shares its class's code object: one cache entry per guard set (shapes, checkpointing).
    # Past the limit dynamo would run the block eager without a word: an error instead.
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 64)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 1024)
    if not config.suppress_errors:
        config.fail_on_recompile_limit_hit = True
    for block in blocks.layers:
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=True, dynamic=False)
    return len(blocks.layers)
