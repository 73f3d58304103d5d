"""Hardware time and memory margins: the one cost model the analytic backend and the simulator share.

Everything here is an *estimate* built from catalog figures (`GPUSpec`) and a few explicit
constants, each documented below and in docs/COSTMODEL.md with the public measurements it was
calibrated against. Callers count the work (FLOPs, collective bytes, offload copies) in a
`StepWork`; `estimate_step_time` turns it into seconds with a roofline:

    compute  = matmul flops / (peak_tflops * matmul efficiency)
             + attention flops / the attention kernel's published speed (ATTENTION_KERNEL_TFLOPS)
             + memory-bound bytes / data-sheet HBM bandwidth (MEMORY_BYTES_PER_TOKEN)
    comm     = collective bytes * (n-1)/n / (link bandwidth * bus efficiency)
    exposed  = comm that does not fit under compute, plus the first all-gather and last
               reduce-scatter of each micro-batch, which nothing can hide
    offload  = host<->device copies over PCIe (they share the copy streams with collectives)
    host     = dispatched ops x HOST_OP_US (where the trace counted them): the host issues the
               kernels ahead of the GPU, so a micro-batch takes the longer of the two
    step     = max(compute, host) + exposed (comm + offload) + CPU AdamW step when offloading
             + under pipeline parallelism, the slowest stage's bubble ((p-1)/(v m) of its time, Narayanan et
               al. 2021) and its exposed stage-to-stage sends (pipeline_bubble_ratio, pp_p2p_bytes)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from autotune.estimate import heldout
from autotune.problem.catalog.gpus import GPUSpec
from autotune.problem.config import Cluster

__all__ = [
    "CollectiveVolume", "StepTime", "StepWork",
    "collective_bytes", "compute_peak_tflops", "estimate_basis", "estimate_step_time", "fsdp_step_work",
    "pipeline_bubble_ratio", "pipeline_in_flight", "pipeline_stage_layers", "pp_p2p_bytes", "PIPELINE_BUBBLE_SOURCE",
    "host_link_gbps",
    "matmul_efficiency", "offload_bytes",
    "ESTIMATE_BASIS",
    "MATMUL_EFFICIENCY", "DEFAULT_MATMUL_EFFICIENCY", "HALF_EFFICIENCY_TOKENS", "HALF_EFFICIENCY_HIDDEN",
    "REFERENCE_HIDDEN", "ATTENTION_KERNEL_TFLOPS", "ATTENTION_KERNEL_SPEEDUP", "MEMORY_BYTES_PER_TOKEN", "EAGER_SCORE_BYTES",
    "attention_kernel_tflops", "memory_bytes_per_token",
    "INTRA_NODE_BUS_EFFICIENCY", "NIC_BUS_EFFICIENCY", "inter_node_ring_gbps", "CPU_ADAM_PARAMS_PER_S_PER_NODE",
    "HOST_PROCESS_BYTES", "HOST_OP_US", "LARGE_MEMORY_OP_BYTES",
]

GiB = 2**30
MiB = 2**20

# --- Throughput constants (calibration and sources: docs/COSTMODEL.md) -------------------------
MATMUL_EFFICIENCY = {"a100-80gb": 0.82, "a100-40gb": 0.82, "h100-80gb": 0.62, "h200-141gb": 0.62}
"""Fraction of the data-sheet dense peak that an FSDP transformer step's matmul FLOPs (recompute
included; attention's score and value products and the memory-bound ops are costed apart, at published
kernel speeds and the HBM data sheet: ATTENTION_KERNEL_TFLOPS, MEMORY_BYTES_PER_TOKEN) run at on large
micro-batches of a model REFERENCE_HIDDEN wide, by GPU family. Fitted with HALF_EFFICIENCY_TOKENS,
HALF_EFFICIENCY_HIDDEN and ATTENTION_KERNEL_SPEEDUP (fitted: 0.816 and 0.619) to the 128 published eager FSDP runs in
autotune/estimate/data/published_runs.json (12 sources: torchtitan, PyTorch/IBM fms-fsdp, MosaicML
llm-foundry, TinyLlama), each source weighed once (autotune/drivers/costmodel_fit.py; benchmarks/
bench_costmodel.py --published prints the fit and checks it leave-one-source-out): the A100 figure
rests on the A100 80GB and 40GB sources (torchtitan's 64 A100s, fms-fsdp's two 128-A100 tables,
llm-foundry's A100 tables, TinyLlama), the H100 one on the H100 sources (torchtitan's 8 and 128,
fms-fsdp's 96, llm-foundry's two). A large bf16 GEMM measured on an H100 by `autotune calibrate`
reaches 0.633 of the peak (BF16_GEMM_FRACTION): the fitted H100 figure is a matmul's, as it now should
be. H200 takes the H100's: no eager H200 source (torchtitan's H200 rows are compiled and float8). It is
the fraction of a 700 W H100 SXM's 989 TFLOP/s: torchtitan's H100s are 96 GB HBM2e parts at a 500 W
limit whose peak the source puts between the SXM's and the NVL's (835), so their rows are estimated at
912, the middle of that range (a row fact, costmodel_fit.PublishedRun.peak_tflops). Was 0.77 / 0.52
while every FLOP (attention's, and the memory-bound ops' time) ran at this one efficiency, 0.85 / 0.66
while every collective across nodes ran at 1.9 NICs per GPU (NIC_BUS_EFFICIENCY), H100 0.65 until
llm-foundry's 2024-01 MPT 7B and 70B rows were costed with the FlashAttention-2 their sweep ran
(2026-11-27), 0.85 / 0.64 while llm-foundry's Triton attention ran at its published bars (the
efficiencies absorbed its speed: ATTENTION_KERNEL_SPEEDUP, 2026-11-28)."""
DEFAULT_MATMUL_EFFICIENCY = 0.50
"""For catalog GPUs without a published FSDP figure: unvalidated."""
HALF_EFFICIENCY_TOKENS = 1480
"""Tokens per GPU per micro-batch at which the matmul efficiency is half its maximum: per
micro-batch costs that do not grow with its tokens (small kernels, each FSDP unit's waits) weigh
on small micro-batches (efficiency = max * t / (t + this)). Fitted with MATMUL_EFFICIENCY (1,483):
the rows that set it are those of one source at several micro-batch sizes: llm-foundry's tables
(micro-batches of 1 to 64 sequences), fms-fsdp's 13B (0.48 of peak at micro-batch 1 x 4,096
tokens, 0.59 at 2) and torchtitan's Llama 2 70B (micro-batch 1 with op-level checkpointing as fast
as 2 with full). Was 920 on the 21 rows before llm-foundry's were added, 1,290 before attention and
the memory-bound ops were costed apart (2026-11-27), 1,780 before collectives across whole nodes ran on
all of a node's NICs (NIC_BUS_EFFICIENCY, the same day), 1,700 before ATTENTION_KERNEL_SPEEDUP (2026-11-28)."""
HALF_EFFICIENCY_HIDDEN = 690
"""Hidden size h at which a step's matmul FLOPs would run at half the efficiency of an infinitely
wide model: matmul FLOPs grow as h^2 per token, the work that grows as h and is not costed apart
(small kernels' fixed costs, launch gaps) weighs more on narrow models (efficiency x h / (h + this),
normalised to 1 at REFERENCE_HIDDEN). Fitted with MATMUL_EFFICIENCY (691): the rows that set it are
the widths one source runs on one cluster: llm-foundry's MPT 7B to 70B (h 4,096 to 8,192), fms-fsdp's
March 2024 table (7B to 70B) and TinyLlama (h 2,048). Was 1,780 on the 21 rows before llm-foundry's
were added (fms-fsdp's widths alone), 800 before attention and the memory-bound ops were costed apart,
710 before ATTENTION_KERNEL_SPEEDUP (2026-11-28)."""
REFERENCE_HIDDEN = 8192
"""The width MATMUL_EFFICIENCY is stated at (Llama 2/3 70B, Code Llama 34B)."""
INTRA_NODE_BUS_EFFICIENCY = 0.80
"""Fraction of nominal NVLink/PCIe bandwidth a ring collective reaches (NCCL busbw on NVLink 3/4
is ~75-80% of the one-direction data-sheet figure)."""
NIC_BUS_EFFICIENCY = 0.80
"""Fraction of a NIC's data-sheet rate (the catalog's `inter_node_gbps`: a GPU's own 200/400 Gb/s NIC on
DGX/HGX nodes and the published clusters that state theirs, or its share of a node's network where the
GPUs share one) that a ring collective's cross-node hop reaches, as INTRA_NODE_BUS_EFFICIENCY for
NVLink: a stated assumption, not fitted. How many NICs a ring uses is modelled (inter_node_ring_gbps):
a ring over every GPU of whole nodes (FSDP's, and HSDP's shard groups of several nodes) runs one NCCL
channel per NIC, so its cross-node traffic spreads over all of a node's NICs (NCCL's own tuning model,
src/graph/tuning.cc, takes a ring's bus bandwidth as its channels times the inter-node speed); a ring
over one GPU per node (HSDP's replica all-reduce) and an all-to-all have their own GPU's NIC each.
Replaced INTER_NODE_BUS_EFFICIENCY = 1.9 (a multiple of one NIC for every collective across nodes, set
by one published row) on 2026-11-27: llm-foundry's MPT 13B at micro-batch 2 ran at 4,792 to 4,811
tokens/s/GPU on 8, 16, 32 and 64 H100s, which one NIC per GPU at any factor below ~2.3 cannot give
(docs/COSTMODEL.md, "Collectives across nodes")."""
HOST_OP_US = 24.0
"""Host time per dispatched op of an eager FSDP2 forward + backward on a GPU (Python, dispatcher,
autograd, FSDP2's hooks, the kernel launch). Small models at small micro-batches are bound by it,
not by the GPU: on one H100, qwen2.5-0.5b at micro-batch 2 ran at 10-12k tokens/s where the
roofline alone says 105k. Measured by `autotune calibrate --backend cuda` (a 2-block FSDP2 step
over its dispatched ops) on H100 VMs with 16 Xeon cores and torch 2.11, on three models and two
machines: 16.7, 21.5, 27.3 and 32.9 us (benchmarks/results/h100_calibrated_*.json); 24 us is
their median. It is a property of the host CPU and the torch version, not of the GPU, so one
figure serves every catalog GPU; checked against the real H100 trials it was not taken from in
`benchmarks/bench_costmodel.py --gpu-recorded` (docs/COSTMODEL.md)."""
HOST_OP_BASIS = ("autotune calibrate --backend cuda on H100 VMs (16 Xeon cores, torch 2.11): 16.7-32.9 us over "
                 "three models and two machines, median 24 us (benchmarks/results/h100_calibrated_*.json); "
                 "a calibrated profile measures this machine's")
_PCIE_GBPS = {"h100-80gb": 50.0, "h200-141gb": 50.0}
"""Host<->device copy bandwidth achieved from pinned memory, GB/s: PCIe Gen5 x16 parts here;
every other catalog part is Gen4 x16 at 25 GB/s."""
_PCIE_GEN4_GBPS = 25.0
CPU_ADAM_PARAMS_PER_S_PER_NODE = 3.8e9
"""fp32 AdamW parameters a node's CPUs step per second under CPU offload (all ranks of the node
together). Measured: the host optimizer step of the 9 recorded one-GPU offload trials (autotune's
fused AdamW, the trials' default `optimizer_impl`; H100 and H200 hosts of 16 cores) took 0.21-0.33
ns per parameter, median 0.26 (benchmarks/bench_costmodel.py --offload). One rank had the host's
cores; a node of 8 ranks runs each rank's step on one thread (torchrun's OMP_NUM_THREADS=1) and
shares the memory bandwidth, which is not measured. Was 1.0e9 until 2026-11-28, a guess near what
`calibrate --backend cuda` then timed: foreach AdamW, 5x slower on a CPU than the fused one the
trials run."""
CPU_ADAM_BASIS = ("the host optimizer step of 9 recorded one-GPU offload trials (fused AdamW, H100 and H200 "
                  "hosts): median 0.26 ns per parameter; a node's ranks sharing its host are not measured")

# --- FSDP2's CPU offload while gradients accumulate ------------------------------------------------
# FSDP2 copies each reduced gradient shard back to the host in the unit's backward hook
# (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce). The first micro-batch
# of a step copies into pinned memory without blocking; every later one accumulates, so the copy
# blocks ("the CPU add kernel depends on the copy result") into a fresh pageable tensor, which is then
# added to the host's gradient. The hook holds the autograd thread: the unit's reduce-scatter, the
# copy and the add stop the GPU, micro-batch after micro-batch.

HOST_MMAP_THRESHOLD_BYTES = 32 * MiB
"""glibc's largest dynamic mmap threshold on 64-bit Linux (DEFAULT_MMAP_THRESHOLD_MAX). A host
allocation at least this large is mapped fresh and unmapped when freed, so each fresh copy faults
every page in again; a smaller one comes back from the heap, whose pages stay mapped. On the 2-core
VM the fresh copy of a 40-128 MiB fp32 tensor took 2.2 ns per element, and one of 4-24 MiB
0.16-0.26 ns (docs/COSTMODEL.md, "CPU offload while gradients accumulate")."""
OFFLOAD_ACCUMULATE_NS_PER_PARAM = 1.56
"""Host seconds x 1e9 per gradient element of the rank's shard in each accumulating micro-batch
under CPU offload: the blocking copy back to pageable memory and the host add. Fitted, with
FRESH_PAGE_NS_PER_BYTE measured apart, to the 9 recorded offload trials (one GPU, 3 models, H100 and
H200 hosts, micro-batch 2, 2 micro-batches: benchmarks/results/gpu_check_h*.json): each step less
the same report's GPU time without offload and less its measured optimizer step. With any host
machine or any model held out it refits at 1.55-1.59 and the held-out trials come within 10%
(benchmarks/bench_costmodel.py --offload). Measured with one rank per host: a node of 8 ranks shares
the host's memory and runs each rank's add on one thread (torchrun's OMP_NUM_THREADS=1), which is
not modelled. `autotune calibrate --backend cuda` times the same copy and add on its host
(calibrate.bench_offload_accumulate: `offload_accumulate_ns_per_param`, read by the per-operation
model)."""
FRESH_PAGE_NS_PER_BYTE = 0.51
"""Host seconds x 1e9 per byte of a fresh mapping's first touch (its page faults): the gradient shards
of at least HOST_MMAP_THRESHOLD_BYTES. Measured by calibrate.bench_fresh_pages on the 2-core VM
(0.51-0.52 ns per byte, three runs; `autotune calibrate` measures the machine it runs on). Fitted
to the 9 recorded GPU trials together with OFFLOAD_ACCUMULATE_NS_PER_PARAM instead, it comes out
0.52: the same cost on the GPUs' hosts."""
OFFLOAD_ACCUMULATE_BASIS = (
    "FSDP2's CPU offload while gradients accumulate: each micro-batch after the first copies the gradient "
    f"shards back blocking ({OFFLOAD_ACCUMULATE_NS_PER_PARAM} ns per element with the host add) and faults in "
    f"fresh pages for shards of {HOST_MMAP_THRESHOLD_BYTES // MiB} MiB or more ({FRESH_PAGE_NS_PER_BYTE} ns per "
    "byte); fitted to 9 one-GPU offload trials on H100 and H200 hosts")


