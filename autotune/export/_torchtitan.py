"""torchtitan job TOML, for the releases that configure jobs with TOML (up to v0.2.x; later
main moved to a Python config registry). Keys from torchtitan/config/job_config.py."""

from __future__ import annotations

import json

from autotune.export._base import Export, Mapper, Tuned, build_export

TARGET = "torchtitan v0.2.x (TOML job config, torchtitan/config/job_config.py; train.py --job.config_file)"

# torchtitan ships its own Llama implementation; these catalog shapes are its flavors.
_FLAVORS = {"llama3-8b": ("llama3", "8B"), "llama3-70b": ("llama3", "70B")}


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string is a JSON string for these values


def _table(name: str, entries: dict) -> str:
    lines = [f"[{name}]"]
    for key, value in entries.items():
        if isinstance(value, tuple):  # (value, comment)
            value, comment = value
            lines.append(f"{key} = {_toml_value(value)}  # {comment}")
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def export_torchtitan(t: Tuned) -> Export:
    m = Mapper()
    if t.precision == "fp16":
        param = "bfloat16"
        m.approximated("precision", "training.mixed_precision_param",
                       "torchtitan has no float16 parameters (bfloat16 or float32): bfloat16 written, same "
                       "memory, different numerics")
    else:
        param = t.param_dtype
        m.mapped("precision", "training.mixed_precision_param")
    m.mapped("reduce_dtype", "training.mixed_precision_reduce")
    if t.ac_every is None:
        ac = {"mode": "none"}
        m.mapped("activation_checkpointing", "activation_checkpoint.mode")
    elif t.ac_every == 1:
        ac = {"mode": "full"}
        m.mapped("activation_checkpointing", "activation_checkpoint.mode")
    else:
        ac = {"mode": "selective", "selective_ac_option": str(t.ac_every)}
        theirs = t.num_layers // t.ac_every
        m.approximated("activation_checkpointing", "activation_checkpoint.selective_ac_option",
                       f"torchtitan's layer-selective AC counts blocks from 1 and checkpoints blocks "
                       f"{t.ac_every - 1}, {2 * t.ac_every - 1}, ... ({theirs} of {t.num_layers}); autotune tuned "
                       f"blocks 0, {t.ac_every}, ... ({t.checkpointed_blocks} of {t.num_layers})")
    m.mapped("cpu_offload", "training.enable_cpu_offload")
    m.mapped("reshard_after_forward", "parallelism.fsdp_reshard_after_forward")
    m.mapped("micro_batch_size", "training.local_batch_size")
    m.mapped("grad_accum_steps", "training.global_batch_size (accumulation = global / (local x dp))")
    m.approximated("wrap", "fully_shard per TransformerBlock",
                   f"torchtitan shards the blocks of its own model implementation, not transformers' {t.wrap}")
    m.mapped("world_size", "parallelism.data_parallel_shard_degree")
    if t.state_dict_type == "sharded":
        m.mapped("state_dict_type", "checkpoint (DCP, sharded: torchtitan's only form)")
    else:
        m.approximated("state_dict_type", "checkpoint (DCP, sharded)",
                       "torchtitan always saves sharded DCP checkpoints; a full state dict would fit here "
                       "(checkpoint.last_save_in_hf consolidates the final weights)")
    m.mapped("optimizer_impl", "optimizer.implementation")
    name, flavor = _FLAVORS.get(t.model_name, ("llama3", "debugmodel"))
    if t.model_name not in _FLAVORS:
        m.warn(f"model {t.model_name!r} has no torchtitan flavor known to autotune: set [model] name/flavor "
               "to a torchtitan model with the same shapes (the TOML says llama3/debugmodel)")
    tables = [
        _table("job", {"description": f"autotune run {t.run_id}: {t.model_name}"}),
        _table("model", {"name": name, "flavor": (flavor, f"autotune model {t.model_name}")}),
        _table("training", {
            "local_batch_size": t.micro_batch_size,
            "global_batch_size": (t.global_batch_size, f"{t.micro_batch_size} x {t.gpus} GPUs x "
                                  f"{t.grad_accum_steps} accumulation steps"),
            "seq_len": t.seq_len,
            "mixed_precision_param": param,
            "mixed_precision_reduce": "float32",
            "enable_cpu_offload": t.cpu_offload,
        }),
        _table("parallelism", {
            "data_parallel_replicate_degree": 1,
            "data_parallel_shard_degree": t.gpus,
            "fsdp_reshard_after_forward": "always" if t.reshard_after_forward else "never",
        }),
        _table("optimizer", {"name": "AdamW", "implementation": t.optimizer_impl}),
        _table("activation_checkpoint", ac),
        _table("checkpoint", {"enable": True}),  # torchtitan 0.2's name (0.1 said enable_checkpoint)
    ]
    body = (f"# Use: NGPU={t.gpus_per_node} CONFIG_FILE=torchtitan.toml ./run_train.sh "
            f"(torchrun --nnodes {t.nodes} --nproc_per_node {t.gpus_per_node} -m torchtitan.train "
            "--job.config_file torchtitan.toml)\n\n" + "\n".join(tables))
    return build_export(fmt="torchtitan", filename="torchtitan.toml", target=TARGET, tuned=t, mapper=m,
                        body=body)
