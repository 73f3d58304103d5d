"""Hugging Face stacks: an `accelerate config` YAML (FSDP version 2), TrainingArguments fields
for the Trainer, and the same for TRL's SFTConfig, or its GRPOConfig with vLLM colocated for a
GRPO tune. All end in Accelerate's FSDP plugin, whose `mixed_precision` mode reduces gradients in
the parameter dtype (not fp32 as tuned)."""

from __future__ import annotations

from typing import Any

import yaml

from autotune.problem.config import QLORA_QUANTIZATION, TRL_MAX_COMPLETION_LENGTH, TRL_NUM_GENERATIONS
from autotune.results.export._base import (
    MAIN_ADDR_PLACEHOLDER,
    RDZV_PORT,
    Export,
    ExportRefused,
    Mapper,
    Tuned,
    accelerate_launch,
    build_export,
    map_attention,
    map_attention_by_hand,
    nodes_note,
    torchrun_launch,
    warn_flash_attention,
)
from autotune.results.export._fsdp1 import optimizer_kwargs


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
    elif t.reduce_dtype == t.param_dtype:  # tuned with Accelerate's step (--stack): its own policy
        m.mapped("reduce_dtype", f"{key} (Accelerate reduces in {t.param_dtype}, as tuned)")
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
    """every:K through the Trainer's model-level checkpointing: blocks 0, K, 2K, ... exactly. Not
    for GRPO: see GRPO_EVERY_K."""
    return t.ac_every is not None and t.ac_every > 1 and t.workload != "grpo" and _has_every_n_layers()


GRPO_EVERY_K = (
    "TRL 1.16's GRPOTrainer runs its no-grad log-probability forward inside disable_gradient_checkpointing "
    "(trl/models/utils.py), which turns the model's checkpointing back on with "
    "gradient_checkpointing_enable(gradient_checkpointing_kwargs): every_n_layers is dropped (it ends up among "
    "torch.utils.checkpoint's kwargs), so after the first generation step every block is checkpointed; no config "
    "key passes it through")
"""Why a GRPO config never uses the model-level every_n_layers route (checked against TRL's code in
tests/test_grpo.py)."""


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
        why = f"{GRPO_EVERY_K}; FSDP's own " if not prefix and t.workload == "grpo" else ""
        m.approximated("activation_checkpointing", f"{prefix}activation_checkpointing: true",
                       f"every:{t.ac_every} (blocks 0, {t.ac_every}, ...) cannot be expressed: {why}checkpointing "
                       f"of all {t.num_layers} blocks instead, which uses less activation memory but recomputes "
                       "more (slower than tuned)")
    m.mapped("cpu_offload", f"{prefix}offload_params" if prefix else "cpu_offload")
    m.mapped("reshard_after_forward", f"{prefix}reshard_after_forward")
    m.mapped("wrap", f"{prefix}auto_wrap_policy: TRANSFORMER_BASED_WRAP + {t.wrap}")
    m.mapped("state_dict_type", f"{prefix}state_dict_type")


HSDP_ENV = ("ACCELERATE_USE_PARALLELISM_CONFIG", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
            "PARALLELISM_CONFIG_DP_SHARD_SIZE")
"""What `accelerate launch` sets from a config's parallelism_config (accelerate 1.15,
utils/launch.prepare_extend_env_parallelism_config), and what Accelerator() reads when it is given no
ParallelismConfig: the Trainer (and so TRL) gives it none unless TrainingArguments.parallelism_config is
set, which a YAML or the command line cannot do (HfArgumentParser leaves the dict unconverted)."""


def hsdp_launch_env(t: Tuned) -> str:
    """The environment in front of a Trainer / TRL launch line that makes Accelerate build the tuned
    (dp_replicate, dp_shard) mesh for fully_shard ('' without HSDP)."""
    if not t.shard_group_size:
        return ""
    replicate, shard = t.hsdp_degrees
    return " ".join(f"{key}={value}" for key, value in zip(HSDP_ENV, ("true", replicate, shard))) + " "


