"""LitGPT 0.5: a config YAML for `litgpt pretrain` and `litgpt finetune_full`, or for a LoRA tune
`litgpt finetune_lora` (jsonargparse reads it with --config; the model comes on the command line).

LitGPT's YAML carries precision, devices, num_nodes and train.{global,micro}_batch_size (it derives
the accumulation from them); its scripts build Lightning Fabric's FSDPStrategy (FSDP1) themselves,
with settings no config key reaches. Read from litgpt 0.5.13's setup() functions:
  pretrain.py:       FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full",
                                  sharding_strategy="HYBRID_SHARD"); AdamW fused=True on CUDA
  finetune/full.py:  FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block},
                                  state_dict_type="full", limit_all_gathers=True, cpu_offload=False)
  finetune/lora.py:  FSDP2 through Fabric's ModelParallelStrategy(parallelize_fn, data_parallel_size=
                     devices x num_nodes): checkpoint_wrapper on every Block (parallelize_fn's
                     activation_checkpointing=True), fully_shard (reshard after forward) on every
                     trainable Linear, every Block and the model; no offload, no MixedPrecisionPolicy
                     (Fabric's precision: bf16-true creates the whole model, adapters too, in bf16)
All use "auto" (no FSDP) on a single device. Where the commands differ from what was tuned in
different ways, the mapping says so for each.
"""

from __future__ import annotations

from typing import Any

import yaml

from autotune.results.export._base import Export, Mapper, Tuned, build_export, fabric_nodes_note, map_own_attention
from autotune.results.export._fsdp1 import optimizer_kwargs

VERSION = "0.5.13"
TARGET = (f"LitGPT {VERSION} (litgpt pretrain / finetune_full --config; Lightning Fabric FSDPStrategy, "
          "FSDP1 underneath)")
TARGET_LORA = f"LitGPT {VERSION} (litgpt finetune_lora --config; Lightning Fabric ModelParallelStrategy, FSDP2)"
FILENAME = "litgpt.yaml"


def _precision(m: Mapper, t: Tuned) -> str:
    """LitGPT's precision string: "bf16-mixed" keeps fp32 master weights as tuned ("bf16-true" would
    create the model in bf16: pure bf16 weights and AdamW state)."""
    if t.precision == "fp32":
        m.mapped("precision", "precision: 32-true")
        m.mapped("reduce_dtype", "precision: 32-true (fp32 throughout)")
        return "32-true"
    if t.precision == "bf16-pure":
        m.mapped("precision", "precision: bf16-true (the model created in bf16: pure bf16, as tuned)")
        m.mapped("reduce_dtype", "precision: bf16-true (gradients reduced in bfloat16, as tuned)")
        return "bf16-true"
    m.approximated("precision", "precision: bf16-mixed",
                   ("LitGPT takes bf16-true, bf16-mixed or 32-true only: fp16 was tuned, bf16 written (same "
                    "memory, different numerics); " if t.precision == "fp16" else "")
                   + "Fabric's FSDPPrecision('bf16-mixed') keeps fp32 master weights, casts buffers (RoPE's cache) "
                   "to bf16 and runs the forward under torch.autocast (ops autocast keeps in fp32 change the "
                   "activation memory from what was traced); 'bf16-true' would be pure bf16 (about half the "
                   "parameter and optimizer memory, no fp32 masters)")
    if t.reduce_dtype == "bfloat16":  # tuned so (--stack litgpt traces LitGPT's step: config.reduce_dtype_name)
        m.mapped("reduce_dtype", "precision: bf16-mixed (gradients reduced in bfloat16, as tuned)")
    else:
        m.approximated("reduce_dtype", "precision: bf16-mixed",
                       "FSDPPrecision('bf16-mixed') reduces gradients in bfloat16, not float32 as tuned; LitGPT's "
                       "scripts build the strategy themselves, so no config key passes a MixedPrecision")
    return "bf16-mixed"


