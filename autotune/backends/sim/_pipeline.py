"""Pipeline parallelism in the simulator: each pipeline rank that could peak highest traced as it runs.

Ranks of a pipeline hold different stages (parallel/pipeline.py): the first the embeddings and, under 1F1B,
the most micro-batches in flight; the last the head, the logits and the loss; the middle ones blocks only.
So the prediction is not one rank's trace: each candidate pipeline rank is traced with the fake process
group initialised at that rank (its first data rank: FSDP's shards are alike within a pp block), and the
worst rank's peak is the prediction, the others kept in the result's details.

Which ranks: the first and the last, and of the middle ones only a rank that holds more blocks than every
middle rank before it. Under every schedule built (1F1B, Interleaved1F1B, GPipe) a later rank has at most
as many micro-batches in flight as an earlier one, and a middle rank holds only blocks, so a middle rank
with no more blocks than an earlier middle rank cannot peak above it (every rank is traced where the
pipeline has at most 4 ranks).

How: a rank's whole trial is replayed under FakeTensorMode as `backends/real/_trial.run_trial` runs it on
CPUs: the model built, split and sharded by the same `parallelize`, the same optimizer, the tracker
(torch's MemTracker, as the real trial's CapacityTracker, with the same changes: leaf inputs collectable,
the root's stats reset per micro-batch) entered before the first step, DTensor's sharding propagation
kept in a fake mode of its own as in a real run (_trace._sharding_propagation_in_a_fake_mode_of_its_own), then the warm-up step and a timed
step of `train_step`, the pipeline's schedule included. The one difference is torch's p2p warm-up vote,
which reads a tensor the fake group never fills: every stage's vote is computed here as each rank computes
it (InferenceMode.needs_dynamic on the metadata the stage was given), and the trace refuses to go on where
the real run would pick DYNAMIC (metadata sent between ranks). The real runs' every stage votes STATIC
(parallel/pipeline.py gives each stage its metadata): the same mode, the same recv buffers. Two things a
fake group does not do as gloo does are done here: a p2p work holds its tensor until the work goes
(_HoldingWork), and on a CPU run gloo's reduce-scatter works on a full-size copy of its input
(_trace._SiteTracker models it the same way). The step's returned loss is kept while the next step runs, as
run_trial's loop keeps it. Measured (benchmarks/bench_pipeline.py): every rank's peak exact under
Interleaved1F1B and GPipe, 4 bytes under the real one under 1F1B (docs/KNOBS.md).

Depth extrapolation (`trace_pipeline_rank_extrapolated`, the simulator's default): a rank whose stages are deep
enough is traced on two shallow copies of the model instead of whole (`shallow_layouts`): in the first each of its
stages holds x periods fewer blocks than in the full model, in the second x - 1 fewer (at least period + 2 blocks,
x >= 2; a stage too shallow for that keeps its full count in both), the embeddings still on the first stage and
the norm and head on the last, the same schedule, micro-batches and every other setting; the other ranks' stages,
never built on this rank, hold one block (their count modulo a layer pattern's period). The shallow copies record
the memory after every op at a *site*, as _trace's do: the FSDP hook (pre/post forward, pre/post backward) the op
follows, of which unit (this rank's stage s0/s1, and the unit's position from the stage's ends: b0..b(period),
t0..t(period), the stage's root), how many times that hook of that unit had fired (micro-batches, recomputation,
the two steps), and the ops since; the optimizer's ops counted from its start and its end. The same site exists
in both copies and in the full model, and its memory per category is affine in x (each period of a stage adds the
same parameters, gradients, optimizer state and saved activations of each micro-batch in flight), so
_extrapolate.extrapolate_pipeline_sites extrapolates it exactly, and the full model's peak is the largest
extrapolated site (tests/test_pipeline_parallel.py checks it byte for byte against whole traces under 1F1B and
Interleaved1F1B, pp 2 and 4, with and without checkpointing). Where no stage of a rank is deep enough, or the two
copies would hold as many of its blocks as the full model (a stage of 6 blocks: 3 + 4), the rank is traced whole
(the result's `pipeline_ranks_extrapolated` says which). What it saves is blocks, not micro-batches: a trace's
cost is its ops, about blocks x micro-batches x 2 steps (docs/PIPELINE.md has the timings).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from autotune.problem.config import TrialSpec
from autotune.problem.knobs import PIPELINE_VIRTUAL_STAGES
from autotune.distributed.parallel import (ParallelDims, keep_leaf_inputs_collectable, parallelize, register_rng_rules,
                                           split_stages)
from autotune.distributed.parallel.pipeline import stages_of_rank
from autotune.distributed.training import build_model, make_optimizer, token_batches, train_step
from autotune.backends.sim._trace import _is_step_op
from autotune.backends.sim._fakepg import forget_dtensor_plans
from autotune.backends.sim._fewer_views import fsdp_chunks_on_demand

_TOTAL = "Total"
_REDUCE_SCATTER = torch.ops.c10d._reduce_scatter_base_.default
TRACED_STEPS = 2
"""The real trial's warm-up step and its (first) timed step: the peak is over both, as a real trial's."""

# MemTracker's reference types -> the simulator's site categories (_trace.REFTYPE_CATEGORIES' keys).
_CATEGORY_OF = {_MemRefType.PARAM: "SHARDED_PARAM", _MemRefType.GRAD: "SHARDED_GRAD", _MemRefType.OPT: "OPT",
                _MemRefType.ACT: "ACT", _MemRefType.TEMP: "TEMP", _MemRefType.BUFFER: "BUFFER",
                _MemRefType.OTH: "INP"}
_ACCUMULATED_GRAD = "UNSHARDED_GRAD"
"""The gradients FSDP2 accumulates unsharded across micro-batches (FSDPParam.unsharded_accumulated_grad: torch's
PipelineStage turns gradient sync off until the last backward): MemTracker sees tensors made in backward and
calls them temporaries; at a peak they are moved to this category (the simulator's 'gradients'), the total
unchanged."""


class _PeakTracker(MemTracker):
    """The real CPU trial's tracker (backends/real/_capacity.CapacityTracker, which the simulator may not
    import) without a capacity, plus gloo's reduce-scatter copy and the largest allocation."""

    def __init__(self, *, gloo: bool, fsdp_params=(), sites: bool = False) -> None:
        super().__init__()
        self._gloo = gloo
        self._fsdp_params = list(fsdp_params)
        self.largest_allocation = 0
        keep_leaf_inputs_collectable(self._mod_tracker)
        # Sites (`sites`: a shallow copy traced for depth extrapolation, `trace_pipeline_rank_extrapolated`): the
        # memory after every op, keyed by where the op runs relative to the stages' ends; nothing of it changes the
        # peak.
        self.sites: dict[tuple, dict[str, int]] | None = {} if sites else None
        self._anchors: tuple[tuple, ...] = (("start", "-", 0),)
        self._ordinal = 0
        self._counts_as_op = True
        self._optimizer_ops: list[dict[str, int]] = []
        self._optimizer_steps = 0
        self._was_in_opt = False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """As _trace._SiteTracker's: dynamo compiles with the tracker switched off, and the compiled graphs'
        ops (aten ops: _trace.SIM_COMPILE_BACKEND) are seen as they run."""
        return True

    def anchor(self, anchors: tuple[tuple, ...]) -> None:
        """Count the ops from here (an FSDP hook of a named unit; () for a unit no other depth has)."""
        self._anchors = anchors
        self._ordinal = 0

    def _record(self, snapshot: dict, extra: int = 0, *, tag: str = "") -> None:
        if not self._anchors and not self._in_opt:
            return
        cats: dict[str, int] = {}
        for reftype, nbytes in snapshot.items():
            if reftype != _TOTAL and nbytes:
                name = _CATEGORY_OF.get(reftype, reftype)
                cats[name] = cats.get(name, 0) + int(nbytes)
        moved = self._accumulated_grad_bytes()
        if moved:  # as _labelled
            cats["TEMP"] = cats.get("TEMP", 0) - moved
            cats[_ACCUMULATED_GRAD] = moved
        if extra:
            cats["TEMP"] = cats.get("TEMP", 0) + extra
        if self._in_opt:
            self._optimizer_ops.append(cats)
            return
        phase = "bw" if self._mod_tracker.is_bw else "fw"
        for anchor in self._anchors:  # a block near both ends of its stage is a site of each
            self.sites[(phase, *anchor, self._ordinal, tag)] = cats

    def _accumulated_grad_bytes(self) -> int:
        """The live unsharded accumulated gradients' bytes MemTracker counts as temporaries (each storage once):
        what `_labelled` and the sites (after every op) move to _ACCUMULATED_GRAD."""
        moved, seen = 0, {}  # id -> the storage, held so that no id is reused within the loop
        winfo = self._WINFO
        for fsdp_param in self._fsdp_params:
            grad = getattr(fsdp_param, "unsharded_accumulated_grad", None)
            if grad is None:
                continue
            storage = grad.untyped_storage()
            info = winfo.get(storage)
            if info is None or info[0].reftype != _MemRefType.TEMP or id(storage) in seen:
                continue
            seen[id(storage)] = storage
            moved += info[0].mem_consumed
        return moved

    def _close_optimizer_step(self) -> None:
        """The optimizer step's ops as sites, as _trace's optimizer_sites: the first half counted from the start,
        the second from the end (parameters step in model order: the middle blocks' steps repeat the ends');
        the ops after it counted from its end."""
        count = len(self._optimizer_ops)
        step = self._optimizer_steps
        for i, cats in enumerate(self._optimizer_ops):
            self.sites[("opt", step, "head", i) if i < count // 2 else ("opt", step, "tail", count - 1 - i)] = cats
        self._optimizer_ops = []
        self._optimizer_steps += 1
        self.anchor((("after_opt", "-", step),))

    def _pre_fw_hook(self, module, inputs) -> None:  # as CapacityTracker's
        if not self._mod_tracker.is_bw and set(self._mod_tracker.parents) - {
                self._mod_tracker.get_known_fqn(module)} == {"Global"}:
            self.memory_tracking.pop(module, None)
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state) -> None:  # as CapacityTracker's, the accumulated gradients relabelled
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL]:
                self._peak_mem[device] = snapshot[_TOTAL]
                self._peak_mem_snap[device] = self._labelled(snapshot)
        if self.sites is None or not self._counts_as_op:
            return
        if self._was_in_opt and not self._in_opt:
            self._close_optimizer_step()
        self._was_in_opt = self._in_opt
        self._ordinal += 1
        for snapshot in self._curr_mem_snap.values():  # one device: the fake tensors' CPU
            self._record(snapshot)

    def _labelled(self, snapshot: dict) -> dict:
        """`snapshot` with the live unsharded accumulated gradients moved from the temporaries to their own category
        (each storage once, only what MemTracker counts as a temporary)."""
        moved = self._accumulated_grad_bytes()
        out = dict(snapshot)
        if moved:
            out[_MemRefType.TEMP] = out.get(_MemRefType.TEMP, 0) - moved
            out[_ACCUMULATED_GRAD] = moved
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._counts_as_op = _is_step_op(func)
        if self._gloo and func is _REDUCE_SCATTER:
            # gloo's reduce-scatter works on a full-size copy of its input, freed when it returns.
            extra = args[1].untyped_storage().nbytes()
            for device, snapshot in self._curr_mem_snap.items():
                if snapshot[_TOTAL] + extra > self._peak_mem.get(device, 0):
                    self._peak_mem[device] = snapshot[_TOTAL] + extra
                    labelled = self._labelled(snapshot)
                    self._peak_mem_snap[device] = {**labelled, _TOTAL: snapshot[_TOTAL] + extra,
                                                   _MemRefType.TEMP: labelled.get(_MemRefType.TEMP, 0) + extra}
                if self.sites is not None:
                    self._record(snapshot, extra, tag="rs")
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for result in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(result, torch.Tensor):
                self.largest_allocation = max(self.largest_allocation, result.untyped_storage().nbytes())
        return out

    def peak(self) -> tuple[int, dict[str, int]]:
        if not self._peak_mem:
            return 0, {}
        device = max(self._peak_mem, key=self._peak_mem.get)
        snapshot = self._peak_mem_snap[device]
        cats: dict[str, int] = {}
        for reftype, nbytes in snapshot.items():
            if reftype != _TOTAL and nbytes:
                name = _CATEGORY_OF.get(reftype, reftype)  # _ACCUMULATED_GRAD is its own name
                cats[name] = cats.get(name, 0) + int(nbytes)
        return int(self._peak_mem[device]), cats


