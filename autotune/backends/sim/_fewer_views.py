"""FSDP2's per-rank chunks, made only where read: what keeps a trace at thousands of ranks from spending
most of its time making fake views.

FSDP2 splits each parameter into one view per rank with `torch.chunk`, at `fully_shard` (to keep its
own rank's shard) and, for a parameter sharded on a dimension other than 0 (`--shard-placement
largest`), at every all-gather's copy-out and every reduce-scatter's input (to reorder the ranks'
shards with `torch.cat`). Under fake tensors each view costs a dispatch, and on 2,048 ranks those
views were most of a trace (cProfile: 40.6 s of an 86 s trial of Llama-3.1-405B in `torch.chunk`).
A view allocates nothing, so the memory a trace records does not depend on how many are made:
here `fully_shard` gets the chunks it reads (its own rank's, rank 0's) as it reads them, and the
reordering `torch.chunk` + `torch.cat` becomes one strided copy of the same bytes into a buffer of
the same size, each standing for the op it replaces (the trace names its sites by op counts). The
same tensors are allocated, first seen and freed at the same ops: the trace is the one FSDP2's own
code gives, site by site (tests/test_plan.py compares the two, field by field), and every test
that holds a trace against a real gloo run holds this too.

Applied to fake tensors only (every trace, at any world size): real trials run FSDP2's own code.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.fsdp._fully_shard import _fsdp_common
from torch.utils._python_dispatch import _disable_current_modes

ENABLED = True
"""Off: traces run FSDP2's own chunking (what tests/test_plan.py compares with)."""


class _Chunks(Sequence):
    """`torch.chunk(tensor, count, dim)` (FSDP's `_chunk_with_empty`: padded with empty tensors to
    `count`), each view made when read."""

    def __init__(self, tensor: torch.Tensor, count: int, dim: int, *, pad_with_empty: bool):
        self.tensor, self.dim = tensor, dim
        size = tensor.size(dim)
        self.per_chunk = -(-size // count) if size else 0
        made = -(-size // self.per_chunk) if self.per_chunk else 0  # what torch.chunk returns
        self._made = made
        self._count = count if pad_with_empty else made

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        if index < self._made:
            start = index * self.per_chunk
            return self.tensor.narrow(self.dim, start, min(self.per_chunk, self.tensor.size(self.dim) - start))
        return self[0].new_empty(0)  # a new empty tensor per chunk, as _chunk_with_empty makes them

    def as_one_view(self) -> _Chunks:
        """Make the chunks now as one strided view, the chunks a new axis at self.dim: one op where
        torch.chunk dispatches one (split), so a trace counts the ops FSDP's code makes, in order (the
        sites' names are op counts, and the tracker first sees a tensor at the first op that reads it)."""
        shape, stride = list(self.tensor.shape), list(self.tensor.stride())
        shape[self.dim:self.dim + 1] = [self._count, self.per_chunk]
        stride[self.dim:self.dim + 1] = [self.per_chunk * stride[self.dim], stride[self.dim]]
        self.chunked = self.tensor.as_strided(shape, stride, self.tensor.storage_offset())
        return self

    def cat(self, dim: int, out: torch.Tensor | None) -> torch.Tensor:
        """`torch.cat(self, dim, out=out)` as one op (cat's) moving the same bytes: the chunks' axis
        moved next to `dim` and merged with it, by views made out of the trace's sight (FSDP's code
        makes no such views)."""
        with _disable_current_modes():
            ordered = self.chunked.movedim(self.dim, dim)
        if out is not None:
            with _disable_current_modes():
                target = out.view(ordered.shape)
            target.copy_(ordered)
            return out
        copied = ordered.clone(memory_format=torch.contiguous_format)  # one new tensor written once, as cat's
        merged = list(ordered.shape)
        merged[dim:dim + 2] = [merged[dim] * merged[dim + 1]]
        with _disable_current_modes():
            return copied.view(merged)


def _applies(tensor) -> bool:
    return ENABLED and isinstance(tensor, FakeTensor)


def _chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int):
    """FSDP's _fsdp_common._chunk_with_empty, its chunks made as read."""
    if not _applies(tensor) or tensor.size(dim) == 0:
        return _fsdp_common._chunk_with_empty(tensor, num_chunks, dim)
    return _Chunks(tensor, num_chunks, dim, pad_with_empty=True)


class _TorchForCollectives(types.ModuleType):
    """`torch` as FSDP's _fsdp_collectives sees it here: chunk and cat as above, the rest torch's."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def chunk(tensor, chunks, dim=0):
        if _applies(tensor) and tensor.size(dim) % chunks == 0:
            return _Chunks(tensor, chunks, dim, pad_with_empty=False).as_one_view()
        return torch.chunk(tensor, chunks, dim=dim)

    @staticmethod
    def cat(tensors, dim=0, *, out=None):
        if isinstance(tensors, _Chunks):  # from chunk above: even chunks, one view
            return tensors.cat(dim, out)
        return torch.cat(tensors, dim=dim, out=out)


@contextmanager
def fsdp_chunks_on_demand():
    """Within: FSDP2's per-rank chunks of fake tensors made only where read (module doc)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param

    saved = _fsdp_param._chunk_with_empty, _fsdp_collectives.torch
    _fsdp_param._chunk_with_empty = _chunk_with_empty
    _fsdp_collectives.torch = _TorchForCollectives("torch")
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty, _fsdp_collectives.torch = saved