def _map_hard_coded(m: Mapper, t: Tuned) -> None:
    """The knobs LitGPT's scripts fix in their FSDPStrategy(...) call, per command."""
    every = t.ac_every
    if every is None:
        m.approximated("activation_checkpointing", "hard-coded: pretrain none, finetune_full every Block",
                       "no checkpointing was tuned: pretrain matches; finetune_full checkpoints every block "
                       "(activation_checkpointing_policy={Block}: less memory, more recompute than tuned)")
    elif every == 1 and not t.op_level_ac:
        m.approximated("activation_checkpointing", "hard-coded: pretrain none, finetune_full every Block",
                       f"every block checkpointed was tuned: finetune_full matches; pretrain checkpoints nothing "
                       f"(more activation memory than tuned: it may run out of memory at micro-batch "
                       f"{t.micro_batch_size})")
    else:
        m.approximated("activation_checkpointing", "hard-coded: pretrain none, finetune_full every Block",
                       f"{t.activation_checkpointing} was tuned: finetune_full checkpoints every block whole (less "
                       "memory, more recompute); pretrain checkpoints nothing (more activation memory than tuned: "
                       f"it may run out of memory at micro-batch {t.micro_batch_size})")
    if t.cpu_offload:
        m.unsupported("cpu_offload", "LitGPT's scripts never offload (finetune_full hard-codes cpu_offload=False, "
                                     "pretrain leaves FSDPStrategy's default): parameters, gradients and optimizer "
                                     "state stay on the GPU, more memory than tuned; edit setup() to offload")
    else:
        m.mapped("cpu_offload", "hard-coded off in both scripts, as tuned")
    if t.reshard_after_forward:
        m.mapped("reshard_after_forward", "hard-coded: FULL_SHARD (finetune_full) / HYBRID_SHARD (pretrain) both "
                                          "reshard after forward, as tuned")
    else:
        m.approximated("reshard_after_forward", "hard-coded: FULL_SHARD / HYBRID_SHARD",
                       "both scripts reshard after forward (no SHARD_GRAD_OP): less memory, an extra all-gather "
                       "per block in backward (slower than tuned)")
    replicate, shard = t.hsdp_degrees
    plain, per_node = "finetune_full's FULL_SHARD shards over every GPU", \
        "pretrain's HYBRID_SHARD shards within each node and replicates across nodes"
    if not t.shard_group_size and t.nodes == 1:
        m.mapped("shard_group_size", f"hard-coded: {plain}; {per_node} (one node here: the same), as tuned")
    elif not t.shard_group_size:
        m.approximated("shard_group_size", "hard-coded: FULL_SHARD (finetune_full) / HYBRID_SHARD (pretrain)",
                       f"sharding over every GPU was tuned: finetune_full matches; {per_node} (groups of "
                       f"{t.gpus_per_node}: more memory per GPU, less inter-node traffic than tuned)")
    elif shard == t.gpus_per_node:
        m.approximated("shard_group_size", "hard-coded: HYBRID_SHARD (pretrain) / FULL_SHARD (finetune_full)",
                       f"HSDP {replicate} x {shard} (groups of one node) was tuned: pretrain matches; {plain} "
                       "(less memory per GPU, more inter-node traffic than tuned)")
    else:
        m.unsupported("shard_group_size", f"HSDP {replicate} x {shard} was tuned: {plain}, {per_node}; neither "
                                          f"shards within groups of {shard} (edit setup()'s FSDPStrategy)")
    if t.state_dict_type == "full":
        m.mapped("state_dict_type", "hard-coded: FSDPStrategy(state_dict_type='full') in both scripts, as recommended")
    else:
        m.approximated("state_dict_type", "hard-coded: FSDPStrategy(state_dict_type='full')",
                       f"the sharded form is recommended ({t.state_dict_reason}); LitGPT's scripts save a full "
                       "state dict, gathered for rank 0 at every save (save_interval): that memory is not in the "
                       "prediction, and it is what autotune advises against for this run")


def _map_optimizer(m: Mapper, t: Tuned) -> dict[str, Any]:
    """AdamW with the traced implementation's switch (pretrain adds fused=True on CUDA itself)."""
    kwargs = optimizer_kwargs(t.optimizer_impl)
    key = f"optimizer: torch.optim.AdamW, init_args {kwargs}"
    if t.optimizer_impl == "fused":
        m.mapped("optimizer_impl", key)
    else:
        m.approximated("optimizer_impl", key,
                       f"finetune_full builds the {t.optimizer_impl} AdamW written; pretrain passes fused=True "
                       "on CUDA whatever the config says (a different optimizer-step peak than traced)")
    return {"class_path": "torch.optim.AdamW", "init_args": kwargs}


