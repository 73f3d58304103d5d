"""`autotune calibrate`: microbenchmarks of this machine, written as a hardware profile.

    autotune calibrate [--backend cpu|cuda] [--model tiny-llama] [--out PROFILE.json]

Everything here is *measured* on the machine it runs on, in about a minute:

* GEMM throughput at the model's shapes (the projections and the LM head, at several token
  counts): a least-squares fit of time = FLOPs / rate + fixed cost per kernel;
* attention (scaled_dot_product_attention, forward + backward, FLOPs by torch's flop-counter
  formulas, as the simulator's trace counts them) the same way;
* memory bandwidth of elementwise ops at activation sizes: time = bytes / bandwidth + fixed cost;
  and of ops too large for the caches (log-softmax over the vocabulary, 32-128 MiB moved):
  `memory_gbps_large`, the rate ops of costmodel.LARGE_MEMORY_OP_BYTES and more are costed at;
* all-gather and reduce-scatter at the model's FSDP unit sizes across the local ranks (gloo on
  CPU with 2 ranks, NCCL across every local GPU): time = latency + bytes (n-1)/n / bandwidth;
* the AdamW step (autotune's own `make_optimizer`) over one rank's shard of the model;
* the host time per dispatched op (`host_op_us`) of a real FSDP2 forward + backward of a 2-block
  copy of the model at a few tokens, over the ops it dispatches (bench_host_overhead);
* cuda with float8 tensor cores (H100, H200, Ada): float8 GEMMs (`torch._scaled_mm`, as torchao's
  float8 linears run them) at the block projections' shapes, tensorwise and rowwise scaled, with the
  bf16 GEMMs of the same shapes beside them (bench_float8_gemms);
* cuda only: pinned host<->device copies, and issue 12's runtime memory terms: the CUDA context
  (mem_get_info around initialisation), cuBLAS workspace, NCCL memory after the first all-gather
  and reduce-scatter at the local world size, and reserved vs allocated over a short FSDP2 step.

The compute benchmarks run on every rank at once, as a training job's ranks do (on CPU one
thread per rank: torchrun's OMP_NUM_THREADS=1 default), and rank 0's figures are kept.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from autotune.estimate.costmodel import LARGE_MEMORY_OP_BYTES
from autotune.estimate.hardware import HardwareFigure, HardwareProfile, machine_description

TOKEN_COUNTS = (256, 512, 1024, 2048)
"""Tokens per micro-batch the GEMMs are timed at (the rows of every projection)."""
CUDA_TOKEN_COUNTS = (512, 2048, 8192, 16384)  # a GPU's matmuls reach their rate at training sizes
COLLECTIVE_SIZES_FRACTIONS = (0.125, 0.5, 1.0, 2.0)


def fit_linear(work: list[float], seconds: list[float]) -> tuple[float, float]:
    """(rate per second, fixed seconds) of time = work / rate + fixed, least squares, with the
    fixed cost kept >= 0 (refit through the origin when the free fit is negative)."""
    n = len(work)
    if n < 2:
        raise ValueError("need at least two points to fit")
    mx, my = sum(work) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in work)
    slope = sum((x - mx) * (y - my) for x, y in zip(work, seconds)) / sxx if sxx else 0.0
    fixed = my - slope * mx
    if fixed < 0 or slope <= 0:
        fixed = 0.0
        slope = sum(x * y for x, y in zip(work, seconds)) / sum(x * x for x in work)
    return 1.0 / slope, fixed


def _timed(fn, *, device, repeats: int = 5, min_s: float = 0.02, calls: int | None = None) -> float:
    """Median seconds of one call of `fn`, after a warm-up call; calls are batched until a
    timing lasts at least `min_s` (the clock's resolution and Python overhead), or `calls` at a
    time (collectives: every rank must make the same number of calls)."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    fn()
    sync()
    fixed = calls is not None
    calls = calls or 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        elapsed = time.perf_counter() - start
        if fixed or elapsed >= min_s or calls >= 1024:
            break
        calls *= 4
    samples = [elapsed / calls]
    for _ in range(repeats - 1):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def _model_shapes(model) -> dict[str, int]:
    return dict(hidden=model.hidden_size, ffn=model.mlp_width, vocab=model.vocab_size, heads=model.num_attention_heads,
                kv_heads=model.num_key_value_heads, head_dim=model.head_dim)


def _block_linear_shapes(s: dict[str, int]) -> list[tuple[int, int]]:
    """The (out, in) shapes of a Llama-like block's linears from `_model_shapes`: q and o, k and v,
    the MLP's three."""
    kv = s["kv_heads"] * s["head_dim"]
    return [(s["hidden"], s["hidden"])] * 2 + [(kv, s["hidden"])] * 2 + [(s["ffn"], s["hidden"])] * 3


def attention_inputs(batch: int, seq_len: int, heads: int, head_dim: int, *, device, dtype):
    """q, k and v in the layout transformers' attention passes them to SDPA in training (no KV
    cache): views of the projections' [batch, seq, heads, head_dim] output, transposed. torch's CPU
    flash backward runs half as fast on it as on contiguous [batch, heads, seq, head_dim] tensors
    (bf16, tiny-llama's shapes: 0.24 s against 0.13 s), and trials run this layout."""
    import torch

    return tuple(torch.randn(batch, seq_len, heads, head_dim, device=device, dtype=dtype,
                             requires_grad=True).transpose(1, 2) for _ in range(3))


def memory_ops(tokens: int, width: int, *, device, dtype) -> list[tuple[float, Any]]:
    """The elementwise ops the memory-bound fit times at one activation size, each with the bytes it
    moves as the simulator's trace counts an op's (every tensor argument read, every output written:
    backends/sim/_trace.py `_tensor_bytes`): a multiply of two `dtype` tensors, and a cast of an fp32
    one to `dtype` (none when `dtype` is fp32: `.to` would return its input)."""
    import torch

    x = torch.randn(tokens, width, device=device, dtype=dtype)
    y = torch.randn(tokens, width, device=device, dtype=dtype)
    ops = [(3.0 * x.numel() * x.element_size(), lambda: x * y)]
    if dtype != torch.float32:
        xf = x.float()
        ops.append((float(xf.numel() * (xf.element_size() + x.element_size())), lambda: xf.to(dtype)))
    return ops


def bench_compute(model, *, device, dtype, seq_len: int, token_counts=TOKEN_COUNTS) -> dict[str, Any]:
    """GEMMs at the model's shapes, SDPA forward+backward, elementwise ops: raw points and fits."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    s = _model_shapes(model)
    gemm_points, mem_points, attn_points = [], [], []
    by_tokens: dict[int, list[float]] = {}
    for tokens in token_counts:
        # F.linear, as the model's projections and LM head run (x @ W^T)
        for k, n in ((s["hidden"], s["hidden"]), (s["hidden"], s["ffn"]), (s["ffn"], s["hidden"]),
                     (s["hidden"], s["vocab"])):
            x = torch.randn(tokens, k, device=device, dtype=dtype)
            w = torch.randn(n, k, device=device, dtype=dtype)
            point = (2.0 * tokens * k * n, _timed(lambda: F.linear(x, w), device=device))
            gemm_points.append(point)
            by_tokens.setdefault(tokens, [0.0, 0.0])
            by_tokens[tokens][0] += point[0]
            by_tokens[tokens][1] += point[1]
        for width in (s["hidden"], s["ffn"]):
            for nbytes, op in memory_ops(tokens, width, device=device, dtype=dtype):
                mem_points.append((nbytes, _timed(op, device=device)))
    attn_by_tokens: dict[int, float] = {}
    # At least two batch sizes, so the fit has two points when every token count is <= one sequence.
    for batch in sorted({max(t // seq_len, 1) for t in token_counts} | {1, 2}):
        q, k, v = attention_inputs(batch, seq_len, s["heads"], s["head_dim"], device=device, dtype=dtype)

        def attention():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))

        shape = tuple(q.shape)
        flops = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)
        attn_points.append((float(flops), _timed(attention, device=device)))
        attn_by_tokens[batch * seq_len] = attn_points[-1][0] / attn_points[-1][1]
    # Memory-bound ops too large for the caches (the loss's log-softmax over the vocabulary, the
    # casts of whole logits): fresh outputs, buffers of 2-8x costmodel.LARGE_MEMORY_OP_BYTES.
    large_points = []
    for factor in (2, 4, 8):
        rows = max(factor * LARGE_MEMORY_OP_BYTES // (8 * s["vocab"]), 1)  # read + write, fp32
        logits = torch.randn(rows, s["vocab"], device=device, dtype=torch.float32)
        large_points.append((2.0 * logits.numel() * 4, _timed(lambda: torch.log_softmax(logits, dim=-1), device=device)))
        large_points.append((3.0 * logits.numel() * 4, _timed(lambda: logits * logits, device=device)))
        del logits
    large_rate, _ = fit_linear(*zip(*large_points))
    gemm_rate, gemm_fixed = fit_linear(*zip(*gemm_points))
    attn_rate, attn_fixed = fit_linear(*zip(*attn_points))
    mem_rate, mem_fixed = fit_linear(*zip(*mem_points))
    return dict(gemm=dict(points=gemm_points, flops_per_s=gemm_rate, fixed_s=gemm_fixed,
                          flops_per_s_by_tokens={t: f / sec for t, (f, sec) in by_tokens.items()}),
                attention=dict(points=attn_points, flops_per_s=attn_rate, fixed_s=attn_fixed, kernels_per_point=1,
                               flops_per_s_by_tokens=attn_by_tokens),
                memory=dict(points=mem_points, bytes_per_s=mem_rate, fixed_s=mem_fixed),
                memory_large=dict(points=large_points, bytes_per_s=large_rate))


def bench_float8_gemms(model, *, device, token_counts=CUDA_TOKEN_COUNTS) -> dict[str, Any]:
    """float8 GEMMs at the block projections' shapes (float8 training converts the blocks' linears,
    not the head): `torch._scaled_mm` with e4m3 operands, bf16 output, the second operand
    column-major, tensorwise (one fp32 scale per operand) and rowwise (a scale per row of each) scaled,
    and bf16 `F.linear` at the same shapes: rates fitted as bench_compute's, and by token count."""
    import torch
    import torch.nn.functional as F

    s = _model_shapes(model)
    shapes = ((s["hidden"], s["hidden"]), (s["hidden"], s["ffn"]), (s["ffn"], s["hidden"]))
    points: dict[str, list[tuple[float, float]]] = {"bf16": [], "tensorwise": [], "rowwise": []}
    by_tokens: dict[str, dict[int, list[float]]] = {kind: {} for kind in points}
    fp8 = torch.float8_e4m3fn
    for tokens in token_counts:
        for k, n in shapes:
            x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
            a, b = x.to(fp8), w.to(fp8).t()  # b: [k, n], column-major, as _scaled_mm requires
            one = torch.ones((), device=device, dtype=torch.float32)
            rows_a = torch.ones(tokens, 1, device=device, dtype=torch.float32)
            cols_b = torch.ones(1, n, device=device, dtype=torch.float32)
            runs = {"bf16": lambda: F.linear(x, w),
                    "tensorwise": lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                    "rowwise": lambda: torch._scaled_mm(a, b, scale_a=rows_a, scale_b=cols_b,
                                                        out_dtype=torch.bfloat16)}
            for kind, fn in runs.items():
                point = (2.0 * tokens * k * n, _timed(fn, device=device))
                points[kind].append(point)
                total = by_tokens[kind].setdefault(tokens, [0.0, 0.0])
                total[0] += point[0]
                total[1] += point[1]
    result: dict[str, Any] = dict(shapes=[list(shape) for shape in shapes])
    for kind, kind_points in points.items():
        rate, fixed = fit_linear(*zip(*kind_points))
        result[kind] = dict(points=kind_points, flops_per_s=rate, fixed_s=fixed,
                            flops_per_s_by_tokens={t: f / sec for t, (f, sec) in by_tokens[kind].items()})
    return result