def _map_hsdp_env(m: Mapper, t: Tuned) -> None:
    if t.shard_group_size:
        replicate, shard = t.hsdp_degrees
        m.mapped("shard_group_size", f"launch line: {HSDP_ENV[1]}={replicate} x {HSDP_ENV[2]}={shard} (Accelerate's "
                                     "ParallelismConfig, read by the Accelerator the Trainer builds: replicate across "
                                     "groups, shard within)")


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
    m.mapped("world_size", "num_processes / num_machines" + ("; machine_rank and main_process_ip per node "
                                                              "(launch line)" if t.nodes > 1 else ""))
    replicate, shard = t.hsdp_degrees
    if t.shard_group_size:
        m.mapped("shard_group_size", f"parallelism_config: dp_replicate_size {replicate} x dp_shard_size {shard} "
                                     "(Accelerate's FSDP2 mesh: replicate across groups, shard within)")
    if t.tensor_parallel > 1:
        m.approximated("tensor_parallel", f"parallelism_config: tp_size {t.tensor_parallel} x dp_shard_size {shard}",
                       "Accelerate's ParallelismConfig mesh; load the model with from_pretrained(..., tp_plan='auto', "
                       "device_mesh=accelerator.torch_device_mesh['tp']): transformers applies the same plan "
                       "(base_model_tp_plan) with its own colwise/rowwise classes, not torch's that autotune traced")
    if t.context_parallel > 1:
        m.approximated("context_parallel", f"parallelism_config: cp_size {t.context_parallel} x dp_shard_size {shard}",
                       "Accelerate's ParallelismConfig mesh; wrap each step in accelerator.maybe_context_parallel("
                       "buffers=[input_ids, shift_labels, position_ids], buffer_seq_dims=[1, 1, 1]): torch's ring "
                       "attention through SDPA, as traced (CUDA's kernels there, the CPU flash kernel here)")
    map_attention_by_hand(m, t, "an accelerate config key")
    m.unsupported("optimizer_impl", f"not an accelerate config key: build torch.optim.AdamW(..., "
                  f"{', '.join(f'{k}={v}' for k, v in optimizer_kwargs(t.optimizer_impl).items())}) in your script, "
                  "the implementation traced")
    if t.compile != "none":
        m.approximated("compile", "dynamo_config: dynamo_backend INDUCTOR, dynamo_use_fullgraph, "
                                  "dynamo_use_regional_compilation",
                       "Accelerate's regional compilation (accelerate.utils.compile_regions) compiles each repeated "
                       f"{t.wrap} with inductor, as tuned, and also the rest of the model (embeddings, head) "
                       "separately, which autotune leaves eager: the head's memory and time may differ from the trace")
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "mixed_precision": _HF_MIXED[t.stack_precision],
        "num_machines": t.nodes,
        "num_processes": t.gpus,
        "machine_rank": 0,
        # Several nodes: the launch line overrides machine_rank and the address on each node.
        **({"main_process_ip": MAIN_ADDR_PLACEHOLDER, "main_process_port": RDZV_PORT} if t.nodes > 1 else {}),
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
        **({"dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_use_fullgraph": True,
                              "dynamo_use_regional_compilation": True}} if t.compile != "none" else {}),
        # HSDP: Accelerate 1.15 builds a (dp_replicate, dp_shard) mesh for fully_shard from these.
        **({"parallelism_config": {"parallelism_config_dp_replicate_size": replicate,
                                   "parallelism_config_dp_shard_size": shard,
                                   **({"parallelism_config_tp_size": t.tensor_parallel} if t.tensor_parallel > 1 else {}),
                                   **({"parallelism_config_cp_size": t.context_parallel} if t.context_parallel > 1 else {})}}
           if t.shard_group_size or t.ranks_per_batch > 1 else {}),
    }
    placeholders = (f"# (machine_rank: 0 and main_process_ip: {MAIN_ADDR_PLACEHOLDER} below are placeholders the "
                    "launch line overrides on each node)\n") if t.nodes > 1 else ""
    body = (f"# Use: {accelerate_launch(t, 'accelerate_fsdp2.yaml')} train.py\n"
            f"{nodes_note(t, ranks=True)}{placeholders}"
            f"# with DataLoader(batch_size={t.micro_batch_size}) and "
            f"Accelerator(gradient_accumulation_steps={t.grad_accum_steps}), sequences of {t.seq_len} tokens,\n"
            f"# the model loaded with from_pretrained(..., attn_implementation={t.attention!r}).\n"
            + _dump(config))
    return build_export(fmt="accelerate", filename="accelerate_fsdp2.yaml", tuned=t, mapper=m, body=body,
                        expresses=("hsdp",),
                        target=f"Accelerate {_version('accelerate', '1.15')} (accelerate config YAML, FSDP version 2)")


