"""CPU offload, modelled from a trace of the same configuration without it.

FSDP2's `CPUOffloadPolicy(pin_memory=True)` cannot be applied without an accelerator (it pins
host memory), so the simulator traces the configuration without offload and moves memory:

- off the device: sharded parameters, sharded gradients and optimizer state (they live on
  the host; the AdamW step runs there);
- onto the device: before each all-gather, the fp32 shard of one FSDP group is copied up and
  cast into the all-gather buffer. A block's shard is charged at every forward and backward
  site (an upper bound: the copy lives only while the all-gather is issued); the root's shard
  (embeddings, output layer: often the largest group) only where the root is gathered, at the
  start of forward: FSDP2 keeps the root unsharded from forward through backward. Measured on
  an H100 (docs/BENCHMARKS.md, GPU check), charging the root's shard everywhere overstated a
  qwen2.5-0.5b offload peak by 13%;
- on the host, per rank: parameters and gradients in pinned memory (PyTorch's pinned host
  allocator rounds each allocation up to a power of two), optimizer state and the step's
  temporaries in pageable memory, plus the process's own host memory (estimated constant).

Assumptions: gradients are copied to the host after every reduce-scatter (no accumulation on
the device); nothing else changes place. Figures built this way are `estimated`.
"""

from __future__ import annotations

from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

from autotune.estimate import costmodel
from autotune.backends.sim._trace import SYNC_PHASE, SiteKey, StepTrace

__all__ = ["OFFLOAD_BASIS", "device_sites", "host_bytes_per_rank", "staging_bytes"]


_ON_HOST = (_FSDPRefType.SHARDED_PARAM.name, _FSDPRefType.SHARDED_GRAD.name, _FSDPRefType.OPT.name)
_STAGING = _FSDPRefType.ALL_GATHER.name

OFFLOAD_BASIS = ("CPU offload modelled from the trace without it: sharded parameters, gradients "
                 "and optimizer state moved to the host, one group's fp32 shard staged on the "
                 "device per all-gather (docs/SIMULATOR.md)")


def device_sites(sites: dict[SiteKey, dict[str, int]], *, block_staging: int,
                 root_staging: int) -> dict[SiteKey, dict[str, int]]:
    """Device memory per site under CPU offload. Sites are (phase, hook, unit, ops since)."""
    moved = {}
    for key, cats in sites.items():
        device = {cat: (0 if cat in _ON_HOST else n) for cat, n in cats.items()}
        if key[0] != "opt":
            root_gathered_here = key[0] == "fw" and key[1] in ("start", "pre_fw") and key[2] in ("-", "root")
            # The weight sync copies each parameter's shard up before gathering it (TRL:
            # param.to(device)): at most the larger group's shard.
            staging = (max(block_staging, root_staging) if root_gathered_here or key[0] == SYNC_PHASE
                       else block_staging)
            device[_STAGING] = device.get(_STAGING, 0) + staging
        moved[key] = device
    return moved


def staging_bytes(trace: StepTrace, *, num_gpus: int) -> tuple[int, int]:
    """fp32 bytes of one block's shard and of the root's shard on one rank."""
    return -(-trace.block_params // num_gpus) * 4, -(-trace.root_params // num_gpus) * 4


def host_bytes_per_rank(sites: dict[SiteKey, dict[str, int]], trace: StepTrace, *, num_layers: int) -> int:
    """Host memory one rank needs: pinned fp32 parameter and gradient shards, optimizer state
    and step temporaries (the optimizer site's), and the process itself."""
    pinned_shards = trace.pinned_param_bytes["root"] + num_layers * trace.pinned_param_bytes["block"]
    optimizer = max((cats.get(_FSDPRefType.OPT.name, 0) for key, cats in sites.items() if key[0] == "opt"),
                    default=0)
    return 2 * pinned_shards + optimizer + costmodel.HOST_PROCESS_BYTES
