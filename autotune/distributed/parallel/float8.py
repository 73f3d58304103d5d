"""float8 training of the decoder blocks' linears (torchao), converted at build time."""

from __future__ import annotations

from torch import nn

from autotune.problem.catalog.blocks import Blocks
from autotune.problem.knobs import float8_converts

FLOAT8_SKIPPED = "lm_head"
"""What float8 never converts: the head stays high precision (torchtitan filters `output` / `lm_head`;
only the decoder blocks are converted here, so the head is never seen)."""


def float8_linear_config(recipe: str):
    """torchao's Float8LinearConfig for a recipe: `tensorwise` with FSDP2's float8 all-gather of the
    weights (torchtitan's --float8.enable_fsdp_float8_all_gather), `rowwise` torchao's recipe."""
    from torchao.float8 import Float8LinearConfig

    if recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    if recipe == "rowwise":
        return Float8LinearConfig.from_recipe_name("rowwise")
    raise ValueError(f"unknown float8 recipe {recipe!r}")


def apply_float8(blocks: Blocks, recipe: str) -> int:
    """Swap each decoder block's convertible linears for torchao's Float8Linear (`recipe` none: nothing),
    before checkpointing, compile and FSDP2, as torchtitan's float8 converter does at build time. The
    root (embeddings, head) stays high precision. Returns how many linears were converted."""
    if recipe == "none":
        return 0
    from torchao.float8 import convert_to_float8_training

    config = float8_linear_config(recipe)
    converted = 0

    def keep(module: nn.Module, fqn: str) -> bool:
        nonlocal converted
        ok = isinstance(module, nn.Linear) and float8_converts(tuple(module.weight.shape)) \
            and not fqn.endswith(FLOAT8_SKIPPED)
        converted += ok
        return ok

    for block in blocks.layers:
        convert_to_float8_training(block, config=config, module_filter_fn=keep)
    return converted
