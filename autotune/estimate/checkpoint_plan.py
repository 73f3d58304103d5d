"""Checkpoint advice: what saving the winning configuration costs, full state dict versus a
sharded torch.distributed.checkpoint (DCP) save, and which to use.

Saving is where large runs die: a 70B full state dict gathered on GPUs runs out of memory on
8x80 GB (llama-cookbook issue 142), and a full optimizer state gathered on one host can exceed
1 TB. The figures are estimates from the parameter count and the run's memory breakdown:

- sharded (DCP): every rank writes its own shards; nothing is gathered. Host memory: at most one
  staged copy of the node's shards (async_save stages them all; a synchronous save goes tensor
  by tensor).
- full, StateDictOptions(full_state_dict=True, cpu_offload=True): one tensor at a time is
  all-gathered on every GPU and copied to rank 0's host, which ends up holding the whole model
  (and the whole optimizer state if saved).
- full without cpu_offload: every rank builds the whole state dict on its GPU.

Master weights and AdamW's two moments are fp32 (training.build_model builds in fp32), so a
full copy is 4 bytes per parameter and the optimizer state 8.
"""

from __future__ import annotations

from typing import Any

PARAM_BYTES = 4  # fp32 master weights
OPTIMIZER_BYTES = 8  # AdamW exp_avg + exp_avg_sq, fp32
ASSUMED_HOST_BYTES = 2**40  # per node, when the run was given no --host-memory
_RESIDENT = ("parameters", "gradients", "optimizer_state", "runtime_overhead")

__all__ = ["plan_checkpoint", "ASSUMED_HOST_BYTES"]


def _figure(value: float, basis: str) -> dict[str, Any]:
    return {"value": int(value), "source": "estimated", "basis": basis}


def _resident_bytes(result: dict[str, Any], params: int) -> tuple[int, str]:
    """Device memory that stays between steps: the training peak's model-state part."""
    breakdown = result.get("memory_breakdown") or {}
    if any(k in breakdown for k in _RESIDENT[:3]):
        value = sum(int(breakdown.get(k, 0)) for k in _RESIDENT)
        source = result.get("memory_source", "estimated")
        return value, (f"parameters + gradients + optimizer state + runtime overhead at the training peak "
                       f"({source} by the {result.get('backend', '?')} backend)")
    if result["fsdp"]["cpu_offload"]:
        return 0, "model state offloaded to the host (no memory breakdown in the result)"
    value = (PARAM_BYTES * 2 + OPTIMIZER_BYTES) * params / result["gpus"]
    return int(value), "fp32 params + grads + AdamW state / world size (no memory breakdown in the result)"


def _size(figure: dict[str, Any]) -> str:
    from autotune.util.units import format_bytes

    return format_bytes(figure["value"])


def _largest_tensor_bytes(result: dict[str, Any]) -> int:
    config = result["model"].get("config") or {}
    hidden = result["model"].get("hidden_size") or config.get("hidden_size") or 0
    vocab = result["model"].get("vocab_size") or config.get("vocab_size") or 0
    ffn = result["model"].get("mlp_width") or config.get("intermediate_size") or 4 * hidden
    return PARAM_BYTES * max(vocab * hidden, ffn * hidden, hidden * hidden)


