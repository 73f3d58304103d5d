"""The GPU catalog: memory and nominal speeds used by estimates.

Memory is the total the driver reports (nvidia-smi MiB); FLOP/s are dense (no sparsity) tensor
core peaks from the vendors' data sheets; bandwidths are per GPU, one direction: NVLink for
intra-node where the part has it (else PCIe), the usual per-GPU NIC for inter-node. These are
nominal figures: every estimate built from them says `estimated`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from autotune.util.errors import UsageError

MiB = 2**20


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    name: str
    memory_bytes: int
    supports_bf16: bool
    peak_tflops: float  # dense bf16 (fp16 where no bf16)
    hbm_gbps: float  # GB/s
    intra_node_gbps: float  # GB/s per GPU, one direction
    inter_node_gbps: float  # GB/s per GPU, one direction: its NIC, or its share of the node's network
    source: str
    float8_tflops: float = 0.0
    """Dense float8 (e4m3/e5m2, fp32 accumulate) tensor-core peak from the data sheet, TFLOP/s; 0: the
    part has no float8 tensor cores (Ampere and older), and float8 training is refused on it."""
    float8_source: str = ""
    fp32_tflops: float = 0.0
    """Dense fp32 peak of the CUDA cores from the data sheet (the source names it), TFLOP/s: where fp32
    matmuls run under torch's default float32 matmul precision ("highest": no TF32 tensor cores), which
    autotune's fp32 trials keep. 0: no figure (fp32 then costed at the 16-bit peak, and the basis says so)."""

    @property
    def has_float8(self) -> bool:
        return self.float8_tflops > 0

    def to_dict(self) -> dict:
        return dict(type=self.name, memory_bytes=self.memory_bytes, supports_bf16=self.supports_bf16,
                    peak_tflops=self.peak_tflops, hbm_gbps=self.hbm_gbps,
                    intra_node_gbps=self.intra_node_gbps, inter_node_gbps=self.inter_node_gbps,
                    float8_tflops=self.float8_tflops, fp32_tflops=self.fp32_tflops)


GPUS: dict[str, GPUSpec] = {g.name: g for g in [
    GPUSpec(name="h100-80gb", memory_bytes=81559 * MiB, supports_bf16=True, peak_tflops=989.0,
            hbm_gbps=3350, intra_node_gbps=450, inter_node_gbps=50,
            source="NVIDIA H100 SXM5 data sheet; NVLink 4 900 GB/s bidirectional; 400 Gb/s NIC; FP32 67 TFLOPS",
            float8_tflops=1979.0, float8_source="NVIDIA H100 SXM5 data sheet: FP8 Tensor Core 3,958 TFLOPS with "
                                                "sparsity, 1,979 dense",
            fp32_tflops=67.0),
    GPUSpec(name="h200-141gb", memory_bytes=143771 * MiB, supports_bf16=True, peak_tflops=989.0,
            hbm_gbps=4800, intra_node_gbps=450, inter_node_gbps=50,
            source="NVIDIA H200 SXM data sheet; NVLink 4; 400 Gb/s NIC; FP32 67 TFLOPS",
            float8_tflops=1979.0, float8_source="NVIDIA H200 SXM data sheet: FP8 Tensor Core 3,958 TFLOPS with "
                                                "sparsity, 1,979 dense",
            fp32_tflops=67.0),
    GPUSpec(name="a100-80gb", memory_bytes=81920 * MiB, supports_bf16=True, peak_tflops=312.0,
            hbm_gbps=2039, intra_node_gbps=300, inter_node_gbps=25,
            source="NVIDIA A100 SXM4 80GB data sheet; NVLink 3 600 GB/s bidirectional; 200 Gb/s NIC; FP32 19.5 "
                   "TFLOPS",
            fp32_tflops=19.5),
    GPUSpec(name="a100-40gb", memory_bytes=40960 * MiB, supports_bf16=True, peak_tflops=312.0,
            hbm_gbps=1555, intra_node_gbps=300, inter_node_gbps=25,
            source="NVIDIA A100 SXM4 40GB data sheet; NVLink 3; 200 Gb/s NIC; FP32 19.5 TFLOPS",
            fp32_tflops=19.5),
    GPUSpec(name="l40s-48gb", memory_bytes=46068 * MiB, supports_bf16=True, peak_tflops=362.0,
            hbm_gbps=864, intra_node_gbps=32, inter_node_gbps=12.5,
            source="NVIDIA L40S data sheet; PCIe Gen4 x16; 100 Gb/s NIC; FP32 91.6 TFLOPS",
            float8_tflops=733.0, float8_source="NVIDIA L40S data sheet: FP8 Tensor Core 733 TFLOPS dense (1,466 "
                                               "with sparsity)",
            fp32_tflops=91.6),
    GPUSpec(name="rtx4090-24gb", memory_bytes=24564 * MiB, supports_bf16=True, peak_tflops=165.2,
            hbm_gbps=1008, intra_node_gbps=32, inter_node_gbps=12.5,
            source="NVIDIA Ada whitepaper (bf16, fp32 accumulate); PCIe Gen4 x16; FP32 82.6 TFLOPS (non-tensor)",
            float8_tflops=330.3, float8_source="NVIDIA Ada whitepaper, RTX 4090: FP8 tensor 330.3 TFLOPS dense "
                                               "with fp32 accumulate (660.6 with sparsity), half the fp16-accumulate "
                                               "rate as for its bf16 figure",
            fp32_tflops=82.6),
    GPUSpec(name="a10g-24gb", memory_bytes=23028 * MiB, supports_bf16=True, peak_tflops=70.0,
            hbm_gbps=600, intra_node_gbps=32, inter_node_gbps=1.5625,
            source="AWS g5 (A10G) figures; PCIe Gen4; 100 Gb/s per 8-GPU node (12.5 GB/s: 1.56 each); FP32 "
                   "31.2 TFLOPS from NVIDIA's A10 data sheet (AWS gives none for the A10G)",
            fp32_tflops=31.2),
    GPUSpec(name="v100-32gb", memory_bytes=32768 * MiB, supports_bf16=False, peak_tflops=125.0,
            hbm_gbps=900, intra_node_gbps=150, inter_node_gbps=12.5,
            source="NVIDIA V100 SXM2 data sheet (fp16 tensor cores, no bf16); NVLink 2; FP32 15.7 TFLOPS",
            fp32_tflops=15.7),
]}