def has_float8_gemms(device) -> bool:
    """float8 tensor cores (compute capability 8.9 and up) and torch's `_scaled_mm`."""
    import torch

    return (device.type == "cuda" and hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn")
            and torch.cuda.get_device_capability(device) >= (8, 9))


TRACKER_BLOCKS = (2, 4)
"""Depths of the copies the tracker is timed on: its cost per op grows with the tensors it
tracks (on tiny-llama, 2 gloo ranks: 229-237 us per op at 2 blocks, 314-342 us at 4)."""


def bench_tracker(model, *, device, mesh, seq_len: int, pairs: int = 7) -> dict[str, Any]:
    """Per-op cost of the cpu backend's tensor-memory tracker (CapacityTracker, a MemTracker that
    runs on every dispatched op of a real cpu trial), as a trial runs it, at two depths: a copy
    of the model cut to each of TRACKER_BLOCKS blocks, wrapped as trials wrap it, with its
    optimizer's state and the tracker attached as run_trial attaches it (`track_external(model,
    optimizer)`); forward + backward with and without it, the difference over the ops the same
    forward + backward dispatches (counted by a dispatch mode). The cost per op is then a line in
    the number of blocks (`per_op_s` at none, `per_op_per_block_s`). Every rank runs it (FSDP2's
    collectives); rank 0's figures are kept.

    A bare 2-block model without FSDP2 and the optimizer (what this measured until 2026-11-23)
    put the cost at 167-195 us per op where real 4-block tiny-llama trials spent ~300 us."""
    depths = tuple(sorted({min(n, model.num_layers) for n in TRACKER_BLOCKS}))
    points = {n: _tracker_cost(model, device=device, mesh=mesh, seq_len=seq_len, pairs=pairs, num_layers=n)
              for n in depths}
    n1, n2 = depths[0], depths[-1]
    c1, c2 = points[n1]["per_op_s"], points[n2]["per_op_s"]
    per_block = max((c2 - c1) / (n2 - n1), 0.0) if n2 != n1 else 0.0
    return dict(per_op_s=max(c1 - per_block * n1, 0.0), per_op_per_block_s=per_block, by_blocks=points, pairs=pairs,
                wrapped="FSDP2 (autotune.distributed.parallel.parallelize) with its optimizer")