def plan_checkpoint(result: dict[str, Any]) -> dict[str, Any]:
    """Predict device and rank-0 host memory of full vs sharded checkpoints for a best.json
    document, and recommend one. Every figure is 'estimated', with its basis."""
    params = int(result["model"]["parameters"])
    gpus, nodes = int(result["gpus"]), int(result.get("nodes", 1))
    per_node = gpus // nodes
    full_model, full_optim = PARAM_BYTES * params, OPTIMIZER_BYTES * params
    resident, resident_basis = _resident_bytes(result, params)
    largest = _largest_tensor_bytes(result)

    limit = result.get("memory_limit_bytes")
    device_cap = int(limit if limit else result["gpu"]["memory_bytes"])
    vllm = " and vLLM's share" if (result.get("workload") or {}).get("kind") == "grpo" else ""
    device_cap_basis = (f"usable GPU memory of the run (capacity less headroom{vllm})" if limit
                        else f"{result['gpu']['type']} capacity")
    host_given = result.get("host_memory_bytes")
    host_cap = int(host_given) if host_given else ASSUMED_HOST_BYTES
    host_cap_basis = ("--host-memory of the run" if host_given else
                      f"assumed {ASSUMED_HOST_BYTES / 2**40:.0f} TiB per node (no --host-memory given)")
    host_base = int(result.get("host_memory_per_node_bytes") or 0)
    host_base_note = " + the run's own host memory per node" if host_base else ""

    def option(description: str, *, optimizer: bool, device: int, device_basis: str, host: int,
               host_basis: str, how: str) -> dict[str, Any]:
        fits_device, fits_host = device <= device_cap, host <= host_cap
        return {"description": description, "includes_optimizer": optimizer,
                "device_bytes": _figure(device, device_basis), "host_rank0_bytes": _figure(host, host_basis),
                "fits_device": fits_device, "fits_host": fits_host, "fits": fits_device and fits_host,
                "how": how}

    shards = (full_model + full_optim) * per_node / gpus
    options = {
        "sharded": option(
            "sharded DCP checkpoint (torch.distributed.checkpoint.save), model + optimizer",
            optimizer=True, device=resident, device_basis=f"{resident_basis}; nothing gathered",
            host=host_base + per_node * largest / gpus,
            host_basis=f"a synchronous save stages one shard tensor at a time on each of the node's {per_node} "
                       "ranks" + host_base_note,
            how="dcp.save({'model': get_model_state_dict(model), 'optim': get_optimizer_state_dict(model, opt)})"),
        "full_cpu_offload": option(
            "full state dict, StateDictOptions(full_state_dict=True, cpu_offload=True), model + optimizer",
            optimizer=True, device=resident + largest,
            device_basis=f"{resident_basis} + the largest tensor gathered at a time",
            host=host_base + full_model + full_optim,
            host_basis="rank 0 holds the whole fp32 model (4 B/param) and AdamW state (8 B/param)" + host_base_note,
            how="get_model_state_dict / get_optimizer_state_dict with "
                "StateDictOptions(full_state_dict=True, cpu_offload=True)"),
        "full_cpu_offload_model_only": option(
            "full state dict with cpu_offload, model weights only (final export)",
            optimizer=False, device=resident + largest,
            device_basis=f"{resident_basis} + the largest tensor gathered at a time",
            host=host_base + full_model, host_basis="rank 0 holds the whole fp32 model" + host_base_note,
            how="get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))"),
        "full_on_gpu": option(
            "full model state dict gathered on the GPUs (no cpu_offload)",
            optimizer=False, device=resident + full_model,
            device_basis=f"{resident_basis} + the whole fp32 model on every GPU",
            host=host_base, host_basis="tensors stay on the GPU until written" + host_base_note,
            how="get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))"),
    }
    options["sharded"]["async_save_host_bytes"] = _figure(
        host_base + shards, f"dcp.async_save stages all of the node's {per_node} shards of fp32 model + AdamW "
                            "state in host memory at once" + host_base_note)
    # FSDP2 practice: training checkpoints are sharded DCP saves, always (nothing gathered, resumable
    # at another world size); a full state dict is for the final export of the weights. Each has
    # its memory, so a full state dict that would not fit is said before anyone tries it.
    sharded, on_gpu, on_host = options["sharded"], options["full_on_gpu"], options["full_cpu_offload"]
    final = options["full_cpu_offload_model_only"]
    periodic_reason = (f"periodic training checkpoints: sharded DCP (dcp.save; {_size(sharded['device_bytes'])} "
                       f"per GPU, nothing gathered; dcp.async_save stages "
                       f"{_size(sharded['async_save_host_bytes'])} of host memory per node)")
    if final["fits"]:
        final_form = "full"
        final_reason = (f"final export: the model weights as a full state dict with cpu_offload "
                        f"(rank 0's host holds {_size(final['host_rank0_bytes'])}, each GPU gathers one tensor at a time)")
    else:
        final_form = "sharded"
        final_reason = (f"final export: a full state dict would not fit (rank 0's host would hold "
                        f"{_size(final['host_rank0_bytes'])}, more than its {_size({'value': host_cap})}): "
                        "consolidate the last DCP checkpoint offline "
                        "(torch.distributed.checkpoint.format_utils.dcp_to_torch_save)")
    failures = [text for text, ok in (
        (f"gathered on the GPUs a full state dict needs {_size(on_gpu['device_bytes'])} per GPU", on_gpu["fits_device"]),
        (f"rank 0's host would hold {_size(on_host['host_rank0_bytes'])} with the optimizer state",
         on_host["fits_host"])) if not ok]
    reason = periodic_reason + "; " + final_reason
    if failures:
        reason += "; never save training checkpoints as a full state dict here: " + "; ".join(failures)
    if host_base > host_cap:
        reason += (f"; note: the run itself needs {_size({'value': host_base})} of host memory per node, more "
                   f"than the {host_cap_basis}")
    return {
        "recommended": "sharded",
        "state_dict_type": "SHARDED_STATE_DICT",
        "reason": reason,
        "periodic": {"form": "sharded", "how": sharded["how"], "reason": periodic_reason},
        "final_export": {"form": final_form, "how": final["how"] if final_form == "full" else
                         "torch.distributed.checkpoint.format_utils.dcp_to_torch_save(checkpoint_dir, 'model.pt')",
                         "reason": final_reason},
        "device_capacity_bytes": device_cap, "device_capacity_basis": device_cap_basis,
        "host_capacity_bytes": host_cap, "host_capacity_basis": host_cap_basis,
        "host_capacity_assumed": not host_given,
        "options": options,
    }
