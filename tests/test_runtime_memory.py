"""GPU memory beyond tensors: the runtime terms' inputs read as their own tools document them,
and out-of-memory errors recognised from the texts torch, NCCL and cuBLAS really produce.
The terms' sizes are checked against the calibrations recorded on other H100 VMs and an H200
(benchmarks/results/*calibrated*.json: world size 1, as the terms were measured); NCCL's channel buffers
at world size >= 2 are extrapolated, never measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autotune.backends.real._launcher import cgroup_oom_kills
from autotune.backends.real.worker import out_of_memory_kind
from autotune.backends.sim._trace import _grouped_query_safe
from autotune.problem.catalog.gpus import GPUS
from autotune.estimate.runtime_memory import (
    RECOMMENDED_ALLOC_CONF, alloc_conf, cublas_workspace_bytes, expandable_segments, runtime_memory,
)

H100 = GPUS["h100-80gb"]
MiB = 2**20


def test_cublas_workspace_config_reads_as_torch_documents_it():
    # torch.use_deterministic_algorithms' docs: ":4096:8" is 8 buffers of 4096 KiB;
    # ":16:8" 8 buffers of 16 KiB; several pairs add up.
    assert cublas_workspace_bytes({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})[0] == 32 * MiB
    assert cublas_workspace_bytes({"CUBLAS_WORKSPACE_CONFIG": ":16:8"})[0] == 128 * 1024
    assert cublas_workspace_bytes({"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"})[0] == 8 * MiB + 128 * 1024
    size, basis = cublas_workspace_bytes({"CUBLAS_WORKSPACE_CONFIG": "nonsense"})
    assert "default" in basis


def test_allocator_setting_is_the_users_else_expandable_segments():
    assert alloc_conf({}) == RECOMMENDED_ALLOC_CONF and expandable_segments(RECOMMENDED_ALLOC_CONF)
    assert alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == "max_split_size_mb:128"
    assert not expandable_segments("max_split_size_mb:128")
    assert expandable_segments("max_split_size_mb:128, expandable_segments:True")
    assert not expandable_segments("expandable_segments:False")


def test_runtime_terms_follow_the_environment_they_name():
    def terms(world: int, per_node: int, **environ) -> dict[str, int]:
        memory = runtime_memory(H100, world_size=world, gpus_per_node=per_node, tensor_peak_bytes=40 * 2**30,
                                largest_allocation_bytes=2 * 2**30, environ=environ)
        assert memory.source == "estimated" and memory.total_bytes == sum(t.bytes for t in memory.terms)
        return {t.name: t.bytes for t in memory.terms}

    alone, eight = terms(1, 1), terms(8, 8)
    assert eight["nccl"] > alone["nccl"]  # peers add channel buffers
    assert terms(8, 8, NCCL_BUFFSIZE=str(2 * MiB))["nccl"] < eight["nccl"]
    assert terms(8, 8, NCCL_MAX_NCHANNELS="4")["nccl"] < eight["nccl"]
    assert terms(8, 8, CUBLAS_WORKSPACE_CONFIG=":16:8")["cublas_workspace"] < eight["cublas_workspace"]
    # Without expandable segments the caching allocator keeps more reserved than allocated.
    default = terms(8, 8, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False")
    assert default["fragmentation"] > eight["fragmentation"] > 0


def test_runtime_terms_against_recorded_calibrations():
    """Each measured runtime term's size against what `autotune calibrate --backend cuda` measured on other
    machines than the one the terms were taken from (runtime_memory.MEASURED_ON: one H100 VM, 2026-11-22):
    five calibrations on H100 VMs of 2026-11-23 and two on an H200 of 2026-11-27, all at world size 1.
    The CUDA context as created (527 MiB in every calibration) is the shipped term less the kernels a step
    loads lazily (150 MiB on MEASURED_ON: cuBLAS 68, the rest 82), so the shipped term lies 100-200 MiB
    above it; one communicator's base within 5%; the cuBLAS workspace per stream exactly. The channel
    buffers of more ranks are extrapolated (no calibration measured world size >= 2) and the basis says so."""
    from autotune.estimate import runtime_memory as rm

    recorded = [json.loads(path.read_text())["figures"]
                for path in sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "results").glob("*.json"))
                if "calibrat" in path.name]
    recorded = [f for f in recorded if "cuda_context_bytes" in f]
    assert len(recorded) >= 6
    for figures in recorded:
        assert 100 * MiB <= rm.CUDA_CONTEXT_BYTES - figures["cuda_context_bytes"]["value"] <= 200 * MiB
        assert abs(rm.NCCL_COMMUNICATOR_BASE_BYTES / figures["nccl_communicator_bytes"]["value"] - 1) <= 0.05
        assert "world size 1" in figures["nccl_communicator_bytes"]["basis"]
        assert figures["cublas_workspace_bytes"]["value"] == 32 * MiB  # written here from the recordings: 32 MiB
    terms = {t.name: t for t in runtime_memory(H100, world_size=8, gpus_per_node=8, tensor_peak_bytes=40 * 2**30,
                                               largest_allocation_bytes=2 * 2**30, environ={}).terms}
    assert "extrapolated" in terms["nccl"].basis and "never measured" in terms["nccl"].basis


def test_out_of_memory_is_recognised_however_it_surfaces():
    with pytest.raises(RuntimeError) as host:  # a real host allocation failure, raised by torch here
        torch.empty(2**62, dtype=torch.uint8)
    assert out_of_memory_kind(host.value) == "host", str(host.value)
    nccl = torch.distributed.DistBackendError(
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled cuda error (run "
        "with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function "
        "failed.\nLast error:\nCuda failure 'out of memory'")
    cublas = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    accelerator = torch.AcceleratorError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
                                         "reported at some other API call, so the stacktrace below might be incorrect.")
    for error in (nccl, cublas, accelerator, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")):
        assert out_of_memory_kind(error) == "device", error
    # A kernel's shared-memory limit (Triton) and ordinary errors are not out of memory.
    assert out_of_memory_kind(RuntimeError("out of resource: shared memory, Required: 262144, "
                                           "Hardware limit: 232448")) is None
    assert out_of_memory_kind(RuntimeError("Expected all tensors to be on the same device")) is None


def test_oom_kill_counter_is_read_from_cgroup_v2_and_v1_files(tmp_path):
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 2\noom 2\noom_kill 3\noom_group_kill 0\n")
    assert cgroup_oom_kills(tmp_path) == 3
    (tmp_path / "memory.events").unlink()
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert cgroup_oom_kills(tmp_path) == 5
    assert cgroup_oom_kills(tmp_path / "missing") is None


def test_sdpa_flops_of_grouped_query_attention_count_the_broadcast_heads():
    """torch < 2.13's SDPA formulas assert equal heads; the wrapper counts GQA as the kernel
    runs it: the FLOPs of key/value broadcast to the query's heads."""
    def strict(query, key, value, *args, out_val=None):
        assert query.shape[1] == key.shape[1] == value.shape[1], "shapes are incompatible"
        b, h, s, d = query.shape
        return 4 * b * h * s * key.shape[2] * d

    q = torch.empty(2, 14, 128, 64, device="meta")
    kv = torch.empty(2, 2, 128, 64, device="meta")
    full = torch.empty(2, 14, 128, 64, device="meta")
    assert _grouped_query_safe(strict)(q, kv, kv) == strict(q, full, full) == 4 * 2 * 14 * 128 * 128 * 64
