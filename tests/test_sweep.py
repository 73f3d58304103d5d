"""Sweeps with cooperating worker processes on one SQLite storage, and nightly regressions.
Workers are real processes; the counts are read back from the storage with Optuna itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune.drivers.cli import main
from autotune.drivers.regress import EXIT_REGRESSION
from autotune.search.store import STUDY_DB

MATRIX = """
name = "{name}"
[matrix]
model = ["tiny-llama", "micro-llama"]
gpus = [2, 4, 8]
global_tokens = ["64K"]
backend = ["analytic"]
"""


def write_sweep(folder: Path, name: str = "nightly", matrix: str = MATRIX) -> Path:
    path = folder / f"{name}.toml"
    path.write_text(matrix.format(name=name))
    return path


def sweep_study(runs: Path, name: str) -> optuna.Study:
    return optuna.load_study(storage=f"sqlite:///{runs / STUDY_DB}", study_name=f"sweep:{name}")


def problem_studies(runs: Path) -> list[optuna.study.StudySummary]:
    return [s for s in optuna.get_all_study_summaries(f"sqlite:///{runs / STUDY_DB}", include_best_trial=False)
            if not s.study_name.startswith("sweep:")]


def autotune(*argv: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "autotune", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.slow
def test_three_workers_started_together_do_every_problem_once(tmp_path):
    runs = tmp_path / "runs"
    proc = autotune("sweep", str(write_sweep(tmp_path)), "--runs-dir", str(runs), "--local", "3",
                    "--heartbeat", "1")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "Warning" not in err, err
    trials = sweep_study(runs, "nightly").get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 6
    assert len({t.user_attrs["problem"] for t in trials}) == 6
    assert all(t.user_attrs["state"] == "done" for t in trials)
    # Each problem was tuned by one worker only: one study, one run folder, each.
    assert len(problem_studies(runs)) == 6
    assert len([d for d in runs.iterdir() if (d / "best.json").exists()]) == 6
    assert "6 of 6 problems finished, 6 with a winner" in out


CLAIM_RACE = """
import sys
from pathlib import Path
from autotune.drivers.sweep import SweepQueue, load_sweep
queue = SweepQueue(sys.argv[1], load_sweep(Path(sys.argv[2])))
while (claimed := queue.claim()) is not None:
    queue.finish(claimed[0], {"state": "done", "tokens_per_sec": 1.0})
"""


def test_workers_racing_for_the_queue_never_claim_one_problem_twice(tmp_path):
    """Four processes doing nothing but claim and finish, on one SQLite file: each problem's trial is
    claimed once. Without BEGIN IMMEDIATE two processes both read WAITING and both claim (measured:
    48 problems gave 52-53 trials in 3 of 3 runs); a duplicate claim shows as an extra trial."""
    matrix = MATRIX.replace('["tiny-llama", "micro-llama"]', '["tiny-llama", "micro-llama", "llama-7b", "llama-13b"]')
    sweep = write_sweep(tmp_path, "race", matrix.replace("[2, 4, 8]", "[1, 2, 4, 8, 16, 32]"))
    runs = tmp_path / "runs"
    runs.mkdir()
    url = f"sqlite:///{runs / STUDY_DB}"
    workers = [subprocess.Popen([sys.executable, "-c", CLAIM_RACE, url, str(sweep)], stderr=subprocess.PIPE,
                                text=True) for _ in range(4)]
    for worker in workers:
        _, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err
    trials = sweep_study(runs, "race").get_trials()
    assert len({t.user_attrs["problem"] for t in trials}) == 24
    assert len(trials) == 24, "a problem was claimed by two workers"
    assert all(t.state == TrialState.COMPLETE for t in trials)


@pytest.mark.slow
def test_a_killed_workers_problem_is_retried_by_another(tmp_path):
    """SIGKILL a worker mid-problem: its heartbeat stops, another worker fails the stale trial,
    Optuna's retry callback queues it again, and the other worker finishes it."""
    runs = tmp_path / "runs"
    sweep = write_sweep(tmp_path, "killed", MATRIX.replace('"analytic"', '"sim"')
                        .replace('["tiny-llama", "micro-llama"]', '["micro-llama"]').replace("[2, 4, 8]", "[2]"))
    first = autotune("sweep", str(sweep), "--runs-dir", str(runs), "--heartbeat", "1")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if sweep_study(runs, "killed").get_trials(states=(TrialState.RUNNING,)):
                    break
            except (KeyError, Exception):  # the database or the study does not exist yet
                pass
            time.sleep(0.2)
        else:
            pytest.fail("the first worker never claimed the problem")
        first.send_signal(signal.SIGKILL)
        first.communicate()
    finally:
        if first.poll() is None:
            first.kill()
    second = autotune("sweep", str(sweep), "--runs-dir", str(runs), "--heartbeat", "1")
    _, err = second.communicate(timeout=300)
    assert second.returncode == 0, err
    trials = sweep_study(runs, "killed").get_trials()
    assert sorted(t.state.name for t in trials) == ["COMPLETE", "FAIL"]
    retried = next(t for t in trials if t.state == TrialState.COMPLETE)
    assert retried.system_attrs["failed_trial"] == next(t for t in trials if t.state == TrialState.FAIL).number
    assert retried.user_attrs["state"] == "done"


