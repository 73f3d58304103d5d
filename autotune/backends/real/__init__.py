"""Real trials: short distributed FSDP2 training steps launched with torchrun, on GPUs or CPUs.

See docs/REAL_TRIALS.md. `RealBackend(device="cpu"|"cuda")` is the entry point; the worker
module (`autotune.backends.real.worker`) is what each rank runs.

The names below are imported when first asked for, not with the package: torchrun's agent
(`_torchrun`) and every rank (`worker`) import modules of this package, and `_backend` brings
`_capacity`, whose `torch.distributed._tools` imports dynamo and inductor (about 2 s of CPU in
each launch's agent, which needs none of it: docs/BENCHMARKS.md, the suite's time).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotune.backends.real._backend import RealBackend, predicted_host_need
    from autotune.backends.real._faults import FAULT_ENV, parse_faults

_HOMES = {"RealBackend": "_backend", "predicted_host_need": "_backend", "FAULT_ENV": "_faults",
          "parse_faults": "_faults"}

__all__ = ["FAULT_ENV", "RealBackend", "parse_faults", "predicted_host_need"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
