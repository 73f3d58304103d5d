"""Multi-node real trials: one controller for the job, a thin agent on every other node.

The controller (`autotune tune` or `trial` on one node) runs the decision graph, the study and
the classification, exactly as on one node. Every other node runs `autotune agent --shared-dir
DIR`: it starts that node's torchrun for each launch the controller writes, ends it when told,
and nothing else. They meet in DIR, a folder on a file system every node sees:

    DIR/session.json                    the controller: session id, a heartbeat count, done
    DIR/<session>/launch-<n>/           one launch (see _launcher.py): job, queue, results,
                                        failures, launch.json, end, and per node
                                        logs/<node>/, torchrun.<node>.log,
                                        agent_failures.<node>.json, exit.<node>.json

An agent follows the newest session (a rerun of the controller starts a new one) and exits 0
when the controller says done, 1 when the controller's heartbeat stops (the count has not moved
for `heartbeat_timeout_s` of the agent's own clock, so clocks need not agree).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from autotune.backends.real._launcher import LaunchOptions, end_launch, node_name, start_torchrun
from autotune.util.files import write_json

SESSION_FILE = "session.json"
HEARTBEAT_S = 2.0
HEARTBEAT_TIMEOUT_S = 60.0
_POLL_S = 0.1


class ControllerSession:
    """The controller's side: a session folder for the launches and a heartbeat the agents watch."""

    def __init__(self, shared_dir: Path) -> None:
        self.shared_dir = Path(shared_dir)
        self.id = uuid.uuid4().hex[:12]
        self.folder = self.shared_dir / self.id
        self.folder.mkdir(parents=True, exist_ok=True)
        self._beats = 0
        self._stop = threading.Event()
        self._write(done=False)
        self._thread = threading.Thread(target=self._beat, name="autotune-controller-heartbeat", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Tell the agents the job is over (they exit 0)."""
        self._stop.set()
        self._thread.join()
        self._write(done=True)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self._write(done=False)

    def _write(self, *, done: bool) -> None:
        self._beats += 1
        write_json(self.shared_dir / SESSION_FILE,
                   dict(id=self.id, controller=node_name(), heartbeat=self._beats, done=done))


def run_agent(shared_dir: Path, *, wait_s: float = 600.0, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
              log=print) -> int:
    """Serve the controller's launches on this node until it is done (0) or gone (1)."""
    shared_dir = Path(shared_dir)
    node = node_name()
    deadline = time.monotonic() + wait_s
    session: str | None = None
    next_launch = 0
    watch = _Heartbeat(heartbeat_timeout_s)
    log(f"agent on {node}: waiting for a controller in {shared_dir}")
    while True:
        state = _read(shared_dir / SESSION_FILE)
        if state is None:
            if time.monotonic() > deadline:
                log(f"agent on {node}: no controller wrote {shared_dir / SESSION_FILE} in {wait_s:.0f} s")
                return 1
            time.sleep(_POLL_S)
            continue
        if state["id"] != session:
            session, next_launch = state["id"], 0
            watch = _Heartbeat(heartbeat_timeout_s)
            log(f"agent on {node}: following controller session {session} on {state.get('controller')}")
        if state.get("done"):
            log(f"agent on {node}: the controller is done")
            return 0
        if watch.stopped(state["heartbeat"]):
            log(f"agent on {node}: the controller's heartbeat stopped for {heartbeat_timeout_s:.0f} s; exiting")
            return 1
        folder = shared_dir / session / f"launch-{next_launch}"
        launch = _read(folder / "launch.json")
        if launch is not None:
            log(f"agent on {node}: starting {folder.name}")
            returncode = serve_launch(folder, launch, heartbeat=watch, session_file=shared_dir / SESSION_FILE)
            log(f"agent on {node}: {folder.name} ended (torchrun exit code {returncode})")
            next_launch += 1
            continue
        time.sleep(_POLL_S)


def serve_launch(folder: Path, launch: dict[str, Any], *, heartbeat: _Heartbeat, session_file: Path) -> int | None:
    """Run this node's torchrun of one launch until it exits, the controller writes `end`, or
    the controller is gone; then make sure every process of it is, and record how it ended."""
    if (folder / "end").exists():  # ended before this agent got to it
        write_json(folder / f"exit.{node_name()}.json", dict(returncode=None))
        return None
    options = LaunchOptions(**launch["options"])
    proc = start_torchrun(options, folder, marker=launch["marker"])
    try:
        while proc.poll() is None:
            if (folder / "end").exists():
                break
            state = _read(session_file)
            if state is not None and heartbeat.stopped(state["heartbeat"]):
                break
            time.sleep(_POLL_S)
    finally:
        end_launch(proc, launch["marker"])
        write_json(folder / f"exit.{node_name()}.json", dict(returncode=proc.returncode))
    return proc.returncode


class _Heartbeat:
    """Whether a heartbeat count has stood still for `timeout_s` of this process's clock."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last: int | None = None
        self._since = time.monotonic()

    def stopped(self, count: int) -> bool:
        if count != self._last:
            self._last, self._since = count, time.monotonic()
        return time.monotonic() - self._since > self.timeout_s


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
