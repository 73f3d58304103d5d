"""llama-cookbook (formerly llama-recipes): the finetuning command with its train_config and
fsdp_config flags (src/llama_cookbook/configs/{training,fsdp}.py; fire parses the flags)."""

from __future__ import annotations

import shlex

from autotune.export._base import Export, Mapper, Tuned, build_export

TARGET = "llama-cookbook 0.0.5 (python -m llama_cookbook.finetuning; train_config / fsdp_config flags, FSDP1)"


def export_cookbook(t: Tuned) -> Export:
    m = Mapper()
    m.mapped("precision", {"bf16": "--mixed_precision True (bfSixteen)", "fp16": "--use_fp16 True",
                           "fp32": "--mixed_precision False"}[t.precision])
    if t.precision == "fp32":
        m.mapped("reduce_dtype", "--mixed_precision False (fp32 throughout)")
    else:
        m.approximated("reduce_dtype", "--mixed_precision True",
                       f"llama-cookbook's {t.precision} policy reduces gradients in {t.param_dtype}, not float32 "
                       "as tuned (no flag for an fp32 reduction; edit get_policies to change it)")
    if t.ac_every is None or t.ac_every == 1:
        m.mapped("activation_checkpointing", "--fsdp_activation_checkpointing")
    else:
        m.approximated("activation_checkpointing", "--fsdp_activation_checkpointing True",
                       f"every:{t.ac_every} cannot be expressed: all {t.num_layers} blocks are checkpointed "
                       "(less memory, slower than tuned)")
    m.mapped("cpu_offload", "--fsdp_cpu_offload")
    # Not a flag: fire hands the string to FSDP1 unconverted (check_fsdp_config converts only
    # checkpoint_type), so --sharding_strategy FULL_SHARD fails with KeyError: 'FULL_SHARD'.
    if t.reshard_after_forward:
        m.mapped("reshard_after_forward", "FULL_SHARD (llama-cookbook's default; no flag needed)")
    else:
        m.approximated("reshard_after_forward", "edit src/llama_cookbook/configs/fsdp.py",
                       "SHARD_GRAD_OP cannot be passed on the command line (llama-cookbook passes the string to "
                       "FSDP1 unconverted): set sharding_strategy: ShardingStrategy = ShardingStrategy.SHARD_GRAD_OP "
                       "in fsdp_config; as written the run reshards after forward (less memory, slower)")
    m.mapped("micro_batch_size", "--batch_size_training")
    m.mapped("grad_accum_steps", "--gradient_accumulation_steps")
    m.mapped("wrap", "LlamaDecoderLayer (llama-cookbook's fixed wrapping policy)")
    m.mapped("world_size", "torchrun --nnodes / --nproc_per_node")
    m.mapped("state_dict_type", "--checkpoint_type")
    m.unsupported("optimizer_impl", f"llama-cookbook builds optim.AdamW itself with torch's default (foreach on "
                  f"CUDA); the {t.optimizer_impl} AdamW traced needs an edit of its train script")
    if t.cpu_offload and t.grad_accum_steps > 1:
        m.warn("llama-cookbook wraps with FSDP1, which gives wrong gradients with CPU offload when accumulating "
               "outside no_sync(); prefer the fsdp2 export or accumulation 1")
    if t.model_type != "llama":
        m.warn(f"llama-cookbook's finetuning script supports llama and mllama models only, not {t.model_type!r}")
    flags = [
        ("enable_fsdp", True),
        ("batch_size_training", t.micro_batch_size),
        ("gradient_accumulation_steps", t.grad_accum_steps),
        ("context_length", t.seq_len),
        ("batching_strategy", "packing"),
        ("mixed_precision", t.precision != "fp32"),
        ("use_fp16", t.precision == "fp16"),
        ("pure_bf16", False),
        ("fsdp_activation_checkpointing", t.ac_every is not None),
        ("fsdp_cpu_offload", t.cpu_offload),
        ("checkpoint_type", f"StateDictType.{t.state_dict_enum}"),
        ("save_optimizer", True),
    ]
    launch = f"torchrun --nnodes {t.nodes} --nproc_per_node {t.gpus_per_node} -m llama_cookbook.finetuning"
    lines = [launch, *(f"    --{key} {shlex.quote(str(value))}" for key, value in flags), '    "$@"']
    body = ("# Use: ./llama_cookbook.sh --model_name <Hugging Face model path> [--dataset ... other flags]\n"
            "set -euo pipefail\n" + " \\\n".join(lines) + "\n")
    return build_export(fmt="llama-cookbook", filename="llama_cookbook.sh", target=TARGET, tuned=t, mapper=m,
                        prologue="#!/usr/bin/env bash\n", body=body)
