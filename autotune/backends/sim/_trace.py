"""Trace one training step of the real model with fake tensors and record memory per *site*.

A site is one point of the step that exists at every depth of the model: the n-th tracked op
after one of FSDP's hooks (pre/post forward, pre/post backward) of one FSDP unit, in one
phase (forward, backward, optimizer). Units are named by position: the root, blocks from the
bottom (b0, b1, ...) or from the top (t0 = last block), so the same site is found in a
2-block and a 32-block copy. Memory at a fixed site grows linearly with depth (every block
adds the same parameters, gradients, optimizer state and saved activations), which
`_extrapolate` uses. FSDP's hooks anchor the sites because they fire reliably; module
backward hooks do not (a module whose inputs need no gradient never leaves the stack).

The traced step is the *steady state* of training, what every step after the first sees:
optimizer state and FSDP's reusable buffers exist before the step starts (a short warm-up
step outside the tracker creates them), and with gradient accumulation the sharded gradients of the previous micro-batch
exist throughout forward and backward (added per site from the exact reduce-scatter outputs).
"""

from __future__ import annotations

import functools
import gc
import math
import time
import weakref
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

# torch registers no FLOP formula for the CPU flash-attention kernels a CPU trace dispatches to;
# their arguments start like the GPU kernels' (query, key, value / grad_out, query, key, value),
# so the GPU formulas count them. Without this, attention FLOPs (16% of llama-7b's at seq 4096)
# were missing from every estimated throughput.
_aten = torch.ops.aten
FLOP_FORMULAS = {
    **flop_registry,
    _aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[_aten._scaled_dot_product_flash_attention],
    _aten._scaled_dot_product_flash_attention_for_cpu_backward:
        flop_registry[_aten._scaled_dot_product_flash_attention_backward],
}


def _grouped_query_safe(formula):
    """torch < 2.13's SDPA FLOP formulas assert that query, key and value have the same number of
    heads, which grouped-query attention does not. Retried with key/value-shaped arguments
    widened to the query's heads: the FLOPs of the kernel, which broadcasts them."""

    def counted(*args, **kwargs):
        try:
            return formula(*args, **kwargs)
        except AssertionError:
            shaped = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
            heads = max(a.shape[1] for a in shaped)
            args = tuple(torch.empty((a.shape[0], heads, *a.shape[2:]), device="meta")
                         if isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[1] != heads else a
                         for a in args)
            return formula(*args, **kwargs)

    return counted


FLOP_FORMULAS = {op: _grouped_query_safe(formula) if "scaled_dot_product" in str(op) else formula
                 for op, formula in FLOP_FORMULAS.items()}


def _grouped_mm_flops(a, b, *args, passes: int = 1, **kwargs) -> int:
    """FLOPs of a grouped matmul: every row of `a` meets one group's matrix, 2 x a's elements x the
    output width, whatever the offsets (2-D x 3-D: tokens x experts' weights; 2-D x 2-D: a weight
    gradient; 3-D x 3-D: batched). `passes` 2: transformers' fallback backward, the input's and
    the weight's gradients in one op."""
    return 2 * passes * a.numel() * b.shape[-1]


# torch 2.13 registers no FLOP formula for grouped matmuls, which transformers 5's MoE experts run
# (`grouped_mm`: aten._grouped_mm in bf16, its own `transformers::grouped_mm_fallback` ops in fp32):
# without these, every expert matmul was missing from a MoE model's FLOPs (mixtral-8x7b: 6.7e13 of
# the ~3.5e14 FLOPs of a micro-batch of 4096 tokens) and its estimated throughput too high.
FLOP_FORMULAS[_aten._grouped_mm] = _grouped_mm_flops

OP_KINDS = ("matmul", "float8_matmul", "attention", "memory")
"""How the step-time model costs an op (autotune/estimate/costmodel.py, `OpWork`): matmuls by FLOPs (float8
ones, `_scaled_mm`, apart: they run at the GPU's float8 rate), attention kernels by FLOPs, every
other op that makes or writes a tensor by the bytes it reads and writes. Views, metadata queries
and collectives (costed per FSDP unit) are not counted."""


@functools.cache
def _op_kind(func) -> str | None:
    packet = func._overloadpacket
    if "scaled_dot_product" in str(packet) or "flash_attention" in str(packet):
        return "attention"
    if packet in (_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten._grouped_mm) or \
            str(packet).startswith("transformers.grouped_mm_fallback"):
        return "matmul"
    if packet is _aten._scaled_mm:
        return "float8_matmul"
    if func.namespace == "bitsandbytes":  # QLoRA's 4-bit matmul, and its dequantizations (memory-bound)
        return "matmul" if func._schema.name.endswith("gemm_4bit") else "memory"
    if func.namespace not in ("aten", "prims"):  # c10d / _c10d_functional collectives, fsdp ops
        return None
    returns = func._schema.returns
    if not returns or not any("Tensor" in str(ret.type) for ret in returns):
        return "memory" if func._schema.name.endswith("_") else None  # in-place foreach/optimizer ops
    if all(ret.alias_info is not None and not ret.alias_info.is_write for ret in returns):
        return None  # a view: moves nothing
    return "memory"


