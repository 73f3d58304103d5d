"""torchtitan 0.3: a launch script naming the registry config whose model has the tuned shapes,
with command-line overrides (parsed by tyro through torchtitan.config.manager.ConfigManager) for
every tuned knob.

torchtitan 0.3 has no TOML job file: `python -m torchtitan.train --module llama3 --config llama3_8b`
picks a function in torchtitan/models/<module>/config_registry.py. torchtitan trains its own model
implementation, so the export is only written for a model torchtitan has with the same shapes;
otherwise it is refused (never a debug model in its place).
"""

from __future__ import annotations

import shlex

from autotune.distributed.titan import titan_ac

from autotune.problem.config import stack_step
from autotune.results.export._base import (Export, ExportRefused, Mapper, Tuned, build_export, map_own_attention,
                                           nodes_note, torchrun_launch)

TARGET = "torchtitan 0.3.0 (python -m torchtitan.train --module M --config C, tyro overrides)"

# torchtitan's own defaults (CheckpointManager.Config; the llama3 registry configs set interval 500
# but leave enable off), written out so they show and can be changed: a later flag in "$@" wins.
CHECKPOINT_INTERVAL = 500
CHECKPOINT_FOLDER = "checkpoint"

# (module, registry config) -> the transformers model types it stands for and the config shapes of its
# model, read from torchtitan 0.3.0's models/llama3/__init__.py and models/qwen3/__init__.py (dim,
# n_layers, n_heads, n_kv_heads, vocab_size, FFN hidden dim; for MoE models moe_hidden_dim, num_experts,
# top_k). tests/test_export.py builds each named model with torchtitan itself and compares.
_DENSE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
          "intermediate_size")
_REGISTRY = {
    ("llama3", "llama3_8b"): (("llama",), dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                               num_key_value_heads=8, vocab_size=128256, intermediate_size=14336)),
    ("llama3", "llama3_70b"): (("llama",), dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                                                num_key_value_heads=8, vocab_size=128256, intermediate_size=28672)),
    ("llama3", "llama3_405b"): (("llama",), dict(hidden_size=16384, num_hidden_layers=126, num_attention_heads=128,
                                                 num_key_value_heads=8, vocab_size=128256, intermediate_size=53248)),
    ("qwen3", "qwen3_32b"): (("qwen3",), dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                                              num_key_value_heads=8, vocab_size=151936, intermediate_size=25600)),
    # Every layer MoE (transformers' intermediate_size, a dense MLP's, is unused there: not compared).
    ("qwen3", "qwen3_30b_a3b"): (("qwen3_moe",), dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                                                      num_key_value_heads=4, vocab_size=151936,
                                                      moe_intermediate_size=768, num_experts=128,
                                                      num_experts_per_tok=8)),
}


def registry_config(t: Tuned) -> tuple[str, str]:
    """(module, config) of the torchtitan model with the tuned model's shapes, or ExportRefused."""
    config = dict(t.model_config)
    config.setdefault("num_key_value_heads", config.get("num_attention_heads"))
    for (module, name), (model_types, theirs) in _REGISTRY.items():
        if t.model_type in model_types and all(config.get(key) == value for key, value in theirs.items()):
            return module, name
    raise ExportRefused(
        f"torchtitan 0.3 has no model with the shapes of {t.model_name} ({t.model_type}, hidden "
        f"{config.get('hidden_size')}, {config.get('num_hidden_layers')} layers): it trains its own implementations "
        f"({', '.join(c for _, c in _REGISTRY)}); use the fsdp2 export for this model")


FLOAT8_MODULE = "autotune_float8"
"""The config-registry module a float8 export writes next to its script: torchtitan 0.3 sets float8 in
a registry function (`model_registry(..., converters=[Float8LinearConverter.Config(...)])`), not on the
command line, and its ConfigManager imports a registry module named by `--module`."""


def float8_registry(module: str, config: str, t: Tuned) -> str:
    """The registry module: torchtitan's own `config` with torchao's float8 linears, rowwise (the only
    recipes torchtitan 0.3's converter has), lm_head left high precision as its llama3_405b config does."""
    return f'''"""{config} with float8 linears (torchtitan 0.3's Float8LinearConverter), written by autotune."""
from torchtitan.components.quantization import Float8LinearConverter
from torchtitan.models.{module} import model_registry
from torchtitan.models.{module}.config_registry import {config} as _tuned_base


def {config}_float8():
    config = _tuned_base()
    config.model_spec = model_registry(config.model_spec.flavor, converters=[
        Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns=["lm_head"],
                                     model_compile_enabled={t.compile != "none"}),
    ])
    return config
'''