def _tracker_cost(model, *, device, mesh, seq_len: int, pairs: int, num_layers: int) -> dict[str, Any]:
    import torch

    from autotune.backends.real._capacity import CapacityTracker
    from autotune.distributed.training import make_optimizer, token_batches, train_step

    net = _short_copy(model, device=device, mesh=mesh, num_layers=num_layers)
    optimizer = make_optimizer(net)
    vocab = model.vocab_size
    train_step(net, optimizer, token_batches(vocab_size=vocab, micro_batch_size=1, seq_len=seq_len, device=device),
               grad_accum_steps=1)  # the optimizer's state exists, as in a trial's timed steps
    ids = torch.randint(0, vocab, (1, seq_len), device=device)

    def step():
        net(input_ids=ids, labels=ids).loss.backward()
        net.zero_grad(set_to_none=True)

    ops = count_dispatched_ops(lambda: net(input_ids=ids, labels=ids).loss.backward())
    net.zero_grad(set_to_none=True)
    tracker = CapacityTracker(capacity_bytes=None)
    tracker.track_external(net, optimizer)

    def tracked_step():
        tracker.reset_mod_stats()  # MemTracker refuses a second forward otherwise (as the trials do)
        step()

    # Interleaved pairs, the median of the per-pair differences: the machine's load drifts less
    # within a pair than between two blocks of timings.
    step()
    with tracker:
        tracked_step()
    plains, differences = [], []
    for _ in range(pairs):
        start = time.perf_counter()
        step()
        plain = time.perf_counter() - start
        with tracker:
            start = time.perf_counter()
            tracked_step()
            tracked = time.perf_counter() - start
        plains.append(plain)
        differences.append(tracked - plain)
    plain, extra = statistics.median(plains), max(statistics.median(differences), 0.0)
    return dict(ops=ops, plain_s=plain, tracked_s=plain + extra, per_op_s=extra / ops)