def test_regress_finds_nothing_between_two_identical_nights_then_the_drop_of_a_cut_short_night(tmp_path, capsys):
    runs = tmp_path / "runs"
    matrix = MATRIX.replace('["tiny-llama", "micro-llama"]', '["tiny-llama"]').replace("[2, 4, 8]", "[2, 4]")
    for night in ("night-1", "night-2"):
        assert main(["sweep", str(write_sweep(tmp_path, night, matrix)), "--runs-dir", str(runs)]) == 0
    capsys.readouterr()
    assert main(["regress", "night-2", "--runs-dir", str(runs)]) == 0  # its baseline found by matrix
    assert "night-2 against night-1: no regression" in capsys.readouterr().out
    # A night allowed one trial per problem stops at micro-batch 1: a slower winner, another config.
    short = write_sweep(tmp_path, "night-3", matrix + "[options]\nmax_trials = 1\n")
    assert main(["sweep", str(short), "--runs-dir", str(runs)]) == 0
    assert main(["regress", "night-3", "--baseline", "night-2", "--runs-dir", str(runs)]) == EXIT_REGRESSION
    report = json.loads((runs / "regress" / "regress-night-3.json").read_text())
    problems = {t.user_attrs["problem"] for t in sweep_study(runs, "night-2").get_trials()}
    kinds = {(f["problem"], f["kind"]) for f in report["findings"] if f["regression"]}
    assert kinds == {(p, k) for p in problems for k in ("throughput", "config")}
    drops = [f["detail"] for f in report["findings"] if f["kind"] == "throughput"]
    assert all("estimated -> estimated" in d for d in drops), drops  # each figure with its source
    assert all("micro_batch_size" in f["detail"] for f in report["findings"] if f["kind"] == "config")
    assert "REGRESSION" in capsys.readouterr().out
    assert (runs / "regress" / "regress-night-3.html").read_text().count("<tr class=bad>") == 4
    assert main(["regress", "night-0", "--runs-dir", str(runs)]) == 2
    assert "no sweep named 'night-0'" in capsys.readouterr().err


def test_bad_sweep_files_are_one_line_usage_errors(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[matrix]\nmodel = ["tiny-llama"]\ngpus = [2]\nglobal_tokens = ["64K"]\nbatch = [1]\n')
    assert main(["sweep", str(bad), "--runs-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'batch'" in err and len(err.strip().splitlines()) == 1
    assert main(["sweep", str(tmp_path / "missing.toml")]) == 2
    assert "cannot read sweep file" in capsys.readouterr().err
    assert main(["regress", "never-ran", "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "cannot open storage" in capsys.readouterr().err  # no database there yet


def _one_model_sweep(tmp_path: Path, name: str, keys: str) -> dict[str, dict]:
    """A sweep of tiny-llama on 2 GPUs with the matrix `keys` added: each problem's result, by its key's last part."""
    runs = tmp_path / "runs"
    matrix = MATRIX.replace('["tiny-llama", "micro-llama"]', '["tiny-llama"]').replace("[2, 4, 8]", "[2]") + keys
    assert main(["sweep", str(write_sweep(tmp_path, name, matrix)), "--runs-dir", str(runs)]) == 0
    results = {t.user_attrs["problem"]: t.user_attrs for t in sweep_study(runs, name).get_trials()}
    return {key.rsplit("/", 1)[-1]: json.loads(Path(attrs["result_file"]).read_text()) for key, attrs in results.items()}


def test_a_matrix_can_vary_the_workload(tmp_path):
    """SFT and GRPO (vLLM colocated) in one sweep; vLLM's share applies to the GRPO problems only."""
    documents = _one_model_sweep(tmp_path, "grpo", 'workload = ["sft", "grpo"]\nvllm_gpu_memory_utilization = [0.3, 0.5]\n')
    assert len(documents) == 3  # sft once, grpo at 0.3 and 0.5
    sft, share_03, share_05 = documents["analytic"], documents["grpo-0.3"], documents["grpo-0.5"]
    assert share_05["workload"]["vllm_gpu_memory_utilization"] == 0.5
    # Training's limit: what vLLM leaves, less the headroom (against the SFT run's limit).
    assert share_05["memory_limit_bytes"] == pytest.approx(sft["memory_limit_bytes"] * 0.5, rel=1e-6)
    assert share_03["memory_limit_bytes"] == pytest.approx(sft["memory_limit_bytes"] * 0.7, rel=1e-6)


def test_a_matrix_can_vary_the_attention(tmp_path):
    """--attention per cell: each problem tuned with its own (best.json says which), keyed apart."""
    documents = _one_model_sweep(tmp_path, "attention", 'attention = ["sdpa", "eager"]\n')
    assert set(documents) == {"attention-sdpa", "attention-eager"}
    for attention, document in documents.items():
        assert document["model"]["attention_implementation"] == attention.removeprefix("attention-")