# LitGPT's LoRA switches and the transformers module names each covers (Llama-style names: LitGPT
# fuses q, k and v into one `attn` Linear with a switch per part, and its MLP switch covers every
# MLP projection).
QLORA_QUANTIZE = "bnb.nf4-dq"
"""finetune_lora's --quantize for QLoRA's layout: bitsandbytes NF4 with double quantization."""

LORA_SWITCHES = {"lora_query": ("q_proj",), "lora_key": ("k_proj",), "lora_value": ("v_proj",),
                 "lora_projection": ("o_proj",), "lora_mlp": ("gate_proj", "up_proj", "down_proj"),
                 "lora_head": ("lm_head",)}


def _lora_config(m: Mapper, t: Tuned) -> dict[str, Any]:
    """finetune_lora's LoRA keys for the adapters that were traced (peft's LoraConfig)."""
    f = t.finetuning
    targets = str(f.get("targets", "all-linear"))
    if targets == "all-linear":  # peft: every Linear but the output head
        switches = {key: key != "lora_head" for key in LORA_SWITCHES}
    else:
        names = set(targets.split(","))
        switches = {key: bool(names & set(covers)) for key, covers in LORA_SWITCHES.items()}
        partial = [key for key, covers in LORA_SWITCHES.items() if names & set(covers) and not set(covers) <= names]
        unknown = sorted(names - {n for covers in LORA_SWITCHES.values() for n in covers})
        if partial or unknown:
            m.warn(f"LoRA targets {targets} were tuned: LitGPT switches adapters per part ("
                   + ", ".join(f"{k} covers {'/'.join(LORA_SWITCHES[k])}" for k in partial)
                   + (f"; no switch for {', '.join(unknown)}" if unknown else "")
                   + "): the adapters written differ from those traced")
    alpha = float(f["alpha"])
    if not alpha.is_integer():
        m.warn(f"lora_alpha {alpha:g} was tuned: LitGPT takes an integer, {round(alpha)} written")
    return {"lora_r": int(f["rank"]), "lora_alpha": round(alpha), "lora_dropout": float(f["dropout"]), **switches}


def _map_lora_command(m: Mapper, t: Tuned) -> str:
    """finetune_lora's hard-coded FSDP2 setup against what was tuned; returns its precision string."""
    if t.precision == "fp32":
        m.mapped("precision", "precision: 32-true")
        m.mapped("reduce_dtype", "precision: 32-true (fp32 throughout)")
        precision = "32-true"
    elif t.precision == "bf16-pure":
        m.mapped("precision", "precision: bf16-true (everything in bf16, as tuned)")
        m.mapped("reduce_dtype", "precision: bf16-true (gradients reduced in bfloat16, as tuned)")
        precision = "bf16-true"
    else:
        m.approximated("precision", "precision: bf16-true",
                       "the frozen base in bf16 as tuned, but LitGPT creates the adapters in bf16 too (their AdamW "
                       "state in bf16: a little less memory than predicted, pure-bf16 numerics for the adapters); "
                       "bf16-mixed would keep the frozen base in fp32 (twice its memory)")
        m.approximated("reduce_dtype", "precision: bf16-true", "adapter gradients reduced in bfloat16, not float32")
        precision = "bf16-true"
    if t.ac_every == 1 and not t.op_level_ac:
        m.mapped("activation_checkpointing", "hard-coded: parallelize_fn wraps every Block in checkpoint_wrapper, "
                                             "as tuned")
    else:
        m.approximated("activation_checkpointing", "hard-coded: checkpoint_wrapper on every Block",
                       f"{t.activation_checkpointing} was tuned: finetune_lora checkpoints every block whole (less "
                       "memory, more recompute; edit parallelize_fn to change it)")
    if t.cpu_offload:
        m.unsupported("cpu_offload", "finetune_lora never offloads (fully_shard without an offload policy): "
                                     "more GPU memory than tuned")
    else:
        m.mapped("cpu_offload", "hard-coded off, as tuned")
    if t.reshard_after_forward:
        m.mapped("reshard_after_forward", "hard-coded: fully_shard's default reshard_after_forward=True, as tuned")
    else:
        m.approximated("reshard_after_forward", "hard-coded: fully_shard's default (reshard after forward)",
                       "less memory, an extra all-gather per block in backward (slower than tuned)")
    if t.shard_group_size:
        m.unsupported("shard_group_size", "ModelParallelStrategy shards over every GPU "
                                          "(data_parallel_size = devices x num_nodes): no HSDP groups")
    else:
        m.mapped("shard_group_size", "hard-coded: ModelParallelStrategy(data_parallel_size=devices x num_nodes), "
                                     "sharding over every GPU as tuned")
    m.mapped("state_dict_type", "hard-coded: save_lora_checkpoint gathers the adapters only (full_tensor to rank 0: "
                                "megabytes, not the model)")
    return precision


