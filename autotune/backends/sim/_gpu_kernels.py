"""Which kernel `scaled_dot_product_attention` runs on a CUDA GPU, and the sim trace of it (issue 56).

A CPU trace is not the GPU run. With dropout_p > 0, CUDA's SDPA runs a fused kernel (flash or
memory-efficient; cuDNN where it comes first) that applies dropout inside the kernel from a philox
seed and offset: it keeps the output and the log-sum-exp (plus the seed/offset, a few bytes), no mask
and no seq x seq scores. On the CPU, torch refuses its fused (flash) kernel for any dropout
(`check_for_dropout`, aten/src/ATen/native/transformers/sdp_utils_cpp.h) and runs the math kernel,
which keeps the seq x seq scores, the softmax and a dropout mask. `sdpa_as_on_a_gpu` makes the sim
trace of a GPU run take the GPU's path; the trace of a CPU (gloo) run keeps the math kernel, as a
CPU trial runs it.

`select_cuda_backend` states CUDA's selection as torch implements it, for dense (not nested)
inputs on NVIDIA (not ROCm) builds. Sources, and what was read where:

* aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, read from pytorch/pytorch at commit
  001f694aef6f922b4fdf6d27d59162d27bf3df58 (the copy at hand; it is *newer* than torch 2.13.0,
  git cf30153c4c, installed here: its `check_batch_size_and_num_heads_dense` takes a third template
  argument, `supports_mqa`, which the 2.13.0 header does not have). `select_sdp_backend`,
  `priority_order`, `check_prefer_cudnn_attention`, `can_use_flash_attention`,
  `can_use_mem_efficient_attention`, `can_use_cudnn_attention` and their checks.
* aten/src/ATen/native/transformers/sdp_utils_cpp.h of torch 2.13.0 as installed
  (.venv/.../torch/include): the checks both files share (`check_for_attn_mask`,
  `check_attn_mask_shape`, `check_batch_size_and_num_heads_dense`, `check_grouped_query_attention`,
  `check_last_dim_stride_equals_1_dense`, `check_nonzero_sequence_lengths_dense`, `check_for_dropout`).
* aten/src/ATen/Context.h of torch 2.13.0 as installed: the default priority order
  flash, efficient, math, cuDNN (so cuDNN runs only where `priority_order` moves it first).

The rules, in torch's order (`select_sdp_backend`: the first backend whose checks all pass):

* Priority: flash -> memory-efficient -> math; cuDNN first instead (cudnn, flash, efficient, math)
  where `check_prefer_cudnn_attention` holds: cuDNN runtime > 9.15.0 on SM 9.x or 10.x (CUDA < 13
  builds: minor 0 or 3 only) and TORCH_CUDNN_SDPA_DEPRIORITIZED unset. The sim does not know the
  run's cuDNN: `cudnn_version=None` (the default) keeps the default order.
* Flash: no attn_mask; q, k, v head dims equal and <= 256; SM 8.0-12.1; on SM 8.6-8.9 / 12.0-12.1
  with gradients, head_dim <= 192, or > 224 without dropout; is_causal needs seq_q == seq_k;
  fp16/bf16 (SM >= 8; FA3's float8 only where the user enabled FA3); batch sizes equal, heads equal
  unless enable_gqa (then k and v heads equal and dividing q's); non-empty sequences; last-dim
  stride 1 (head_dim 1 exempt). Dropout: supported, in the kernel.
* Memory-efficient: SM 5.0-12.1; head dims (q = k, v) multiples of the GEMM alignment
  (`minimum_gemm_alignment`: SM >= 8: 8 for fp16/bf16, 4 for fp32; SM 7.x: 8 for fp16, 1 for fp32),
  *no upper limit* on CUDA; q/k/v storage offsets x element size aligned to that many elements' bytes
  (SM >= 8); attn_mask supported (last-dim stride 1 on GPUs); batch/heads/GQA as flash;
  last-dim stride 1; dtypes fp16/fp32/bf16 (SM >= 8), fp16/fp32 below. Dropout: supported, in the kernel.
* cuDNN: fp16/bf16; mask of a broadcastable 2-D or 4-D shape, not requiring grad; SM 8.0-12.1;
  dropout a multiple of 1/16 (so 0.1 is refused), and not on cuDNN 9.11-9.13; not under
  deterministic algorithms; batch and heads <= 65535; head dims <= 128 (256 on SM 9.0/10.x with
  cuDNN > 9.22 and a frontend >= 1.24; 192/128 from 9.11) and multiples of 8; seq_k != 1; seq_q != 1
  with dropout; with gradients on the D256-capable parts, backward only for d <= 128, 192/128 or
  256/256; GQA with q heads divisible by k's and v's. Dropout: in the kernel.
* Math: always (unless disabled). Dropout: a mask, with the scores and the softmax kept.

What is *not* modelled: runtime switches (`torch.backends.cuda.enable_*_sdp`, sdpa_kernel contexts),
nested tensors, ROCm (AOTriton/CK), FA3, the cuDNN frontend version (assumed recent enough for
D256). `torch.backends.cuda.can_use_flash_attention` cannot check this here: it returns False on a
CPU build.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from autotune.problem.catalog.gpus import DEFAULT_SM, GPU_SM

FLASH, EFFICIENT, CUDNN, MATH = "flash_attention", "efficient_attention", "cudnn_attention", "math"
FUSED = (FLASH, EFFICIENT, CUDNN)
"""The kernels that apply dropout inside the kernel (philox seed/offset, no mask kept)."""

_HALF = (torch.float16, torch.bfloat16)


def gpu_sm(gpu_name: str | None) -> tuple[int, int]:
    """The compute capability of a catalog GPU; SM 9.0 for one not in the table."""
    return GPU_SM.get(gpu_name or "", DEFAULT_SM)


@dataclass(frozen=True)
class SdpaCall:
    """What the selection reads of one SDPA call (dense 4-D inputs: batch, heads, seq, head_dim)."""

    dtype: torch.dtype
    batch: int
    q_heads: int
    kv_heads: int
    v_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    dropout_p: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False
    requires_grad: bool = True
    mask_shape: tuple[int, ...] | None = None
    """None: no attn_mask."""
    mask_requires_grad: bool = False
    mask_last_stride: int = 1
    last_dim_strides: tuple[int, int, int] = (1, 1, 1)
    storage_offsets: tuple[int, int, int] = (0, 0, 0)
    dims: tuple[int, int, int] = (4, 4, 4)
    k_head_dim: int | None = None
    """None: the query's."""

    @classmethod
    def of(cls, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False) -> "SdpaCall":
        dims = (query.dim(), key.dim(), value.dim())
        shape = lambda t: tuple(t.shape) if t.dim() == 4 else (1,) * (4 - t.dim()) + tuple(t.shape)  # noqa: E731
        q, k, v = shape(query), shape(key), shape(value)
        return cls(dtype=query.dtype, batch=q[0], q_heads=q[1], kv_heads=k[1], v_heads=v[1], q_len=q[2], kv_len=k[2],
                   head_dim=q[3], k_head_dim=k[3], v_head_dim=v[3], dropout_p=float(dropout_p),
                   is_causal=bool(is_causal), enable_gqa=bool(enable_gqa),
                   requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)),
                   mask_shape=None if attn_mask is None else tuple(attn_mask.shape),
                   mask_requires_grad=attn_mask is not None and attn_mask.requires_grad,
                   mask_last_stride=1 if attn_mask is None else attn_mask.stride(-1),
                   last_dim_strides=(query.stride(-1), key.stride(-1), value.stride(-1)),
                   # Under dynamo (compiled blocks) offsets are not read: taken as aligned, as torch
                   # takes symbolic ones (check_data_ptr_alignment_mem_efficient).
                   storage_offsets=((0, 0, 0) if torch.compiler.is_compiling() else
                                    (query.storage_offset(), key.storage_offset(), value.storage_offset())),
                   dims=dims)

    @property
    def d_qk(self) -> int:
        return self.head_dim if self.k_head_dim is None else self.k_head_dim

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True)
class Selection:
    backend: str
    rejected: dict[str, str] = field(default_factory=dict)
    """Each backend tried before it, and the first check it failed (torch's order)."""

    @property
    def dropout_in_kernel(self) -> bool:
        return self.backend in FUSED


