"""A second process that traces the deeper of the two shallow copies while this one traces the
shallower: every configuration needs both, they do not depend on each other, and a trace runs
on one core, so a 2-core machine traces a configuration in a little over half the time.

The helper is forked from the process that needs it once torch and the tracing code are
imported (imports are what a process start costs: 4 s of a plan). It builds its own backend
(the factory it is given: this module does not know the backend class) with its own Tracer, so
the models it built are reused for later micro-batches as the parent's are. It is killed when
the backend closes, when a request fails or is interrupted, and at the latest when the backend
is garbage collected or the interpreter exits: no helper outlives its parent's plan.

    AUTOTUNE_SIM_HELPER=off   never start one; =on   start one even on a busy machine
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import weakref
from typing import Any, Callable

__all__ = ["HELPER_ENV", "TraceHelper", "can_help"]

HELPER_ENV = "AUTOTUNE_SIM_HELPER"


def can_help() -> bool:
    """A helper pays only where a second core is free to run it: on a machine whose cores are
    busy it competes with this process and costs more than it saves (a first trace in each)."""
    setting = os.environ.get(HELPER_ENV, "auto").lower()
    if setting == "off" or not hasattr(os, "fork"):
        return False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # At least half a core free over the last minute (this plan's own start counts in it).
    return cores >= 2 and (setting == "on" or os.getloadavg()[0] < cores - 0.5)


class TraceHelper:
    """One forked process that runs a backend's `_trace` for the parent, one request at a time.

    `new_backend` builds the helper's own backend in the child (forked: it need not pickle)."""

    def __init__(self, new_backend: Callable[[], Any]) -> None:
        context = multiprocessing.get_context("fork")  # the parent's imports come with it
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_serve, args=(child_conn, new_backend), daemon=True,
                                        name="autotune-sim-helper")
        self._process.start()
        child_conn.close()
        self._finalizer = weakref.finalize(self, _kill, self._process, self._conn)

    def submit(self, spec, keys: list[tuple[int, int]]) -> None:
        """Start tracing `spec` at each (depth, micro-batch) of `keys` (shallow, extrapolation sites)."""
        self._conn.send((spec, keys))

    def results(self) -> list:
        """The StepTraces of the last `submit`, in its order; its exception if it failed."""
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError("the simulator's helper process died") from None
        if status == "error":
            raise value
        return value

    def close(self) -> None:
        self._finalizer()


def _kill(process, conn) -> None:
    conn.close()
    if process.is_alive():
        process.kill()  # nothing of its own to save: it only holds traces it has not sent
    process.join()


def _serve(conn, new_backend: Callable[[], Any]) -> None:
    # The parent owns Ctrl-C and SIGTERM (autotune/util/interrupts.py) and kills this process when it
    # unwinds; the parent's deferred-signal timer must not fire here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    backend = new_backend()
    while True:
        try:
            spec, keys = conn.recv()
        except (EOFError, OSError):  # the parent closed the pipe or is gone
            return
        try:
            reply = ("ok", [backend._trace(spec, depth=d, micro_batch_size=m, keep_middle=False) for d, m in keys])
            conn.send(reply)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
            try:
                conn.send(("error", exc))
            except Exception:  # an exception that does not pickle: its text does
                conn.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
