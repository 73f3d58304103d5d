"""Where a transformers model keeps its repeated decoder blocks: what FSDP wraps one by one, what
the catalog counts per block, what activation checkpointing wraps.

A question about the model's structure, not about parallelism: the catalog asks it to count a
model's parameters, parallel.py to wrap the blocks (and the FSDP2 export copies these functions
verbatim into its script).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from autotune.util.errors import UnsupportedModelError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo2", "and other "
                      "transformers decoders whose blocks sit in one nn.ModuleList")


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
    """The decoder layers: the largest nn.ModuleList of identical block classes, preferring one
    with a block per layer of the language model's config (a multimodal model's vision or audio
    tower can hold a larger list)."""
    depth = _config_depth(model)
    best: tuple[tuple[bool, int], nn.Module, str, str] | None = None
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            if not isinstance(child, nn.ModuleList) or len(child) == 0:
                continue
            classes = {_block_class_name(m) for m in child}
            if len(classes) != 1:
                continue
            rank = (len(child) == depth, sum(p.numel() for p in child.parameters()))
            if best is None or rank > best[0]:
                best = (rank, parent, attr, classes.pop())
    if best is None:
        raise UnsupportedModelError(
            f"{model.__class__.__name__} has no repeated decoder blocks (an nn.ModuleList of one "
            f"block class) for FSDP to wrap; supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    _, parent, attr, class_name = best
    return Blocks(parent, attr, class_name)


def _config_depth(model: nn.Module) -> int | None:
    """num_hidden_layers of the model's (text) config, where it says."""
    config = getattr(model, "config", None)
    try:
        config = config.get_text_config()
    except Exception:  # noqa: BLE001 - no config, or one without a text config
        pass
    try:
        value = getattr(config, "num_hidden_layers", None)
    except Exception:  # noqa: BLE001 - a per-layer config may refuse a global read
        return None
    return value if isinstance(value, int) else None


def _block_class_name(module: nn.Module) -> str:
    """The block's own class, seen through checkpoint_wrapper and through the FSDP<Class>
    subclass fully_shard swaps in: a parallelized model still shows its decoder blocks."""
    module = getattr(module, "_checkpoint_wrapped_module", module)
    return next(c.__name__ for c in type(module).__mro__ if not c.__name__.startswith("FSDP"))


def fused_experts(block: nn.Module) -> list[nn.Module]:
    """A decoder block's fused-expert modules: transformers 5 keeps a MoE block's experts in one
    module (MixtralExperts, Qwen3MoeExperts, GptOssExperts, ...) whose every weight is one tensor
    [num_experts, ...] and whose forward takes (hidden_states, top_k_index, top_k_weights). Told
    by that shape: an integer `num_experts` and its own parameters, a 3-D one among them, each with
    dimension 0 that long (the router, [num_experts, hidden], has no 3-D weight)."""
    found = []
    for module in block.modules():
        count, own = getattr(module, "num_experts", None), list(module.parameters(recurse=False))
        if isinstance(count, int) and not isinstance(count, bool) and any(p.dim() == 3 for p in own) \
                and all(p.dim() >= 2 and p.shape[0] == count for p in own):
            found.append(module)
    return found
