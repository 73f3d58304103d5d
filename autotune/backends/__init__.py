"""Trial backends: how one configuration is evaluated.

    analytic  closed-form estimate (every figure `estimated`)
    sim       the real model traced with fake tensors (memory `predicted`, time `estimated`)
    cpu       real FSDP2 steps on CPUs with gloo (figures `measured`)
    cuda      real FSDP2 steps on GPUs with NCCL (figures `measured`)
"""

from autotune.backends.base import (
    MEMORY_CATEGORIES,
    Figure,
    TrialBackend,
    TrialResult,
    TrialStatus,
)

__all__ = ["MEMORY_CATEGORIES", "Figure", "TrialBackend", "TrialResult", "TrialStatus", "get_backend",
           "BACKEND_NAMES"]

BACKEND_NAMES = ("auto", "analytic", "sim", "cpu", "cuda")


def get_backend(name: str, **options) -> TrialBackend:
    """A backend by name. Imports lazily: the simulator and launcher pull in heavy modules."""
    from autotune.util.errors import UsageError

    if name == "analytic":
        from autotune.backends.analytic import AnalyticBackend

        return AnalyticBackend(**options)
    if name == "sim":
        from autotune.backends.sim import SimBackend

        return SimBackend(**options)
    if name in ("cpu", "cuda"):
        from autotune.backends.real import RealBackend

        return RealBackend(device=name, **options)
    raise UsageError(f"unknown backend {name!r}: choose one of {', '.join(BACKEND_NAMES)}")