def _gemm_4bit_flops(a, b, shape_b, *args, out_val=None, **kwargs) -> int:
    """bitsandbytes' 4-bit matmul: (tokens x K) @ (K x N) from a weight of quantized shape [N, K]."""
    return 2 * (a.numel() // a.shape[-1]) * shape_b[0] * shape_b[1]


def _gemm_4bit_dequantized_bytes(args) -> int:
    """What bnb's 4-bit matmul moves dequantizing its weight before the matmul, as its GPU path for
    more than one row does (dequantize_4bit, then cuBLAS): the packed codes read, the weight written
    in the activations' dtype and read back by the matmul. Estimated: the kernel is not traced on a GPU."""
    a, b, shape_b = args[:3]
    return b.numel() * b.element_size() + 2 * shape_b[0] * shape_b[1] * a.element_size()


BNB_GPU_CUSTOM_MAX_ROWS = 1536
"""bitsandbytes 0.50's CUDA 4-bit matmul (backends/cuda/ops.py, `_gemm_4bit_custom_max_m`): past
this many input rows it dequantizes the weight and calls F.linear (`_dequant_linear_fallback`)."""


def _gemm_4bit_gpu_workspace_bytes(a, b, shape_b, absmax, blocksize, quant_type, bias=None, absmax_8bit=None,
                                   *args, **kwargs) -> int:
    """What bnb's CUDA 4-bit matmul allocates inside the op for a training batch (more than
    BNB_GPU_CUSTOM_MAX_ROWS rows), freed when it returns: the weight dequantized to the input's
    dtype and, with double quantization, the block scales dequantized to fp32 and offset (two
    fp32 copies). Inside one op the trace does not see it (nor does a CPU run's tracker, which
    counts what the op returns): added for GPU traces, read from bnb's CUDA code (not run here)."""
    if a.numel() // a.shape[-1] <= BNB_GPU_CUSTOM_MAX_ROWS:
        return 0
    weights = shape_b[0] * shape_b[1]
    scales = 2 * 4 * absmax_8bit.numel() if absmax_8bit is not None else 0
    return weights * a.element_size() + scales


@functools.cache
def _transformers_grouped_mm(func):
    """The FLOP formula of transformers' own grouped-matmul ops (registered when its MoE code is
    imported, so looked up by name), or None."""
    name = str(func._overloadpacket)
    if name == "transformers.grouped_mm_fallback":
        return _grouped_mm_flops
    if name == "transformers.grouped_mm_fallback_backward":
        return functools.partial(_grouped_mm_flops, passes=2)
    return None


def _any_dtensor(args) -> bool:
    """Whether an op takes a DTensor (tensor parallelism's weights and activations)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(a, DTensor) for a in tree_leaves(args))


_FUNCTIONAL_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_ONE_BYTE = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)


def _float8_data(t: torch.Tensor) -> torch.Tensor:
    """The tensor a float8 operand's bytes live in: torchao's Float8TrainingTensor (eager) holds them in `_data`."""
    return getattr(t, "_data", t)


def _tensor_bytes(values) -> int:
    total = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, (list, tuple)):
            total += _tensor_bytes(value)
    return total

from autotune.backends.sim._compile_reuse import compile_reuse, route_module_hooks  # noqa: E402
from autotune.backends.sim._fewer_views import fsdp_chunks_on_demand  # noqa: E402
from autotune.backends.sim._gpu_kernels import DEFAULT_SM, sdpa_as_on_a_gpu  # noqa: E402
from autotune.problem.catalog.blocks import Blocks, fused_experts  # noqa: E402
from autotune.problem.catalog.models import ModelSpec
from autotune.problem.config import TRL_STEPS, FineTuning, TrainConfig
from autotune.estimate.costmodel import LARGE_MEMORY_OP_BYTES
from autotune.distributed.parallel import keep_leaf_inputs_collectable, parallelize, register_rng_rules
from autotune.distributed.parallel.expert import set_routing
from autotune.distributed.training import (OffloadedActivations, build_model, make_optimizer, prepare_step, sync_weights_to_vllm,
                               token_batches, train_step)

__all__ = ["REFTYPE_CATEGORIES", "SYNC_PHASE", "SiteKey", "StepTrace", "Tracer", "period_of"]

_TOTAL = "Total"
_CPU = torch.device("cpu")
_REDUCE_SCATTER = torch.ops.c10d._reduce_scatter_base_.default

# FSDPMemTracker's reference types -> autotune.backends.base.MEMORY_CATEGORIES.
REFTYPE_CATEGORIES: dict[str, str] = {
    _FSDPRefType.SHARDED_PARAM.name: "parameters",
    _FSDPRefType.UNSHARDED_PARAM.name: "parameters",
    _FSDPRefType.SHARDED_GRAD.name: "gradients",
    _FSDPRefType.UNSHARDED_GRAD.name: "gradients",
    _FSDPRefType.OPT.name: "optimizer_state",
    _FSDPRefType.ACT.name: "activations",
    _FSDPRefType.TEMP.name: "activations",
    _FSDPRefType.ALL_GATHER.name: "communication_buffers",
    _FSDPRefType.REDUCE_SCATTER.name: "communication_buffers",
    _FSDPRefType.BUFFER.name: "other",
    _FSDPRefType.INP.name: "other",
}
PENDING_GRAD = _FSDPRefType.SHARDED_GRAD.name
"""Gradients of earlier micro-batches are sharded gradients: the steady-state adjustment adds here."""

SiteKey = tuple  # (phase, FSDP hook, unit position, ops since the hook)
SYNC_PHASE = "sync"
"""Sites of the weight sync to vLLM (GRPO): (SYNC_PHASE, parameter name in its unit, unit position,
ops since that parameter's gather began)."""
_GATHERED = _FSDPRefType.UNSHARDED_PARAM.name
_NEW_TENSORS = (_FSDPRefType.ACT.name, _FSDPRefType.TEMP.name)


def period_of(train: TrainConfig, model: ModelSpec) -> int:
    """Blocks per repeating pattern of the traced step: the least common multiple of the
    checkpointing period (k for 'every:k', else 1) and the model's own layer pattern (2 where
    sliding and full attention alternate)."""
    every = train.activation_checkpointing.block_every
    return math.lcm(every if every and every > 1 else 1, model.layer_period)


@dataclass
class StepTrace:
    """What one traced step at one depth recorded."""

    depth: int
    sites: dict[SiteKey, dict[str, int]]
    """Per site, bytes per tracker reference type (`_FSDPRefType.name`) at the site's peak."""
    flops: float
    """FLOPs of forward + backward of one micro-batch on one rank, recomputation included."""
    tensor_peak_bytes: int
    """Max over the recorded sites: the step's tensor-level peak (steady state) when middle
    blocks were kept, else the peak over the ends."""
    block_params: int
    root_params: int
    float8_gathered_params: int = 0
    """Parameters of one block FSDP2 all-gathers in float8 (tensorwise float8's all-gather)."""
    pinned_param_bytes: dict[str, int] = field(default_factory=dict)
    """Host bytes a pinned copy of one rank's fp32 shards takes ('block', 'root'): the pinned
    host allocator rounds every allocation up to a power of two."""
    duration_s: float = 0.0
    largest_allocation_bytes: int = 0
    """The largest single tensor storage the step allocates (the fp32 logits, for LLMs): the
    allocator's fragmentation at the peak scales with it (autotune/estimate/runtime_memory.py)."""
    sync_largest_allocation_bytes: int = 0
    """The same for the weight sync (a full fp32 parameter), when it was traced: it does not grow
    with the micro-batch."""
    op_work: dict[str, float] = field(default_factory=dict)
    """Forward + backward of one micro-batch on one rank, by how the step-time model costs each
    op (`OP_KINDS`): '<kind>_ops' (count), 'matmul_flops', 'float8_matmul_flops', 'attention_flops',
    'memory_bytes', 'float8_cast_elements' (the float8 matmuls' operands: what the casts wrote; under tensor
    parallelism an operand a float8 all-gather carried counts as the shard cast before the gather, once)."""
    offloaded: dict[str, int] = field(default_factory=dict)
    """Activation offload (GPU runs): 'host_bytes', the most one rank holds in pinned host memory
    at once, and 'moved_bytes', what one micro-batch copies each way (training.OffloadedActivations)."""
    dropout: dict[str, int] = field(default_factory=dict)
    """Dropout the step met, by how it was traced (_gpu_kernels.sdpa_as_on_a_gpu): SDPA calls with
    dropout as 'dropout_in_kernel:<CUDA backend>' (a GPU run: traced as the fused kernel) or
    'math_with_dropout', and 'other_dropout' (residual, embedding); recomputation included."""
    derived_from: tuple[int, ...] = ()
    """The two world sizes this trace was derived from (_world.derive), the one it is the same as
    (_world.replicated, HSDP), or () where it was traced."""
    repeats: dict[SiteKey, tuple[tuple[int, dict[str, int], int], ...]] = field(default_factory=dict)
    """Sites the step reaches more than once: each occurrence's (value compared, categories as in
    `sites`, pending gradient bytes as in `pending_grad`), in order; `sites` holds the first with
    the largest value. Kept so that a trace at another world size (_world) can pick the occurrence
    that peaks there, as a trace would."""
    accumulating: bool = False
    """Traced for a step with gradient accumulation: every training site holds, besides what the
    traced micro-batch holds, the gradients reduced by earlier micro-batches (`pending_grad`)."""
    pending_grad: dict[SiteKey, int] = field(default_factory=dict)
    """Per training site, the gradient bytes a step with accumulation holds there beyond the traced
    micro-batch's (what the reduce-scatters of earlier micro-batches left): added to the site's
    SHARDED_GRAD when `accumulating` (_world.accumulated converts one way or the other)."""


def _float8_flatten_without_reading_scales() -> None:
    """torchao 0.18's float8 weight wrapper (`WeightWithDynamicFloat8CastTensor`, FSDP2's float8
    all-gather) lists its precomputed scale when flattened only `if self._precomputed_scale:`, the
    scale's truth value: a read of its data, which fake tensors refuse (DataDependentOutputException
    from FSDPMemTracker, which flattens every parameter once precompute_float8_dynamic_scale_for_fsdp
    has set the scales). A scale is max-float8 / amax (amax clamped above 0): never zero, so `is not
    None` lists the same tensors. Replaced for this process; idempotent."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Weight

    def flatten(self):
        tensors = ["_tensor"] + (["_precomputed_scale"] if self._precomputed_scale is not None else [])
        return tensors, {"mm_config": self._linear_mm_config, "dtype": self._dtype}

    Weight.__tensor_flatten__ = flatten


def _next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


@functools.cache
def _is_step_op(func) -> bool:
    """An op that advances a site's count: it returns tensors, or nothing at all (an in-place op
    such as the fused AdamW kernel: without it a fused optimizer step records no site)."""
    returns = func._schema.returns
    return not returns or any("Tensor" in str(ret.type) for ret in returns)


_compiled_graphs_running = [0]
"""How many of the simulator's compiled graphs are running now (nested: a checkpointed block's
recompute): the tracker counts their ops as inductor's kernel launches, not as eager dispatches."""


