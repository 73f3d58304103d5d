"""Fault injection for tests: make one rank hang, crash or run out of memory on purpose.

A testing aid, read by the worker from the environment:

    AUTOTUNE_FAULT="hang:rank=1"            rank 1 sleeps forever inside the trial
    AUTOTUNE_FAULT="crash:rank=1"           rank 1 dies at once (os._exit, no Python exception)
    AUTOTUNE_FAULT="oom:rank=1"             rank 1 raises torch.OutOfMemoryError
    AUTOTUNE_FAULT="crash:rank=1:trial=2"   only in the trial with index 2 of an evaluate_many list

Several faults are separated by commas. Without `rank=` the fault hits every rank.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

FAULT_ENV = "AUTOTUNE_FAULT"
FAULT_KINDS = ("hang", "crash", "oom")
CRASH_EXIT_CODE = 70


@dataclass(frozen=True, kw_only=True)
class Fault:
    kind: str
    rank: int | None = None
    trial: int | None = None

    def applies(self, *, rank: int, trial: int) -> bool:
        return (self.rank is None or self.rank == rank) and (self.trial is None or self.trial == trial)


def parse_faults(text: str | None) -> list[Fault]:
    """Parse an AUTOTUNE_FAULT value; ValueError names the part that is wrong."""
    faults = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        kind, *options = part.split(":")
        if kind not in FAULT_KINDS:
            raise ValueError(f"{FAULT_ENV}: fault {kind!r} is not one of {', '.join(FAULT_KINDS)}")
        fields: dict[str, int] = {}
        for option in options:
            key, _, value = option.partition("=")
            if key not in ("rank", "trial") or not value.isdigit():
                raise ValueError(f"{FAULT_ENV}: {option!r} in {part!r} is not rank=N or trial=N")
            fields[key] = int(value)
        faults.append(Fault(kind=kind, **fields))
    return faults


def inject_faults(faults: list[Fault], *, rank: int, trial: int) -> None:
    """Act out the faults meant for this rank and trial (called inside the trial, before training)."""
    import torch

    for fault in faults:
        if not fault.applies(rank=rank, trial=trial):
            continue
        print(f"autotune fault injection: {fault.kind} on rank {rank}, trial {trial}", file=sys.stderr, flush=True)
        if fault.kind == "oom":
            raise torch.OutOfMemoryError(f"injected out-of-memory on rank {rank} ({FAULT_ENV})")
        if fault.kind == "crash":
            os._exit(CRASH_EXIT_CODE)
        while True:  # hang
            time.sleep(3600)
