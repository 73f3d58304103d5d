"""The one FSDP2 wrapping function and the one device mesh: real trials apply them, the
simulator traces them, the fsdp2 export's script imports them (Lightning's export copies them).

`ParallelDims` (after torchtitan's) says how the world is split: `dp_shard` ranks hold one
copy of the parameters between them, `dp_replicate` such groups each hold a copy (HSDP:
sharded within a group, the gradients all-reduced across groups). `build_mesh` makes the mesh
`fully_shard` receives: 1-D for plain FSDP, 2-D `(dp_replicate, dp_shard)` for HSDP.

Order matters, as in torchtitan's parallelize_llama: activation checkpointing wraps blocks
first (fully_shard must see the wrapper so the recompute also all-gathers), then each block is
compiled (torch.compile knob), then each decoder block is sharded bottom-up, then the root. float8
converts the blocks' linears before all of it, as torchtitan's model converters run at build time.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from autotune.catalog.blocks import Blocks, find_decoder_blocks, fused_experts
from autotune.config import PARAM_DTYPE_NAMES, TRL_STEPS, TrainConfig
from autotune.knobs import COMPILE_BACKEND, Checkpointing, float8_converts, shard_dim

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


@dataclass(frozen=True)
class ParallelDims:
    """How the ranks split: `dp_replicate` groups of `dp_shard` ranks. Ranks are numbered node by
    node (torchrun), and a mesh is laid out row-major, so a shard group of up to a node's GPUs
    stays within a node: its all-gathers and reduce-scatters never leave it.

    Expert parallelism (`ep` > 1, torchtitan's layout: the EP degree borrowed from dp_shard) splits
    the shard group as (dp_shard / ep, ep): ep neighbouring ranks hold different experts (their
    all-to-alls stay within a node where ep divides it), and the dp_shard / ep ranks that hold the
    same experts shard them with FSDP. Every other parameter is sharded over all dp_shard ranks."""

    dp_replicate: int
    dp_shard: int
    ep: int = 1

    @classmethod
    def of(cls, train: TrainConfig, world_size: int) -> "ParallelDims":
        shard = train.shard_group_size or world_size
        if world_size % shard:
            raise ValueError(f"shard group size {shard} does not divide the world size {world_size}")
        ep = train.expert_parallel
        if shard % ep:
            raise ValueError(f"expert-parallel degree {ep} does not divide the shard group of {shard} ranks")
        if ep > 1 and shard != world_size:
            raise ValueError("expert parallelism with HSDP is not built here: use a shard group of every rank")
        return cls(dp_replicate=world_size // shard, dp_shard=shard, ep=ep)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.dp_replicate, self.dp_shard) if self.hsdp else (self.dp_shard,)

    @property
    def dim_names(self) -> tuple[str, ...]:
        return ("dp_replicate", "dp_shard") if self.hsdp else ("dp_shard",)

    def build_mesh(self, device_type: str):
        """The mesh fully_shard takes: a 2-D one shards over its last dimension and replicates over
        the first (HSDP). With expert parallelism, the 1-D dp_shard mesh flattened from the 2-D
        (dp_shard_mod_ep, ep) one that `expert_meshes` reads back."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.ep > 1:
            experts = init_device_mesh(device_type, (self.dp_shard // self.ep, self.ep),
                                       mesh_dim_names=("dp_shard_mod_ep", "ep"))
            return experts._flatten("dp_shard")
        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.dim_names)


def expert_meshes(mesh):
    """(ep, dp_shard_mod_ep) sub-meshes of a mesh `ParallelDims.build_mesh` made with ep > 1: the
    ranks holding different experts, and those holding the same experts (FSDP shards them there)."""
    root = mesh._get_root_mesh()
    return root["ep"], root["dp_shard_mod_ep"]


def balanced_splits(rows: int, ranks: int) -> list[int]:
    """Rows sent to each of `ranks` peers when routing is balanced: as even as whole rows allow."""
    return [rows // ranks + (peer < rows % ranks) for peer in range(ranks)]


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with its backward (the reverse exchange of the gradients): what
    torch.distributed.nn.functional.all_to_all_single did before its deprecation."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, recv_sizes: list[int], send_sizes: list[int], group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.sizes, ctx.group = (recv_sizes, send_sizes), group
        out = rows.new_empty(sum(recv_sizes), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), recv_sizes, send_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        recv_sizes, send_sizes = ctx.sizes
        return _AllToAll.apply(grad.contiguous(), send_sizes, recv_sizes, ctx.group), None, None, None


class ExpertDispatch:
    """The forward of a fused-experts module under expert parallelism (HF transformers 5.24's
    AllToAllEP, without its tensor-parallel part): each (token, expert) pair is sent by all-to-all
    to the rank holding the expert, the experts' own forward runs on the received rows (top-1, local
    expert ids, unit weights), a second all-to-all brings the outputs back, and the routing weights
    are applied where the tokens live. The split sizes depend on the router's choices: a real run
    reads them back to the host (`.tolist()`); under fake tensors (the simulator) their values
    do not exist, and every rank is assumed to send `balanced_splits` of its rows to each peer and
    to receive as much (balanced routing: docs/KNOBS.md)."""

    def __init__(self, experts: nn.Module, ep_mesh) -> None:
        self.local_forward = experts.forward
        self.local_experts = experts.num_experts
        self.group, self.ranks = ep_mesh.get_group(), ep_mesh.size()

    def split_sizes(self, rows: int, send_counts: torch.Tensor,
                    recv_counts: torch.Tensor) -> tuple[list[int], list[int]]:
        """Rows sent to and received from each peer: read from the counts, or balanced (fake tensors)."""
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(send_counts):
            balanced = balanced_splits(rows, self.ranks)
            return balanced, balanced
        send, recv = torch.stack([send_counts.sum(dim=1), recv_counts.sum(dim=1)]).tolist()
        return send, recv

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        tokens, top_k = top_k_index.shape
        expert_ids = top_k_index.reshape(-1)
        # Sorted by expert, the rows are grouped by the rank owning it (each owns a contiguous range).
        order = torch.argsort(expert_ids, stable=True)
        send = hidden_states[order // top_k]
        send_counts = torch.zeros(self.ranks * self.local_experts, dtype=torch.long, device=expert_ids.device)
        send_counts = send_counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids)).view(self.ranks, -1)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_sizes, recv_sizes = self.split_sizes(expert_ids.numel(), send_counts, recv_counts)
        received = _AllToAll.apply(send, recv_sizes, send_sizes, self.group)
        local_ids = torch.arange(self.local_experts, device=expert_ids.device).repeat(self.ranks)
        local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1), output_size=sum(recv_sizes)).unsqueeze(-1)
        if received.shape[0]:
            out = self.local_forward(received, local_ids, torch.ones_like(local_ids, dtype=received.dtype))
        else:  # nothing routed here: one row made from the empty input keeps backward's exchange connected
            row = received.sum(dim=0, keepdim=True)
            out = self.local_forward(row, local_ids.new_zeros((1, 1)), row.new_ones((1, 1)))[:0]
        back = _AllToAll.apply(out, send_sizes, recv_sizes, self.group)
        unsorted = torch.empty_like(back)
        unsorted[order] = back
        weighted = unsorted.view(tokens, top_k, -1) * top_k_weights.unsqueeze(-1).to(unsorted.dtype)
        return weighted.sum(dim=1).to(hidden_states.dtype)


