"""Context parallelism (CP): each rank of a CP group holds a slice of every sequence, and attention
runs as torch's ring (`torch.distributed.tensor.experimental.context_parallel`): each rank keeps its
query slice and the key/value slices travel round the group, the partial results merged by their
log-sum-exp.

torch registers the ring only for CUDA's SDPA kernels (flash, efficient, cuDNN); on CPUs SDPA runs
`aten._scaled_dot_product_flash_attention_for_cpu`, which has no DTensor rule, so CP fails there
("... does not have a sharding strategy registered"). `register_cpu_ring_attention` adds the same
ring for that kernel, through torch's own `_templated_ring_attention` and
`_templated_ring_attention_backward` (the CPU kernel returns (out, logsumexp) and takes its inputs by
the same names, so the loop runs unchanged: the same rotations, the same tensors kept). It runs on
gloo ranks and under FakeTensorMode with the fake process group, so the simulator can trace a CP step.

What the ring computes is plain causal attention over the whole sequence, so a model may use CP only
where that is its attention (knobs.why_no_context_parallel says why not), and transformers must pass
SDPA `is_causal=True` with no mask (`use_causal_sdpa`). `apply_cp` prepares a model, and a training
step runs each micro-batch inside `sequence_shards`."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

CAUSAL_SDPA = "context_parallel_sdpa"
_SEQ_DIM = 2  # of SDPA's (batch, heads, seq, head_dim) q, k, v and out; logsumexp's too

aten = torch.ops.aten
_CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _ring_forward(group, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    if attn_mask is not None or dropout_p:
        raise NotImplementedError("the ring attention takes no attn_mask and no dropout: only is_causal")
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    return _templated_ring_attention(group, _SEQ_DIM, _CPU_FLASH, query=query, key=key, value=value,
                                     is_causal=is_causal, dropout_p=0.0, scale=scale)


def _ring_backward(group, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                   attn_mask=None, scale=None):
    if attn_mask is not None or dropout_p:
        raise NotImplementedError("the ring attention takes no attn_mask and no dropout: only is_causal")
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward,
    )

    return _templated_ring_attention_backward(
        group, _SEQ_DIM, _CPU_FLASH_BACKWARD, grad_out=grad_out, grad_out_name="grad_out", query=query,
        key=key, value=value, out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=0.0, scale=scale)


def _cpu_ring_handler(op_call: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    """DTensor's handler for the CPU flash kernel while CP is on (torch's `_sdpa_handler` for it):
    every tensor argument a sequence shard, Shard(2) of a 1-D CP mesh; the results are too. The
    output specs are built here, not by sharding propagation, because torch has no rule for this
    kernel and a Shard(2) rule is right only while CP is on."""
    from torch._prims_common import make_contiguous_strides_for
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    mesh = op_info.compute_mesh
    specs = [spec for spec in op_info.flat_args_schema if isinstance(spec, DTensorSpec)]
    if mesh.ndim != 1 or any(spec.placements != (Shard(_SEQ_DIM),) for spec in specs):
        raise NotImplementedError(f"CP's ring takes sequence shards on a 1-D mesh, got {[s.placements for s in specs]}")
    ring = _ring_forward if op_call is _CPU_FLASH else _ring_backward
    results = ring(mesh.get_group(), *op_info.local_args, **op_info.local_kwargs)

    def spec_of(local: torch.Tensor) -> DTensorSpec:
        shape = list(local.shape)
        shape[_SEQ_DIM] *= mesh.size()
        meta = TensorMeta(torch.Size(shape), make_contiguous_strides_for(shape), local.dtype)
        return DTensorSpec(mesh, (Shard(_SEQ_DIM),), tensor_meta=meta)

    return DTensor._op_dispatcher.wrap(results, tuple(spec_of(local) for local in results))


def register_cpu_ring_attention() -> None:
    """Make CP's ring cover the CPU flash kernel and its backward. The handlers go into torch's table
    of CP handlers (`_context_parallel._attention.custom_ops`), which torch installs into DTensor's
    dispatcher only while a `context_parallel` context is open, as it does its CUDA ones. Idempotent."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    _attention.custom_ops[_CPU_FLASH] = _cpu_ring_handler
    _attention.custom_ops[_CPU_FLASH_BACKWARD] = _cpu_ring_handler


