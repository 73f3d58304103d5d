"""CUDA SDPA's kernel selection (autotune/backends/sim/_gpu_kernels.py) and the sim traces that use it
(issue 56): a GPU run's trace applies attention dropout inside a fused kernel, as the GPU does; a CPU
(gloo) run's trace keeps the math kernel's scores, softmax and mask, as the CPU trial does.

Each selection test states the torch source check it follows (cuda/sdp_utils.cpp, sdp_utils_cpp.h)."""

from __future__ import annotations

import json

import pytest
import torch

from autotune.backends.sim import SimBackend
from autotune.backends.sim._gpu_kernels import (CUDNN, EFFICIENT, FLASH, MATH, SdpaCall, dropout_note,
                                                cudnn_first, gpu_sm, sdpa_as_on_a_gpu, select_cuda_backend)
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec

H100, A100, L40S, V100 = (9, 0), (8, 0), (8, 9), (7, 0)


def _call(**kw) -> SdpaCall:
    """A bf16 causal self-attention call (batch 2, 16 heads, seq 1024, head_dim 64), no mask."""
    base = dict(dtype=torch.bfloat16, batch=2, q_heads=16, kv_heads=16, v_heads=16, q_len=1024, kv_len=1024,
                head_dim=64, v_head_dim=64, dropout_p=0.1, is_causal=True)
    if "head_dim" in kw and "v_head_dim" not in kw:
        kw["v_head_dim"] = kw["head_dim"]
    return SdpaCall(**{**base, **kw})


def _kernel(sm=H100, cudnn_version=None, **kw) -> str:
    return select_cuda_backend(_call(**kw), sm=sm, cudnn_version=cudnn_version).backend


# --- the rules, one test per check --------------------------------------------------------------

def test_flash_for_bf16_causal_without_mask_head_dim_64_with_dropout():
    # priority flash -> efficient -> math (Context.h's default order); flash supports dropout.
    assert _kernel() == FLASH
    assert _kernel(dropout_p=0.0) == FLASH


def test_memory_efficient_where_a_mask_is_given():
    # check_for_attn_mask: flash takes no mask; the memory-efficient kernel does.
    selection = select_cuda_backend(_call(is_causal=False, mask_shape=(2, 1, 1024, 1024)), sm=H100)
    assert selection.backend == EFFICIENT and "attn_mask" in selection.rejected[FLASH]
    assert selection.dropout_in_kernel


def test_fp32_is_not_flash_but_memory_efficient():
    # check_dtypes_flash_attention: fp16/bf16 on SM >= 8 (FA3 off); mem-efficient takes fp32 (alignment 4).
    assert _kernel(dtype=torch.float32) == EFFICIENT
    assert _kernel(dtype=torch.float32, head_dim=68) == EFFICIENT  # 68 % 4 == 0
    assert _kernel(dtype=torch.float32, head_dim=66) == MATH       # 66 % 4 != 0


def test_head_dim_over_256_leaves_flash_and_unaligned_leaves_both():
    # check_head_dim_size_flash: <= 256. check_head_dim_size_mem_efficient: a multiple of the GEMM
    # alignment (8 for bf16 on SM >= 8), no upper limit on CUDA builds.
    assert _kernel(head_dim=256) == FLASH
    assert _kernel(head_dim=320) == EFFICIENT
    assert _kernel(head_dim=300) == MATH        # > 256 and 300 % 8 != 0
    assert _kernel(head_dim=100) == FLASH       # flash has no alignment rule (pads internally)
    assert _kernel(head_dim=100, mask_shape=(1024, 1024), is_causal=False) == MATH  # masked: no flash, unaligned


def test_different_value_head_dim_is_not_flash():
    # check_head_dim_size_flash: q, k and v head dims equal; mem-efficient needs only q == k.
    assert _kernel(head_dim=128, v_head_dim=64) == EFFICIENT


def test_grouped_query_attention_needs_enable_gqa():
    # check_batch_size_and_num_heads_dense: equal heads unless enable_gqa (k, v heads equal, dividing q's).
    assert _kernel(kv_heads=4, v_heads=4) == MATH
    assert _kernel(kv_heads=4, v_heads=4, enable_gqa=True) == FLASH
    assert _kernel(kv_heads=5, v_heads=5, enable_gqa=True) == MATH  # 16 % 5 != 0


def test_causal_flash_needs_square_attention():
    # check_flash_causal_non_square_seqlens; the memory-efficient kernel takes it.
    assert _kernel(q_len=512) == EFFICIENT
    assert _kernel(q_len=512, is_causal=False) == FLASH


def test_the_gpu_generation_decides_flash():
    # check_flash_attention_hardware_support: SM 8.0-12.1; mem-efficient from SM 5.0 (fp16/fp32 below SM 8).
    assert _kernel(sm=V100) == MATH                      # bf16 on SM 7.0: neither fused kernel
    assert _kernel(sm=V100, dtype=torch.float16) == EFFICIENT
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: training, head_dim in (192, 256].
    assert _kernel(sm=L40S, head_dim=200) == EFFICIENT
    assert _kernel(sm=A100, head_dim=200) == FLASH
    assert _kernel(sm=L40S, head_dim=240, dropout_p=0.0) == FLASH  # > 224 without dropout
    assert gpu_sm("h100-80gb") == H100 and gpu_sm("a10g-24gb") == (8, 6)


