"""A trace at one world size from traces at two others: what `autotune plan` reuses across GPU counts.

FSDP on dimension 0 whose every sharded dimension divides by W pads no shard, so at every site each
category's bytes are a W-independent part (activations, the gathered unit, the logits; with HSDP or
a reshard group, what is sharded over the group) plus a part proportional to 1/W (the shards of
parameters, gradients and optimizer state over all W ranks, and what is copied in and out of
them): affine in 1/W.
Two traces at W1 and W2 then give the trace at any other unpadded W exactly, with one care: a site
the step reaches more than once (the root's pre-backward) records its largest occurrence, and the
largest of several affine functions is not affine (llama3-70b's root peaks with the logits alive at
W=8, without them at W=16): the traces keep every occurrence of such a site (StepTrace.repeats),
each is derived, and the largest is taken, as the trace takes it. The largest single allocation
(the logits, or a shard at small W) is the largest of non-increasing functions of W: where it is
the same at W1 and W2 it is the same at any larger W, not at a smaller one, so nothing is derived
below both. Anything the two
traces do not agree on (sites, FLOPs, op counts, the largest allocation, parameter counts), a
value that would not come out a whole byte, or a non-power-of-two W (the pinned-memory sizes are
powers of two), and this returns None: the caller traces afresh. One figure is not affine: the
bytes of memory ops over LARGE_MEMORY_OP_BYTES (an op's shard crosses the threshold as W grows);
it is left out of a derived trace, which the roofline estimate does not read (the per-operation
cost model does: with a hardware profile nothing is derived). tests/test_plan.py compares a
derived trace, field by field, with a fresh one.

Also here: `replicated` (HSDP: the same trace at every world size, from one), `accumulated` (the
trace for the other gradient accumulation, at the same world size), and `share`/`shared` (traces
left in a folder for the other processes of `autotune plan --jobs`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import tempfile
from fractions import Fraction
from pathlib import Path

from autotune.backends.sim._trace import StepTrace


def unpadded(model, train, world_sizes) -> bool:
    """Whether no parameter shard is padded at any of `world_sizes` (shards on dimension 0; HSDP and
    reshard groups are powers of two no larger than W, so they divide what W divides)."""
    if train.shard_placement != "dim0" or train.expert_parallel > 1 or train.ranks_per_batch > 1:
        return False  # expert, tensor and context parallelism: not checked, traced afresh
    dims = {shape[0] for shape in model.block_param_shapes} | {model.hidden_size, model.vocab_size}
    return all(w & (w - 1) == 0 and all(d % w == 0 for d in dims) for w in world_sizes)


def _at(x1: Fraction, w1: int, x2: Fraction, w2: int, w: int) -> Fraction:
    """The affine function of 1/W through (1/w1, x1) and (1/w2, x2), at 1/w."""
    return x1 + (x2 - x1) * (Fraction(1, w) - Fraction(1, w1)) / (Fraction(1, w2) - Fraction(1, w1))


def _bytes_at(x1: int, w1: int, x2: int, w2: int, w: int) -> int | None:
    """_at for byte counts, in integers (a trace has thousands of them): the whole number of bytes,
    or None where the line does not meet a whole byte at 1/w."""
    # x1 + (x2 - x1) * (1/w - 1/w1) / (1/w2 - 1/w1), the fraction's terms multiplied by w * w1 * w2
    quotient, remainder = divmod((x2 - x1) * (w1 - w) * w2, w * (w1 - w2))
    return None if remainder else x1 + quotient


def derive(first: StepTrace, w1: int, second: StepTrace, w2: int, w: int) -> StepTrace | None:
    """The trace at world size `w` from traces at `w1` and `w2` (see the module doc), or None."""
    if (set(first.sites) != set(second.sites) or first.flops != second.flops
            or (first.block_params, first.root_params) != (second.block_params, second.root_params)
            or first.largest_allocation_bytes != second.largest_allocation_bytes
            or first.sync_largest_allocation_bytes or second.sync_largest_allocation_bytes
            or set(first.op_work) != set(second.op_work) or set(first.pinned_param_bytes) != set(second.pinned_param_bytes)
            or first.offloaded != second.offloaded):  # offloaded activations do not depend on W
        return None
    occurrences_of = {key: len(seen) for key, seen in first.repeats.items()}
    if w < min(w1, w2) or occurrences_of != {key: len(seen) for key, seen in second.repeats.items()}:
        return None

    def categories(cats: dict[str, int], other: dict[str, int]) -> dict[str, int] | None:
        derived = {}
        for ref in cats.keys() | other.keys():
            value = _bytes_at(cats.get(ref, 0), w1, other.get(ref, 0), w2, w)
            if value is None or value < 0:
                return None
            if value or ref in cats:
                derived[ref] = value
        return derived

    sites, repeats = {}, {}
    for key, cats in first.sites.items():
        if key in first.repeats:
            continue
        sites[key] = categories(cats, second.sites[key])
        if sites[key] is None:
            return None
    for key, occurrences in first.repeats.items():
        # A site reached more than once: each occurrence is affine in 1/W, their largest is not;
        # the trace keeps the first occurrence with the largest value (_SiteTracker), so does this.
        derived = []
        for (value, cats, pending), (other_value, other, other_pending) in zip(occurrences, second.repeats[key]):
            value, pending = _bytes_at(value, w1, other_value, w2, w), _bytes_at(pending, w1, other_pending, w2, w)
            cats = categories(cats, other)
            if cats is None or value is None or pending is None:
                return None
            derived.append((value, cats, pending))
        repeats[key] = tuple(derived)
        sites[key] = max(derived, key=lambda occurrence: occurrence[0])[1]  # max() keeps the first of equals
    if first.accumulating != second.accumulating or set(first.pending_grad) != set(second.pending_grad):
        return None
    pending_grad = {}
    for key, nbytes in first.pending_grad.items():
        pending_grad[key] = _bytes_at(nbytes, w1, second.pending_grad[key], w2, w)
        if pending_grad[key] is None:
            return None
    op_work = {}
    for name, value in first.op_work.items():
        if name.endswith("_ops") and value != second.op_work[name]:
            return None  # the same ops at every world size, or not this derivation
        if name.endswith("_large"):
            # Bytes of ops over a size threshold: shards shrinking past it make this no affine
            # function. Kept where W does not change it; else left out (only the per-operation
            # cost model reads it, and SimBackend derives nothing for that).
            if value == second.op_work[name]:
                op_work[name] = value
            continue
        op_work[name] = float(_at(Fraction(value), w1, Fraction(second.op_work[name]), w2, w))
    pinned = {}
    for name, nbytes in first.pinned_param_bytes.items():
        other = second.pinned_param_bytes[name]
        if nbytes == other:  # sharded over a group (HSDP), not over W
            pinned[name] = nbytes
        elif nbytes * w1 == other * w2 and (nbytes * w1) % w == 0:  # each shard's power of two halves with W
            pinned[name] = nbytes * w1 // w
        else:
            return None
    return dataclasses.replace(first, sites=sites, repeats=repeats, pending_grad=pending_grad, op_work=op_work,
                               pinned_param_bytes=pinned, duration_s=0.0,
                               tensor_peak_bytes=max(sum(c.values()) for c in sites.values()),
                               derived_from=(w1, w2))


def replicated(trace: StepTrace, w1: int, w: int, train) -> StepTrace | None:
    """The trace at world size `w` from one at `w1` where both replicate (HSDP: shard groups of
    `train.shard_group_size` ranks, fewer than the world): nothing is sharded over all ranks, so
    each rank holds, gathers and frees the same tensors and runs the same ops at every such world
    size (the gradients' all-reduce over the replicas is in place, and FSDP2 averages through the
    collective at any replica count). Else None. tests/test_plan.py compares one with a fresh trace."""
    from autotune.distributed.parallel import ParallelDims

    if (train.expert_parallel > 1 or train.ranks_per_batch > 1 or trace.derived_from or trace.sync_largest_allocation_bytes
            or not all(ParallelDims.of(train, world).hsdp for world in (w1, w))):
        return None
    return dataclasses.replace(trace, duration_s=0.0, derived_from=(w1,))


def _family(folder: str, key: tuple, world: int) -> Path:
    """The folder of `key`'s configuration at every world size (the key without its world size)."""
    return Path(folder) / hashlib.sha256(repr(key[:world] + key[world + 1:]).encode()).hexdigest()[:32]


