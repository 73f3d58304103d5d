"""How a model is parallelized: the one `parallelize` real trials apply, the simulator traces and
the fsdp2 export's script copies (Lightning's export too), with one module per dimension, as
torchtitan's distributed/ package has them.

`ParallelDims` (dims) says how the world is split: `dp_shard` ranks hold one copy of the parameters
between them, `dp_replicate` such groups each hold a copy (HSDP), `tp` neighbouring ranks split each
block's linears (tensor), `ep` ranks of a shard group split the experts (expert), `cp` neighbouring
ranks split each sequence (context), `pp` blocks of ranks each hold a share of the blocks as pipeline
stages (pipeline, the mesh's outermost dimension). `build_mesh` makes the data mesh `fully_shard` receives (with cp,
dp_shard x cp flattened); the tp, ep and cp meshes are read back from its root.

Order matters, as in torchtitan's parallelize_llama: expert parallelism splits the experts, float8 converts
the blocks' linears (torchtitan's converters run at build time, before any split), tensor parallelism
splits them (with torchao's float8 styles under tensorwise float8), context parallelism switches
attention to the causal SDPA its ring computes, activation checkpointing wraps blocks
(fully_shard must see the wrapper so the recompute also all-gathers), then each block is compiled,
then each decoder block is sharded bottom-up (fsdp), then the root. Under pipeline parallelism
(apply_pp) the model is first split into this rank's stages, and each stage is checkpointed and sharded
as a whole model would be, the stage its FSDP root (torchtitan's pipeline_llm, then parallelize per part).
"""

from __future__ import annotations

from torch import nn

from autotune.problem.catalog.blocks import Blocks, find_decoder_blocks
from autotune.problem.config import TrainConfig
from autotune.util.errors import UsageError
from autotune.problem.knobs import COMPILE_BACKEND, CONTEXT_PARALLEL_STEPS
from autotune.distributed.parallel.checkpointing import apply_ac, op_sac_policy
from autotune.distributed.parallel.compile import apply_compile
from autotune.distributed.parallel.context import apply_cp
from autotune.distributed.parallel.dims import ParallelDims, context_mesh, expert_meshes, pipeline_mesh, tensor_mesh
from autotune.distributed.parallel.expert import ExpertDispatch, apply_ep, balanced_splits
from autotune.distributed.parallel.float8 import FLOAT8_SKIPPED, apply_float8, float8_linear_config
from autotune.distributed.parallel.fsdp import PARAM_DTYPES, apply_fsdp, mixed_precision_policy, shard_placement_fn
from autotune.distributed.parallel.pipeline import PipelineStageModule, apply_pp, split_stages, why_no_pipeline_stages
from autotune.distributed.parallel.tensor import apply_tp, enable_async_tp
from autotune.distributed.parallel.tracing import keep_leaf_inputs_collectable, register_rng_rules

__all__ = [
    "FLOAT8_SKIPPED", "PARAM_DTYPES", "ExpertDispatch", "ParallelDims", "apply_ac", "apply_compile", "apply_cp",
    "apply_ep", "apply_tp", "enable_async_tp", "apply_float8", "apply_fsdp", "balanced_splits", "context_mesh", "expert_meshes",
    "float8_linear_config", "keep_leaf_inputs_collectable", "mixed_precision_policy", "op_sac_policy", "parallelize",
    "register_rng_rules", "shard_placement_fn", "tensor_mesh", "PipelineStageModule", "apply_pp", "pipeline_mesh",
    "split_stages", "why_no_pipeline_stages",
]


def parallelize(model: nn.Module, mesh, train: TrainConfig, *, allow_offload: bool = True,
                compile_backend: str = COMPILE_BACKEND, step: str = "autotune") -> Blocks:
    """Apply the tuned configuration to a freshly built model, in place.

    `allow_offload=False` is for places that cannot pin host memory (no accelerator): the
    simulator then models offload from the trace instead of applying it. `compile_backend`: what
    compiled blocks are compiled with (the simulator's fake tensors cannot run inductor's kernels).
    `step` (config.stack_step): a stack's own mixed-precision policy where it differs; 'torchtitan':
    torchtitan's own parallelize_llama pieces on its own model (titan.parallelize_titan); 'litgpt': LitGPT's
    GPT, its Blocks the units (litgpt_step.litgpt_blocks) and Fabric's bf16-mixed policy.
    """
    if train.context_parallel > 1 and step not in CONTEXT_PARALLEL_STEPS:  # TrialSpec refuses it first
        raise UsageError(f"--cp {train.context_parallel}: context parallelism is built for the steps "
                         f"{CONTEXT_PARALLEL_STEPS} only, not {step!r}")
    if train.pipeline_parallel > 1:
        from autotune.problem.knobs import PIPELINE_PARALLEL_STEPS

        if step not in PIPELINE_PARALLEL_STEPS:  # TrialSpec refuses it first
            raise UsageError(f"--pp {train.pipeline_parallel}: pipeline stages are built for the steps "
                             f"{PIPELINE_PARALLEL_STEPS} only, not {step!r}")
        try:
            return apply_pp(model, mesh, train, allow_offload=allow_offload, compile_backend=compile_backend,
                            step=step)
        except ValueError as exc:  # a model the stage module cannot split: the user's to change
            raise UsageError(f"--pp {train.pipeline_parallel}: {exc}") from None
    if step == "torchtitan":
        from autotune.distributed.titan import parallelize_titan

        return parallelize_titan(model, mesh, train, allow_offload=allow_offload)
    if step == "litgpt":
        from autotune.distributed.litgpt_step import check_litgpt_train, litgpt_blocks

        check_litgpt_train(train)
        blocks = litgpt_blocks(model)
    else:
        blocks = find_decoder_blocks(model)
    apply_ep(blocks, mesh, train.expert_parallel)
    apply_float8(blocks, train.float8)  # at build time, before TP splits the converted linears (torchtitan)
    if train.tensor_parallel > 1:
        apply_tp(model, blocks, tensor_mesh(mesh), train.tensor_parallel, float8=train.float8,
                 loss_parallel=train.loss_parallel)
        if train.async_tensor_parallel:
            enable_async_tp(tensor_mesh(mesh), compile_backend=compile_backend)
    if train.context_parallel > 1:
        apply_cp(model, context_mesh(mesh))
    apply_ac(blocks, train.activation_checkpointing)
    apply_compile(blocks, train.compile, backend=compile_backend)
    apply_fsdp(model, blocks, mesh, train, allow_offload=allow_offload, step=step)
    return blocks
