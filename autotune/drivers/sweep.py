"""Sweeps: a matrix of tuning problems, each done once by any number of cooperating workers.

A sweep file (TOML) names the matrix; every combination is one problem, tuned exactly as
`autotune tune` would tune it (its own study, reused by a rerun):

    name = "nightly"
    [matrix]                      # lists; every combination is a problem
    model = ["llama3-8b", "qwen2.5-7b"]
    gpus = [8, 16]
    gpu_type = ["h100-80gb"]
    global_tokens = ["4Mi"]
    seq_len = [4096]              # optional (default: each model's)
    nodes = [1]                   # optional (default: gpus / 8, one node up to 8 GPUs)
    backend = ["sim"]             # optional (default sim)
    workload = ["sft", "grpo"]    # optional (default sft); grpo: TRL GRPO with vLLM colocated
    [options]                     # optional, the same for every problem
    headroom = 0.1
    max_trials = 40
    time_budget = "10m"

The work queue is an Optuna study of the same storage, `sweep:<name>`, with one enqueued trial
per problem. Optuna's own mechanisms do the coordination, no queue of ours:
- the worker that creates the study (creation is exactly-once in the database) enqueues the
  problems; the others wait until it says it is done;
- a worker claims a problem by moving its trial from WAITING to RUNNING, which the storage does
  for exactly one caller;
- a claimed trial carries a heartbeat (RDBStorage heartbeats); a worker that dies stops beating,
  and after the grace period any worker's `fail_stale_trials` fails it and Optuna's
  RetryHeartbeatStaleTrialCallback enqueues it again (3 times at most), so another worker takes it;
- a worker with nothing to claim waits while problems are still running elsewhere (one may come
  back), and stops when every problem is finished.
Each finished problem's trial keeps the winner's summary (user attributes) for `autotune regress`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import itertools
import json
import threading
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.util.errors import AutotuneError, NothingFits, StorageUnavailable, UsageError

SWEEP_PREFIX = "sweep:"
MATRIX_KEYS = ("model", "gpus", "nodes", "gpu_type", "global_tokens", "seq_len", "backend", "workload",
               "vllm_gpu_memory_utilization", "attention")
OPTION_KEYS = ("headroom", "global_tolerance", "max_trials", "time_budget", "space", "timeout", "text_only")
DEFAULT_HEARTBEAT_S = 10.0
ENQUEUE_WAIT_S = 120.0
MAX_RETRIES = 3  # a problem whose workers keep dying is given up after this many retries


@dataclass(frozen=True)
class Problem:
    """One cell of the matrix: the problem options of one tune (TuneOptions fields, autotune/problem/options.py)."""

    model: str
    gpus: int
    global_tokens: str
    gpu_type: str | None = None
    nodes: int | None = None
    seq_len: int | None = None
    backend: str = "sim"
    workload: str | None = None
    vllm_gpu_memory_utilization: float | None = None
    attention: str | None = None
    """--attention (autotune/problem/catalog/attention.py); None: the model's default."""

    @property
    def key(self) -> str:
        parts = [self.model, f"{self.gpus}x{self.gpu_type or 'default'}", f"{self.nodes or 1}n",
                 f"tokens-{self.global_tokens}", f"seq-{self.seq_len or 'default'}", self.backend]
        if self.workload not in (None, "sft"):  # SFT problems keep the keys they always had
            parts.append(f"{self.workload}-{self.vllm_gpu_memory_utilization or 'default'}")
        if self.attention is not None:  # problems without one keep the keys they always had
            parts.append(f"attention-{self.attention}")
        return "/".join(parts)


@dataclass(frozen=True)
class Sweep:
    name: str
    problems: tuple[Problem, ...]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def study_name(self) -> str:
        return f"{SWEEP_PREFIX}{self.name}"

    @property
    def digest(self) -> str:
        """What the matrix is, whatever the sweep is called: nights of one matrix compare."""
        identity = json.dumps([[p.key for p in self.problems], self.options], sort_keys=True)
        return hashlib.sha256(identity.encode()).hexdigest()[:12]


