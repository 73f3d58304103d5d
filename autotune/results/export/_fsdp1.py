"""FSDP1 (`FullyShardedDataParallel`) keyword arguments, and Lightning's FSDPStrategy (which
wraps FSDP1): Python modules, since policies and dtypes are objects, not strings."""

from __future__ import annotations

import torch

from autotune.results.export._base import (Export, Mapper, Tuned, block_import, build_export, map_attention,
                                           torchrun_launch)

FSDP1_TARGET = (f"PyTorch FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel, deprecated in favour of "
                f"fully_shard), torch {torch.__version__.split('+')[0]}")


def _lightning_target() -> str:
    try:
        import lightning

        version = lightning.__version__
    except ImportError:  # the exporter does not need Lightning installed
        version = "2.6"
    return f"Lightning {version} (lightning.pytorch.strategies.FSDPStrategy, FSDP1 underneath)"


def optimizer_kwargs(impl: str) -> dict[str, bool]:
    """torch.optim.AdamW arguments that select the traced implementation (spelled out: torch's
    default is foreach on CUDA, which allocates temporaries the loop does not)."""
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[impl]


def _dtype(name: str) -> str:
    return f"torch.{name}"


def _map_common(m: Mapper, t: Tuned, *, ac_key: str, sharding_key: str, offload_key: str,
                state_key: str) -> None:
    """The knobs FSDP1 and Lightning's FSDPStrategy express the same way."""
    m.mapped("precision", f"MixedPrecision(param_dtype={_dtype(t.param_dtype)})")
    m.mapped("reduce_dtype", "MixedPrecision(reduce_dtype=torch.float32)")
    if t.ac_every is None or t.ac_every == 1:
        m.mapped("activation_checkpointing", ac_key)
    else:
        m.mapped("activation_checkpointing", ac_key,
                 f"blocks whose self_attn.layer_idx % {t.ac_every} == 0, as tuned")
    m.mapped("reshard_after_forward", f"{sharding_key}={t.sharding_strategy}")
    if _hybrid(t):
        m.mapped("shard_group_size", f"{sharding_key}={t.sharding_strategy} (FSDP1 shards within each node, "
                                     "replicates across nodes: the tuned groups of one node)")
    if t.cpu_offload:
        m.approximated("cpu_offload", offload_key,
                       "FSDP1 offloads parameters and gradients and steps the optimizer on the CPU like "
                       "FSDP2's CPUOffloadPolicy, but its memory and speed were not measured")
        if t.grad_accum_steps > 1:
            m.warn("FSDP1 with CPU offload gives wrong gradients when accumulating outside no_sync(); "
                   "accumulate inside model.no_sync() for all but the last micro-batch (more memory than "
                   "was tuned) or use the fsdp2 export")
    else:
        m.mapped("cpu_offload", f"{offload_key} off")
    m.mapped("wrap", f"{t.wrap} (auto wrap policy)")
    m.mapped("state_dict_type", f"{state_key} ({t.state_dict_type})")
    m.mapped("optimizer_impl", f"OPTIMIZER_KWARGS = {optimizer_kwargs(t.optimizer_impl)} for torch.optim.AdamW")
    map_attention(m, t, "ATTN_IMPLEMENTATION for from_pretrained(..., attn_implementation=...)")


def _attention_constant(t: Tuned) -> str:
    """The attention the memory was predicted for, for the user's model loading (these files do not load it)."""
    return ("# AutoModelForCausalLM.from_pretrained(..., attn_implementation=ATTN_IMPLEMENTATION): the attention\n"
            f"# the memory was predicted for.\nATTN_IMPLEMENTATION = {t.attention!r}\n")


def _ac_check(t: Tuned) -> str:
    """Python for `is_checkpointed(block)`: which decoder blocks to checkpoint."""
    if t.ac_every is None:
        return "def is_checkpointed(module):\n    return False  # no activation checkpointing was tuned\n"
    if t.ac_every == 1:
        return f"def is_checkpointed(module):\n    return isinstance(module, {t.wrap})\n"
    return (f"def is_checkpointed(module):\n"
            f"    # every:{t.ac_every} as tuned: blocks 0, {t.ac_every}, {2 * t.ac_every}, ...\n"
            f"    return isinstance(module, {t.wrap}) and module.self_attn.layer_idx % {t.ac_every} == 0\n")


def export_fsdp1(t: Tuned) -> Export:
    m = Mapper()
    _map_common(m, t, ac_key="apply_activation_checkpointing(check_fn=is_checkpointed)",
                sharding_key="sharding_strategy", offload_key="cpu_offload=CPUOffload(offload_params=True)",
                state_key="FSDP.set_state_dict_type")
    m.mapped("micro_batch_size", "MICRO_BATCH_SIZE (your DataLoader's batch_size)")
    m.mapped("grad_accum_steps", "GRAD_ACCUM_STEPS (your loop)")
    m.mapped("world_size", torchrun_launch(t))
    body = f'''"""FullyShardedDataParallel arguments for the tuned configuration.

Usage (after dist.init_process_group and torch.cuda.set_device):
    model = wrap(model)   # FSDP + activation checkpointing, as tuned
"""

import functools

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import (
    CPUOffload,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

{block_import(t)}

MICRO_BATCH_SIZE = {t.micro_batch_size}
GRAD_ACCUM_STEPS = {t.grad_accum_steps}
SEQ_LEN = {t.seq_len}
STATE_DICT_TYPE = StateDictType.{t.state_dict_enum}
# torch.optim.AdamW(model.parameters(), lr=..., **OPTIMIZER_KWARGS): the implementation autotune traced.
OPTIMIZER_KWARGS = {optimizer_kwargs(t.optimizer_impl)!r}
{_attention_constant(t)}

FSDP_KWARGS = dict(
    sharding_strategy=ShardingStrategy.{t.sharding_strategy},
    auto_wrap_policy=ModuleWrapPolicy({{{t.wrap}}}),
    # No buffer_dtype: FSDP1's root would cast every buffer, RoPE's inv_freq included, and rounded
    # to 16 bits the rotation angles at long positions are off by radians. Buffers stay fp32.
    mixed_precision=MixedPrecision(param_dtype={_dtype(t.param_dtype)}, reduce_dtype=torch.float32),
    cpu_offload=CPUOffload(offload_params={t.cpu_offload}),
    use_orig_params=True,
    limit_all_gathers=True,
)


{_ac_check(t)}

def wrap(model):
    """Shard `model` with FSDP1 and checkpoint the tuned blocks (non-reentrant)."""
    model = FSDP(model, device_id=torch.cuda.current_device() if torch.cuda.is_available() else None,
                 **FSDP_KWARGS)
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=is_checkpointed,
    )
    FSDP.set_state_dict_type(model, STATE_DICT_TYPE)
    return model
'''
    return build_export(fmt="fsdp1", filename="fsdp1_kwargs.py", target=FSDP1_TARGET, tuned=t, mapper=m,
                        expresses=_hybrid(t),
                        body=body)