def _marked_while_running(compiler: Callable) -> Callable:
    """An AOT autograd graph compiler whose compiled graph marks `_compiled_graphs_running` while it runs."""
    def compile_graph(graph_module, example_inputs):
        compiled = compiler(graph_module, example_inputs)

        def run(args):  # AOT autograd's boxed calling convention: one list of arguments
            _compiled_graphs_running[0] += 1
            try:
                return compiled(args)
            finally:
                _compiled_graphs_running[0] -= 1

        run._boxed_call = True
        return run

    return compile_graph


def SIM_COMPILE_BACKEND(graph_module, example_inputs, **kwargs):
    """What the simulator compiles blocks with (`compile=blocks`): torch's `aot_eager_decomp_partition`
    (torch/_dynamo/backends/debugging.py), i.e. dynamo and AOT autograd with inductor's decompositions
    and inductor's partitioner (min-cut rematerialisation: what is saved for backward and what is
    recomputed), then the partitioned forward and backward graphs run op by op on fake tensors; its
    graphs are marked while they run, so the tracker can count their ops as fused kernels. Inductor
    itself cannot run on fake tensors (its kernels read data pointers: a segfault); what inductor would
    add or remove inside a graph (fused temporaries, buffer reuse) is the difference docs/COMPILE.md
    measures."""
    from importlib import import_module

    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import get_nop_func
    from torch._functorch import config as functorch_config

    with functorch_config.patch({"unlift_effect_tokens": True}):  # as aot_eager_decomp_partition
        return aot_autograd(
            fw_compiler=_marked_while_running(get_nop_func()), bw_compiler=_marked_while_running(get_nop_func()),
            decompositions=lambda: import_module("torch._inductor.compile_fx").select_decomp_table(),
            partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
        )(graph_module, example_inputs)


COMPILED_LAUNCHES_BASIS = ("the kernels the host launches for a compiled block, counted in the trace: each matmul and "
                           "attention, and one fused kernel for each run of memory-bound ops between them (a proxy for "
                           "inductor's fusion: +3..+9% against inductor's own CPU code, benchmarks/bench_compile.py "
                           "--launches)")


