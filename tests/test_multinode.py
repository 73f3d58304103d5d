"""Multi-node real trials on one machine: one controller and one agent, two "nodes" of 2 gloo
ranks each, meeting through a loopback rendezvous and a shared folder (docs/REAL_TRIALS.md)."""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.backends.real import FAULT_ENV, RealBackend
from autotune.backends.real._launcher import NODE_NAME_ENV
from autotune.problem.catalog.models import resolve_model
from autotune.drivers.cli import main
from autotune.problem.config import Cluster, TrainConfig, TrialSpec
from tests.test_real import leftover_trial_processes

pytestmark = pytest.mark.slow

MODEL = resolve_model("micro-llama")
AGENT_NODE = "node-b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_agent(shared: Path, **env) -> subprocess.Popen:
    """`autotune agent` as another node would run it: its own name, its own environment."""
    environment = dict(os.environ, OMP_NUM_THREADS="1", **{NODE_NAME_ENV: AGENT_NODE}, **env)
    return subprocess.Popen([sys.executable, "-m", "autotune", "agent", "--shared-dir", str(shared), "--wait", "120"],
                            env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(agent: subprocess.Popen, timeout_s: float = 60) -> str:
    try:
        _, err = agent.communicate(timeout=timeout_s)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.communicate()
    return err


def spec(micro_batch_size: int) -> TrialSpec:
    return TrialSpec(model=MODEL, cluster=Cluster(num_gpus=4, num_nodes=2), seq_len=64,
                     train=TrainConfig(micro_batch_size=micro_batch_size))


def test_one_controller_and_an_agent_run_every_trial_and_classify_an_oom_on_one_node_once(tmp_path, monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    shared = tmp_path / "shared"
    # Only the agent's node runs out of memory, in the second trial (both of its ranks).
    agent = start_agent(shared, **{FAULT_ENV: "oom:trial=1"})
    try:
        with RealBackend(device="cpu", nnodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}", shared_dir=shared,
                         timeout_s=120, timed_steps=1) as backend:
            results = backend.evaluate_many([spec(1), spec(2), spec(4)])
            launches = backend.launches
    finally:
        err = finish(agent)
    assert agent.returncode == 0, err  # the controller said done
    assert [r.status for r in results] == ["ok", "oom", "ok"], [r.message for r in results]
    assert "injected out-of-memory" in results[1].message
    # Every trial ran on all 4 ranks (torchrun waits for both nodes), the one after the OOM in a
    # fresh launch that the agent joined too.
    assert len(results[0].extras["per_rank_tensor_peak_bytes"]) == 4
    assert len(results[2].extras["per_rank_tensor_peak_bytes"]) == 4
    assert launches == 2
    session = shared / json.loads((shared / "session.json").read_text())["id"]
    for number in range(launches):
        folder = session / f"launch-{number}"
        assert (folder / "logs" / AGENT_NODE).is_dir() and (folder / "logs" / platform.node()).is_dir()
        assert (folder / f"exit.{AGENT_NODE}.json").exists()
    failures = [json.loads(p.read_text()) for p in (session / "launch-0" / "out" / "failures").glob("1.rank*.json")]
    oom_nodes = {f["node"] for f in failures if f["oom"]}
    assert oom_nodes == {AGENT_NODE}, failures
    assert leftover_trial_processes(shared) == []


def test_tune_across_two_nodes_records_one_study(tmp_path, capsys):
    """The CLI: the controller walks the graph once, the agent only runs launches; the study
    holds each configuration once and the agent exits when the controller is done."""
    shared, runs = tmp_path / "shared", tmp_path / "runs"
    agent = start_agent(shared)
    try:
        code = main(["--model", "micro-llama", "--gpus", "4", "--nodes", "2", "--global-tokens", "4096",
                     "--backend", "cpu", "--shared-dir", str(shared), "--rdzv-endpoint",
                     f"127.0.0.1:{free_port()}", "--runs-dir", str(runs), "--max-trials", "3"])
    finally:
        err = finish(agent)
    assert code == 0, capsys.readouterr().err
    assert agent.returncode == 0, err
    (best,) = runs.glob("*/best.json")
    result = json.loads(best.read_text())
    steps = result["decision_path"]
    configs = [json.dumps([s["config"], s["grad_accum_steps"]], sort_keys=True) for s in steps]
    assert len(configs) == len(set(configs)) == 3
    assert all(s["memory_source"] == "measured" for s in steps if s["status"] == "ok")
    assert leftover_trial_processes(shared) == []


def test_node_rank_is_refused_with_what_to_do(capsys):
    code = main(["--model", "micro-llama", "--gpus", "4", "--nodes", "2", "--global-tokens", "4096",
                 "--backend", "cpu", "--node-rank", "1"])
    assert code == 2
    assert "autotune agent --shared-dir" in capsys.readouterr().err