@contextlib.contextmanager
def context_parallel_step(cp_mesh: DeviceMesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int],
                          no_restore_buffers: set[torch.Tensor] | None = None) -> Iterator[None]:
    """One training step's CP context, as torchtitan's `get_train_context` opens it: torch's
    `context_parallel` shards `buffers` in place along `seq_dims` (input ids, labels already shifted
    for next-token loss, position ids: rotary positions must be sharded like the tokens) and sends
    SDPA through the ring, the CPU kernel's too (register_cpu_ring_attention).

    Load balancing: torch's head-tail balancer (`_HeadTailLoadBalancer`, its default) splits the
    sequence into 2 x degree chunks and gives rank r chunks r and 2 x degree - 1 - r, so every rank
    does the same share of causal attention. torch applies it only where 2 x degree divides the
    sequence and silently drops it otherwise; here such a length is refused (ValueError), as
    knobs.why_no_context_parallel refuses it.

    The buffers come back whole at exit unless named in `no_restore_buffers`."""
    from torch.distributed.tensor.experimental import context_parallel

    seq_len, degree = buffers[0].shape[seq_dims[0]], cp_mesh.size()
    if seq_len % (2 * degree):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x the context-parallel degree {degree}: "
                         "torch would run it without load balancing")
    register_cpu_ring_attention()
    sdpa = F.scaled_dot_product_attention
    with context_parallel(cp_mesh, buffers=list(buffers), buffer_seq_dims=list(seq_dims),
                          no_restore_buffers=no_restore_buffers):
        if F.scaled_dot_product_attention is sdpa:  # torch patches F by the function's __name__
            raise RuntimeError(f"context parallelism could not patch SDPA: F.scaled_dot_product_attention is "
                               f"{sdpa.__qualname__}, a wrapper that does not carry SDPA's name")
        yield


def _no_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    """The mask of CAUSAL_SDPA: none, so transformers' SDPA passes `is_causal=True`. transformers'
    own sdpa mask would build one from a CP rank's position ids: a balanced shard's positions jump
    (0..15 then 48..63), which it reads as packed documents."""
    if attention_mask is not None:
        raise ValueError("context parallelism takes no padding mask: every sequence must be whole")
    return None


def use_causal_sdpa(model: nn.Module) -> None:
    """Switch a transformers model to CAUSAL_SDPA: transformers' own SDPA attention, with no mask
    built, so each layer calls SDPA with `is_causal=True` and no attn_mask, the only attention CP's
    ring computes. Refuse the models that need another mask first (knobs.why_no_context_parallel)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(CAUSAL_SDPA, _no_mask)
    model.set_attn_implementation(CAUSAL_SDPA)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Prepare `model` for context parallelism over `cp_mesh`: causal SDPA (use_causal_sdpa), and the
    mesh recorded on the model with `model.sequence_shards(tokens)` (sequence_shards), which the training
    step enters around each micro-batch (training._micro_batch, which cannot import this package), so that
    real trials and the simulator's trace run one step."""
    use_causal_sdpa(model)
    model.context_parallel_mesh = cp_mesh
    model.sequence_shards = functools.partial(sequence_shards, model)


@contextlib.contextmanager
def sequence_shards(model: nn.Module, tokens: torch.Tensor) -> Iterator[dict[str, Any]]:
    """The model's arguments for one micro-batch of `tokens` (batch, seq) with CP open around them; enter
    it around forward and backward, as the ring runs in both. Every rank of a CP group takes the same
    tokens and keeps its balanced slice of the input ids, the labels (shifted before slicing, so none is
    predicted across a slice's edge) and the position ids.

    The loss is this rank's summed token losses over the whole micro-batch's count / cp: the cp ranks'
    losses then average to the micro-batch's mean loss, and FSDP, which averages gradients over every
    rank it shards over (dp_shard x cp), gives the mean's gradient, as without CP."""
    cp_mesh = model.context_parallel_mesh
    rows, seq = tokens.shape
    labels = F.pad(tokens[:, 1:], (0, 1), value=-100)
    positions = torch.arange(seq, device=tokens.device).repeat(rows, 1)
    buffers = [tokens, labels, positions]  # sliced in place: `tokens` is this rank's slice inside
    with context_parallel_step(cp_mesh, buffers, [1, 1, 1], no_restore_buffers=set(buffers)):
        # shift_labels: transformers' loss takes them as they are (labels it would shift again, within a slice)
        yield dict(input_ids=tokens, labels=labels, shift_labels=labels, position_ids=positions,
                   num_items_in_batch=rows * (seq - 1) / cp_mesh.size(), use_cache=False)
