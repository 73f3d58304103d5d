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
    """Destroy the fake group if it is the one initialised (a real group is left alone), and DTensor's
    plans made under it (forget_dtensor_plans: the next fake group reuses its meshes' ranks)."""
    _mesh_cache.clear()
    if dist.is_initialized() and dist.get_backend() == _FAKE_BACKEND:
        forget_dtensor_plans()
        dist.destroy_process_group()


def forget_dtensor_plans() -> None:
    """Empty DTensor's caches of sharding decisions and redistribution plans. They are keyed by meshes that
    compare equal across fake groups (the same ranks and names) but hold the process group names of the group
    they were made under, which a new fake group numbers afresh: a tensor-parallel trace under the next group
    of the same size would reach a group that is gone ("Could not resolve the process group registered under
    the name ..."). Only plans: no memory."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's own
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