class _SiteTracker(FSDPMemTracker):
    """FSDPMemTracker that also keeps the memory at every site, and counts reduced gradients.

    Sites are anchored on FSDP's own hooks (pre/post forward, pre/post backward of each FSDP
    unit), which fire reliably; a site is (phase, hook, unit position, ops since the hook).

    Compiled blocks: torch.compile skips frames while a dispatch mode is active unless the mode
    ignores compile internals; this one does, so dynamo compiles with the tracker switched off and
    the compiled graphs' ops are seen as they run (they are aten ops: SIM_COMPILE_BACKEND)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, model: nn.Module, optimizer, *, position_of: Callable[[nn.Module], tuple[str, ...]],
                 gloo: bool, dtensors: bool = False) -> None:
        super().__init__(model, optimizer)
        route_module_hooks(self._mod_tracker)  # compiled blocks reused by later traces (_compile_reuse)
        keep_leaf_inputs_collectable(self._mod_tracker)
        self._gloo = gloo
        self._dtensors = dtensors
        """Set where the step runs DTensor ops: tensor parallelism's blocks, context parallelism's ring
        attention (FLOPs and bytes then read the local ops on this rank's shards)."""
        self._transient = 0
        self._transient_ref = _FSDPRefType.REDUCE_SCATTER
        self.largest_allocation = 0
        self.count_flops = False
        self.flops = 0
        self.op_work: dict[str, float] = {}
        self._optimizer_ops: list[dict[str, int]] = []
        self._position_of = position_of
        self.sites: dict[SiteKey, tuple[int, dict, int]] = {}
        self.repeats: dict[SiteKey, list[tuple[int, dict, int]]] = {}
        """Every occurrence (value, categories, reduced) of a site the step reaches more than once
        (the root's pre-backward, ...): which occurrence peaks may change with the world size."""
        self.reduced_grad_bytes = 0
        self._anchors: tuple[tuple[str, str], ...] = (("start", "-"),)
        self._ordinal = 0
        self._counts_as_op = True
        self._previous_compiled_op_memory = False
        self._gathered_float8: dict[int, Any] = {}
        """Tensors (by id, a weak reference each) holding what a tensor-parallel all-gather carried in float8, and
        what views, splits and concatenations made of it: torchao cast it on this rank's sequence shard before the
        gather (tensorwise float8), so a matmul reading it casts nothing (_follow_gathered_float8)."""
        self.phase: str | None = None
        """Set for the weight sync, which is neither forward nor backward."""

    def anchor(self, anchors: tuple[tuple[str, str], ...]) -> None:
        """Start counting ops from a point no FSDP hook marks (a parameter's gather in the sync)."""
        self._anchors = anchors
        self._ordinal = 0

    def optimizer_sites(self) -> dict[SiteKey, dict[str, int]]:
        """The optimizer step's ops as sites. AdamW steps one parameter after another, in model
        order: the first half of its ops (embeddings, bottom blocks) is counted from the start,
        the second half (top blocks, final norm, output layer) from the end, so that both ends
        line up at any depth; the middle blocks' steps repeat the ends'."""
        count = len(self._optimizer_ops)
        return {("opt", "head", i) if i < count // 2 else ("opt", "tail", count - 1 - i): cats
                for i, cats in enumerate(self._optimizer_ops)}

    def _anchored(self, hook: str, fsdp_mod, inner):
        anchors = tuple((hook, name) for name in self._position_of(fsdp_mod))

        def anchored(*args: Any, **kwargs: Any):
            self._anchors = anchors
            self._ordinal = 0
            return inner(*args, **kwargs)

        return anchored

    def _fsdp_state_pre_forward(self, fsdp_mod, orig):
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

        def called_again(*args: Any, **kwargs: Any):
            # torchtitan's chunked loss calls its head once per chunk with each chunk's backward in
            # between, which leaves torch's module tracker outside every module: a unit called again
            # in forward is not the next iteration (only the root's second forward is).
            if fsdp_mod is not self._root_mod and not self._mod_tracker.is_bw:
                self.memory_tracking.pop(fsdp_mod, None)
            return inner(*args, **kwargs)

        return self._anchored("pre_fw", fsdp_mod, called_again)

    def _fsdp_state_post_forward(self, fsdp_mod, orig):
        return self._anchored("post_fw", fsdp_mod, super()._fsdp_state_post_forward(fsdp_mod, orig))

    def _fsdp_param_group_pre_backward(self, fsdp_mod, orig):
        return self._anchored("pre_bw", fsdp_mod, super()._fsdp_param_group_pre_backward(fsdp_mod, orig))

    def _fsdp_param_group_post_backward(self, fsdp_mod, orig):
        inner = self._anchored("post_bw", fsdp_mod, self._post_backward_freeing_gradients(fsdp_mod, orig))

        def counted(*args: Any, **kwargs: Any) -> None:
            inner(*args, **kwargs)
            group = fsdp_mod._get_fsdp_state()._fsdp_param_group
            storages = {}  # the group's gradients are views of one reduce-scatter output
            for fsdp_param in group.fsdp_params if group else ():
                grad = fsdp_param.sharded_param.grad
                if grad is not None:
                    storage = grad._local_tensor.untyped_storage()
                    storages[storage._cdata] = storage.nbytes()
            self.reduced_grad_bytes += sum(storages.values())

        return counted

    def _post_backward_freeing_gradients(self, fsdp_mod, orig):
        """FSDPMemTracker's wrapper of a group's post-backward (torch 2.13) without its one side effect: its
        loop variable kept the group's last unsharded gradient alive while FSDP's post-backward ran, which a
        run frees there (copied into the reduce-scatter input, or accumulated in fp32 and dropped). Where that
        moment is the peak, the trace counted a gradient too many (torchtitan's chunked loss: its head's
        post-backward between chunks; measured 4,096,000 B, tiny-llama's bf16 head gradient). The memory
        tracker's per-module snapshots are not kept (nothing here reads them)."""
        from torch.distributed._tools.fsdp2_mem_tracker import _FSDPState

        def inner(*args: Any, **kwargs: Any) -> None:
            self._track_group_grads(fsdp_mod, sharded=False)
            self._fsdp_state = _FSDPState.POST_BW
            orig(*args, **kwargs)
            self._track_group_grads(fsdp_mod, sharded=True)

        return inner

    def _track_group_grads(self, fsdp_mod, *, sharded: bool) -> None:
        group = fsdp_mod._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group else ():
            grad = fsdp_param.sharded_param.grad if sharded else fsdp_param._unsharded_param.grad
            if grad is None:
                continue
            if sharded:
                self._update_and_maybe_create_winfos(grad, _FSDPRefType.SHARDED_GRAD)
                continue
            try:
                self._update_and_maybe_create_winfos(grad, _FSDPRefType.UNSHARDED_GRAD, update_existing=True)
            except KeyError:
                # Seen once: torchtitan's head traced a second time on a cached model (another micro-batch)
                # hands its gradient to FSDP without the tracker having seen it made; counted from here.
                self._update_and_maybe_create_winfos(grad, _FSDPRefType.UNSHARDED_GRAD)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Metadata queries (prim.device, sym_size, ...) come and go with fake tensors' caches;
        # only ops that return tensors (or mutate in place) advance a site's op count.
        self._counts_as_op = _is_step_op(func)
        if self._dtensors and _any_dtensor(args):
            # The mode sees tensor parallelism's DTensor ops (global shapes; CP's attention too) and then the
            # local ops each runs on this rank's shards: those are counted, the DTensor op is not (twice).
            self._counts_as_op = False
            return super().__torch_dispatch__(func, types, args, kwargs)
        if self._gloo and func is _REDUCE_SCATTER:
            # gloo's reduce-scatter works on a full-size copy of its input, freed when it returns.
            self._transient, self._transient_ref = args[1].untyped_storage().nbytes(), _FSDPRefType.REDUCE_SCATTER
        elif not self._gloo and func.namespace == "bitsandbytes" and func._schema.name.endswith("gemm_4bit"):
            # On a GPU, bnb's 4-bit matmul dequantizes the weight into a buffer of its own first.
            workspace = _gemm_4bit_gpu_workspace_bytes(*args, **(kwargs or {}))
            if workspace:
                self._transient, self._transient_ref = workspace, _FSDPRefType.TEMP
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self._dtensors and active_fake_mode() is not self._fake_mode_on_entry:
            # DTensor's sharding propagation (an op run at global shapes in a fake mode of its own, once per
            # new op signature: _sharding_propagation_in_a_fake_mode_of_its_own): no rank computes it, and
            # MemTracker counts no memory for it; counted, the FLOPs would depend on which signatures an
            # earlier trace met (not linear in depth).
            self._counts_as_op = False
            return out
        for result in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(result, torch.Tensor):
                self.largest_allocation = max(self.largest_allocation, result.untyped_storage().nbytes())
        # FLOPs from torch's flop-counter formulas, counted here: FlopCounterMode's module hooks
        # would keep tensors alive under activation checkpointing and change the memory traced.
        formula = FLOP_FORMULAS.get(func._overloadpacket) or _transformers_grouped_mm(func) \
            if self.count_flops and out is not NotImplemented else None
        op_flops = 0
        if formula is not None:
            op_flops = formula(*args, **(kwargs or {}), out_val=out)
            self.flops += op_flops
        if self.count_flops and out is not NotImplemented and not self._in_opt and self.phase is None:
            kind = _op_kind(func)
            if self._counts_as_op and _compiled_graphs_running[0]:
                # Inside a compiled block the host launches inductor's kernels, not each op: a view
                # launches nothing, and memory-bound ops between two matmuls (attentions) fuse into
                # one kernel, a proxy for inductor's fusion (COMPILED_LAUNCHES_BASIS).
                if kind is not None:
                    if not (kind == "memory" and self._previous_compiled_op_memory):
                        self.op_work["compiled_launches"] = self.op_work.get("compiled_launches", 0) + 1
                    self._previous_compiled_op_memory = kind == "memory"
            elif self._counts_as_op:  # not the metadata queries fake tensors make
                self.op_work["dispatched_ops"] = self.op_work.get("dispatched_ops", 0) + 1
                self._previous_compiled_op_memory = False
            if kind == "matmul" and any(type(a).__name__ == "Float8TrainingTensor" for a in args):
                # Eager float8: the mode sees torchao's tensor subclass's mm, which runs `_scaled_mm`
                # below the mode (compiled blocks dispatch `_scaled_mm` itself).
                kind = "float8_matmul"
            if kind is not None:
                work = self.op_work
                work[f"{kind}_ops"] = work.get(f"{kind}_ops", 0) + 1
                if kind == "memory":
                    moved = _tensor_bytes(args) + _tensor_bytes((kwargs or {}).values()) + _tensor_bytes(
                        out if isinstance(out, (tuple, list)) else (out,))
                    work["memory_bytes"] = work.get("memory_bytes", 0) + moved
                    if moved >= LARGE_MEMORY_OP_BYTES:
                        work["memory_bytes_large"] = work.get("memory_bytes_large", 0) + moved
                else:
                    work[f"{kind}_flops"] = work.get(f"{kind}_flops", 0) + op_flops
                if func.namespace == "bitsandbytes" and kind == "matmul":
                    moved = _gemm_4bit_dequantized_bytes(args)
                    work["memory_bytes"] = work.get("memory_bytes", 0) + moved
                    if moved >= LARGE_MEMORY_OP_BYTES:
                        work["memory_bytes_large"] = work.get("memory_bytes_large", 0) + moved
                if kind == "float8_matmul":  # each float8 operand is one dynamic cast's output (or a transpose of one)
                    cast = sum(a.numel() for a in args[:2] if not self._gathered(a))
                    work["float8_cast_elements"] = work.get("float8_cast_elements", 0) + cast
            if self._dtensors and kind != "float8_matmul":
                self._follow_gathered_float8(func, args, kwargs, out)
        return out

    def _gathered(self, t) -> bool:
        """Whether `t` holds what a float8 all-gather carried (_follow_gathered_float8); ids of dead tensors are reused,
        so the weak reference must still be to `t` itself."""
        ref = self._gathered_float8.get(id(t))
        return ref is not None and ref() is t

    def _follow_gathered_float8(self, func, args, kwargs, out) -> None:
        """Tensor parallelism under tensorwise float8 (torchao's Float8ColwiseParallel and its input preparation):
        each block's attention and MLP inputs, and in backward the row-wise linears' output gradients, are cast on
        this rank's sequence shard and all-gathered in float8, and the gathered tensor feeds every matmul that reads
        it (q, k and v; gate and up). One cast of the shard's elements is counted at the gather, and the matmuls
        reading what it gathered (through views, splits and the concatenation that orders it, in uint8 where
        compiled) count no cast of their own: counted per matmul operand, the gathered input was cast tp x 3
        times over for q, k and v."""
        if func is _FUNCTIONAL_ALL_GATHER and _float8_data(args[0]).dtype in _ONE_BYTE[:2]:
            self.op_work["float8_cast_elements"] = self.op_work.get("float8_cast_elements", 0) + args[0].numel()
        elif not self._gathered_float8 or not any(self._gathered(a) for a in tree_leaves((args, kwargs))):
            return  # every op of a tensor-parallel step comes here: most read nothing gathered
        for o in tree_leaves(out):
            if isinstance(o, torch.Tensor) and _float8_data(o).dtype in _ONE_BYTE:
                self._gathered_float8[id(o)] = weakref.ref(o)

    def _update_peak_stats(self, peak_state) -> None:
        # Called after every op. Replaces the per-module bookkeeping (unused here, a deepcopy
        # per op) with one record per site.
        snap = self._curr_mem_snap.get(_CPU)
        if not self._counts_as_op:
            return
        self._ordinal += 1
        if not snap:
            return
        if self._transient:
            snap = dict(snap)
            snap[_TOTAL] += self._transient
            snap[self._transient_ref] = snap.get(self._transient_ref, 0) + self._transient
            self._transient = 0
        if snap[_TOTAL] > self._peak_mem.get(_CPU, 0):
            self._peak_mem[_CPU] = snap[_TOTAL]
        if self._in_opt:
            self._optimizer_ops.append({ref.name: int(n) for ref, n in snap.items() if ref != _TOTAL})
            return
        if not self._anchors:
            return
        phase = self.phase or ("bw" if self._mod_tracker.is_bw else "fw")
        # Steady state with accumulation: later micro-batches hold every gradient throughout.
        reduced = self.reduced_grad_bytes
        value = snap[_TOTAL] - reduced
        cats = None
        for anchor in self._anchors:  # a block near both ends is a site of each
            site = (phase, *anchor, self._ordinal)
            best = self.sites.get(site)
            if best is not None:
                cats = cats or {ref.name: int(n) for ref, n in snap.items() if ref != _TOTAL}
                self.repeats.setdefault(site, [best]).append((value, cats, reduced))
            if best is None or value > best[0]:
                cats = cats or {ref.name: int(n) for ref, n in snap.items() if ref != _TOTAL}
                self.sites[site] = (value, cats, reduced)


@dataclass
class _Built:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    blocks: Blocks
    block_params: int
    root_params: int
    pinned: dict[str, int]
    float8_gathered_params: int = 0
    optimizer_sites: dict[SiteKey, dict[str, int]] | None = None
    sync_sites: dict[SiteKey, dict[str, int]] | None = None
    sync_largest_allocation: int = 0
    reshard_after_forward: bool = True


def _set_reshard_after_forward(built: _Built, reshard: bool) -> None:
    """Switch the blocks' resharding after forward (the root never reshards, see parallel.py)."""
    if built.reshard_after_forward == reshard:
        return
    for block in built.blocks.layers:
        block.set_reshard_after_forward(reshard)
    built.reshard_after_forward = reshard
    built.optimizer_sites = built.sync_sites = None  # traced once per mode, not assumed alike


class _Stepper:
    """The optimizer as the traced step sees it: its step is skipped where its memory is known
    (`skip`); zero_grad still frees gradients. Records which parameters with AdamW state had no
    gradient at the step (`without_grad`): a real run never gives those state (AdamW skips a
    parameter whose gradient is None), while the warm-up, which cannot know, gave every one some."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, skip: bool) -> None:
        self._optimizer = optimizer
        self._skip = skip
        self.without_grad: list[nn.Parameter] = []

    def step(self) -> None:
        self.without_grad = [p for p in self._optimizer.state if p.grad is None]
        if not self._skip:
            self._optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)


class Tracer:
    """Builds, shards and traces models under one FakeTensorMode, caching what does not depend
    on the micro-batch (the sharded model and its warmed-up optimizer) per configuration."""

    def __init__(self, *, max_cached_models: int = 24) -> None:
        self._fake_mode = FakeTensorMode()
        self._propagation_mode = FakeTensorMode()
        self._models: dict[tuple, _Built] = {}
        self._max_cached_models = max_cached_models

    def clear(self) -> None:
        self._models.clear()

    def trace(self, model_spec: ModelSpec, *, depth: int, mesh, world_size: int, train: TrainConfig,
              seq_len: int, grad_accum_steps: int, count_flops: bool = True,
              keep_middle: bool = True, gloo: bool = False, weight_sync: bool = False,
              finetuning: FineTuning | None = None, step: str = "autotune",
              gpu_sm: tuple[int, int] | None = None, routing=None, documents: tuple[int, ...] = ()) -> StepTrace:
        """Trace one steady-state step of `model_spec` cut to `depth` blocks. `keep_middle=False`
        records only the sites that exist at every depth (for extrapolation); `gloo` adds the
        copy gloo's reduce-scatter makes (a CPU run), which NCCL does not; `weight_sync` adds the
        sites of TRL's weight sync to vLLM after the step (GRPO, `training.sync_weights_to_vllm`);
        `step`: whose forward and loss (config.stack_step), as a real trial runs it; `gpu_sm`: the
        compute capability of a GPU run's GPU (None: SM 9.0), for the attention kernel CUDA's SDPA
        picks there (_gpu_kernels: with dropout, a fused kernel keeps no mask and no scores); `routing`:
        a stated MoE routing skew (autotune/problem/routing.py), whose binding rank expert parallelism's
        all-to-alls are traced at (parallel.ExpertDispatch; set on the cached model every trace)."""
        start = time.perf_counter()
        built = self._built(model_spec, depth=depth, mesh=mesh, world_size=world_size, train=train,
                            finetuning=finetuning or FineTuning(), step=step, seq_len=seq_len)
        set_routing(built.model, routing)
        period = period_of(train, model_spec)
        steady_accum = grad_accum_steps > 1
        position_of = _position_namer(built.model, built.blocks, depth=depth, period=period,
                                      keep_middle=keep_middle)
        packed = step == "trl-padding-free"
        with self._fake_mode, _real_mask_decisions(packed=packed), _qlora_context(finetuning, self._fake_mode), \
                _sharding_propagation_in_a_fake_mode_of_its_own(self._propagation_mode):
            batches = token_batches(vocab_size=int(model_spec.config_dict["vocab_size"]),
                                    micro_batch_size=train.micro_batch_size, seq_len=seq_len, device="cpu",
                                    documents=documents)
            tracker = _SiteTracker(built.model, built.optimizer, position_of=position_of, gloo=gloo,
                                   dtensors=train.ranks_per_batch > 1)
            tracker.count_flops = count_flops
            # The optimizer step sees the same parameters, gradients and state at every
            # micro-batch size: traced once per model, then skipped.
            optimizer = _Stepper(built.optimizer, skip=built.optimizer_sites is not None)
            sync_now = weight_sync and built.sync_sites is None
            # Activation offload on a GPU run (a CPU run cannot apply it): the same hooks a real
            # trial enters, keeping no copy, so the device side is traced exactly.
            offload = OffloadedActivations(to_host=False) if train.activation_offload and not gloo else None
            dropout: dict[str, int] = {}
            with _collections_skip_what_was_alive(), tracker, compile_reuse(), fsdp_chunks_on_demand(), \
                    _trl_kernels_as_on_a_gpu(step in TRL_STEPS and not gloo), \
                    sdpa_as_on_a_gpu(not gloo, sm=gpu_sm or DEFAULT_SM, seen=dropout):
                # One micro-batch: later ones repeat it; their gradients are added below.
                train_step(built.model, optimizer, batches, grad_accum_steps=1, saved_activations=offload, step=step)
                if sync_now:
                    # After the optimizer step and zero_grad, as GRPOTrainer syncs before its next
                    # generation. The same at every micro-batch: traced once per model, like the
                    # optimizer step.
                    largest_in_step = tracker.largest_allocation
                    tracker.largest_allocation = 0
                    _trace_weight_sync(tracker, built, position_of)
                    built.sync_largest_allocation = tracker.largest_allocation
                    tracker.largest_allocation = largest_in_step
            total_grad = tracker.reduced_grad_bytes
        if optimizer.without_grad:
            # Parameters no gradient reaches (a DSA indexer behind its top-k, an unused embedding):
            # their warm-up state dropped, and the step traced again as a real run has it.
            for param in optimizer.without_grad:
                del built.optimizer.state[param]
            built.optimizer_sites = built.sync_sites = None
            return self.trace(model_spec, depth=depth, mesh=mesh, world_size=world_size, train=train,
                              seq_len=seq_len, grad_accum_steps=grad_accum_steps, count_flops=count_flops,
                              keep_middle=keep_middle, gloo=gloo, weight_sync=weight_sync,
                              finetuning=finetuning, step=step, gpu_sm=gpu_sm, routing=routing, documents=documents)
        sites = {}
        if sync_now:
            built.sync_sites = {key: _as_gathered(cats) for key, (_, cats, _) in tracker.sites.items()
                                if key[0] == SYNC_PHASE}

        def recorded(cats: dict[str, int], reduced: int) -> dict[str, int]:
            cats = dict(cats)
            if steady_accum:
                cats[PENDING_GRAD] = cats.get(PENDING_GRAD, 0) + total_grad - reduced
            return cats

        pending = {}
        for key, (_, cats, reduced) in tracker.sites.items():
            if key[0] != SYNC_PHASE:
                sites[key] = recorded(cats, reduced)
                pending[key] = total_grad - reduced
        repeats = {key: tuple((value, recorded(cats, reduced), total_grad - reduced)
                              for value, cats, reduced in occurrences)
                   for key, occurrences in tracker.repeats.items() if key[0] != SYNC_PHASE}
        if built.optimizer_sites is None:
            built.optimizer_sites = tracker.optimizer_sites()
        sites.update(built.optimizer_sites)
        if weight_sync:
            sites.update(built.sync_sites)
        flops = float(tracker.flops)
        return StepTrace(depth=depth, sites=sites, flops=flops,
                         tensor_peak_bytes=max(sum(c.values()) for c in sites.values()),
                         block_params=built.block_params, root_params=built.root_params,
                         float8_gathered_params=built.float8_gathered_params,
                         pinned_param_bytes=dict(built.pinned), duration_s=time.perf_counter() - start,
                         largest_allocation_bytes=int(tracker.largest_allocation),
                         sync_largest_allocation_bytes=built.sync_largest_allocation if weight_sync else 0,
                         op_work=dict(tracker.op_work),
                         offloaded=dict(host_bytes=offload.host_bytes, moved_bytes=offload.moved_bytes) if offload else {},
                         dropout=dropout,
                         repeats=repeats, accumulating=steady_accum, pending_grad=pending)

    def _built(self, model_spec: ModelSpec, *, depth: int, mesh, world_size: int, train: TrainConfig,
               finetuning: FineTuning, step: str = "autotune", seq_len: int | None = None) -> _Built:
        # Every knob but the three that do not change the built model: a new knob can never reuse
        # a model built for another value of it. Resharding after forward is switched on the
        # built model (as FSDP2 allows at run time), which saves a build and a warm-up step.
        key = (model_spec.name, repr(sorted(model_spec.config_dict.items())), depth, world_size,
               train.with_(micro_batch_size=1, cpu_offload=False, reshard_after_forward=True).cache_key(),
               finetuning.key(), step, seq_len if step == "torchtitan" else None,  # its RoPE cache: seq_len rows
               model_spec.attention)
        if key in self._models:
            built = self._models[key]
            _set_reshard_after_forward(built, train.reshard_after_forward)
            return built
        if len(self._models) >= self._max_cached_models:
            self._models.pop(next(iter(self._models)))
        with self._fake_mode, _real_mask_decisions(), _qlora_context(finetuning, self._fake_mode):
            with _module_to_assigns_data():
                model = build_model(model_spec, num_layers=depth, precision=train.precision, finetuning=finetuning,
                                    step=step, seq_len=seq_len)
            with _post_forward_meshes_outside_fake_mode(), fsdp_chunks_on_demand():
                blocks = parallelize(model, mesh, train.with_(cpu_offload=False), allow_offload=False,
                                     compile_backend=SIM_COMPILE_BACKEND, step=step)
            prepare_step(model, step=step, precision=train.precision, device_type=_CPU.type)
            if train.compile != "none":
                register_rng_rules(_SiteTracker)
            if train.float8 != "none":
                _float8_flatten_without_reading_scales()
            optimizer = make_optimizer(model, impl=train.optimizer_impl)
            _warm_up(model, optimizer)
        block_ids = {id(p) for p in blocks.layers.parameters()}
        block_params = sum(p.numel() for p in blocks.layers[0].parameters())
        root_params = sum(p.numel() for p in model.parameters() if id(p) not in block_ids)
        pinned = {
            "block": sum(_next_pow2(p.to_local().nbytes) for p in blocks.layers[0].parameters()),
            "root": sum(_next_pow2(p.to_local().nbytes) for p in model.parameters() if id(p) not in block_ids),
        }
        float8_gathered = sum(m.weight.numel() for m in blocks.layers[0].modules()
                              if getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False))
        built = _Built(model=model, optimizer=optimizer, blocks=blocks, block_params=block_params,
                       root_params=root_params, pinned=pinned, reshard_after_forward=train.reshard_after_forward,
                       float8_gathered_params=float8_gathered)
        self._models[key] = built
        return built


def _trace_weight_sync(tracker: _SiteTracker, built: _Built, position_of) -> None:
    """Run TRL's weight sync under the tracker, each parameter's gather anchored at the parameter's
    name within its FSDP unit and the unit's position, so that sync sites extrapolate in depth
    like the step's (a block's parameters are the same tensors at every depth)."""
    unit_of = {id(p): (layer, local) for layer in built.blocks.layers for local, p in layer.named_parameters()}
    anchors = {}
    for name, param in built.model.named_parameters():
        unit, local = unit_of.get(id(param), (built.model, name))
        local = local.replace("_checkpoint_wrapped_module.", "")
        anchors[name.replace("_checkpoint_wrapped_module.", "")] = tuple((local, pos) for pos in position_of(unit))
    tracker.phase = SYNC_PHASE
    try:
        sync_weights_to_vllm(built.model, device=_CPU, before_gather=lambda name: tracker.anchor(anchors[name]))
    finally:
        tracker.phase = None


def _as_gathered(cats: dict[str, int]) -> dict[str, int]:
    """At a sync site every tensor the tracker saw created is a gathered full parameter (the
    tracker files new tensors outside forward as activations): counted as parameters."""
    cats = dict(cats)
    cats[_GATHERED] = cats.get(_GATHERED, 0) + sum(cats.pop(ref, 0) for ref in _NEW_TENSORS)
    return cats


def _warm_up(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Bring a freshly built model to the steady state a trace must see, as a first training
    step would, without running one (a step through the model costs as much as a trace):
    FSDP2's lazy initialisation (its root's first forward does it); each FSDP unit gathered and
    resharded as in forward (to its smaller group where blocks reshard to one), then gathered
    again and resharded as in backward, which creates the all-gather buffers and unsharded
    parameters a step leaves behind (kept with their storage freed); and AdamW's state (created
    at the first step, here from zero gradients). Checked site by site: the traces that follow
    equal those after a real first step on dense, op-level, HSDP, reshard-group, gloo and
    accumulation configurations (tests/test_sim.py)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    model._get_fsdp_state()._lazy_init()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = module._get_fsdp_state()._fsdp_param_groups
        for phase in (TrainingState.FORWARD, TrainingState.PRE_BACKWARD):
            for group in groups:  # reshard() does what the phase's post-hook would
                group._training_state = phase
            module.unshard()
            module.reshard()
        for group in groups:
            group._training_state = TrainingState.IDLE
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@contextmanager
def _collections_skip_what_was_alive():
    """While a step is traced, the garbage collector's scans skip the objects alive when it began
    (torch, transformers, the built model: some 400,000), as a real trial's do
    (real/_trial.py `release_memory`); they are handed back after it. The step's own garbage is
    collected as before. Measured on the main job: its full collections 3.0-3.6 -> 0.9-1.0 s of
    about 20 CPU s, and `compile_reuse`'s collection after each compile no longer walks them."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def _trl_kernels_as_on_a_gpu(active: bool):
    """TRL's fused LM head (trl 1.16, kernels/chunked_logprob.py) folds each logits tile into its
    statistics with a Triton kernel on GPUs, in place (it allocates nothing), and with torch ops
    over the whole tile elsewhere (fp32 copies of the tile); its `_addmm_fp32` accumulates in place
    with cuBLAS's out_dtype on CUDA, and from fp32 copies of both operands elsewhere. Traced on CPU
    fake tensors for a GPU run, those three run as on the GPU: in place, allocating nothing (fake
    tensors hold no values to write). A CPU run (gloo) traces TRL's CPU path as it runs."""
    if not active:
        yield
        return
    from trl.kernels import chunked_logprob as kernels

    saved = kernels._forward_tile, kernels._backward_tile, kernels._addmm_fp32

    def in_place(*args, **kwargs) -> None:
        return None

    kernels._forward_tile = kernels._backward_tile = kernels._addmm_fp32 = in_place
    try:
        yield
    finally:
        kernels._forward_tile, kernels._backward_tile, kernels._addmm_fp32 = saved


