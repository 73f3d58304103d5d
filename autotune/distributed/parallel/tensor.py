"""Tensor parallelism: each decoder block's linears split over the tp ranks, as the model's own
tensor-parallel plan says (transformers' `base_model_tp_plan`, e.g. Llama's: q/k/v and gate/up
column-wise, o and down row-wise), with sequence parallelism between them, applied with torch's
`parallelize_module` in torchtitan's layout (apply_tp).

Built: the plan's `colwise` and `rowwise` entries on the decoder blocks, the blocks' norms and the final
norm on a sequence shard, the embeddings and head whole on every tp rank (FSDP shards them over the data
ranks); with float8 (converted first, torchtitan's order) and compiled blocks. Not built, and refused by
name where asked (knobs.check_combination): loss parallelism, plan entries other than
colwise/rowwise (MoE experts' local_* and the like), TP with HSDP, expert parallelism or CPU offload, and
compiled blocks checkpointed whole (torch 2.13's AOT autograd saves the mesh among the tensors).
Async TP (enable_async_tp) on GPUs: inductor's micro-pipeline pass rewrites the compiled blocks' all-gather ->
matmul and matmul -> reduce-scatter pairs into torch's fused symmetric-memory ops."""

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

    return _with_hidden_states(args, kwargs, whole)


