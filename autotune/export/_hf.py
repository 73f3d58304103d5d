"""Hugging Face stacks: an `accelerate config` YAML (FSDP version 2), TrainingArguments fields
for the Trainer, and the same for TRL's SFTConfig. All three end in Accelerate's FSDP plugin,
whose `mixed_precision` mode reduces gradients in the parameter dtype (not fp32 as tuned)."""

from __future__ import annotations

from typing import Any

import yaml

from autotune.export._base import Export, Mapper, Tuned, build_export
from autotune.export._fsdp1 import optimizer_kwargs


def _version(module: str, fallback: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:  # the exporter does not need the stack installed
        return fallback


_HF_MIXED = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}
# TrainingArguments.optim names of the AdamW implementations autotune traces.
_HF_OPTIM = {"fused": "adamw_torch_fused", "foreach": "adamw_torch", "for-loop": "adamw_torch"}


def _map_precision(m: Mapper, t: Tuned, key: str) -> None:
    m.mapped("precision", key)
    if t.precision == "fp32":
        m.mapped("reduce_dtype", f"{key} (fp32 throughout)")
    else:
        m.approximated("reduce_dtype", key,
                       f"Accelerate's {t.precision} mode reduces gradients in {t.param_dtype}, not float32 as "
                       "tuned; for fp32 reduction construct FullyShardedDataParallelPlugin(mixed_precision_policy="
                       f"{{'param_dtype': torch.{t.param_dtype}, 'reduce_dtype': torch.float32, "
                       f"'output_dtype': torch.{t.param_dtype}}}) in code")


def _has_every_n_layers() -> bool:
    """transformers 5.23+ checkpoints every n-th decoder layer (activation_checkpointing_kwargs)."""
    try:
        import inspect

        from transformers import PreTrainedModel
    except ImportError:
        return True  # written for the current release; the file says which version it targets
    return "every_n_layers" in inspect.signature(PreTrainedModel._set_gradient_checkpointing).parameters


def _model_level_every_k(t: Tuned) -> bool:
    """every:K through the Trainer's model-level checkpointing: blocks 0, K, 2K, ... exactly."""
    return t.ac_every is not None and t.ac_every > 1 and _has_every_n_layers()


def _map_fsdp_knobs(m: Mapper, t: Tuned, prefix: str) -> None:
    """Knobs expressed by fsdp_config keys (Accelerate's YAML uses the fsdp_ prefix, Trainer not)."""
    if t.ac_every is None or t.ac_every == 1:
        m.mapped("activation_checkpointing", f"{prefix}activation_checkpointing")
    elif not prefix and _model_level_every_k(t):
        m.approximated("activation_checkpointing",
                       f"activation_checkpointing_kwargs.every_n_layers={t.ac_every}",
                       f"the model's own non-reentrant checkpointing of blocks 0, {t.ac_every}, ... (the tuned blocks, "
                       "the tuned activation memory; fsdp_config activation_checkpointing is off, as transformers "
                       "refuses both); transformers warns it adds an all-gather in backward under FSDP "
                       "(transformers issue 30404), so communication may exceed what was estimated")
    else:
        m.approximated("activation_checkpointing", f"{prefix}activation_checkpointing: true",
                       f"every:{t.ac_every} (blocks 0, {t.ac_every}, ...) cannot be expressed: checkpointing "
                       f"all {t.num_layers} blocks instead, which uses less activation memory but recomputes "
                       "more (slower than tuned)")
    m.mapped("cpu_offload", f"{prefix}offload_params" if prefix else "cpu_offload")
    m.mapped("reshard_after_forward", f"{prefix}reshard_after_forward")
    m.mapped("wrap", f"{prefix}auto_wrap_policy: TRANSFORMER_BASED_WRAP + {t.wrap}")
    m.mapped("state_dict_type", f"{prefix}state_dict_type")


