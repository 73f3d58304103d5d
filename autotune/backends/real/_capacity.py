"""Memory on CPUs: a per-rank capacity for tensor memory, and the host's own memory.

On the cpu backend a rank has no device limit of its own, so `CapacityTracker` gives it one:
torch's `MemTracker` counts every tensor storage as it is created or resized, and this
subclass raises `torch.OutOfMemoryError` from the very update that takes the count over the
capacity, i.e. at the allocation that crosses it, as a GPU's allocator would.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from autotune.distributed.parallel import keep_leaf_inputs_collectable

_TOTAL = "Total"

# MemTracker's reference types -> autotune.backends.base.MEMORY_CATEGORIES.
TRACKER_CATEGORIES = {
    _MemRefType.PARAM: "parameters",
    _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer_state",
    _MemRefType.ACT: "activations",
    _MemRefType.TEMP: "activations",
    _MemRefType.BUFFER: "other",
    _MemRefType.OTH: "other",
}


class _NoHook:
    """A hook handle for a parameter that gets none (MemTracker removes every handle at exit)."""

    def remove(self) -> None:
        pass


_NO_GRAD_HOOKS = (_NoHook(), _NoHook())


class CapacityTracker(MemTracker):
    """A MemTracker that raises torch.OutOfMemoryError when tracked memory on a device
    exceeds `capacity_bytes` (None: no limit, tracking only)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile skips every frame while a dispatch mode that does not ignore compile
        internals is active: a compiled trial would silently run eager. This mode is switched off
        while dynamo compiles and sees what the compiled code dispatches as it runs (with
        `track_inductor_allocations`, every buffer inductor allocates too)."""
        return True

    def __init__(self, *, capacity_bytes: int | None, rank: int = 0) -> None:
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self.rank = rank
        keep_leaf_inputs_collectable(self._mod_tracker)

    def _pre_fw_hook(self, module, inputs) -> None:
        # torchtitan's chunked loss calls its head once per chunk with each chunk's backward in between,
        # which leaves torch's module tracker outside every module: MemTracker would take the head's next
        # call for the next iteration. Trials reset the stats before each micro-batch's forward anyway.
        if not self._mod_tracker.is_bw and set(self._mod_tracker.parents) - {
                self._mod_tracker.get_known_fqn(module)} == {"Global"}:
            self.memory_tracking.pop(module, None)
        super()._pre_fw_hook(module, inputs)

    # Every increase of tracked memory (a new storage, a resize) goes through _update_snap.
    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed=old_mem_consumed, old_reftype=old_reftype)
        if self.capacity_bytes is None:
            return
        total = self._curr_mem_snap.get(winfo.device, {}).get(_TOTAL, 0)
        if total > self.capacity_bytes:
            raise torch.OutOfMemoryError(
                f"CPU capacity emulation: tracked tensor memory on rank {self.rank} reached {total:,} "
                f"bytes, over the per-rank capacity of {self.capacity_bytes:,} bytes (the trial's "
                "memory limit)")

    # Called after every op. MemTracker also keeps each module's own peak here, scanning every
    # module it has seen on every op: O(ops x modules), 75% of a 20-block model's CPU trial
    # (cProfile: 95 of 128 s). Trials read only the rank's peak and its breakdown (below), which
    # this keeps exactly as MemTracker does; the simulator's tracker skips the same scan.
    def _update_peak_stats(self, peak_state) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL]:
                self._peak_mem[device] = snapshot[_TOTAL]
                self._peak_mem_snap[device] = dict(snapshot)

    # MemTracker hooks every parameter's gradient, and torch refuses a hook on a parameter that
    # does not require grad: families that keep a fixed bias or scale as a frozen parameter
    # (afmoe, ernie4_5_moe, laguna) could not be tracked. A frozen parameter has no gradient to
    # count: it is marked as hooked, and is still counted as a parameter.
    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        for param in module.parameters():
            if not param.requires_grad and self._param_to_grad_hook_handles.get(param, None) is None:
                self._param_to_grad_hook_handles[param] = _NO_GRAD_HOOKS
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def peak_bytes(self) -> int:
        """Tracked peak since entering, over devices."""
        return max(self._peak_mem.values(), default=0)

    def peak_breakdown(self) -> dict[str, int]:
        """Bytes per autotune memory category at the peak."""
        snapshot = self.get_tracker_snapshot("peak")
        if not snapshot:
            return {}
        device_snap = max(snapshot.values(), key=lambda snap: snap.get(_TOTAL, 0))
        breakdown: dict[str, int] = {}
        for reftype, category in TRACKER_CATEGORIES.items():
            breakdown[category] = breakdown.get(category, 0) + int(device_snap.get(reftype, 0))
        return breakdown


def track_inductor_allocations() -> None:
    """Make the buffers inductor's CPU code allocates visible to a dispatch-mode tracker.

    Inductor's generated CPU wrapper allocates its buffers with
    `torch._C._dynamo.guards._empty_strided_cpu` (bound when the generated module loads), which
    calls the allocator directly, bypassing the dispatcher: a MemTracker never sees them (on
    tiny-llama, 4.9 MB of a 120.5 MB peak; docs/COMPILE.md). Replaced, for this process, by the
    same allocation made through the dispatcher (`torch.empty_strided`): the same storages with
    the same lifetimes, now counted and held to the capacity. On CUDA the caching allocator's
    statistics count them anyway. Idempotent; call before the first compiled step."""
    guards = torch._C._dynamo.guards
    if getattr(guards._empty_strided_cpu, "_autotune_tracked", False):
        return

    def empty_strided_cpu(size, stride, dtype):
        return torch.empty_strided(size, stride, dtype=dtype, device="cpu")

    empty_strided_cpu._autotune_tracked = True
    guards._empty_strided_cpu = empty_strided_cpu


def reset_rss_peak() -> None:
    """Reset this process's peak RSS (VmHWM) so it covers one trial only (Linux >= 4.0)."""
    try:
        Path(f"/proc/{os.getpid()}/clear_refs").write_text("5")
    except OSError:
        pass


def rss_bytes() -> int:
    """This process's resident set size now (VmRSS), 0 where unreadable."""
    try:
        for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def rss_peak_bytes() -> int | None:
    """This process's peak resident set size (VmHWM) since the last reset."""
    try:
        for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
