"""The `sim` backend: per-GPU memory predicted by tracing the real model with fake tensors,
step time estimated from the traced FLOPs and FSDP's collective volumes (docs/SIMULATOR.md)."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Literal

import os
from typing import TYPE_CHECKING

from autotune.util import cache
from autotune.estimate import costmodel
from autotune.backends.analytic import (attention_span, context_parallel_work, expert_parallel_work, fused_bytes_saved,
                                      tensor_parallel_work, model_shape, offload_fresh_page_bytes,
                                      float8_gathered_weight_seconds, pipeline_float8_counts,
                                      pipeline_virtual_stages, screen_margin, step_work,
                                      symmetric_memory_bytes, trainable_split)
from autotune.backends.base import MEMORY_CATEGORIES, Figure, TrialBackend, TrialResult
from autotune.backends.sim._extrapolate import extrapolate, shallow_depths
from autotune.problem.config import PARAM_DTYPE_BYTES, TrialSpec
from autotune.util.errors import AutotuneError
from autotune.problem.packing import STEP as PACKED_STEP
from autotune.estimate.runtime_memory import runtime_memory
from autotune.util.units import format_bytes

if TYPE_CHECKING:
    from autotune.backends.sim._trace import StepTrace

# torch and transformers are imported when a trace is needed, not before: a plan whose every
# prediction is in the persistent cache (autotune/util/cache.py) never imports them.

RUNTIME_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "NCCL_BUFFSIZE", "NCCL_MAX_NCHANNELS", "NCCL_MAX_CTAS",
               "CUBLAS_WORKSPACE_CONFIG")
"""Environment variables the runtime memory terms read: part of a cached prediction's key."""

GiB = 2**30
_WORLD_INDEX = 3
"""Where the world size is in a trace key (_trace_key): traces differing only there share a derivation."""
_ACCUM_INDEX = 6
"""Where 'accumulates gradients' is in a trace key: the same traced step either way (_world.accumulated)."""
_MB_BASE = (2, 3)
"""Micro-batches larger than these are extrapolated from them (see _extrapolate)."""


def _linear_in_micro_batch(spec: TrialSpec) -> bool:
    """Whether memory grows linearly with the micro-batch from _MB_BASE on: TRL's fused LM head
    holds one tile of at most TRL_TOKEN_TILE tokens, a term that stops growing once a micro-batch
    has that many, so its step extrapolates only from micro-batches already past it; a padding-free
    micro-batch is one row whose attention mask is (micro-batch x seq_len) squared: never linear."""
    from autotune.backends.analytic import TRL_TOKEN_TILE

    if spec.step in ("trl-padding-free", PACKED_STEP):  # a packed row's documents differ by micro-batch
        return False
    return spec.step != "trl" or min(_MB_BASE) * (spec.seq_len - 1) >= TRL_TOKEN_TILE


