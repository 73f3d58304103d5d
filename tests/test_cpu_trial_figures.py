"""What makes CPU trials fast changes nothing they measure.

Two things keep a CPU trial's step short: bf16 matrix products computed in fp32 on CPUs without
bf16 units (autotune/backends/real/_cpu_bf16.py) and a tensor tracker that keeps only the rank's
peak (CapacityTracker). Each is checked here against what it replaces, run side by side: torch's
own bf16 kernels and torch's own MemTracker.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from autotune.backends.real._capacity import CapacityTracker
from autotune.problem.catalog.models import resolve_model
from autotune.distributed.training import build_model

# In a process of its own: the kernels, once registered, stay for the process's life.
_BF16_CHECK = textwrap.dedent("""
    import json, torch
    from torch.distributed._tools.mem_tracker import MemTracker
    from autotune.backends.real._cpu_bf16 import compute_bf16_kernels_in_fp32, native_bf16_matmul
    from autotune.problem.catalog.models import resolve_model
    from autotune.distributed.training import build_model

    torch.manual_seed(0)
    a, b = torch.randn(96, 160, dtype=torch.bfloat16), torch.randn(160, 48, dtype=torch.bfloat16)
    bias, batch = torch.randn(48, dtype=torch.bfloat16), torch.randn(3, 96, 160, dtype=torch.bfloat16)
    products = lambda: [a @ b, torch.addmm(bias, a, b, beta=0.5, alpha=2.0), torch.bmm(batch, b.expand(3, -1, -1)),
                        a.t().contiguous().t() @ b, (a.float() @ b.float())]

    def tracked_step():
        torch.manual_seed(0)
        model = build_model(resolve_model("micro-llama"), seed=0).to(torch.bfloat16)
        ids = torch.randint(0, 512, (2, 64))
        with MemTracker() as tracker:
            tracker.track_external(model)
            model(input_ids=ids, labels=ids).loss.backward()
        return max(tracker._peak_mem.values())

    # Flash attention as a trial's model calls it: heads as a transposed view of [batch, seq, heads, dim].
    q, k, v = (torch.randn(2, 128, 4, 32, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    grad = torch.randn(2, 128, 4, 32, dtype=torch.bfloat16).transpose(1, 2)
    flash, flash_backward = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)

    def attention():
        out, lse = flash(q, k, v, is_causal=True)
        return [out, lse, *flash_backward(grad, q, k, v, out, lse, 0.0, True)]

    native, native_peak, native_attention = products(), tracked_step(), attention()
    registered = compute_bf16_kernels_in_fp32()
    mine, mine_peak, mine_attention = products(), tracked_step(), attention()
    # The fp32 kernel (fp32 operands still reach torch's own) on the upcast operands, rounded once.
    out, lse = flash(q.float(), k.float(), v.float(), is_causal=True)
    upcast_attention = [out.bfloat16(), lse, *(g.bfloat16() for g in flash_backward(
        grad.float(), q.float(), k.float(), v.float(), mine_attention[0].float(), mine_attention[1], 0.0, True))]
    upcast = [(a.float() @ b.float()).bfloat16(), torch.addmm(bias.float(), a.float(), b.float(), beta=0.5, alpha=2.0).bfloat16(),
              torch.bmm(batch.float(), b.float().expand(3, -1, -1)).bfloat16(), (a.float() @ b.float()).bfloat16(),
              a.float() @ b.float()]
    print(json.dumps(dict(
        native_bf16=native_bf16_matmul(), registered=registered,
        same_layout=[(x.dtype, x.shape, x.stride()) == (y.dtype, y.shape, y.stride()) for x, y in zip(native, mine)],
        equals_upcast=[bool(torch.equal(x, y)) for x, y in zip(mine, upcast)],
        worst_vs_native=[float(((x.float() - y.float()).abs() / y.float().abs().clamp_min(1e-3)).max()) for x, y in zip(mine, native)],
        native_peak=native_peak, mine_peak=mine_peak,
        attention_same_layout=[(x.dtype, x.shape, x.stride()) == (y.dtype, y.shape, y.stride())
                               for x, y in zip(native_attention, mine_attention)],
        attention_equals_upcast=[bool(torch.equal(x, y)) for x, y in zip(mine_attention, upcast_attention)],
        attention_worst_vs_native=[float((x.float() - y.float()).abs().max() / y.float().abs().max())
                                   for x, y in zip(mine_attention, native_attention)])))
""")


def test_bf16_products_are_fp32_products_rounded_and_leave_the_tensor_peak_alone():
    import json

    done = subprocess.run([sys.executable, "-c", _BF16_CHECK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["native_bf16"]:
        assert result["registered"] is False  # torch's own fast kernels are kept
        return
    assert result["registered"] is True
    assert all(result["same_layout"]), result
    # Each bf16 product is exactly the fp32 product rounded once; fp32 products are torch's own.
    assert all(result["equals_upcast"]), result
    # And within bf16's rounding (2^-8 relative, one ulp) of torch's reference bf16 kernel.
    assert max(result["worst_vs_native"]) <= 2 ** -7, result
    # Flash attention (output, logsumexp, three gradients): the dtypes and strides of torch's bf16
    # kernel, exactly its fp32 kernel's results rounded once, and within a few bf16 ulps of the
    # largest value of torch's bf16 kernel, which rounds its tiles to bf16 on the way.
    assert all(result["attention_same_layout"]) and len(result["attention_same_layout"]) == 5, result
    assert all(result["attention_equals_upcast"]), result
    assert max(result["attention_worst_vs_native"]) <= 2 ** -6, result
    # The fp32 operands are kernel temporaries: MemTracker's peak of a training step is unchanged.
    assert result["mine_peak"] == result["native_peak"] > 0, result


def test_capacity_tracker_peak_equals_torchs_mem_tracker():
    """The same forward and backward, counted by CapacityTracker (rank peak only) and by torch's
    MemTracker (every module's peak too): the rank's peak and its breakdown agree to the byte."""
    from torch.distributed._tools.mem_tracker import MemTracker

    def step(tracker_class, **kwargs):
        torch.manual_seed(0)
        model = build_model(resolve_model("micro-llama"), seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
        ids = torch.randint(0, 512, (2, 64))
        with tracker_class(**kwargs) as tracker:
            tracker.track_external(model, optimizer)
            for number in range(2):  # the second step holds optimizer state, as trials measure
                if number:
                    tracker.reset_mod_stats()
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        return max(tracker._peak_mem.values()), tracker.get_tracker_snapshot("peak")

    theirs_peak, theirs_snapshot = step(MemTracker)
    mine_peak, mine_snapshot = step(CapacityTracker, capacity_bytes=None)
    assert mine_peak == theirs_peak > 0
    assert mine_snapshot == theirs_snapshot


def test_a_frozen_parameter_is_tracked_as_the_same_tensor_held_as_a_buffer():
    """Some families keep a fixed tensor as a parameter that does not require grad; torch's
    MemTracker cannot hook it (RuntimeError), CapacityTracker counts it. The same model with that
    tensor registered as a buffer instead, counted by torch's own MemTracker, must give the same
    total peak: the tensor is held either way and has no gradient either way."""
    from torch.distributed._tools.mem_tracker import MemTracker

    def step(tracker_class, *, frozen_as_buffer: bool, **kwargs):
        torch.manual_seed(0)
        model = build_model(resolve_model("micro-llama"), seed=0)
        layer = model.model.layers[0].mlp
        scale = torch.ones(model.config.intermediate_size)
        if frozen_as_buffer:
            layer.register_buffer("fixed_scale", scale)
        else:
            layer.fixed_scale = torch.nn.Parameter(scale, requires_grad=False)
        forward = layer.forward
        layer.forward = lambda x: forward(x) + 0 * layer.fixed_scale.sum()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False)
        ids = torch.randint(0, 512, (2, 64))
        with tracker_class(**kwargs) as tracker:
            tracker.track_external(model, optimizer)
            for number in range(2):
                if number:
                    tracker.reset_mod_stats()
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        return max(tracker._peak_mem.values())

    with pytest.raises(RuntimeError, match="does not require grad|doesn't require gradient"):
        step(MemTracker, frozen_as_buffer=False)
    assert step(CapacityTracker, frozen_as_buffer=False, capacity_bytes=None) == step(MemTracker, frozen_as_buffer=True)