def apply_ep(blocks: Blocks, mesh, degree: int) -> int:
    """Expert parallelism over `degree` ranks (1: nothing): each block's fused experts keep this
    rank's contiguous num_experts / degree of them (plain parameters, sliced on dimension 0) and
    answer through ExpertDispatch. Before FSDP, which then shards the local experts over the
    ranks holding the same ones (apply_fsdp). Returns how many expert modules were split."""
    if degree == 1:
        return 0
    ep_mesh, _ = expert_meshes(mesh)
    rank = ep_mesh.get_local_rank()
    split = 0
    for block in blocks.layers:
        for experts in fused_experts(block):
            if experts.num_experts % degree:
                raise ValueError(f"expert-parallel degree {degree} does not divide the {experts.num_experts} "
                                 f"experts of {type(experts).__name__}")
            local = experts.num_experts // degree
            for name, param in list(experts.named_parameters(recurse=False)):
                piece = param.detach()[rank * local:(rank + 1) * local].clone()
                setattr(experts, name, nn.Parameter(piece, requires_grad=param.requires_grad))
            experts.num_experts = local
            experts.forward = ExpertDispatch(experts, ep_mesh)
            split += 1
    return split


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


def register_rng_rules(mode_class: type) -> None:
    """Let a memory-tracking dispatch mode (the simulator's, the CPU trial's) run compiled blocks
    under checkpointing. AOT autograd wraps a random op that checkpointing recomputes (SDPA takes a
    dropout argument) in the `run_and_save_rng_state` / `run_with_rng_state` higher-order ops, so
    the recompute draws the same numbers, and a mode must say how to run them: here the wrapped op
    runs through the mode like any other op, with the CPU generator's state saved and restored as
    those ops' own CPU implementations do (torch/_prims/rng_prims.py). Idempotent."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    if mode_class in run_and_save_rng_state.python_key_table:
        return

    @run_and_save_rng_state.py_impl(mode_class)
    def _save(mode, op, *args, **kwargs):
        return torch.get_rng_state(), mode.__torch_dispatch__(op, (), args, kwargs)

    @run_with_rng_state.py_impl(mode_class)
    def _with(mode, rng_state, op, *args, **kwargs):
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(rng_state):  # the simulator's trace draws no numbers (a state activation offload
            return mode.__torch_dispatch__(op, (), args, kwargs)  # brought back holds no data either)
        current = torch.get_rng_state()
        torch.set_rng_state(rng_state)
        try:
            return mode.__torch_dispatch__(op, (), args, kwargs)
        finally:
            torch.set_rng_state(current)


def keep_leaf_inputs_collectable(mod_tracker) -> None:
    """torch 2.13's ModTracker (inside MemTracker and FSDPMemTracker) registers a multi-grad hook on every
    module input that requires a gradient; on a leaf the hook holds the leaf's AccumulateGrad node, which
    holds the leaf: a cycle through C++ that Python's collector cannot break, so the leaf outlives its step
    while tracked. torchtitan's chunked loss feeds its head such leaves (each chunk of the hidden states,
    detached): measured, 8 more kept alive per step under the tracker, none without one. Leaf inputs are left
    out of that hook (the module then leaves the tracker's parents at the end of backward instead). Call
    before entering the tracker."""
    hook = mod_tracker._fw_pre_hook

    def pre_hook(module: nn.Module, inputs):
        return hook(module, tuple(a for a in inputs
                                  if not (isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad)))

    mod_tracker._fw_pre_hook = pre_hook


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
    if step == "torchtitan":
        from autotune.titan import parallelize_titan

        return parallelize_titan(model, mesh, train, allow_offload=allow_offload)
    if step == "litgpt":
        from autotune.litgpt_step import check_litgpt_train, litgpt_blocks

        check_litgpt_train(train)
        blocks = litgpt_blocks(model)
    else:
        blocks = find_decoder_blocks(model)
    apply_ep(blocks, mesh, train.expert_parallel)
    apply_float8(blocks, train.float8)
    apply_ac(blocks, train.activation_checkpointing)
    apply_compile(blocks, train.compile, backend=compile_backend)
    apply_fsdp(model, blocks, mesh, train, allow_offload=allow_offload, step=step)
    return blocks