def _why_untraceable(exc: Exception) -> str:
    """What a failure of a kind fake tensors can never get past means for the user (models that read a
    tensor's value in forward: jetmoe's and modernbert-decoder's routing, docs/MODEL_COVERAGE.md)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    if isinstance(exc, DataDependentOutputException):
        return (" (the model reads a tensor's value in forward, e.g. .item() or a data-dependent shape, which "
                "the simulator's fake tensors cannot give: tune it with real trials, --backend cpu or cuda)")
    return ""


def _traced_train(train, micro_batch_size: int):
    """The configuration a trace is made (and keyed) for: at the micro-batch traced, without CPU offload (modelled
    from the trace) and without async TP (its fused ops allocate what the unfused graph traced does; its
    symmetric-memory workspace is a runtime term: runtime_memory.async_tp_workspace_bytes)."""
    return train.with_(micro_batch_size=micro_batch_size, cpu_offload=False, async_tensor_parallel=False)


def _has_dropout(config: dict) -> bool:
    """Whether a config sets any dropout above 0: only then does the GPU's attention kernel choice
    (by compute capability) change a trace, so only then do traces differ by GPU type (the plan's
    options on A100s and H100s share the rest)."""
    return any(("dropout" in key or "pdrop" in key) and isinstance(value, (int, float))
               and not isinstance(value, bool) and value > 0 for key, value in config.items())


class SimBackend(TrialBackend):
    """Simulated trials. `device_kind="cuda"` predicts a GPU run on `spec.cluster.gpu` (tensor
    peak plus an estimated runtime margin, estimated tokens/s); `"cpu"` predicts the cpu
    backend's gloo run with `num_gpus` ranks (tensor peak only, no throughput).

    `extrapolate` traces shallow copies and extrapolates in depth (and, with
    `extrapolate_micro_batch`, micro-batches over 3 from micro-batches 2 and 3 when the same
    configuration was evaluated before at another micro-batch); False traces every model whole.
    `parallel` traces the deeper shallow copy in a helper process (_helper) where a second core
    is free: the same traces, in about half the time. Close the backend to stop the helper.
    """

    name = "sim"
    memory_source = "predicted"
    throughput_source = "estimated"

    def __init__(self, *, device_kind: Literal["cuda", "cpu"] = "cuda", extrapolate: bool = True,
                 extrapolate_micro_batch: bool = True, max_cached_models: int = 24, screen: bool = True,
                 hardware=None, parallel: bool = False, derive_world_sizes: bool = False) -> None:
        if device_kind not in ("cuda", "cpu"):
            raise ValueError(f"device_kind must be 'cuda' or 'cpu', got {device_kind!r}")
        self.device_kind = device_kind
        self.applies_async_tp = device_kind == "cuda"  # a cpu-kind simulator predicts CPU trials, which refuse it
        self.hardware = hardware
        """A HardwareProfile (autotune/estimate/hardware.py) the step time is estimated on; None: the
        shipped profile of the cluster's GPU (no throughput for a CPU run without one)."""
        self.extrapolate = extrapolate
        self.extrapolate_micro_batch = extrapolate_micro_batch
        self.screen = screen
        self._max_cached_models = max_cached_models
        self.parallel = parallel
        self.derive_world_sizes = derive_world_sizes
        """Derive a trace from the same configuration's traces at two other world sizes where that is
        exact (_world), instead of tracing it: `autotune plan`, which asks for many GPU counts."""
        self._eager_op_work: dict[str, dict[str, float] | None] = {}
        """The traced op work of the eager high-precision twins of compiled and float8 configurations,
        by the twin's cache key (_eager_twin_op_work)."""
        self.shared_traces: str | None = None
        """A folder where this backend leaves every trace it makes and finds those other processes
        made (`autotune plan --jobs`: a process per GPU count, deriving from each other's traces)."""
        self._helper = None
        self._tracer_instance = None
        self._traces: dict[tuple, StepTrace] = {}
        self._families: set[tuple] = set()
        self._mesh_in_use = None

    def describe(self) -> str:
        what = "a GPU run (tensor peak + estimated runtime margin)" if self.device_kind == "cuda" \
            else "a CPU gloo run (tensor peak)"
        return (f"sim: memory predicted by tracing the real model with fake tensors "
                f"({'depth-extrapolated' if self.extrapolate else 'full depth'}) for {what}; "
                f"throughput {self._throughput_description()}")

    @property
    def _profile(self):
        """The hardware profile that applies to what this backend predicts (a cpu profile for a
        CPU run, a GPU one for a GPU run), or None."""
        hardware = self.hardware
        return hardware if hardware is not None and hardware.device == self.device_kind else None

    def _throughput_description(self) -> str:
        if self._profile is not None:
            return f"estimated (per-operation cost model on {self._profile.describe()})"
        return "estimated (roofline)" if self.device_kind == "cuda" else "not estimated (no CPU profile)"

    @property
    def _tracer(self):
        if self._tracer_instance is None:
            from autotune.backends.sim._trace import Tracer

            self._tracer_instance = Tracer(max_cached_models=self._max_cached_models)
        return self._tracer_instance

    def close(self) -> None:
        self._stop_helper()
        self._traces.clear()
        self._families.clear()
        self._mesh_in_use = None
        if self._tracer_instance is not None:
            from autotune.backends.sim._fakepg import release_fake_group

            self._tracer_instance.clear()
            release_fake_group()

    def evaluate(self, spec: TrialSpec) -> TrialResult:
        start = time.perf_counter()
        key = cache.key_of("sim-result", self._cache_inputs(spec))
        cached = cache.load("sim-result", key)
        if cached is not None:
            result = TrialResult.from_dict(cached)
            result.extras["cache"] = "hit: predicted before with the same inputs, versions and code"
            result.duration_s = time.perf_counter() - start
            return result
        try:
            result = self._screened(spec) or self._evaluate(spec)
        except AutotuneError:
            raise  # the user's to fix (unsupported model, a real process group in the way)
        except Exception as exc:  # an estimate that failed is an error trial, never a fit
            import traceback

            result = TrialResult(status="error", message=f"simulation failed: {type(exc).__name__}: {exc}"
                                                         f"{_why_untraceable(exc)}",
                                 extras={"traceback": traceback.format_exc()})  # for the run's log
        result.duration_s = time.perf_counter() - start
        if result.status in ("ok", "oom"):
            cache.store("sim-result", key, result.to_dict())
        return result

    def _cache_inputs(self, spec: TrialSpec) -> dict[str, Any]:
        """Everything a prediction depends on besides versions and code (cache.fingerprint)."""
        # The step too: the same spec traces another step where torchtitan became importable (config.stack_step).
        return dict(spec=spec.to_dict(), step=spec.step, device_kind=self.device_kind, extrapolate=self.extrapolate,
                    extrapolate_micro_batch=self.extrapolate_micro_batch, screen=self.screen,
                    derive_world_sizes=self.derive_world_sizes,
                    environment={name: os.environ.get(name) for name in RUNTIME_ENV},
                    hardware=self.hardware.to_dict() if self.hardware is not None else None)

    def _screened(self, spec: TrialSpec) -> TrialResult | None:
        """The closed form's verdict where it is far over the limit, else None (trace it)."""
        if not self.screen:
            return None
        from autotune.backends.analytic import AnalyticBackend

        try:
            estimate = AnalyticBackend().evaluate(spec)
        except Exception:  # a model the closed form does not know: the trace decides
            return None
        if estimate.status != "oom" or estimate.peak_memory is None:
            return None
        # A CPU run has no runtime margin: compare its tensor peak alone.
        need = estimate.extras.get("tensor_peak_bytes") if self.device_kind == "cpu" else estimate.peak_bytes
        margin = screen_margin(spec.train.compile != "none")
        if not need or need <= margin * spec.limit_bytes:
            return None
        estimate.message = (f"estimated {format_bytes(need)} per GPU by the closed form, over "
                            f"{margin:.0%} of the limit {format_bytes(spec.limit_bytes)}: not traced")
        estimate.extras["screened"] = True
        if self.device_kind == "cpu":
            estimate.tokens_per_sec = None
            # The figure shown is the one compared: a CPU run's tensor peak, not a GPU's total.
            estimate.peak_memory = Figure(need, "estimated", "closed-form tensor peak of the CPU run (no "
                                                             "runtime memory on CPUs)")
        return estimate

    # --- tracing ---------------------------------------------------------------------------------

    def _mesh(self, spec: TrialSpec):
        from autotune.backends.sim._fakepg import fake_mesh
        from autotune.distributed.parallel import ParallelDims

        mesh = fake_mesh(ParallelDims.of(spec.train, spec.cluster.num_gpus))
        if spec.cluster.num_gpus != self._mesh_in_use:
            self._tracer.clear()  # sharded models belong to the previous process group's meshes
            self._mesh_in_use = spec.cluster.num_gpus
        return mesh

    def _trace_key(self, spec: TrialSpec, *, depth: int, micro_batch_size: int, keep_middle: bool) -> tuple:
        train = _traced_train(spec.train, micro_batch_size)
        return (spec.model.name, repr(sorted(spec.model.config_dict.items())), depth, spec.cluster.num_gpus,
                spec.seq_len, train.cache_key(), spec.grad_accum_steps > 1, keep_middle, self.device_kind,
                spec.workload.weight_sync, spec.finetuning.key(), spec.step,
                self._gpu_sm(spec) if _has_dropout(spec.model.config_dict) else None,
                *((spec.routing_skew.key(),) if train.expert_parallel > 1 and not spec.routing_skew.balanced else ()),
                *((spec.packing.key(),) if spec.packing is not None else ()),
                *((spec.model.attention,) if spec.model.attention is not None else ()))

    def _gpu_sm(self, spec: TrialSpec) -> tuple[int, int] | None:
        """The compute capability a GPU run's attention kernels are chosen for (_gpu_kernels); None on CPU."""
        from autotune.backends.sim._gpu_kernels import gpu_sm

        return gpu_sm(spec.cluster.gpu.name) if self.device_kind == "cuda" else None

    def _trace(self, spec: TrialSpec, *, depth: int, micro_batch_size: int, keep_middle: bool) -> StepTrace:
        train = _traced_train(spec.train, micro_batch_size)
        world_size = spec.cluster.num_gpus
        key = self._trace_key(spec, depth=depth, micro_batch_size=micro_batch_size, keep_middle=keep_middle)
        self._derive(spec, key, train)
        if key not in self._traces:
            mesh = self._mesh(spec)
            self._keep(key, self._tracer.trace(
                spec.model, depth=depth, mesh=mesh, world_size=world_size, train=train, seq_len=spec.seq_len,
                grad_accum_steps=spec.grad_accum_steps, keep_middle=keep_middle,
                gloo=self.device_kind == "cpu", weight_sync=spec.workload.weight_sync,
                finetuning=spec.finetuning, step=spec.step, gpu_sm=self._gpu_sm(spec), routing=spec.routing_skew,
                documents=spec.with_train(train).documents))
        return self._traces[key]

    def _keep(self, key: tuple, trace: StepTrace) -> None:
        """A trace made here (or by the helper): kept, and left in `shared_traces` for other processes."""
        self._traces[key] = trace
        if self.shared_traces and not trace.derived_from:
            from autotune.backends.sim._world import share

            share(self.shared_traces, key, _WORLD_INDEX, trace)

    def _derive(self, spec: TrialSpec, key: tuple, train) -> None:
        """With derive_world_sizes: the trace of `key` from the same configuration's traces at two other
        world sizes (at one with HSDP), or at the same world size for the other gradient accumulation,
        where that is exact (_world); else nothing (it is traced)."""
        if key in self._traces or not self.derive_world_sizes:
            return
        if self.shared_traces:  # what other processes traced of this configuration, at any world size
            from autotune.backends.sim._world import shared

            for other, trace in shared(self.shared_traces, key, _WORLD_INDEX):
                self._traces.setdefault(other, trace)
            if key in self._traces:
                return
        derived = self._derived(spec, key, train)
        if derived is not None:
            self._traces[key] = derived

    def _derived(self, spec: TrialSpec, key: tuple, train) -> StepTrace | None:
        from autotune.backends.sim._world import accumulated, derive, replicated, unpadded

        world, accumulating = _WORLD_INDEX, key[_ACCUM_INDEX]

        def family(other: tuple) -> tuple:  # the configuration, whatever the world size and accumulation
            return tuple(part for i, part in enumerate(other) if i not in (world, _ACCUM_INDEX))

        # Traces of the same configuration at other world sizes, with or without accumulation (the
        # same traced step: _world.accumulated), one per world size, this accumulation first.
        found: dict[int, StepTrace] = {}
        for other, trace in sorted(self._traces.items(), key=lambda item: item[0][_ACCUM_INDEX] != accumulating):
            if not trace.derived_from and family(other) == family(key):
                found.setdefault(other[world], trace)
        # The per-operation cost model (a hardware profile) reads a figure a derivation leaves out (_world).
        if not found or self.device_kind != "cuda" or spec.workload.weight_sync or self._profile is not None:
            return None
        if key[world] in found:  # the same step, traced for the other accumulation
            return accumulated(found[key[world]], accumulating)
        traced = sorted(found.items())
        for w1, first in reversed(traced):  # HSDP: one trace gives the others
            same = replicated(accumulated(first, accumulating), w1, key[world], train)
            if same is not None:
                return same
        if len(traced) < 2:
            return None
        (w1, first), (w2, second) = traced[-2:]
        if not unpadded(spec.model, train, (w1, w2, key[world])):
            return None
        return derive(accumulated(first, accumulating), w1, accumulated(second, accumulating), w2, key[world])

    def _sites(self, spec: TrialSpec) -> tuple[dict, StepTrace, dict[str, Any]]:
        """Sites of the full model at the spec's micro-batch, a trace for shapes, and notes."""
        if spec.train.pipeline_parallel > 1:
            return self._pipeline_sites(spec)
        num_layers = spec.model.num_layers
        mb = spec.train.micro_batch_size
        from autotune.backends.sim._trace import period_of

        period = period_of(spec.train, spec.model)
        depths = shallow_depths(num_layers, period) if self.extrapolate else None
        if depths is None:
            trace = self._trace(spec, depth=num_layers, micro_batch_size=mb, keep_middle=True)
            return trace.sites, trace, dict(traced_layers=[num_layers], extrapolated=False,
                                            flops_per_microbatch=trace.flops, op_work=dict(trace.op_work),
                                            offloaded_activations=dict(trace.offloaded))
        # A configuration seen before at another micro-batch is being grown: trace micro-batches
        # 2 and 3 once, then every larger one is free. A first look traces the one asked for.
        family = self._trace_key(spec, depth=0, micro_batch_size=1, keep_middle=False)
        mbs = (mb,)
        if (self.extrapolate_micro_batch and mb > max(_MB_BASE) and family in self._families
                and _linear_in_micro_batch(spec)):
            mbs = _MB_BASE
        self._families.add(family)
        traces = self._shallow_traces(spec, [(d, m) for d in depths for m in mbs])
        combined = extrapolate(traces, num_layers=num_layers, micro_batch_size=mb, period=period)
        notes = dict(traced_layers=list(depths), traced_micro_batches=list(mbs), extrapolated=True,
                     flops_per_microbatch=combined.flops, dropped_sites=combined.dropped_sites,
                     op_work=dict(combined.op_work or {}), offloaded_activations=dict(combined.offloaded or {}),
                     largest_allocation_bytes=_largest_at(traces, depths, mbs, mb))
        return combined.sites, traces[depths[0], mbs[0]], notes

    def _pipeline_sites(self, spec: TrialSpec) -> tuple[dict, StepTrace, dict[str, Any]]:
        """Pipeline parallelism (_pipeline): each pipeline rank that could peak highest traced at its own rank of
        the fake group; one site per traced rank, the worst the prediction. With `extrapolate`, a rank whose
        stages are deep enough is traced on two shallow copies and extrapolated in depth per site
        (_pipeline.trace_pipeline_rank_extrapolated, exact as _extrapolate), the others traced whole."""
        from autotune.backends.sim._pipeline import (ranks_to_trace, trace_pipeline_rank,
                                                     trace_pipeline_rank_extrapolated)
        from autotune.backends.sim._trace import StepTrace, period_of
        from autotune.problem.catalog.models import model_flops_per_token

        key = ("pipeline", spec.to_dict().__repr__(), self.device_kind, self.extrapolate)
        pipelines = self.__dict__.setdefault("_pipeline_traces", {})
        if key not in pipelines:
            pp = spec.train.pipeline_parallel
            ranks = ranks_to_trace(spec.model.num_layers, pp, spec.train.pipeline_schedule)
            gloo = self.device_kind == "cpu"
            period = period_of(spec.train, spec.model)
            traced = []
            for rank in ranks:
                found = (trace_pipeline_rank_extrapolated(spec, rank, gloo=gloo, period=period)
                         if self.extrapolate else None)
                traced.append(found or trace_pipeline_rank(spec, rank, gloo=gloo))
            # The fake group was re-initialised at other ranks: models sharded on the old one's meshes go.
            self._tracer.clear()
            self._mesh_in_use = None
            worst = max(traced, key=lambda t: t["tensor_peak_bytes"])
            tokens = spec.train.micro_batch_size * spec.seq_len
            trace = StepTrace(depth=sum(b - a for s in worst["stages"] for a, b in [s["blocks"]]),
                              sites={("pipeline", f"rank {t['pipeline_rank']}"): t["categories"] for t in traced},
                              flops=model_flops_per_token(spec.model, spec.seq_len) * tokens / pp,
                              tensor_peak_bytes=worst["tensor_peak_bytes"], block_params=worst["block_params"],
                              root_params=worst["root_params"], duration_s=sum(t["duration_s"] for t in traced),
                              largest_allocation_bytes=worst["largest_allocation_bytes"])
            pipelines[key] = (trace, traced)
        trace, traced = pipelines[key]
        notes = dict(traced_layers=[trace.depth], extrapolated=False, flops_per_microbatch=trace.flops, op_work={},
                     offloaded_activations={},
                     pipeline_ranks=[{k: v for k, v in t.items() if k != "duration_s"} for t in traced],
                     per_pipeline_rank_tensor_peak_bytes={str(t["pipeline_rank"]): t["tensor_peak_bytes"]
                                                          for t in traced},
                     # Per traced rank: its stages' blocks and the shallow copies' it was extrapolated from, or why
                     # it was traced whole.
                     pipeline_ranks_extrapolated={
                         str(t["pipeline_rank"]): t.get("extrapolated") or (
                             "traced whole: its stages too shallow to extrapolate (a stage needs period + 2 blocks "
                             "and two periods more), or two shallow copies no cheaper than the whole"
                             if self.extrapolate else "traced whole: extrapolation off")
                         for t in traced})
        return trace.sites, trace, notes

    def _shallow_traces(self, spec: TrialSpec, keys: list[tuple[int, int]]) -> dict[tuple[int, int], StepTrace]:
        """Traces of `spec` at each (depth, micro-batch) in `keys`, for extrapolation. With a helper
        the deepest copies are traced there while this process traces the others."""
        def trace(depth: int, mb: int) -> StepTrace:
            return self._trace(spec, depth=depth, micro_batch_size=mb, keep_middle=False)

        def known(depth: int, mb: int) -> bool:
            return self._trace_key(spec, depth=depth, micro_batch_size=mb, keep_middle=False) in self._traces

        for d, m in keys:  # derived where exact: neither traced here nor sent to the helper
            self._derive(spec, self._trace_key(spec, depth=d, micro_batch_size=m, keep_middle=False),
                         spec.train.with_(micro_batch_size=m, cpu_offload=False))
        deepest = max(d for d, _ in keys)
        remote = [(d, m) for d, m in keys if d == deepest and not known(d, m)]
        helper = self._started_helper() if remote else None
        if helper is None:
            return {(d, m): trace(d, m) for d, m in keys}
        try:
            helper.submit(spec, remote)
            for d, m in keys:
                if (d, m) not in remote:
                    trace(d, m)
            for (d, m), traced in zip(remote, helper.results()):
                self._keep(self._trace_key(spec, depth=d, micro_batch_size=m, keep_middle=False), traced)
        except BaseException:
            self._stop_helper()  # a request half done (or interrupted) leaves nothing to resume
            raise
        return {(d, m): trace(d, m) for d, m in keys}  # all traced by now

    def _started_helper(self):
        """The helper process, started on first need where it pays (decided once per backend)."""
        if not self.parallel or self._helper is False:
            return None
        if self._helper is None:
            from autotune.backends.sim._helper import TraceHelper, can_help

            if not can_help():
                self._helper = False
                return None
            self._tracer  # forked after torch and the tracing code are imported: the helper starts warm
            self._helper = TraceHelper(functools.partial(
                SimBackend, device_kind=self.device_kind, extrapolate=self.extrapolate,
                extrapolate_micro_batch=self.extrapolate_micro_batch, max_cached_models=self._max_cached_models,
                screen=self.screen, hardware=self.hardware, parallel=False))
        return self._helper

    def _stop_helper(self) -> None:
        if self._helper:
            self._helper.close()
        self._helper = None

    # --- the result ------------------------------------------------------------------------------

    def _evaluate(self, spec: TrialSpec) -> TrialResult:
        from autotune.backends.sim import _offload
        from autotune.backends.sim._trace import REFTYPE_CATEGORIES

        world_size = spec.cluster.num_gpus
        sites, trace, notes = self._sites(spec)
        offload = spec.train.cpu_offload
        host_per_node = None
        root_staging = 0
        offloaded = notes.get("offloaded_activations") or {}
        if offload:
            host_per_rank = _offload.host_bytes_per_rank(sites, trace, num_layers=spec.model.num_layers)
            host_per_node = host_per_rank * spec.cluster.gpus_per_node
            block_staging, root_staging = _offload.staging_bytes(trace, num_gpus=world_size)
            sites = _offload.device_sites(sites, block_staging=block_staging, root_staging=root_staging)
        peak_key, peak_cats = max(sites.items(), key=lambda item: sum(item[1].values()))
        tensor_peak = sum(peak_cats.values())
        sync = (_weight_sync(sites, peak_key, source="estimated" if offload else "predicted")
                if spec.workload.weight_sync else None)
        runtime = None
        if self.device_kind == "cuda":
            largest = max(notes.get("largest_allocation_bytes", trace.largest_allocation_bytes),
                          trace.sync_largest_allocation_bytes)
            runtime = runtime_memory(spec.cluster.gpu, world_size=world_size,
                                     gpus_per_node=spec.cluster.gpus_per_node, tensor_peak_bytes=tensor_peak,
                                     largest_allocation_bytes=largest, offload_staging_bytes=root_staging,
                                     root_shard_bytes=_root_shard_bytes(spec),
                                     symmetric_memory_bytes=symmetric_memory_bytes(spec),
                                     calibrated=self._profile if self._profile and self._profile.calibrated else None)
        overhead = runtime.total_bytes if runtime else 0
        total = tensor_peak + overhead
        breakdown = dict.fromkeys(MEMORY_CATEGORIES, 0)
        for reftype, nbytes in peak_cats.items():
            breakdown[REFTYPE_CATEGORIES[reftype]] += nbytes
        breakdown["runtime_overhead"] = overhead

        basis = f"tensor peak traced exactly with fake tensors at world size {world_size}"
        if len(trace.derived_from) == 1:
            basis = (f"tensor peak derived exactly for world size {world_size} from a fake-tensor trace at world size "
                     f"{trace.derived_from[0]} (HSDP: nothing sharded over all ranks, the same step at both)")
        elif trace.derived_from:
            basis = (f"tensor peak derived exactly for world size {world_size} from fake-tensor traces at world "
                     f"sizes {trace.derived_from[0]} and {trace.derived_from[1]} (no shard padded: every site's "
                     "bytes affine in 1/world size)")
        if notes.get("per_pipeline_rank_tensor_peak_bytes"):
            how = notes.get("pipeline_ranks_extrapolated", {})
            shallow = [rank for rank, said in how.items() if not str(said).startswith("traced whole")]
            basis += (f", the worst of pipeline ranks {', '.join(notes['per_pipeline_rank_tensor_peak_bytes'])} (each "
                      "traced at its own rank, their stages differ; "
                      + (f"ranks {', '.join(shallow)} extrapolated exactly from two shallow copies of their stages)"
                         if shallow else "each traced whole)"))
        if notes["extrapolated"]:
            basis += (f", extrapolated from {notes['traced_layers'][0]} and {notes['traced_layers'][1]} "
                      f"blocks to {spec.model.num_layers}")
            if len(notes["traced_micro_batches"]) == 2:
                basis += f" and from micro-batches {_MB_BASE[0]} and {_MB_BASE[1]}"
        if runtime:
            basis = (f"predicted tensor peak {format_bytes(tensor_peak)} ({basis}) + {runtime.source} runtime "
                     f"memory {format_bytes(overhead)} ({runtime.describe()})")
        if sync:
            basis += "; " + sync["basis"]
        if offload:
            basis += "; " + _offload.OFFLOAD_BASIS
        if offloaded:
            basis += ("; saved activations offloaded to pinned host memory (the offload hooks traced: the device "
                      "frees each at pack and allocates it again at unpack)")
        from autotune.backends.sim._gpu_kernels import dropout_note
        from autotune.problem.catalog.attention import kernel_note

        dropout = dropout_note(trace.dropout, gpu=self.device_kind == "cuda")
        for note in (dropout, kernel_note(spec.model.attention or "")):
            if note:
                basis += "; " + note
        source = "estimated" if offload else "predicted+estimated" if runtime else "predicted"
        peak = Figure(total, source, basis)

        extras: dict[str, Any] = dict(tensor_peak_bytes=int(tensor_peak), runtime_overhead_bytes=int(overhead),
                                      peak_site=" / ".join(str(part) for part in peak_key), **notes)
        if trace.dropout:  # calls in one traced step (of `trace.depth` blocks), recomputation included
            extras["dropout"] = dict(calls=dict(sorted(trace.dropout.items())), traced_blocks=trace.depth,
                                     note=dropout)
        if sync:
            extras["weight_sync"] = {k: v for k, v in sync.items() if k != "basis"}
        if runtime:
            workspace = sum(t.bytes for t in runtime.terms if t.name == "cublas_workspace")
            extras.update(runtime_memory=runtime.to_dict(), largest_allocation_bytes=int(largest),
                          predicted_allocated_bytes=int(tensor_peak + workspace),
                          predicted_reserved_bytes=int(tensor_peak + runtime.in_allocator_bytes),
                          predicted_device_bytes=int(total))
        throughput, message = self._throughput(spec, trace, notes["flops_per_microbatch"], extras,
                                               op_work=notes.get("op_work"))
        costed = throughput.value if throughput is not None else None  # before compile, float8, copies
        if spec.train.compile != "none" and throughput is not None and throughput.value and self.device_kind == "cuda":
            throughput = _compiled(throughput, extras)
        if (spec.train.float8 != "none" and throughput is not None and throughput.value and self.device_kind == "cuda"
                and "gpu_compute_s" in (extras.get("step_time") or {})):  # the roofline (a profile costs traced ops)
            throughput = _float8(throughput, spec, notes.get("op_work") or {}, extras,
                                 gathered_block_params=trace.float8_gathered_params)
        if offloaded and throughput is not None and throughput.value:
            throughput = _with_activation_transfers(throughput, spec, offloaded, extras)
        if throughput is not None and spec.packing is not None:
            throughput = _packed(throughput, spec, extras)
        if costed and "mfu_estimated" in extras:  # the MFU of the figure reported, not of the eager step
            extras["mfu_estimated"] *= throughput.value / costed
        host_figure = None
        if host_per_node is not None:
            host_figure = Figure(host_per_node, "estimated",
                                 f"{_offload.OFFLOAD_BASIS}; per rank {format_bytes(host_per_node / spec.cluster.gpus_per_node)} "
                                 f"x {spec.cluster.gpus_per_node} ranks per node, "
                                 f"{format_bytes(costmodel.HOST_PROCESS_BYTES)} process memory each")
        if offloaded:
            # Activation offload: what the hooks held at most, in pinned blocks, on every rank of a node.
            activations_host = offloaded.get("host_bytes", 0) * spec.cluster.gpus_per_node
            moved_basis = (f"saved activations offloaded: {format_bytes(offloaded.get('host_bytes', 0))} of pinned host "
                     f"memory per rank at most (predicted: the offload hooks counted in the trace) x "
                     f"{spec.cluster.gpus_per_node} ranks per node")
            if host_figure is None:
                host_per_node = activations_host + costmodel.HOST_PROCESS_BYTES * spec.cluster.gpus_per_node
                host_figure = Figure(host_per_node, "predicted+estimated",
                                     f"{moved_basis}, plus {format_bytes(costmodel.HOST_PROCESS_BYTES)} process memory "
                                     "each (estimated)")
            else:
                host_per_node += activations_host
                host_figure = Figure(host_per_node, "estimated", f"{host_figure.basis}; {moved_basis}")

        status, reasons = "ok", []
        if total > spec.limit_bytes:
            status = "oom"
            reasons.append(f"predicted peak {format_bytes(total)} per GPU is over the limit "
                           f"{format_bytes(spec.limit_bytes)}")
        host_limit = spec.cluster.host_memory_bytes
        if host_per_node is not None and host_limit is not None and host_per_node > host_limit:
            status = "oom"
            reasons.append(f"{'CPU offload' if offload else 'activation offload'} needs {format_bytes(host_per_node)} "
                           f"of host memory per node, over --host-memory {format_bytes(host_limit)}")
        return TrialResult(status=status, peak_memory=peak, memory_breakdown=breakdown,
                           tokens_per_sec=throughput, host_memory_per_node=host_figure,
                           message="; ".join(reasons + [m for m in (sync and sync["basis"], message) if m]),
                           extras=extras)

    def _throughput(self, spec: TrialSpec, trace: StepTrace, flops_per_microbatch: float,
                    extras: dict[str, Any], op_work: dict[str, float] | None = None) -> tuple[Figure | None, str]:
        from autotune.problem.catalog.models import model_flops_per_token
        from autotune.estimate.hardware import profile_for

        accum = spec.grad_accum_steps
        world_size = spec.cluster.num_gpus
        tokens_per_gpu_step = spec.train.micro_batch_size * spec.seq_len * accum
        extras["flops_per_gpu_per_step"] = flops_per_microbatch * accum
        hardware = self._profile
        if self.device_kind == "cpu" and hardware is None:
            return None, ("throughput not estimated for a CPU run without a CPU profile "
                          "(autotune calibrate --backend cpu, then --hardware PROFILE)")
        if hardware is not None and spec.train.ranks_per_batch > 1:
            return None, ("throughput not estimated: the per-operation model (--hardware) does not cost tensor or "
                          "context parallelism's sends yet; without --hardware the roofline does")
        if op_work and hardware is not None:
            # The per-operation model on a profile given with --hardware (validated against real
            # CPU trials, docs/COSTMODEL.md); without one, the roofline the published runs check.
            profile = profile_for(spec.cluster.gpu, hardware)
            if spec.train.compile != "none" and self.device_kind == "cuda":
                op_work = self._compiled_op_work(spec, op_work, extras)
            rowwise = profile.figures.get("float8_rowwise_matmul_tflops")
            if spec.train.float8 == "rowwise" and rowwise is not None:  # calibrate times each recipe's GEMMs
                profile = dataclasses.replace(profile, figures={**profile.figures, "float8_matmul_tflops": rowwise})
            op_step_of = functools.partial(
                costmodel.estimate_op_step_time, profile=profile, num_gpus=world_size,
                num_nodes=spec.cluster.num_nodes, num_blocks=spec.model.num_layers,
                block_params=trace.block_params, root_params=trace.root_params,
                param_bytes=PARAM_DTYPE_BYTES[spec.train.precision], tokens_per_step=tokens_per_gpu_step * world_size,
                num_microbatches=accum, reshard_after_forward=spec.train.reshard_after_forward,
                cpu_offload=spec.train.cpu_offload, precision=spec.train.precision,
                model_flops_per_gpu=model_flops_per_token(spec.model, spec.seq_len) * tokens_per_gpu_step,
                peak_tflops=(costmodel.compute_peak_tflops(spec.cluster.gpu, spec.train.precision)
                             if self.device_kind == "cuda" else None),
                shard_group_size=spec.train.shard_group_size, reshard_group_size=spec.train.reshard_group_size,
                trainable=trainable_split(spec), offload_fresh_page_bytes=offload_fresh_page_bytes(spec))
            op_step = op_step_of(costmodel.OpWork.from_trace(op_work))
            if spec.train.compile != "none" and self.device_kind == "cuda" and op_work.get("memory_bytes"):
                # The compiled step: the blocks' memory-bound ops fused (_compiled takes the ratio of the two).
                saved = fused_bytes_saved(spec)
                fused = {**op_work, "memory_bytes": max(op_work["memory_bytes"] - saved / accum, 0.0)}
                extras["compiled_step_time"] = op_step_of(costmodel.OpWork.from_trace(fused)).to_dict()
                extras["compile_fused_bytes_saved"] = saved
                twin = self._eager_twin_op_work(spec, extras)  # cached by _compiled_op_work
                if twin and twin.get("dispatched_ops"):
                    extras["compile_eager_step_time"] = op_step_of(costmodel.OpWork.from_trace(
                        {**op_work, "dispatched_ops": twin["dispatched_ops"]})).to_dict()
            extras["step_time"] = op_step.to_dict()
            if op_step.mfu is not None:
                extras["mfu_estimated"] = op_step.mfu
            span = costmodel.estimate_range(op_step.tokens_per_sec, profile, host_bound=op_step.host_bound,
                                            per_op=True)
            source = costmodel.range_source(profile, host_bound=op_step.host_bound, per_op=True)
            extras["real_backend"] = self.device_kind  # the real trial that checks this estimate
            extras["tokens_per_sec_range_from"] = costmodel.range_note(profile, host_bound=op_step.host_bound,
                                                                       per_op=True)
            if span is None:  # no held-out row on this GPU family: no range, and the basis says so
                basis = f"{op_step.basis}; ops counted in the trace (recomputation included); {source}"
                return Figure(op_step.tokens_per_sec, "estimated", basis), ""
            low, high = span
            if spec.train.float8 != "none" and self.device_kind == "cuda":  # as _float8 widens the roofline's
                low *= costmodel.FLOAT8_RANGE_LOW
                source += (f"; low end x {costmodel.FLOAT8_RANGE_LOW:.2f}, the worst float8 speed-up measured "
                           "against its estimate (costmodel.FLOAT8_ONE_GPU_MEASURED)")
            extras["tokens_per_sec_range"] = [low, high]
            basis = (f"{op_step.basis}; ops counted in the trace (recomputation included); range "
                     f"{low:,.0f}-{high:,.0f} from held-out errors ({source})")
            return Figure(op_step.tokens_per_sec, "estimated", basis), ""
        # Attention's traced FLOPs (torch's SDPA formulas: the full square, backward 2.5x forward) at the
        # flash kernel's published rate, which counts the causal half; the traced memory-bound ops' bytes
        # at the HBM bandwidth. A compiled or float8 configuration is costed here as its eager
        # high-precision twin (compile's fused step and costmodel.float8_step_seconds come after):
        # its memory-bound bytes are the twin's, its own trace holding inductor's decomposed ops and the casts.
        shape = model_shape(spec.model)
        op_work = op_work or {}
        traced_attention = op_work.get("attention_flops", 0.0) * accum
        cp = spec.train.context_parallel
        memory_bytes = op_work.get("memory_bytes", 0.0)
        if (spec.train.compile != "none" or spec.train.float8 != "none") and memory_bytes:
            memory_bytes = self._eager_twin_memory_bytes(spec, extras) or memory_bytes
        attention = dict(
            # The causal kernel's work: half the counted square; under context parallelism each ring step after
            # the first is counted at its load-balanced half already, so cp / (cp + 1) of the count.
            attention_flops_per_gpu=traced_attention,
            attention_kernel_flops_per_gpu=traced_attention * cp / (cp + 1),
            attention_span=max(1, attention_span(spec) // spec.train.context_parallel),  # a ring step's keys
            attention_head_dim=shape.hidden // max(shape.num_heads, 1), memory_bytes_per_gpu=memory_bytes * accum)
        if spec.train.pipeline_parallel > 1:
            # The pipeline's pace is its slowest rank's (the head on the last stage, the most blocks): the traces
            # count each rank's memory, and the closed form that rank's FLOPs and sends (analytic.step_work).
            work = step_work(spec)
        else:
            work = None
        work = work or costmodel.fsdp_step_work(
            flops_per_gpu=flops_per_microbatch * accum,  # the rank's own: a tensor-parallel shard's where split
            model_flops_per_gpu=model_flops_per_token(spec.model, spec.seq_len) * tokens_per_gpu_step
            / spec.train.ranks_per_batch,
            tokens_per_gpu_step=tokens_per_gpu_step, num_gpus=world_size, block_params=trace.block_params,
            num_blocks=spec.model.num_layers, root_params=trace.root_params,
            param_bytes=PARAM_DTYPE_BYTES[spec.train.precision], reshard_after_forward=spec.train.reshard_after_forward,
            cpu_offload=spec.train.cpu_offload, num_microbatches=accum,
            # The host's work: the eager ops it dispatches, and the fused kernels it launches for
            # compiled blocks (the trace's proxy for inductor's fusion, docs/COMPILE.md).
            dispatched_ops_per_microbatch=sum(op_work.get(k, 0.0) for k in ("dispatched_ops", "compiled_launches")),
            hidden_size=shape.hidden, trainable=trainable_split(spec),
            float8_block_params=trace.float8_gathered_params, attention=attention, precision=spec.train.precision,
            offload_fresh_page_bytes=offload_fresh_page_bytes(spec), **expert_parallel_work(spec),
            **tensor_parallel_work(spec), **context_parallel_work(spec))
        counted = "FLOPs counted in the trace (recomputation included" + (
            "; this rank's tensor-parallel shards)" if spec.train.tensor_parallel > 1 else
            "; this rank's sequence shards and ring steps)" if spec.train.context_parallel > 1 else ")")
        if spec.train.pipeline_parallel > 1:
            counted = ("the slowest pipeline rank's FLOPs and sends in closed form (analytic.pipeline_costed_rank; "
                       "its memory traced), the bubble by its schedule (costmodel.pipeline_bubble_ratio)")
        step = costmodel.estimate_step_time(work, spec.cluster, shard_group_size=spec.train.shard_group_size,
                                            reshard_group_size=spec.train.reshard_group_size)
        extras["step_time"] = step.to_dict()
        extras["mfu_estimated"] = step.mfu
        if spec.train.compile != "none" and self.device_kind == "cuda":
            # The compiled step: the blocks' memory-bound ops fused; and eager's, the host dispatching the eager
            # twin's ops instead of the compiled step's launches (_compiled: the figure and the ratio).
            saved = fused_bytes_saved(spec)
            step_of = functools.partial(costmodel.estimate_step_time, cluster=spec.cluster, describe=False,
                                        shard_group_size=spec.train.shard_group_size,
                                        reshard_group_size=spec.train.reshard_group_size)
            extras["compiled_step_time"] = step_of(costmodel.compiled_work(work, fused_bytes_saved=saved)).to_dict()
            extras["compile_fused_bytes_saved"] = saved
            twin = self._eager_twin_op_work(spec, extras) if memory_bytes else None  # cached: traced once
            if twin and twin.get("dispatched_ops"):
                extras["compile_eager_step_time"] = step_of(dataclasses.replace(
                    work, dispatched_ops_per_microbatch=twin["dispatched_ops"])).to_dict()
        if spec.train.ranks_per_batch > 1:  # the held-out rows are FSDP runs: they say nothing of TP's or CP's sends
            splits = [name for name, degree in (("tensor", spec.train.tensor_parallel),
                                                ("context", spec.train.context_parallel),
                                                ("pipeline", spec.train.pipeline_parallel)) if degree > 1]
            split, mesh = " and ".join(splits), " x ".join(f"{name[0].upper()}P" for name in splits)
            extras["tokens_per_sec_range_from"] = f"not validated for {split} parallelism"
            return Figure(step.tokens_per_sec, "estimated", f"{step.basis}; {counted}; not validated for {split} "
                          f"parallelism: no published FSDP x {mesh} run is among the held-out rows, so no "
                          "range (docs/VALIDATION.md)"), ""
        shipped = profile_for(spec.cluster.gpu)
        span = costmodel.estimate_range(step.tokens_per_sec, shipped, host_bound=step.host_bound)
        source = costmodel.range_source(shipped, host_bound=step.host_bound)
        extras["tokens_per_sec_range_from"] = costmodel.range_note(shipped, host_bound=step.host_bound)
        if span is None:  # no held-out row on this GPU family: no range, and the basis says so
            return Figure(step.tokens_per_sec, "estimated", f"{step.basis}; {counted}; {source}"), ""
        low, high = span
        extras["tokens_per_sec_range"] = [low, high]
        basis = (f"{step.basis}; {counted}; range {low:,.0f}-{high:,.0f} "
                 f"({source})")
        return Figure(step.tokens_per_sec, "estimated", basis), ""

    def _eager_twin_memory_bytes(self, spec: TrialSpec, extras: dict[str, Any]) -> float | None:
        """The memory-bound bytes per micro-batch of `spec` run eager in high precision (_eager_twin_op_work)."""
        return (self._eager_twin_op_work(spec, extras) or {}).get("memory_bytes")

    def _eager_twin_op_work(self, spec: TrialSpec, extras: dict[str, Any]) -> dict[str, float] | None:
        """The traced op work per micro-batch of `spec` run eager in high precision, evaluated like any
        trial (usually cached: the controller compiles and converts configurations it evaluated eager),
        traced even where the closed form screens it (compiled, a configuration can fit where eager
        does not). None where the twin cannot be traced."""
        twin_spec = spec.with_train(spec.train.with_(compile="none", float8="none", async_tensor_parallel=False))
        key = cache.key_of("sim-eager-memory", self._cache_inputs(twin_spec))
        if key not in self._eager_op_work:  # compiled and float8 siblings share a twin: trace it once
            twin = self.evaluate(twin_spec)
            if twin.extras.get("screened"):
                try:
                    twin = self._evaluate(twin_spec)
                except Exception:  # the trial's own trace stands; the twin's failure is not this trial's
                    twin = TrialResult(status="error")
            self._eager_op_work[key] = twin.extras.get("op_work") or None
        op_work = self._eager_op_work[key]
        if op_work and op_work.get("memory_bytes"):
            extras["memory_bytes_from"] = f"the eager high-precision twin ({twin_spec.train.label()})"
        return op_work

    def _compiled_op_work(self, spec: TrialSpec, op_work: dict[str, float], extras: dict[str, Any]) -> dict[str, float]:
        """The op work the per-operation model costs a compiled configuration on: its own trace runs
        inductor's decomposed graphs op by op, unfused (more bytes and ops than eager: 1.45x the bytes on
        mistral-7b, 4x with rowwise float8's casts), so its memory-bound ops are the eager twin's, as the
        roofline takes them, and the fused step compile is costed on comes after (_compiled). float8's
        casts are added as fused (costmodel.FLOAT8_CAST_BYTES['compiled'] per element); its matmuls stay
        the trace's `_scaled_mm`."""
        twin = self._eager_twin_op_work(spec, extras)
        if not twin or not twin.get("memory_bytes"):
            return op_work
        casts = op_work.get("float8_cast_elements", 0.0) * costmodel.FLOAT8_CAST_BYTES["compiled"]
        return {**op_work, "memory_bytes": twin["memory_bytes"] + casts,
                "memory_bytes_large": twin.get("memory_bytes_large", 0.0), "memory_ops": twin.get("memory_ops", 0.0)}


def _compiled(throughput: Figure, extras: dict[str, Any]) -> Figure:
    """A compiled configuration's tokens/s: its step with eager's memory-bound bytes (the traced FLOPs, the host
    launching the compiled step's kernels, counted) against the same step with the blocks' memory-bound ops fused
    (extras["compiled_step_time"]; costmodel.compiled_throughput), the range likewise. The ratio is over eager's
    step (extras["compile_eager_step_time"]: the host dispatching the eager twin's ops), so it holds the launches
    compile removes as well as the bytes. Estimated, and says so."""
    low, high = extras.get("tokens_per_sec_range") or (None, None)
    step_time = extras.get("step_time") or {}
    compiled_step = extras.pop("compiled_step_time", None) or step_time
    eager_step = extras.pop("compile_eager_step_time", None) or step_time
    if not step_time.get("seconds") or not eager_step.get("seconds"):
        extras["eager_tokens_per_sec"] = throughput.value
        return throughput
    scale = step_time["seconds"] / eager_step["seconds"]  # this trace's launches -> eager's dispatch
    eager_value = throughput.value * scale
    extras["eager_tokens_per_sec"] = eager_value
    value, low, high, ratio, basis = costmodel.compiled_throughput(
        eager_value, None if low is None else low * scale, None if high is None else high * scale,
        eager_step=eager_step, compiled_step=compiled_step,
        fused_bytes_saved=extras.get("compile_fused_bytes_saved", 0.0))
    if step_time.get("host_bound") or eager_step.get("host_bound"):
        from autotune.backends.sim._trace import COMPILED_LAUNCHES_BASIS

        basis += f"; the host's time launching {COMPILED_LAUNCHES_BASIS} against eager's dispatched ops"
    if low is not None:
        extras["tokens_per_sec_range"] = [low, high]
    extras["compile_speedup"] = dict(ratio=ratio, source="estimated", basis=basis)
    extras["compiled_step_time"] = compiled_step
    return Figure(value, "estimated", f"{throughput.basis}; {basis}")


def _float8(throughput: Figure, spec: TrialSpec, op_work: dict[str, float], extras: dict[str, Any], *,
            gathered_block_params: int = 0) -> Figure:
    """A float8 configuration's tokens/s: its step (after the estimated compile ratio, where compiled)
    less what the traced float8 matmuls save, plus their casts (costmodel.float8_step_seconds; the
    float8 all-gather's smaller bytes are in the step's collectives already) and, where FSDP gathers the weights
    in float8 (`gathered_block_params` a block, as traced), the casts its hooks run eagerly before each gather
    (costmodel.float8_gathered_weight_seconds). The range moves with it."""
    accum = spec.grad_accum_steps
    step_s = spec.tokens_per_step / throughput.value
    roofline = extras["step_time"]
    scale = step_s / roofline["seconds"]  # the estimated compile ratio's share (1 when eager)
    gpu_s, host_s = roofline["gpu_compute_s"] * scale, roofline["host_s"] * scale
    gpu = spec.cluster.gpu
    pipelined = spec.train.pipeline_parallel > 1
    if pipelined:  # the pipeline's traces count memory, not ops: the slowest rank's counts in closed form
        float8_flops, cast_elements = pipeline_float8_counts(spec)
    else:
        float8_flops = op_work.get("float8_matmul_flops", 0.0) * accum
        cast_elements = op_work.get("float8_cast_elements", 0.0) * accum
    saved_s, casts_s, basis = costmodel.float8_step_seconds(
        gpu=gpu, float8_flops=float8_flops, cast_elements=cast_elements, compiled=spec.train.compile != "none",
        recipe=spec.train.float8,
        efficiency=extras["flops_per_gpu_per_step"] / (roofline["gpu_compute_s"] * gpu.peak_tflops * 1e12))
    # FSDP's float8 all-gather: the weights arrive cast, each GPU casting its shard before every gather (the trace's
    # count of a block's gathered weights; the closed form's on a pipeline rank, whose FLOPs are closed-form too).
    gather_s, gather_basis = float8_gathered_weight_seconds(
        spec, float8_flops=float8_flops, block_params=None if pipelined else gathered_block_params)
    if gather_basis:
        casts_s += gather_s
        basis += "; " + gather_basis + " (costed as if not overlapped: the casts run on FSDP's copy-in stream)"
    if pipelined:  # the bubble is (p - 1) / (v m) of the stage's time: it shrinks with it
        bubble = costmodel.pipeline_bubble_ratio(stages=spec.train.pipeline_parallel, microbatches=accum,
                                                 virtual_stages=pipeline_virtual_stages(spec))
        saved_s, casts_s = saved_s * (1 + bubble), casts_s * (1 + bubble)
        basis += "; the slowest pipeline rank's float8 GEMMs and casts counted in closed form (analytic.pipeline_float8_counts)"
    # The host's dispatch time (eager: the casts' ops are in the traced count) still bounds the step.
    float8_s = step_s - max(gpu_s, host_s) + max(gpu_s - saved_s + casts_s, host_s)
    ratio = step_s / float8_s
    extras["float8"] = dict(recipe=spec.train.float8, high_precision_tokens_per_sec=throughput.value,
                            saved_s=saved_s, casts_s=casts_s, speedup=ratio, source="estimated", basis=basis)
    if extras.get("tokens_per_sec_range"):
        # The low end also takes the worst measured shortfall of a float8 speed-up (one GPU, where
        # float8 ran slower than compiled bf16): a close call against high precision is named as such.
        low, high = extras["tokens_per_sec_range"]
        extras["tokens_per_sec_range"] = [low * ratio * costmodel.FLOAT8_RANGE_LOW, high * ratio]
        basis += (f"; range low end x {costmodel.FLOAT8_RANGE_LOW:.2f}, the worst float8 speed-up measured against "
                  "its estimate (one H200: compiled float8 0.67-1.04x of compiled bf16, costmodel."
                  "FLOAT8_ONE_GPU_MEASURED)")
    return Figure(throughput.value * ratio, "estimated", f"{throughput.basis}; {basis}")


def _with_activation_transfers(throughput: Figure, spec: TrialSpec, offloaded: dict[str, int],
                               extras: dict[str, Any]) -> Figure:
    """Activation offload's copies added to the step: each micro-batch moves what its forward saved
    to the host and back (the traced `moved_bytes`, each way) over the GPU's host link. The hooks
    copy on the compute stream, so the copies are counted as not overlapped (an upper bound on the
    time: torchtune's version overlaps them on a side stream)."""
    gbps = costmodel.host_link_gbps(spec.cluster.gpu)
    transfer_s = costmodel.activation_transfer_s(spec.cluster.gpu, moved_bytes=offloaded.get("moved_bytes", 0),
                                                 num_microbatches=spec.grad_accum_steps)
    tokens = spec.tokens_per_step
    step_s = tokens / throughput.value + transfer_s
    extras["activation_transfer_s"] = transfer_s
    if extras.get("tokens_per_sec_range"):
        low, high = extras["tokens_per_sec_range"]
        extras["tokens_per_sec_range"] = [tokens / (tokens / low + transfer_s), tokens / (tokens / high + transfer_s)]
    return Figure(tokens / step_s, throughput.source,
                  f"{throughput.basis}; plus {transfer_s:.3f} s per step of activation offload copies "
                  f"({format_bytes(offloaded.get('moved_bytes', 0))} each way per micro-batch at {gbps:g} GB/s, "
                  "the host link's achieved figure, not overlapped)")


def _packed(throughput: Figure, spec: TrialSpec, extras: dict[str, Any]) -> Figure:
    """A token-budget configuration's tokens/s (autotune/problem/packing.py): the step was costed on the traced row,
    filled to the budget; a real micro-batch holds whole documents only (the expected fill), and attention's
    work follows the sum of squared document lengths. The micro-batches' compute is scaled by
    packing.packed_seconds_ratio, communication and the optimizer step stay; the tokens are the expected ones."""
    from autotune.problem.packing import packed_seconds_ratio

    step_time = extras.get("step_time") or {}
    seconds = step_time.get("seconds")
    if not seconds:
        return throughput
    compute = step_time.get("compute_s") or sum(step_time.get(k, 0.0) for k in ("matmul_s", "attention_s", "memory_s"))
    stats = spec.packing.stats(spec.token_budget, spec.seq_len)
    traced_squares = sum(length * length for length in spec.documents)
    ratio = packed_seconds_ratio(attention_share=step_time.get("attention_s", 0.0) / compute if compute else 0.0,
                                 stats=stats, traced_squares=traced_squares)
    scale = stats.fill * seconds / (seconds - compute + compute * ratio)
    extras["packing"] = dict(stats.to_dict(), traced_documents=len(spec.documents),
                             traced_sum_of_squared_lengths=traced_squares, compute_time_ratio=round(ratio, 4))
    if extras.get("tokens_per_sec_range"):
        extras["tokens_per_sec_range"] = [value * scale for value in extras["tokens_per_sec_range"]]
    return Figure(throughput.value * scale, throughput.source,
                  f"{throughput.basis}; packed batches: costed on the traced row of {spec.token_budget:,} tokens, "
                  f"then {stats.fill:.1%} filled in expectation with attention at the expected sum of squared "
                  f"document lengths ({stats.squares:,.0f} vs {traced_squares:,} traced): the micro-batches' "
                  f"compute x {ratio:.3f}")


def _weight_sync(sites: dict, peak_key: tuple, *, source: str = "predicted") -> dict[str, Any]:
    """The weight sync's own peak against the training step's, and which one is the prediction's
    peak (the larger: the step and the sync never overlap)."""
    from autotune.backends.sim._trace import SYNC_PHASE

    def peak_of(keys) -> tuple[int, tuple | None]:
        return max(((sum(sites[k].values()), k) for k in keys), default=(0, None))

    sync_bytes, sync_key = peak_of(k for k in sites if k[0] == SYNC_PHASE)
    step_bytes, _ = peak_of(k for k in sites if k[0] != SYNC_PHASE)
    dominates = peak_key[0] == SYNC_PHASE
    where = f"gathering {sync_key[1]} ({sync_key[2]})" if sync_key else "no parameter gathered"
    basis = (f"the weight sync to vLLM dominates: {where} peaks at {format_bytes(sync_bytes)}, over the training "
             f"step's {format_bytes(step_bytes)}" if dominates else
             f"the training step dominates; the weight sync to vLLM peaks at {format_bytes(sync_bytes)} ({where})")
    return dict(how=SYNC_HOW, peak_bytes=int(sync_bytes), training_peak_bytes=int(step_bytes),
                dominates=dominates, site=" / ".join(str(part) for part in sync_key) if sync_key else None,
                source=source, basis=f"{basis} (tensor peaks, {source})")


SYNC_HOW = ("TRL's colocate weight sync as traced: named_parameters() in order, each fp32 shard gathered with "
            "full_tensor() while the previous full parameter is still held (trl/generation/vllm_generation.py, "
            "VLLMGeneration.sync_weights / _iter_fsdp2_params)")


def _largest_at(traces: dict, depths, mbs, mb: int) -> int:
    """The step's largest single allocation at micro-batch `mb` (for the fragmentation term), from the traces at the
    micro-batches `mbs`. Each tensor is either weight-sized (W: the same at every micro-batch) or grows with it (a x
    m: the logits), and the largest is max(W, a x m). Traced at mb itself: read. Traced at two micro-batches m1 < m2
    with L1 < L2: L2 is a x m2, so max(L1, L2 x mb / m2) is exact. With L1 == L2 the largest is W and a <= W / m2
    is all that is known: W x mb / m2 is the bound taken (never below the truth)."""
    at = {m: max(traces[d, m].largest_allocation_bytes for d in depths) for m in mbs}
    if mb in at:
        return at[mb]
    low, high = min(mbs), max(mbs)
    return max(at[low], at[high] * mb // high)


def _root_shard_bytes(spec: TrialSpec) -> int:
    """The root FSDP unit's fp32 parameters on one rank (what the fragmentation rule scales with)."""
    from autotune.distributed.parallel import ParallelDims

    dims = ParallelDims.of(spec.train, spec.cluster.num_gpus)
    return spec.model.root_parameters * PARAM_DTYPE_BYTES["fp32"] // (dims.dp_shard * dims.cp)  # cp ranks shard it too