def bench_adamw(model, *, device, world_size: int, impl: str) -> dict[str, Any]:
    """AdamW (autotune's make_optimizer) over one rank's shard of the model's parameters."""
    import torch
    from torch import nn

    from autotune.distributed.training import make_optimizer

    s = _model_shapes(model)
    layers = model.num_layers
    shapes = [(s["vocab"], s["hidden"]), (s["vocab"], s["hidden"])]
    for _ in range(layers):
        shapes += _block_linear_shapes(s)
    holder = nn.Module()
    holder.params = nn.ParameterList(
        nn.Parameter(torch.randn(max(rows // world_size, 1), cols, device=device)) for rows, cols in shapes)
    for p in holder.params:
        p.grad = torch.randn_like(p)
    optimizer = make_optimizer(holder, impl=impl)
    count = sum(p.numel() for p in holder.params)
    seconds = _timed(optimizer.step, device=device, repeats=3)
    return dict(params=count, seconds=seconds, params_per_s=count / seconds)


def bench_fresh_pages(*, numel: int = 16 * 2**20, repeats: int = 7) -> dict[str, Any]:
    """The first touch of fresh host memory, one thread (the driver's copy into pageable memory is
    one): copying into a new fp32 tensor of at least costmodel.HOST_MMAP_THRESHOLD_BYTES (mapped
    fresh, every page faulted in) less the same copy into a reused one, per byte. What FSDP2's CPU
    offload pays for each large gradient shard it copies back while gradients accumulate."""
    import torch

    from autotune.estimate import costmodel

    numel = max(numel, costmodel.HOST_MMAP_THRESHOLD_BYTES // 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source, reused = torch.randn(numel), torch.empty(numel)
        reused.copy_(source)
        fresh_s, reused_s = [], []
        for _ in range(repeats):  # interleaved: a quiet moment favours neither
            start = time.perf_counter()
            torch.empty(numel).copy_(source)
            fresh_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            reused.copy_(source)
            reused_s.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    fresh, again = statistics.median(fresh_s), statistics.median(reused_s)
    return dict(bytes=numel * 4, fresh_s=fresh, reused_s=again, repeats=repeats,
                ns_per_byte=max(fresh - again, 0.0) / (numel * 4) * 1e9)


def bench_offload_accumulate(model, *, device, world_size: int, repeats: int = 3) -> dict[str, Any]:
    """What FSDP2's CPU offload does per gradient shard in a micro-batch that accumulates
    (_fsdp_collectives.foreach_reduce): a blocking copy of the reduced fp32 shard from the device into
    a new pageable host tensor, then the host add into the offloaded gradient. Over one block's
    shards at this world size (one rank's, all local ranks at once as a node's ranks do); the shards
    of at least costmodel.HOST_MMAP_THRESHOLD_BYTES are counted apart, their first touch being
    `fresh_page_ns_per_byte`'s."""
    import torch

    from autotune.estimate import costmodel

    shards = [torch.randn(max(rows // world_size, 1), cols, device=device)
              for rows, cols in _block_linear_shapes(_model_shapes(model))]
    grads = [torch.zeros(shard.shape) for shard in shards]  # the offloaded gradients on the host

    def accumulate():
        for shard, grad in zip(shards, grads):
            grad += shard.to("cpu")  # non_blocking=False: FSDP2 blocks when it accumulates

    seconds = _timed(accumulate, device=device, repeats=repeats)
    elements = sum(shard.numel() for shard in shards)
    fresh = sum(shard.numel() * 4 for shard in shards if shard.numel() * 4 >= costmodel.HOST_MMAP_THRESHOLD_BYTES)
    return dict(seconds=seconds, elements=elements, fresh_page_bytes=fresh, shards=len(shards))


def bench_collectives(unit_bytes: list[int], *, device, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    ag_points, rs_points = [], []
    for nbytes in unit_bytes:
        numel = max(nbytes // 4 // world_size * world_size, world_size)
        full = torch.empty(numel, device=device)
        shard = torch.ones(numel // world_size, device=device)
        dist.barrier()
        ag_points.append((float(numel * 4), _timed(lambda: dist.all_gather_into_tensor(full, shard), device=device, calls=8)))
        dist.barrier()
        rs_points.append((float(numel * 4), _timed(lambda: dist.reduce_scatter_tensor(shard, full), device=device, calls=8)))
    out = {}
    for name, points in (("all_gather", ag_points), ("reduce_scatter", rs_points)):
        scaled = [(b * (world_size - 1) / world_size, t) for b, t in points]
        rate, fixed = fit_linear(*zip(*scaled))
        out[name] = dict(points=points, bus_bytes_per_s=rate, latency_s=fixed)
    return out


def bench_host_copies(*, device, nbytes: int = 256 * 2**20) -> dict[str, float]:
    import torch

    host = torch.empty(nbytes // 4, pin_memory=True)
    dev = torch.empty(nbytes // 4, device=device)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), device=device, repeats=3)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), device=device, repeats=3)
    return dict(h2d_bytes_per_s=nbytes / h2d, d2h_bytes_per_s=nbytes / d2h)


def _short_copy(model, *, device, mesh, num_layers: int = 2):
    """A copy of the model cut to `num_layers` blocks on `device`, wrapped as trials wrap it
    (autotune.distributed.parallel)."""
    import torch

    from autotune.problem.config import TrainConfig
    from autotune.distributed.parallel import parallelize
    from autotune.distributed.training import build_model

    with torch.device(device):
        net = build_model(model, num_layers=num_layers)
    parallelize(net, mesh, TrainConfig(micro_batch_size=1))
    return net


def short_fsdp_steps(model, *, device, mesh, seq_len: int, steps: int = 2) -> None:
    """Two optimizer steps of a 2-block copy of the model, wrapped as trials wrap it (any device)."""
    from autotune.distributed.training import make_optimizer, token_batches, train_step

    net = _short_copy(model, device=device, mesh=mesh)
    optimizer = make_optimizer(net)
    batches = token_batches(vocab_size=model.vocab_size, micro_batch_size=1, seq_len=seq_len,
                            device=device)
    for _ in range(steps):
        train_step(net, optimizer, batches, grad_accum_steps=1)


HOST_TOKEN_COUNTS = (8, 32)
"""Tokens of the tiny micro-batches the host overhead is timed at (one sequence each): device
work is negligible there on a GPU, and small enough on a CPU to extrapolate away."""


def count_dispatched_ops(fn) -> int:
    """Ops `fn` dispatches, counted by a TorchDispatchMode around a real call with the filter the
    simulator's trace counts `dispatched_ops` with (ops that return tensors or mutate in place,
    not metadata queries): an independent count of the same quantity."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autotune.backends.sim._trace import _is_step_op

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += _is_step_op(func)
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.ops


def bench_host_overhead(model, *, device, mesh, token_counts=HOST_TOKEN_COUNTS, repeats: int = 7) -> dict[str, Any]:
    """Host time per dispatched op of a real FSDP2 forward + backward: a 2-block copy of the model
    wrapped as trials wrap it (autotune.distributed.parallel.parallelize), at micro-batches of a few tokens.

    The host time of a micro-batch is timed from its start to the return of backward() (on a GPU
    before synchronising: the time the host takes to issue it, Python + dispatcher + autograd +
    FSDP2 hooks + kernel launches). It is extrapolated linearly to zero tokens from the two token
    counts (on a CPU the host also runs the kernels), and divided by the ops dispatched, counted
    independently by a dispatch mode around the same forward + backward."""
    import torch

    net = _short_copy(model, device=device, mesh=mesh)
    vocab = model.vocab_size
    batches = {t: torch.randint(0, vocab, (1, t), device=device) for t in token_counts}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)

    def fwd_bwd(ids):
        net(input_ids=ids, labels=ids).loss.backward()

    def host_seconds(ids) -> tuple[float, float]:
        sync()
        start = time.perf_counter()
        fwd_bwd(ids)
        host = time.perf_counter() - start
        sync()
        wall = time.perf_counter() - start
        net.zero_grad(set_to_none=True)
        return host, wall

    for ids in batches.values():  # warm-up: allocator, kernels, FSDP lazy init
        host_seconds(ids)
        host_seconds(ids)
    ops = {t: count_dispatched_ops(lambda: fwd_bwd(ids)) for t, ids in batches.items()}
    net.zero_grad(set_to_none=True)
    samples: dict[int, list[float]] = {t: [] for t in token_counts}
    walls: dict[int, list[float]] = {t: [] for t in token_counts}
    for _ in range(repeats):  # interleaved: the machine's load drifts less within a round
        for t, ids in batches.items():
            host, wall = host_seconds(ids)
            samples[t].append(host)
            walls[t].append(wall)
    # Medians, as every other calibrated time (the collectives' fits subtracted from this one on a
    # CPU are medians too: a least time here against median collectives went to 0 under load).
    # The least times are kept beside them: load only ever adds time, so they are what a check
    # against another timing of the same step compares (CI, 2026-11-26: medians of 25.5 ms at 8
    # tokens and 17.7 ms at 32 under load, an inverted pair). A noisy pair never makes the slope
    # negative.
    def at_zero(stat) -> float:
        (t1, t2) = token_counts[0], token_counts[-1]
        h1, h2 = stat(samples[t1]), stat(samples[t2])
        slope = max((h2 - h1) / (t2 - t1), 0.0) if t2 != t1 else 0.0
        return max(h1 - slope * t1, 0.0)

    return dict(ops=ops[token_counts[0]], ops_by_tokens=ops,
                host_s_by_tokens={t: statistics.median(v) for t, v in samples.items()},
                wall_s_by_tokens={t: statistics.median(v) for t, v in walls.items()},
                host_s_at_zero=at_zero(statistics.median), least_host_s_at_zero=at_zero(min),
                repeats=repeats, blocks=2)


def short_fsdp_step_memory(model, *, device, mesh, seq_len: int) -> dict[str, int]:
    """Reserved vs allocated over two short FSDP2 steps of a 2-block copy of the model (cuda)."""
    import torch

    torch.cuda.reset_peak_memory_stats(device)
    short_fsdp_steps(model, device=device, mesh=mesh, seq_len=seq_len)
    torch.cuda.synchronize(device)
    return dict(max_allocated_bytes=int(torch.cuda.max_memory_allocated(device)),
                max_reserved_bytes=int(torch.cuda.max_memory_reserved(device)))


def _worker(rank: int, world_size: int, port: int, job: dict[str, Any], out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from autotune.problem.catalog.models import resolve_model

    cuda = job["backend"] == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    if cuda:
        from autotune.estimate.runtime_memory import ALLOC_CONF_ENV, alloc_conf

        os.environ[ALLOC_CONF_ENV] = alloc_conf(os.environ)  # as real trials run, before CUDA starts
        job = {**job, "alloc_conf": os.environ[ALLOC_CONF_ENV]}
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        if world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            # torchrun's default for several local ranks, as the real trials run: the host's AdamW under
            # CPU offload and its gradient adds take one thread per rank (bench_adamw, bench_offload_accumulate).
            torch.set_num_threads(1)
        before = torch.cuda.mem_get_info(device)  # creates the context
        context = before[1] - before[0] - torch.cuda.memory_reserved(device)
        # device_id= initialises the communicator eagerly: NCCL's memory is what appears outside
        # the allocator from here to after the first all-gather and reduce-scatter.
        dist.init_process_group("nccl", device_id=device)
    else:
        from autotune.backends.real._cpu_bf16 import compute_bf16_kernels_in_fp32

        torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1, as every cpu trial runs
        compute_bf16_kernels_in_fp32()  # as every cpu trial runs
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    model = resolve_model(job["model"])
    result: dict[str, Any] = dict(device=str(device), world_size=world_size, alloc_conf=job.get("alloc_conf"))
    if cuda:
        from autotune.estimate.runtime_memory import measure_outside_allocator

        result["device_name"] = torch.cuda.get_device_name(device)
        result["context_bytes"] = int(context)
        outside_before = int(context)
        probe = torch.ones(2**20, device=device)
        gathered = torch.empty(2**20 * world_size, device=device)
        dist.all_gather_into_tensor(gathered, probe)
        dist.reduce_scatter_tensor(probe, gathered)
        torch.cuda.synchronize(device)
        result["nccl_bytes"] = int(measure_outside_allocator(device)["outside_allocator_bytes"] - outside_before)
        allocated = torch.cuda.memory_allocated(device)
        a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
        b = a @ a
        torch.cuda.synchronize(device)
        result["cublas_workspace_bytes"] = int(torch.cuda.memory_allocated(device) - allocated - a.nbytes - b.nbytes)
        del a, b, probe, gathered
    dtype = torch.bfloat16
    counts = CUDA_TOKEN_COUNTS if cuda else TOKEN_COUNTS
    result["compute_bf16"] = bench_compute(model, device=device, dtype=dtype, seq_len=job["seq_len"],
                                           token_counts=counts)
    result["compute_fp32"] = bench_compute(model, device=device, dtype=torch.float32, seq_len=job["seq_len"],
                                           token_counts=counts[:2])
    if cuda and has_float8_gemms(device):
        try:
            result["float8_gemms"] = bench_float8_gemms(model, device=device)
        except Exception as exc:  # a torch without these kernels: the profile then has no float8 figures
            result["float8_gemms"] = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
    result["adamw"] = bench_adamw(model, device=device, world_size=world_size, impl=job["optimizer_impl"])
    if cuda:  # CPU offload steps AdamW on the host: every local rank at once, as a node's ranks do
        result["adamw_cpu"] = bench_adamw(model, device=torch.device("cpu"), world_size=world_size,
                                          impl=job["optimizer_impl"])
    result["fresh_pages"] = bench_fresh_pages()
    if cuda:
        try:
            result["offload_accumulate"] = bench_offload_accumulate(model, device=device, world_size=world_size)
        except Exception as exc:  # the profile then has no such figure: costmodel's fitted constant stands
            result["offload_accumulate"] = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
    if world_size > 1:
        result["collectives"] = bench_collectives(job["unit_bytes"], device=device, world_size=world_size)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size,))
    if not cuda:
        result["tracker"] = bench_tracker(model, device=device, mesh=mesh, seq_len=job["seq_len"])
    if cuda:
        result["host_copies"] = bench_host_copies(device=device)
        result["fsdp_step"] = short_fsdp_step_memory(model, device=device, mesh=mesh, seq_len=job["seq_len"])
    # After the memory step: its peak counters must not see this benchmark's cached blocks.
    result["host_overhead"] = bench_host_overhead(model, device=device, mesh=mesh)
    dist.barrier()
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def measure(*, backend: str = "cpu", model_name: str = "tiny-llama", world_size: int | None = None,
            seq_len: int | None = None, optimizer_impl: str | None = None) -> dict[str, Any]:
    """Run the microbenchmarks in `world_size` fresh processes; rank 0's raw measurements."""
    import torch
    import torch.multiprocessing as mp

    from autotune.problem.catalog.models import resolve_model
    from autotune.util.errors import UsageError

    if backend not in ("cpu", "cuda"):
        raise UsageError(f"calibrate --backend must be cpu or cuda, got {backend!r}")
    if backend == "cuda" and not torch.cuda.is_available():
        raise UsageError("calibrate --backend cuda: no CUDA GPU is visible here (use --backend cpu)")
    model = resolve_model(model_name)
    if world_size is None:
        world_size = torch.cuda.device_count() if backend == "cuda" else 2
    seq_len = seq_len or model.default_seq_len
    block, root = model.block_parameters, model.root_parameters
    param_bytes = 2
    unit_bytes = sorted({int(block * param_bytes * f) for f in COLLECTIVE_SIZES_FRACTIONS} |
                        {int(root * param_bytes), int(block * 4), int(root * 4)})
    job = dict(backend=backend, model=model_name, seq_len=seq_len, unit_bytes=unit_bytes,
               optimizer_impl=optimizer_impl or ("fused" if backend == "cuda" else "foreach"),
               num_layers=model.num_layers)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "calibration.json")
        mp.start_processes(_worker, args=(world_size, _free_port(), job, out_path), nprocs=world_size,
                           start_method="spawn", join=True)
        raw = json.loads(Path(out_path).read_text())
    raw["job"] = job
    raw["duration_s"] = time.perf_counter() - start
    return raw


def host_op_figure(raw: dict[str, Any], *, on: str) -> HardwareFigure:
    """`host_op_us` from bench_host_overhead: the host seconds of a tiny real forward + backward,
    at zero tokens, per dispatched op. On a CPU (gloo) the collectives of the 2-block copy run on
    the same thread and the cost model charges them separately, so their time (from this
    calibration's own all-gather / reduce-scatter fits) is taken out first; on a GPU they run on
    the device and only their launch is host time."""
    from autotune.problem.catalog.models import resolve_model
    from autotune.estimate.costmodel import collective_seconds

    h = raw["host_overhead"]
    host_s = h["host_s_at_zero"]
    comm_s = 0.0
    coll = raw.get("collectives")
    if coll and raw["job"]["backend"] == "cpu":
        model = resolve_model(raw["job"]["model"])
        world = raw["world_size"]
        ag, rs = coll["all_gather"], coll["reduce_scatter"]

        def one(fit, nbytes):
            return collective_seconds(nbytes, ranks=world, gbps=fit["bus_bytes_per_s"] / 1e9,
                                      latency_us=fit["latency_s"] * 1e6)

        block, root = model.block_parameters, model.root_parameters
        # 2 blocks gathered in forward and again in backward (resharded), the root once; fp32
        # gradients reduce-scattered per unit.
        comm_s = h["blocks"] * (2 * one(ag, block * 2) + one(rs, block * 4)) + one(ag, root * 2) + one(rs, root * 4)
    per_op = max(host_s - comm_s, 0.0) / h["ops"]
    times = ", ".join(f"{t} tokens {s * 1e3:.1f} ms" for t, s in sorted(h["host_s_by_tokens"].items(), key=lambda kv: int(kv[0])))
    return HardwareFigure(
        per_op * 1e6, "measured",
        f"host time of a real FSDP2 forward+backward of a 2-block {raw['job']['model']} wrapped as trials wrap it "
        f"({times}, medians of {h['repeats']}; to the return of backward(), before any device sync), extrapolated to "
        f"0 tokens: {host_s * 1e3:.2f} ms" + (f", less {comm_s * 1e3:.2f} ms of gloo collectives (this "
                                             f"calibration's fits)" if comm_s else "") +
        f", over {h['ops']} dispatched ops (counted by a dispatch mode around the same step), on {on}")


def profile_from_measurements(raw: dict[str, Any], *, name: str | None = None) -> HardwareProfile:
    """A calibrated profile: every figure `measured`, its basis the benchmark and its fit."""
    import torch

    from autotune.estimate import costmodel

    backend = raw["job"]["backend"]
    world = raw["world_size"]
    on = raw.get("device_name") or f"{world} CPU rank(s), 1 thread each"
    m = "measured"
    f: dict[str, HardwareFigure] = {}
    for dtype, suffix in (("bf16", ""), ("fp32", "_fp32")):
        comp = raw[f"compute_{dtype}"]
        f[f"matmul_tflops{suffix}"] = HardwareFigure(
            comp["gemm"]["flops_per_s"] / 1e12, m, f"{dtype} GEMMs at {raw['job']['model']}'s projection and LM-head "
            f"shapes, {len(comp['gemm']['points'])} points, fit time = FLOPs / rate + fixed, on {on}")
        f[f"attention_tflops{suffix}"] = HardwareFigure(
            comp["attention"]["flops_per_s"] / 1e12, m, f"{dtype} SDPA forward+backward at the model's heads and sequence, FLOPs by torch's sdpa formulas, on {on}")
        for what, key in (("matmul", "gemm"), ("attention", "attention")):
            for tokens, rate in sorted(comp[key]["flops_per_s_by_tokens"].items(), key=lambda kv: int(kv[0])):
                f[f"{what}_tflops{suffix}@{int(tokens)}"] = HardwareFigure(
                    rate / 1e12, m, f"{dtype} {what} rate at {tokens} tokens per micro-batch (the model's shapes), on {on}")
        if not suffix:
            f["matmul_op_us"] = HardwareFigure(comp["gemm"]["fixed_s"] * 1e6, m, "fixed cost per GEMM from the same fit")
            f["attention_op_us"] = HardwareFigure(comp["attention"]["fixed_s"] * 1e6, m,
                                                  "fixed cost per attention kernel from the same fit")
            f["memory_gbps"] = HardwareFigure(comp["memory"]["bytes_per_s"] / 1e9, m,
                                              f"elementwise multiply and casts at activation sizes, bytes read + "
                                              f"written, fit time = bytes / bandwidth + fixed, on {on}")
            f["memory_op_us"] = HardwareFigure(comp["memory"]["fixed_s"] * 1e6, m, "fixed cost per op from the same fit")
            if "memory_large" in comp:
                sizes = sorted(b for b, _ in comp["memory_large"]["points"])
                f["memory_gbps_large"] = HardwareFigure(
                    comp["memory_large"]["bytes_per_s"] / 1e9, m,
                    f"fp32 log-softmax over the model's vocabulary and multiplies, fresh outputs, "
                    f"{sizes[0] / 2**20:.0f}-{sizes[-1] / 2**20:.0f} MiB moved per op (ops of at least "
                    f"{LARGE_MEMORY_OP_BYTES // 2**20} MiB run at it), on {on}")
    float8 = raw.get("float8_gemms")
    if float8 and "error" not in float8:
        shapes = ", ".join(f"{k}x{n}" for k, n in float8["shapes"])
        bf16_rate = float8["bf16"]["flops_per_s"]
        for recipe, figure in (("tensorwise", "float8_matmul_tflops"), ("rowwise", "float8_rowwise_matmul_tflops")):
            fit = float8[recipe]
            f[figure] = HardwareFigure(
                fit["flops_per_s"] / 1e12, m, f"torch._scaled_mm, e4m3 operands, {recipe} scales, bf16 output, at "
                f"{raw['job']['model']}'s block projection shapes (K x N: {shapes}), {len(fit['points'])} points, fit "
                f"time = FLOPs / rate + fixed; bf16 F.linear at the same shapes {bf16_rate / 1e12:.0f} TFLOP/s "
                f"({fit['flops_per_s'] / bf16_rate:.2f}x), on {on}")
            for tokens, rate in sorted(fit["flops_per_s_by_tokens"].items(), key=lambda kv: int(kv[0])):
                bf16_at = float8["bf16"]["flops_per_s_by_tokens"][tokens]
                f[f"{figure}@{int(tokens)}"] = HardwareFigure(
                    rate / 1e12, m, f"{recipe} float8 GEMM rate at {tokens} tokens per micro-batch (the block "
                    f"projections' shapes; bf16 at them {bf16_at / 1e12:.0f} TFLOP/s, {rate / bf16_at:.2f}x), on {on}")
    coll = raw.get("collectives")
    link = "NCCL" if backend == "cuda" else "gloo"
    if coll:
        ag, rs = coll["all_gather"], coll["reduce_scatter"]
        sizes = f"{len(ag['points'])} sizes from {min(b for b, _ in ag['points']) / 2**20:.2f} to " \
                f"{max(b for b, _ in ag['points']) / 2**20:.1f} MiB (the model's FSDP units)"
        f["intra_node_gbps"] = HardwareFigure(ag["bus_bytes_per_s"] / 1e9, m,
                                              f"{link} all_gather_into_tensor over {world} local ranks, {sizes}")
        f["intra_node_latency_us"] = HardwareFigure(ag["latency_s"] * 1e6, m, "fixed cost from the same fit")
        f["intra_node_rs_gbps"] = HardwareFigure(rs["bus_bytes_per_s"] / 1e9, m,
                                                 f"{link} reduce_scatter_tensor over {world} local ranks, {sizes}")
        f["intra_node_rs_latency_us"] = HardwareFigure(rs["latency_s"] * 1e6, m, "fixed cost from the same fit")
    else:
        f["intra_node_gbps"] = HardwareFigure(0.0, m, "one rank: no collective measured")
        f["intra_node_latency_us"] = HardwareFigure(0.0, m, "one rank: no collective measured")
    # Across nodes nothing was measured: the intra-node figures stand in, and say so.
    f["inter_node_gbps"] = HardwareFigure(f["intra_node_gbps"].value, m,
                                          "not measured across nodes (one machine): the intra-node figure")
    f["inter_node_latency_us"] = HardwareFigure(f["intra_node_latency_us"].value, m,
                                                "not measured across nodes (one machine): the intra-node figure")
    f["comm_overlap"] = HardwareFigure(1.0 if backend == "cuda" else 0.0, m if backend == "cuda" else "measured",
                                       "FSDP2 overlaps collectives on side CUDA streams" if backend == "cuda" else
                                       "gloo on CPU: FSDP2's collectives run on the compute thread's timeline "
                                       "(no CUDA streams), so none of them hides")
    if raw.get("tracker"):
        t = raw["tracker"]
        if "by_blocks" in t:
            timed = "; ".join(f"{n} blocks: {p['ops']} ops, {p['plain_s'] * 1e3:.1f} ms without, "
                              f"{p['tracked_s'] * 1e3:.1f} ms with it" for n, p in sorted(t["by_blocks"].items(),
                                                                                        key=lambda kv: int(kv[0])))
            f["tracked_op_us"] = HardwareFigure(
                t["per_op_s"] * 1e6, m, f"the cpu backend's tensor-memory tracker (CapacityTracker) per dispatched op, "
                f"plus tracked_op_us_per_block for every block of the model: forward+backward of FSDP2-wrapped copies "
                f"of {raw['job']['model']} with their optimizer ({timed}; medians of {t['pairs']} interleaved pairs), "
                f"a line in the blocks, on {on}")
            f["tracked_op_us_per_block"] = HardwareFigure(t["per_op_per_block_s"] * 1e6, m,
                                                          "the tracker's cost per op grows with the blocks it tracks: "
                                                          "the slope of the same line")
        else:  # a raw file of the older bench_tracker (one bare 2-block copy)
            f["tracked_op_us"] = HardwareFigure(
                t["per_op_s"] * 1e6, m, f"the cpu backend's tensor-memory tracker (CapacityTracker) per dispatched op: "
                f"forward+backward of a 2-block bf16 {raw['job']['model']} in {t['plain_s'] * 1e3:.1f} ms without, "
                f"{t['tracked_s'] * 1e3:.1f} ms with it (median of {t.get('pairs', 5)} interleaved pairs), {t['ops']} ops, "
                f"on {on}")
    if raw.get("host_overhead"):
        f["host_op_us"] = host_op_figure(raw, on=on)
    adam = raw["adamw"]
    per_s = adam["params_per_s"]
    if backend == "cpu":
        f["cpu_adam_params_per_s"] = HardwareFigure(
            per_s, m, f"autotune's make_optimizer({raw['job']['optimizer_impl']}) step over a {world}-rank shard "
            f"({adam['params']:,} parameters) in {adam['seconds'] * 1e3:.1f} ms on {on}, per rank")
    else:
        host = raw["adamw_cpu"]
        f["cpu_adam_params_per_s"] = HardwareFigure(
            host["params_per_s"] * world, m, f"make_optimizer({raw['job']['optimizer_impl']}) AdamW on the host over "
            f"a {world}-rank shard, all {world} local ranks at once: {host['params_per_s']:.3g} params/s each x "
            f"{world} (the node's rate)")
    accumulate = raw.get("offload_accumulate") or {}
    if raw.get("fresh_pages") and "seconds" in accumulate:
        page_s = accumulate["fresh_page_bytes"] * raw["fresh_pages"]["ns_per_byte"] * 1e-9
        f["offload_accumulate_ns_per_param"] = HardwareFigure(
            max(accumulate["seconds"] - page_s, 0.0) / accumulate["elements"] * 1e9, m,
            f"CPU offload's accumulating micro-batch as FSDP2 runs it: a blocking copy of each fp32 gradient shard of "
            f"one block ({accumulate['shards']} shards, {accumulate['elements']:,} elements at world size {world}) "
            f"into new pageable host memory and the host add, {accumulate['seconds'] * 1e3:.1f} ms, less the first "
            f"touch of the shards of {costmodel.HOST_MMAP_THRESHOLD_BYTES // 2**20} MiB or more at "
            f"fresh_page_ns_per_byte; all local ranks at once, on {on}")
    if raw.get("fresh_pages"):
        pages = raw["fresh_pages"]
        f["fresh_page_ns_per_byte"] = HardwareFigure(
            pages["ns_per_byte"], m, f"the host's first touch of a fresh {pages['bytes'] / 2**20:.0f} MiB mapping, one "
            f"thread: a copy into a new tensor ({pages['fresh_s'] * 1e3:.1f} ms) less into a reused one "
            f"({pages['reused_s'] * 1e3:.1f} ms), medians of {pages['repeats']}, on {on}")
    f["optimizer_gbps"] = HardwareFigure(per_s * 28 / 1e9, m, "the same AdamW step as bytes (28 per parameter)")
    copies = raw.get("host_copies")
    f["host_link_gbps"] = HardwareFigure(
        min(copies["h2d_bytes_per_s"], copies["d2h_bytes_per_s"]) / 1e9 if copies else 0.0, m,
        "pinned 256 MiB copies, the slower direction" if copies else "cpu: no host-device link")
    if backend == "cuda":
        f["cuda_context_bytes"] = HardwareFigure(raw["context_bytes"], m, "mem_get_info around CUDA initialisation")
        f["nccl_communicator_bytes"] = HardwareFigure(
            raw["nccl_bytes"], m, f"device memory outside the allocator after the first all-gather and "
            f"reduce-scatter at world size {world}")
        f["cublas_workspace_bytes"] = HardwareFigure(raw["cublas_workspace_bytes"], m,
                                                     "allocated by the first bf16 matmul beyond its tensors")
        step = raw["fsdp_step"]
        f["reserved_over_allocated"] = HardwareFigure(
            step["max_reserved_bytes"] / max(step["max_allocated_bytes"], 1), m,
            f"max_memory_reserved / max_memory_allocated over two FSDP2 steps of a 2-block "
            f"{raw['job']['model']}, PYTORCH_CUDA_ALLOC_CONF={raw.get('alloc_conf') or 'unset (default allocator)'}")
    gpu = None
    if backend == "cuda":
        from autotune.problem.catalog.gpus import detect_gpu

        spec = detect_gpu()
        gpu = spec.name if spec else None
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    machine = machine_description()
    versions = dict(torch=torch.__version__, cuda=torch.version.cuda, world_size=world,
                    autotune_model=raw["job"]["model"], seq_len=raw["job"]["seq_len"])
    label = name or (f"{gpu or 'gpu'}-{machine.get('hostname', 'host')}" if backend == "cuda"
                     else f"cpu-{machine.get('hostname', 'host')}")
    return HardwareProfile(name=label, device=backend, gpu=gpu, figures=f, calibrated=True, date=date,
                           machine=machine, versions=versions)


def calibrate(*, backend: str = "cpu", model_name: str = "tiny-llama", out: str | None = None,
              world_size: int | None = None, name: str | None = None) -> tuple[HardwareProfile, dict[str, Any]]:
    raw = measure(backend=backend, model_name=model_name, world_size=world_size)
    profile = profile_from_measurements(raw, name=name)
    if out:
        profile.save(out)
    return profile, raw
