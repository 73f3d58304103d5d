"""Ctrl-C and SIGTERM, raised only where unwinding is safe.

Python runs a signal handler in the main thread at whatever bytecode it is executing. Raising there
is fine in autotune's own code and in the standard library, but not inside torch, transformers,
Optuna or an import in progress:
- an exception raised in Python code that torch's C++ called (a dispatch mode, an autograd or
  FSDP hook) can cross a C++ frame that cannot unwind, and the process aborts with
  "terminate called after throwing an instance of 'python_error'" (seen in CI on SIGTERM while
  the simulator traced);
- one raised in a weakref callback (torch.utils.weak) is printed as "Exception ignored" and lost;
- an import cut in half leaves a module half-initialised, and importing torch again segfaults;
- a storage write cut in half is exactly what "finished trials are never lost" must rule out.

So the handler raises only when every frame between it and `autotune.drivers.cli.main` is autotune's or
the standard library's (not importlib). Otherwise the signal is held and looked at again every
50 ms (SIGALRM) until the main thread is back in such code: at the latest when the current trace,
import or storage call returns. A second signal of the same kind raises at once (the user insists).
"""

from __future__ import annotations

import os
import signal
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType, FrameType

RETRY_S = 0.05
_AUTOTUNE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the whole package
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
_THIRD_PARTY_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib")})


def _is_safe_code(filename: str) -> bool:
    if filename.startswith(_AUTOTUNE_DIR):
        return True
    if filename.startswith("<frozen importlib") or filename.startswith(_THIRD_PARTY_DIRS):
        return False
    return filename.startswith(_STDLIB_DIR) and not filename.startswith(_STDLIB_DIR + "importlib" + os.sep)


def safe_to_raise(frame: FrameType | None, entry: CodeType | None) -> bool:
    """True when every frame from `frame` out to the `entry` code (or the whole stack if it is
    not on it) belongs to autotune or to the standard library outside importlib."""
    while frame is not None:
        if frame.f_code is entry:
            return True
        if not _is_safe_code(frame.f_code.co_filename):
            return False
        frame = frame.f_back
    return True


class _Deferrer:
    """The installed state: which signals raise what, and the one held, if any."""

    def __init__(self, raisers: dict[int, Callable[[], BaseException]], entry: CodeType | None) -> None:
        self.raisers = raisers
        self.entry = entry
        self.pending: int | None = None

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.pending == signum or safe_to_raise(frame, self.entry):
            self._raise(signum)
        self.pending = signum
        signal.setitimer(signal.ITIMER_REAL, RETRY_S)

    def on_retry(self, signum: int, frame: FrameType | None) -> None:
        if self.pending is None:
            return
        if safe_to_raise(frame, self.entry):
            self._raise(self.pending)
        signal.setitimer(signal.ITIMER_REAL, RETRY_S)

    def _raise(self, signum: int) -> None:
        self.pending = None
        signal.setitimer(signal.ITIMER_REAL, 0)
        raise self.raisers[signum]()


@contextmanager
def raised_where_safe(raisers: dict[int, Callable[[], BaseException]], entry: CodeType | None = None) -> Iterator[None]:
    """Install handlers that turn each signal in `raisers` into its exception, raised only where
    safe (module doc); `entry` is the code object of the function whose frame ends the check.
    A no-op off the main thread (Python delivers signals to the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    deferrer = _Deferrer(raisers, entry)
    previous = {signum: signal.signal(signum, deferrer.on_signal) for signum in raisers}
    previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, deferrer.on_retry)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        held = deferrer.pending
        if held is not None and sys.exc_info()[0] is None:
            raise raisers[held]()  # held until the end: still an interrupt