def _trainer_fields(t: Tuned, m: Mapper) -> dict[str, Any]:
    _map_precision(m, t, {"bf16": "bf16: true", "fp16": "fp16: true", "fp32": "bf16/fp16 off"}[t.stack_precision])
    _map_fsdp_knobs(m, t, "")
    m.mapped("micro_batch_size", "per_device_train_batch_size")
    m.mapped("grad_accum_steps", "gradient_accumulation_steps")
    if t.optimizer_impl == "fused":
        m.mapped("optimizer_impl", "optim: adamw_torch_fused")
    else:
        m.approximated("optimizer_impl", "optim: adamw_torch",
                       f"the Trainer has no switch for AdamW's {t.optimizer_impl} path: adamw_torch takes torch's "
                       "default (foreach on CUDA); pass optim_args or a custom optimizer for the per-parameter loop")
    m.mapped("world_size", f"{torchrun_launch(t)} (launch line above)")
    _map_hsdp_env(m, t)
    if t.compile != "none":
        m.approximated("compile", "torch_compile: true",
                       "the Trainer compiles the whole model (torch.compile through Accelerate, inductor), not each "
                       f"{t.wrap} with the rest eager as tuned: graph breaks at FSDP's hooks and the head's memory "
                       "may differ from the trace (docs/COMPILE.md)")
    return {
        "output_dir": "output",
        "per_device_train_batch_size": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "bf16": t.stack_precision == "bf16",
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
        **({"torch_compile": True} if t.compile != "none" else {}),
    }