DEFAULT_GPU = "h100-80gb"


def resolve_gpu(name: str) -> GPUSpec:
    key = name.lower()
    if key in GPUS:
        return GPUS[key]
    close = difflib.get_close_matches(key, list(GPUS), n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise UsageError(f"unknown GPU type {name!r}: {hint}choose one of {', '.join(GPUS)}")


def nvidia_driver_present() -> bool:
    """Whether this machine can have CUDA GPUs at all, without importing torch (seconds)."""
    import os

    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidia0")


def detect_gpu() -> GPUSpec | None:
    """The catalog entry of the local GPU 0, if CUDA is present and the part is known. Without
    an NVIDIA driver on the machine, torch is not imported to find that out (seconds saved on
    every plan made without GPUs)."""
    if not nvidia_driver_present():
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(0)
    except Exception:  # a broken driver is the same as no GPU for choosing a default
        return None
    name = props.name.upper()
    for key, prefix in (("h200-141gb", "H200"), ("h100-80gb", "H100"), ("l40s-48gb", "L40S"),
                        ("rtx4090-24gb", "4090"), ("a10g-24gb", "A10G"), ("v100-32gb", "V100")):
        if prefix in name:
            return GPUS[key]
    if "A100" in name:
        return GPUS["a100-80gb" if props.total_memory > 50 * 2**30 else "a100-40gb"]
    return None


# Compute capability of the catalog's GPUs, for the kernel checks (backends/sim/_gpu_kernels.py, catalog/attention.py):
# NVIDIA's published figures, written from memory (H100/H200 9.0, A100 8.0, L40S and RTX 4090 8.9, A10G 8.6, V100 7.0).
GPU_SM: dict[str, tuple[int, int]] = {
    "h100-80gb": (9, 0), "h200-141gb": (9, 0), "a100-80gb": (8, 0), "a100-40gb": (8, 0),
    "l40s-48gb": (8, 9), "rtx4090-24gb": (8, 9), "a10g-24gb": (8, 6), "v100-32gb": (7, 0),
}
DEFAULT_SM = (9, 0)
"""A GPU not in GPU_SM is taken as SM 9.0 (Hopper)."""
