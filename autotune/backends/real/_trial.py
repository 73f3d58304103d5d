"""One real trial on one rank: build on meta, shard, materialise, train, measure.

Runs inside a torchrun worker (see worker.py); returns this rank's figures as a plain dict.
The ranks' dicts are gathered and reduced by rank 0 (worst peak, slowest rank).
"""

from __future__ import annotations

import gc
import math
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autotune.backends.real._capacity import (CapacityTracker, reset_rss_peak, rss_peak_bytes,
                                              track_inductor_allocations)
from autotune.backends.real._faults import Fault, inject_faults
from autotune.problem.config import TrialSpec
from autotune.distributed.litgpt_step import init_litgpt, is_litgpt_model
from autotune.distributed.parallel import ParallelDims, parallelize, register_rng_rules
from autotune.distributed.parallel.expert import set_routing
from autotune.distributed.training import (OffloadedActivations, build_model, make_optimizer, prepare_step, requantize_base,
                               sync_weights_to_vllm, token_batches, train_step)

# A short trial accumulates at most this many micro-batches per step: the per-step memory
# pattern (reduce-scatter after every micro-batch) is the same from the second one on.
MAX_TRIAL_GRAD_ACCUM = 2


def trial_grad_accum(spec: TrialSpec) -> int:
    """Micro-batches a trial's step runs: at most MAX_TRIAL_GRAD_ACCUM, except under pipeline parallelism,
    whose schedule's memory depends on how many micro-batches it runs (GPipe keeps every one's activations
    in flight; 1F1B needs at least as many as stages): the configuration's own count."""
    if spec.train.pipeline_parallel > 1:
        return spec.grad_accum_steps
    return min(spec.grad_accum_steps, MAX_TRIAL_GRAD_ACCUM)