def export_torchtitan(t: Tuned) -> Export:
    module, config = registry_config(t)
    m = Mapper()
    registry = None
    if t.float8 != "none":
        registry = float8_registry(module, config, t)
        module, config = FLOAT8_MODULE, f"{config}_float8"
        key = (f"--module {module} --config {config} ({module}.py, written by the script: Float8LinearConverter, "
               "recipe rowwise, lm_head filtered)")
        if t.float8 == "rowwise":
            m.mapped("float8", key, "torchao's rowwise recipe; needs torchao and a GPU with float8 (SM89+)")
        else:
            m.approximated("float8", key,
                           "torchtitan 0.3's float8 converter has rowwise recipes only (no tensorwise, no float8 "
                           "all-gather): rowwise written, with bf16 all-gathers; torchao's published Llama3-8B runs "
                           "were 1.25x (tensorwise) and 1.10x (rowwise) over bf16, so expect less than tuned")
    if t.precision == "fp16":
        param = "bfloat16"
        m.approximated("precision", "--training.mixed-precision-param bfloat16",
                       "torchtitan has no float16 parameters (bfloat16 or float32): bfloat16 written, same "
                       "memory, different numerics")
    else:
        param = t.param_dtype
        m.mapped("precision", "--training.mixed-precision-param")
    m.mapped("reduce_dtype", "--training.mixed-precision-reduce float32")
    # The subcommand --stack torchtitan traces too (titan.titan_ac): 0.3's SelectiveAC is the op-level policy.
    ac = f"activation-checkpoint:{titan_ac(t.checkpointing)}"
    if t.op_level_ac:
        if t.checkpointing.policy == "alt-mm":
            m.mapped("activation_checkpointing", ac, "torchtitan's op SAC: every other matmul output saved, as tuned")
        else:
            m.approximated("activation_checkpointing", ac,
                           f"torchtitan's op SAC saves every other matmul output; {t.activation_checkpointing} "
                           "(every matmul) was tuned: less memory, more recompute than tuned")
    elif t.ac_every is None or t.ac_every == 1:
        m.mapped("activation_checkpointing", ac)
    else:
        m.approximated("activation_checkpointing", ac,
                       f"torchtitan 0.3 has no every-K-blocks checkpointing (its selective mode is per-op): all "
                       f"{t.num_layers} blocks are checkpointed instead of {t.checkpointed_blocks} (less memory, "
                       "more recompute than tuned)")
    replicate, shard = t.hsdp_degrees
    m.mapped("shard_group_size", f"--parallelism.data-parallel-replicate-degree {replicate} "
                                 f"--parallelism.data-parallel-shard-degree {shard}")
    if t.shard_placement == "dim0":
        m.mapped("shard_placement", "torchtitan's default: every parameter on dimension 0")
    else:
        m.approximated("shard_placement", "torchtitan's own placement (distributed/fsdp.py)",
                       "torchtitan 0.3 puts the experts of its own MoE blocks on Shard(1) when the FSDP degree "
                       "exceeds the number of experts, every other parameter on dimension 0; the tuned placement "
                       "also moved other parameters smaller than the shard group")
    if t.expert_parallel > 1:
        m.mapped("expert_parallel", f"--parallelism.expert-parallel-degree {t.expert_parallel}",
                 "torchtitan 0.3 borrows the expert-parallel degree from the data-parallel shard degree, as tuned: "
                 f"each GPU holds 1/{t.expert_parallel} of the experts, FSDP shards them over the other "
                 f"{t.gpus // t.expert_parallel} GPUs holding the same ones; with --training.disable-cuda-graphs, "
                 "which torchtitan requires of its all-to-all dispatcher (split sizes read back to the host)")
    else:
        m.mapped("expert_parallel", "--parallelism.expert-parallel-degree 1 (torchtitan's default: none)")
    if t.tensor_parallel > 1:
        m.approximated("tensor_parallel", f"--parallelism.tensor-parallel-degree {t.tensor_parallel}",
                       "torchtitan applies its own Llama plan (colwise q/k/v and w1/w3, rowwise wo and w2, sequence "
                       "parallelism on the norms), as traced, and also splits the embeddings by vocabulary, which "
                       "autotune keeps whole on each GPU"
                       + ("" if t.loss_parallel else ", and the output layer with a loss-parallel cross-entropy")
                       + ": it needs less memory than predicted")
    else:
        m.mapped("tensor_parallel", "--parallelism.tensor-parallel-degree 1 (none)")
    if t.loss_parallel:
        m.mapped("loss_parallel", "torchtitan's own (its vocabulary-parallel cross-entropy under TP, always on)",
                 "torchtitan 0.3 splits the output layer by vocabulary and computes the loss on each GPU's share "
                 "whenever it tensor-parallelizes, as tuned")
    elif t.tensor_parallel > 1:
        m.approximated("loss_parallel", "torchtitan's own (its vocabulary-parallel cross-entropy under TP, always on)",
                       "tuned with the head whole on each GPU; torchtitan 0.3 always splits it under TP: less memory "
                       "than predicted")
    else:
        m.mapped("loss_parallel", "no tensor parallelism, no loss parallelism")
    if t.async_tensor_parallel:
        m.mapped("async_tensor_parallel", "--compile.enable-async-tensor-parallel",
                 "torchtitan 0.3's _maybe_enable_async_tp: inductor's micro-pipeline pass on the compiled blocks, as "
                 "tuned (its CompileConfig requires --compile.enable with the model among the components: set here)")
    else:
        m.mapped("async_tensor_parallel", "async tensor parallelism off (torchtitan's default)")
    if t.context_parallel > 1:
        m.approximated("context_parallel", f"--parallelism.context-parallel-degree {t.context_parallel}",
                       "torchtitan's context parallelism: torch's ring attention through SDPA with the head-tail load "
                       "balancer, as traced; FSDP shards over the flattened dp_shard x cp mesh, as traced")
    else:
        m.mapped("context_parallel", "--parallelism.context-parallel-degree 1 (none)")
    if t.pipeline_parallel > 1:
        m.mapped("pipeline_parallel", f"--parallelism.pipeline-parallel-degree {t.pipeline_parallel} "
                                      f"--parallelism.pipeline-parallel-microbatch-size {t.micro_batch_size}",
                 f"torchtitan splits its own model into {t.pipeline_parallel} ranks' stages with its own layer split "
                 "(embeddings and output counted as layers), and runs local-batch / microbatch-size = "
                 f"{t.grad_accum_steps} micro-batches per step through the schedule, as tuned; with "
                 "--training.disable-cuda-graphs, which torchtitan requires of pipeline parallelism")
        m.mapped("pipeline_schedule", f"--parallelism.pipeline-parallel-schedule {t.pipeline_schedule}")
    else:
        m.mapped("pipeline_parallel", "--parallelism.pipeline-parallel-degree 1 (none)")
        m.mapped("pipeline_schedule", "no pipeline, no schedule")
    m.mapped("cpu_offload", "--training.enable-cpu-offload / --training.no-enable-cpu-offload")
    m.mapped("reshard_after_forward", "--parallelism.fsdp-reshard-after-forward always|never")
    m.mapped("micro_batch_size", "--training.local-batch-size")
    m.mapped("grad_accum_steps", "--training.global-batch-size (accumulation = global / (local x data-parallel))")
    m.approximated("wrap", f"torchtitan's {module} blocks",
                   f"torchtitan shards the blocks of its own {module} implementation, with the shapes of "
                   f"{t.wrap}; its numerics (RoPE scaling, init) are torchtitan's")
    m.mapped("world_size", "--parallelism.data-parallel-shard-degree x replicate degree; torchrun --nnodes/--nproc_per_node")
    # Off in torchtitan 0.3's llama3 configs: without --checkpoint.enable the job saves nothing.
    saving = (f"--checkpoint.enable (DCP, sharded: torchtitan's form) every --checkpoint.interval "
              f"{CHECKPOINT_INTERVAL} steps into <dump folder>/--checkpoint.folder {CHECKPOINT_FOLDER}")
    if t.state_dict_type == "sharded":
        m.mapped("state_dict_type", saving)
    else:
        m.approximated("state_dict_type", saving,
                       "torchtitan saves sharded DCP checkpoints (the last one model-only, its "
                       "last_save_model_only default); add --checkpoint.last-save-in-hf for the final one as Hugging "
                       "Face safetensors, or consolidate it, for the full state dict recommended")
    m.mapped("optimizer_impl", f"--optimizer.implementation {t.optimizer_impl}")
    map_own_attention(m, t, "torchtitan")
    if t.compile != "none":
        m.mapped("compile", "--compile.enable --compile.components model",
                 "torchtitan's apply_compile: each TransformerBlock compiled (fullgraph, inductor) after "
                 "checkpointing and before FSDP, the loss eager, as tuned")
    else:
        m.mapped("compile", "--compile.no-enable (some registry configs, e.g. llama3_405b, enable it)")
    if stack_step(t.stack, t.precision, t.model_type) != "torchtitan":
        m.warn("torchtitan's loss is chunked cross-entropy (ChunkedLossWrapper): its logits peak is smaller than "
               "the HF loss autotune traced, so the run has more headroom than predicted, not less; "
               "tune with --stack torchtitan (torchtitan importable) to predict its own step")
    overrides = [
        ("--module", module), ("--config", config),
        # Under a pipeline, torchtitan's local batch is what the schedule splits into micro-batches of
        # --parallelism.pipeline-parallel-microbatch-size: the tuned micro-batch x the accumulation steps.
        ("--training.local-batch-size", t.micro_batch_size * (t.grad_accum_steps if t.pipeline_parallel > 1 else 1)),
        ("--training.global-batch-size", t.global_batch_size),
        ("--training.seq-len", t.seq_len),
        ("--training.mixed-precision-param", param),
        ("--training.mixed-precision-reduce", "float32"),
        ("--training.enable-cpu-offload" if t.cpu_offload else "--training.no-enable-cpu-offload", None),
        ("--parallelism.data-parallel-replicate-degree", replicate),
        ("--parallelism.data-parallel-shard-degree", shard),
        ("--parallelism.fsdp-reshard-after-forward", "always" if t.reshard_after_forward else "never"),
        ("--parallelism.expert-parallel-degree", t.expert_parallel),
        ("--parallelism.tensor-parallel-degree", t.tensor_parallel),
        ("--parallelism.context-parallel-degree", t.context_parallel),
        *((("--parallelism.pipeline-parallel-degree", t.pipeline_parallel),
           ("--parallelism.pipeline-parallel-schedule", t.pipeline_schedule),
           ("--parallelism.pipeline-parallel-microbatch-size", t.micro_batch_size)) if t.pipeline_parallel > 1 else ()),
        # Its all-to-all token dispatcher reads the split sizes back to the host, as autotune's does, and its
        # pipeline schedules are not captured: torchtitan 0.3 refuses either under CUDA graphs (its ConfigManager
        # says so), so they are off.
        *((("--training.disable-cuda-graphs", None),) if t.expert_parallel > 1 or t.pipeline_parallel > 1 else ()),
        ("--optimizer.implementation", t.optimizer_impl),
        *((("--compile.enable", None), ("--compile.components", "model")) if t.compile != "none"
          else (("--compile.no-enable", None),)),
        *((("--compile.enable-async-tensor-parallel", None),) if t.async_tensor_parallel else ()),
        ("--checkpoint.enable", None),
        ("--checkpoint.interval", CHECKPOINT_INTERVAL),
        ("--checkpoint.folder", CHECKPOINT_FOLDER),
    ]
    lines = [f"{torchrun_launch(t)} -m torchtitan.train"]
    lines += [f"    {flag}" + ("" if value is None else f" {shlex.quote(str(value))}") for flag, value in overrides]
    # Overrides before the checkpointing subcommand: tyro applies what follows it to the subcommand
    # and refuses top-level options there.
    lines += ['    "$@"', f"    {ac}"]
    body = ("# Use: ./torchtitan.sh [more torchtitan overrides]; set --hf-assets-path to the model's tokenizer\n"
            "# (e.g. --checkpoint.interval 1000 --checkpoint.folder ckpt: they come after the values below, and the\n"
            "# last value given wins).\n"
            f"{nodes_note(t, ranks=False)}"
            f"# (global batch {t.global_batch_size} sequences = {t.micro_batch_size} x {t.data_ranks_text} x "
            f"{t.grad_accum_steps} accumulation steps).\n"
            "set -euo pipefail\n"
            + (f"# float8: torchtitan 0.3 sets it in a config-registry function; this one is written next to the script.\n"
               f"cat > \"$(dirname \"$0\")/{FLOAT8_MODULE}.py\" <<'PY'\n{registry}PY\n"
               f"export PYTHONPATH=\"$(cd \"$(dirname \"$0\")\" && pwd)${{PYTHONPATH:+:$PYTHONPATH}}\"\n" if registry else "")
            + " \\\n".join(lines) + "\n")
    return build_export(fmt="torchtitan", filename="torchtitan.sh", target=TARGET, tuned=t, mapper=m,
                        expresses=("op_level_ac", "hsdp"),
                        prologue="#!/usr/bin/env bash\n", body=body)


def overrides_of(text: str) -> list[str]:
    """The torchtitan.train arguments of an exported script (for tests and tools)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "torchtitan.train" in line)  # after a float8 registry
    command = " ".join(line.rstrip("\\").strip() for line in lines[start:]
                       if line.strip() and not line.lstrip().startswith(("#", "set ")))
    words = shlex.split(command)
    return [w for w in words[words.index("torchtitan.train") + 1:] if w != "$@"]
