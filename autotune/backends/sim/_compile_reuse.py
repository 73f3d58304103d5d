"""Compiled blocks (`compile=blocks`) compiled once per process and shape, not once per trace.

Dynamo compiles a block's forward and guards the compiled code on what it read, and it reads the
process-wide module hooks: `Module._call_impl` checks `_global_forward_hooks`, which ModTracker
(inside the simulator's FSDPMemTracker) fills on entry and empties on exit. Each tracker registered
its hooks under new handle ids, so every trace failed the previous trace's guards and compiled every
block again: 18 compiles (~3 s each, AOT autograd and the min-cut partitioner) in the main job's 16
trials (2026-11-28). Here the hooks are registered under the same ids and are the same functions in
every trace, routing to the tracker in use, so a later trace of the same block shapes (the other
shallow depth, the other resharding mode, a re-trace) runs the compiled code it already has.

Two things made a trace that compiled differ from one that reused, and both are removed while a
step is traced (`compile_reuse`), so that what a trace records never depends on what the process
compiled before (checked site by site in tests/test_compile.py):
- dynamo's compile leaves reference cycles holding the frame's example inputs (a block's
  `cache_position`, 32 KiB at seq 4096) until the garbage collector runs: collected when each
  compile ends. A real run compiles in its warm-up step, so its steady step holds none of them.
- AOT autograd runs a compiled graph's first call under a dispatch mode that checks custom ops for
  aliasing (`check_custom_op_aliasing`), which re-dispatches each parameter as a detach: ops the
  tracker counted (52 in tiny-llama's step) that a real steady step does not run. Off while tracing.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

import torch
from torch.distributed._tools.mod_tracker import ModTracker
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle

__all__ = ["compile_reuse", "route_module_hooks"]

_active: list[ModTracker | None] = [None]
_keys: list[int] = []  # the handle ids the routed hooks are registered under, reserved once


def _routed_pre_hook(module, inputs):
    if torch.compiler.is_compiling():  # inside a compiled block: nothing for dynamo to read further
        return None
    tracker = _active[0]
    return None if tracker is None else tracker._fw_pre_hook(module, inputs)


def _routed_post_hook(module, inputs, output):
    if torch.compiler.is_compiling():
        return None
    tracker = _active[0]
    return None if tracker is None else tracker._fw_post_hook(module, inputs, output)


class _RoutedModTracker(ModTracker):
    """A ModTracker whose global forward hooks are `_routed_pre_hook` and `_routed_post_hook`,
    registered under the same handle ids on every entry (one tracker at a time)."""

    def __enter__(self):
        if _active[0] is not None:
            raise RuntimeError("one simulator trace at a time per process: a tracker is already active")
        if not _keys:
            _keys.extend((RemovableHandle(nn_module._global_forward_pre_hooks).id,
                          RemovableHandle(nn_module._global_forward_hooks).id))
        pre, post = _keys
        nn_module._global_forward_pre_hooks[pre] = _routed_pre_hook
        nn_module._global_forward_hooks[post] = _routed_post_hook
        nn_module._global_forward_hooks_always_called[post] = True  # as ModTracker registers it
        _active[0] = self
        return self

    def __exit__(self, *args):
        pre, post = _keys
        nn_module._global_forward_pre_hooks.pop(pre, None)
        nn_module._global_forward_hooks.pop(post, None)
        nn_module._global_forward_hooks_always_called.pop(post, None)
        _active[0] = None


def route_module_hooks(mod_tracker: ModTracker) -> None:
    """Make `mod_tracker` (a plain ModTracker, before it is entered) register its global hooks as
    every other trace's do. Its own `_fw_pre_hook` and `_fw_post_hook` still do the tracking. A
    tracker of another class (a later torch's) is left as it is: its traces then compile again,
    which costs time, not accuracy."""
    if type(mod_tracker) is ModTracker:
        mod_tracker.__class__ = _RoutedModTracker


def _collect_after_compile(*_args) -> None:
    gc.collect()


@contextmanager
def compile_reuse():
    """While a step is traced: a compile leaves no garbage holding the step's tensors, and a
    compiled graph's first call runs the same ops as its later calls."""
    from torch._dynamo.callback import callback_handler
    from torch._functorch import config as functorch_config

    callback_handler.register_end_callback(_collect_after_compile)
    try:
        with functorch_config.patch(check_custom_op_aliasing=False):
            yield
    finally:
        callback_handler.remove_end_callback(_collect_after_compile)
