"""Tensor parallelism: each decoder block's linears split over the tp ranks, as the model's own
tensor-parallel plan says (transformers' `base_model_tp_plan`, e.g. Llama's: q/k/v and gate/up
column-wise, o and down row-wise), with sequence parallelism between them, applied with torch's
`parallelize_module` in torchtitan's layout (apply_tp).

Built: the plan's `colwise` and `rowwise` entries on the decoder blocks, the blocks' norms and the final
norm on a sequence shard, the embeddings and head whole on every tp rank (FSDP shards them over the data
ranks). Not built, and refused by name where asked (knobs.check_combination): loss parallelism, async TP,
plan entries other than colwise/rowwise (MoE experts' local_* and the like), TP with HSDP, expert
parallelism, compile, float8 or CPU offload."""

from __future__ import annotations

from typing import Any

from torch import nn

from autotune.problem.catalog.blocks import Blocks
from autotune.problem.knobs import block_plan


def model_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The base model's tensor-parallel plan from its (text) config."""
    config = getattr(model, "config", None)
    try:
        config = config.get_text_config()
    except Exception:  # noqa: BLE001 - no config, or one without a text config
        pass
    return getattr(config, "base_model_tp_plan", None)


def _gather_sequence(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a block's attention or MLP under sequence parallelism: its input (the first
    positional argument, or `hidden_states`), a sequence shard between the blocks' norms, is all-gathered
    to the whole sequence as a plain tensor (backward: a reduce-scatter of its gradient), as torch's
    PrepareModuleInput does, whichever way the family's decoder layer passes it."""
    from torch.distributed.tensor import DTensor, Replicate

    def whole(value):
        return value.redistribute(placements=[Replicate()]).to_local() if isinstance(value, DTensor) else value

    if args:
        args = (whole(args[0]), *args[1:])
    if "hidden_states" in kwargs:
        kwargs = {**kwargs, "hidden_states": whole(kwargs["hidden_states"])}
    return args, kwargs


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def apply_tp(model: nn.Module, blocks: Blocks, tp_mesh: Any, degree: int) -> int:
    """Tensor parallelism over `degree` ranks (1: nothing), with sequence parallelism between the blocks'
    linears, as torchtitan's apply_tp lays it out: the plan's colwise linears split their outputs, the rowwise
    ones reduce-scatter theirs to a sequence shard (Shard(1)); each block's norms run on that shard
    (SequenceParallel), and its attention and MLP all-gather their input (_gather_sequence); the embeddings'
    output is split to the sequence shard and the head's input gathered back, both left whole on each rank
    (tied embeddings stay tied; no loss parallelism). Before checkpointing and FSDP (torchtitan's order).
    Returns how many linears were split."""
    if degree == 1:
        return 0
    plan = _colwise_rowwise_plan(model)
    final_norm = getattr(blocks.parent, "norm", None)
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if final_norm is None or embeddings is None or head is None:
        raise ValueError(f"{type(model).__name__}: no final norm, embeddings or head where sequence parallelism "
                         "expects them")
    return _apply_tp_parts(plan, blocks, tp_mesh, embeddings=embeddings, final_norm=final_norm, head=head)


def apply_tp_stage(model: nn.Module, blocks: Blocks, tp_mesh: Any, degree: int, *, embeddings: nn.Module | None,
                   final_norm: nn.Module | None, head: nn.Module | None) -> int:
    """apply_tp on one pipeline stage (parallel/pipeline.py) of `model` (the causal LM whose plan is read): the
    stage's `blocks` as apply_tp splits a whole model's, and of the embeddings, final norm and head those the
    stage holds (None: another stage's). The stage passes its residual stream on as each tp rank's sequence
    shard, a plain tensor (PipelineStageModule turns it into one and back). Returns how many linears were split."""
    if degree == 1:
        return 0
    return _apply_tp_parts(_colwise_rowwise_plan(model), blocks, tp_mesh, embeddings=embeddings,
                           final_norm=final_norm, head=head)


def _colwise_rowwise_plan(model: nn.Module) -> dict[str, str]:
    plan = block_plan(model_tp_plan(model))
    if not plan or any(style not in ("colwise", "rowwise") for style in plan.values()):
        raise ValueError(f"{type(model).__name__}: no tensor-parallel plan of colwise/rowwise entries to apply")
    return plan


def _apply_tp_parts(plan: dict[str, str], blocks: Blocks, tp_mesh: Any, *, embeddings: nn.Module | None,
                    final_norm: nn.Module | None, head: nn.Module | None) -> int:
    """apply_tp's layout on the blocks, and on each of the embeddings, final norm and head that is not None."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    styles = {"colwise": lambda: ColwiseParallel(),
              "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    split = 0
    # The units whose input is gathered: the modules holding the plan's linears (self_attn, mlp, ...).
    gathering = sorted({key.rsplit(".", 1)[0] for key in plan if "." in key})
    for block in blocks.layers:
        parallelize_module(block, tp_mesh, {
            **{key: styles[style]() for key, style in plan.items()},
            **{name: SequenceParallel() for name, child in block.named_children() if _is_norm(child)}})
        for name in gathering:
            block.get_submodule(name).register_forward_pre_hook(_gather_sequence, with_kwargs=True)
        split += len(plan)
    if embeddings is not None:
        parallelize_module(embeddings, tp_mesh, PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False))
    if final_norm is not None:
        parallelize_module(final_norm, tp_mesh, SequenceParallel())
    if head is not None:
        parallelize_module(head, tp_mesh, PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                                             use_local_output=True))
    return split
