"""Hardware profiles: the numbers the step-time model (autotune/estimate/costmodel.py) runs on.

A profile is JSON: the machine it describes, the software versions and date it was made, and
each figure with its value, unit, source and basis:

    {"schema": "autotune-hardware/1", "name": "h100-80gb", "device": "cuda", "gpu": "h100-80gb",
     "calibrated": false, "date": "...", "machine": {...}, "versions": {...},
     "figures": {"matmul_tflops": {"value": 415.4, "unit": "TFLOP/s", "source": "published run",
                                   "basis": "..."}, ...}}

`source` is one of `data sheet` (the vendor's nominal figure, times a stated fraction),
`published run` (derived from a public measurement, named), `measured` (by `autotune
calibrate` on the machine named in the profile). The shipped profiles (one per catalog GPU,
built here from autotune/problem/catalog/gpus.py) hold nothing measured on the machine they describe
(`host_op_us`, a host figure, comes from this project's recorded calibrations); `autotune calibrate` writes
profiles whose figures are measured, and `--hardware PROFILE` on `tune` and `trial` makes the
estimate run on them (its basis then says "calibrated profile <name>").

Figures (all per GPU, or per CPU rank for a cpu profile):

    matmul_tflops          achieved dense matmul rate on large shapes
    matmul_op_us           fixed cost per matmul kernel (launch, small-shape tail): small
                           shapes reach a smaller fraction of the rate
    attention_tflops       achieved rate of the fused attention kernels (forward and backward)
    attention_op_us        fixed cost per attention kernel
    matmul_tflops_fp32, attention_tflops_fp32   the same two rates in fp32 (precision fp32); absent:
                           the 16-bit rates (a calibrated cpu profile measures them; the shipped GPU
                           profiles take the data sheet's fp32 peak, TF32 off as torch's default)
    float8_matmul_tflops, float8_rowwise_matmul_tflops   (calibrated, GPUs with float8) the float8
                           training GEMMs' rate (`torch._scaled_mm`, tensorwise or rowwise scales) at the
                           block projections' shapes; absent: float8 matmuls at `matmul_tflops`
    <rate>@<tokens>        (calibrated) a rate measured at that many tokens per micro-batch, the
                           model's shapes: the estimate interpolates them in log(tokens)
    memory_gbps            achieved bandwidth of memory-bound ops (bytes read + written)
    memory_op_us           fixed cost per memory-bound op (launch / dispatch overhead)
    memory_gbps_large      (calibrated) the same for ops of at least costmodel.LARGE_MEMORY_OP_BYTES,
                           whose buffers stream from main memory; absent: `memory_gbps` for all
    intra_node_gbps        all-gather / reduce-scatter bus bandwidth within a node
    intra_node_latency_us  fixed cost of one collective within a node
    inter_node_gbps        the same across nodes, one GPU's NIC (a ring over whole nodes runs
                           all of a node's: costmodel.inter_node_ring_gbps)
    inter_node_latency_us
    comm_overlap           1 where collectives run on side streams under compute (CUDA), 0 where
                           they block the compute (gloo on CPU)
    host_link_gbps         pinned host<->device copies (cuda)
    cpu_adam_params_per_s  fp32 AdamW parameters a node's CPUs step per second (CPU offload, or
                           the whole optimizer step of a cpu run, per rank)
    optimizer_gbps         bandwidth of the on-device AdamW step (28 bytes per parameter)
    host_op_us             host time per dispatched op of a real FSDP2 forward+backward (Python,
                           dispatcher, autograd, FSDP2 hooks, kernel launch): on a GPU the host
                           issues kernels ahead of the device, so a micro-batch takes the longer
                           of its device time and its host time; on a CPU the two add. Absent in
                           profiles made before it existed: then no host term (the old model)
    fresh_page_ns_per_byte (calibrated) the host's first touch of a fresh mapping per byte: CPU
                           offload's large gradient shards while gradients accumulate; absent:
                           costmodel.FRESH_PAGE_NS_PER_BYTE
    offload_accumulate_ns_per_param  (cuda, calibrated) the blocking gradient copy back and host
                           add per element of CPU offload's accumulating micro-batches; absent:
                           costmodel.OFFLOAD_ACCUMULATE_NS_PER_PARAM
    tracked_op_us          (cpu, calibrated) what the cpu backend's tensor-memory tracker adds to
                           every dispatched op of a real cpu trial, plus
    tracked_op_us_per_block   that much more per block of the model (it tracks more tensors)
    cuda_context_bytes, nccl_communicator_bytes, cublas_workspace_bytes (cuda, calibrated only):
                           runtime memory terms that replace autotune/estimate/runtime_memory.py's estimates
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.estimate import costmodel
from autotune.problem.catalog.gpus import GPUS, GPUSpec
from autotune.util.errors import UsageError

SCHEMA = "autotune-hardware/1"
SOURCES = ("data sheet", "published run", "measured")

FIGURE_UNITS = {
    "matmul_tflops": "TFLOP/s", "matmul_op_us": "us", "attention_tflops": "TFLOP/s", "attention_op_us": "us",
    "matmul_tflops_fp32": "TFLOP/s", "attention_tflops_fp32": "TFLOP/s",
    "float8_matmul_tflops": "TFLOP/s", "float8_rowwise_matmul_tflops": "TFLOP/s",
    "memory_gbps": "GB/s", "memory_op_us": "us", "memory_gbps_large": "GB/s",
    "intra_node_gbps": "GB/s", "intra_node_latency_us": "us",
    "inter_node_gbps": "GB/s", "inter_node_latency_us": "us", "comm_overlap": "fraction",
    "host_link_gbps": "GB/s", "cpu_adam_params_per_s": "params/s", "optimizer_gbps": "GB/s",
    "cuda_context_bytes": "bytes", "nccl_communicator_bytes": "bytes", "cublas_workspace_bytes": "bytes",
    "reserved_over_allocated": "ratio", "tracked_op_us": "us", "tracked_op_us_per_block": "us", "host_op_us": "us",
    "fresh_page_ns_per_byte": "ns/B", "offload_accumulate_ns_per_param": "ns",
}
REQUIRED = ("matmul_tflops", "matmul_op_us", "attention_tflops", "attention_op_us", "memory_gbps", "memory_op_us",
            "intra_node_gbps", "intra_node_latency_us", "inter_node_gbps", "inter_node_latency_us", "comm_overlap",
            "host_link_gbps", "cpu_adam_params_per_s", "optimizer_gbps")


@dataclass(frozen=True)
class HardwareFigure:
    value: float
    source: str
    basis: str

    def to_dict(self, name: str) -> dict[str, Any]:
        # A rate at a token count (`matmul_tflops@2048`) has its rate's unit.
        return dict(value=self.value, unit=FIGURE_UNITS.get(name.split("@")[0], ""), source=self.source,
                    basis=self.basis)


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    device: str
    """'cuda' or 'cpu': what the figures describe."""
    gpu: str | None
    figures: dict[str, HardwareFigure]
    calibrated: bool = False
    date: str = ""
    machine: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    path: str | None = None

    def __getitem__(self, name: str) -> float:
        return self.figures[name].value

    def get(self, name: str, default: float | None = None) -> float | None:
        figure = self.figures.get(name)
        return default if figure is None else figure.value

    def describe(self) -> str:
        """For a Figure's basis: what the profile is."""
        if self.calibrated:
            return f"calibrated profile {self.name} (measured by autotune calibrate on {self.date[:10]})"
        return f"shipped profile {self.name} (data sheet and published runs)"

    def to_dict(self) -> dict[str, Any]:
        return dict(schema=SCHEMA, name=self.name, device=self.device, gpu=self.gpu, calibrated=self.calibrated,
                    date=self.date, machine=self.machine, versions=self.versions,
                    figures={k: f.to_dict(k) for k, f in self.figures.items()})

    def save(self, path: str | os.PathLike) -> Path:
        from autotune.util.files import write_atomic

        out = Path(path)
        write_atomic(out, json.dumps(self.to_dict(), indent=2) + "\n")  # never a half-written profile
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, path: str | None = None) -> "HardwareProfile":
        where = path or "the profile"
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise UsageError(f"{where} is not an autotune hardware profile (schema {SCHEMA!r} expected)")
        raw = data.get("figures") or {}
        figures = {}
        for name, item in raw.items():
            try:
                value = float(item["value"])
            except (KeyError, TypeError, ValueError):
                raise UsageError(f"{where}: figure {name!r} has no numeric value") from None
            source = item.get("source", "")
            if source not in SOURCES:
                raise UsageError(f"{where}: figure {name!r} has source {source!r}, not one of {', '.join(SOURCES)}")
            figures[name] = HardwareFigure(value, source, str(item.get("basis", "")))
        missing = [name for name in REQUIRED if name not in figures]
        if missing:
            raise UsageError(f"{where}: missing figures {', '.join(missing)}")
        device = data.get("device")
        if device not in ("cuda", "cpu"):
            raise UsageError(f"{where}: device must be 'cuda' or 'cpu', got {device!r}")
        return cls(name=str(data.get("name") or Path(where).stem), device=device, gpu=data.get("gpu"),
                   figures=figures, calibrated=bool(data.get("calibrated")), date=str(data.get("date", "")),
                   machine=dict(data.get("machine") or {}), versions=dict(data.get("versions") or {}), path=path)


