"""Launch torchrun for a list of trials, watch it, and end it cleanly whatever the trials do.

A `Launch` is one torchrun run of the worker; trials are queued to it as files and it keeps
running between them (persistent mode), until stopped or ended by a trial. The launcher reads
the worker's files (see worker.py) as they appear; each trial gets its own timeout, counted
from its start. A trial that ends the launch (out of memory, crash, hang) is classified, and
the backend sends the trials after it to a fresh launch.

Multi-node: the launch folder is on a file system every node sees. The controller starts its own
torchrun and writes `launch.json`; an agent on every other node (multinode.py) starts the same
torchrun there, ends it when the controller writes `end`, and leaves `exit.<node>.json`. Each
launch has a rendezvous id of its own, so a relaunch never restarts an earlier launch's workers;
node ranks are whatever the c10d rendezvous assigns. Results, failures and every node's logs and
exit codes land in the one folder, and the controller classifies a trial once.

Process hygiene: torchrun starts in a new session, and every process of a launch carries an
environment marker. Ending a launch kills torchrun's process group, then every process that
carries the marker (torchrun puts its workers in sessions of their own, so the group alone
would miss them), and checks /proc until none is left.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.util.files import write_json
from autotune.estimate.runtime_memory import ALLOC_CONF_ENV, alloc_conf


LAUNCH_MARKER_ENV = "AUTOTUNE_REAL_LAUNCH"
AGENT_FAILURES_ENV = "AUTOTUNE_AGENT_FAILURES"  # where _torchrun writes the agent's failed ranks
LAUNCHER_PID_ENV = "AUTOTUNE_LAUNCHER_PID"  # the process that started this node's torchrun
NODE_NAME_ENV = "AUTOTUNE_NODE_NAME"  # overrides the host name (containers that share one; tests)
REMOTE_EXIT_GRACE_S = 15.0
STDERR_TAIL_LINES = 20
_POLL_S = 0.1
_KILL_GRACE_S = 10.0
_EXIT_GRACE_S = 3.0
_STOPPED_BY_AGENT = {"SIGTERM", "SIGKILL"}


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """How to start torchrun and how long to wait for it."""

    device: str
    nproc_per_node: int
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    timeout_s: float = 300.0
    startup_timeout_s: float = 180.0
    warmup_steps: int = 1
    timed_steps: int = 2
    seed: int = 0

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    def torchrun_args(self, *, log_dir: Path, rdzv_id: str) -> list[str]:
        args = [f"--nproc-per-node={self.nproc_per_node}", f"--log-dir={log_dir}", "--redirects=3",
                "--max-restarts=0"]
        if not self.multi_node:
            return ["--standalone", *args]
        # No --node-rank: the c10d rendezvous assigns node ranks (it would ignore one).
        return [f"--nnodes={self.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={self.rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}", *args]


@dataclass(kw_only=True)
class TrialOutcome:
    """What one trial of a launch came to; the backend turns it into a TrialResult."""

    index: int
    status: str  # ok | oom | error | timeout
    message: str = ""
    figures: dict[str, Any] | None = None  # the worker's results file, for status ok
    failed_rank: int | None = None
    launch: int = 0
    duration_s: float = 0.0


def cgroup_oom_kills(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """How many processes the kernel's OOM killer has killed in this process's cgroup (v2
    memory.events, else v1 memory.oom_control); None where neither can be read."""
    try:
        cgroup = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        cgroup = []
    candidates = []
    for line in cgroup:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            candidates.append(root / path.lstrip("/") / "memory.events")
        elif "memory" in controllers.split(","):  # v1 memory controller
            candidates.append(root / "memory" / path.lstrip("/") / "memory.oom_control")
    candidates += [root / "memory.events", root / "memory" / "memory.oom_control"]
    for path in candidates:
        try:
            for line in path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def node_name() -> str:
    return os.environ.get(NODE_NAME_ENV) or platform.node()


def torchrun_command(options: LaunchOptions, *, folder: Path, node: str, rdzv_id: str) -> list[str]:
    """One node's command line of a launch (torch's launcher, run through _torchrun to keep exit
    codes); its logs go to a folder of the node's own."""
    return [sys.executable, "-m", "autotune.backends.real._torchrun",
            *options.torchrun_args(log_dir=folder / "logs" / node, rdzv_id=rdzv_id),
            "-m", "autotune.backends.real.worker", "--job", str(folder / "job.json"), "--out", str(folder / "out")]


