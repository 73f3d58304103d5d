"""What a memory-tracking dispatch mode (the simulator's, the CPU trial's) needs to follow a parallelized model."""

from __future__ import annotations

import torch
from torch import nn


def register_rng_rules(mode_class: type) -> None:
    """Let a memory-tracking dispatch mode (the simulator's, the CPU trial's) run compiled blocks
    under checkpointing. AOT autograd wraps a random op that checkpointing recomputes (SDPA takes a
    dropout argument) in the `run_and_save_rng_state` / `run_with_rng_state` higher-order ops, so
    the recompute draws the same numbers, and a mode must say how to run them: here the wrapped op
    runs through the mode like any other op, with the CPU generator's state saved and restored as
    those ops' own CPU implementations do (torch/_prims/rng_prims.py). Idempotent."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    if mode_class in run_and_save_rng_state.python_key_table:
        return

    @run_and_save_rng_state.py_impl(mode_class)
    def _save(mode, op, *args, **kwargs):
        return torch.get_rng_state(), mode.__torch_dispatch__(op, (), args, kwargs)

    @run_with_rng_state.py_impl(mode_class)
    def _with(mode, rng_state, op, *args, **kwargs):
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(rng_state):  # the simulator's trace draws no numbers (a state activation offload
            return mode.__torch_dispatch__(op, (), args, kwargs)  # brought back holds no data either)
        current = torch.get_rng_state()
        torch.set_rng_state(rng_state)
        try:
            return mode.__torch_dispatch__(op, (), args, kwargs)
        finally:
            torch.set_rng_state(current)


def keep_leaf_inputs_collectable(mod_tracker) -> None:
    """torch 2.13's ModTracker (inside MemTracker and FSDPMemTracker) registers a multi-grad hook on every
    module input that requires a gradient; on a leaf the hook holds the leaf's AccumulateGrad node, which
    holds the leaf: a cycle through C++ that Python's collector cannot break, so the leaf outlives its step
    while tracked. torchtitan's chunked loss feeds its head such leaves (each chunk of the hidden states,
    detached): measured, 8 more kept alive per step under the tracker, none without one. Leaf inputs are left
    out of that hook (the module then leaves the tracker's parents at the end of backward instead). Call
    before entering the tracker."""
    hook = mod_tracker._fw_pre_hook

    def pre_hook(module: nn.Module, inputs):
        return hook(module, tuple(a for a in inputs
                                  if not (isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad)))

    mod_tracker._fw_pre_hook = pre_hook