def load_profile(name_or_path: str) -> HardwareProfile:
    """A profile from a JSON file, or a shipped one by catalog GPU name."""
    if name_or_path.lower() in GPUS and not os.path.exists(name_or_path):
        return shipped_profile(GPUS[name_or_path.lower()])
    path = Path(name_or_path)
    if not path.is_file():
        raise UsageError(f"--hardware {name_or_path}: no such file, and not a catalog GPU ({', '.join(GPUS)})")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--hardware {name_or_path}: not readable JSON ({exc})") from None
    return HardwareProfile.from_dict(data, path=str(path))


# --- shipped profiles: data sheets and published runs ----------------------------------------------

PUBLISHED_MATMUL_FRACTION = {
    "a100": (costmodel.MATMUL_EFFICIENCY["a100-80gb"],
             "the fraction of the A100 dense bf16 peak (312 TFLOP/s) an eager FSDP step's matmul FLOPs run at "
             "(attention at published flash-kernel speeds and memory-bound ops at the HBM data sheet costed apart) in "
             "torchtitan's Llama 3 and Llama 2 runs on 64 A100s (docs/performance.md 2024), fms-fsdp's on 128 "
             "A100s, llm-foundry's MPT tables (A100 80GB and 40GB) and TinyLlama's 16 A100-40GB, fitted to all "
             "of autotune/estimate/data/published_runs.json"),
    "hopper": (costmodel.MATMUL_EFFICIENCY["h100-80gb"],
               "the fraction of the H100 dense bf16 peak (989 TFLOP/s) an eager FSDP step's matmul FLOPs run at "
               "(attention at published flash-kernel speeds and memory-bound ops at the HBM data sheet costed apart) in "
               "torchtitan's Llama 3.1 8B on 8 and 128 H100s (docs/performance.md Tables 1 and 3, FSDP eager; 500 W "
               "HBM2e parts, costed at 912 TFLOP/s, the middle of the peak range the source states), "
               "fms-fsdp's 96 H100s and llm-foundry's MPT H100 tables, fitted to all of "
               "autotune/estimate/data/published_runs.json"),
}
"""Where a public FSDP run on the part exists; checked leave-one-source-out in benchmarks/bench_costmodel.py."""
UNPUBLISHED_MATMUL_FRACTION = costmodel.DEFAULT_MATMUL_EFFICIENCY
INTRA_NODE_BUS_FRACTION = costmodel.INTRA_NODE_BUS_EFFICIENCY
NIC_BUS_FRACTION = costmodel.NIC_BUS_EFFICIENCY
_PCIE_GBPS = {"h100-80gb": 50.0, "h200-141gb": 50.0}


