"""llama-cookbook (formerly llama-recipes): the finetuning command with its train_config and
fsdp_config flags (src/llama_cookbook/configs/{training,fsdp}.py; fire parses the flags).

Read from the llama-cookbook 0.0.5.post1 wheel: finetuning.py loads the model with
torch_dtype=bfloat16 (float16 with use_fp16) whatever the precision flags say, and
utils/train_utils.py imports `is_ccl_available` from accelerate, which accelerate 1.13 removed."""

from __future__ import annotations

import shlex

from autotune.results.export._base import (Export, Mapper, Tuned, build_export, nodes_note, sdpa_instead,
                                           torchrun_launch)

TARGET = "llama-cookbook 0.0.5.post1 (python -m llama_cookbook.finetuning; train_config / fsdp_config flags, FSDP1)"

# The import llama-cookbook 0.0.5.post1 fails on with accelerate >= 1.13 (utils/train_utils.py, line 26).
ACCELERATE_IMPORT = "from accelerate.utils import is_xpu_available, is_ccl_available"
ACCELERATE_PIN = "accelerate<1.13"


def _precision(t: Tuned) -> tuple[str, dict[str, bool]]:
    """What llama-cookbook really trains in, and the flags that say so: it loads the weights in
    bf16 (fp16 with use_fp16) whatever the flags, so there is no fp32 master copy to mix with."""
    if t.precision == "fp16":
        return "float16", {"mixed_precision": True, "use_fp16": True, "pure_bf16": False}
    return "bfloat16", {"mixed_precision": False, "use_fp16": False, "pure_bf16": True}


def _map_forced_precision(m: Mapper, t: Tuned, dtype: str, flag: str) -> None:
    """Mixed precision tuned, pure 16-bit trained: the cookbook's forced dtype, said as approximated."""
    m.approximated("precision", flag,
                   f"llama-cookbook 0.0.5.post1 loads the model with torch_dtype={dtype} whatever the flags "
                   f"(finetuning.py), so weights, gradients, AdamW state and RoPE's inv_freq are all {dtype}: pure "
                   f"{dtype}, no fp32 master weights ({t.precision} with fp32 masters was tuned): about half the "
                   "parameter, gradient and optimizer memory predicted, and updates rounded to 16 bits; the flag "
                   "written says so (its mixed-precision flags cannot change it)")
    m.approximated("reduce_dtype", flag,
                   f"gradients are {dtype} and reduced in {dtype}, not float32 as tuned (no flag for an fp32 "
                   "reduction)")


def export_cookbook(t: Tuned) -> Export:
    m = Mapper()
    dtype, precision_flags = _precision(t)
    flag = "--use_fp16 True" if t.precision == "fp16" else "--pure_bf16 True"
    if t.precision == "bf16-pure":  # what the cookbook does anyway: exact
        m.mapped("precision", flag, "llama-cookbook loads the model in bfloat16: pure bf16, as tuned")
        m.mapped("reduce_dtype", flag, "gradients reduced in bfloat16, as tuned")
    else:
        _map_forced_precision(m, t, dtype, flag)
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
    m.mapped("world_size", torchrun_launch(t))
    m.mapped("state_dict_type", "--checkpoint_type")
    # finetuning.py loads with attn_implementation="sdpa" if use_fast_kernels else None (transformers'
    # default, also sdpa for llama): no flag reaches eager or flash-attention.
    if t.attention == "sdpa":
        m.mapped("attention", "--use_fast_kernels True (from_pretrained(..., attn_implementation='sdpa'))")
    else:
        m.approximated("attention", "--use_fast_kernels True (attn_implementation='sdpa')",
                       f"llama-cookbook cannot express {t.attention}: finetuning.py loads the model with "
                       f"attn_implementation='sdpa' or transformers' default (also sdpa), so it runs SDPA "
                       f"({sdpa_instead(t)}); edit its from_pretrained call to train with the attention tuned")
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
        ("use_fast_kernels", True),
        *precision_flags.items(),
        ("fsdp_activation_checkpointing", t.ac_every is not None),
        ("fsdp_cpu_offload", t.cpu_offload),
        ("checkpoint_type", f"StateDictType.{t.state_dict_enum}"),
        ("save_optimizer", True),
    ]
    m.warn(f"llama-cookbook 0.0.5.post1 fails at import with accelerate >= 1.13 (it imports is_ccl_available, "
           f"which 1.13 removed): the script stops with the fix (pip install '{ACCELERATE_PIN}') unless that "
           "import works")
    launch = f"{torchrun_launch(t)} -m llama_cookbook.finetuning"
    lines = [launch, *(f"    --{key} {shlex.quote(str(value))}" for key, value in flags), '    "$@"']
    body = ("# Use: ./llama_cookbook.sh --model_name <Hugging Face model path> [--dataset ... other flags]\n"
            f"{nodes_note(t, ranks=False)}"
            f"# Needs: pip install llama-cookbook==0.0.5.post1 '{ACCELERATE_PIN}' torch==<the torch you train with>\n"
            "# (llama-cookbook's install pulls torch forward: pin yours back in the same command).\n"
            "set -euo pipefail\n"
            f"python -c {shlex.quote(ACCELERATE_IMPORT)} 2>/dev/null || {{\n"
            f"    echo \"llama-cookbook 0.0.5.post1 needs accelerate < 1.13 (it imports is_ccl_available): "
            f"pip install '{ACCELERATE_PIN}'\" >&2\n"
            "    exit 1\n"
            "}\n" + " \\\n".join(lines) + "\n")
    return build_export(fmt="llama-cookbook", filename="llama_cookbook.sh", target=TARGET, tuned=t, mapper=m,
                        prologue="#!/usr/bin/env bash\n", body=body, expresses=("bf16_pure",))
