"""bf16 matrix products and flash attention on CPUs without native bf16 arithmetic, at fp32 speed.

On x86 CPUs without AVX512-BF16 or AMX (AVX2-only EPYCs, most laptops), torch has no fast bf16
GEMM: oneDNN refuses bf16 there and `aten::mm` falls back to a reference loop, 15-20x slower than
fp32 on the same core (measured: a 256 x 256 @ 256 x 8000 product 0.68 s in bf16, 0.04 s upcast
to fp32; a tiny-llama training step spends 93% of its time in `aten::mm`). Its CPU flash attention
converts every tile and runs 8x slower in bf16 than in fp32 (the next 25% of the step once the
products are fast). CPU trials run bf16 mixed precision as GPUs do, so without this every CPU
trial, and the test suite, pays that.

`compute_bf16_kernels_in_fp32()` registers CPU kernels for `mm`, `addmm` and `bmm` that, for bf16
operands, multiply the operands upcast to fp32 and round the product to bf16: exactly what a
GPU's tensor cores and oneDNN's bf16 GEMM compute (products of bf16 values are exact in fp32, sums
accumulate in fp32), so results differ from the reference loop only in the order of fp32
additions (one bf16 ulp in about 1 element in 10,000). CPU flash attention's forward and backward
run torch's fp32 kernel on the upcast operands and round its results to bf16 once, where torch's
bf16 kernel also rounds its tiles on the way (within a few bf16 ulps of it). Other dtypes run the
original kernels.

What trials measure is unchanged: each output has the same dtype, shape and strides, and the fp32
operands are temporaries inside the kernel, below the dispatcher level at which torch's
MemTracker (and so the cpu backend's tensor peak) sees tensors, as a native kernel's workspace
is. Throughput figures of CPU trials and `calibrate --backend cpu` both run with it, so a
calibrated CPU profile describes the trials it estimates. Only CPU trial processes call it.
"""

from __future__ import annotations

import warnings

import torch

_LIBRARY: torch.library.Library | None = None


def native_bf16_matmul() -> bool:
    """Whether this CPU has fast bf16 GEMM (oneDNN's bf16 path: AVX512-BF16, AMX, or Arm's)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def compute_bf16_kernels_in_fp32() -> bool:
    """Register the fp32-computing bf16 kernels in this process (once); True if registered.
    A CPU with native bf16 GEMM keeps torch's own kernels."""
    global _LIBRARY
    if _LIBRARY is not None:
        return True
    if native_bf16_matmul():
        return False
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore", UserWarning)
        library.impl("mm", _mm, "CPU")
        library.impl("addmm", _addmm, "CPU")
        library.impl("bmm", _bmm, "CPU")
        if hasattr(torch.library, "get_kernel"):  # torch >= 2.10: the original kernel stays callable
            for name, kernel in _ATTENTION_KERNELS.items():
                _ORIGINAL[name] = torch.library.get_kernel(f"aten::{name}", "CPU")
                library.impl(name, kernel, "CPU", with_keyset=True)
    _LIBRARY = library
    return True


def _bf16(*tensors: torch.Tensor) -> bool:
    return all(t.dtype is torch.bfloat16 for t in tensors)


# Each kernel calls the `.out` overload, which keeps torch's own kernel: calling the functional
# op again would come back here.

def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not _bf16(a, b):
        return torch.ops.aten.mm.out(a, b, out=a.new_empty((a.shape[0], b.shape[1])))
    product = torch.ops.aten.mm.out(a.float(), b.float(), out=a.new_empty((a.shape[0], b.shape[1]),
                                                                           dtype=torch.float32))
    return product.to(torch.bfloat16)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    shape = (a.shape[0], b.shape[1])
    if not _bf16(bias, a, b):
        return torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=a.new_empty(shape))
    product = torch.ops.aten.addmm.out(bias.float(), a.float(), b.float(), beta=beta, alpha=alpha,
                                       out=a.new_empty(shape, dtype=torch.float32))
    return product.to(torch.bfloat16)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    shape = (a.shape[0], a.shape[1], b.shape[2])
    if not _bf16(a, b):
        return torch.ops.aten.bmm.out(a, b, out=a.new_empty(shape))
    product = torch.ops.aten.bmm.out(a.float(), b.float(), out=a.new_empty(shape, dtype=torch.float32))
    return product.to(torch.bfloat16)


# CPU flash attention: torch's bf16 kernel converts every tile on a CPU without bf16 units and runs
# 8x slower than its fp32 twin (tiny-llama's heads, 2 x 256 tokens: 65 ms against 8 ms forward and
# backward). The operands go through the fp32 kernel and the results come back in the dtypes and
# strides the bf16 kernel gives: the same tensors for MemTracker, fp32 copies as kernel temporaries.
# The bf16 kernel accumulates in fp32 too; what differs is where it rounds its tiles to bf16.

_ORIGINAL: dict[str, "torch._C._SafeKernelFunction"] = {}


def _upcast(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.float() if t is not None and t.dtype is torch.bfloat16 else t


def _flash_forward(keyset, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    original = _ORIGINAL["_scaled_dot_product_flash_attention_for_cpu"]
    if not _bf16(query, key, value):
        return original.call_boxed(keyset, query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    out, logsumexp = original.call_boxed(keyset, query.float(), key.float(), value.float(), dropout_p, is_causal,
                                         attn_mask=_upcast(attn_mask), scale=scale)
    return out.to(torch.bfloat16), logsumexp


def _flash_backward(keyset, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                    scale=None):
    original = _ORIGINAL["_scaled_dot_product_flash_attention_for_cpu_backward"]
    if not _bf16(grad_out, query, key, value, out):
        return original.call_boxed(keyset, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                                   attn_mask=attn_mask, scale=scale)
    grads = original.call_boxed(keyset, grad_out.float(), query.float(), key.float(), value.float(), out.float(),
                                logsumexp, dropout_p, is_causal, attn_mask=_upcast(attn_mask), scale=scale)
    return tuple(grad.to(torch.bfloat16) for grad in grads)


_ATTENTION_KERNELS = {"_scaled_dot_product_flash_attention_for_cpu": _flash_forward,
                      "_scaled_dot_product_flash_attention_for_cpu_backward": _flash_backward}