# --- the checks -------------------------------------------------------------------------------
# Each returns None when it passes, else why it fails.

def _shapes(c: SdpaCall) -> str | None:  # check_tensor_shapes
    return None if c.dims == (4, 4, 4) else "query, key and value must be 4-D"


def _heads(c: SdpaCall, *, requires_same_num_heads: bool = True) -> str | None:
    """check_batch_size_and_num_heads_dense<supports_gqa=true, requires_same_num_heads>."""
    if c.enable_gqa:  # check_grouped_query_attention
        if requires_same_num_heads and c.kv_heads != c.v_heads:
            return "key and value heads differ"
        if c.q_heads % c.kv_heads or (not requires_same_num_heads and c.q_heads % c.v_heads):
            return "key/value heads do not divide query heads"
        return None
    if not c.q_heads == c.kv_heads == c.v_heads:
        return "heads differ without enable_gqa"
    return None


def _nonzero(c: SdpaCall) -> str | None:  # check_nonzero_sequence_lengths_dense
    return None if c.q_len and c.kv_len else "a zero-length sequence"


def _last_stride(c: SdpaCall, *, ignore_singleton_dim: bool) -> str | None:  # check_last_dim_stride_equals_1_dense
    ok = c.last_dim_strides == (1, 1, 1) or (ignore_singleton_dim and c.head_dim == 1)
    if not ok or c.mask_last_stride != 1:  # the mask's stride counts on GPUs
        return "last dimension's stride is not 1"
    return None