def export_hf_trainer(t: Tuned) -> Export:
    m = Mapper()
    fields = _trainer_fields(t, m)
    map_attention_by_hand(m, t, "a TrainingArguments field")
    body = (f"# Use: {hsdp_launch_env(t)}{torchrun_launch(t)} train.py hf_trainer_args.yaml\n"
            f"{nodes_note(t, ranks=False)}"
            "# where train.py does: (args,) = HfArgumentParser(TrainingArguments).parse_yaml_file(sys.argv[1])\n"
            f"# and loads the model with from_pretrained(..., attn_implementation={t.attention!r}).\n"
            f"# Tokenize into sequences of {t.seq_len} tokens (the tuned seq_len).\n"
            + _dump(fields))
    return build_export(fmt="hf-trainer", filename="hf_trainer_args.yaml", tuned=t, mapper=m, body=body,
                        expresses=("hsdp",),
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
    fields.update(trl_packing(t))
    if t.activation_offload:
        # TRL 1.16 ports torchtune's OffloadActivations: the same rule of what moves (not parameters,
        # not under 1 KiB), on a side stream, and it keeps the output head's activations on the GPU.
        fields["activation_offloading"] = True
        m.approximated("activation_offload", "activation_offloading: true",
                       "TRL's OffloadActivations (trl/models/activation_offloading.py) moves what autotune's "
                       "OffloadedActivations moves except the output head's activations, which it keeps on the "
                       "GPU (more memory at the loss than predicted), and overlaps the copies (faster)")
    else:
        m.mapped("activation_offload", "activation_offloading: false (TRL's default)")
    if t.token_budget:
        fields["attn_implementation"] = "flash_attention_2"
        _map_packed_attention(m, t)
        m.approximated("token_budget", f"packing_strategy: bfd, padding_free: true, per_device_train_batch_size x "
                       f"max_length = {t.token_budget:,} tokens, attn_implementation: flash_attention_2",
                       "TRL packs whole documents into rows of max_length (bfd) and flattens a micro-batch's rows into "
                       "one padding-free row: at most the budget tuned, filled at least as well as the greedy packing "
                       "estimated; flash-attention's varlen kernel attends within each document, as traced (with "
                       "SDPA per document)")
        note = (f"packed batches of up to {t.token_budget:,} tokens of whole documents (bfd into rows of "
                f"max_length={t.seq_len}, flattened padding-free), attention within each document, as tuned "
                "(--token-budget).")
    elif t.stack == "trl-padding-free":
        note = (f"bfd packing of documents into sequences of max_length={t.seq_len} tokens, each micro-batch "
                "flattened into one padding-free row, as tuned (--stack trl-padding-free); its memory was "
                "predicted with SDPA, transformers' attention where attn_implementation is not set, which attends "
                "through a block-diagonal (tokens x tokens) mask in every block; with flash_attention_2 (TRL's "
                "advice for padding-free batches) transformers builds no mask (flash-attention itself is not "
                "traced).")
    else:
        note = (f"wrapped packing fills rows of max_length={t.seq_len} tokens, as traced; TRL's default bfd "
                "packing makes batches padding-free, a step of its own: tune with --stack trl-padding-free "
                "for it.")
    if not t.token_budget:
        fields.update(_model_init_attention(m, t))
    return _trl_export(t, m, fields, command="sft", config="SFTConfig", note=note)


def _model_init_attention(m: Mapper, t: Tuned) -> dict[str, Any]:
    """The tuned attention as SFTConfig / GRPOConfig model_init_kwargs: the from_pretrained kwargs the
    trainer loads a model name with, which `trl sft` / `trl grpo` also apply over ModelConfig's (trl 1.16,
    trl/scripts/sft.py: model_init_kwargs.update(training_args.model_init_kwargs))."""
    map_attention(m, t, f"model_init_kwargs: attn_implementation: {t.attention}")
    return {"model_init_kwargs": {"attn_implementation": t.attention}}


def _map_packed_attention(m: Mapper, t: Tuned) -> None:
    """Packed padding-free batches: ModelConfig's flash_attention_2, TRL's varlen attention for them."""
    key = "attn_implementation: flash_attention_2 (ModelConfig)"
    if t.attention == "flash_attention_2":
        map_attention(m, t, key)
        return
    m.approximated("attention", key, f"packed padding-free batches attend within each document through "
                                     f"flash-attention's varlen kernel (TRL's advice), not the {t.attention} "
                                     "tuned (traced per document)")
    warn_flash_attention(m, t, "flash_attention_2")


def trl_packing(t: Tuned) -> dict[str, Any]:
    """SFTConfig's packing fields for the step tuned (trl 1.16, SFTTrainer.__init__: bfd or bfd_split
    packing turns the collator padding-free whatever padding_free says). `--stack trl-padding-free`:
    bfd, padding-free, written out; otherwise 'wrapped', the one strategy that fills rows of
    max_length tokens without flattening them, the batches every other step traces."""
    if t.stack == "trl-padding-free" or t.token_budget:
        return {"packing": True, "packing_strategy": "bfd", "padding_free": True}
    return {"packing": True, "packing_strategy": "wrapped", "padding_free": False}


def _lora_fields(t: Tuned) -> dict[str, Any]:
    """TRL's ModelConfig fields for the LoRA that was traced (trl 1.16, trl/trainer/model_config.py;
    `trl <command> --config` fills every dataclass of its parser from one file). The base loads in
    bf16 (`dtype`), and Accelerate's FSDP2 preparation upcasts only trainable parameters to fp32
    (accelerate 1.15, utils/fsdp_utils.py: 'FSDP upcast of low precision parameters'): the frozen
    base in bf16 and the adapters in fp32, as traced."""
    f = t.finetuning
    if f.get("peft") not in ("lora", "qlora"):
        return {}
    alpha = int(f["alpha"]) if float(f["alpha"]).is_integer() else f["alpha"]
    fields = {"use_peft": True, "lora_r": int(f["rank"]), "lora_alpha": alpha, "lora_dropout": f["dropout"],
              "lora_target_modules": str(f.get("targets", "all-linear")).split(","), "dtype": t.param_dtype}
    if f["peft"] == "qlora":
        # QLoRA: ModelConfig's bitsandbytes fields, which TRL's get_quantization_config turns into the
        # BitsAndBytesConfig traced (compute dtype = `dtype`; packed codes stored in bf16 for FSDP).
        fields.update(load_in_4bit=True, bnb_4bit_quant_type=QLORA_QUANTIZATION["quant_type"],
                      use_bnb_nested_quant=QLORA_QUANTIZATION["compress_statistics"],
                      bnb_4bit_quant_storage=t.param_dtype)
    return fields


def _trl_export(t: Tuned, m: Mapper, fields: dict[str, Any], *, command: str, config: str, note: str,
                launch_args: str = "", target_note: str = "") -> Export:
    """A TRL config YAML for `trl <command>` (its `config` dataclass's fields, and ModelConfig's
    LoRA fields for a LoRA tune), with its launch line."""
    filename = f"trl_{command}.yaml"
    lora = _lora_fields(t)
    if lora:
        fields = {**fields, **lora}
        config += " + ModelConfig (QLoRA)" if lora.get("load_in_4bit") else " + ModelConfig (LoRA)"
    body = (f"# Use: {hsdp_launch_env(t)}{accelerate_launch(t)} -m trl.cli {command} "
            f"--config {filename} --model_name_or_path MODEL --dataset_name DATA{launch_args}\n"
            f"{nodes_note(t, ranks=True)}"
            f"# (or `trl {command} --config {filename} ...`). {config} fields; {note}\n"
            + _dump(fields))
    return build_export(fmt="trl", filename=filename, tuned=t, mapper=m, body=body,
                        expresses=("lora", "qlora", "hsdp", *(("packing",) if t.token_budget and command == "sft" else ())),
                        target=f"TRL {_version('trl', '1.16')} ({config} YAML{target_note}; transformers "
                               "TrainingArguments fsdp_config version 2)")


def grpo_num_generations(t: Tuned) -> int:
    """Completions per prompt: TRL's default where it divides the generation batch, else the largest
    divisor below it. GRPOConfig.__post_init__ requires the generation batch
    (per_device_train_batch_size x processes x steps_per_generation, which defaults to the
    accumulation steps: the tuned global batch in sequences) to hold whole groups of at least 2."""
    batch = t.global_batch_size
    if t.num_generations is not None:  # the user's: kept, or refused
        if batch % t.num_generations:
            raise ExportRefused(f"--num-generations {t.num_generations} does not divide the tuned global batch of {batch} "
                                "sequences (GRPOConfig refuses that): tune a --global-tokens whose batch it divides")
        return t.num_generations
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
    fields.update(_model_init_attention(m, t))  # the trained model's; vLLM generates with its own
    fields.update({
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": t.vllm_gpu_memory_utilization,
        # Pinned: the prediction assumes vLLM holds its share throughout, and no reference model.
        "vllm_enable_sleep_mode": False,
        "beta": 0.0,
        "num_generations": generations,
        "max_completion_length": t.max_completion_length or TRL_MAX_COMPLETION_LENGTH,
        # Prompt + completion, the sequences GRPO trains on, stay within the tuned seq_len.
        "vllm_max_model_length": t.seq_len,
    })
    if generations != TRL_NUM_GENERATIONS and t.num_generations is None:
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
    "estimated, not predicted (best.json workload.vllm_share: the need and why this share); vLLM sizes its KV "
    "cache to fill the share and refuses to start unless that much of each GPU is free",
    "generation throughput is not modelled: a smaller share that holds fewer sequences at once generates slower",
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
