"""Real 2-rank gloo trials of micro-llama on CPUs: fit, OOM via the capacity, hang, crash,
persistent mode. Every launching test checks that no trial process is left behind."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from autotune.backends.real import FAULT_ENV, RealBackend, parse_faults
from autotune.backends.real._backend import host_memory_available_bytes
from autotune.backends.real._faults import Fault
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec
from autotune.util.errors import UsageError

pytestmark = pytest.mark.slow

MODEL = resolve_model("micro-llama")
WORLD = 2
# Counted from the trial's start: longer than building micro-llama on 2 busy cores (~5 s).
HANG_TIMEOUT_S = 10.0


def make_spec(*, limit: int | None = None, **train) -> TrialSpec:
    return TrialSpec(model=MODEL, cluster=Cluster(num_gpus=WORLD), seq_len=64,
                     train=TrainConfig(micro_batch_size=2, **train), memory_limit_bytes=limit)


def leftover_trial_processes(log_dir: Path) -> list[str]:
    """Trial processes still alive: children of this test process, and any process of a launch
    under `log_dir` (torchrun and its workers name their job file on the command line)."""
    import psutil

    found = [f"{p.pid} {p.name()}" for p in psutil.Process().children(recursive=True)
             if p.status() != psutil.STATUS_ZOMBIE]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "autotune.backends.real" in cmdline and str(log_dir) in cmdline:
            found.append(f"{pid} {cmdline[:120]}")
    return found


@pytest.fixture(autouse=True)
def no_fault_env(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)


@pytest.fixture(scope="module")
def single_result(tmp_path_factory):
    """One fitting trial in a launch of its own (shared by the fit and persistence tests)."""
    log_dir = tmp_path_factory.mktemp("single")
    with RealBackend(device="cpu", persistent=False, timed_steps=1, log_dir=log_dir) as backend:
        result = backend.evaluate(make_spec())
        assert backend.launches == 1
    assert leftover_trial_processes(log_dir) == []
    return result


def test_fitting_trial_has_plausible_measured_figures(single_result):
    result = single_result
    assert result.status == "ok", result.message
    param_bytes = MODEL.num_parameters * 4  # fp32 master parameters, sharded over the ranks
    assert result.extras["tensor_peak_bytes"] > param_bytes / WORLD
    assert result.peak_memory.value == result.extras["tensor_peak_bytes"]
    assert result.peak_memory.source == "measured" and "gloo ranks" in result.peak_memory.basis
    assert result.tokens_per_sec.value > 0 and result.tokens_per_sec.source == "measured"
    assert 0 < result.extras["loss"] < 20  # ln(vocab 512) = 6.2 at initialisation
    assert result.extras["rss_peak_bytes"] > result.extras["tensor_peak_bytes"]
    assert result.host_memory_per_node.value >= WORLD * 100 * 2**20
    assert result.memory_breakdown["parameters"] > 0 and result.memory_breakdown["optimizer_state"] > 0
    assert sum(result.memory_breakdown.values()) == result.extras["tensor_peak_bytes"]
    assert result.extras["mfu"] is None  # no accelerator peak to compare with on CPUs


def test_persistent_mode_one_launch_continues_after_oom(single_result, tmp_path):
    """A (one evaluate call), then A with full AC and an OOM via the capacity (one
    evaluate_many call) share one launch; the OOM ends it and the last spec runs in a fresh
    launch, with the same figures as the launch of its own."""
    fitting = single_result
    tight = fitting.extras["tensor_peak_bytes"] // 2
    with RealBackend(device="cpu", persistent=True, timed_steps=1, log_dir=tmp_path) as backend:
        first = backend.evaluate(make_spec())
        checkpointed, fp16_accum, oom, after = backend.evaluate_many(
            [make_spec(activation_checkpointing="full"),
             replace(make_spec(precision="fp16"), grad_accum_steps=4),
             make_spec(limit=tight), make_spec()])
        assert backend.launches == 2
    results = (first, checkpointed, fp16_accum, oom, after)
    assert [r.extras["launch"] for r in results] == [0, 0, 0, 0, 1]
    assert [r.status for r in results] == ["ok", "ok", "ok", "oom", "ok"], [r.message for r in results]
    # fp16 with a loss scaler, two micro-batches per step (MemTracker reset before each forward).
    assert fp16_accum.extras["grad_accum_run"] == 2 and "2 of 4 micro-batches" in fp16_accum.message
    assert 0 < fp16_accum.extras["loss"] < 20
    assert "OutOfMemoryError" in oom.message and f"{tight:,}" in oom.message
    # Deterministic figures: the same in a shared launch, a fresh launch and a launch of its own.
    for result in (first, after):
        assert result.extras["tensor_peak_bytes"] == fitting.extras["tensor_peak_bytes"]
        assert result.extras["loss"] == pytest.approx(fitting.extras["loss"], rel=1e-6)
    assert checkpointed.extras["tensor_peak_bytes"] < first.extras["tensor_peak_bytes"]
    assert checkpointed.extras["loss"] == pytest.approx(first.extras["loss"], rel=1e-4)
    assert leftover_trial_processes(tmp_path) == []


def test_hang_is_ended_by_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "hang:rank=1")
    with RealBackend(device="cpu", timeout_s=HANG_TIMEOUT_S, timed_steps=1, log_dir=tmp_path) as backend:
        result = backend.evaluate(make_spec())
    assert result.status == "timeout", result.message
    assert f"{HANG_TIMEOUT_S:.0f} s" in result.message
    assert leftover_trial_processes(tmp_path) == []


def test_crashing_rank_is_an_error_with_its_stderr(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "crash:rank=1")
    with RealBackend(device="cpu", timeout_s=120, timed_steps=1, log_dir=tmp_path) as backend:
        result = backend.evaluate(make_spec())
    assert result.status == "error"
    assert result.extras["failed_rank"] == 1
    assert "rank 1 exited with code 70" in result.message
    assert "autotune fault injection: crash on rank 1" in result.message  # from its stderr log
    assert leftover_trial_processes(tmp_path) == []


def test_fault_specs_parse_and_reject_typos():
    assert parse_faults("hang:rank=1, oom:trial=2") == [Fault(kind="hang", rank=1), Fault(kind="oom", trial=2)]
    assert parse_faults("") == []
    with pytest.raises(ValueError, match="hung"):
        parse_faults("hung:rank=1")
    with pytest.raises(ValueError, match="rank=x"):
        parse_faults("crash:rank=x")


def test_bad_backend_options_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="rdzv-endpoint"):
        RealBackend(device="cpu", nnodes=2, log_dir=tmp_path)
    with pytest.raises(UsageError, match="timed steps"):
        RealBackend(device="cpu", timed_steps=0, log_dir=tmp_path)


def test_host_memory_is_read_from_proc_meminfo():
    import psutil

    available = host_memory_available_bytes()
    assert available == pytest.approx(psutil.virtual_memory().available, rel=0.2)


def test_cpu_backend_refuses_a_model_too_big_for_this_host(tmp_path):
    pytest.importorskip("autotune.backends.sim", reason="the simulator backend is not in this tree yet")
    spec = TrialSpec(model=resolve_model("llama-70b"), cluster=Cluster(num_gpus=WORLD), seq_len=512,
                     train=TrainConfig(micro_batch_size=1))
    with RealBackend(device="cpu", log_dir=tmp_path) as backend:
        result = backend.evaluate(spec)
        assert backend.launches == 0
    assert result.status == "error" and "refused before launch" in result.message
    assert result.host_memory_per_node.source == "predicted"
    assert result.host_memory_per_node.value > host_memory_available_bytes()


def test_cpu_backend_refuses_offload_rather_than_measure_a_different_configuration(tmp_path):
    """FSDP2's CPUOffloadPolicy needs an accelerator: a cpu trial asked for offload is not launched
    (it would measure the run without offload under the offload configuration's name)."""
    with RealBackend(device="cpu", log_dir=tmp_path) as backend:
        result = backend.evaluate(make_spec(cpu_offload=True))
        assert backend.launches == 0
    assert result.status == "error" and "CPU offload cannot run on the cpu backend" in result.message
    assert result.extras["refused"] and result.tokens_per_sec is None


def test_short_trial_times_the_optimizer_apart_and_counts_the_jobs_accumulation(tmp_path):
    """A trial runs 2 of the job's 16 micro-batches per step: the step time it reports is the
    first micro-batch as measured, 15 more at the second's measured time, plus the optimizer step,
    timed on its own."""
    spec = replace(make_spec(), grad_accum_steps=16)
    with RealBackend(device="cpu", persistent=False, timed_steps=2, log_dir=tmp_path) as backend:
        result = backend.evaluate(spec)
    assert result.status == "ok", result.message
    extras = result.extras
    assert extras["grad_accum_run"] == 2 and extras["optimizer_step_s"] > 0
    measured_step = max(sum(times) / len(times) for times in extras["step_times_s"])  # 2 micro-batches
    assert extras["step_seconds"] > 4 * measured_step - extras["optimizer_step_s"] * 4
    assert extras["step_seconds"] > measured_step
    tokens_per_step = WORLD * 16 * spec.train.micro_batch_size * spec.seq_len
    assert result.tokens_per_sec.value == pytest.approx(tokens_per_step / extras["step_seconds"])
    assert "16 micro-batches" in result.message


def test_a_jobs_later_micro_batches_count_at_the_later_ones_time():
    """Under CPU offload the first micro-batch of a step copies its gradients back without blocking
    and every later one blocks and adds on the host (FSDP2's foreach_reduce), so a 2-micro-batch
    trial times a fast one and a slow one. A 16-micro-batch job runs 1 fast and 15 slow: its step is
    1 + 15 x 3 + the optimizer's 0.5 s = 46.5 s, not the mean x 16 (32.5 s)."""
    from autotune.backends.real._backend import _step_seconds

    rank = dict(grad_accum=2, micro_batches_s=[4.0, 4.0], first_micro_batch_s=[1.0, 1.0],
                optimizer_step_s=[0.5, 0.5], step_times=[4.5, 4.5])
    assert _step_seconds(rank, full_accum=16) == pytest.approx(1 + 15 * 3 + 0.5)
    assert _step_seconds(rank, full_accum=2) == pytest.approx(4.5)  # what the trial ran, as timed
    older = {k: v for k, v in rank.items() if k != "first_micro_batch_s"}  # results written before the split
    assert _step_seconds(older, full_accum=16) == pytest.approx(4.0 * 8 + 0.5)


def test_gpu_check_plumbing_runs_on_cpu(tmp_path):
    """benchmarks/gpu_check.py on 2 gloo ranks: the table, the comparisons and the OOM-agreement
    trials under caps set from the predictions (a real out-of-memory on the capped rank)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    report_path = tmp_path / "check.json"
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                           "--json", str(report_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "PASS" in done.stdout and "configuration" in done.stdout
    report = json.loads(report_path.read_text())
    assert len(report["rows"]) == 3 and all(r["measured_status"] == "ok" for r in report["rows"])
    # The simulator's tensor peak against the gloo run's: exact but for the loss accumulator's
    # scalar, which the trace (one micro-batch, gradients of the rest added) does not hold.
    assert all(abs(r["predicted_tensor"] - r["measured_allocated"]) <= 64 for r in report["rows"])
    statuses = [(r["predicted_status"], r["measured_status"]) for r in report["oom_agreement"]]
    assert ("oom", "oom") in statuses and ("ok", "ok") in statuses and len(statuses) == 4


def test_controller_killed_with_sigkill_leaves_no_trial_processes(tmp_path):
    """SIGKILL cannot be handled: torchrun dies with its controller (PR_SET_PDEATHSIG) and the
    ranks with torchrun, even mid-trial (one rank hangs here), instead of holding devices until
    the collective timeout."""
    import signal
    import subprocess
    import sys
    import time
    import uuid

    from autotune.backends.real._launcher import process_gone

    tag = f"AUTOTUNE_TEST_TAG={uuid.uuid4().hex}".encode()

    def tagged(command_part: bytes = b"") -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if tag in environ and command_part in cmdline and not process_gone(int(pid)):
                found.append(int(pid))
        return found

    # TMPDIR: the killed controller cannot remove its log folder; it is left in tmp_path, not /tmp.
    env = dict(os.environ, **{FAULT_ENV: "hang:rank=1"}, AUTOTUNE_TEST_TAG=tag.split(b"=")[1].decode(),
               TMPDIR=str(tmp_path))
    controller = subprocess.Popen([sys.executable, "-m", "autotune", "trial", "--model", "micro-llama", "--gpus", "2",
                                   "--backend", "cpu", "--timeout", "600", "--micro-batch", "2"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 180
        while len(tagged(b"autotune.backends.real.worker")) < 2 and time.monotonic() < deadline:
            assert controller.poll() is None, "the trial ended before it could be killed"
            time.sleep(0.5)
        assert len(tagged(b"autotune.backends.real.worker")) >= 2, "the ranks never started"
        time.sleep(2)  # both ranks inside the trial (rank 1 hangs, rank 0 waits for it)
    finally:
        controller.send_signal(signal.SIGKILL)
        controller.wait()
    deadline = time.monotonic() + 30
    while tagged() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert tagged() == []
