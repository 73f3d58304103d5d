"""Build a model and run training steps: the code every trial runs, real or traced.

The simulator calls these under FakeTensorMode with a fake process group; the real trial
worker calls them on real devices. Keeping one copy is what makes the prediction exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from autotune.catalog.models import ModelSpec


def build_model(model: ModelSpec, *, num_layers: int | None = None, seed: int = 0) -> nn.Module:
    """The transformers causal LM from its config, in fp32 (FSDP casts for compute), on the
    current default device (use `torch.device('meta')` to build without memory)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(
        model.hf_config(num_layers=num_layers),
        dtype=torch.float32,
        trust_remote_code=model.trust_remote_code,
    )


def make_optimizer(model: nn.Module, *, impl: str = "fused", lr: float = 1e-4) -> torch.optim.Optimizer:
    """AdamW as `impl` ('fused', 'foreach' or 'for-loop'), spelled out: torch's own default
    (foreach on CUDA, the loop elsewhere) would make the traced step differ from the run.
    docs/SIMULATOR.md has what each costs in memory."""
    if impl == "fused":
        return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    if impl == "foreach":
        return torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
    if impl == "for-loop":
        return torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    raise ValueError(f"unknown AdamW implementation {impl!r}")


def token_batches(*, vocab_size: int, micro_batch_size: int, seq_len: int, device: torch.device | str,
                  seed: int = 0) -> Iterator[torch.Tensor]:
    """Seeded random token batches of shape (micro_batch, seq_len), forever."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_len), generator=generator)
        yield tokens.to(device)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator[torch.Tensor], *,
               grad_accum_steps: int, scaler=None, defer_grad_sync: bool = False,
               phase_times: list[tuple[float, float]] | None = None, clock=None) -> torch.Tensor:
    """One optimizer step over `grad_accum_steps` micro-batches; returns the mean loss (detached).

    Gradients are reduce-scattered after every micro-batch by default: deferring the sync to
    the last micro-batch (`defer_grad_sync`) saves communication but keeps unsharded gradients
    of every block until then, which defeats full sharding's memory savings.
    With `phase_times` and `clock` (a synchronising timer), appends (seconds of the micro-batches,
    seconds of the optimizer step): a short trial runs fewer micro-batches than the real job
    and scales the first part only.
    """
    timing = phase_times is not None and clock is not None
    started = clock() if timing else 0.0
    total = None
    for micro_step in range(grad_accum_steps):
        is_last = micro_step == grad_accum_steps - 1
        if defer_grad_sync and hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(is_last)
        tokens = next(batches)
        loss = model(input_ids=tokens, labels=tokens).loss / grad_accum_steps
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    backward_done = clock() if timing else 0.0
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if timing:
        phase_times.append((backward_done - started, clock() - backward_done))
    return total


def gathered_for_vllm(model: nn.Module, *, device: torch.device | str,
                      before_gather: Callable[[str], None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's full parameters one at a time, as TRL gathers an FSDP2 model for vLLM
    (trl 1.16, trl/generation/vllm_generation.py, `VLLMGeneration._iter_fsdp2_params`):
    `named_parameters()` in order, a host-offloaded shard copied to the device first, then
    `full_tensor()` (an all-gather of the fp32 shard). `before_gather(name)` lets the simulator
    name its sites."""
    for name, param in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")  # the name vLLM expects, as TRL fixes it
        if before_gather is not None:
            before_gather(name)
        if param.device != torch.device(device):
            param = param.to(device)
        param = param.full_tensor()  # rebound as TRL does: the shard's device copy is freed here
        yield name, param


def sync_weights_to_vllm(model: nn.Module, *, device: torch.device | str,
                         load_weights: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None,
                         before_gather: Callable[[str], None] | None = None) -> int:
    """TRL's weight sync in colocate mode (`VLLMGeneration.sync_weights`, run by GRPOTrainer before
    generating whenever the optimizer step changed): each gathered parameter goes to vLLM's
    `load_weights`, which copies it into vLLM's own weights (in vLLM's memory share). As in TRL's
    loop, the loop variable holds the previous full parameter while the next is gathered, so two
    are alive at once. Returns how many parameters were gathered."""
    count = 0
    for name, full in gathered_for_vllm(model, device=device, before_gather=before_gather):
        if load_weights is not None:
            load_weights([(name, full)])
        count += 1
    return count