def start_torchrun(options: LaunchOptions, folder: Path, *, marker: str) -> subprocess.Popen:
    """Start this node's torchrun of the launch in `folder`: a new session (so it can be killed
    as a group), the launch marker in every process's environment, killed with its starter."""
    node = node_name()
    env = dict(os.environ, **{LAUNCH_MARKER_ENV: marker, LAUNCHER_PID_ENV: str(os.getpid()), NODE_NAME_ENV: node,
                              AGENT_FAILURES_ENV: str(folder / f"agent_failures.{node}.json")})
    # Trials run with the allocator setting the prediction assumes and the exports pin.
    env[ALLOC_CONF_ENV] = alloc_conf(os.environ)
    if options.device == "cpu":
        # Compiled CPU trials: each rank compiles inductor's kernels on its own thread. The ranks
        # already fill the cores (one thread each), and a compile-worker pool per rank only adds
        # processes: 2 ranks compiling micro-llama's blocks cold took 72-94 s with one thread, 114-123 s
        # with the default pool (2-core VM, alternated, load 4-6). A value set by the user is kept.
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    command = torchrun_command(options, folder=folder, node=node, rdzv_id=f"autotune-{marker}")
    # Launch from the main thread: preexec_fn runs Python in the forked child, which there drops
    # the other threads' objects (a gloo group's destructor then waits forever on its threads).
    with open(folder / f"torchrun.{node}.log", "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, preexec_fn=die_with_parent)


class Launch:
    """One torchrun launch that takes trials as they are submitted, until stopped or ended by a
    trial. The ranks wait between trials (polling the queue folder) outside any collective."""

    def __init__(self, options: LaunchOptions, folder: Path, *, number: int) -> None:
        self.options = options
        self.folder = folder
        self.number = number
        self.marker = uuid.uuid4().hex
        self.out = folder / "out"
        self.logs = folder / "logs"
        self.ended = False
        self._submitted = 0
        self._started_any = False
        self._proc: subprocess.Popen | None = None

    @property
    def _torchrun_log(self) -> Path:
        return self.folder / f"torchrun.{node_name()}.log"  # start_torchrun writes it

    @property
    def alive(self) -> bool:
        return not self.ended and self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        (self.out / "queue").mkdir(parents=True, exist_ok=True)
        write_json(self.folder / "job.json", dict(
            device=self.options.device, warmup_steps=self.options.warmup_steps,
            timed_steps=self.options.timed_steps, seed=self.options.seed,
            # Collectives give up on their own well after the launcher would have killed them.
            collective_timeout_s=self.options.timeout_s + self.options.startup_timeout_s))
        self._oom_kills_at_start = cgroup_oom_kills()
        self._proc = start_torchrun(self.options, self.folder, marker=self.marker)
        if self.options.multi_node:  # the agents start the same launch on their nodes
            write_json(self.folder / "launch.json", dict(options=dataclasses.asdict(self.options), marker=self.marker))

    def run(self, items: list[tuple[int, dict[str, Any]]]) -> list[TrialOutcome]:
        """Queue (index, spec dict) pairs and wait for them. Returns the outcomes of a prefix of
        `items`: all of them, or up to the one that ended the launch."""
        if self._proc is None:
            self.start()
        assert self.alive, "run() on a launch that has ended"
        for index, spec in items:
            write_json(self.out / "queue" / f"{self._submitted}.json", dict(index=index, spec=spec))
            self._submitted += 1
        try:
            outcomes = self._watch([index for index, _ in items])
        except BaseException:
            self.end()
            raise
        if len(outcomes) < len(items) or not self.alive:
            self.end()
        return outcomes

    def stop(self) -> None:
        """Ask the ranks to finish (they exit between trials), then make sure they have."""
        if self.alive:
            write_json(self.out / "queue" / "stop", True)
            try:
                self._proc.wait(timeout=_EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        self.end()

    def end(self) -> None:
        """Kill whatever of the launch is left and verify that nothing is (the agents do the same
        on their nodes when they see `end`)."""
        if self.options.multi_node:
            write_json(self.folder / "end", True)
        if self._proc is not None:
            end_launch(self._proc, self.marker)
        self.ended = True

    def _watch(self, pending: list[int]) -> list[TrialOutcome]:
        finished: list[TrialOutcome] = []
        clock = deadline_from = time.monotonic()  # when the current trial (or the start-up) began
        current_started = False
        while pending:
            returncode = self._proc.poll()
            index = pending[0]
            result = self.out / "results" / f"{index}.json"
            if result.exists():
                figures = json.loads(result.read_text())
                now = time.monotonic()
                finished.append(TrialOutcome(index=index, status="ok", figures=figures, launch=self.number,
                                             duration_s=now - clock))
                pending.pop(0)
                clock = deadline_from = now
                current_started = False
                continue
            if not current_started and (self.out / "started" / str(index)).exists():
                current_started = self._started_any = True
                deadline_from = time.monotonic()  # the trial's timeout counts from its start
            if returncode is not None:
                # Rank 0 writes results before the launch can exit: a last look, then classify.
                if result.exists():
                    continue
                return finished + self._failed(pending, returncode, current_started, clock)
            limit = self.options.timeout_s + (0 if self._started_any else self.options.startup_timeout_s)
            if time.monotonic() - deadline_from > limit:
                self.end()
                return finished + self._timed_out(pending, current_started, clock, limit)
            time.sleep(_POLL_S)
        return finished

    def _timed_out(self, pending: list[int], started: bool, clock: float, limit: float) -> list[TrialOutcome]:
        what = f"trial made no progress for {limit:.0f} s" if started else \
            f"the launch did not start trial {pending[0]} within {limit:.0f} s"
        outcome = TrialOutcome(index=pending[0], status="timeout", launch=self.number,
                               duration_s=time.monotonic() - clock,
                               message=f"{what} (a rank hung, e.g. in a collective); every process of the "
                                       f"launch was killed. Logs: {self.logs}")
        if started:
            return [outcome]
        return [outcome] + [TrialOutcome(index=index, status="error", launch=self.number,
                                         message=f"not run: the launch timed out in start-up ({what})")
                            for index in pending[1:]]

    def _failed(self, pending: list[int], returncode: int, started: bool, clock: float) -> list[TrialOutcome]:
        duration = time.monotonic() - clock
        self._await_other_nodes()
        # Another rank can fail in the trial before rank 0 has marked it started.
        started = started or any((self.out / "failures").glob(f"{pending[0]}.rank*.json"))
        if not started:
            # Nothing trial-specific ran: start-up failed, and would fail again for the rest.
            reason = self._root_cause("setup") or TrialOutcome(
                index=-1, status="error", message=f"torchrun exited with code {returncode} before any "
                f"trial started; last lines of its log:\n{_tail(self._torchrun_log)}")
            return [TrialOutcome(index=index, status="error", launch=self.number, duration_s=duration,
                                 failed_rank=reason.failed_rank,
                                 message=f"the launch failed before the trial started: {reason.message}")
                    for index in pending]
        index = pending[0]
        outcome = self._root_cause(str(index)) or TrialOutcome(
            index=index, status="error", message=f"torchrun exited with code {returncode} during the trial "
            f"and no rank reported why; last lines of its log:\n{_tail(self._torchrun_log)}")
        outcome.index, outcome.launch, outcome.duration_s = index, self.number, duration
        return [outcome]

    def _root_cause(self, index: str) -> TrialOutcome | None:
        """The first failure of a trial: an out-of-memory anywhere, else a rank that died without
        an exception (its exit code or signal, as the agent saw it), else the earliest exception."""
        reports = [json.loads(p.read_text()) for p in sorted((self.out / "failures").glob(f"{index}.rank*.json"))]
        ooms = sorted((r for r in reports if r["oom"]), key=lambda r: r["time"])
        if ooms:
            root = ooms[0]
            return TrialOutcome(index=-1, status="oom", failed_rank=root["rank"],
                                message=f"out of memory on rank {root['rank']}: {root['type']}: {root['message']}")
        reported = {r["rank"] for r in reports}
        silent = [f for f in self._agent_failures()
                  if f["rank"] not in reported and f.get("signal") not in _STOPPED_BY_AGENT]
        if silent:
            root = min(silent, key=lambda f: (f["timestamp"], f["rank"]))
            kills = cgroup_oom_kills()
            before = getattr(self, "_oom_kills_at_start", None)
            local = root.get("node") == node_name()  # the OOM killer's count is this node's
            if local and root.get("signal") == "SIGKILL" and kills is not None and before is not None and kills > before:
                return TrialOutcome(index=-1, status="oom", failed_rank=root["rank"], message=(
                    f"host out of memory: rank {root['rank']} was killed by the kernel's OOM killer "
                    f"(cgroup memory.events oom_kill {before} -> {kills})"))
            how = f"killed by {root['signal']}" if root.get("signal") else f"exited with code {root['exitcode']}"
            return TrialOutcome(index=-1, status="error", failed_rank=root["rank"],
                                message=f"rank {root['rank']} {how} without a Python exception; last lines "
                                        f"of its stderr:\n{self._stderr_tail(root)}")
        if reports:
            root = min(reports, key=lambda r: r["time"])
            return TrialOutcome(index=-1, status="error", failed_rank=root["rank"],
                                message=f"rank {root['rank']} raised {root['type']}: {root['message']}\nlast "
                                        f"lines of its stderr:\n{self._stderr_tail(root)}")
        return None

    def _await_other_nodes(self) -> None:
        """Multi-node: a failing launch ends on every node; wait (briefly) until each agent has
        recorded its torchrun's exit, so failures seen from any node are classified together."""
        if not self.options.multi_node:
            return
        deadline = time.monotonic() + REMOTE_EXIT_GRACE_S
        while len(list(self.folder.glob("exit.*.json"))) < self.options.nnodes - 1 and time.monotonic() < deadline:
            time.sleep(_POLL_S)

    def _agent_failures(self) -> list[dict[str, Any]]:
        """Every node's torchrun agent's view of its failed ranks, each tagged with its node."""
        failures = []
        for path in sorted(self.folder.glob("agent_failures.*.json")):
            node = path.name.removeprefix("agent_failures.").removesuffix(".json")
            try:
                failures += [dict(f, node=node) for f in json.loads(path.read_text())]
            except (OSError, json.JSONDecodeError):
                continue
        return failures

    def _stderr_tail(self, failure: dict[str, Any]) -> str:
        """The last lines of a failed rank's stderr, from its node's log folder."""
        node, local_rank = failure.get("node"), failure.get("local_rank")
        logs = sorted((self.logs / str(node)).glob(f"*/attempt_*/{local_rank}/stderr.log"))
        return _tail(logs[-1]) if logs else f"(no stderr log of node {node}, local rank {local_rank})"


def _tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def process_gone(pid: int) -> bool:
    """True once `pid` has exited: no longer in /proc, or a zombie (its resources released)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux PR_SET_PDEATHSIG): a
    controller killed with SIGKILL takes its torchrun with it, and torchrun's death takes the
    ranks, so no trial keeps GPUs after the process that launched it is gone. A no-op where
    prctl is missing."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def marked_processes(marker: str) -> list[int]:
    """Live processes whose environment carries this launch's marker (zombies have none)."""
    needle = f"{LAUNCH_MARKER_ENV}={marker}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(name))
    return found


def end_launch(proc: subprocess.Popen, marker: str) -> None:
    """Kill torchrun's process group and every process of the launch, and wait until each is
    really gone (reaped or a zombie: its GPU memory released), not merely unreadable: a process
    in the middle of exiting has an empty /proc environ but may still hold its GPU memory, and
    a relaunch started then could run out of memory for that reason."""
    known = set(marked_processes(marker)) | {proc.pid}
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + _KILL_GRACE_S
    while True:
        known.update(marked_processes(marker))
        proc.poll()  # reap torchrun itself, our child
        alive = [pid for pid in known if not process_gone(pid)]
        if not alive:
            break
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            # Not the controller's problem to die of; say so loudly (a process stuck in the kernel).
            warnings.warn(f"processes {alive} of a trial launch survived SIGKILL for {_KILL_GRACE_S} s",
                          RuntimeWarning, stacklevel=2)
            break
        time.sleep(0.05)
    proc.wait()