def offload_accumulate_seconds(*, grad_params: float, fresh_page_bytes: float, accumulating_microbatches: int,
                               ns_per_param: float | None = None, page_ns_per_byte: float | None = None) -> float:
    """Host time FSDP2's CPU offload adds to a step's accumulating micro-batches, which the GPU waits
    for: `grad_params` elements of the rank's gradient shards copied back blocking and added, of which
    `fresh_page_bytes` land in fresh mappings (tensors of at least HOST_MMAP_THRESHOLD_BYTES)."""
    if accumulating_microbatches <= 0:
        return 0.0
    per_param = OFFLOAD_ACCUMULATE_NS_PER_PARAM if ns_per_param is None else ns_per_param
    per_byte = FRESH_PAGE_NS_PER_BYTE if page_ns_per_byte is None else page_ns_per_byte
    return accumulating_microbatches * (grad_params * per_param + fresh_page_bytes * per_byte) * 1e-9


def fresh_page_bytes(param_shapes, *, shard_ranks: int) -> float:
    """Bytes of one rank's fp32 gradient shards (FSDP2 shards dim 0, padded to equal chunks) in
    tensors of at least HOST_MMAP_THRESHOLD_BYTES: `param_shapes` is (shape, count) pairs
    (ModelSpec.param_shapes)."""
    shards = ((-(-shape[0] // max(shard_ranks, 1)) * math.prod(shape[1:]) * 4, count)
              for shape, count in param_shapes if shape)
    return float(sum(nbytes * count for nbytes, count in shards if nbytes >= HOST_MMAP_THRESHOLD_BYTES))


# --- Host memory (GPU memory beyond tensors: autotune/estimate/runtime_memory.py) -------------------------
HOST_PROCESS_BYTES = 3 * GiB
"""Host memory of one GPU training process before offloaded state: Python, torch, CUDA and NCCL
libraries, pinned staging buffers."""


# --- Attention kernels and memory-bound work (issue 29) -------------------------------------------

ATTENTION_KERNEL_TFLOPS = {
    # (kernel, GPU family): {head dim: ((sequence length, TFLOP/s fwd + bwd, causal), ...)}
    ("flash2", "a100"): {64: ((512, 88), (1024, 119), (2048, 140), (4096, 156), (8192, 165), (16384, 171)),
                         128: ((512, 99), (1024, 133), (2048, 155), (4096, 173), (8192, 182), (16384, 189))},
    ("triton", "a100"): {64: ((512, 59), (1024, 75), (2048, 79), (4096, 76), (8192, 79), (16384, 80)),
                         128: ((512, 50), (1024, 61), (2048, 68), (4096, 74), (8192, 78), (16384, 80))},
    ("flash2", "hopper"): {64: ((512, 141), (1024, 192), (2048, 232), (4096, 257), (8192, 273), (16384, 284)),
                           128: ((512, 163), (1024, 221), (2048, 265), (4096, 294), (8192, 308), (16384, 328))},
    ("flash1", "hopper"): {64: ((512, 104), (1024, 123), (2048, 136), (4096, 138), (8192, 149), (16384, 156)),
                           128: ((512, 98), (1024, 109), (2048, 108), (4096, 126), (8192, 135), (16384, 137))},
}
"""Published attention kernel speeds, forward + backward with a causal mask, bf16/fp16, TFLOP/s as
the FlashAttention benchmark counts them (forward 4 s^2 d heads / 2, backward 2.5x forward:
benchmarks/benchmark_flash_attention.py `flops`; hidden 2,048, batch 16k tokens / s): FlashAttention-2
(Dao 2023, arXiv 2307.08691, Figures 4 and 7; Dao-AILab/flash-attention commit 4f285b3,
assets/flash2_a100_fwd_bwd_benchmark.png on an A100 80GB SXM4 and flash2_h100_fwd_bwd_benchmark.png on
an H100 80GB SXM5, panels c and d). "triton" is the paper's "FlashAttention Triton" bars (flash-attn's
flash_attn_triton.py, which llm-foundry copied for MPT's attn_impl triton), measured on the A100 only;
on Hopper it takes the paper's FlashAttention (1, CUDA) bars, which that kernel's own docstring puts
slightly ahead of it ("Overall Triton forward + backward is slightly slower than CUDA forward +
backward"): an assumption, stated. The figures are not fitted to any published training run; the Triton
kernel's are scaled by a fitted ATTENTION_KERNEL_SPEEDUP (the build the runs used was faster)."""
ATTENTION_KERNEL_PEAK = {"a100": 312.0, "hopper": 989.0}
"""The dense bf16 peak of the part each family's figures were measured on (A100 SXM4, H100 SXM5): a
GPU of the family at another peak (torchtitan's 500 W H100s, `peak_tflops`) runs at the same fraction."""
ATTENTION_KERNEL_ON = {"triton": {"hopper": "flash1"}}
"""Kernels measured on one family only, and the figures another family takes."""
ATTENTION_KERNEL_SPEEDUP = {"triton": 1.37}
"""Fitted: how much faster a kernel ran in the published training runs than in the benchmark its
ATTENTION_KERNEL_TFLOPS figures come from, for the kernels whose benchmark ran another build. The
FlashAttention-2 paper's Triton bars timed flash_attn_triton.py with the Triton of mid-2023, whose new
MLIR backend the kernel's own docstring says it was not written for ("tested with
triton==2.0.0.dev20221202"); llm-foundry, the only stack in the published runs that ran it (MPT's
attn_impl triton), pinned pre-MLIR builds (triton 2.0.0.dev20221202 in May 2023, its triton-pre-mlir
fork with sm90 support from October 2023). Fitted with MATMUL_EFFICIENCY on the 128 published eager
runs (1.368): llm-foundry's four tables (two stacks, A100 40/80GB and H100, May 2023 to January 2024),
whose rows at 16k-65k tokens per sequence are mostly attention; 1.33-1.41 with any one of them held out
(benchmarks/bench_costmodel.py --published). Implied by single rows: 1.09x (May 2023, A100) to 1.31x
(October 2023, H100) the bars it is applied to. autotune's own steps run PyTorch SDPA's flash
backend ("flash2"), which no factor touches: on that kernel the published bars stand (a factor
fitted for it came out 0.84-1.02 across held-out sources and made the publisher-held-out check
worse: not kept). Before it (2026-11-28), the matmul efficiencies absorbed the fast Triton rows
(A100 0.85, Hopper 0.64)."""

MEMORY_BYTES_PER_TOKEN = {
    # per decoder block, bf16, forward + backward, then forward alone: coefficients of (hidden, ffn, kv width)
    "eager": ((378.3, 36.6, 65.4), (116.2, 18.3, 28.6)),
    "fused-gelu": ((44.0, 10.0, 0.0), (44.0 / 3, 10.0 / 3, 0.0)),
    "fused-swiglu": ((52.0, 16.0, 8.0), (52.0 / 3, 16.0 / 3, 8.0 / 3)),
}
"""Bytes per token per decoder block that the memory-bound ops move (inputs plus outputs). "eager":
counted with the simulator's op classifier (backends/sim/_trace.py `_op_kind`, `_tensor_bytes`) around
transformers' LlamaDecoderLayer (fp32-upcast RMSNorm, rotate-half rotary, SwiGLU, residual adds, SDPA),
least squares over six shapes (within 0.6% of each count; llama-7b's full trace: 2.26 MB per token per
block against 2.22). "fused-*": kernel by kernel, each reading its inputs and writing its outputs once:
llm-foundry's MPT block (one LayerNorm kernel, GELU, bias inside its flash kernel) and TinyLlama's
(fused RMSNorm, rotary, SwiGLU, flash-attention 2); forward a third (not counted). docs/COSTMODEL.md,
"Memory-bound work, attention and hardware facts"."""


def attention_kernel_tflops(gpu: GPUSpec, kernel: str, *, span: int, head_dim: int,
                            speedup: float | None = None) -> float | None:
    """The published fwd + bwd rate (TFLOP/s, the kernel's own count) of `kernel` on `gpu` at this many
    keys per query and head dim: interpolated in log2 of the sequence between the measured 512..16k
    (flat beyond), linearly in the head dim between 64 and 128 (flat beyond), at the GPU's peak over
    the measured part's, times the kernel's ATTENTION_KERNEL_SPEEDUP (`speedup` replaces it: the
    leave-one-out checks refit it). None where no figure covers the GPU's family."""
    if speedup is None:
        speedup = ATTENTION_KERNEL_SPEEDUP.get(kernel, 1.0)
    family = "a100" if gpu.name.startswith("a100") else "hopper" if gpu.name.startswith(("h100", "h200")) else None
    if family is None:
        return None
    measured = _measured_attention_tflops(ATTENTION_KERNEL_ON.get(kernel, {}).get(family, kernel), family,
                                          span, head_dim)
    return None if measured is None else measured * gpu.peak_tflops / ATTENTION_KERNEL_PEAK[family] * speedup


@functools.lru_cache(maxsize=4096)
def _measured_attention_tflops(kernel: str, family: str, span: int, head_dim: int) -> float | None:
    """ATTENTION_KERNEL_TFLOPS of (kernel, family) interpolated at `span` keys and `head_dim` (on the
    measured part; cached: the published checks' fits ask for the same rows thousands of times)."""
    table = ATTENTION_KERNEL_TFLOPS.get((kernel, family))
    if table is None:
        return None

    def at_seq(points) -> float:
        x = math.log2(max(span, 1))
        if x <= math.log2(points[0][0]):
            return points[0][1]
        for (s0, r0), (s1, r1) in zip(points, points[1:]):
            if x <= math.log2(s1):
                w = (x - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
                return r0 + w * (r1 - r0)
        return points[-1][1]

    lo, hi = at_seq(table[64]), at_seq(table[128])
    w = min(max((head_dim - 64) / 64, 0.0), 1.0)
    return lo + w * (hi - lo)


EAGER_SCORE_BYTES = (60.5, 32.5)
"""Bytes transformers' eager attention moves per score (batch x heads x seq x keys, the full square) per decoder
block, bf16, forward + backward, then forward alone (a checkpointed block's recompute): the mask add, the fp32
softmax and its casts, dropout where set, and their gradients, beyond what SDPA's attention moves. Counted with
the simulator's op classifier (backends/sim/_trace.py `_op_kind`, `_tensor_bytes`) on micro-llama's blocks, eager
less SDPA, 2 and 4 layers, at 256 and 512 tokens: a x seq^2 + b x seq per head, a taken (2026-11-29;
tests/test_attention.py recounts it on another model)."""


def eager_score_bytes(*, scores: float, blocks: int, recomputed: int) -> float:
    """EAGER_SCORE_BYTES of `scores` score elements per block, over `blocks` blocks, `recomputed` of them run
    forward again (bf16; a caller scales by the compute dtype)."""
    return scores * (blocks * EAGER_SCORE_BYTES[0] + recomputed * EAGER_SCORE_BYTES[1])


def memory_bytes_per_token(kernels: str, *, hidden: int, ffn: int, kv_width: int, forward: bool = False) -> float:
    """MEMORY_BYTES_PER_TOKEN of one decoder block, bf16 (forward alone: what a checkpointed block's
    recompute moves again)."""
    a, b, c = MEMORY_BYTES_PER_TOKEN[kernels][1 if forward else 0]
    return a * hidden + b * ffn + c * kv_width


def compute_peak_tflops(gpu: GPUSpec, precision: str = "bf16") -> float:
    """The data-sheet peak a step's matmuls run at: the tensor cores' 16-bit peak, or under fp32 the
    CUDA cores' (`GPUSpec.fp32_tflops`): torch's default float32 matmul precision ("highest") keeps TF32
    off, and autotune's fp32 trials keep that default. The 16-bit peak where the catalog has no fp32 one."""
    if precision == "fp32" and gpu.fp32_tflops:
        return gpu.fp32_tflops
    return gpu.peak_tflops


def estimate_basis(gpu: GPUSpec, efficiency: float, precision: str = "bf16") -> str:
    """What an estimated figure is and on what, for `Figure.basis`; `efficiency` the fraction of
    peak the step's FLOPs were taken to run at."""
    top = MATMUL_EFFICIENCY.get(gpu.name, DEFAULT_MATMUL_EFFICIENCY)
    peak = compute_peak_tflops(gpu, precision)
    if precision != "fp32":
        what = f"{peak:g} TFLOP/s"
    elif gpu.fp32_tflops:
        what = f"{peak:g} TFLOP/s in fp32, on CUDA cores with TF32 off as torch's default"
    else:
        what = f"{peak:g} TFLOP/s, the 16-bit peak: no fp32 figure in the catalog"
    return (f"estimated: roofline on {gpu.name} data-sheet figures ({what}, "
            f"{gpu.intra_node_gbps:g}/{gpu.inter_node_gbps:g} GB/s intra/inter-node, collectives at "
            f"{INTRA_NODE_BUS_EFFICIENCY:g}x of them, a ring across whole nodes on all of a node's NICs) at "
            f"{efficiency:.0%} compute efficiency ({top:.0%} on large micro-batches {REFERENCE_HIDDEN} wide, less on "
            f"narrower models and fewer tokens per micro-batch)")


ESTIMATE_BASIS = {
    "time": "estimated: roofline (compute at calibrated matmul efficiency, ring collectives, "
            "overlap, PCIe offload, CPU AdamW) on the GPU catalog's data-sheet figures",
    "memory": "estimated: closed-form FSDP2 memory per rank (model states, gathered blocks, "
              "activations, logits) plus runtime overhead margins",
    "runtime_overhead": "estimated: CUDA context, NCCL, cuBLAS workspaces and allocator fragmentation, "
                        "term by term (autotune/estimate/runtime_memory.py)",
    "host_memory": "estimated: offloaded fp32 parameters, gradients and AdamW state of every "
                   "rank on the node, plus pinned staging",
}
"""Basis strings for `Figure(basis=...)`, by what the figure is."""


@dataclass(frozen=True, kw_only=True)
class StepWork:
    """The work of one optimizer step on one GPU, as counted by a backend."""

    flops_per_gpu: float
    """FLOPs per optimizer step, recomputation included."""
    tokens_per_step: int
    """Global tokens per optimizer step (all GPUs, all micro-batches)."""
    num_microbatches: int = 1
    allgather_bytes_per_gpu: float = 0.0
    """Unsharded bytes each GPU all-gathers per step (the (n-1)/n ring factor is applied later)."""
    reduce_scatter_bytes_per_gpu: float = 0.0
    """Unsharded gradient bytes each GPU reduce-scatters per step."""
    host_to_device_bytes: float = 0.0
    device_to_host_bytes: float = 0.0
    cpu_optimizer_params: int = 0
    """Parameters this GPU's rank steps on the host (CPU offload), 0 otherwise: also the gradient
    elements it copies back each micro-batch."""
    offload_fresh_page_bytes: float = 0.0
    """CPU offload: bytes of those gradient shards in tensors of at least HOST_MMAP_THRESHOLD_BYTES
    (fresh_page_bytes), whose copy faults in fresh pages each accumulating micro-batch."""
    model_flops_per_gpu: float | None = None
    """FLOPs without recomputation, for MFU; None means `flops_per_gpu` (then MFU is HFU)."""
    num_fsdp_units: int | None = None
    """FSDP groups per micro-batch (blocks + root). Their first all-gather and last
    reduce-scatter cannot overlap compute; None leaves that term out."""
    backward_allgather_bytes_per_gpu: float = 0.0
    """The part of `allgather_bytes_per_gpu` that backward gathers again (blocks resharded after
    forward): what resharding to smaller groups moves onto the group's links."""
    dispatched_ops_per_microbatch: float = 0.0
    """Ops the host dispatches per micro-batch (counted in the trace, recomputation included);
    0 where nothing counted them (the closed form, the published runs): then no host term."""
    hidden_size: int = 0
    """The model's hidden size, for the compute efficiency's width term (0: not known)."""
    all_to_all_bytes_per_gpu: float = 0.0
    """Bytes each GPU sends to other GPUs by all-to-all per step (expert parallelism: the routed
    tokens to their experts and back, `expert_all_to_all_bytes`); on the critical path, not hidden."""
    all_to_all_inter_node: bool = False
    """Whether the all-to-all's group spans nodes."""
    attention_flops_per_gpu: float = 0.0
    """The part of `flops_per_gpu` that is attention's score and value products (S x S, counted like
    the rest: full square, backward twice forward, a checkpointed block's forward again): costed at the
    attention kernel's published rate instead of the matmul efficiency where ATTENTION_KERNEL_TFLOPS
    has the GPU (0: nothing counted apart, all FLOPs at the matmul efficiency)."""
    attention_kernel_flops_per_gpu: float = 0.0
    """The same work as the flash kernels execute and their benchmarks count it (causal: half the
    square; backward 2.5x forward, its recompute of the scores included; a checkpointed block's forward
    again): the FLOPs the published rate is a rate of."""
    attention_span: int = 0
    """Keys per query of the attention (the sequence length), where the kernel's rate depends on it."""
    attention_head_dim: int = 0
    attention_kernel: str = "flash2"
    """Which kernel runs attention: "flash2" (FlashAttention-2: PyTorch SDPA's flash backend since
    torch 2.2, the flash-attn package) or "triton" (the Triton flash kernel of flash-attn 1, which
    llm-foundry's MPT ran)."""
    memory_bytes_per_gpu: float = 0.0
    """HBM bytes the memory-bound ops (everything but matmuls, attention kernels and collectives) move
    per step, at the GPU's data-sheet bandwidth (0: not counted)."""
    precision: str = "bf16"
    """The trial's precision (config.PRECISIONS): "fp32" runs its matmuls at the GPU's fp32 peak
    (compute_peak_tflops) and attention without a flash kernel (FlashAttention is 16-bit only)."""
    tensor_parallel: int = 1
    """GPUs that split each block's linears (parallel/tensor.py) and share one batch: FSDP's rings
    run over the GPUs / tensor_parallel data ranks."""
    tp_all_reduce_bytes_per_gpu: float = 0.0
    """Bytes each GPU all-reduces within its tensor-parallel group per step (tp_all_reduce_bytes),
    before the ring factor; on the critical path (no async TP): the next layer waits for them."""
    async_tensor_parallel: bool = False
    """Async TP (knobs): each of `tp_overlap`'s collectives runs in tp chunks under the matmul it is fused with."""
    tp_overlap: tuple[tuple[float, float, float], ...] = ()
    """The tensor-parallel collectives beside the matmuls async TP fuses them with (tp_exchanges): (how many per
    step, bytes of the whole tensor one collective gathers or scatters, FLOPs of that matmul on one GPU)."""
    context_parallel: int = 1
    """GPUs that split each sequence (parallel/context.py) and share one batch; FSDP still shards over every GPU."""
    cp_ring_bytes_per_gpu: float = 0.0
    """Bytes each GPU sends round its context-parallel ring per step (cp_ring_bytes), counted as not
    overlapped with attention (an upper bound on the time: torch's ring overlaps the next send)."""
    pipeline_parallel: int = 1
    """Pipeline stages' worth of ranks (parallel/pipeline.py): each GPU holds a share of the decoder blocks and
    runs every micro-batch through it (the accumulation steps are the pipeline's micro-batches); FSDP's rings run
    over the GPUs / (tensor_parallel x pipeline_parallel) data ranks of a stage. 1: none, and nothing below counts."""
    pipeline_schedule: str = "1F1B"
    """The schedule (knobs.PIPELINE_SCHEDULES), for the bubble's label; its size is pipeline_virtual_stages'."""
    pipeline_virtual_stages: int = 1
    """Stages each rank holds (Interleaved1F1B: v > 1, the bubble shrinks v-fold: pipeline_bubble_ratio)."""
    pp_p2p_bytes_per_gpu: float = 0.0
    """Bytes each GPU sends to its neighbouring stages per step (pp_p2p_bytes): activations forward, their
    gradients backward."""
    pp_p2p_inter_node: bool = False
    """Whether consecutive stages sit on different nodes (pp outermost in the mesh: world/pp ranks apart)."""


CP_RING_GRADIENT_BYTES = 4
"""Bytes an element of the key and value gradients takes round the context-parallel ring: torch's ring
accumulates them in fp32 and sends them so (`_cp_options.convert_to_f32`, True by default;
torch/distributed/tensor/experimental/_context_parallel/_attention.py, torch 2.13)."""


def cp_ring_bytes(*, tokens_per_microbatch: int, kv_width: int, activation_bytes: int, num_blocks: int,
                  context_parallel: int, checkpointed_blocks: int = 0, num_microbatches: int = 1) -> float:
    """Bytes one GPU receives round its context-parallel ring per step (torch 2.13's ring attention): each
    attention's forward all-gathers the key and value shards (tokens / cp x kv_width each; cp - 1 of each
    arrive), and so does its backward, which also passes the key and value gradients on to the next rank at each
    of its cp steps, in fp32 (CP_RING_GRADIENT_BYTES); a checkpointed block's recompute repeats the forward.
    Counted against torch's own collectives in tests/test_context_parallel.py."""
    if context_parallel <= 1:
        return 0.0
    shard = tokens_per_microbatch / context_parallel * kv_width  # elements of one of K, V on a GPU
    gathered = (context_parallel - 1) * 2 * shard * activation_bytes  # one all-gather of K and V
    gradients = context_parallel * 2 * shard * CP_RING_GRADIENT_BYTES  # dK, dV passed on at every ring step
    return float((gathered * (2 * num_blocks + checkpointed_blocks) + gradients * num_blocks) * num_microbatches)


def tp_all_reduce_bytes(*, tokens_per_microbatch: int, hidden_size: int, activation_bytes: int, num_blocks: int,
                        tensor_parallel: int, checkpointed_blocks: int = 0, num_microbatches: int = 1,
                        float8_gathers: bool = False) -> float:
    """Bytes one GPU all-reduces within its tensor-parallel group per step (parallel/tensor.py, torch's
    Colwise/RowwiseParallel without sequence parallelism): each block's two row-wise linears (attention's
    output, the MLP's down projection) all-reduce their output in forward, the two column-wise inputs
    (q/k/v, gate/up) their input's gradient in backward, and a checkpointed block's recompute repeats
    the forward two; each a micro-batch's tokens x hidden in the compute dtype. Under sequence parallelism
    each all-reduce is a reduce-scatter and an all-gather moving as much; `float8_gathers` (tensorwise float8:
    torchao gathers the inputs in forward and the output gradients in backward in float8, counted in
    tests/test_float8.py::test_tensorwise_float8_tensor_parallelism_gathers_in_float8) makes the all-gather
    half one byte an element, the reduce-scatter half staying in the compute dtype."""
    if tensor_parallel <= 1:
        return 0.0
    exchanges = 4 * num_blocks + 2 * checkpointed_blocks
    per_element = (1 + activation_bytes) / 2 if float8_gathers else activation_bytes
    return float(tokens_per_microbatch * hidden_size * per_element * exchanges * num_microbatches)


def tp_exchanges(*, tokens_per_microbatch: int, hidden_size: int, q_width: int, kv_width: int, mlp_in_width: int,
                 ffn: int, activation_bytes: int, num_blocks: int, tensor_parallel: int, checkpointed_blocks: int = 0,
                 num_microbatches: int = 1, float8_gathers: bool = False,
                 gathers_fuse: bool = True) -> tuple[tuple[float, float, float], ...]:
    """tp_all_reduce_bytes's collectives one by one (StepWork.tp_overlap), each with the FLOPs of the matmul
    inductor's micro-pipeline pass fuses it with under async TP (torch's fused_all_gather_matmul and
    fused_matmul_reduce_scatter), 0 where the pass cannot (torch/_inductor/fx_passes/micro_pipeline_tp.py, torch
    2.13). Per block and micro-batch, forward all-gathers the attention's and the MLP's input into q/k/v and
    gate/up (fused) and reduce-scatters o's and down's outputs (fused: each a matmul's own output); backward
    all-gathers the output gradients o and down take into their input-gradient matmuls (fused), and
    reduce-scatters the input gradients of q/k/v and gate/up, which are sums of several matmuls' (not fused: the
    pass needs the reduce-scatter's input to be one matmul's output); a checkpointed block's recompute repeats the
    forward four. `mlp_in_width`: gate and up's outputs together (2 x ffn where gated). Gathers carry one byte an
    element under tensorwise float8 (`float8_gathers`), as tp_all_reduce_bytes counts them; the sum of count x
    bytes is twice tp_all_reduce_bytes (each exchange there an all-reduce's reduce-scatter and all-gather).
    `gathers_fuse` False: no all-gather is fused (rowwise float8: the gathered bf16 tensor is cast to float8 before
    its scaled matmul, and the pass fuses an all-gather only into the matmuls that take its output)."""
    if tensor_parallel <= 1:
        return ()
    tokens, tp = tokens_per_microbatch, tensor_parallel
    gathered = float(tokens * hidden_size * (1 if float8_gathers else activation_bytes))
    scattered = float(tokens * hidden_size * activation_bytes)
    qkv = 2.0 * tokens * hidden_size * (q_width + 2 * kv_width) / tp
    out = 2.0 * tokens * q_width * hidden_size / tp
    up = 2.0 * tokens * hidden_size * mlp_in_width / tp
    down = 2.0 * tokens * ffn * hidden_size / tp
    forward = float((num_blocks + checkpointed_blocks) * num_microbatches)
    backward = float(num_blocks * num_microbatches)
    fused = 1.0 if gathers_fuse else 0.0  # an all-gather's matmul, where the pass fuses one
    return ((forward, gathered, fused * qkv), (forward, scattered, out), (forward, gathered, fused * up),
            (forward, scattered, down), (backward, scattered, 0.0), (backward, gathered, fused * out),
            (backward, scattered, 0.0), (backward, gathered, fused * down))


def async_tp_exposed_seconds(exchanges, *, tensor_parallel: int, link_gbps: float, matmul_tflops: float) -> float:
    """Seconds async TP leaves exposed of `exchanges`' collectives (tp_exchanges): each fused one runs as tp
    chunks, the local chunk's matmul first while the next arrives (all-gather) or the previous leaves
    (reduce-scatter), so what waits is the collective's (tp - 1) / tp of the bytes beyond the matmul's (tp - 1) / tp
    of its time: max(0, comm - matmul x (tp - 1) / tp); one fused with no matmul waits whole, as without async TP.
    The chunked matmuls are taken at the whole one's rate (matmul_tflops) and the copy engines' transfers as
    contending for nothing: the overlap's upper bound."""
    tp = tensor_parallel
    share = (tp - 1) / tp
    exposed = 0.0
    for count, nbytes, flops in exchanges:
        comm = nbytes * share / (link_gbps * 1e9)
        matmul = flops / (matmul_tflops * 1e12)
        exposed += count * max(0.0, comm - matmul * share)
    return exposed


PIPELINE_BUBBLE_SOURCE = ("Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
                          "Megatron-LM' (arXiv 2104.04473), section 2.2")


def pipeline_bubble_ratio(*, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The pipeline bubble over the ideal time, t_pb / t_id (Narayanan et al. 2021, section 2.2.1: GPipe and 1F1B
    both idle (p - 1)(t_f + t_b) per step against m(t_f + t_b) of work, so (p - 1) / m; section 2.2.2: the
    interleaved schedule with v stages per rank, (p - 1) / (v m)). A step takes the ideal time x (1 + this); the
    bubble's share of the step is (p - 1) / (v m + p - 1). `stages` p the ranks of a pipeline, `microbatches` m.
    Checked against torch's own schedules (tests/test_costmodel_pipeline.py: their action lists run with
    t_b = 2 t_f), which match it for GPipe and 1F1B at any m, and for Interleaved1F1B where m is a multiple of p."""
    if stages <= 1:
        return 0.0
    if microbatches < 1 or virtual_stages < 1:
        raise ValueError("microbatches and virtual_stages must be >= 1")
    return (stages - 1) / (virtual_stages * microbatches)


def pipeline_in_flight(schedule: str, *, stages: int, microbatches: int, rank: int = 0,
                       virtual_stages: int = 1) -> int:
    """Micro-batches (stage chunks, under an interleaved schedule) whose activations pipeline rank `rank` holds at
    once at its peak, as torch.distributed.pipelining's schedules run them (schedules.py): GPipe all m forwards
    before any backward; 1F1B min(m, p - rank) (Schedule1F1B's warm-up, then one forward before the first
    backward); Interleaved1F1B its warm-up forwards (_get_warmup_ops: (v - 1) x micro-batches per round + 2(p - 1
    - rank), at most v m) and the 1F1B phase's first forward, at most v m chunks in all."""
    p, m, v = stages, microbatches, virtual_stages
    if schedule == "GPipe":
        return m * v
    if schedule == "1F1B":
        return min(m, p - rank)
    if schedule == "Interleaved1F1B":
        rounds = max(1, m // p)
        per_round = m // rounds
        warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
        return min(warmup + 1, m * v)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def pipeline_stage_layers(num_layers: int, stages: int) -> list[int]:
    """Decoder blocks of each of `stages` contiguous stages (pp x v, in order): as even as whole blocks allow, the
    extra ones on the middle stages before the first and the last, which also hold the embeddings and the head
    (torchtitan's generated split points give the first and last stages the fewer blocks; Llama 3's pipeline one
    block fewer on each). Up to two stages more than blocks: the first and last then hold no block (Llama 3's
    embedding-only first chunk and head-only last chunk)."""
    if stages < 1 or stages > num_layers + 2:
        raise ValueError(f"{stages} stages need at least {stages - 2} decoder blocks, and there are {num_layers}")
    if stages == 1:
        return [num_layers]
    if stages > num_layers:
        return [0] + [1] * num_layers + [0] * (stages - 1 - num_layers)
    base, extra = divmod(num_layers, stages)
    order = list(range(1, stages - 1)) + [0, stages - 1]  # who takes an extra block first
    layers = [base] * stages
    for i in order[:extra]:
        layers[i] += 1
    return layers


def pp_p2p_bytes(*, tokens_per_microbatch: int, hidden_size: int, activation_bytes: int, num_microbatches: int,
                 virtual_stages: int = 1, tensor_parallel: int = 1, context_parallel: int = 1) -> float:
    """Bytes one GPU sends to its neighbouring stages per step: each of its v stages sends every micro-batch's output
    activations on (tokens x hidden in the compute dtype, a tp x cp-th of them: each GPU of a stage's tensor- and
    context-parallel group sends its own shard) and, backward, their gradient of the same size back. The first
    stage sends no gradient and the last no activation: counted as every stage's, an upper bound by 1/(p v)."""
    per_microbatch = tokens_per_microbatch * hidden_size * activation_bytes / (tensor_parallel * context_parallel)
    return float(2 * per_microbatch * num_microbatches * virtual_stages)


def expert_all_to_all_bytes(*, tokens_per_microbatch: int, experts_per_token: int, hidden_size: int,
                            activation_bytes: int, moe_layers: int, expert_parallel: int,
                            checkpointed_moe_layers: int = 0, num_microbatches: int = 1) -> float:
    """Bytes one GPU sends to the others by all-to-all per step under expert parallelism over
    `expert_parallel` GPUs (parallel.ExpertDispatch): every MoE layer sends its tokens x top-k rows
    (hidden wide, in the compute dtype) to the experts' GPUs and gets the outputs back, in forward
    and, as gradients, in backward (4 exchanges), and a checkpointed block's recompute repeats the
    forward two. Balanced routing: (ep - 1)/ep of the rows leave the GPU (the simulator's assumption)."""
    if expert_parallel <= 1 or not moe_layers:
        return 0.0
    rows = tokens_per_microbatch * experts_per_token * hidden_size * activation_bytes
    exchanges = 4 * moe_layers + 2 * checkpointed_moe_layers
    return float(rows * exchanges * (expert_parallel - 1) / expert_parallel * num_microbatches)


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Estimated time of one optimizer step and what it is made of (seconds)."""

    seconds: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    offload_s: float
    cpu_optimizer_s: float
    tokens_per_sec: float
    """Whole-job tokens per second."""
    mfu: float
    """Model FLOPs utilisation against the data-sheet peak."""
    basis: str
    host_s: float = 0.0
    """The host's time to dispatch the step's ops (0 where they were not counted)."""
    host_bound: bool = False
    """The host's time exceeds the GPU's compute: the step waits on Python, not on the GPU."""
    gpu_compute_s: float = 0.0
    """The GPU's time for the step's FLOPs (compute_s is the longer of it and host_s)."""
    offload_accumulate_s: float = 0.0
    """CPU offload: the host's blocking gradient copies and adds of the accumulating micro-batches
    (offload_accumulate_seconds), which the GPU waits for."""
    attention_s: float = 0.0
    """The part of gpu_compute_s that is the attention kernel's (0 where attention was costed as matmuls)."""
    pp_bubble_s: float = 0.0
    """Pipeline parallelism: the bubble, the stage's idle time while the pipeline fills and drains
    (pipeline_bubble_ratio of its compute and tensor/context-parallel time); 0 without a pipeline."""
    pp_p2p_s: float = 0.0
    """Pipeline parallelism: the stage-to-stage sends on the critical path (exposed; all of them are in comm_s)."""

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True, kw_only=True)
class CollectiveVolume:
    """FSDP2 bytes per GPU per optimizer step, unsharded sizes (before the ring factor)."""

    allgather_bytes: float
    reduce_scatter_bytes: float


def collective_bytes(*, block_params: int, num_blocks: int, root_params: int, param_bytes: int,
                     reduce_bytes: int = 4, reshard_after_forward: bool = True,
                     num_microbatches: int = 1, trainable: tuple[int, int] | None = None) -> CollectiveVolume:
    """FSDP2 collective volume per GPU per optimizer step.

    Per micro-batch: forward all-gathers every block and the root in the parameter dtype;
    backward all-gathers the blocks again when they were resharded after forward (the root
    never is); backward reduce-scatters every gradient in `reduce_bytes` (fp32 here): of the
    `trainable` (block, root) parameters only where some are frozen (LoRA: FSDP2 reduces the
    parameters that have gradients). Gradients are reduced after every micro-batch (no deferred
    sync), so all of it repeats per micro-batch. Activation checkpointing adds no collective:
    recomputation runs while the backward all-gather holds the block's parameters.
    """
    if min(block_params, num_blocks, root_params) < 0 or num_microbatches < 1:
        raise ValueError("parameter counts must be >= 0 and num_microbatches >= 1")
    blocks = block_params * num_blocks
    gathers_per_block = 2 if reshard_after_forward else 1
    allgather = (blocks * gathers_per_block + root_params) * param_bytes
    block_grads, root_grads = trainable if trainable is not None else (block_params, root_params)
    reduce_scatter = (block_grads * num_blocks + root_grads) * reduce_bytes
    return CollectiveVolume(allgather_bytes=float(allgather * num_microbatches),
                            reduce_scatter_bytes=float(reduce_scatter * num_microbatches))


def offload_bytes(*, block_params: int, num_blocks: int, root_params: int, num_gpus: int,
                  reshard_after_forward: bool = True, num_microbatches: int = 1,
                  trainable: tuple[int, int] | None = None) -> tuple[float, float]:
    """(host->device, device->host) bytes per GPU per step under FSDP2's CPUOffloadPolicy.

    The fp32 shard is copied to the device before every all-gather of it and the fp32 reduced
    gradient shard of each `trainable` (block, root) parameter back after every reduce-scatter.
    """
    blocks = block_params * num_blocks
    gathers_per_block = 2 if reshard_after_forward else 1
    block_grads, root_grads = trainable if trainable is not None else (block_params, root_params)
    h2d = (blocks * gathers_per_block + root_params) * 4 / num_gpus
    d2h = (block_grads * num_blocks + root_grads) * 4 / num_gpus
    return float(h2d * num_microbatches), float(d2h * num_microbatches)


def fsdp_step_work(*, flops_per_gpu: float, model_flops_per_gpu: float, tokens_per_gpu_step: int,
                   num_gpus: int, block_params: int, num_blocks: int, root_params: int, param_bytes: int,
                   reshard_after_forward: bool = True, cpu_offload: bool = False,
                   num_microbatches: int = 1, dispatched_ops_per_microbatch: float = 0.0,
                   hidden_size: int = 0, reduce_bytes: int = 4,
                   trainable: tuple[int, int] | None = None, float8_block_params: int = 0,
                   all_to_all_bytes: float = 0.0, all_to_all_inter_node: bool = False,
                   attention: dict | None = None, precision: str = "bf16",
                   offload_fresh_page_bytes: float = 0.0, tensor_parallel: int = 1,
                   tp_all_reduce_bytes: float = 0.0, async_tensor_parallel: bool = False,
                   tp_overlap: tuple[tuple[float, float, float], ...] = (), context_parallel: int = 1,
                   cp_ring_bytes: float = 0.0, pipeline_parallel: int = 1, pipeline_schedule: str = "1F1B",
                   pipeline_virtual_stages: int = 1, pp_p2p_bytes: float = 0.0, pp_p2p_inter_node: bool = False,
                   pipeline_stage_blocks: int = 0, pipeline_root_params: int = 0) -> StepWork:
    """The `StepWork` of a full-sharded FSDP2 step from what a backend counted: FLOPs, sizes;
    gradients reduced in `reduce_bytes` per element (fp32, FSDP2's default here), of the
    `trainable` (block, root) parameters where some are frozen (LoRA), which alone the optimizer steps.
    `float8_block_params`: parameters of each block all-gathered in float8 (tensorwise float8 with
    FSDP2's float8 all-gather: 1 byte each instead of `param_bytes`). `tensor_parallel` > 1: `num_gpus`
    counts every GPU, `tokens_per_gpu_step` what each tensor-parallel group takes, and each GPU gathers,
    reduces and steps its 1/tensor_parallel of the blocks' parameters (block_params: the whole block's).
    `context_parallel` > 1: `tokens_per_gpu_step` what each context-parallel group takes; parameters stay
    sharded over every GPU. `pipeline_parallel` > 1: the GPU costed holds `pipeline_stage_blocks` of the blocks and
    `pipeline_root_params` of the root's parameters (embeddings on the first stage, norm and head on the last) and
    FSDP shards them over its stage's num_gpus / (tensor_parallel x pipeline_parallel) data ranks; the FLOPs given are
    that GPU's (the slowest stage's, which sets the pace), `tokens_per_gpu_step` what each pipeline takes. As torch's
    PipelineStage runs FSDP2, the micro-batches accumulate unsharded gradients without reducing them
    (set_requires_gradient_sync(False) until the last backward), so the stage's gradients are reduce-scattered
    once per step, and its parameters all-gathered once per step when not resharded after forward (torchtitan's
    default under PP), else about once per micro-batch and once more (m + 1 gathers: each backward re-gathers what
    forward resharded; backward keeps them gathered for the next forward)."""
    tp = tensor_parallel
    if pipeline_parallel > 1:
        return _pipeline_step_work(
            flops_per_gpu=flops_per_gpu, model_flops_per_gpu=model_flops_per_gpu, tokens_per_gpu_step=tokens_per_gpu_step,
            num_gpus=num_gpus, block_params=block_params // tp, num_blocks=pipeline_stage_blocks,
            root_params=pipeline_root_params, param_bytes=param_bytes, reshard_after_forward=reshard_after_forward,
            num_microbatches=num_microbatches, dispatched_ops_per_microbatch=dispatched_ops_per_microbatch,
            hidden_size=hidden_size, reduce_bytes=reduce_bytes, float8_block_params=float8_block_params,
            attention=attention, precision=precision, tensor_parallel=tp, tp_all_reduce_bytes=tp_all_reduce_bytes,
            context_parallel=context_parallel, cp_ring_bytes=cp_ring_bytes, pipeline_parallel=pipeline_parallel,
            pipeline_schedule=pipeline_schedule, pipeline_virtual_stages=pipeline_virtual_stages,
            pp_p2p_bytes=pp_p2p_bytes, pp_p2p_inter_node=pp_p2p_inter_node, cpu_offload=cpu_offload,
            trainable=trainable, all_to_all_bytes=all_to_all_bytes, all_to_all_inter_node=all_to_all_inter_node)
    if tp > 1:
        block_params //= tp
        trainable = (trainable[0] // tp, trainable[1]) if trainable is not None else None
    sizes = dict(block_params=block_params, num_blocks=num_blocks, root_params=root_params,
                 reshard_after_forward=reshard_after_forward, num_microbatches=num_microbatches,
                 trainable=trainable)
    volume = collective_bytes(param_bytes=param_bytes, reduce_bytes=reduce_bytes, **sizes)
    h2d, d2h = offload_bytes(num_gpus=num_gpus, **sizes) if cpu_offload else (0.0, 0.0)
    block_grads, root_grads = trainable if trainable is not None else (block_params, root_params)
    total_params = root_grads + num_blocks * block_grads
    gathers = 2 if reshard_after_forward else 1
    float8_saved = float(float8_weight_bytes_saved(float8_block_params, param_bytes) * num_blocks * num_microbatches)
    return StepWork(
        flops_per_gpu=flops_per_gpu, model_flops_per_gpu=model_flops_per_gpu,
        tokens_per_step=tokens_per_gpu_step * (num_gpus // (tp * context_parallel)), num_microbatches=num_microbatches,
        allgather_bytes_per_gpu=volume.allgather_bytes - gathers * float8_saved,
        reduce_scatter_bytes_per_gpu=volume.reduce_scatter_bytes,
        host_to_device_bytes=h2d, device_to_host_bytes=d2h,
        cpu_optimizer_params=-(-total_params // (num_gpus // tp)) if cpu_offload else 0,
        offload_fresh_page_bytes=offload_fresh_page_bytes if cpu_offload else 0.0,
        backward_allgather_bytes_per_gpu=float(block_params * num_blocks * param_bytes * num_microbatches) - float8_saved
        if reshard_after_forward else 0.0,
        num_fsdp_units=num_blocks + 1, dispatched_ops_per_microbatch=dispatched_ops_per_microbatch,
        hidden_size=hidden_size, all_to_all_bytes_per_gpu=all_to_all_bytes, all_to_all_inter_node=all_to_all_inter_node,
        precision=precision, tensor_parallel=tp, tp_all_reduce_bytes_per_gpu=tp_all_reduce_bytes,
        async_tensor_parallel=async_tensor_parallel, tp_overlap=tp_overlap,
        context_parallel=context_parallel, cp_ring_bytes_per_gpu=cp_ring_bytes, **(attention or {}),
    )


def _pipeline_step_work(*, flops_per_gpu: float, model_flops_per_gpu: float, tokens_per_gpu_step: int, num_gpus: int,
                        block_params: int, num_blocks: int, root_params: int, param_bytes: int,
                        reshard_after_forward: bool, num_microbatches: int, dispatched_ops_per_microbatch: float,
                        hidden_size: int, reduce_bytes: int, float8_block_params: int, attention: dict | None,
                        precision: str, tensor_parallel: int, tp_all_reduce_bytes: float, context_parallel: int,
                        cp_ring_bytes: float, pipeline_parallel: int, pipeline_schedule: str,
                        pipeline_virtual_stages: int, pp_p2p_bytes: float, pp_p2p_inter_node: bool, cpu_offload: bool,
                        trainable: tuple[int, int] | None, all_to_all_bytes: float,
                        all_to_all_inter_node: bool) -> StepWork:
    """fsdp_step_work under pipeline parallelism (its docstring): `block_params` already a tensor-parallel GPU's
    share, `num_blocks` and `root_params` the costed GPU's stage's."""
    if cpu_offload or trainable is not None:
        raise ValueError("pipeline parallelism is costed without CPU offload and LoRA (knobs refuses them together)")
    tp, cp, pp, m = tensor_parallel, context_parallel, pipeline_parallel, num_microbatches
    stage_params = block_params * num_blocks + root_params
    gathers = m + 1 if reshard_after_forward else 1
    float8_saved = float(float8_weight_bytes_saved(float8_block_params, param_bytes) * num_blocks)
    allgather = gathers * (stage_params * param_bytes - float8_saved)
    return StepWork(
        flops_per_gpu=flops_per_gpu, model_flops_per_gpu=model_flops_per_gpu,
        tokens_per_step=tokens_per_gpu_step * (num_gpus // (tp * cp * pp)), num_microbatches=m,
        allgather_bytes_per_gpu=float(allgather), reduce_scatter_bytes_per_gpu=float(stage_params * reduce_bytes),
        backward_allgather_bytes_per_gpu=float(m * (block_params * num_blocks * param_bytes - float8_saved))
        if reshard_after_forward else 0.0,
        num_fsdp_units=num_blocks + 1, dispatched_ops_per_microbatch=dispatched_ops_per_microbatch,
        hidden_size=hidden_size, all_to_all_bytes_per_gpu=all_to_all_bytes, all_to_all_inter_node=all_to_all_inter_node,
        precision=precision, tensor_parallel=tp, tp_all_reduce_bytes_per_gpu=tp_all_reduce_bytes,
        context_parallel=cp, cp_ring_bytes_per_gpu=cp_ring_bytes, pipeline_parallel=pp,
        pipeline_schedule=pipeline_schedule, pipeline_virtual_stages=pipeline_virtual_stages,
        pp_p2p_bytes_per_gpu=pp_p2p_bytes, pp_p2p_inter_node=pp_p2p_inter_node, **(attention or {}),
    )


def host_link_gbps(gpu: GPUSpec) -> float:
    """Achieved pinned host<->device bandwidth, GB/s one direction."""
    return _PCIE_GBPS.get(gpu.name, _PCIE_GEN4_GBPS)


def activation_transfer_s(gpu: GPUSpec, *, moved_bytes: float, num_microbatches: int) -> float:
    """Activation offload's copies in one optimizer step: what each micro-batch's forward saved goes to
    the host and comes back, over the host link, on the compute stream (not overlapped: an upper
    bound, torchtune overlaps them on a side stream)."""
    return num_microbatches * 2 * moved_bytes / (host_link_gbps(gpu) * 1e9)


def matmul_efficiency(gpu: GPUSpec, tokens_per_microbatch: float, top: float | None = None, *,
                      hidden_size: int = 0, half_tokens: float | None = None,
                      half_hidden: float | None = None) -> float:
    """Fraction of peak FLOP/s reached with this many tokens per GPU per micro-batch on a model
    this wide (0: unknown, taken at REFERENCE_HIDDEN); the keywords replace the fitted constants."""
    top = MATMUL_EFFICIENCY.get(gpu.name, DEFAULT_MATMUL_EFFICIENCY) if top is None else top
    half_tokens = HALF_EFFICIENCY_TOKENS if half_tokens is None else half_tokens
    half_hidden = HALF_EFFICIENCY_HIDDEN if half_hidden is None else half_hidden
    width = hidden_size or REFERENCE_HIDDEN
    width_factor = (width / (width + half_hidden)) / (REFERENCE_HIDDEN / (REFERENCE_HIDDEN + half_hidden))
    return top * width_factor * tokens_per_microbatch / (tokens_per_microbatch + half_tokens)


def inter_node_ring_gbps(nic_gbps: float, *, gpus_per_node: int, intra_node_gbps: float,
                         whole_nodes: bool) -> float:
    """Achieved per-GPU rate of a collective across nodes, GB/s, from the rate one NIC reaches
    (`nic_gbps`, one NIC per GPU). A ring over every GPU of whole nodes runs a channel per NIC: each
    channel crosses each node boundary once, through its own NIC, so the ring's cross-node traffic
    spreads over the node's `gpus_per_node` NICs, up to the node's own links (NVLink), which every
    channel also crosses. A ring over one GPU per node (HSDP's replicas) and an all-to-all (each GPU
    sends its own share) have one NIC each (`whole_nodes=False`)."""
    if not whole_nodes:
        return nic_gbps
    return min(gpus_per_node * nic_gbps, intra_node_gbps)


def _link_gbps(cluster: Cluster, *, inter_node: bool, whole_nodes: bool = True,
               nic_bus_efficiency: float | None = None) -> float:
    """Achieved per-GPU ring bandwidth on the node's links or across nodes, GB/s (inter_node_ring_gbps)."""
    gpu = cluster.gpu
    intra = gpu.intra_node_gbps * INTRA_NODE_BUS_EFFICIENCY
    if not inter_node:
        return intra
    nic = gpu.inter_node_gbps * (NIC_BUS_EFFICIENCY if nic_bus_efficiency is None else nic_bus_efficiency)
    return inter_node_ring_gbps(nic, gpus_per_node=cluster.gpus_per_node, intra_node_gbps=intra,
                                whole_nodes=whole_nodes)


def _stage_ring_gbps(cluster: Cluster, *, stage_gpus: int, tensor_parallel: int,
                     nic_bus_efficiency: float | None = None) -> float:
    """Achieved per-GPU rate of a pipeline stage's FSDP ring, GB/s: its `stage_gpus` GPUs are consecutive (pp
    outermost), so the ring stays on NVLink where they fit in a node; else it crosses nodes with gpus_per_node /
    tensor_parallel of its GPUs on each node, one NIC each (inter_node_ring_gbps)."""
    gpu = cluster.gpu
    intra = gpu.intra_node_gbps * INTRA_NODE_BUS_EFFICIENCY
    if stage_gpus <= cluster.gpus_per_node:
        return intra
    nic = gpu.inter_node_gbps * (NIC_BUS_EFFICIENCY if nic_bus_efficiency is None else nic_bus_efficiency)
    return inter_node_ring_gbps(nic, gpus_per_node=max(cluster.gpus_per_node // tensor_parallel, 1),
                                intra_node_gbps=intra, whole_nodes=True)


def hsdp_comm_seconds(work: StepWork, cluster: Cluster, *, shard_group_size: int,
                      nic_bus_efficiency: float | None = None) -> tuple[float, float]:
    """(intra-node, inter-node) seconds of one step's collectives under HSDP: parameters sharded
    within groups of `shard_group_size` GPUs (consecutive ranks: a node, or whole nodes) and
    replicated across the r = n / size groups.

    The all-gathers and reduce-scatters run as rings within a group: on NVLink when the group
    fits in a node, else at the inter-node rate. Each reduced gradient shard (1/size of the
    gradient bytes) is then all-reduced across the groups, 2(r-1)/r of it on a ring (FSDP2 does
    it after every reduce-scatter), across nodes whenever there are several, each ring on its GPUs' own
    NICs (one GPU per node: inter_node_ring_gbps).
    """
    n, size = cluster.num_gpus, shard_group_size or cluster.num_gpus
    replicas = n // size
    seconds = {False: 0.0, True: 0.0}  # by inter_node
    group_inter = size > cluster.gpus_per_node
    group_bytes = (work.allgather_bytes_per_gpu + work.reduce_scatter_bytes_per_gpu) * (size - 1) / size
    seconds[group_inter] += group_bytes / (_link_gbps(cluster, inter_node=group_inter,
                                                      nic_bus_efficiency=nic_bus_efficiency) * 1e9)
    replicas_inter = cluster.num_nodes > 1
    allreduce_bytes = 2 * (replicas - 1) / replicas * work.reduce_scatter_bytes_per_gpu / size
    seconds[replicas_inter] += allreduce_bytes / (_link_gbps(cluster, inter_node=replicas_inter, whole_nodes=False,
                                                             nic_bus_efficiency=nic_bus_efficiency) * 1e9)
    return seconds[False], seconds[True]


def estimate_step_time(work: StepWork, cluster: Cluster, *, shard_group_size: int = 0, reshard_group_size: int = 0,
                       matmul_top_efficiency: float | None = None,
                       nic_bus_efficiency: float | None = None,
                       host_op_us: float | None = None, half_efficiency_tokens: float | None = None,
                       half_efficiency_hidden: float | None = None, attention_kernel_speedup: float | None = None,
                       describe: bool = True) -> StepTime:
    """Roofline time of one optimizer step on `cluster` (see the module docstring);
    `shard_group_size` > 0: HSDP (see hsdp_comm_seconds); `reshard_group_size` > 0: backward's
    all-gathers run in rings of that many GPUs (on the node's links when they fit in a node).
    `matmul_top_efficiency`, `nic_bus_efficiency`, the `half_efficiency_*` and
    `attention_kernel_speedup` (the work's kernel's) replace the fitted constants (leave-one-out
    validation refits them); `host_op_us` the host time per dispatched op
    (default HOST_OP_US). `describe=False` leaves `basis` empty: a fit evaluates a million
    estimates, and writing each one's sentence was half their time."""
    gpu = cluster.gpu
    tp, pp = work.tensor_parallel, work.pipeline_parallel
    n = cluster.num_gpus // (tp * pp)  # FSDP's ranks: a tensor-parallel group is one of them, of one pipeline stage
    tokens_per_microbatch = work.tokens_per_step / (work.num_microbatches * n)
    # A tensor-parallel GPU multiplies the same tokens by a tp-th of each weight: its matmuls keep their rows and
    # their contraction over the model's width (the column-wise ones) or their output width (the row-wise ones),
    # so they run at the model's width's efficiency, not a tp-times narrower model's (published FSDP x TP8 runs
    # of 8B and 70B came out 22-41% slower than measured with the narrower width: docs/KNOBS.md).
    efficiency = matmul_efficiency(gpu, tokens_per_microbatch, matmul_top_efficiency, hidden_size=work.hidden_size,
                                   half_tokens=half_efficiency_tokens, half_hidden=half_efficiency_hidden)
    # fp32: no flash kernel runs it (FlashAttention is 16-bit only), so attention is costed as matmuls.
    attention_rate = (attention_kernel_tflops(gpu, work.attention_kernel, span=work.attention_span,
                                              head_dim=work.attention_head_dim, speedup=attention_kernel_speedup)
                      if work.attention_kernel_flops_per_gpu and work.precision != "fp32" else None)
    peak_tflops = compute_peak_tflops(gpu, work.precision)
    matmul_flops = work.flops_per_gpu - (work.attention_flops_per_gpu if attention_rate else 0.0)
    gpu_compute_s = matmul_flops / (peak_tflops * 1e12 * efficiency)
    attention_s = work.attention_kernel_flops_per_gpu / (attention_rate * 1e12) if attention_rate else 0.0
    gpu_compute_s += attention_s
    if work.memory_bytes_per_gpu:
        gpu_compute_s += work.memory_bytes_per_gpu / (gpu.hbm_gbps * 1e9)
    # The host queues kernels ahead of the GPU (FSDP2 does not block it inside forward and
    # backward), so the micro-batches take the longer of the GPU's time and the host's.
    host_op_us = HOST_OP_US if host_op_us is None else host_op_us
    host_s = work.num_microbatches * work.dispatched_ops_per_microbatch * host_op_us * 1e-6
    compute_s = max(gpu_compute_s, host_s)

    comm_s = 0.0
    shard = shard_group_size if 0 < shard_group_size < n else n
    if 0 < reshard_group_size < shard and work.backward_allgather_bytes_per_gpu:
        moved = work.backward_allgather_bytes_per_gpu
        work = replace(work, allgather_bytes_per_gpu=work.allgather_bytes_per_gpu - moved,
                       backward_allgather_bytes_per_gpu=0.0)
        across = reshard_group_size > cluster.gpus_per_node
        comm_s += moved * (reshard_group_size - 1) / reshard_group_size / (_link_gbps(
            cluster, inter_node=across, nic_bus_efficiency=nic_bus_efficiency) * 1e9)
    if shard_group_size and shard_group_size < n:
        comm_s += sum(hsdp_comm_seconds(work, cluster, shard_group_size=shard_group_size,
                                        nic_bus_efficiency=nic_bus_efficiency))
    elif n > 1 and pp > 1:
        # A stage's data ranks: world / pp consecutive GPUs (pp outermost, tp innermost), so its FSDP rings cross
        # nodes where a stage spans several, each ring on as many of a node's NICs as it has GPUs there.
        ring_bytes = (work.allgather_bytes_per_gpu + work.reduce_scatter_bytes_per_gpu) * (n - 1) / n
        comm_s += ring_bytes / (_stage_ring_gbps(cluster, stage_gpus=cluster.num_gpus // pp, tensor_parallel=tp,
                                                 nic_bus_efficiency=nic_bus_efficiency) * 1e9)
    elif n > 1:
        ring_bytes = (work.allgather_bytes_per_gpu + work.reduce_scatter_bytes_per_gpu) * (n - 1) / n
        comm_s += ring_bytes / (_link_gbps(cluster, inter_node=cluster.num_nodes > 1,
                                          nic_bus_efficiency=nic_bus_efficiency) * 1e9)
    offload_s = (work.host_to_device_bytes + work.device_to_host_bytes) / (host_link_gbps(gpu) * 1e9)
    # Expert parallelism's all-to-alls: the experts wait on them (no overlap modelled).
    all_to_all_s = work.all_to_all_bytes_per_gpu / (_link_gbps(
        cluster, inter_node=work.all_to_all_inter_node, whole_nodes=False,
        nic_bus_efficiency=nic_bus_efficiency) * 1e9)

    # Collectives and offload copies run on side streams under compute. What cannot hide: the
    # excess over compute, and each micro-batch's first all-gather and last reduce-scatter.
    side_s = comm_s + offload_s
    unhideable_s = 0.0
    if work.num_fsdp_units:
        unhideable_s = side_s / work.num_fsdp_units
    exposed_s = min(side_s, max(side_s - compute_s, 0.0) + unhideable_s)
    offload_accumulate_s = 0.0
    if work.cpu_optimizer_params and work.num_microbatches > 1:
        # CPU offload while gradients accumulate (offload_accumulate_seconds): the host blocks on each
        # unit's reduce-scatter, copies and adds before backward goes on, so those micro-batches'
        # reduce-scatters are exposed too.
        accumulating = work.num_microbatches - 1
        offload_accumulate_s = offload_accumulate_seconds(
            grad_params=work.cpu_optimizer_params, fresh_page_bytes=work.offload_fresh_page_bytes,
            accumulating_microbatches=accumulating)
        gathered_and_reduced = work.allgather_bytes_per_gpu + work.reduce_scatter_bytes_per_gpu
        if gathered_and_reduced:
            reduce_s = comm_s * work.reduce_scatter_bytes_per_gpu / gathered_and_reduced
            exposed_s = min(side_s, exposed_s + reduce_s * accumulating / work.num_microbatches)
    exposed_comm_s = exposed_s * (comm_s / side_s) if side_s else 0.0

    cpu_optimizer_s = 0.0
    if work.cpu_optimizer_params:
        node_params = work.cpu_optimizer_params * cluster.gpus_per_node
        cpu_optimizer_s = node_params / CPU_ADAM_PARAMS_PER_S_PER_NODE

    # Tensor parallelism's all-reduces: ring all-reduce moves 2 (tp - 1) / tp of the bytes, within a node; under
    # async TP each collective hides under the matmul it is fused with as far as that matmul lasts.
    tp_gbps = _link_gbps(cluster, inter_node=tp > cluster.gpus_per_node, whole_nodes=False,
                         nic_bus_efficiency=nic_bus_efficiency)
    tp_s = work.tp_all_reduce_bytes_per_gpu * 2 * (tp - 1) / tp / (tp_gbps * 1e9) if tp > 1 else 0.0
    tp_sync_s = tp_s
    if tp > 1 and work.async_tensor_parallel and work.tp_overlap:
        tp_s = async_tp_exposed_seconds(work.tp_overlap, tensor_parallel=tp, link_gbps=tp_gbps,
                                        matmul_tflops=peak_tflops * efficiency)
    # Context parallelism's ring sends, within a node (exposed: an upper bound on the time); a ring's GPUs are tp
    # apart (tp innermost in the mesh), so with tensor parallelism it leaves the node once tp x cp GPUs outgrow it.
    cp = work.context_parallel
    cp_s = (work.cp_ring_bytes_per_gpu / (_link_gbps(
        cluster, inter_node=cp * tp > cluster.gpus_per_node, whole_nodes=False,
        nic_bus_efficiency=nic_bus_efficiency) * 1e9)
        if cp > 1 else 0.0)
    comm_s += all_to_all_s + tp_s + cp_s
    exposed_s += all_to_all_s + tp_s + cp_s
    exposed_comm_s += all_to_all_s + tp_s + cp_s
    # Pipeline parallelism (pipeline_bubble_ratio): the stage's micro-batches (compute, and the tensor- and
    # context-parallel exchanges on their critical path) idle (p - 1) / (v m) of that again while the pipeline
    # fills and drains; each stage-to-stage send lies on the critical path where the fill and the drain cross a
    # stage boundary (2 (p v - 1) hops), the rest under the other micro-batches' compute unless they outlast it.
    bubble_s = p2p_all_s = p2p_s = 0.0
    if pp > 1:
        v, m = work.pipeline_virtual_stages, work.num_microbatches
        stage_s = compute_s + tp_s + cp_s
        bubble_s = stage_s * pipeline_bubble_ratio(stages=pp, microbatches=m, virtual_stages=v)
        if work.pp_p2p_bytes_per_gpu:
            p2p_all_s = work.pp_p2p_bytes_per_gpu / (_link_gbps(
                cluster, inter_node=work.pp_p2p_inter_node, whole_nodes=False,
                nic_bus_efficiency=nic_bus_efficiency) * 1e9)
            hop_s = p2p_all_s / (2 * m * v)
            p2p_s = min(p2p_all_s, 2 * (pp * v - 1) * hop_s + max(p2p_all_s - stage_s, 0.0))
        comm_s += p2p_all_s
        exposed_s += p2p_s
        exposed_comm_s += p2p_s
    seconds = compute_s + exposed_s + bubble_s + cpu_optimizer_s + offload_accumulate_s
    model_flops = work.flops_per_gpu if work.model_flops_per_gpu is None else work.model_flops_per_gpu
    return StepTime(
        seconds=seconds, compute_s=compute_s, comm_s=comm_s, exposed_comm_s=exposed_comm_s,
        offload_s=offload_s, cpu_optimizer_s=cpu_optimizer_s,
        tokens_per_sec=work.tokens_per_step / seconds if seconds > 0 else 0.0,
        mfu=model_flops / (seconds * peak_tflops * 1e12) if seconds > 0 else 0.0,
        basis=(estimate_basis(gpu, efficiency, work.precision)
               + (f" on {cluster.num_nodes} nodes" if cluster.num_nodes > 1 else "")
               + (f"; matmul efficiency for the matmuls, attention at {attention_rate:.0f} TFLOP/s (the published "
                  f"{work.attention_kernel} kernel speed at seq {work.attention_span}, head dim {work.attention_head_dim})"
                  if attention_rate else "")
               + (f"; memory-bound ops {work.memory_bytes_per_gpu / 1e9:.3g} GB per step at the {gpu.hbm_gbps:g} GB/s "
                  "HBM data sheet" if work.memory_bytes_per_gpu else "")
               + (f"; host-bound: {work.num_microbatches} micro-batch(es) x {work.dispatched_ops_per_microbatch:,.0f} "
                  f"dispatched ops x {host_op_us:g} us = {host_s:.3g} s per step, over the GPU's {gpu_compute_s:.3g} s"
                  if host_s > gpu_compute_s else "")
               + (f"; {offload_accumulate_s:.3g} s per step of the host's blocking gradient copies and adds in "
                  f"{work.num_microbatches - 1} accumulating micro-batch(es) ({OFFLOAD_ACCUMULATE_BASIS})"
                  if offload_accumulate_s else "")
               + (f"; async TP: the tensor-parallel collectives {tp_s:.3g} s exposed of {tp_sync_s:.3g} s (each past "
                  "the matmul it is fused with, costmodel.async_tp_exposed_seconds)" if tp_s != tp_sync_s else "")
               + (f"; pipeline of {pp} stages' ranks x {work.pipeline_virtual_stages} ({work.pipeline_schedule}), "
                  f"{work.num_microbatches} micro-batches: bubble {bubble_s:.3g} s ((p-1)/(v m) of the slowest stage's "
                  f"time, {PIPELINE_BUBBLE_SOURCE}), stage-to-stage sends {p2p_s:.3g} s exposed "
                  f"({'across nodes' if work.pp_p2p_inter_node else 'within a node'})" if pp > 1 else ""))
        if describe else "",
        host_s=host_s, host_bound=host_s > gpu_compute_s, gpu_compute_s=gpu_compute_s,
        offload_accumulate_s=offload_accumulate_s, attention_s=attention_s, pp_bubble_s=bubble_s, pp_p2p_s=p2p_s,
    )


# --- The per-operation step-time model (issue 11) ---------------------------------------------------

LARGE_MEMORY_OP_BYTES = 16 * MiB
"""A memory-bound op that moves at least this much (inputs + outputs) runs at a profile's
`memory_gbps_large`: its buffers do not fit in a CPU's last-level cache shared by the ranks (32
MiB on the 2-core VM), and a new output's pages are first touched by it. On one step of
tiny-llama (2 gloo ranks, micro-batch 8) the log-softmax of the loss ran at 2.5-3 GB/s against
56-84 GB/s for elementwise ops at activation sizes (torch.profiler, docs/history/BENCHMARKS-2026-11-25.md, run 9)."""

@dataclass(frozen=True, kw_only=True)
class OpWork:
    """The ops of forward + backward of one micro-batch on one rank, as the simulator's trace
    counted them (`StepTrace.op_work`; recomputation included)."""

    matmul_flops: float = 0.0
    matmul_ops: float = 0.0
    attention_flops: float = 0.0
    attention_ops: float = 0.0
    memory_bytes: float = 0.0
    memory_ops: float = 0.0
    memory_bytes_large: float = 0.0
    """The part of `memory_bytes` moved by ops of at least LARGE_MEMORY_OP_BYTES each (the loss's
    softmax over the vocabulary, say): they stream from main memory, not from the caches."""
    dispatched_ops: float = 0.0
    """Every op dispatched, views included."""
    float8_matmul_flops: float = 0.0
    float8_matmul_ops: float = 0.0
    """float8 matmuls (`_scaled_mm`: float8 training's converted linears), costed at the profile's
    `float8_matmul_tflops` where it has one, else at its matmul rate."""

    @classmethod
    def from_trace(cls, op_work: dict[str, float]) -> "OpWork":
        return cls(**{k: float(op_work.get(k, 0.0)) for k in cls.__dataclass_fields__})


@dataclass(frozen=True, kw_only=True)
class OpStepTime:
    """The per-operation estimate of one optimizer step on one rank (seconds), by part."""

    seconds: float
    matmul_s: float
    attention_s: float
    memory_s: float
    host_s: float = 0.0
    """Host time of the dispatched ops (`host_op_us`), 0 without the figure: added to the device
    time on a CPU, overlapping it on a GPU (compute is the longer of the two)."""
    host_bound: bool = False
    """GPU: the host's time exceeds the device's (launch-bound)."""
    compute_s: float = 0.0
    """The micro-batches' time: device + host on a CPU, the longer of the two on a GPU."""
    comm_s: float
    exposed_comm_s: float
    offload_s: float
    optimizer_s: float
    offload_accumulate_s: float = 0.0
    """CPU offload: the host's blocking gradient copies and adds of the accumulating micro-batches."""
    tokens_per_sec: float
    mfu: float | None
    basis: str

    @property
    def device_s(self) -> float:
        return self.matmul_s + self.attention_s + self.memory_s

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def rate_at(profile, name: str, tokens: float) -> float | None:
    """A profile rate at `tokens` per micro-batch: its `name@T` figures (measured at the model's
    shapes by calibrate) interpolated linearly in log(tokens), held flat beyond the ends; else
    the plain `name` figure, or None."""
    table = sorted((int(key.split("@", 1)[1]), fig.value) for key, fig in profile.figures.items()
                   if key.startswith(name + "@"))
    if not table:
        return profile.get(name)
    if tokens <= table[0][0]:
        return table[0][1]
    for (t0, r0), (t1, r1) in zip(table, table[1:]):
        if tokens <= t1:
            w = (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0))
            return r0 + w * (r1 - r0)
    return table[-1][1]


def collective_seconds(nbytes: float, *, ranks: int, gbps: float, latency_us: float) -> float:
    """One ring all-gather or reduce-scatter of `nbytes` (unsharded) over `ranks` ranks:
    latency plus the (n-1)/n share each rank sends at the bus bandwidth."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return latency_us * 1e-6 + nbytes * (ranks - 1) / ranks / (gbps * 1e9)


def estimate_op_step_time(ops: OpWork, *, profile, num_gpus: int, num_nodes: int = 1, num_blocks: int,
                          block_params: int, root_params: int, param_bytes: int, tokens_per_step: int,
                          num_microbatches: int = 1, reshard_after_forward: bool = True,
                          cpu_offload: bool = False, precision: str = "bf16",
                          model_flops_per_gpu: float | None = None, peak_tflops: float | None = None,
                          shard_group_size: int = 0, reshard_group_size: int = 0,
                          trainable: tuple[int, int] | None = None,
                          offload_fresh_page_bytes: float = 0.0) -> OpStepTime:
    """Step time of one rank from the traced ops on a hardware profile (autotune/estimate/hardware.py).

    device per micro-batch  = matmul FLOPs / rate + matmuls x fixed cost
                            + attention FLOPs / rate + attention kernels x fixed cost
                            + memory-bound bytes / bandwidth + memory-bound ops x fixed cost
    host per micro-batch    = dispatched ops x `host_op_us` (0 where the profile lacks it)
    compute per micro-batch = device + host on a CPU (the host runs the kernels; the matmul and
                              memory-bound fixed costs are then left out: they are host time,
                              counted once),
                              max(device, host) on a GPU (the host queues kernels ahead)
    communication per FSDP unit and micro-batch: all-gather of the unit in forward, again in
    backward when resharded (never the root), reduce-scatter of its fp32 gradients; each a
    latency plus bytes over the bus bandwidth (inter-node figures when the job spans nodes).
    overlap: FSDP2 prefetches one unit ahead, so a block's collectives hide under a block's
    compute; exposed = the root's all-gather and the last reduce-scatter (nothing to hide under)
    plus, per block, what its collectives take beyond its compute. Where the profile says
    collectives block compute (`comm_overlap` 0: gloo on CPU), all of it is exposed.
    HSDP (`shard_group_size` g < n): the unit's collectives run within its group of g ranks (on
    the node's links when the group fits in a node), then each gradient shard is all-reduced across
    the n/g replicas (a ring all-reduce: twice a reduce-scatter's traffic, inter-node across nodes).
    `trainable` (block, root): the parameters with gradients where some are frozen (LoRA): only
    they are reduce-scattered, copied back from offload and stepped by the optimizer.
    optimizer: AdamW over the rank's shard on the device (28 bytes per parameter at
    `optimizer_gbps`), or on the host (`cpu_adam_params_per_s`, shared by a node's ranks) with CPU
    offload or on a cpu profile; offload adds the host<->device copies of the fp32 shards, and in
    each micro-batch after the first the host's blocking gradient copies and adds
    (offload_accumulate_seconds; `offload_fresh_page_bytes` from fresh_page_bytes), with that
    micro-batch's reduce-scatters exposed.
    """
    p = profile
    n = num_gpus
    fp32 = precision == "fp32"
    tokens_per_microbatch = tokens_per_step / (n * num_microbatches)
    mb = num_microbatches

    host_op_us = p.get("host_op_us")
    # On a CPU the host runs every op: the fixed cost per matmul and per elementwise op that the
    # microbenchmarks fit (a bare op called from Python: tens of us) is part of the host time per
    # op a real step measures, not extra. The attention kernel's fixed cost stays: on a CPU it is
    # milliseconds of real work per call (the causal mask of the math kernel), not dispatch.
    fixed = 0.0 if host_op_us is not None and p.device == "cpu" else 1.0

    def kernels(kind: str, flops: float, count: float) -> float:
        # A rate measured at this many tokens (calibrate's `name@T` table) already includes the
        # kernels' fixed cost at the model's shapes; the plain figure needs it added per kernel.
        name = f"{kind}_tflops" + ("_fp32" if fp32 else "")
        at_shape = rate_at(profile, name, tokens_per_microbatch)
        if at_shape is not None and any(key.startswith(name + "@") for key in p.figures):
            return flops / (at_shape * 1e12)
        rate = p.get(name) or p[f"{kind}_tflops"]
        per_kernel = p[f"{kind}_op_us"] * (1.0 if kind == "attention" else fixed)
        return flops / (rate * 1e12) + count * per_kernel * 1e-6

    matmul_s = mb * kernels("matmul", ops.matmul_flops, ops.matmul_ops)
    if ops.float8_matmul_flops:
        rate = p.get("float8_matmul_tflops") or p["matmul_tflops"]
        matmul_s += mb * (ops.float8_matmul_flops / (rate * 1e12) + ops.float8_matmul_ops * p["matmul_op_us"] * fixed * 1e-6)
    attention_s = mb * kernels("attention", ops.attention_flops, ops.attention_ops)
    # Large ops at the large-buffer bandwidth where the profile measured one (calibrate), else all
    # bytes at one bandwidth (shipped and older profiles).
    large_gbps = p.get("memory_gbps_large")
    large_bytes = ops.memory_bytes_large if large_gbps else 0.0
    memory_s = mb * ((ops.memory_bytes - large_bytes) / (p["memory_gbps"] * 1e9)
                     + (large_bytes / (large_gbps * 1e9) if large_bytes else 0.0)
                     + fixed * ops.memory_ops * p["memory_op_us"] * 1e-6)
    # A cpu profile's `tracked_op_us`: the cpu backend's tensor-memory tracker (the CPU's "device",
    # autotune/backends/real/_capacity.py) runs Python on every dispatched op of a real cpu trial.
    # Its cost per op grows with the blocks it tracks (calibrate measures the slope).
    tracked_op_us = (p.get("tracked_op_us") or 0.0) + (p.get("tracked_op_us_per_block") or 0.0) * num_blocks
    memory_s += mb * ops.dispatched_ops * tracked_op_us * 1e-6
    device_s = matmul_s + attention_s + memory_s
    # Host time: Python, dispatcher, autograd, FSDP2 hooks and the launch of every dispatched op.
    # On a CPU the host runs the kernels itself: the two add. On a GPU the host queues kernels
    # ahead of the device: FSDP2 never blocks the host inside forward and backward (its memory
    # management uses stream events, not CPU syncs), so within a micro-batch the queue decouples
    # the two and the micro-batch takes the longer of the device's and the host's time. Every
    # block repeats the same ops, so the host-to-device ratio is about the same all through the
    # micro-batch, and the max of the sums is close to the event-by-event schedule.
    host_s = mb * ops.dispatched_ops * (host_op_us or 0.0) * 1e-6
    if p.device == "cpu":
        compute_s = device_s + host_s
    else:
        compute_s = max(device_s, host_s)

    group = shard_group_size if 0 < shard_group_size < n else n
    replicas = n // group
    gpus_per_node = n // num_nodes

    def ring_gbps(across: bool, *, whole_nodes: bool = True) -> float:
        if not across:
            return p["intra_node_gbps"]
        return inter_node_ring_gbps(p["inter_node_gbps"], gpus_per_node=gpus_per_node,
                                    intra_node_gbps=p["intra_node_gbps"], whole_nodes=whole_nodes)

    inter = num_nodes > 1 and group > gpus_per_node  # the shard group spans nodes (whole ones)
    ag_bw = ring_gbps(inter)
    ag_lat = p["inter_node_latency_us" if inter else "intra_node_latency_us"]
    rs_bw = (None if inter else p.get("intra_node_rs_gbps")) or ag_bw
    rs_lat = (None if inter else p.get("intra_node_rs_latency_us")) or ag_lat
    ar_inter = num_nodes > 1  # replicas sit on other nodes whenever there are several: one GPU per node
    ar_bw = ring_gbps(ar_inter, whole_nodes=False)
    ar_lat = p["inter_node_latency_us" if ar_inter else "intra_node_latency_us"]

    def ag(params: int) -> float:
        return collective_seconds(params * param_bytes, ranks=group, gbps=ag_bw, latency_us=ag_lat)

    def rs(params: int) -> float:
        # HSDP: the reduce-scattered fp32 shard is then all-reduced across the replicas.
        return collective_seconds(params * 4, ranks=group, gbps=rs_bw, latency_us=rs_lat) + \
            2 * collective_seconds(params * 4 / group, ranks=replicas, gbps=ar_bw, latency_us=ar_lat)

    def ag_backward(params: int) -> float:
        # Resharded after forward to groups of `reshard_group_size`: backward gathers within one.
        if not 0 < reshard_group_size < group:
            return ag(params)
        across = num_nodes > 1 and reshard_group_size > gpus_per_node
        return collective_seconds(params * param_bytes, ranks=reshard_group_size, gbps=ring_gbps(across),
                                  latency_us=p["inter_node_latency_us" if across else "intra_node_latency_us"])

    block_grads, root_grads = trainable if trainable is not None else (block_params, root_params)
    block_comm = ag(block_params) + (ag_backward(block_params) if reshard_after_forward else 0.0) + \
        (rs(block_grads) if block_grads else 0.0)
    root_comm = ag(root_params) + (rs(root_grads) if root_grads else 0.0)
    comm_mb = num_blocks * block_comm + root_comm
    offload_mb = 0.0
    if cpu_offload:
        h2d, d2h = offload_bytes(block_params=block_params, num_blocks=num_blocks, root_params=root_params,
                                 num_gpus=group, reshard_after_forward=reshard_after_forward, trainable=trainable)
        offload_mb = (h2d + d2h) / (p["host_link_gbps"] * 1e9)
    overlap = min(max(p["comm_overlap"], 0.0), 1.0)
    per_block_compute = compute_s / mb / max(num_blocks, 1)
    side_block = block_comm + offload_mb / max(num_blocks + 1, 1)
    hidden_exposed = root_comm + offload_mb / max(num_blocks + 1, 1) + \
        num_blocks * max(side_block - per_block_compute, 0.0)
    exposed_mb = overlap * min(hidden_exposed, comm_mb + offload_mb) + (1 - overlap) * (comm_mb + offload_mb)
    comm_s, offload_s = comm_mb * mb, offload_mb * mb
    exposed_s = exposed_mb * mb
    exposed_comm_s = exposed_s * (comm_s / (comm_s + offload_s)) if comm_s + offload_s else 0.0

    shard_params = -(-(root_grads + num_blocks * block_grads) // group)
    offload_accumulate_s = 0.0
    if cpu_offload and p.device == "cuda" and mb > 1:
        offload_accumulate_s = offload_accumulate_seconds(
            grad_params=shard_params, fresh_page_bytes=offload_fresh_page_bytes, accumulating_microbatches=mb - 1,
            ns_per_param=p.get("offload_accumulate_ns_per_param"), page_ns_per_byte=p.get("fresh_page_ns_per_byte"))
        reduce_mb = num_blocks * (rs(block_grads) if block_grads else 0.0) + (rs(root_grads) if root_grads else 0.0)
        exposed_s = min(comm_s + offload_s, exposed_s + (mb - 1) * reduce_mb)
        exposed_comm_s = exposed_s * (comm_s / (comm_s + offload_s)) if comm_s + offload_s else 0.0
    if cpu_offload or p.device == "cpu":
        ranks_sharing = max(n // num_nodes, 1) if cpu_offload and p.device == "cuda" else 1
        optimizer_s = shard_params * ranks_sharing / p["cpu_adam_params_per_s"]
    else:
        optimizer_s = shard_params * 28 / (p["optimizer_gbps"] * 1e9)

    seconds = compute_s + exposed_s + optimizer_s + offload_accumulate_s
    mfu = None
    if model_flops_per_gpu is not None and peak_tflops and seconds > 0:
        mfu = model_flops_per_gpu / (seconds * peak_tflops * 1e12)
    return OpStepTime(seconds=seconds, matmul_s=matmul_s, attention_s=attention_s, memory_s=memory_s,
                      host_s=host_s, host_bound=p.device != "cpu" and host_s > device_s, compute_s=compute_s,
                      comm_s=comm_s, exposed_comm_s=exposed_comm_s, offload_s=offload_s, optimizer_s=optimizer_s,
                      offload_accumulate_s=offload_accumulate_s, tokens_per_sec=tokens_per_step / seconds if seconds > 0 else 0.0, mfu=mfu,
                      basis=f"estimated: per-operation cost model on {profile.describe()}"
                            + (f", {num_nodes} nodes" if num_nodes > 1 else "")
                            + (f"; {offload_accumulate_s:.3g} s per step of the host's blocking gradient copies and "
                               f"adds in {mb - 1} accumulating micro-batch(es)"
                               + ("" if p.get("offload_accumulate_ns_per_param") else f" ({OFFLOAD_ACCUMULATE_BASIS})")
                               if offload_accumulate_s else ""))


RANKING_ERROR = 0.076
"""How far the ratio of two estimates of one model on one cluster has been from the published ratio:
the worst of the same-table pairs of the published runs held out by source (llama-70b on 64 A100s,
op-level checkpointing at micro-batch 1 against full at 2: published +0.6%, estimated +8.2%, 7.6%
apart; the other four 2.7-5.3%: docs/COSTMODEL.md, "Ordering"). What two such estimates share (the
GPU's efficiency, the model's shape) cancels in their ratio, so a ranking is surer than either
estimate's held-out range (autotune.estimate.heldout): a lead below this is a close call (result.why_winner)."""


def estimate_kind(profile, *, host_bound: bool = False, per_op: bool = False) -> str:
    """The kind of estimate whose held-out errors its range comes from (autotune.estimate.heldout): a CPU
    profile's; a GPU estimate the host's dispatch time sets; the per-operation model on a calibrated
    GPU profile; the default roofline."""
    if profile.device == "cpu":
        return "cpu"
    return ("per-op" if per_op else "roofline") + ("-host-bound" if host_bound else "")


def estimate_range(tokens_per_sec: float, profile, *, host_bound: bool = False,
                   per_op: bool = False) -> tuple[float, float] | None:
    """(low, high) tokens/s around an estimate: the held-out errors' quantile for its kind and GPU family
    (autotune.estimate.heldout, docs/VALIDATION.md), or None where no held-out row ran on the family: not validated."""
    figures = heldout.held_out(estimate_kind(profile, host_bound=host_bound, per_op=per_op), profile.gpu)
    if figures is None:
        return None
    return tokens_per_sec * (1 - figures.half_width), tokens_per_sec * (1 + figures.half_width)


def range_source(profile, *, host_bound: bool = False, per_op: bool = False) -> str:
    """What an estimate's range comes from: the held-out rows (count, publishers), or "not validated on <gpu>"."""
    kind = estimate_kind(profile, host_bound=host_bound, per_op=per_op)
    figures = heldout.held_out(kind, profile.gpu)
    if figures is None:
        return (f"not validated on {profile.gpu or profile.device}: no held-out row of a {kind} estimate ran on "
                "its GPU family, so no range (docs/VALIDATION.md)")
    return f"{figures.label()}; docs/VALIDATION.md"


def range_note(profile, *, host_bound: bool = False, per_op: bool = False) -> str:
    """range_source in a few words, for the console: 'from 61 held-out rows (...)' or 'not validated on l40s-48gb'."""
    figures = heldout.held_out(estimate_kind(profile, host_bound=host_bound, per_op=per_op), profile.gpu)
    return figures.short() if figures else f"not validated on {profile.gpu or profile.device}"


# --- torch.compile (issues 28, 56) ----------------------------------------------------------------

COMPILED_KERNELS = "fused-swiglu"
"""The memory-bound kernels a compiled block runs (MEMORY_BYTES_PER_TOKEN): inductor fuses each run of
elementwise, norm, rotary and activation ops between two matmuls (or the attention kernel) into one
kernel, which reads its inputs and writes its outputs once, as a hand-fused Llama block does (fused
RMSNorm, rotary and SwiGLU: TinyLlama's kernels, counted kernel by kernel, not fitted). The matmuls and
the attention kernel are the eager step's. The simulator counts those fused kernels' launches from the
compiled trace (`compiled_launches`, docs/COMPILE.md)."""

COMPILE_RATIO_ERROR_POINTS = 0.13
"""How far an estimated compiled/eager ratio has been from the published one: the worst |error| in
points over the published pairs that compile alone separates (costmodel_fit.compile_pairs: torchtitan's
two, fms-fsdp's four, AWS's one; the eager constants fitted without each pair's publisher), rounded
up. A compiled estimate's range is its eager range times the ratio less / plus this. Derived, not
fitted: no estimate uses it but the range (tests/test_validation.py::test_compiled_rows_not_taken_into_the_ratio
recomputes it)."""


def compile_fused_bytes_saved(*, tokens: float, num_layers: int, checkpointed_blocks: int, hidden: int, ffn: int,
                              kv_width: int, param_bytes: int) -> float:
    """HBM bytes per step that compiling the blocks takes off the memory-bound ops: `tokens` (this GPU's,
    all micro-batches) through `num_layers` blocks forward and backward and `checkpointed_blocks` forwards
    again (the recompute repeats the fused forward), the eager block's MEMORY_BYTES_PER_TOKEN less the
    fused one's (COMPILED_KERNELS), in a `param_bytes` compute dtype (the table is bf16's)."""
    def saved(forward: bool) -> float:
        shape = dict(hidden=hidden, ffn=ffn, kv_width=kv_width, forward=forward)
        return max(memory_bytes_per_token("eager", **shape) - memory_bytes_per_token(COMPILED_KERNELS, **shape), 0.0)

    return float(tokens) * param_bytes / 2 * (num_layers * saved(False) + checkpointed_blocks * saved(True))


def compiled_work(work: StepWork, *, fused_bytes_saved: float) -> StepWork:
    """The compiled step's work: the eager `work` with its memory-bound bytes less what compiling the
    blocks fuses away (compile_fused_bytes_saved); FLOPs, attention, collectives and offload unchanged.
    Where the work counted no memory-bound bytes (0), nothing is saved: the estimate is eager's."""
    if not work.memory_bytes_per_gpu:
        return work
    return replace(work, memory_bytes_per_gpu=max(work.memory_bytes_per_gpu - fused_bytes_saved, 0.0))


def host_offload_seconds(step_time: dict) -> float:
    """The part of an estimated step (StepTime or OpStepTime as a dict) the host spends on CPU
    offload's own work, which compiling the blocks does not touch: the host optimizer step and the
    accumulating micro-batches' blocking gradient copies and adds. 0 without offload."""
    accumulate = step_time.get("offload_accumulate_s", 0.0)
    host_optimizer = step_time.get("cpu_optimizer_s", 0.0)  # the roofline's; the per-op model's optimizer_s
    if "cpu_optimizer_s" not in step_time and step_time.get("offload_s"):  # is the host's under offload
        host_optimizer = step_time.get("optimizer_s", 0.0)
    return accumulate + host_optimizer


def compiled_throughput(tokens_per_sec: float, low: float | None = None, high: float | None = None, *,
                        eager_step: dict, compiled_step: dict,
                        fused_bytes_saved: float = 0.0) -> tuple[float, float | None, float | None, float, str]:
    """A compiled configuration's estimated tokens/s from its eager estimate and the same step costed
    compiled (`compiled_step`: the eager work with the blocks' memory-bound ops fused, compiled_work):
    the eager figure times the ratio of the two steps' seconds. The ratio comes out of the configuration's
    own mix of matmul, attention, memory-bound, collective and host time, so it moves with width,
    sequence, checkpointing (the recompute repeats the fused forward), precision (the bytes scale with the
    dtype) and GPU count (collectives that compute no longer hides); CPU offload's host work
    (host_offload_seconds) and a host-bound step's dispatch time are in both steps and do not shrink.
    The range: the eager range times the ratio less / plus COMPILE_RATIO_ERROR_POINTS, the worst held-out
    error of the estimated ratio on the published pairs (docs/COMPILE.md, "Validation").
    Returns (tokens/s, low, high, ratio, basis)."""
    ratio = eager_step["seconds"] / compiled_step["seconds"] if compiled_step.get("seconds") else 1.0
    points = COMPILE_RATIO_ERROR_POINTS

    def scaled(value: float | None, r: float) -> float | None:
        return None if value is None else value * r

    host = host_offload_seconds(eager_step)
    share = host / eager_step["seconds"] if eager_step.get("seconds") else 0.0
    basis = (f"compiled blocks: estimated x{ratio:.3f} over eager from this step's own work (the blocks' memory-bound "
             f"ops fused, {fused_bytes_saved / 1e9:.3g} GB per step less at the HBM data sheet; matmuls, attention, "
             f"collectives and the host's dispatch as costed; costmodel.COMPILED_KERNELS), no published ratio applied; "
             f"range +-{points * 100:.0f} points, the worst held-out error on published compiled/eager pairs "
             "(docs/VALIDATION.md)")
    if share:
        basis += (f"; CPU offload's host work ({share:.0%} of the eager step: its optimizer step and gradient copies) "
                  "is not sped up")
    if compiled_step.get("host_bound"):
        basis += "; host-bound: the step's time is the host's, which fusing the GPU's memory-bound ops does not shorten"
    return (tokens_per_sec * ratio, scaled(low, ratio - points), scaled(high, ratio + points), ratio, basis)


# --- float8 training (issue 28) ---------------------------------------------------------------------

FLOAT8_CAST_BYTES = {"eager": 33.0, "compiled": 5.0}
"""Bytes one dynamic float8 cast moves per element of the bf16 tensor it casts. Eager: 33, counted
(torchao 0.18's hp_tensor_to_float8_dynamic, tensorwise and rowwise alike, under a dispatch mode: abs,
max, to-fp32, mul, clamp and to-float8 each read and write the whole tensor; tests/test_float8.py
counts it again). Compiled: 5, the least a cast can move (the amax reads 2 bytes, the cast reads 2 and
writes 1): torch.compile fuses torchao's scaling and casting kernels (torchtitan's float8 notes), taken
to fuse them fully. The casts are memory-bound, at the GPU's data-sheet HBM bandwidth."""
BF16_GEMM_FRACTION = 0.633
"""The fraction of the data-sheet bf16 peak a large bf16 GEMM reaches on an H100: 625.6 of 989
TFLOP/s, the median of the four `matmul_tflops` `autotune calibrate --backend cuda` measured on H100
VMs (616.6, 623.0, 628.2, 660.7: benchmarks/results/h100_calibrated_*.json). The converted linears'
GEMMs are taken to run at this fraction of the float8 peak too (an assumption, not measured here)."""
ROWWISE_GEMM_RATE = 0.73
"""A rowwise-scaled float8 GEMM's rate against a tensorwise-scaled one of the same shapes (a scale per
row of each operand: PyTorch runs `_scaled_mm` with a CUTLASS rowwise kernel, and torchao casts each
operand along both axes where tensorwise transposes one cast). **Fitted** to the one published
rowwise row it is checked against apart: torchao's docs (1.100x over compiled bf16), then checked on
torchtitan commit 7a04053's rowwise run (1.115x), another source of the same configuration, not
fitted to it (docs/COMPILE.md, "Validation")."""
FLOAT8_PUBLISHED = (
    # (label, GPUs, bf16 tokens/s per GPU, float8 tokens/s per GPU): all compiled, FSDP2, Llama 3(.1) 8B,
    # seq 8192, H100. The validation of float8_step_seconds (docs/COMPILE.md); only the rowwise GEMM rate
    # is fitted, to torchao's rowwise row.
    ("torchtitan Table 1, tensorwise + float8 all-gather", 8, 6_667, 8_532),
    ("torchtitan Table 3, tensorwise + float8 all-gather", 128, 6_514, 8_380),
    ("torchao docs, tensorwise + float8 all-gather", 8, 6_150, 7_689.5),
    ("torchao docs, rowwise", 8, 6_150, 6_768),
    ("torchtitan commit 7a04053, tensorwise + float8 all-gather", 8, 5_760, 7_186),
    ("torchtitan commit 7a04053, rowwise", 8, 5_760, 6_424),
)
FLOAT8_ONE_GPU_MEASURED = (
    # (model, recipe, measured float8/bf16 tokens/s, both compiled; the same ratio as the shipped profile's
    # estimate gave it then): real cuda trials on one H200 (torch 2.11, torchao 0.18, seq 2048, mb 2, full
    # AC; benchmarks/gpu_check.py --cases large, benchmarks/results/gpu_check_h200_*_large.json, 2026-11-27).
    ("mistral-7b", "tensorwise", 7_589 / 8_640, 8_477 / 6_736),
    ("mistral-7b", "rowwise", 8_450 / 8_640, 7_500 / 6_736),
    ("qwen2.5-1.5b", "tensorwise", 12_756 / 19_064, 26_502 / 23_856),
    ("qwen2.5-1.5b", "rowwise", 19_766 / 19_064, 24_630 / 23_856),
)
FLOAT8_RANGE_LOW = min(measured / estimated for _, _, measured, estimated in FLOAT8_ONE_GPU_MEASURED)
"""How far below its estimate a float8 speed-up has measured: the low end of a float8 estimate's range is
its high-precision range's low end times the estimated ratio times this (0.60). On 8 H100s the estimated
ratio is within 1.4% of every published one (FLOAT8_PUBLISHED); on one H200 compiled float8 measured
0.67-1.04x of compiled bf16 where the estimate said 1.03-1.26x (the GEMMs themselves ran 1.6-1.75x faster:
benchmarks/results/float8_gemms_h200.json): what costs the difference there is not modelled, so the range
says it. Taken from the two models above; no check covers it (the one it had, llama3.2-1b's rows inside a
range wide enough to hold compiled bf16 too, could not fail). What is checked instead is the float8 speed-up
itself against llama3.2-1b's H200 rows and torchtitan's published 8B run
(tests/test_float8.py::test_float8_ratios_against_published_and_measured_rows; docs/VALIDATION.md)."""


FLOAT8_PRE_ALL_GATHER_CAST_BYTES = {4: 21.0, 2: 27.0}
"""Bytes FSDP2's float8 all-gather (tensorwise) moves per element of a weight's local shard to cast it before each
all-gather, by the shard's bytes per element (fp32 master weights under mixed precision, bf16 under bf16-pure):
torchao's `WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather` with the scale precomputed multiplies by the scale
in fp32, clamps and casts to float8 (a bf16 shard is cast to fp32 first), each op reading and writing the whole
shard: counted under a dispatch mode (tests/test_float8.py counts it again). FSDP's hooks run outside the compiled
blocks, so these are eager kernels even where the blocks are compiled. After each optimizer step
`precompute_float8_dynamic_scale_for_fsdp` reads every shard once more (its inf-norm)."""


def float8_gathered_weight_seconds(*, gpu: GPUSpec, weight_elements: float, shard_elements: float, gathers: float,
                                   weight_operands: float, input_gradients: float, compiled: bool, master_bytes: int
                                   ) -> tuple[float, str]:
    """What FSDP2's float8 all-gather (tensorwise) changes in the casts of one step's weights, in HBM seconds.
    The trace counts each converted GEMM's weight operand as a dynamic cast (`weight_operands` of them, each of
    `weight_elements`, this GPU's gathered weights); under the float8 all-gather they arrive cast instead: each GPU
    casts its shard (`shard_elements`) before each of the step's `gathers` (FLOAT8_PRE_ALL_GATHER_CAST_BYTES, eager:
    FSDP's hooks run outside the compiled blocks), the scales' precompute reads the shard once, and each of the
    step's `input_gradients` GEMMs a weight feeds copies the gathered float8 weight to the column-major layout `_scaled_mm` takes (a byte read
    and one written per element). Returns (seconds added, less those of the operand casts counted, basis). Counted,
    not fitted; at the data-sheet HBM bandwidth."""
    hbm = gpu.hbm_gbps * 1e9
    operand_bytes = weight_elements * weight_operands * FLOAT8_CAST_BYTES["compiled" if compiled else "eager"]
    gather_bytes = shard_elements * (FLOAT8_PRE_ALL_GATHER_CAST_BYTES[master_bytes] * gathers + master_bytes)
    transposes = weight_elements * 2.0 * input_gradients
    seconds = (gather_bytes + transposes - operand_bytes) / hbm
    return seconds, (f"FSDP's float8 all-gather: {shard_elements:.3g} shard elements cast before each of {gathers:g} "
                     f"gathers ({FLOAT8_PRE_ALL_GATHER_CAST_BYTES[master_bytes]:g} B each, eager outside the blocks), "
                     f"the weights' input-gradient copies, in place of {weight_operands:g} weight-operand casts: "
                     f"{seconds:+.3g} s")


def float8_measured_summary() -> str:
    """The one GPU measurement of float8's speed-up against its estimate, in a clause (FLOAT8_ONE_GPU_MEASURED)."""
    measured = [m for _, _, m, _ in FLOAT8_ONE_GPU_MEASURED]
    estimated = [e for _, _, _, e in FLOAT8_ONE_GPU_MEASURED]
    models = ", ".join(dict.fromkeys(model for model, *_ in FLOAT8_ONE_GPU_MEASURED))
    return (f"on one H200 ({models}; world size 1, seq 2048) compiled float8 measured {min(measured):.2f}-"
            f"{max(measured):.2f}x of compiled bf16 where estimated {min(estimated):.2f}-{max(estimated):.2f}x")


FLOAT8_SOURCES = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md Tables 1 and 3 (Llama 3.1 8B, local batch 2, "
                  "selective AC, compiled, 8 and 128 H100s); torchao docs/source/workflows/training.md 'e2e training "
                  "benchmarks' (Llama3-8b, 8 H100s, batch 1, compiled, per-op SAC); torchtitan commit 7a04053 "
                  "(Llama 3 8B, 8 H100s, batch 1, compiled, selective op AC)")


def float8_weight_bytes_saved(float8_block_params: int, param_bytes: int) -> int:
    """Bytes fewer per gathered block with FSDP2's float8 all-gather (tensorwise): its converted
    linears' weights travel and are held in float8 (1 byte) instead of the parameter dtype."""
    return float8_block_params * max(param_bytes - 1, 0)


def float8_step_seconds(*, gpu: GPUSpec, float8_flops: float, cast_elements: float, compiled: bool,
                        efficiency: float | None = None, recipe: str = "tensorwise") -> tuple[float, float, str]:
    """What float8 training changes in one step's compute on `gpu`, from what the trace counted:
    `float8_flops`, the converted linears' matmul FLOPs (`_scaled_mm`, recompute included), and
    `cast_elements`, the elements their float8 operands hold (each one dynamic cast's output).
    Returns (seconds saved by the float8 matmuls, seconds the casts add, basis).

    saved = the converted FLOPs' GEMM time at BF16_GEMM_FRACTION of the bf16 peak x (1 - bf16 peak /
            float8 peak x rate): the same GEMMs at the same fraction of the float8 peak (capped at what
            the roofline gave those FLOPs: `efficiency`, its fraction of peak), rowwise ones at
            ROWWISE_GEMM_RATE of tensorwise's;
    casts = cast_elements x FLOAT8_CAST_BYTES (eager or compiled) / HBM bandwidth.
    Estimated from data-sheet rates and one measured GEMM fraction; tensorwise checked against
    published runs (FLOAT8_PUBLISHED), not fitted to them; rowwise's rate fitted to one of them."""
    if not gpu.has_float8:
        raise ValueError(f"{gpu.name} has no float8 tensor cores")
    fraction = max(BF16_GEMM_FRACTION, efficiency or 0.0)
    gemm_s = float8_flops / (gpu.peak_tflops * 1e12 * fraction)
    rate = ROWWISE_GEMM_RATE if recipe == "rowwise" else 1.0
    saved_s = gemm_s * (1 - gpu.peak_tflops / (gpu.float8_tflops * rate))
    kind = "compiled" if compiled else "eager"
    casts_s = cast_elements * FLOAT8_CAST_BYTES[kind] / (gpu.hbm_gbps * 1e9)
    rowwise = (f", rowwise GEMMs at {rate:g} of tensorwise's rate (fitted to torchao's published rowwise run)"
               if recipe == "rowwise" else "")
    basis = (f"float8: {float8_flops:.3g} converted matmul FLOPs at {gpu.float8_tflops:g} instead of "
             f"{gpu.peak_tflops:g} TFLOP/s ({gpu.float8_source}; at {fraction:.3f} of peak, autotune calibrate's "
             f"H100 GEMMs{rowwise}) saves {saved_s:.3g} s, {cast_elements:.3g} cast elements x "
             f"{FLOAT8_CAST_BYTES[kind]:g} B ({kind} casts) at {gpu.hbm_gbps:g} GB/s add {casts_s:.3g} s; checked "
             f"against published runs ({FLOAT8_SOURCES}), {'the rest ' if rowwise else ''}not fitted to them")
    return saved_s, casts_s, basis
