"""Simulated trials: the real model traced with fake tensors (docs/SIMULATOR.md).

    SimBackend    the `sim` trial backend (memory predicted, throughput estimated)
    Tracer        one steady-state training step traced per site (used by benchmarks)

Importing this package does not import torch: the tracing modules load on first use.
"""

from autotune.backends.sim._backend import SimBackend
from autotune.backends.sim._extrapolate import extrapolate, shallow_depths

__all__ = ["SimBackend", "StepTrace", "Tracer", "extrapolate", "fake_mesh", "release_fake_group",
           "shallow_depths"]

_LAZY = {"StepTrace": "_trace", "Tracer": "_trace", "fake_mesh": "_fakepg", "release_fake_group": "_fakepg"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"autotune.backends.sim.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
