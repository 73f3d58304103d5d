"""Real trials on CUDA GPUs (NCCL). Skipped where no GPU is visible; the same code path on
CPUs (gloo) is tested for real in tests/test_real.py."""

from __future__ import annotations

import pytest
import torch

from autotune.backends.real import RealBackend
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU; the CPU path is in test_real.py"),
]


def gpu_spec(**train) -> TrialSpec:
    limit = train.pop("limit", None)
    return TrialSpec(model=resolve_model("tiny-llama"), cluster=Cluster(num_gpus=1), seq_len=128,
                     train=TrainConfig(micro_batch_size=2, **train), memory_limit_bytes=limit)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    with RealBackend(device="cuda", timed_steps=2, log_dir=tmp_path_factory.mktemp("gpu")) as real:
        yield real


def test_cuda_trial_measures_reserved_allocated_and_mfu(backend):
    bf16, fp16, offload = backend.evaluate_many(
        [gpu_spec(), gpu_spec(precision="fp16"), gpu_spec(cpu_offload=True)])
    for result in (bf16, fp16, offload):
        assert result.status == "ok", result.message
        assert result.peak_memory.value >= result.extras["allocated_peak_bytes"] > 0
        assert result.extras["tensor_peak_bytes"] == result.extras["allocated_peak_bytes"]
        assert result.peak_memory.basis.startswith("torch.cuda.max_memory_reserved")
        assert 0 < result.extras["mfu"] < 1
        assert 0 < result.extras["loss"] < 20
    # Offloaded parameters and optimizer state leave the GPU.
    assert offload.extras["allocated_peak_bytes"] < bf16.extras["allocated_peak_bytes"]


def test_cuda_trial_over_the_usable_limit_is_oom(backend):
    result = backend.evaluate(gpu_spec(limit=64 * 2**20))
    assert result.status == "oom", result.message


def test_cuda_trial_reports_allocated_reserved_and_device_peaks(backend):
    """One definition of the peak: device-level = reserved + what lives outside the allocator
    (context, NCCL), measured from the driver; the allocator was capped by the trial's limit."""
    result = backend.evaluate(gpu_spec(limit=8 * 2**30))
    assert result.status == "ok", result.message
    extras = result.extras
    assert extras["reserved_peak_bytes"] >= extras["allocated_peak_bytes"] > 0
    assert extras["outside_allocator_bytes"] > 100 * 2**20  # a CUDA context at least
    assert result.peak_memory.value == extras["reserved_peak_bytes"] + extras["outside_allocator_bytes"]
    total = extras["device_capacity_bytes"]
    assert extras["memory_fraction"] == pytest.approx((8 * 2**30 - extras["outside_allocator_bytes"]) / total, rel=0.05)


def test_release_memory_returns_pinned_host_blocks():
    """CPU offload stages through pinned host memory; empty_cache alone keeps those blocks."""
    from autotune.backends.real._trial import release_memory

    def pinned() -> int:
        """Pinned bytes the host allocator holds (its stats where this torch keeps them, else
        this process's resident memory: pinned pages are resident)."""
        stats = torch.cuda.host_memory_stats()
        if stats:
            return int(stats.get("allocated_bytes.current", stats.get("reserved_bytes.current", 0)))
        from autotune.backends.real._capacity import rss_bytes

        return rss_bytes()

    block = torch.empty(64 * 2**20, dtype=torch.uint8).pin_memory()
    del block
    cached = pinned()
    assert cached >= 64 * 2**20, torch.cuda.host_memory_stats()
    release_memory(torch.device("cuda", 0))
    assert pinned() <= cached - 48 * 2**20


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs; the CPU path is in test_real.py")
@pytest.mark.parametrize("fault", ["oom:rank=1", "crash:rank=1"])
def test_cuda_world_two_classifies_one_ranks_fault(tmp_path, monkeypatch, fault):
    monkeypatch.setenv("AUTOTUNE_FAULT", fault)
    spec = TrialSpec(model=resolve_model("tiny-llama"), cluster=Cluster(num_gpus=2), seq_len=128,
                     train=TrainConfig(micro_batch_size=2))
    with RealBackend(device="cuda", timed_steps=1, log_dir=tmp_path) as real:
        result = real.evaluate(spec)
    assert result.status == ("oom" if fault.startswith("oom") else "error"), result.message
    assert result.extras["failed_rank"] == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs; the CPU path is in test_real.py")
def test_cuda_world_two_hang_times_out(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_FAULT", "hang:rank=1")
    spec = TrialSpec(model=resolve_model("tiny-llama"), cluster=Cluster(num_gpus=2), seq_len=128,
                     train=TrainConfig(micro_batch_size=2))
    with RealBackend(device="cuda", timed_steps=1, timeout_s=30, log_dir=tmp_path) as real:
        result = real.evaluate(spec)
    assert result.status == "timeout", result.message
