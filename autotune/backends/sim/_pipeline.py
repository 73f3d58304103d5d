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

No depth extrapolation: a rank's trace is its stages' blocks at full depth (a 126-block model on 8 ranks
traces 16 blocks per rank), and the stage's in-flight micro-batches make the peak's place in the schedule
differ from the unpipelined step's sites that _extrapolate works on.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from autotune.problem.config import TrialSpec
from autotune.problem.knobs import PIPELINE_VIRTUAL_STAGES
from autotune.distributed.parallel import ParallelDims, keep_leaf_inputs_collectable, parallelize, split_stages
from autotune.distributed.parallel.pipeline import stages_of_rank
from autotune.distributed.training import build_model, make_optimizer, token_batches, train_step

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

    def __init__(self, *, gloo: bool, fsdp_params=()) -> None:
        super().__init__()
        self._gloo = gloo
        self._fsdp_params = list(fsdp_params)
        self.largest_allocation = 0
        keep_leaf_inputs_collectable(self._mod_tracker)

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

    def _labelled(self, snapshot: dict) -> dict:
        """`snapshot` with the live unsharded accumulated gradients moved from the temporaries to their own category
        (each storage once, only what MemTracker counts as a temporary)."""
        moved, seen = 0, []
        for fsdp_param in self._fsdp_params:
            grad = getattr(fsdp_param, "unsharded_accumulated_grad", None)
            if grad is None:
                continue
            storage = grad.untyped_storage()
            info = self._WINFO.get(storage)
            if info is None or info[0].reftype != _MemRefType.TEMP or any(storage is other for other in seen):
                continue
            seen.append(storage)
            moved += info[0].mem_consumed
        out = dict(snapshot)
        if moved:
            out[_MemRefType.TEMP] = out.get(_MemRefType.TEMP, 0) - moved
            out[_ACCUMULATED_GRAD] = moved
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._gloo and func is _REDUCE_SCATTER:
            # gloo's reduce-scatter works on a full-size copy of its input, freed when it returns.
            extra = args[1].untyped_storage().nbytes()
            for device, snapshot in self._curr_mem_snap.items():
                if snapshot[_TOTAL] + extra > self._peak_mem.get(device, 0):
                    self._peak_mem[device] = snapshot[_TOTAL] + extra
                    labelled = self._labelled(snapshot)
                    self._peak_mem_snap[device] = {**labelled, _TOTAL: snapshot[_TOTAL] + extra,
                                                   _MemRefType.TEMP: labelled.get(_MemRefType.TEMP, 0) + extra}
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


def trace_pipeline_rank(spec: TrialSpec, pp_rank: int, *, gloo: bool) -> dict[str, Any]:
    """One pipeline rank's trial replayed under fake tensors (see the module docstring): its peak, the
    categories at the peak, its stages and blocks, the largest allocation and the seconds it took."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autotune.backends.sim._fakepg import release_fake_group
    from autotune.backends.sim._trace import (_module_to_assigns_data, _post_forward_meshes_outside_fake_mode,
                                              _real_mask_decisions, _sharding_propagation_in_a_fake_mode_of_its_own)

    start = time.perf_counter()
    train = spec.train.with_(cpu_offload=False)
    world = spec.cluster.num_gpus
    dims = ParallelDims.of(train, world)
    rank = pp_rank * (world // dims.pp)
    release_fake_group()
    _forget_dtensor_plans()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = dims.build_mesh("cpu")
        with FakeTensorMode(), _real_mask_decisions(), _vote_as_each_rank_does(), _works_hold_their_tensors(), \
                _sharding_propagation_in_a_fake_mode_of_its_own(FakeTensorMode()):
            with _module_to_assigns_data():
                model = build_model(spec.model, precision=train.precision, finetuning=spec.finetuning,
                                    step=spec.step, seq_len=spec.seq_len)
            with _post_forward_meshes_outside_fake_mode():  # FSDP's (dp, tp) mesh of a tp-split parameter
                parallelize(model, mesh, train, allow_offload=False, step=spec.step)
            optimizer = make_optimizer(model, impl=train.optimizer_impl)
            batches = token_batches(vocab_size=int(spec.model.config_dict["vocab_size"]),
                                    micro_batch_size=train.micro_batch_size, seq_len=spec.seq_len, device="cpu")
            tracker = _PeakTracker(gloo=gloo, fsdp_params=_fsdp_params(model))
            with tracker:
                tracker.track_external(model, optimizer)
                batches = _reset_before_each_forward(batches, tracker)
                loss = None
                for _ in range(TRACED_STEPS):  # the trial's `loss` holds the last step's while the next runs
                    loss = train_step(model, optimizer, batches, grad_accum_steps=spec.grad_accum_steps,
                                      step=spec.step)
                del loss
        peak, cats = tracker.peak()
        stages = [(index, module.start, module.end) for index, module in model.pipeline.modules]
        first = model.pipeline.modules[0][1]
        block_ids = {id(p) for _, module in model.pipeline.modules for p in module.layers.parameters()}
        block_params = sum(p.numel() for p in first.layers[0].parameters())
        root_params = sum(p.numel() for p in model.parameters() if id(p) not in block_ids)
    finally:
        release_fake_group()
        _forget_dtensor_plans()  # nor may a later trace (the simulator's own, at rank 0) meet this group's plans
    return dict(pipeline_rank=pp_rank, rank=rank, tensor_peak_bytes=peak, categories=cats,
                stages=[dict(stage=i, blocks=[a, b]) for i, a, b in stages],
                block_params=int(block_params), root_params=int(root_params),
                largest_allocation_bytes=int(tracker.largest_allocation), duration_s=time.perf_counter() - start)


def _forget_dtensor_plans() -> None:
    """DTensor's caches of sharding decisions and redistribution plans, emptied before each rank's trace: they
    are keyed by meshes that compare equal across fake groups (the same ranks and names) but hold the process
    group names of the group they were made under, which each rank's new fake group numbers afresh (tensor
    parallelism's DTensors in the stages would otherwise reach a group that is gone). Emptied again after the
    trace, for the simulator's next trace in this process. Only plans: no memory."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's own
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


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