def _with_hidden_states(args: tuple, kwargs: dict, gather) -> tuple[tuple, dict]:
    """A block's attention or MLP arguments with `gather` applied to its hidden states: the first positional
    argument, or the `hidden_states` keyword (HF families pass them either way)."""
    if args:
        args = (gather(args[0]), *args[1:])
    if "hidden_states" in kwargs:
        kwargs = {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
    return args, kwargs


def _gather_sequence_in_float8(module: nn.Module, args: tuple, kwargs: dict):
    """_gather_sequence under tensorwise float8: the sequence shard is cast to float8 and then all-gathered,
    left a DTensor of torchao's Float8TrainingTensor that each colwise linear takes as cast (torchao's
    PrepareFloat8ModuleInput, as torchtitan's apply_tp lays it out: one cast of a shard, half the bytes
    gathered, where _gather_sequence gathers the compute dtype and each colwise linear casts the whole)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    prepare = module._float8_input

    def whole(value):
        if not isinstance(value, DTensor):
            return value
        return prepare._prepare_input_arg(value, value.device_mesh, Shard(1), Replicate())

    return _with_hidden_states(args, kwargs, whole)


def _float8_input(module: nn.Module):
    """A PrepareFloat8ModuleInput configured as its _apply configures one (the linear_mm_config of the
    module's float8 linears), for _gather_sequence_in_float8 to call (not applied as a style: families
    pass the hidden states by position or by keyword, which a style's layouts must name)."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

    prepare = PrepareFloat8ModuleInput(use_local_output=False)
    configs = [m.linear_mm_config for m in module.modules() if isinstance(m, Float8Linear)]
    if not configs or any(config != configs[0] for config in configs):
        raise ValueError(f"{type(module).__name__}: float8 tensor parallelism needs its linears converted with one "
                         "config (torchao's PrepareFloat8ModuleInput casts their input once)")
    prepare.linear_mm_config = configs[0]
    return prepare


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def apply_tp(model: nn.Module, blocks: Blocks, tp_mesh: Any, degree: int, *, float8: str = "none",
             loss_parallel: bool = False) -> int:
    """Tensor parallelism over `degree` ranks (1: nothing), with sequence parallelism between the blocks'
    linears, as torchtitan's apply_tp lays it out: the plan's colwise linears split their outputs, the rowwise
    ones reduce-scatter theirs to a sequence shard (Shard(1)); each block's norms run on that shard
    (SequenceParallel), and its attention and MLP all-gather their input (_gather_sequence); the embeddings'
    output is split to the sequence shard and the head's input gathered back, both left whole on each rank
    (tied embeddings stay tied). After float8 converts the linears, before checkpointing and FSDP (torchtitan's
    order); `float8` the recipe they were converted with (_linear_styles). `loss_parallel` (an untied head): the
    head split by vocabulary instead, its logits left a DTensor of vocabulary shards that the model's
    cross-entropy computes on within torch's loss_parallel (training._micro_batch opens it: the model's
    `loss_parallel`), as torchtitan's default. Returns how many linears were split."""
    if degree == 1:
        return 0
    plan = _colwise_rowwise_plan(model)
    final_norm = getattr(blocks.parent, "norm", None)
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if final_norm is None or embeddings is None or head is None:
        raise ValueError(f"{type(model).__name__}: no final norm, embeddings or head where sequence parallelism "
                         "expects them")
    model.loss_parallel = loss_parallel
    return _apply_tp_parts(plan, blocks, tp_mesh, embeddings=embeddings, final_norm=final_norm, head=head,
                           float8=float8, loss_parallel=loss_parallel)


def enable_async_tp(tp_mesh: Any, *, compile_backend: str) -> bool:
    """Async TP as torchtitan's maybe_enable_async_tp turns it on: inductor's micro-pipeline pass
    (torch._inductor.config._micro_pipeline_tp) splits each all-gather feeding a matmul, and each matmul feeding
    a reduce-scatter, of the compiled blocks into per-rank chunks exchanged over symmetric memory while the
    other chunks multiply (torch.distributed._symmetric_memory's fused_all_gather_matmul and
    fused_matmul_reduce_scatter; torch >= 2.9 rendezvouses the group itself). Only where inductor compiles on
    CUDA: the fused ops have no CPU kernel, and the simulator (another compile backend) traces the unfused graph,
    whose tensors the fused ops allocate alike; the flag is process-wide, so nothing is set elsewhere.
    Returns whether it was turned on."""
    if compile_backend != "inductor" or getattr(tp_mesh, "device_type", "cpu") != "cuda":
        return False
    import torch._inductor.config

    torch._inductor.config._micro_pipeline_tp = True
    return True


def apply_tp_stage(model: nn.Module, blocks: Blocks, tp_mesh: Any, degree: int, *, embeddings: nn.Module | None,
                   final_norm: nn.Module | None, head: nn.Module | None, float8: str = "none") -> int:
    """apply_tp on one pipeline stage (parallel/pipeline.py) of `model` (the causal LM whose plan is read): the
    stage's `blocks` as apply_tp splits a whole model's, and of the embeddings, final norm and head those the
    stage holds (None: another stage's). The stage passes its residual stream on as each tp rank's sequence
    shard, a plain tensor (PipelineStageModule turns it into one and back). `float8`: the recipe the blocks'
    linears were converted with, as apply_tp's. Returns how many linears were split."""
    if degree == 1:
        return 0
    return _apply_tp_parts(_colwise_rowwise_plan(model), blocks, tp_mesh, embeddings=embeddings,
                           final_norm=final_norm, head=head, float8=float8)


def _colwise_rowwise_plan(model: nn.Module) -> dict[str, str]:
    plan = block_plan(model_tp_plan(model))
    if not plan or any(style not in ("colwise", "rowwise") for style in plan.values()):
        raise ValueError(f"{type(model).__name__}: no tensor-parallel plan of colwise/rowwise entries to apply")
    return plan


def _linear_styles(float8: str) -> tuple[type, type]:
    """The (colwise, rowwise) styles for the plan's linears: torchao's Float8ColwiseParallel and
    Float8RowwiseParallel on linears converted with tensorwise float8 (their weights and the inputs they
    receive cast to float8 before the split's collectives, torchtitan's enable_float8_tensorwise_tp), torch's
    own otherwise (rowwise float8: torchtitan keeps regular TP, the collectives in high precision). The
    attention and MLP inputs are then gathered in float8 (_gather_sequence_in_float8) under tensorwise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if float8 == "tensorwise":
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        return Float8ColwiseParallel, Float8RowwiseParallel
    return ColwiseParallel, RowwiseParallel


def _apply_tp_parts(plan: dict[str, str], blocks: Blocks, tp_mesh: Any, *, embeddings: nn.Module | None,
                    final_norm: nn.Module | None, head: nn.Module | None, float8: str = "none",
                    loss_parallel: bool = False) -> int:
    """apply_tp's layout on the blocks, and on each of the embeddings, final norm and head that is not None."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   SequenceParallel, parallelize_module)

    colwise, rowwise = _linear_styles(float8)
    styles = {"colwise": lambda: colwise(),
              "rowwise": lambda: rowwise(output_layouts=Shard(1), use_local_output=False)}
    split = 0
    # The units whose input is gathered: the modules holding the plan's linears (self_attn, mlp, ...).
    gathering = sorted({key.rsplit(".", 1)[0] for key in plan if "." in key})
    for block in blocks.layers:
        parallelize_module(block, tp_mesh, {
            **{key: styles[style]() for key, style in plan.items()},
            **{name: SequenceParallel() for name, child in block.named_children() if _is_norm(child)}})
        for name in gathering:
            unit = block.get_submodule(name)
            if float8 == "tensorwise":
                unit._float8_input = _float8_input(unit)
                unit.register_forward_pre_hook(_gather_sequence_in_float8, with_kwargs=True)
            else:
                unit.register_forward_pre_hook(_gather_sequence, with_kwargs=True)
        split += len(plan)
    if embeddings is not None:
        parallelize_module(embeddings, tp_mesh, PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False))
    if final_norm is not None:
        parallelize_module(final_norm, tp_mesh, SequenceParallel())
    if head is not None and loss_parallel:  # torchtitan's output layer under loss parallelism
        parallelize_module(head, tp_mesh, ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                                          use_local_output=False))
    elif head is not None:
        parallelize_module(head, tp_mesh, PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                                             use_local_output=True))
    return split
