"""Hugging Face stacks: an `accelerate config` YAML (FSDP version 2), TrainingArguments fields
for the Trainer, and the same for TRL's SFTConfig, or its GRPOConfig with vLLM colocated for a
GRPO tune. All end in Accelerate's FSDP plugin, whose `mixed_precision` mode reduces gradients in
the parameter dtype (not fp32 as tuned)."""

from __future__ import annotations

from typing import Any

import yaml

from autotune.export._base import Export, ExportRefused, Mapper, Tuned, build_export
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
    if t.workload == "grpo":
        return _export_trl_grpo(t)
    m = Mapper()
    # TRL defaults gradient_checkpointing to True; the explicit activation_checkpointing set by
    # _trainer_fields takes precedence over that deprecated alias.
    fields = _trainer_fields(t, m)
    fields["max_length"] = t.seq_len
    fields["packing"] = True
    return _trl_export(t, m, fields, command="sft", config="SFTConfig",
                       note=f"packing fills sequences of max_length={t.seq_len} tokens as tuned.")


def _trl_export(t: Tuned, m: Mapper, fields: dict[str, Any], *, command: str, config: str, note: str,
                launch_args: str = "", target_note: str = "") -> Export:
    """A TRL config YAML for `trl <command>` (its `config` dataclass's fields), with its launch line."""
    filename = f"trl_{command}.yaml"
    body = (f"# Use: accelerate launch --num_processes {t.gpus} --num_machines {t.nodes} -m trl.cli {command} "
            f"--config {filename} --model_name_or_path MODEL --dataset_name DATA{launch_args}\n"
            f"# (or `trl {command} --config {filename} ...`). {config} fields; {note}\n"
            + _dump(fields))
    return build_export(fmt="trl", filename=filename, tuned=t, mapper=m, body=body,
                        target=f"TRL {_version('trl', '1.16')} ({config} YAML{target_note}; transformers "
                               "TrainingArguments fsdp_config version 2)")


TRL_NUM_GENERATIONS = 8
"""GRPOConfig.num_generations' default (trl 1.16)."""


def grpo_num_generations(t: Tuned) -> int:
    """Completions per prompt: TRL's default where it divides the generation batch, else the largest
    divisor below it. GRPOConfig.__post_init__ requires the generation batch
    (per_device_train_batch_size x processes x steps_per_generation, which defaults to the
    accumulation steps: the tuned global batch in sequences) to hold whole groups of at least 2."""
    batch = t.global_batch_size
    for groups in range(TRL_NUM_GENERATIONS, 1, -1):
        if batch % groups == 0:
            return groups
    raise ExportRefused(f"GRPO needs at least 2 completions per prompt in a generation batch; the tuned global "
                        f"batch is {batch} sequence{'s' if batch != 1 else ''} per step: tune a larger --global-tokens")


def _export_trl_grpo(t: Tuned) -> Export:
    """GRPOConfig fields (trl 1.16, trl/trainer/grpo_config.py) for the configuration tuned under
    `--workload grpo`; what the prediction assumed of TRL is pinned, what it leaves out is warned."""
    m = Mapper()
    fields = _trainer_fields(t, m)
    generations = grpo_num_generations(t)
    fields.update({
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": t.vllm_gpu_memory_utilization,
        # Pinned: the prediction assumes vLLM holds its share throughout, and no reference model.
        "vllm_enable_sleep_mode": False,
        "beta": 0.0,
        "num_generations": generations,
        # Prompt + completion, the sequences GRPO trains on, stay within the tuned seq_len.
        "vllm_max_model_length": t.seq_len,
    })
    if generations != TRL_NUM_GENERATIONS:
        m.warn(f"num_generations: {generations}, not TRL's default {TRL_NUM_GENERATIONS}, which does not divide the "
               f"tuned global batch of {t.global_batch_size} sequences (GRPOConfig refuses that); for another group "
               "size, tune a --global-tokens whose global batch it divides")
    for line in GRPO_NOT_MODELLED:
        m.warn(line)
    return _trl_export(t, m, fields, command="grpo", config="GRPOConfig", launch_args=" --reward_funcs ...",
                       target_note=", vLLM colocate",
                       note=f"prompt + completion are capped at vllm_max_model_length={t.seq_len} tokens, the "
                            "tuned seq_len.")


GRPO_NOT_MODELLED = (
    "vLLM's share (vllm_gpu_memory_utilization: its weights, the KV cache it generates with, CUDA graphs) is "
    "vLLM's to fill and is not predicted; vLLM refuses to start unless that much of each GPU is free",
    "the traced loss is the causal-LM cross-entropy over every token; GRPO's loss takes per-token "
    "log-probabilities of the completion tokens (GRPOTrainer._get_per_token_logps_and_entropies), so the "
    "logits' memory at the loss differs from what was traced",
    "GRPOTrainer's no-grad forward for the old log-probabilities (always run with vLLM's importance sampling "
    "correction) is not traced; it keeps no activations for backward",
    "beta: 0.0 (TRL's default) is pinned: with beta > 0 GRPOTrainer loads a reference model "
    "(create_model_from_path, then prepare_fsdp), whose sharded weights are not in the prediction",
    "vllm_enable_sleep_mode: false is pinned: with sleep mode vLLM frees its share during training (more room "
    "than predicted, slower generation)",
    "reward models given as reward_funcs are loaded on every GPU and are not in the prediction",
    "tokens/s is the training step's estimate: generation and the weight sync to vLLM take time it leaves out",
)
"""What the GRPO prediction leaves out, read from trl 1.16's GRPOTrainer (trl/trainer/grpo_trainer.py)."""