def load_sweep(path: Path, *, name: str | None = None) -> Sweep:
    """The sweep file, expanded into problems; a UsageError names what is wrong in it."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"cannot read sweep file {str(path)!r}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"sweep file {str(path)!r} is not valid TOML: {exc}") from None
    unknown = set(data) - {"name", "matrix", "options"}
    if unknown:
        raise UsageError(f"sweep file {str(path)!r}: unknown table or key {sorted(unknown)[0]!r} "
                         "(expected name, [matrix], [options])")
    matrix = data.get("matrix") or {}
    for key, values in matrix.items():
        if key not in MATRIX_KEYS:
            raise UsageError(f"sweep file [matrix]: unknown key {key!r} (one of {', '.join(MATRIX_KEYS)})")
        if not isinstance(values, list) or not values:
            raise UsageError(f"sweep file [matrix]: {key} must be a non-empty list, e.g. {key} = [...]")
    for required in ("model", "gpus", "global_tokens"):
        if required not in matrix:
            raise UsageError(f"sweep file [matrix] needs {required} = [...]")
    options = data.get("options") or {}
    for key in options:
        if key not in OPTION_KEYS:
            raise UsageError(f"sweep file [options]: unknown key {key!r} (one of {', '.join(OPTION_KEYS)})")
    keys = list(matrix)
    problems = [Problem(**dict(zip(keys, values, strict=True))) for values in itertools.product(*(matrix[k] for k in keys))]
    # vLLM's share means nothing to an SFT problem: drop it there, and the duplicates that leaves.
    problems = [p if p.workload == "grpo" else dataclasses.replace(p, vllm_gpu_memory_utilization=None) for p in problems]
    problems = tuple(dict.fromkeys(problems))
    sweep_name = name or data.get("name") or Path(path).stem
    return Sweep(name=str(sweep_name), problems=problems, options=dict(options))


# -- the work queue -----------------------------------------------------------------------------------


class SweepQueue:
    """The sweep's Optuna study: one trial per problem, claimed and finished through the storage."""

    def __init__(self, storage_url: str, sweep: Sweep, *, heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> None:
        from autotune.util.secrets import with_password
        from autotune.search.store import create_study

        self.sweep = sweep
        self.heartbeat_s = heartbeat_s
        self.study, created = create_study(with_password(storage_url), sweep.study_name, storage_options=dict(
            heartbeat_s=heartbeat_s, retries=MAX_RETRIES))
        self.storage = self.study._storage  # the RDBStorage create_study made (Study has no public getter)
        if created:
            for index, problem in enumerate(sweep.problems):
                self.study.enqueue_trial({}, user_attrs={"problem": problem.key, "index": index})
            self.study.set_user_attr("matrix", sweep.digest)
            self.study.set_user_attr("created", time.time())
            self.study.set_user_attr("enqueued", len(sweep.problems))
        else:
            self._await_enqueued()

    def _await_enqueued(self) -> None:
        deadline = time.monotonic() + ENQUEUE_WAIT_S
        while "enqueued" not in self.study.user_attrs:
            if time.monotonic() > deadline:
                raise UsageError(f"sweep study {self.sweep.study_name!r} exists but its problems were never all "
                                 "queued (its creator died?): rerun with another --name")
            time.sleep(0.2)
        if self.study.user_attrs.get("matrix") != self.sweep.digest:
            raise UsageError(f"sweep {self.sweep.name!r} already exists in this storage with another matrix: "
                             "pass --name NAME for the new one")

    def claim(self) -> tuple[int, Problem] | None:
        """A waiting problem, now RUNNING for this worker; None when none is waiting."""
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import TrialState

        self.fail_stale()
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            try:
                if not self.storage.set_trial_state_values(trial._trial_id, state=TrialState.RUNNING):
                    continue  # another worker took it first
            except UpdateFinishedTrialError:
                continue
            self.storage.record_heartbeat(trial._trial_id)
            return trial._trial_id, self.sweep.problems[trial.user_attrs["index"]]
        return None

    def fail_stale(self) -> None:
        """Problems whose worker stopped beating go back to the queue (Optuna's retry callback)."""
        import warnings

        import optuna

        with warnings.catch_warnings():  # "experimental" in Optuna 5.0, and exactly what is needed
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(self.study)

    def running(self) -> int:
        from optuna.trial import TrialState

        return len(self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))

    @contextlib.contextmanager
    def heartbeat(self, trial_id: int) -> Iterator[None]:
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.heartbeat_s):
                self.storage.record_heartbeat(trial_id)

        thread = threading.Thread(target=beat, name="autotune-sweep-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def finish(self, trial_id: int, outcome: dict[str, Any]) -> None:
        import optuna
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import TrialState

        value = float(outcome.get("tokens_per_sec") or 0.0)
        try:
            for key, item in outcome.items():
                self.storage.set_trial_user_attr(trial_id, key, item)
            self.storage.set_trial_state_values(trial_id, state=TrialState.COMPLETE, values=[value])
            return
        except UpdateFinishedTrialError:
            pass
        # This worker's heartbeat went stale (a long stall) and another worker failed the trial and
        # queued it again: keep this result as a finished trial of its own, and withdraw the copy
        # if no worker has taken it yet.
        problem = self._problem_attrs(trial_id)
        self.study.add_trial(optuna.trial.create_trial(state=TrialState.COMPLETE, value=value,
                                                       user_attrs={**problem, **outcome}))
        for waiting in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            if waiting.user_attrs.get("index") == problem["index"]:
                with contextlib.suppress(UpdateFinishedTrialError):
                    if self.storage.set_trial_state_values(waiting._trial_id, state=TrialState.RUNNING):
                        self.storage.set_trial_user_attr(waiting._trial_id, "withdrawn", "finished by the stalled worker")
                        self.storage.set_trial_state_values(waiting._trial_id, state=TrialState.FAIL)

    def give_back(self, trial_id: int) -> None:
        """An interrupted worker's problem goes back to the queue at once (no need to wait for
        its heartbeat to go stale)."""
        from optuna.trial import TrialState

        self.study.enqueue_trial({}, user_attrs=self._problem_attrs(trial_id))
        self.storage.set_trial_state_values(trial_id, state=TrialState.FAIL)

    def _problem_attrs(self, trial_id: int) -> dict[str, Any]:
        """What identifies a queued problem (as enqueued, and as Optuna's retry copies it)."""
        attrs = self.storage.get_trial(trial_id).user_attrs
        return {"problem": attrs["problem"], "index": attrs["index"]}


def sweep_results(study) -> dict[str, dict[str, Any]]:
    """Finished problems of a sweep study by problem key (the outcome each worker recorded)."""
    from optuna.trial import TrialState

    return {t.user_attrs["problem"]: dict(t.user_attrs) for t in study.get_trials(deepcopy=False,
                                                                                    states=(TrialState.COMPLETE,))}


# -- one worker -----------------------------------------------------------------------------------------


def run_worker(queue: SweepQueue, *, storage_url: str, runs_dir: Path, log) -> dict[str, int]:
    """Claim and tune problems until every one of the sweep is finished; returns counts by state."""
    sweep, heartbeat_s = queue.sweep, queue.heartbeat_s
    counts: dict[str, int] = {}
    while True:
        claimed = queue.claim()
        if claimed is None:
            if queue.running() == 0:
                return counts
            time.sleep(min(heartbeat_s, 2.0))  # running elsewhere: one may come back if its worker dies
            continue
        trial_id, problem = claimed
        log(f"sweep {sweep.name}: tuning {problem.key}")
        try:
            with queue.heartbeat(trial_id):
                outcome = tune_problem(problem, sweep=sweep, storage_url=storage_url, runs_dir=runs_dir)
        except StorageUnavailable:
            raise  # the queue is out of reach too: the problem returns when its heartbeat goes stale
        except BaseException:
            queue.give_back(trial_id)
            raise
        queue.finish(trial_id, outcome)
        counts[outcome["state"]] = counts.get(outcome["state"], 0) + 1
        log(f"sweep {sweep.name}: {problem.key}: {outcome['state']}"
            + (f", {outcome['tokens_per_sec']:,.0f} tokens/s ({outcome['throughput_source']})"
               if outcome.get("tokens_per_sec") else ""))


def tune_problem(problem: Problem, *, sweep: Sweep, storage_url: str, runs_dir: Path) -> dict[str, Any]:
    """The library's tune (what `autotune tune` runs) for one problem, in this process, on the
    sweep's storage; its winner's summary (or why there is none) as the sweep records it."""
    from autotune.drivers.api import run_tune
    from autotune.results.console import Console
    from autotune.problem.options import tune_options

    out = runs_dir / "sweeps" / sweep.name / (problem.key.replace("/", "_") + ".json")
    try:
        # A study per sweep and problem: a rerun of this sweep resumes it, but another night
        # measures afresh (reusing last night's trials would hide tonight's regressions).
        options = tune_options(**dataclasses.asdict(problem), **sweep.options, storage=storage_url,
                               study=f"{sweep.name}:{problem.key}", runs_dir=str(runs_dir), out=str(out))
        document = run_tune(options, Console(quiet=True))
    except UsageError as exc:
        return dict(state="bad-input", message=str(exc))
    except NothingFits:
        return dict(state="nothing-fits", message="no configuration fits (see the problem's run folder)")
    except StorageUnavailable:
        raise  # not the problem's failure: this worker stops, its problem goes to another
    except Exception as exc:  # noqa: BLE001 - one problem's failure is recorded, the sweep goes on
        return dict(state="error", message=f"{type(exc).__name__}: {exc}")
    return summarize(document, result_file=str(out))


def summarize(result: dict[str, Any], *, result_file: str) -> dict[str, Any]:
    """What a nightly comparison needs of a winner (best.json), with each figure's source."""
    fsdp = result["fsdp"]
    return dict(state="done", result_file=result_file, run_id=result["run_id"], study=result["study"],
                config=dict(precision=result["precision"], activation_checkpointing=fsdp["activation_checkpointing"],
                            cpu_offload=fsdp["cpu_offload"], reshard_after_forward=fsdp["reshard_after_forward"],
                            micro_batch_size=result["micro_batch_size"],
                            grad_accum_steps=result["grad_accum_steps"],
                            optimizer_impl=result["optimizer"]["impl"]),
                tokens_per_sec=result["tokens_per_sec"], throughput_source=result["throughput_source"],
                peak_memory_bytes=result["peak_memory_bytes"], memory_source=result["memory_source"])


# -- Slurm ----------------------------------------------------------------------------------------------


def submit_to_slurm(sweep: Sweep, *, sweep_file: Path, storage_url: str, runs_dir: Path, workers: int,
                    heartbeat_s: float, sbatch_args: list[str], wait: bool) -> tuple[str, Path]:
    """Submit `workers` sweep workers as one Slurm job array (sbatch), each an ordinary worker of
    this sweep; returns (job id, the job script). The script holds no password: the URL must carry
    none, and sbatch passes the submitting environment (AUTOTUNE_STORAGE_PASSWORD) to the tasks."""
    import shlex
    import shutil
    import subprocess
    import sys

    from autotune.util.files import write_atomic
    from autotune.util.secrets import mask

    if mask(storage_url) != storage_url:
        raise UsageError("--slurm writes a job script: give --storage without its password and the password in "
                         "AUTOTUNE_STORAGE_PASSWORD (or a file named by AUTOTUNE_STORAGE_PASSWORD_FILE)")
    if shutil.which("sbatch") is None:
        raise UsageError("--slurm needs Slurm's sbatch on PATH (run on a login node), or use --local N")
    folder = (runs_dir / "sweeps" / sweep.name).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    worker = [sys.executable, "-m", "autotune", "sweep", str(Path(sweep_file).resolve()), "--storage", storage_url,
              "--runs-dir", str(runs_dir.resolve()), "--name", sweep.name, "--heartbeat", str(heartbeat_s)]
    script = folder / "sbatch.sh"
    write_atomic(script, "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name=autotune-{sweep.name}",
        f"#SBATCH --array=0-{workers - 1}",
        f"#SBATCH --output={folder}/slurm-%A_%a.out",
        *(f"#SBATCH {arg}" for arg in sbatch_args),
        "# Each array task is one worker of the sweep; workers share the storage's queue.",
        f"cd {shlex.quote(str(Path.cwd()))}",
        "exec " + shlex.join(worker),
        ""]))
    command = ["sbatch", "--parsable", *(["--wait"] if wait else []), str(script)]
    done = subprocess.run(command, capture_output=True, text=True)
    job = done.stdout.strip().split(";")[0]
    if done.returncode != 0 and not (wait and job):
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise UsageError(f"sbatch refused the sweep job: {mask(last)}")
    if done.returncode != 0:
        raise AutotuneError(f"Slurm job {job}: some workers failed (logs: {folder}/slurm-{job}_*.out)")
    return job, script