@contextmanager
def _post_forward_meshes_outside_fake_mode():
    """fully_shard(reshard_after_forward=N) builds the device mesh of N-rank groups from the
    parent mesh's rank tensor; under FakeTensorMode that tensor would be fake and the mesh cannot
    read its ranks. Building that mesh (ranks only, no parameter memory) outside the fake mode
    gives the same FSDP state a real run has. The same holds for the data x tensor-parallel mesh
    fully_shard concatenates for a parameter tensor parallelism already split (DeviceMesh._concatenate)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

    build = _fsdp_init._get_post_forward_mesh_info
    concatenate = DeviceMesh._concatenate

    def outside_fake_mode(*args, **kwargs):
        with unset_fake_temporarily():
            return build(*args, **kwargs)

    def concatenate_outside_fake_mode(meshes):
        with unset_fake_temporarily():
            return concatenate(meshes)

    _fully_shard._get_post_forward_mesh_info = outside_fake_mode
    DeviceMesh._concatenate = staticmethod(concatenate_outside_fake_mode)
    try:
        yield
    finally:
        _fully_shard._get_post_forward_mesh_info = build
        DeviceMesh._concatenate = staticmethod(concatenate)


def _qlora_context(finetuning: FineTuning | None, fake_mode: FakeTensorMode):
    """`_params4bit_as_plain_parameters` where the model has 4-bit layers (QLoRA) only: importing
    bitsandbytes costs seconds that no other trace needs."""
    return _params4bit_as_plain_parameters(fake_mode) if finetuning is not None and finetuning.qlora else nullcontext()


@contextmanager
def _params4bit_as_plain_parameters(fake_mode: FakeTensorMode):
    """QLoRA under fake tensors: bitsandbytes' `Params4bit` is a tensor subclass made with
    `Tensor._make_subclass`, which cannot wrap a fake tensor (its mode already owns the Python
    object). While the simulator builds and traces, a Params4bit of fake data is a plain parameter
    of the same packed tensor carrying the same attributes (`quant_state` above all), which is what
    `Linear4bit.forward` and bnb's ops read; a real one wraps the same storage, so the memory is the
    same. bnb's double-quantization code table (built with `.tolist()`, cached) is built outside the
    fake mode and stands as a fake tensor of `fake_mode` meanwhile. bnb's ops have shape functions (torch.library fakes): the 4-bit matmul and the
    dequantization in backward are traced as they run. Nothing to do without bitsandbytes."""
    try:
        from bitsandbytes import functional
        from bitsandbytes.nn import Params4bit
    except ImportError:
        yield
        return
    with unset_fake_temporarily():  # double quantization's code table: built with .tolist(), so built real
        real_table = functional.name2qmap.get("dynamic")
        table = real_table if real_table is not None else functional.create_dynamic_map()
    functional.name2qmap["dynamic"] = fake_mode.from_tensor(table)
    FLOP_FORMULAS[torch.ops.bitsandbytes.gemm_4bit] = _gemm_4bit_flops
    new = Params4bit.__new__

    def plain_when_fake(cls, data=None, requires_grad=False, quant_state=None, blocksize=None,
                        compress_statistics=True, quant_type="fp4", quant_storage=torch.uint8, module=None,
                        bnb_quantized=False, **kwargs):
        if not isinstance(data, FakeTensor):
            return new(cls, data, requires_grad, quant_state, blocksize, compress_statistics, quant_type,
                       quant_storage, module, bnb_quantized, **kwargs)
        param = nn.Parameter(data, requires_grad=requires_grad)
        param.blocksize, param.compress_statistics, param.quant_type = blocksize or 64, compress_statistics, quant_type
        param.quant_state, param.quant_storage, param.bnb_quantized, param.module = (quant_state, quant_storage,
                                                                                     bnb_quantized, module)
        return param

    Params4bit.__new__ = plain_when_fake
    try:
        yield
    finally:
        Params4bit.__new__ = new
        if real_table is None:
            functional.name2qmap.pop("dynamic")
        else:
            functional.name2qmap["dynamic"] = real_table


@contextmanager
def _sharding_propagation_in_a_fake_mode_of_its_own(mode: FakeTensorMode):
    """Keep DTensor's sharding propagation out of the trace, as it is out of a real run's.

    On a cache miss, DTensor works out an op's output metadata by running it on fake tensors of
    the *global* shapes, under `detect_fake_mode() or FakeTensorMode()`. In a real run that is a
    fake mode of its own, and MemTracker skips ops run under a fake mode other than the one it
    entered with. Under the simulator, `detect_fake_mode()` finds the trace's own mode, so the
    tracker counted those global-shape tensors as memory: one fused AdamW step over a parameter
    list it had not seen (a parameter without a gradient, skipped: XLNet's mask_emb, unused
    experts) added parameters, gradients and both moments at full size (xlnet predicted +19%,
    hy_v4 +34%, axk2 +59% over the real run). Here propagation runs under `mode`, which is not
    the trace's, as it is not the real tracker's."""
    from torch.distributed.tensor import _sharding_prop

    detect = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: mode
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = detect


@contextmanager
def _module_to_assigns_data():
    """Let Module.to move fake parameters, as it moves real ones.

    Module.to swaps a parameter for its converted copy when the copy is a tensor subclass, and a
    fake tensor cannot be swapped (its mode holds weak references to it), so any Module.to inside
    the fake mode fails: peft calls it on every adapter it adds. While the simulator builds a
    model, a module whose parameters are fake has each one's data assigned instead, which is what
    Module.to does for plain tensors (the parameter object, and so FSDP's and the optimizer's view
    of it, stays the same)."""
    apply = nn.Module._apply

    def assign_data(self, fn, recurse=True):
        if not any(isinstance(p, FakeTensor) for p in self._parameters.values() if p is not None):
            return apply(self, fn, recurse)
        if recurse:
            for child in self.children():
                child._apply(fn)
        for param in self._parameters.values():
            if param is not None:
                with torch.no_grad():
                    converted = fn(param)
                if converted is not param:
                    param.data = converted
        for name, buffer in self._buffers.items():
            if buffer is not None:
                self._buffers[name] = fn(buffer)
        return self

    nn.Module._apply = assign_data
    try:
        yield
    finally:
        nn.Module._apply = apply


@contextmanager
def _real_mask_decisions(*, packed: bool = False):
    """Let transformers skip the causal mask as it does in a real run.

    transformers cannot read a fake tensor's values, so under fake tensors it assumes packed
    sequences and padding and materialises the causal mask (SDPA then takes its masked path)
    where a real run finds neither and uses SDPA's `is_causal`. Our training batches hold one
    unpadded sequence per row, starting at position 0: the trace tells transformers so. `packed`:
    the batch is one padding-free row of several documents (training.padding_free_batch), whose
    position_ids restart: transformers finds packed sequences in a real run, and builds the
    block-diagonal mask, as it assumes under fake tensors.
    """
    try:
        from transformers import masking_utils
    except ImportError:  # no transformers masking helpers: nothing to correct
        yield
        return
    find_packed, ignore_mask = masking_utils.find_packed_sequence_indices, masking_utils._ignore_causal_mask_sdpa

    def not_packed(position_ids, *args, **kwargs):
        if isinstance(position_ids, FakeTensor) and not packed:
            return None
        return find_packed(position_ids, *args, **kwargs)

    def as_in_a_real_run(padding_mask, q_length, kv_length, q_offset, kv_offset, *args, **kwargs):
        if isinstance(padding_mask, FakeTensor):
            padding_mask = None
        if isinstance(q_offset, FakeTensor):
            q_offset = 0
        return ignore_mask(padding_mask, q_length, kv_length, q_offset, kv_offset, *args, **kwargs)

    masking_utils.find_packed_sequence_indices = not_packed
    masking_utils._ignore_causal_mask_sdpa = as_in_a_real_run
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = find_packed
        masking_utils._ignore_causal_mask_sdpa = ignore_mask


def _position_namer(model: nn.Module, blocks: Blocks, *, depth: int, period: int, keep_middle: bool):
    """Names FSDP units by depth-independent positions: 'root'; the first period + 1 blocks from
    the bottom (b0 = first) and the last period + 1 from the top (t0 = last); a block near both
    ends has both names. b0 and t0 are special (nothing to prefetch below the first block in
    backward; the last is the first one backward reaches); the blocks between them repeat with
    the period, their memory at a site changing by the same amount per period, so its largest
    values lie at the ends of that run: b1..b(period) and t1..t(period). Blocks further in are
    not sites (no counterpart at another depth) unless `keep_middle` (a full-depth trace). Under
    expert parallelism a block's experts are a unit of their own, named after the block
    ('b0.experts')."""
    index_of = {id(layer): (i, "") for i, layer in enumerate(blocks.layers)}
    index_of.update({id(experts): (i, ".experts") for i, layer in enumerate(blocks.layers)
                     for experts in fused_experts(layer)})
    # Units outside the blocks (torchtitan's: the embeddings, norm + head) exist at every depth: by name.
    outside = {id(module): f"root.{name}" for name, module in model.named_modules()
               if name and id(module) not in index_of and hasattr(module, "_get_fsdp_state")
               and not any(id(m) in index_of for m in _ancestors(model, name))}

    def position_of(fsdp_mod: nn.Module) -> tuple[str, ...]:
        if fsdp_mod is model:
            return ("root",)
        if id(fsdp_mod) in outside:
            return (outside[id(fsdp_mod)],)
        index, part = index_of[id(fsdp_mod)]
        names = []
        if index <= period:
            names.append(f"b{index}{part}")
        if index >= depth - 1 - period:
            names.append(f"t{depth - 1 - index}{part}")
        if not names and keep_middle:
            names.append(f"m{index}{part}")
        return tuple(names)

    return position_of


def _ancestors(model: nn.Module, name: str) -> list[nn.Module]:
    """The modules on the path from `model` down to the submodule `name` (excluded)."""
    parts, found, module = name.split("."), [], model
    for part in parts[:-1]:
        module = getattr(module, part)
        found.append(module)
    return found
