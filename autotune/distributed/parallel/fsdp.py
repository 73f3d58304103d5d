"""FSDP2: the mixed-precision policy of each stack, the shard placement, fully_shard bottom-up."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from autotune.problem.catalog.blocks import Blocks, fused_experts
from autotune.problem.config import PARAM_DTYPE_NAMES, TRL_STEPS, TrainConfig
from autotune.problem.knobs import shard_dim
from autotune.distributed.parallel.dims import expert_meshes

PARAM_DTYPES = {precision: getattr(torch, name) for precision, name in PARAM_DTYPE_NAMES.items()}


def mixed_precision_policy(precision: str, *, step: str = "autotune"):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision in ("fp32", "bf16-pure"):
        # Everything in the parameters' own dtype: fp32, or bf16 with bf16 reduction (pure bf16).
        return MixedPrecisionPolicy()
    if step == "litgpt":
        # Lightning Fabric's FSDPPrecision('bf16-mixed'): param, reduce (and buffer) dtype bf16.
        return MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[precision], reduce_dtype=PARAM_DTYPES[precision])
    if step in ("hf", *TRL_STEPS):
        # Accelerate's FSDP2 plugin under mixed_precision bf16/fp16 (accelerate 1.15,
        # FullyShardedDataParallelPlugin.set_mixed_precision): params, reduction and outputs all in it.
        dtype = PARAM_DTYPES[precision]
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype)
    # Mixed precision reduces gradients in fp32: written explicitly, since the default moved.
    return MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[precision], reduce_dtype=torch.float32)



def shard_placement_fn(mesh, placement: str):
    """fully_shard's shard_placement_fn for a placement (None: FSDP2's default, dim 0)."""
    if placement == "dim0":
        return None
    from torch.distributed.tensor import Shard

    shard_size = mesh.size(mesh.ndim - 1)  # HSDP shards over the mesh's last dimension

    def place(param: nn.Parameter):
        dim = shard_dim(tuple(param.shape), shard_size, placement)
        return Shard(dim) if dim else None
    return place


def apply_fsdp(model: nn.Module, blocks: Blocks, mesh, train: TrainConfig, *, allow_offload: bool = True,
               step: str = "autotune") -> None:
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
    mp = mixed_precision_policy(train.precision, step=step)
    place = shard_placement_fn(mesh, train.shard_placement)
    experts_mesh = expert_meshes(mesh)[1] if train.expert_parallel > 1 else None
    for block in blocks.layers:
        if experts_mesh is not None:
            # Each expert-parallel rank's own experts, sharded over the ranks that hold the same ones
            # (torchtitan's efsdp); their gradients averaged over every rank, as the others' are: a
            # sum with the division apart (gloo has no PREMUL_SUM, NCCL's torchtitan uses; one name
            # for the simulator, real trials and exports).
            for experts in fused_experts(block):
                fully_shard(experts, mesh=experts_mesh, mp_policy=mp, offload_policy=offload,
                            reshard_after_forward=train.fsdp_reshard_after_forward,
                            shard_placement_fn=shard_placement_fn(experts_mesh, train.shard_placement))
                experts.set_gradient_divide_factor(float(mesh.size()))
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=train.fsdp_reshard_after_forward, shard_placement_fn=place)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False,
                shard_placement_fn=place)