def _mask_shape(c: SdpaCall) -> str | None:  # check_attn_mask_shape
    if c.mask_shape is None:
        return None
    if c.mask_requires_grad:
        return "attn_mask requires grad"
    fits = lambda dim, target: dim == target or dim == 1  # noqa: E731
    m = c.mask_shape
    if not (fits(m[-2], c.q_len) and fits(m[-1], c.kv_len)):
        return "attn_mask's last two dims do not broadcast to (seq_q, seq_k)"
    if len(m) == 2 or (len(m) == 4 and fits(m[0], c.batch) and fits(m[1], c.q_heads)):
        return None
    return "attn_mask is not 2-D or a broadcastable 4-D"


def _sm_in(sm: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= sm <= high


def _gemm_alignment(c: SdpaCall, sm: tuple[int, int]) -> int:  # minimum_gemm_alignment
    is_half = c.dtype in _HALF
    use_tc = sm[0] >= 8 or (sm[0] >= 7 and is_half)
    mn = 4 if sm[0] >= 8 else 1
    return max(mn, 128 // (16 if is_half else 32)) if use_tc else mn


def flash_rejects(c: SdpaCall, sm: tuple[int, int] = DEFAULT_SM) -> str | None:
    """`can_use_flash_attention`: why flash cannot run this call on SM `sm`, or None."""
    if (why := _shapes(c)):
        return why
    if c.mask_shape is not None:  # check_for_attn_mask
        return "flash takes no attn_mask"
    if not (c.head_dim == c.d_qk == c.v_head_dim and c.head_dim <= 256):  # check_head_dim_size_flash
        return "head dims differ or exceed 256"
    if not _sm_in(sm, (8, 0), (12, 1)):  # check_flash_attention_hardware_support
        return f"flash needs SM 8.0-12.1, not {sm[0]}.{sm[1]}"
    if c.requires_grad and (_sm_in(sm, (8, 6), (8, 9)) or _sm_in(sm, (12, 0), (12, 1))):
        # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
        if not (c.head_dim <= 192 or (c.dropout_p == 0 and c.head_dim > 224)):
            return f"training with head_dim {c.head_dim} on SM {sm[0]}.{sm[1]}"
    if c.is_causal and c.q_len != c.kv_len:  # check_flash_causal_non_square_seqlens
        return "is_causal with seq_q != seq_k"
    if c.dtype not in (_HALF if sm[0] >= 8 else (torch.float16,)):  # check_dtypes_flash_attention (FA3 off)
        return f"flash needs fp16/bf16, not {c.dtype}"
    return _heads(c) or _nonzero(c) or _last_stride(c, ignore_singleton_dim=True)


def efficient_rejects(c: SdpaCall, sm: tuple[int, int] = DEFAULT_SM) -> str | None:
    """`can_use_mem_efficient_attention`: why the memory-efficient kernel cannot run this call, or None."""
    if not _sm_in(sm, (5, 0), (12, 1)):  # check_mem_efficient_hardware_support
        return f"memory-efficient needs SM 5.0-12.1, not {sm[0]}.{sm[1]}"
    if (why := _shapes(c)):
        return why
    align = _gemm_alignment(c, sm)  # check_head_dim_size_mem_efficient
    if not (c.head_dim == c.d_qk and c.head_dim % align == 0 and c.head_dim > 0
            and c.v_head_dim % align == 0 and c.v_head_dim > 0):
        return f"head dims not multiples of {align}"
    if sm[0] >= 8:  # check_data_ptr_alignment_mem_efficient
        align_bytes = align * c.element_size
        if any(offset * c.element_size % align_bytes for offset in c.storage_offsets):
            return f"storage offsets not {align_bytes}-byte aligned"
    if (why := _nonzero(c) or _last_stride(c, ignore_singleton_dim=False) or _heads(c)):
        return why
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if sm[0] >= 8 else (torch.float16, torch.float32)
    return None if c.dtype in dtypes else f"memory-efficient does not take {c.dtype}"


def cudnn_rejects(c: SdpaCall, sm: tuple[int, int] = DEFAULT_SM, cudnn_version: int = 91900,
                  deterministic: bool = False) -> str | None:
    """`can_use_cudnn_attention` (cuDNN >= 9, runtime-enabled): why cuDNN cannot run this call, or None."""
    if c.dropout_p > 0 and 91100 < cudnn_version < 91400:
        return "cuDNN 9.11-9.13 takes no dropout"
    if (why := _shapes(c)):
        return why
    if deterministic:  # check_cudnn_deterministic
        return "deterministic algorithms"
    if c.dtype not in (_HALF if sm[0] >= 8 else (torch.float16,)):  # check_dtypes_low_precision
        return f"cuDNN needs fp16/bf16, not {c.dtype}"
    if (why := _mask_shape(c)):
        return why
    if not _sm_in(sm, (8, 0), (12, 1)):  # check_cudnn_hardware_support
        return f"cuDNN needs SM 8.0-12.1, not {sm[0]}.{sm[1]}"
    if c.dropout_p * 16.0 != math.floor(c.dropout_p * 16.0):  # check_cudnn_dropout
        return "dropout not a multiple of 1/16"
    if (why := _nonzero(c) or _last_stride(c, ignore_singleton_dim=True) or _heads(c, requires_same_num_heads=False)):
        return why
    # check_cudnn_tensor_shapes
    if c.batch > 65535 or c.q_heads > 65535:
        return "batch or heads over 65535"
    d_qk, d_v = c.d_qk, c.v_head_dim
    sm90_or_10x = sm == (9, 0) or sm[0] == 10
    d256 = sm90_or_10x and not (sm == (10, 7) and cudnn_version <= 92500) and cudnn_version > 92200
    limit = 256 if d256 else 192 if sm90_or_10x and cudnn_version >= 91100 and (d_qk, d_v) == (192, 128) else 128
    if d_qk > limit or d_v > limit:
        return f"head_dim over {limit}"
    if d_qk % 8 or d_v % 8:
        return "head_dim not a multiple of 8"
    if c.kv_len == 1:
        return "seq_k 1"
    if c.dropout_p and c.q_len == 1:
        return "seq_q 1 with dropout"
    if c.requires_grad and d256 and not (  # check_cudnn_d256_bprop_head_dim
            (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))):
        return f"no backward for head dims {d_qk}/{d_v}"
    return None


def cudnn_first(sm: tuple[int, int], cudnn_version: int | None, cuda_major: int = 12) -> bool:
    """`check_prefer_cudnn_attention`: cuDNN moves to the front of the priority order."""
    if cudnn_version is None or cudnn_version <= 91500 or sm[0] not in (9, 10):
        return False
    return cuda_major >= 13 or sm[1] in (0, 3)


def select_cuda_backend(call: SdpaCall, *, sm: tuple[int, int] = DEFAULT_SM,
                        cudnn_version: int | None = None) -> Selection:
    """`select_sdp_backend`: the kernel CUDA's SDPA runs for `call` on SM `sm` (all backends
    enabled). `cudnn_version` (e.g. 91900 for 9.19): the run's cuDNN, which decides whether cuDNN
    comes first; None: the default order, flash -> memory-efficient -> math."""
    order = [FLASH, EFFICIENT, MATH]
    if cudnn_first(sm, cudnn_version):
        order.insert(0, CUDNN)
    checks = {FLASH: lambda: flash_rejects(call, sm), EFFICIENT: lambda: efficient_rejects(call, sm),
              CUDNN: lambda: cudnn_rejects(call, sm, cudnn_version or 0)}
    rejected: dict[str, str] = {}
    for backend in order:
        if backend == MATH:
            return Selection(MATH, rejected)
        why = checks[backend]()
        if why is None:
            return Selection(backend, rejected)
        rejected[backend] = why
    raise AssertionError("unreachable: math always runs")


# --- the trace of a GPU run ---------------------------------------------------------------------

GPU_DROPOUT_BASIS = ("attention dropout traced as on a GPU: where CUDA's SDPA picks a fused kernel, it applies "
                     "dropout inside the kernel (philox seed/offset; no mask, no seq x seq scores kept), traced as "
                     "the CPU flash kernel without dropout (output + log-sum-exp kept); dropout outside attention "
                     "(residual, embedding) traced as the CPU runs it, its mask kept")
CPU_DROPOUT_NOTE = ("attention dropout > 0: torch's CPU SDPA has no fused kernel with dropout and runs the math "
                    "kernel, which keeps the seq x seq scores, the softmax and a dropout mask per layer; a GPU applies "
                    "dropout inside its flash/memory-efficient kernel and keeps none of them, so this CPU run's peak "
                    "is higher than a GPU run's of the same configuration (issue 56)")


def dropout_note(seen: dict[str, int], *, gpu: bool) -> str:
    """What a result says of the dropout a trace met (`seen` from `sdpa_as_on_a_gpu` / `count_dropout`),
    or '' where there was none."""
    fused = sum(n for what, n in seen.items() if what.startswith("dropout_in_kernel"))
    math_calls = seen.get("math_with_dropout", 0)
    other = seen.get("other_dropout", 0)
    parts = []
    if gpu and fused:
        parts.append(GPU_DROPOUT_BASIS)
    if gpu and math_calls:
        parts.append(f"{math_calls} SDPA call(s) with dropout on CUDA's math kernel (traced with its mask and scores)")
    if not gpu and math_calls:
        parts.append(CPU_DROPOUT_NOTE)
    if other and not (gpu and fused):
        parts.append(f"dropout outside attention (residual, embedding): {other} call(s), each keeping its mask")
    return "; ".join(parts)


@contextmanager
def sdpa_as_on_a_gpu(active: bool, *, sm: tuple[int, int] = DEFAULT_SM, seen: dict[str, int] | None = None):
    """While tracing a GPU run on CPU fake tensors: `torch.nn.functional.scaled_dot_product_attention`
    (as transformers' integrations/sdpa_attention.py calls it, looked up at each call) runs, where a
    call has dropout_p > 0 and CUDA would pick a fused kernel (`select_cuda_backend`), with
    dropout_p=0, so the CPU takes its flash kernel, which keeps what the GPU's fused kernels keep: the
    output and the log-sum-exp (the GPU adds a philox seed and offset, a few bytes, not counted),
    and whose FLOPs are counted as attention. Where CUDA would run the math kernel, the call is left
    as it is. A CPU run (gloo, `active` False) traces torch's CPU path as it runs.

    Either way `seen` counts the dropout met, recomputation included: SDPA calls with dropout by what
    was traced ('dropout_in_kernel:<backend>', 'math_with_dropout') and other dropout
    (`torch.nn.functional.dropout` with p > 0 in training: residual, embedding) as 'other_dropout',
    which is traced as it runs either way."""
    functional = torch.nn.functional
    original_sdpa, original_dropout = functional.scaled_dot_product_attention, functional.dropout
    seen = {} if seen is None else seen

    def count(what: str) -> None:
        seen[what] = seen.get(what, 0) + 1

    @functools.wraps(original_sdpa)  # its name: torch's context_parallel re-patches F by the function's name
    def as_on_a_gpu(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
        if dropout_p > 0:
            if not active:
                count("math_with_dropout")  # torch's CPU SDPA: check_for_dropout
            else:
                selection = select_cuda_backend(
                    SdpaCall.of(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa), sm=sm)
                count(f"dropout_in_kernel:{selection.backend}" if selection.dropout_in_kernel else "math_with_dropout")
                if selection.dropout_in_kernel:
                    dropout_p = 0.0
        return original_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                             scale=scale, enable_gqa=enable_gqa)

    def counted_dropout(input, p=0.5, training=True, inplace=False):
        if training and p > 0:
            count("other_dropout")
        return original_dropout(input, p, training, inplace)

    functional.scaled_dot_product_attention, functional.dropout = as_on_a_gpu, counted_dropout
    try:
        yield seen
    finally:
        functional.scaled_dot_product_attention, functional.dropout = original_sdpa, original_dropout
