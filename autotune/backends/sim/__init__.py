"""Simulated trials: the real model traced with fake tensors (docs/SIMULATOR.md).

    SimBackend    the `sim` trial backend (memory predicted, throughput estimated)
    Tracer        one steady-state training step traced per site (used by benchmarks)
"""

from autotune.backends.sim._backend import SimBackend
from autotune.backends.sim._extrapolate import extrapolate, shallow_depths
from autotune.backends.sim._fakepg import fake_mesh, release_fake_group
from autotune.backends.sim._trace import StepTrace, Tracer

__all__ = ["SimBackend", "StepTrace", "Tracer", "extrapolate", "fake_mesh", "release_fake_group",
           "shallow_depths"]
