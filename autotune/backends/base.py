"""The trial-backend interface: one configuration in, one result out.

Every figure carries its source, so nothing downstream can present a prediction as a
measurement: `measured` (a real run), `predicted` (an exact trace of the real model),
`estimated` (a model of the hardware: roofline, margins).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from autotune.problem.config import TrialSpec

TrialStatus = Literal["ok", "oom", "error", "timeout", "pruned"]
Source = Literal["measured", "predicted", "estimated", "predicted+estimated"]
SOURCES: tuple[str, ...] = ("measured", "predicted", "estimated", "predicted+estimated")
"""`predicted+estimated`: a total made of a prediction (the traced tensor peak) and an estimate
(the runtime memory terms); its basis gives each part."""

# Per-GPU memory categories, in the order charts stack them.
MEMORY_CATEGORIES: tuple[str, ...] = (
    "parameters",             # sharded parameters (and unsharded copies while gathered)
    "gradients",
    "optimizer_state",
    "activations",            # saved for backward, plus temporaries
    "communication_buffers",  # all-gather / reduce-scatter buffers
    "other",                  # inputs, buffers, anything unclassified
    "runtime_overhead",       # CUDA context, NCCL, workspaces, fragmentation (autotune.estimate.runtime_memory)
)


@dataclass(frozen=True)
class Figure:
    """A number with what it is and on what it was obtained."""

    value: float | int | None
    source: Source
    basis: str = ""

    def __post_init__(self) -> None:
        assert self.source in SOURCES, self.source

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class TrialResult:
    status: TrialStatus
    peak_memory: Figure | None = None
    """Peak per-GPU memory, runtime overhead included where the backend models it."""
    memory_breakdown: dict[str, int] = field(default_factory=dict)
    """Bytes per MEMORY_CATEGORIES entry at the peak (where known)."""
    tokens_per_sec: Figure | None = None
    """Training throughput of the whole job (all GPUs)."""
    host_memory_per_node: Figure | None = None
    """Host memory a node needs (CPU offload, or a CPU trial's RSS)."""
    message: str = ""
    """Why an error/oom/pruned happened, or a note on the figures."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Backend-specific figures (MFU, reserved bytes, per-rank values, step times ...)."""
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def peak_bytes(self) -> int | None:
        return None if self.peak_memory is None or self.peak_memory.value is None else int(self.peak_memory.value)

    @property
    def throughput(self) -> float | None:
        return None if self.tokens_per_sec is None else self.tokens_per_sec.value

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "peak_memory": self.peak_memory.to_dict() if self.peak_memory else None,
            "memory_breakdown": dict(self.memory_breakdown),
            "tokens_per_sec": self.tokens_per_sec.to_dict() if self.tokens_per_sec else None,
            "host_memory_per_node": self.host_memory_per_node.to_dict() if self.host_memory_per_node else None,
            "message": self.message,
            "extras": self.extras,
            "duration_s": self.duration_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrialResult":
        def fig(value):
            return Figure(**value) if value else None

        return cls(status=data["status"], peak_memory=fig(data.get("peak_memory")),
                   memory_breakdown=dict(data.get("memory_breakdown") or {}),
                   tokens_per_sec=fig(data.get("tokens_per_sec")),
                   host_memory_per_node=fig(data.get("host_memory_per_node")),
                   message=data.get("message", ""), extras=dict(data.get("extras") or {}),
                   duration_s=float(data.get("duration_s", 0.0)))


class TrialBackend(abc.ABC):
    """Evaluates configurations. Subclasses set `name` and implement `evaluate`."""

    name: str = "base"
    memory_source: Source = "estimated"
    throughput_source: Source = "estimated"
    applies_cpu_offload: bool = True
    """False where a trial cannot apply CPU offload (real CPU trials: CPUOffloadPolicy pins host
    memory, which needs an accelerator): the backend refuses such trials and the search skips them."""
    applies_async_tp: bool = True
    """False where a trial cannot run async TP (CPUs: torch's fused symmetric-memory ops have CUDA kernels only):
    the backend refuses such trials and the search skips them."""

    @abc.abstractmethod
    def evaluate(self, spec: TrialSpec) -> TrialResult:
        """Evaluate one configuration. Out of memory is a result (status 'oom'), not an exception;
        anything else that goes wrong is status 'error' with a message."""

    def evaluate_many(self, specs: Iterable[TrialSpec]) -> list[TrialResult]:
        """Evaluate several configurations; backends with set-up costs override this."""
        return [self.evaluate(spec) for spec in specs]

    def describe(self) -> str:
        """One line for the screen: what this backend's figures are and on what."""
        return f"{self.name}: memory {self.memory_source}, throughput {self.throughput_source}"

    def close(self) -> None:
        """Release workers, process groups, files."""

    def __enter__(self) -> "TrialBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
