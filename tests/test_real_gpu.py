"""Real trials on CUDA GPUs (NCCL). Skipped where no GPU is visible; the same code path on
CPUs (gloo) is tested for real in tests/test_real.py."""

from __future__ import annotations

import pytest
import torch

from autotune.backends.real import RealBackend
from autotune.catalog.models import resolve_model
from autotune.config import Cluster, TrainConfig, TrialSpec

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