def _family(gpu: GPUSpec) -> str | None:
    if gpu.name.startswith("a100"):
        return "a100"
    if gpu.name.startswith(("h100", "h200")):
        return "hopper"
    return None


def shipped_profile(gpu: GPUSpec) -> HardwareProfile:
    """The shipped profile of a catalog GPU: data-sheet figures, scaled where a published run
    says what fraction an FSDP step reaches. Nothing in it is measured here."""
    fam = _family(gpu)
    fraction, why = PUBLISHED_MATMUL_FRACTION.get(fam, (UNPUBLISHED_MATMUL_FRACTION, ""))
    matmul_source = "published run" if fam else "data sheet"
    matmul_basis = why if fam else (f"{UNPUBLISHED_MATMUL_FRACTION:.0%} of the data-sheet peak: no published FSDP "
                                    "run on this part (unvalidated)")
    sheet = f"data sheet ({gpu.source})"
    pcie = _PCIE_GBPS.get(gpu.name, 25.0)
    figures = {
        "matmul_tflops": HardwareFigure(gpu.peak_tflops * fraction, matmul_source,
                                        f"{gpu.peak_tflops:g} TFLOP/s dense peak x {fraction:.2f}: {matmul_basis}"),
        "matmul_op_us": HardwareFigure(8.0, "data sheet", "kernel launch and tail per GEMM, a few microseconds "
                                       "(typical CUDA launch latency); not sourced: unvalidated"),
        "attention_tflops": HardwareFigure(gpu.peak_tflops * fraction, matmul_source,
                                           "as matmul_tflops (flash attention reaches a similar fraction)"),
        "attention_op_us": HardwareFigure(20.0, "data sheet", "launch per attention kernel: unvalidated"),
        "memory_gbps": HardwareFigure(gpu.hbm_gbps * 0.8, "data sheet",
                                      f"80% of the {gpu.hbm_gbps:g} GB/s memory bandwidth ({gpu.source})"),
        "memory_op_us": HardwareFigure(5.0, "data sheet", "kernel launch per elementwise op: unvalidated"),
        "intra_node_gbps": HardwareFigure(gpu.intra_node_gbps * INTRA_NODE_BUS_FRACTION, "data sheet",
                                          f"{INTRA_NODE_BUS_FRACTION:.0%} of {gpu.intra_node_gbps:g} GB/s one-way "
                                          f"link ({sheet}); NCCL ring busbw fraction, unvalidated"),
        "intra_node_latency_us": HardwareFigure(15.0, "data sheet", "NCCL ring latency within a node: unvalidated"),
        "inter_node_gbps": HardwareFigure(gpu.inter_node_gbps * NIC_BUS_FRACTION, "data sheet",
                                          f"{NIC_BUS_FRACTION:.0%} of the {gpu.inter_node_gbps:g} GB/s per-GPU NIC; a "
                                          "ring over whole nodes runs all of a node's NICs (costmodel."
                                          "inter_node_ring_gbps): unvalidated fraction"),
        "inter_node_latency_us": HardwareFigure(40.0, "data sheet", "NCCL ring latency across nodes: unvalidated"),
        "comm_overlap": HardwareFigure(1.0, "data sheet", "FSDP2 runs collectives on side CUDA streams"),
        "host_link_gbps": HardwareFigure(pcie, "data sheet", f"~80% of PCIe Gen{5 if pcie > 30 else 4} x16"),
        # Measured by autotune on the lent GPU hosts named in the basis, not this machine, nor a publisher's.
        "cpu_adam_params_per_s": HardwareFigure(costmodel.CPU_ADAM_PARAMS_PER_S_PER_NODE, "measured",
                                                costmodel.CPU_ADAM_BASIS),
        "optimizer_gbps": HardwareFigure(gpu.hbm_gbps * 0.5, "data sheet", "50% of memory bandwidth for the "
                                         "multi-tensor AdamW: unvalidated"),
        "host_op_us": HardwareFigure(costmodel.HOST_OP_US, "measured", costmodel.HOST_OP_BASIS),
    }
    if gpu.fp32_tflops:  # fp32 matmuls and attention run on the CUDA cores (TF32 off: torch's default)
        for kind in ("matmul", "attention"):
            figures[f"{kind}_tflops_fp32"] = HardwareFigure(
                gpu.fp32_tflops * fraction, "data sheet",
                f"{gpu.fp32_tflops:g} TFLOP/s fp32 peak (CUDA cores; {sheet}) x {fraction:.2f}, the 16-bit fraction: "
                "unvalidated")
    return HardwareProfile(name=gpu.name, device="cuda", gpu=gpu.name, figures=figures)


def profile_for(gpu: GPUSpec, override: HardwareProfile | None = None) -> HardwareProfile:
    """The profile an estimate on `gpu` runs on: the user's (`--hardware`), else the shipped one."""
    return override if override is not None else shipped_profile(gpu)


def machine_description() -> dict[str, Any]:
    import platform

    info: dict[str, Any] = dict(hostname=platform.node(), machine=platform.machine(), cpus=os.cpu_count(),
                                system=platform.platform())
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info
