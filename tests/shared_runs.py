"""Real 2-rank gloo trials that several test modules compare with, run in one torchrun launch.

Every launch pays torchrun's start-up, two interpreters importing torch and transformers, and
gloo's rendezvous before its first trial (about 14 CPU s on the 2-core VM); the trials themselves are
a few seconds each. So the modules that compare the simulator or the cost model with real CPU runs
do not launch their own: each registers the trials it needs (`register`, at import), and the
session's `gloo_runs` fixture (tests/conftest.py) runs every registered set of a kind (below) whose
module has a selected test, in one launch of the real cpu backend in persistent mode, the first time
any of them asks. A module then reads its own trials back (`SharedRuns.run(name)`), in its own order.

Under pytest-xdist (the README's `make test` runs three workers, each taking whole modules) the
workers share the launch too: the first worker to ask runs every wanted set of the same kind (below)
and writes each set's specs and results to a folder all workers see, under a file lock; a worker
asking later waits on the lock and reads them back. No trial runs twice, and one launch's start-up
serves every worker.

The launch is made by a fresh Python process, not by the test process: the launcher's fork runs
Python before exec, which deadlocks in a process whose other threads hold a simulator's gloo
group. Trials run one warm-up step and the timed steps their set asks for: a memory check needs
one (the second step is the steady state whose tensor peak the simulator predicts: optimizer state
exists), the cost model's check times two. Sets with different step counts, or with folders of
their own on the path (torchao, which transformers then imports on every model build), run in
separate launches. Within a launch the trials run grouped by world size, widest first (each change of
size starts a new torchrun), and compiled trials last (a compile leaves dynamo's and inductor's state
in the process for the trials after it): `_launch_order`.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from autotune.backends.base import TrialResult
from autotune.problem.config import TrialSpec
from autotune.util.files import write_json

WARMUP_STEPS = 1
# A trial's own limit (the real backend's default is 300 s without progress): the compiled float8 TP2 trial takes
# 64 s on an idle 2-core VM (its two ranks compile at once), and ran past 300 s in CI on a VM about 3x slower with
# three pytest workers besides (stop 82). A hang still ends the launch, later.
TRIAL_TIMEOUT_S = 1200
LAUNCH_TIMEOUT_S = 3600


@dataclass(frozen=True)
class TrialSet:
    name: str
    module: str
    make_specs: Callable[[Path], list[TrialSpec]]
    """Called once, with a folder of the set's own (for config files a set writes)."""
    timed_steps: int = 1
    """1 for a memory check (the steady-state step); more where step times are compared."""
    python_path: tuple[str, ...] = ()
    """Folders the launch's processes import from besides the venv (tests/float8_site.py)."""


_SETS: dict[str, TrialSet] = {}

# The real launch: reads the timed steps and the specs on stdin, prints the results as one JSON line.
_RUN_FOR_REAL = f"""\
import json, sys
from autotune.backends.real import RealBackend
from autotune.problem.config import TrialSpec
job = json.load(sys.stdin)
specs = [TrialSpec.from_dict(d) for d in job["specs"]]
with RealBackend(device='cpu', persistent=True, warmup_steps={WARMUP_STEPS}, timed_steps=job["timed_steps"],
                 timeout_s={TRIAL_TIMEOUT_S}) as real:
    print(json.dumps([r.to_dict() for r in real.evaluate_many(specs)]))
"""


def register(name: str, module: str, make_specs: Callable[[Path], list[TrialSpec]], *, timed_steps: int = 1,
             python_path: tuple[str, ...] = ()) -> None:
    """Declare a set of real trials that tests of `module` (its __name__) compare with."""
    _SETS[name] = TrialSet(name, module, make_specs, timed_steps, python_path)