def export_lightning_fsdp1(t: Tuned) -> Export:
    """Lightning's FSDP1 FSDPStrategy, on request: flat parameters per wrapped block, a different
    memory layout and communication pattern from the FSDP2 run autotune traced and measured
    (the `lightning` format is FSDP2)."""
    m = Mapper()
    _map_common(m, t, ac_key="FSDPStrategy(activation_checkpointing_policy=...)",
                sharding_key="sharding_strategy", offload_key="FSDPStrategy(cpu_offload=True)",
                state_key="FSDPStrategy(state_dict_type=...)")
    m.mapped("micro_batch_size", "DataLoader(batch_size=MICRO_BATCH_SIZE)")
    m.mapped("grad_accum_steps", "Trainer(accumulate_grad_batches=...)")
    m.mapped("world_size", "Trainer(devices=..., num_nodes=...)")
    # "32-true": no autocast; the explicit MixedPrecision below casts, as FSDP2's policy does in the
    # traced run. Only fp16 keeps "16-mixed", the one mode in which Lightning builds a ShardedGradScaler.
    precision = "16-mixed" if t.precision == "fp16" else "32-true"
    if t.precision == "fp16":
        m.warn("fp16: Trainer(precision='16-mixed') for Lightning's ShardedGradScaler also runs the forward under "
               "torch.autocast(float16) on top of the MixedPrecision policy: ops autocast keeps in float32 "
               "(softmax, the loss) change the activation memory from what was traced")
    if t.ac_every is None:
        ac_policy = "None"
    elif t.ac_every == 1:
        ac_policy = f"{{{t.wrap}}}"
    else:
        ac_policy = "functools.partial(lambda_auto_wrap_policy, lambda_fn=is_checkpointed)"
    body = f'''"""Lightning FSDPStrategy and Trainer arguments for the tuned configuration.

Usage:
    trainer = Trainer(strategy=make_strategy(), **TRAINER_KWARGS)
    loader = DataLoader(dataset, batch_size=MICRO_BATCH_SIZE)
The explicit mixed_precision= below is the tuned policy ({t.param_dtype} compute, fp32 gradient
reduction, fp32 master weights and buffers); Trainer(precision={precision!r}) keeps Lightning from
adding its own ("bf16-mixed" would autocast every forward and reduce gradients in bf16). FSDP2 in
Lightning goes through ModelParallelStrategy instead; the knobs above are FSDP1's equivalents.
"""

import functools

import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

{block_import(t)}

MICRO_BATCH_SIZE = {t.micro_batch_size}
# In configure_optimizers: torch.optim.AdamW(self.parameters(), lr=..., **OPTIMIZER_KWARGS), as traced.
OPTIMIZER_KWARGS = {optimizer_kwargs(t.optimizer_impl)!r}
{_attention_constant(t)}SEQ_LEN = {t.seq_len}
TRAINER_KWARGS = dict(
    accelerator="gpu",
    devices={t.gpus_per_node},
    num_nodes={t.nodes},
    precision={precision!r},
    accumulate_grad_batches={t.grad_accum_steps},
)


{_ac_check(t)}

def make_strategy() -> FSDPStrategy:
    return FSDPStrategy(
        auto_wrap_policy={{{t.wrap}}},
        activation_checkpointing_policy={ac_policy},
        sharding_strategy={t.sharding_strategy!r},
        cpu_offload={t.cpu_offload},
        # No buffer_dtype: buffers (RoPE's inv_freq) stay fp32, as in the FSDP2 run that was tuned.
        mixed_precision=MixedPrecision(param_dtype={_dtype(t.param_dtype)}, reduce_dtype=torch.float32),
        state_dict_type={t.state_dict_type!r},
        use_orig_params=True,
        limit_all_gathers=True,
    )
'''
    m.warn("FSDP1 (FSDPStrategy): flat parameters per wrapped block, not the FSDP2 per-parameter sharding "
           "that was traced and measured; memory and speed differ. The `lightning` format is FSDP2")
    return build_export(fmt="lightning-fsdp1", filename="lightning_fsdp1.py", target=_lightning_target(), tuned=t,
                        expresses=_hybrid(t),
                        mapper=m, body=body)


def _hybrid(t: Tuned) -> tuple[str, ...]:
    """FSDP1's HYBRID_SHARD shards within a node: it expresses HSDP with groups of one node only."""
    return ("hsdp",) if t.shard_group_size and t.shard_group_size == t.gpus_per_node else ()