@contextmanager
def _vote_as_each_rank_does():
    """torch's p2p warm-up vote, its sends and receives run as torch runs them, but each stage's inference mode
    set as the vote's outcome would be where every rank's stages vote alike (they do: parallel/pipeline.py
    gives every stage its metadata): the fake group's receives bring no vote to read (`.item()`)."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import InferenceMode

    original = schedules._PipelineSchedule._warmup_p2p

    def vote(self, stages, has_backward, p2p_done):
        # The vote's own sends and receives as torch runs them (their few bytes allocated as in a real run)...
        acc = None
        for stage in stages:
            acc = stage._warmup_forward_vote(has_backward, received_acc=acc)
        result = acc
        for stage in reversed(stages):
            result = stage._warmup_backward_result(received_result=result)
        del acc, result
        # ... and the outcome as every rank votes (the fake group's receives hold no value to read).
        for stage in stages:
            if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
                raise RuntimeError(f"pipeline stage {stage.stage_index} would infer its metadata by sending it "
                                   "between ranks (DYNAMIC), which the fake process group cannot trace")
            stage._inference_mode = InferenceMode.STATIC

    schedules._PipelineSchedule._warmup_p2p = vote
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = original


class _HoldingWork:
    """A fake group's p2p work that holds its tensor until the work itself goes, as gloo's (and NCCL's) works
    do: the schedule keeps its send works until it waits on them (`send_work`, the 1F1B steady state), so a
    sent activation outlives its stage's backward by that long in a real run (measured: a 64 KiB bf16
    micro-batch of tiny-llama's hidden states at the first stage's peak)."""

    def __init__(self, work, tensors) -> None:
        self._work, self._tensors = work, tensors

    def wait(self, *args, **kwargs):
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextmanager
def _works_hold_their_tensors():
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def batch_p2p(p2p_ops, desc=None):
        works = original(p2p_ops, desc=desc)
        if len(works) == len(p2p_ops):
            return [_HoldingWork(work, (op.tensor,)) for work, op in zip(works, p2p_ops)]
        return [_HoldingWork(work, tuple(op.tensor for op in p2p_ops)) for work in works]

    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = original


def ranks_to_trace(num_layers: int, pp: int, schedule: str) -> list[int]:
    """The pipeline ranks that could peak highest (the module's docstring says why these)."""
    if pp <= 4:
        return list(range(pp))
    bounds = split_stages(num_layers, pp * PIPELINE_VIRTUAL_STAGES[schedule])

    def blocks(rank: int) -> int:
        return sum(bounds[s][1] - bounds[s][0] for s in stages_of_rank(rank, pp, schedule))

    chosen, most = [0], 0
    for rank in range(1, pp - 1):
        if blocks(rank) > most:
            chosen.append(rank)
            most = blocks(rank)
    return [*chosen, pp - 1]


def trace_pipeline_rank(spec: TrialSpec, pp_rank: int, *, gloo: bool, layout: list[int] | None = None,
                        period: int = 1) -> dict[str, Any]:
    """One pipeline rank's trial replayed under fake tensors (see the module docstring): its peak, the
    categories at the peak, its stages and blocks, the largest allocation and the seconds it took.

    `layout` (blocks per stage, every stage of the pipeline): a shallow copy of the model split so, for depth
    extrapolation (`shallow_layouts`, `trace_pipeline_rank_extrapolated`): the model built with sum(layout)
    blocks, split as `layout` says instead of by split_stages, and the memory after every op recorded per
    site (`sites`), the units named by position from the ends of their stage (`period` as _trace's)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autotune.backends.sim._fakepg import release_fake_group
    from autotune.backends.sim._trace import (SIM_COMPILE_BACKEND, _float8_flatten_without_reading_scales,
                                              _module_to_assigns_data,
                                              _post_forward_meshes_outside_fake_mode, _real_mask_decisions,
                                              _sharding_propagation_in_a_fake_mode_of_its_own)

    start = time.perf_counter()
    train = spec.train.with_(cpu_offload=False)
    world = spec.cluster.num_gpus
    dims = ParallelDims.of(train, world)
    rank = pp_rank * (world // dims.pp)
    num_layers = sum(layout) if layout is not None else None
    release_fake_group()
    forget_dtensor_plans()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = dims.build_mesh("cpu")
        with FakeTensorMode(), _real_mask_decisions(), _vote_as_each_rank_does(), _works_hold_their_tensors(), \
                _sharding_propagation_in_a_fake_mode_of_its_own(FakeTensorMode()), _split_as(layout):
            with _module_to_assigns_data():
                model = build_model(spec.model, num_layers=num_layers, precision=train.precision,
                                    finetuning=spec.finetuning, step=spec.step, seq_len=spec.seq_len)
            with _post_forward_meshes_outside_fake_mode(), fsdp_chunks_on_demand():  # (dp, tp) mesh: see there
                parallelize(model, mesh, train, allow_offload=False, compile_backend=SIM_COMPILE_BACKEND,
                            step=spec.step)
            if train.compile != "none":
                register_rng_rules(_PeakTracker)
            if train.float8 != "none":
                _float8_flatten_without_reading_scales()
            optimizer = make_optimizer(model, impl=train.optimizer_impl)
            batches = token_batches(vocab_size=int(spec.model.config_dict["vocab_size"]),
                                    micro_batch_size=train.micro_batch_size, seq_len=spec.seq_len, device="cpu")
            tracker = _PeakTracker(gloo=gloo, fsdp_params=_fsdp_params(model), sites=layout is not None)
            with tracker, fsdp_chunks_on_demand(), \
                    (_anchored_units(model, tracker, period) if layout is not None else nullcontext()):
                tracker.track_external(model, optimizer)
                batches = _reset_before_each_forward(batches, tracker)
                loss = None
                for _ in range(TRACED_STEPS):  # the trial's `loss` holds the last step's while the next runs
                    loss = train_step(model, optimizer, batches, grad_accum_steps=spec.grad_accum_steps,
                                      step=spec.step)
                del loss
                if tracker.sites is not None and tracker._optimizer_ops:
                    tracker._close_optimizer_step()
        peak, cats = tracker.peak()
        stages = [(index, module.start, module.end) for index, module in model.pipeline.modules]
        first = model.pipeline.modules[0][1]
        block_ids = {id(p) for _, module in model.pipeline.modules for p in module.layers.parameters()}
        block_params = sum(p.numel() for p in first.layers[0].parameters())
        root_params = sum(p.numel() for p in model.parameters() if id(p) not in block_ids)
    finally:
        release_fake_group()  # and its DTensor plans: nor may a later trace (the simulator's own, at rank 0) meet them
    return dict(pipeline_rank=pp_rank, rank=rank, tensor_peak_bytes=peak, categories=cats,
                stages=[dict(stage=i, blocks=[a, b]) for i, a, b in stages],
                block_params=int(block_params), root_params=int(root_params),
                largest_allocation_bytes=int(tracker.largest_allocation), duration_s=time.perf_counter() - start,
                **({"sites": tracker.sites} if tracker.sites is not None else {}))


@contextmanager
def _split_as(layout: list[int] | None):
    """apply_pp's split of the model's blocks into stages replaced by `layout` (blocks per stage)."""
    if layout is None:
        yield
        return
    import importlib

    pipeline_module = importlib.import_module("autotune.distributed.parallel.pipeline")
    original = pipeline_module.split_stages
    bounds, start = [], 0
    for blocks in layout:
        bounds.append((start, start + blocks))
        start += blocks

    def split(num_layers: int, stages: int, **_: Any) -> list[tuple[int, int]]:
        if (num_layers, stages) != (start, len(layout)):
            raise ValueError(f"a shallow pipeline layout of {start} blocks in {len(layout)} stages, asked to split "
                             f"{num_layers} in {stages}")
        return list(bounds)

    pipeline_module.split_stages = split
    try:
        yield
    finally:
        pipeline_module.split_stages = original


@contextmanager
def _anchored_units(model, tracker: _PeakTracker, period: int):
    """Sites for depth extrapolation: FSDP's hooks of each unit of this rank's stages (pre/post forward, pre/post
    backward, as _trace's _SiteTracker anchors them) start counting ops afresh, the unit named by its stage
    (s0, s1: this rank's first and second stage) and its position from the stage's ends (b0..b(period) from
    the bottom, t0..t(period) from the top, 'root' the stage module, 'root.<name>' another unit outside the
    blocks), and by how many times that hook of that unit has fired (the schedule's micro-batches, the two
    steps). The blocks further in anchor nothing: their memory repeats with the period, its largest values at
    the ends of their run."""
    from torch.distributed.fsdp import FSDPModule

    names: dict[int, tuple[str, ...]] = {}
    for v, (_, stage) in enumerate(model.pipeline.modules):
        layers = list(stage.layers)
        n = len(layers)
        index_of = {id(layer): i for i, layer in enumerate(layers)}
        for name, module in stage.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            if id(module) in index_of:
                i = index_of[id(module)]
                names[id(module)] = tuple([f"s{v}.b{i}"] * (i <= period)
                                          + [f"s{v}.t{n - 1 - i}"] * (i >= n - 1 - period))
            elif module is stage:
                names[id(module)] = (f"s{v}.root",)
            else:
                names[id(module)] = (f"s{v}.root.{name}",)
    fired: dict[tuple[str, str], int] = {}

    def anchor(hook: str, unit_names: tuple[str, ...]) -> None:
        anchors = []
        for name in unit_names:
            count = fired.get((hook, name), 0)
            fired[hook, name] = count + 1
            anchors.append((hook, name, count))
        tracker.anchor(tuple(anchors))

    handles, saved = [], []
    for module in model.modules():
        if id(module) not in names or not isinstance(module, FSDPModule):
            continue
        unit = names[id(module)]
        handles.append(module.register_forward_pre_hook(lambda *_, unit=unit: anchor("pre_fw", unit), prepend=True))
        handles.append(module.register_forward_hook(lambda *_, unit=unit: anchor("post_fw", unit), always_call=True))
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        saved.append((group, group.pre_backward, group.post_backward))

        def wrapped(orig, hook, unit=unit):
            def call(*args, **kwargs):
                anchor(hook, unit)
                return orig(*args, **kwargs)
            return call

        group.pre_backward = wrapped(group.pre_backward, "pre_bw")
        group.post_backward = wrapped(group.post_backward, "post_bw")
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for group, pre, post in saved:
            group.pre_backward, group.post_backward = pre, post


def shallow_layouts(num_layers: int, pp: int, schedule: str, pp_rank: int,
                    period: int) -> tuple[list[int], list[int], int, list[int]] | None:
    """Two shallow layouts (blocks per stage, every stage) for tracing pipeline rank `pp_rank` of a model of
    `num_layers` blocks split by split_stages, and how many periods the full model's stages of that rank hold
    beyond the first layout's (x), or None: trace the rank whole.

    Each stage of the rank loses the same x periods (the first layout) or x - 1 (the second), so every stage
    keeps its block count modulo the period (its top blocks checkpointed as in the full model) and the
    differences between the rank's stages: memory at a site, a sum over the rank's stages of what each one's
    blocks hold, is then affine in x, as _extrapolate's in the depth. Each varied stage keeps at least
    period + 2 blocks in the first layout (every named position b0..b(period), t0..t(period) exists, as in
    _extrapolate.shallow_depths) and x >= 2, else the second layout would be the full model; a stage of the rank
    with too few blocks for that (Interleaved1F1B's first stage may hold one) keeps its full count in both
    layouts (a constant term: memory stays affine in x). The stages of other
    ranks (never built on this rank: only their count and the schedule reach it) keep one block or, where a
    layer pattern repeats (period > 1), their count modulo the period, so that every block of the rank keeps its
    place in the pattern. Returns (layout 1, layout 2, x, the full model's blocks per stage of the rank)."""
    stages = pp * PIPELINE_VIRTUAL_STAGES[schedule]
    counts = [b - a for a, b in split_stages(num_layers, stages)]
    mine = stages_of_rank(pp_rank, pp, schedule)
    room = {s: (counts[s] - (period + 2)) // period for s in mine}
    varied = [s for s in mine if room[s] >= 2]
    if not varied:
        return None
    x = min(room[s] for s in varied)
    first = [counts[s] - x * period if s in varied else counts[s] if s in mine else (counts[s] - 1) % period + 1
             for s in range(stages)]
    second = [blocks + period if s in varied else blocks for s, blocks in enumerate(first)]
    return first, second, x, [counts[s] for s in mine]


def trace_pipeline_rank_extrapolated(spec: TrialSpec, pp_rank: int, *, gloo: bool, period: int,
                                     only_if_cheaper: bool = True) -> dict[str, Any] | None:
    """`trace_pipeline_rank`'s figures for the full model from two shallow copies (`shallow_layouts`), or None
    where the rank's stages are too shallow to extrapolate, or (`only_if_cheaper`) where the two copies hold
    together as many of the rank's blocks as the full model (a trace's cost is its ops, in proportion to the
    blocks: a stage of 6 blocks is traced whole, not as 3 and 4): trace it whole. Per site, the memory of each
    category is extrapolated as _extrapolate's (affine in the periods the rank's stages hold); the full
    model's peak is the largest extrapolated site. The per-stage blocks, the parameters and the largest
    allocation (the logits, the same at any depth) are the full model's."""
    from autotune.backends.sim._extrapolate import extrapolate_pipeline_sites

    train = spec.train
    layouts = shallow_layouts(spec.model.num_layers, train.pipeline_parallel, train.pipeline_schedule, pp_rank,
                              period)
    if layouts is None:
        return None
    start = time.perf_counter()
    first, second, x, full = layouts
    mine = stages_of_rank(pp_rank, train.pipeline_parallel, train.pipeline_schedule)
    if only_if_cheaper and sum(first[s] + second[s] for s in mine) >= sum(full):
        return None
    shallow = [trace_pipeline_rank(spec, pp_rank, gloo=gloo, layout=layout, period=period)
               for layout in (first, second)]
    sites, dropped = extrapolate_pipeline_sites(shallow[0]["sites"], shallow[1]["sites"], x)
    key = max(sites, key=lambda k: sum(sites[k].values()))  # the first of any tie, as the tracker's peak
    cats = {name: nbytes for name, nbytes in sites[key].items() if nbytes}
    bounds = split_stages(spec.model.num_layers,
                          train.pipeline_parallel * PIPELINE_VIRTUAL_STAGES[train.pipeline_schedule])
    deeper = shallow[1]
    return dict(pipeline_rank=pp_rank, rank=deeper["rank"], tensor_peak_bytes=sum(cats.values()), categories=cats,
                stages=[dict(stage=s, blocks=list(bounds[s])) for s in mine],
                block_params=deeper["block_params"], root_params=deeper["root_params"],
                largest_allocation_bytes=max(t["largest_allocation_bytes"] for t in shallow),
                duration_s=time.perf_counter() - start,
                extrapolated=dict(stage_blocks=full, traced_stage_blocks=[[layout[s] for s in mine]
                                                                          for layout in (first, second)],
                                  periods_beyond=x, dropped_sites=dropped,
                                  traced_peaks=[t["tensor_peak_bytes"] for t in shallow]))


def _fsdp_params(model) -> list:
    """The FSDPParams of every FSDP module of `model` (its stages' blocks and roots)."""
    from torch.distributed.fsdp import FSDPModule

    params = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                params.extend(group.fsdp_params)
    return params


def _reset_before_each_forward(batches, tracker):
    """As the real trial's: MemTracker refuses a second forward of the root unless reset first."""
    for number, batch in enumerate(batches):
        if number:
            tracker.reset_mod_stats()
        yield batch