@torch.no_grad()
def init_weights(model: nn.Module, *, seed: int) -> None:
    """Initialise the materialised (sharded) weights in place with the model's own HF init,
    which also recomputes RoPE buffers such as `inv_freq` that `to_empty` left as garbage; torchtitan's
    model with its own `init_states` (parameters and the RoPE cache), as its trainer does after `to_empty`.

    Each module's init runs on its DTensor shards. Where DTensor cannot run it there (the
    state-space mixers' `init.copy_(A_log, torch.log(A))` of a whole tensor computed on the spot:
    "aten.copy_.default got mixed torch.Tensor and DTensor", in mamba, mamba2, falcon_mamba,
    bamba, falcon_h1, granitemoehybrid, qwen3_next, qwen3_5_moe_text and lara_mini; rwkv's
    orthogonal init, which has no sharding rule), it runs on whole host copies instead and each
    rank keeps its own shard (`_init_on_whole_copies`)."""
    torch.manual_seed(seed)
    if is_litgpt_model(model):
        init_litgpt(model)
        return
    if hasattr(model, "init_states"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            model.init_states(buffer_device=next(model.parameters()).device)
        return
    init_module = getattr(model, "_init_weights", None)
    with warnings.catch_warnings():
        # DTensor warns that its random ops are incomplete on CPU meshes: each rank then fills
        # its own shard from its own seeded generator, which is all a trial needs.
        warnings.simplefilter("ignore", UserWarning)
        for module in model.modules():
            if init_module is not None:
                try:
                    init_module(module)
                except (RuntimeError, NotImplementedError):  # DTensor refused an op of this init
                    _init_on_whole_copies(module, init_module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()


def _init_on_whole_copies(module: nn.Module, init_module) -> None:
    """Run `init_module(module)` with each sharded parameter of `module` swapped for a whole
    host tensor holding this rank's shard at its place, then copy the shard's part back (what the
    init did not write comes back unchanged). Every rank runs the same init from the same seed,
    so every rank's whole tensor is the same, as when each loads its shard of one checkpoint.
    Host memory: a rank's device only ever holds its shards."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    swapped = []
    for owner in module.modules():
        for name, param in list(owner._parameters.items()):
            if not isinstance(param, DTensor):
                continue
            local = param.to_local()
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            where = tuple(slice(o, o + n) for o, n in zip(offset, shape))
            whole = torch.zeros(param.shape, dtype=param.dtype, device="cpu")
            whole[where] = local.cpu()
            owner._parameters[name] = nn.Parameter(whole, requires_grad=param.requires_grad)
            swapped.append((owner, name, param, local, where))
    try:
        init_module(module)
    finally:
        for owner, name, param, local, where in swapped:
            local.copy_(owner._parameters[name].detach()[where])
            owner._parameters[name] = param


def make_grad_scaler(precision: str, device: torch.device):
    """fp16 needs loss scaling. ShardedGradScaler unscales FSDP2's DTensor gradient shards and
    all-reduces the found-inf flag, so every rank skips or takes the same steps."""
    if precision != "fp16":
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=device.type)


def run_trial(spec: TrialSpec, *, mesh, device: torch.device, rank: int, warmup_steps: int,
              timed_steps: int, seed: int, faults: list[Fault], trial_index: int) -> dict[str, Any]:
    """Train `warmup_steps + timed_steps` steps of `spec` on this rank; return its figures."""
    on_cuda = device.type == "cuda"
    cap: dict[str, Any] = {}
    if on_cuda:
        # Cap the caching allocator before anything of the trial is allocated, so a trial over
        # the limit runs out of memory for real, as on a GPU of that size.
        release_memory(device)
        cap = cap_device_memory(device, limit_bytes=spec.limit_bytes)
        torch.cuda.reset_peak_memory_stats(device)
    if not on_cuda and spec.train.compile != "none":
        track_inductor_allocations()  # before compiling: inductor's buffers count (docs/COMPILE.md)
        register_rng_rules(CapacityTracker)
    model, notes = materialise(spec, mesh=mesh, device=device, seed=seed)
    offloaded = None
    if spec.train.activation_offload:
        if on_cuda:
            offloaded = OffloadedActivations()
        else:  # on CPUs the host is the device: nothing would be freed (the backend refuses it before launch)
            notes.append("activation_offload requested but not applied: the host is the device on CPUs")
    optimizer = make_optimizer(model, impl=spec.train.optimizer_impl)
    scaler = make_grad_scaler(spec.train.precision, device)
    grad_accum = trial_grad_accum(spec)
    dims = ParallelDims.of(spec.train, spec.cluster.num_gpus)
    batches = token_batches(vocab_size=int(spec.model.config_dict["vocab_size"]),
                            micro_batch_size=spec.train.micro_batch_size, seq_len=spec.seq_len,
                            device=device, seed=seed + dims.data_rank(rank),  # a tp/cp group, a pipeline: one batch
                            documents=spec.documents)  # a packed problem: its worst-case row (autotune/problem/packing.py)
    inject_faults(faults, rank=rank, trial=trial_index)

    reset_rss_peak()
    # On CPUs the tracker is the device: it counts tensor memory and enforces the capacity.
    tracker = None if on_cuda else CapacityTracker(capacity_bytes=spec.limit_bytes, rank=rank)
    if tracker is not None:
        tracker.track_external(model, optimizer)
        batches = _reset_before_each_forward(batches, tracker)
    step_times: list[float] = []
    warmup_times: list[float] = []  # the first step of a compiled trial compiles its blocks
    phases: list[tuple[float, float, float]] = []  # (micro-batches, optimizer step, first micro-batch) per timed step
    losses: list[float] = []

    def clock() -> float:
        _synchronize(device)
        return time.perf_counter()

    # A CPU run counts the attention dropout it meets (calls passed through unchanged): torch's CPU
    # SDPA runs the math kernel for it, not a GPU's fused one, and the result says so (issue 56).
    # Not under compile, where dynamo would trace the counting wrapper into the blocks' graphs.
    dropout: dict[str, int] = {}
    counting = nullcontext()
    if not on_cuda and spec.train.compile == "none":
        from autotune.backends.sim._gpu_kernels import sdpa_as_on_a_gpu

        counting = sdpa_as_on_a_gpu(False, seen=dropout)
    with tracker if tracker is not None else nullcontext(), counting:
        for step in range(warmup_steps + timed_steps):
            timed = step >= warmup_steps
            _synchronize(device)
            if timed:
                dist.barrier(device_ids=[device.index] if on_cuda else None)
            start = time.perf_counter()
            loss = train_step(model, optimizer, batches, grad_accum_steps=grad_accum, scaler=scaler,
                              phase_times=phases if timed else None, clock=clock, saved_activations=offloaded,
                              step=spec.step)
            _synchronize(device)
            (step_times if timed else warmup_times).append(time.perf_counter() - start)
            losses.append(float(loss))
            if spec.workload.weight_sync:  # GRPO: TRL gathers the weights for vLLM (untimed: not training)
                sync_weights_to_vllm(model, device=device)
        # fp16: a scaler that skipped every step never allocated the optimizer state, and the
        # peak would miss it. Step on (untimed) until one step is taken.
        extra = 0
        while scaler is not None and not optimizer.state and extra < FP16_EXTRA_STEPS:
            losses.append(float(train_step(model, optimizer, batches, grad_accum_steps=grad_accum, scaler=scaler,
                                           saved_activations=offloaded, step=spec.step)))
            extra += 1
        if scaler is not None and not optimizer.state:
            raise RuntimeError(f"fp16: the grad scaler skipped all {len(losses)} optimizer steps (inf/NaN "
                               "gradients at every scale): the optimizer state was never allocated")

    from autotune.problem.catalog.attention import FLASH, kernel_note

    if spec.model.attention in FLASH:  # flash-attn is not run here: its stand-in is (catalog/attention.py)
        notes.append(kernel_note(spec.model.attention_implementation, run=True))
    if dropout.get("math_with_dropout"):
        from autotune.backends.sim._gpu_kernels import CPU_DROPOUT_NOTE

        notes.append(CPU_DROPOUT_NOTE)
    figures: dict[str, Any] = dict(
        rank=rank, losses=losses, step_times=step_times, warmup_times=warmup_times, grad_accum=grad_accum,
        micro_batches_s=[p[0] for p in phases], optimizer_step_s=[p[1] for p in phases],
        first_micro_batch_s=[p[2] for p in phases],
        tokens_per_micro_batch=spec.train.micro_batch_size * spec.seq_len,
        tokens_per_step=spec.train.micro_batch_size * spec.seq_len * grad_accum,
        rss_peak_bytes=rss_peak_bytes(), notes=notes, finite=all(math.isfinite(x) for x in losses))
    if spec.train.compile != "none":
        # Graphs dynamo compiled in this process so far: 0 would mean the blocks ran eager.
        from torch._dynamo.utils import counters

        figures["compiled_graphs"] = int(counters["stats"]["unique_graphs"])
    if spec.train.float8 != "none":
        # Linears torchao swapped for Float8Linear on this rank: 0 would mean a high-precision run.
        figures["float8_linears"] = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if on_cuda:
        from autotune.estimate.runtime_memory import measure_outside_allocator

        outside = max(cap["outside_allocator_bytes"], measure_outside_allocator(device)["outside_allocator_bytes"])
        reserved = torch.cuda.max_memory_reserved(device)
        figures.update(tensor_peak_bytes=torch.cuda.max_memory_allocated(device), reserved_peak_bytes=reserved,
                       outside_allocator_bytes=outside, device_peak_bytes=reserved + outside,
                       device_capacity_bytes=torch.cuda.get_device_properties(device).total_memory,
                       memory_fraction=cap["fraction"], breakdown={})
    else:
        figures.update(tensor_peak_bytes=tracker.peak_bytes(), breakdown=tracker.peak_breakdown())
    del model, optimizer, scaler, tracker, batches
    release_memory(device)
    if on_cuda:
        # What the allocator still holds with no trial alive: workspaces no traced op made.
        figures["allocator_persistent_bytes"] = torch.cuda.memory_allocated(device)
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    return figures


FP16_EXTRA_STEPS = 16


def cap_device_memory(device: torch.device, *, limit_bytes: int) -> dict[str, Any]:
    """Limit this process's caching allocator so that allocator + what lives outside it (context,
    NCCL, measured now) stays within `limit_bytes`: `set_per_process_memory_fraction` caps reserved
    memory, and an allocation over the cap raises torch.OutOfMemoryError as on a smaller GPU."""
    from autotune.estimate.runtime_memory import measure_outside_allocator

    measured = measure_outside_allocator(device)
    fraction = allocator_fraction(limit_bytes=limit_bytes, outside_allocator_bytes=measured["outside_allocator_bytes"],
                                  total_bytes=measured["total_bytes"])
    if fraction <= 0:
        raise torch.OutOfMemoryError(
            f"the memory limit {limit_bytes:,} bytes leaves nothing for tensors: "
            f"{measured['outside_allocator_bytes']:,} bytes are used outside the allocator (context, NCCL)")
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return dict(fraction=fraction, **measured)


def allocator_fraction(*, limit_bytes: int, outside_allocator_bytes: int, total_bytes: int) -> float:
    """The fraction of the device the caching allocator may reserve under a device-level limit."""
    return max(0.0, min(1.0, (limit_bytes - outside_allocator_bytes) / total_bytes))


def materialise(spec: TrialSpec, *, mesh, device: torch.device, seed: int) -> tuple[nn.Module, list[str]]:
    """A trial's model: build_sharded, then the stack's step prepared. Returns the model and notes on
    what could not be applied here."""
    if device.type == "cpu" and spec.train.float8 == "tensorwise" and spec.train.tensor_parallel > 1:
        from autotune.backends.real._gloo_float8 import gather_float8_as_bytes

        gather_float8_as_bytes()  # torchao's float8 TP all-gathers float8, which gloo cannot carry
    model, notes = build_sharded(spec.model, spec.train, mesh=mesh, device=device, seed=seed,
                                 finetuning=spec.finetuning, step=spec.step, seq_len=spec.seq_len)
    set_routing(model, spec.routing_skew)  # a stated skew: the router forced to it (parallel.ExpertDispatch)
    prepare_step(model, step=spec.step, precision=spec.train.precision, device_type=device.type)
    return model, notes


def build_sharded(model_spec, train, *, mesh, device: torch.device, seed: int, finetuning=None,
                  step: str = "autotune", seq_len: int | None = None,
                  load: Callable[[nn.Module], None] | None = None) -> tuple[nn.Module, list[str]]:
    """Build on meta, apply THE wrapping function, allocate only this rank's shards, initialise with
    the model's own init (which also recomputes the non-persistent buffers no checkpoint holds, RoPE's
    inv_freq), then `load` real weights into the shards if given (the exported script's checkpoint).
    Real trials and the fsdp2 export's script both build their model here. Returns the model and notes
    on what could not be applied here."""
    notes: list[str] = []
    offload = train.cpu_offload and device.type == "cuda"
    with torch.device("meta"):
        model = build_model(model_spec, seed=seed, precision=train.precision, finetuning=finetuning, step=step,
                            seq_len=seq_len)
    if train.cpu_offload and not offload:
        notes.append("cpu_offload requested but not applied: CPUOffloadPolicy needs an accelerator")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the offload warning is in the notes
        parallelize(model, mesh, train, allow_offload=device.type == "cuda", step=step)
    # Offloaded shards live on the host (as in torchtitan); FSDP2 moves them for compute.
    model.to_empty(device="cpu" if offload else device)
    init_weights(model, seed=seed)
    if finetuning is not None and finetuning.qlora:
        requantize_base(model, seed=seed)
    if load is not None:
        load(model)
    if offload:
        _move_buffers(model, device)
    return model, notes


def _reset_before_each_forward(batches: Iterator[torch.Tensor], tracker: CapacityTracker) -> Iterator[torch.Tensor]:
    """MemTracker refuses a second forward of the root (the next micro-batch or step) unless its
    module stats are reset first; train_step takes a batch right before each forward. The
    peak and the capacity are unaffected."""
    for number, batch in enumerate(batches):
        if number:
            tracker.reset_mod_stats()
        yield batch


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers (RoPE frequencies) are not FSDP-managed: they go where compute runs."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(device)


def release_memory(device: torch.device) -> None:
    """Free what the trial left so the next trial in a persistent launch starts clean: the
    device's cached blocks and the pinned host blocks CPU offload staged (empty_cache leaves
    those, so host RSS would grow across trials and count in the next one's figure)."""
    gc.collect()
    # What survives a trial (imported modules, torch's dispatch and sharding caches) lives as long
    # as the process: freezing it keeps later collections, this one's and the automatic ones
    # during the next trial, from walking it again (measured: a launch of 8 tiny trials ~7%
    # faster). Objects still reachable only through a cycle are all collected above first.
    gc.freeze()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        release_pinned_host_memory()


def release_pinned_host_memory() -> None:
    """Return the pinned host allocator's cached blocks (torch >= 2.8; older: the private name)."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is None:
        empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
