"""Where the suite's CPU goes, per test: a pytest plugin for measuring the suite, not part of it.

    PYTHONPATH=. .venv/bin/python -m pytest -p tests.cpu_accounting -n 3 --dist loadfile ...

Each test's wall time, the CPU its worker process used (`time.process_time`) and the CPU of the
child processes the worker reaped during it (`RUSAGE_CHILDREN`: real launches with their torchrun
ranks, CLI subprocesses, sweep workers) are appended to cpu-<worker>.tsv in
$AUTOTUNE_CPU_ACCOUNTING_DIR (default: the current folder). The suite is CPU-bound on 2 cores, so
a test's CPU, not its wall time under contention, is what it costs the others (docs/BENCHMARKS.md,
"The test suite's time").
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import pytest


def _now() -> tuple[float, float, float]:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter(), time.process_time(), children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, own, children = _now()
    yield
    wall2, own2, children2 = _now()
    folder = Path(os.environ.get("AUTOTUNE_CPU_ACCOUNTING_DIR", "."))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(folder / f"cpu-{worker}.tsv", "a") as out:
        out.write(f"{item.nodeid}\t{wall2 - wall:.2f}\t{own2 - own:.2f}\t{children2 - children:.2f}\n")