def share(folder: str, key: tuple, world: int, trace: StepTrace) -> None:
    """Leave a trace where other processes of the same plan find it (`shared`): written to a
    temporary file and renamed into place, so a reader never sees half of one."""
    family = _family(folder, key, world)
    family.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("wb", dir=family, prefix=".tmp-", delete=False) as handle:
        pickle.dump((key, trace), handle)
    os.replace(handle.name, family / f"{key[world]}.pkl")


def shared(folder: str, key: tuple, world: int) -> list[tuple[tuple, StepTrace]]:
    """The traces of `key`'s configuration other processes left in `folder` (`share`), any world size."""
    found = []
    for path in sorted(_family(folder, key, world).glob("*.pkl")):
        with open(path, "rb") as handle:
            other, trace = pickle.load(handle)  # written by this plan's own processes (share)
        if other[:world] + other[world + 1:] == key[:world] + key[world + 1:]:
            found.append((other, trace))
    return found


def accumulated(trace: StepTrace, accumulating: bool) -> StepTrace:
    """The trace of the same step with gradient accumulation (`accumulating`) or without: the tracer
    traces one micro-batch either way and, for a step that accumulates, adds at each training site
    the gradients earlier micro-batches left (StepTrace.pending_grad), which is all that differs."""
    from autotune.backends.sim._trace import PENDING_GRAD

    if trace.accumulating == accumulating:
        return trace
    sign = 1 if accumulating else -1

    def moved(cats: dict[str, int], pending: int) -> dict[str, int]:
        return {**cats, PENDING_GRAD: cats.get(PENDING_GRAD, 0) + sign * pending}

    sites = {key: moved(cats, trace.pending_grad[key]) if key in trace.pending_grad else cats
             for key, cats in trace.sites.items()}
    repeats = {key: tuple((value, moved(cats, pending), pending) for value, cats, pending in occurrences)
               for key, occurrences in trace.repeats.items()}
    for key, occurrences in repeats.items():
        sites[key] = max(occurrences, key=lambda occurrence: occurrence[0])[1]
    return dataclasses.replace(trace, sites=sites, repeats=repeats, accumulating=accumulating, duration_s=0.0,
                               tensor_peak_bytes=max(sum(c.values()) for c in sites.values()))