def test_cudnn_only_first_on_new_cudnn_and_never_for_dropout_off_the_sixteenths():
    # priority_order / check_prefer_cudnn_attention: cuDNN > 9.15.0 on SM 9.0/10.x; check_cudnn_dropout: k/16.
    assert not cudnn_first(H100, None) and not cudnn_first(A100, 91900) and cudnn_first(H100, 91900)
    assert _kernel(cudnn_version=91900) == FLASH                       # 0.1 is not a multiple of 1/16
    assert _kernel(cudnn_version=91900, dropout_p=0.125) == CUDNN
    assert _kernel(cudnn_version=91200, dropout_p=0.125) == FLASH      # 9.11-9.13: no dropout
    assert _kernel(cudnn_version=91900, dropout_p=0.125, dtype=torch.float32) == EFFICIENT


def test_the_call_is_read_from_tensors():
    q = torch.empty(2, 8, 128, 64, dtype=torch.bfloat16, requires_grad=True)
    kv = torch.empty(2, 2, 128, 64, dtype=torch.bfloat16, requires_grad=True)
    call = SdpaCall.of(q, kv, kv, None, 0.1, True, True)
    assert (call.q_heads, call.kv_heads, call.head_dim, call.enable_gqa, call.requires_grad) == (8, 2, 64, True, True)
    assert select_cuda_backend(call).backend == FLASH


def test_a_gpu_trace_of_sdpa_keeps_what_flash_keeps():
    """On real CPU tensors: under the GPU context a dropout call runs the CPU flash kernel; outside,
    the math kernel (its softmax and dropout mask)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    q, k, v = (torch.randn(1, 2, 32, 64, requires_grad=True) for _ in range(3))
    for gpu in (True, False):
        seen = {}
        with sdpa_as_on_a_gpu(gpu, seen=seen), Ops() as ops:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        flash = "_scaled_dot_product_flash_attention_for_cpu" in ops.ops
        assert flash == gpu and ("bernoulli_" in ops.ops) == (not gpu)
        # fp32 on a GPU: the memory-efficient kernel (flash takes fp16/bf16 only), dropout in the kernel.
        assert seen == ({"dropout_in_kernel:efficient_attention": 1} if gpu else {"math_with_dropout": 1})
    assert torch.nn.functional.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"
    assert "fused kernel" in dropout_note({"dropout_in_kernel:flash_attention": 1}, gpu=True)
    assert "higher than a GPU run" in dropout_note({"math_with_dropout": 1}, gpu=False)


# --- the traces (issue 56) -------------------------------------------------------------------------

def _gpt2(tmp_path, attn_pdrop: float, resid_pdrop: float = 0.0):
    folder = tmp_path / f"gpt2-a{attn_pdrop}-r{resid_pdrop}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="gpt2", architectures=["GPT2LMHeadModel"], n_layer=2, n_embd=128, n_head=2, n_positions=512,
        vocab_size=1024, attn_pdrop=attn_pdrop, resid_pdrop=resid_pdrop, embd_pdrop=0.0)))
    return resolve_model(str(folder / "config.json"))


def _spec(model) -> TrialSpec:
    return TrialSpec(model=model, cluster=Cluster(num_gpus=2), seq_len=512,
                     train=TrainConfig(micro_batch_size=4, activation_checkpointing="none"))


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """Both backends' results on the small GPT-2, with and without attention dropout."""
    tmp = tmp_path_factory.mktemp("gpt2")
    models = {p: _gpt2(tmp, p) for p in (0.0, 0.1)}
    results = {}
    for kind in ("cuda", "cpu"):
        with SimBackend(device_kind=kind, extrapolate=False, screen=False) as sim:
            for p, model in models.items():
                results[kind, p] = sim.evaluate(_spec(model))
    return results


def test_a_gpu_trace_with_attention_dropout_is_the_run_without(traced):
    with_dropout, without = traced["cuda", 0.1], traced["cuda", 0.0]
    assert with_dropout.status == without.status == "ok", with_dropout.message
    assert with_dropout.peak_bytes == pytest.approx(without.peak_bytes, rel=0.03)
    assert with_dropout.tokens_per_sec.value == pytest.approx(without.tokens_per_sec.value, rel=0.10)
    assert with_dropout.extras["dropout"]["calls"] == {"dropout_in_kernel:flash_attention": 2}
    assert "inside the kernel" in with_dropout.peak_memory.basis
    assert "dropout" not in without.extras


def test_a_cpu_trace_keeps_the_math_kernels_scores_softmax_and_mask(traced):
    with_dropout, without = traced["cpu", 0.1], traced["cpu", 0.0]
    # Per layer the math kernel keeps batch x heads x seq x seq scores, softmax and mask: 3 x 2 MiB
    # in bf16 here, against the flash kernel's output and log-sum-exp.
    assert with_dropout.extras["tensor_peak_bytes"] > 1.15 * without.extras["tensor_peak_bytes"]
    assert with_dropout.extras["dropout"]["calls"] == {"math_with_dropout": 2}
    assert "higher than a GPU run" in with_dropout.extras["dropout"]["note"]
    assert "higher than a GPU run" in with_dropout.peak_memory.basis


def test_residual_dropout_is_named_apart_and_traced_as_it_runs(tmp_path):
    with SimBackend(device_kind="cuda", extrapolate=False, screen=False) as sim:
        result = sim.evaluate(_spec(_gpt2(tmp_path, 0.1, resid_pdrop=0.1)))
    calls = result.extras["dropout"]["calls"]
    assert calls["dropout_in_kernel:flash_attention"] == 2 and calls["other_dropout"] == 4  # 2 per block