def _dump(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def export_accelerate(t: Tuned) -> Export:
    m = Mapper()
    _map_precision(m, t, "mixed_precision")
    _map_fsdp_knobs(m, t, "fsdp_")
    m.unsupported("micro_batch_size", f"not an accelerate config key: use DataLoader(batch_size={t.micro_batch_size}) "
                  "in your script")
    m.unsupported("grad_accum_steps", "not an accelerate config key: use "
                  f"Accelerator(gradient_accumulation_steps={t.grad_accum_steps}) in your script")
    m.mapped("world_size", "num_processes / num_machines")
    m.unsupported("optimizer_impl", f"not an accelerate config key: build torch.optim.AdamW(..., "
                  f"{', '.join(f'{k}={v}' for k, v in optimizer_kwargs(t.optimizer_impl).items())}) in your script, "
                  "the implementation traced")
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "mixed_precision": _HF_MIXED[t.precision],
        "num_machines": t.nodes,
        "num_processes": t.gpus,
        "machine_rank": 0,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": t.reshard_after_forward,
            "fsdp_offload_params": t.cpu_offload,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": t.wrap,
            "fsdp_activation_checkpointing": t.ac_every is not None,
            "fsdp_state_dict_type": t.state_dict_enum,
            "fsdp_cpu_ram_efficient_loading": True,
        },
    }
    body = (f"# Use: accelerate launch --config_file accelerate_fsdp2.yaml train.py\n"
            f"# with DataLoader(batch_size={t.micro_batch_size}) and "
            f"Accelerator(gradient_accumulation_steps={t.grad_accum_steps}), sequences of {t.seq_len} tokens.\n"
            + _dump(config))
    return build_export(fmt="accelerate", filename="accelerate_fsdp2.yaml", tuned=t, mapper=m, body=body,
                        target=f"Accelerate {_version('accelerate', '1.15')} (accelerate config YAML, FSDP version 2)")


def _trainer_fields(t: Tuned, m: Mapper) -> dict[str, Any]:
    _map_precision(m, t, {"bf16": "bf16: true", "fp16": "fp16: true", "fp32": "bf16/fp16 off"}[t.precision])
    _map_fsdp_knobs(m, t, "")
    m.mapped("micro_batch_size", "per_device_train_batch_size")
    m.mapped("grad_accum_steps", "gradient_accumulation_steps")
    if t.optimizer_impl == "fused":
        m.mapped("optimizer_impl", "optim: adamw_torch_fused")
    else:
        m.approximated("optimizer_impl", "optim: adamw_torch",
                       f"the Trainer has no switch for AdamW's {t.optimizer_impl} path: adamw_torch takes torch's "
                       "default (foreach on CUDA); pass optim_args or a custom optimizer for the per-parameter loop")
    m.mapped("world_size", f"torchrun --nnodes {t.nodes} --nproc_per_node {t.gpus_per_node} (launch line above)")
    return {
        "output_dir": "output",
        "per_device_train_batch_size": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "bf16": t.precision == "bf16",
        "fp16": t.precision == "fp16",
        "fsdp": True,
        "fsdp_config": {
            "version": 2,
            "reshard_after_forward": t.reshard_after_forward,
            "cpu_offload": t.cpu_offload,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": [t.wrap],
            "activation_checkpointing": t.ac_every is not None and not _model_level_every_k(t),
            "state_dict_type": t.state_dict_enum,
        },
        # Model-level checkpointing only for every:K; FSDP's own otherwise (never both: transformers
        # refuses it, and TRL would turn it on by default).
        "activation_checkpointing": _model_level_every_k(t),
        **({"activation_checkpointing_kwargs": {"every_n_layers": t.ac_every, "use_reentrant": False}}
           if _model_level_every_k(t) else {}),
        "optim": _HF_OPTIM[t.optimizer_impl],
    }


def export_hf_trainer(t: Tuned) -> Export:
    m = Mapper()
    fields = _trainer_fields(t, m)
    body = (f"# Use: torchrun --nnodes {t.nodes} --nproc_per_node {t.gpus_per_node} train.py hf_trainer_args.yaml\n"
            "# where train.py does: (args,) = HfArgumentParser(TrainingArguments).parse_yaml_file(sys.argv[1])\n"
            f"# Tokenize into sequences of {t.seq_len} tokens (the tuned seq_len).\n"
            + _dump(fields))
    return build_export(fmt="hf-trainer", filename="hf_trainer_args.yaml", tuned=t, mapper=m, body=body,
                        target=f"transformers {_version('transformers', '5.23')} (TrainingArguments, fsdp_config "
                               "version 2)")


def export_trl(t: Tuned) -> Export:
    m = Mapper()
    # TRL defaults gradient_checkpointing to True; the explicit activation_checkpointing set by
    # _trainer_fields takes precedence over that deprecated alias.
    fields = _trainer_fields(t, m)
    fields["max_length"] = t.seq_len
    fields["packing"] = True
    body = (f"# Use: accelerate launch --num_processes {t.gpus} --num_machines {t.nodes} -m trl.cli sft "
            "--config trl_sft.yaml --model_name_or_path MODEL --dataset_name DATA\n"
            "# (or `trl sft --config trl_sft.yaml ...`). SFTConfig fields; packing fills "
            f"sequences of max_length={t.seq_len} tokens as tuned.\n"
            + _dump(fields))
    return build_export(fmt="trl", filename="trl_sft.yaml", tuned=t, mapper=m, body=body,
                        target=f"TRL {_version('trl', '1.16')} (SFTConfig YAML; transformers TrainingArguments "
                               "fsdp_config version 2)")
