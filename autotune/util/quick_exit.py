"""Exit without the interpreter's teardown, once a program's work is done and written.

What a normal exit still does, this does too: other (non-daemon) threads are joined, the exit
handlers run (logging, temporary folders, child processes, storages), the standard streams are
flushed. What it skips is the interpreter's finalization, which with torch loaded
- takes 1-1.5 s of every `autotune plan` (issue 15) to free memory the OS reclaims anyway, and
- can abort a gloo rank after its training is done: a process group's C++ worker thread that
  drops a Python reference while the interpreter is being torn down takes the GIL then, and the
  rank dies with "terminate called without an active exception" and SIGABRT, its launcher
  reporting the run failed (pytorch/pytorch#179291 describes it; seen in 2 of 112 two-rank runs of
  the exported FSDP2 script under load on the 2-core VM, after its checkpoint was saved).
"""

from __future__ import annotations

import os
import sys


def quick_exit(code: int, *, internal_error_code: int = 1) -> None:
    """Join the other threads, run the exit handlers, flush stdout and stderr, then os._exit(code)
    (`internal_error_code` where a stream cannot be flushed: nothing said is lost silently). A
    second Ctrl-C while exiting ends the waiting; the program's result stands."""
    import atexit
    import threading

    try:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    except KeyboardInterrupt:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (autotune ... | head): nothing left to say
            code = code or internal_error_code
    os._exit(code)
