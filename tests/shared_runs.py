"""Real 2-rank gloo trials that several test modules compare with, run in one torchrun launch.

Every launch pays torchrun's start-up, two interpreters importing torch and transformers, and
gloo's rendezvous before its first trial; the trials themselves are a few seconds each. So the
modules that compare the simulator or the cost model with real CPU runs do not launch their own:
each registers the trials it needs (`register`, at import), and the session's `gloo_runs`
fixture (tests/conftest.py) runs every registered set whose module has a selected test, in one
launch of the real cpu backend in persistent mode, the first time any of them asks. A module then
reads its own trials back (`SharedRuns.run(name)`), in its own order. Under pytest-xdist (the
README's `make test` runs three workers, each taking whole modules) a worker launches only the set of
the module that asks: the other sets may be another worker's, and no trial runs twice.

The launch is made by a fresh Python process, not by the test process: the launcher's fork runs
Python before exec, which deadlocks in a process whose other threads hold a simulator's gloo
group. Trials run one warm-up step and the timed steps their set asks for: a memory check needs
one (the second step is the steady state whose tensor peak the simulator predicts: optimizer state
exists), the cost model's check times three. Sets with different step counts run in separate
launches (a step of these models takes longer than a launch's start-up over a set).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from autotune.backends.base import TrialResult
from autotune.config import TrialSpec

WORLD = 2
WARMUP_STEPS = 1


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
from autotune.config import TrialSpec
job = json.load(sys.stdin)
specs = [TrialSpec.from_dict(d) for d in job["specs"]]
with RealBackend(device='cpu', persistent=True, warmup_steps={WARMUP_STEPS}, timed_steps=job["timed_steps"]) as real:
    print(json.dumps([r.to_dict() for r in real.evaluate_many(specs)]))
"""


def register(name: str, module: str, make_specs: Callable[[Path], list[TrialSpec]], *, timed_steps: int = 1,
             python_path: tuple[str, ...] = ()) -> None:
    """Declare a set of real trials that tests of `module` (its __name__) compare with."""
    _SETS[name] = TrialSet(name, module, make_specs, timed_steps, python_path)


class SharedRuns:
    """The session's shared launch: started on the first `run`, with every set a selected test needs."""

    def __init__(self, *, wanted_modules: set[str], folder: Path) -> None:
        self._wanted = wanted_modules
        self._folder = folder
        self._specs: dict[str, list[TrialSpec]] = {}
        self._results: dict[str, list[TrialResult]] = {}

    def _launch(self, required: str) -> None:
        sets = [s for s in _SETS.values()
                if s.name not in self._results and (s.module in self._wanted or s.name == required)]
        for trial_set in sets:
            folder = self._folder / trial_set.name
            folder.mkdir(parents=True, exist_ok=True)
            self._specs[trial_set.name] = trial_set.make_specs(folder)
        for steps in sorted({trial_set.timed_steps for trial_set in sets}):
            self._launch_sets([trial_set for trial_set in sets if trial_set.timed_steps == steps], steps)

    def _launch_sets(self, sets: list[TrialSet], timed_steps: int) -> None:
        every = [spec for trial_set in sets for spec in self._specs[trial_set.name]]
        log = self._folder / f"launch-{timed_steps}-timed.stderr.log"
        job = json.dumps(dict(timed_steps=timed_steps, specs=[s.to_dict() for s in every]))
        extra = [folder for trial_set in sets for folder in trial_set.python_path]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([*extra, os.environ.get("PYTHONPATH", "")])) if extra else None
        with open(log, "w") as stderr:  # a file, not a pipe: nothing to fill while the ranks run
            done = subprocess.run([sys.executable, "-c", _RUN_FOR_REAL], input=job, env=env,
                                  stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=1800)
        assert done.returncode == 0, log.read_text()[-3000:]
        results = [TrialResult.from_dict(r) for r in json.loads(done.stdout.strip().splitlines()[-1])]
        start = 0
        for trial_set in sets:
            count = len(self._specs[trial_set.name])
            self._results[trial_set.name] = results[start:start + count]
            start += count

    def run(self, name: str) -> tuple[list[TrialSpec], list[TrialResult]]:
        """The set's specs and their real results (launching every wanted set, once, if not yet)."""
        if name not in _SETS:
            raise KeyError(f"no shared trial set {name!r}: register it at import (tests/shared_runs.py)")
        if name not in self._results:
            self._launch(name)
        return self._specs[name], self._results[name]