class SharedRuns:
    """The session's shared launch: started on the first `run`, with every set a selected test needs.

    `folder` holds the sets' files and results; under pytest-xdist it is one folder for every worker
    (conftest.py), and a lock in it makes the workers launch each kind of set once between them."""

    def __init__(self, *, wanted_modules: set[str], folder: Path) -> None:
        self._wanted = wanted_modules
        self._folder = folder
        self._runs: dict[str, tuple[list[TrialSpec], list[TrialResult]]] = {}

    def run(self, name: str) -> tuple[list[TrialSpec], list[TrialResult]]:
        """The set's specs and their real results (launching every wanted set of its kind, once, if not yet)."""
        if name not in _SETS:
            raise KeyError(f"no shared trial set {name!r}: register it at import (tests/shared_runs.py)")
        if name not in self._runs:
            self._folder.mkdir(parents=True, exist_ok=True)
            kind = _kind(_SETS[name])
            with open(self._folder / f"{kind}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be running this kind's launch: wait for it
                # A launch that failed in another worker fails here too, with its log, and is not run again.
                assert not self._failed(kind).exists(), self._failed(kind).read_text()
                if not self._saved(name).exists():
                    self._launch(_SETS[name], kind)
            saved = json.loads(self._saved(name).read_text())
            self._runs[name] = ([TrialSpec.from_dict(d) for d in saved["specs"]],
                                [TrialResult.from_dict(d) for d in saved["results"]])
        return self._runs[name]

    def _saved(self, name: str) -> Path:
        return self._folder / f"{name}.json"

    def _failed(self, kind: str) -> Path:
        return self._folder / f"{kind}.failed"

    def _launch(self, required: TrialSet, kind: str) -> None:
        """One launch of `required` and every other wanted set of its kind not yet run."""
        sets = [s for s in _SETS.values() if _kind(s) == kind and not self._saved(s.name).exists()
                and (s.module in self._wanted or s is required)]
        specs = {}
        for trial_set in sets:
            folder = self._folder / trial_set.name
            folder.mkdir(parents=True, exist_ok=True)
            specs[trial_set.name] = trial_set.make_specs(folder)
        every = [spec for trial_set in sets for spec in specs[trial_set.name]]
        order = _launch_order(every)
        log = self._folder / f"{kind}.stderr.log"
        job = json.dumps(dict(timed_steps=required.timed_steps, specs=[every[i].to_dict() for i in order]))
        env = (dict(os.environ, PYTHONPATH=os.pathsep.join([*required.python_path, os.environ.get("PYTHONPATH", "")]))
               if required.python_path else None)
        try:
            with open(log, "w") as stderr:  # a file, not a pipe: nothing to fill while the ranks run
                done = subprocess.run([sys.executable, "-c", _RUN_FOR_REAL], input=job, env=env,
                                      stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=LAUNCH_TIMEOUT_S)
            problem = f"exited {done.returncode}" if done.returncode else None
        except subprocess.TimeoutExpired:
            problem = f"ran past {LAUNCH_TIMEOUT_S} s"
        if problem:
            failed = self._failed(kind)
            failed.write_text(f"the shared launch of {', '.join(s.name for s in sets)} {problem}; "
                              f"the end of {log}:\n{log.read_text()[-3000:]}")
            raise AssertionError(failed.read_text())
        results = [None] * len(every)
        for i, result in zip(order, json.loads(done.stdout.strip().splitlines()[-1])):
            results[i] = result
        start = 0
        for trial_set in sets:
            count = len(specs[trial_set.name])
            saved = dict(specs=[s.to_dict() for s in specs[trial_set.name]], results=results[start:start + count])
            write_json(self._saved(trial_set.name), saved)  # atomic: a reader never sees half a file
            start += count


def _launch_order(specs: list[TrialSpec]) -> list[int]:
    """The order the launch runs `specs` in (indices): the widest worlds first, then compiled trials last.
    A persistent launch keeps its ranks only while the world size stays (a change of size is a new torchrun,
    about 14 CPU s of start-up on the 2-core VM for 2 ranks, twice that for 4), and a compile leaves dynamo's and
    inductor's state in the process for the trials after it. Stable: registration order otherwise."""
    return sorted(range(len(specs)), key=lambda i: (specs[i].train.compile != "none", -specs[i].cluster.num_gpus))


def _kind(trial_set: TrialSet) -> str:
    """Sets of one kind run in one launch: the same timed steps and the same folders on the path. The
    kind is a file name (its launch's lock, log and failure mark)."""
    return "-".join([f"launch-{trial_set.timed_steps}-timed", *(Path(p).name for p in trial_set.python_path)])
