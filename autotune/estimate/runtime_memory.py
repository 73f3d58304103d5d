"""GPU memory that is not the traced tensors, term by term, each with what determines it.

The simulator predicts the tensor peak exactly (what `torch.cuda.max_memory_allocated` reads,
less the allocator's own workspaces). A real process also holds:

    outside the caching allocator (device-level usage only: nvidia-smi, mem_get_info)
      cuda_context       the CUDA context and the kernels loaded into it (torch, cuBLAS, ...)
      nccl               NCCL communicators: their kernels, state and channel buffers
      symmetric_memory   async TP's workspace (torch's symmetric-memory allocator), where async TP is on
    inside the caching allocator (counted in max_memory_reserved)
      cublas_workspace   cuBLAS/cuBLASLt workspaces, allocated by the caching allocator but
                         made by no traced op
      fragmentation      reserved but unallocated memory at the peak, set by the allocator
                         configuration (PYTORCH_CUDA_ALLOC_CONF)

Each term is `estimated` from what determines it (world size, process groups, NCCL and
allocator settings from the environment) with its source; the figures measured on a GPU by
`benchmarks/gpu_check.py` (and `measure_outside_allocator` in real trials) are named as such.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from autotune.problem.catalog.gpus import GPUSpec

MiB = 2**20
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
RECOMMENDED_ALLOC_CONF = "expandable_segments:True"
"""What trials run with and exports pin unless the user's environment sets another value:
expandable segments grow one mapping per stream instead of caching fixed-size segments, so
reserved memory stays close to allocated (PyTorch's CUDA semantics notes, "Optimizing memory
usage with PYTORCH_CUDA_ALLOC_CONF"); every catalog stack runs on a torch that has it."""

# --- measured on a GPU (benchmarks/gpu_check.py; docs/BENCHMARKS.md) -----------------------------
MEASURED_ON = ("NVIDIA H100 80GB HBM3, driver 580.159.04, torch 2.11.0+cu130, CUDA_MODULE_LOADING=LAZY, "
               "2026-11-22 (benchmarks/gpu_check.py)")
CUDA_CONTEXT_BYTES = 677 * MiB
"""The CUDA context (527 MiB as created) plus the kernels a training step loads lazily into it
(cuBLAS 68 MiB at the first bf16 matmul, attention, loss and optimizer kernels 82 MiB more):
measured on MEASURED_ON, outside the allocator, after NCCL's share is taken off. Where: one H100, world
size 1; applied to every GPU and world size. Checked against the context that calibrations on other H100 VMs
and an H200 measured (tests/test_runtime_memory.py::test_runtime_terms_against_recorded_calibrations)."""
NCCL_COMMUNICATOR_BASE_BYTES = 654 * MiB
"""One NCCL communicator of one rank, eagerly initialised (init_process_group(device_id=...)):
its kernels and state, measured on MEASURED_ON with world size 1 (no peers, so no channel
buffers); more ranks add the channel buffers below, which are EXTRAPOLATED from NCCL's documented
defaults: no communicator has been measured at world size >= 2 (no multi-GPU machine was lent).
Checked at world size 1 against other H100 VMs' and an H200's calibrations (tests/test_runtime_memory.py)."""
CUBLAS_WORKSPACE_BYTES = 32 * MiB
"""torch's default cuBLAS workspace on Hopper (CUBLAS_WORKSPACE_CONFIG=:4096:8, aten
CublasHandlePool.cpp), allocated by the caching allocator once per stream that runs matmuls:
measured 32 MiB after one bf16 matmul on MEASURED_ON (world size 1); every recorded calibration (H100 VMs, an
H200) measured the same."""
CUBLAS_WORKSPACE_STREAMS = 2
"""Workspaces an FSDP2 training step leaves allocated: 65-66 MiB stayed allocated after every
trial on MEASURED_ON at world size 1 (two streams' workspaces); not checked elsewhere."""
@dataclass(frozen=True)
class FragmentationRule:
    """Reserved-but-unallocated memory at the peak for one allocator setting: the larger of
    (of_largest x the step's largest single allocation + of_root_shard x the root FSDP unit's
    fp32 parameter shard) and of_peak x the tensor peak."""

    of_largest: float
    of_root_shard: float
    of_peak: float
    basis: str


FRAGMENTATION = {
    "expandable_segments": FragmentationRule(
        0.521, 1.111, 0.0,
        "a least-squares fit, no intercept, to 14 configurations of two tied-embedding models at seq 1024 "
        "(qwen2.5-0.5b and llama3.2-1b, world size 1; every row within 80 MiB of its gap); checked out of "
        "sample at seq 2048 on qwen2.5-0.5b and qwen2.5-1.5b (docs/BENCHMARKS.md, GPU check)"),
    "default": FragmentationRule(
        1.0, 0.0, 0.12,
        "the gap was 0.87-1.58x the largest allocation over seven qwen2.5-0.5b configurations; 12% of the "
        "peak is the median over a tiny-llama tune (one H100, world size 1)"),
}
"""By allocator setting, measured on MEASURED_ON. With expandable segments the gap is about half the
largest allocation (the fp32 logits: at the loss the logits and their gradient are made while the
bf16 logits' hole is too small for either, so the mapped segment grows past it) plus about the
root unit's fp32 shard (the embedding's gradient and optimizer update likewise). Not measured at
world size > 1: the root term is taken per shard there, as the tensors it follows are."""

# --- NCCL channel buffers (estimated from NCCL's documented defaults) -------------------------------
NCCL_BUFFSIZE_DEFAULT = 4 * MiB
"""NCCL_BUFFSIZE default (NCCL docs, Environment Variables): per channel, per peer, per direction. The
channel-buffer term these three make is extrapolated, never measured (only world size 1 was)."""
NCCL_CHANNELS_DEFAULT = {"intra": 32, "inter": 16}
"""Channels NCCL opens for ring collectives on NVLink/NVSwitch nodes and across InfiniBand
(NCCL_MAX_NCHANNELS caps both); the counts NCCL's init log reports on DGX H100 systems."""
NCCL_RING_PEERS = 2
"""A ring channel connects each rank to its previous and next rank, whatever the world size."""


@dataclass(frozen=True)
class MemoryTerm:
    name: str
    bytes: int
    source: str  # "estimated" | "measured"
    basis: str
    in_allocator: bool  # counted in torch.cuda.max_memory_reserved

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RuntimeMemory:
    """The runtime terms of one process, and the allocator setting they assume."""

    terms: tuple[MemoryTerm, ...]
    alloc_conf: str

    @property
    def total_bytes(self) -> int:
        return sum(term.bytes for term in self.terms)

    @property
    def in_allocator_bytes(self) -> int:
        return sum(term.bytes for term in self.terms if term.in_allocator)

    @property
    def outside_allocator_bytes(self) -> int:
        return sum(term.bytes for term in self.terms if not term.in_allocator)

    @property
    def source(self) -> str:
        return "measured" if self.terms and all(t.source == "measured" for t in self.terms) else "estimated"

    def describe(self) -> str:
        from autotune.util.units import format_bytes

        return " + ".join(f"{term.name} {format_bytes(term.bytes)}" for term in self.terms if term.bytes)

    def to_dict(self) -> dict[str, Any]:
        return dict(total_bytes=self.total_bytes, source=self.source, alloc_conf=self.alloc_conf,
                    in_allocator_bytes=self.in_allocator_bytes,
                    outside_allocator_bytes=self.outside_allocator_bytes,
                    terms=[term.to_dict() for term in self.terms])


def alloc_conf(environ: Mapping[str, str] | None = None) -> str:
    """The allocator setting trials run with and exports pin: the user's, else the recommended."""
    environ = os.environ if environ is None else environ
    return environ.get(ALLOC_CONF_ENV) or RECOMMENDED_ALLOC_CONF


def expandable_segments(conf: str) -> bool:
    options = dict(part.split(":", 1) for part in conf.replace(" ", "").split(",") if ":" in part)
    return options.get("expandable_segments", "False").lower() == "true"


def cublas_workspace_bytes(environ: Mapping[str, str]) -> tuple[int, str]:
    """One workspace's size from CUBLAS_WORKSPACE_CONFIG (':SIZE_KiB:COUNT' pairs), else the default."""
    config = environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    parts = [p for p in config.split(":") if p]
    if len(parts) >= 2 and all(p.isdigit() for p in parts) and len(parts) % 2 == 0:
        size = sum(int(kib) * 1024 * int(count) for kib, count in zip(parts[::2], parts[1::2]))
        return size, f"CUBLAS_WORKSPACE_CONFIG={config}"
    return CUBLAS_WORKSPACE_BYTES, "torch's default on Hopper (CUBLAS_WORKSPACE_CONFIG unset)"


def nccl_communicator_bytes(*, ranks: int, inter_node: bool, environ: Mapping[str, str]) -> tuple[int, str]:
    """One communicator's device memory on one rank: its base plus ring channel buffers."""
    if ranks <= 1:
        return NCCL_COMMUNICATOR_BASE_BYTES, "world size 1: base only (measured)"
    buffsize = int(environ.get("NCCL_BUFFSIZE") or NCCL_BUFFSIZE_DEFAULT)
    channels = NCCL_CHANNELS_DEFAULT["inter" if inter_node else "intra"]
    cap = environ.get("NCCL_MAX_NCHANNELS") or environ.get("NCCL_MAX_CTAS")
    if cap and cap.isdigit():
        channels = min(channels, int(cap))
    buffers = buffsize * channels * NCCL_RING_PEERS * 2  # send and receive
    return NCCL_COMMUNICATOR_BASE_BYTES + buffers, (
        f"base (measured, world size 1) + {channels} channels x {NCCL_RING_PEERS} ring peers x "
        f"send/recv x NCCL_BUFFSIZE {buffsize // MiB} MiB (extrapolated from NCCL's defaults: never measured at world "
        "size >= 2)")


def async_tp_workspace_bytes(*, tokens_per_microbatch: int, hidden_size: int, tensor_parallel: int,
                             activation_bytes: int) -> int:
    """The symmetric-memory workspace async TP keeps on each GPU: torch.distributed._symmetric_memory's
    get_symm_mem_workspace holds one per tensor-parallel group, grown to the largest request and kept. A fused
    matmul -> reduce-scatter asks for two of its output's per-rank chunks (_pipelined_produce_and_all2all), an
    all-gather -> matmul for its input's shard (_pipelined_multi_all_gather_and_consume); a block's largest is the
    reduce-scatter's: 2 x tokens / tp x hidden in the compute dtype (tests/test_async_tp.py asks torch's own
    functions). Allocated outside the caching allocator (cuMem, mapped by every rank of the group)."""
    return 2 * (tokens_per_microbatch // tensor_parallel) * hidden_size * activation_bytes


def runtime_memory(gpu: GPUSpec, *, world_size: int, gpus_per_node: int, tensor_peak_bytes: int,
                   largest_allocation_bytes: int = 0, root_shard_bytes: int = 0, offload_staging_bytes: int = 0,
                   communicators: int = 1, symmetric_memory_bytes: int = 0,
                   environ: Mapping[str, str] | None = None, calibrated=None) -> RuntimeMemory:
    """The runtime terms of one rank of a job. `largest_allocation_bytes` is the step's largest
    single tensor (the simulator traces it); `root_shard_bytes` the root FSDP unit's fp32
    parameters on this rank (embeddings, final norm, an untied LM head); `communicators` is the number of NCCL process
    groups the configuration creates (1 for a 1-D mesh over the whole world; HSDP's shard and
    replicate groups add one each). `offload_staging_bytes`: with CPU offload, the root's fp32
    shard copied up at the start of forward; without expandable segments its cached block is
    a size nothing else reuses (measured: +0.58 GB of gap for a 0.55 GB staging copy).
    `symmetric_memory_bytes`: async TP's workspace (async_tp_workspace_bytes), 0 without async TP."""
    if world_size < 1 or gpus_per_node < 1 or tensor_peak_bytes < 0 or communicators < 1:
        raise ValueError("world_size, gpus_per_node and communicators must be >= 1 and tensor_peak_bytes >= 0")
    environ = os.environ if environ is None else environ
    conf = alloc_conf(environ)
    measured_part = f"measured on {MEASURED_ON}; applied to {gpu.name}" if gpu.name != "h100-80gb" else \
        f"measured on {MEASURED_ON}"
    per_comm, comm_basis = nccl_communicator_bytes(ranks=world_size, inter_node=world_size > gpus_per_node,
                                                   environ=environ)
    workspace, workspace_basis = cublas_workspace_bytes(environ)
    setting = "expandable_segments" if expandable_segments(conf) else "default"
    rule = FRAGMENTATION[setting]
    fragmentation = int(max(rule.of_largest * largest_allocation_bytes + rule.of_root_shard * root_shard_bytes,
                            rule.of_peak * tensor_peak_bytes))
    staging_note = ""
    if setting == "default" and offload_staging_bytes:
        fragmentation += offload_staging_bytes
        staging_note = f", + the cached offload staging block ({offload_staging_bytes // MiB} MiB)"
    terms = (
        MemoryTerm("cuda_context", CUDA_CONTEXT_BYTES, "estimated",
                   f"CUDA context + lazily loaded kernels, {measured_part}", in_allocator=False),
        MemoryTerm("nccl", per_comm * communicators, "estimated",
                   f"{communicators} NCCL communicator(s) of {world_size} ranks: {comm_basis}", in_allocator=False),
        MemoryTerm("cublas_workspace", workspace * CUBLAS_WORKSPACE_STREAMS, "estimated",
                   f"{CUBLAS_WORKSPACE_STREAMS} streams x {workspace // MiB} MiB ({workspace_basis})",
                   in_allocator=True),
        MemoryTerm("fragmentation", fragmentation, "estimated",
                   f"the larger of {rule.of_largest:g}x the largest allocation ({largest_allocation_bytes // MiB} MiB)"
                   f" + {rule.of_root_shard:g}x the root unit's fp32 shard ({root_shard_bytes // MiB} MiB) and "
                   f"{rule.of_peak:.0%} of the tensor peak{staging_note}, with {ALLOC_CONF_ENV}={conf} "
                   f"({measured_part}; {rule.basis})",
                   in_allocator=True),
    )
    if symmetric_memory_bytes:
        terms += (MemoryTerm("symmetric_memory", symmetric_memory_bytes, "estimated",
                             "async TP's symmetric-memory workspace: two per-rank chunks of a fused matmul -> "
                             "reduce-scatter's output (torch.distributed._symmetric_memory.get_symm_mem_workspace; "
                             "not measured on a GPU)", in_allocator=False),)
    if calibrated is not None:
        terms = _calibrated_terms(terms, calibrated, world_size=world_size, communicators=communicators)
    return RuntimeMemory(terms=terms, alloc_conf=conf)


def _calibrated_terms(terms, profile, *, world_size: int, communicators: int) -> tuple[MemoryTerm, ...]:
    """Replace the context, NCCL and cuBLAS terms by what `autotune calibrate --backend cuda`
    measured (a calibrated cuda profile, autotune/estimate/hardware.py); the others stay estimates."""
    where = f"calibrated profile {profile.name}, {profile.date[:10]}"
    ranks = profile.machine.get("calibrated_world_size") or profile.versions.get("world_size")
    out = []
    for term in terms:
        if term.name == "cuda_context" and profile.get("cuda_context_bytes") is not None:
            term = MemoryTerm("cuda_context", int(profile["cuda_context_bytes"]), "measured",
                              f"mem_get_info around CUDA initialisation ({where})", in_allocator=False)
        elif term.name == "nccl" and profile.get("nccl_communicator_bytes") is not None:
            same = ranks is None or int(ranks) == world_size
            term = MemoryTerm("nccl", int(profile["nccl_communicator_bytes"]) * communicators,
                              "measured" if same else "estimated",
                              f"{communicators} communicator(s) x the memory after the first all-gather and "
                              f"reduce-scatter at world size {ranks or '?'} ({where})"
                              + ("" if same else f"; this job has {world_size} ranks"), in_allocator=False)
        elif term.name == "cublas_workspace" and profile.get("cublas_workspace_bytes") is not None:
            term = MemoryTerm("cublas_workspace", int(profile["cublas_workspace_bytes"]) * CUBLAS_WORKSPACE_STREAMS,
                              "measured", f"{CUBLAS_WORKSPACE_STREAMS} streams x the workspace of the first bf16 "
                              f"matmul ({where})", in_allocator=True)
        out.append(term)
    return tuple(out)


def measure_outside_allocator(device) -> dict[str, int]:
    """Device memory in use by this process outside the caching allocator (context, kernels,
    NCCL), read from the driver: (total - free) - reserved. Exact for a GPU this process has
    to itself; another process on the same GPU is counted too."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return dict(total_bytes=int(total), used_bytes=int(total - free), reserved_bytes=int(reserved),
                outside_allocator_bytes=int(total - free - reserved))


def measure_runtime_terms(device_index: int = 0) -> dict[str, Any]:
    """Measure this GPU's runtime terms in a fresh process (call it first thing: the context is
    measured as it is created): the context, the cuBLAS kernels and workspace a bf16 matmul
    loads and allocates, and one NCCL communicator of world size 1 eagerly initialised, with
    FSDP2's collectives run once. For `autotune calibrate` and benchmarks/gpu_check.py."""
    import socket

    import torch
    import torch.distributed as dist

    device = torch.device("cuda", device_index)
    torch.cuda.set_device(device)
    free, total = torch.cuda.mem_get_info(device)  # creates the context
    context = total - free - torch.cuda.memory_reserved(device)
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
    b = a @ a
    torch.cuda.synchronize(device)
    workspace = torch.cuda.memory_allocated(device) - a.nbytes - b.nbytes
    del a, b
    after_matmul = measure_outside_allocator(device)["outside_allocator_bytes"]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", device_id=device)
    shard = torch.ones(2**20, device=device)
    full = torch.empty(2**20, device=device)
    dist.all_gather_into_tensor(full, shard)
    dist.reduce_scatter_tensor(shard, full)
    torch.cuda.synchronize(device)
    after_nccl = measure_outside_allocator(device)["outside_allocator_bytes"]
    dist.destroy_process_group()
    return dict(device=torch.cuda.get_device_name(device), torch=torch.__version__,
                cuda=torch.version.cuda, total_bytes=int(total), context_bytes=int(context),
                cublas_kernels_bytes=int(after_matmul - context), cublas_workspace_bytes=int(workspace),
                nccl_world1_bytes=int(after_nccl - after_matmul),
                module_loading=os.environ.get("CUDA_MODULE_LOADING", "LAZY (default)"))
