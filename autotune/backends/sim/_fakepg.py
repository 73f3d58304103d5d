"""The fake process group the simulator traces under: process-global, so managed in one place.

`torch.distributed` holds one default group per process. The simulator needs the "fake"
backend (collectives that move no data) at the trial's world size; it re-initialises it when
the world size changes and never replaces a real group somebody else initialised.
"""

from __future__ import annotations

import torch.distributed as dist

from autotune.util.errors import TrialError
from autotune.distributed.parallel import ParallelDims

_FAKE_BACKEND = "fake"
_mesh_cache: dict[object, object] = {}


def fake_mesh(dims: ParallelDims):
    """The CPU device mesh of `dims` (ParallelDims.build_mesh, as real trials build it) over a fake
    process group of its world size (this is rank 0)."""
    # Importing fake_pg registers the "fake" backend with torch.distributed.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() != _FAKE_BACKEND:
            raise TrialError(
                f"a real process group ({dist.get_backend()}) is initialised in this process; the "
                "simulator needs the fake one and will not replace it: run the sim backend in a "
                "process of its own")
        if dist.get_world_size() == dims.world_size:
            if dims not in _mesh_cache:
                _mesh_cache[dims] = dims.build_mesh("cpu")
            return _mesh_cache[dims]
        release_fake_group()
    dist.init_process_group(_FAKE_BACKEND, store=FakeStore(), rank=0, world_size=dims.world_size)
    _mesh_cache[dims] = dims.build_mesh("cpu")
    return _mesh_cache[dims]


def release_fake_group() -> None:
    """Destroy the fake group if it is the one initialised (a real group is left alone)."""
    _mesh_cache.clear()
    if dist.is_initialized() and dist.get_backend() == _FAKE_BACKEND:
        dist.destroy_process_group()