def export_litgpt(t: Tuned) -> Export:
    """pretrain / finetune_full, or finetune_lora for a LoRA tune: the same keys for what they share."""
    m = Mapper()
    lora = t.finetuning.get("peft") in ("lora", "qlora")
    qlora = t.finetuning.get("peft") == "qlora"
    if lora:
        precision = _map_lora_command(m, t)
        extra = _lora_config(m, t)
        if qlora and t.gpus == 1:
            extra["quantize"] = QLORA_QUANTIZE  # bitsandbytes NF4 with double quantization, as traced
        elif qlora:
            m.warn(f"tuned as QLoRA on {t.gpus} GPUs: LitGPT's finetune_lora refuses --quantize on more than one "
                   "device (NotImplementedError in setup), so this file trains LoRA on a bf16 base (2 bytes a base "
                   f"weight instead of about 0.53: more memory than tuned); on one GPU it takes quantize: {QLORA_QUANTIZE}")
        wrap, sharded = "hard-coded: fully_shard on every Block and every trainable Linear", \
            ", and shards each adapter Linear as its own group"
        usage = f"# Use: litgpt finetune_lora <checkpoint_dir> --config {FILENAME} [--data ...]\n"
    else:
        precision = _precision(m, t)
        _map_hard_coded(m, t)
        extra, wrap, sharded = {}, "hard-coded: auto_wrap_policy={Block} (litgpt.model.Block)", ""
        usage = (f"# Use: litgpt finetune_full <checkpoint_dir> --config {FILENAME} [--data ...]\n"
                 f"#  or: litgpt pretrain <model_name> --config {FILENAME} [--data ... --tokenizer_dir ...]\n")
    m.mapped("micro_batch_size", "train.micro_batch_size")
    m.mapped("grad_accum_steps", "train.global_batch_size (LitGPT derives accumulation = global / (devices x "
                                 "num_nodes) / micro)")
    m.approximated("wrap", wrap, f"LitGPT trains its own GPT implementation and wraps its Block, not transformers' "
                                 f"{t.wrap}{sharded}: same shapes for a model LitGPT has, its numerics and kernels "
                                 "are LitGPT's")
    m.mapped("world_size", "devices / num_nodes")
    optimizer = _map_optimizer(m, t)
    map_own_attention(m, t, "LitGPT")
    if t.gpus == 1:
        m.warn("one GPU: LitGPT's scripts use the 'auto' strategy on a single device, no FSDP at all")
    config = {
        "precision": precision,
        "devices": t.gpus_per_node,
        "num_nodes": t.nodes,
        **extra,
        "train": {
            "global_batch_size": t.global_batch_size,
            "micro_batch_size": t.micro_batch_size,
            "max_seq_length": t.seq_len,
        },
        "optimizer": optimizer,
    }
    multi = f"# {fabric_nodes_note(t)}" if t.nodes > 1 else ""
    body = (f"{usage}{multi}"
            f"# Global batch {t.global_batch_size} sequences = {t.micro_batch_size} x {t.gpus} GPUs x "
            f"{t.grad_accum_steps} accumulation steps; each command keeps its own defaults for the other keys.\n"
            + yaml.safe_dump(config, sort_keys=False, default_flow_style=False))
    return build_export(fmt="litgpt", filename=FILENAME, target=TARGET_LORA if lora else TARGET, tuned=t, mapper=m,
                        body=body, expresses=("bf16_pure", "lora", *(("qlora",) if qlora and t.gpus == 1 else ()))
                        if lora else ("bf16_pure",))
