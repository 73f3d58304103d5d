"""PyTorch FSDP2: a runnable training script (torchrun; gloo on CPUs, nccl on GPUs).

The script holds the tuned values and its main loop only: it imports the wrapping
(`autotune.distributed.parallel.parallelize`, which real trials apply and the simulator traces), the training
step (`autotune.distributed.training`) and the sharded loading and saving of Hugging Face checkpoints
(`autotune.results.hf_checkpoint`) from the installed autotune, so there is one source of truth for what
was tuned. The Lightning export still embeds copies of them (`tuned_and_wrapping`, below).
"""

from __future__ import annotations

import inspect
import textwrap

import torch

from autotune.problem import knobs as _knobs
from autotune.problem.catalog import blocks as _blocks
from autotune.distributed import parallel as _parallel
from autotune.distributed.parallel import dims as _dims
from autotune.distributed.parallel import expert as _expert
from autotune.distributed.parallel import tensor as _tensor
from autotune.distributed import training as _training
from autotune.results.export._base import Export, Mapper, Tuned, build_export, map_attention, torchrun_launch

TARGET = f"PyTorch FSDP2 (torch.distributed.fsdp.fully_shard), torch {torch.__version__.split('+')[0]}"

# Copied verbatim into the Lightning export, in dependency order.
_SOURCES = (
    _knobs.Checkpointing, _knobs.shard_dim, _knobs.float8_converts, _knobs.block_plan, _parallel.ParallelDims,
    _dims.tensor_mesh,
    _blocks.Blocks, _blocks.find_decoder_blocks, _blocks._config_depth, _blocks._block_class_name,
    _blocks.fused_experts, _parallel.expert_meshes, _parallel.balanced_splits, _expert._AllToAll,
    _parallel.ExpertDispatch, _parallel.apply_ep, _tensor.model_tp_plan, _tensor._gather_sequence,
    _tensor._with_hidden_states, _tensor._gather_sequence_in_float8, _tensor._float8_input, _tensor._is_norm, _tensor.apply_tp,
    _tensor.enable_async_tp,
    _tensor._colwise_rowwise_plan, _tensor._linear_styles, _tensor._apply_tp_parts,
    _parallel.mixed_precision_policy,
    _parallel.op_sac_policy, _parallel.apply_ac, _parallel.apply_compile, _parallel.float8_linear_config,
    _parallel.apply_float8, _parallel.shard_placement_fn,
    _parallel.apply_fsdp, _parallel.parallelize,
    _training.trainable_parameters, _training.make_optimizer, _training.token_batches,
    _training.OffloadedActivations, _training.padding_free_batch, _training.micro_batch_loss, _training._micro_batch,
    _training.train_step,
)


def copied_sources() -> str:
    """The source of the wrapping and training functions, as the script embeds them."""
    return "\n\n".join(textwrap.dedent(inspect.getsource(obj)).rstrip() for obj in _SOURCES)


def map_parallelize_knobs(m: Mapper, *, precision_also: str = "", tensor_parallel: bool = True) -> None:
    """The knobs autotune's own parallelize() applies, for every export that embeds it (`tensor_parallel`:
    where the script builds ParallelDims' own mesh, which tensor parallelism reads its group from)."""
    if tensor_parallel:
        m.mapped("tensor_parallel", "apply_tp in parallelize() on ParallelDims.of(TUNED, world)'s (dp_shard, tp) mesh "
                                    "(the model's transformers tensor-parallel plan, colwise/rowwise; one batch per "
                                    "tensor-parallel group)")
        m.mapped("async_tensor_parallel", "enable_async_tp in parallelize() after apply_tp (inductor's micro-pipeline "
                                          "pass on the compiled blocks; on CUDA GPUs only)")
        m.mapped("loss_parallel", "apply_tp(loss_parallel=TUNED.loss_parallel) in parallelize() (the head split by "
                                  "vocabulary); train_step runs each micro-batch's loss and backward in torch's "
                                  "loss_parallel")
        m.mapped("context_parallel", "apply_cp in parallelize() on ParallelDims.of(TUNED, world)'s (dp_shard, cp) mesh "
                                     "(torch's ring attention through SDPA; train_step opens it around each "
                                     "micro-batch; one batch per context-parallel group)")
    m.mapped("precision", "MixedPrecisionPolicy(param_dtype=...) in parallelize()" + precision_also)
    m.mapped("reduce_dtype", "mixed_precision_policy(TUNED.precision) in parallelize() (fp32 reduction in mixed "
                             "precision, bf16 in bf16-pure)")
    m.mapped("activation_checkpointing", "apply_ac in parallelize() (checkpoint_wrapper, NO_REENTRANT; op-level: "
                                         "create_selective_checkpoint_contexts(op_sac_policy))")
    m.mapped("cpu_offload", "CPUOffloadPolicy(pin_memory=True) in parallelize()",
             "applied on GPUs only: pinning host memory needs an accelerator")
    m.mapped("reshard_after_forward", "fully_shard(reshard_after_forward=...) in parallelize()")
    m.mapped("reshard_group_size", "fully_shard(reshard_after_forward=N) in parallelize() (TUNED.reshard_group_size)")
    m.mapped("shard_placement", "fully_shard(shard_placement_fn=shard_placement_fn(mesh, TUNED.shard_placement)) "
                                "in parallelize()")
    m.mapped("expert_parallel", "apply_ep in parallelize() on ParallelDims.of(TUNED, world)'s (dp_shard/ep, ep) "
                                "mesh (ExpertDispatch: all-to-all to the experts' ranks; the local experts "
                                "fully_shard over the ranks holding the same ones)")
    m.mapped("activation_offload", "OffloadedActivations() around each forward (TUNED.activation_offload)",
             "applied on GPUs only: on CPUs the host is the device")
    m.mapped("compile", "apply_compile in parallelize() (each decoder block's forward torch.compile(fullgraph=True, "
                        "dynamic=False), inductor, after checkpointing and before fully_shard)")
    m.mapped("float8", "apply_float8 in parallelize() (torchao's convert_to_float8_training on the blocks' linears, "
                       "lm_head and dimensions not divisible by 16 left high precision; tensorwise: FSDP2's float8 "
                       "all-gather, precompute_float8_dynamic_scale_for_fsdp after each optimizer step in "
                       "make_optimizer)", "needs torchao (pip install --no-deps torchao) and a GPU with float8")


def export_fsdp2(tuned: Tuned) -> Export:
    m = Mapper()
    map_parallelize_knobs(m)
    m.mapped("micro_batch_size", "TUNED.micro_batch_size")
    m.mapped("grad_accum_steps", "GRAD_ACCUM_STEPS")
    m.mapped("wrap", "fully_shard per block (find_decoder_blocks), then the root")
    m.mapped("world_size", torchrun_launch(tuned))
    m.mapped("state_dict_type", "--save: save_hf_checkpoint (each rank writes its own shards with DCP's "
                                "HuggingFaceStorageWriter, nothing gathered on any device; rank 0 consolidates "
                                "them into safetensors)")
    m.mapped("optimizer_impl", f"make_optimizer(impl={tuned.optimizer_impl!r})")
    m.mapped("shard_group_size", "ParallelDims.of(TUNED, world).build_mesh(): 1-D, or 2-D (replicate, shard) for HSDP")
    if tuned.context_parallel > 1:  # the ring computes with SDPA's kernels whatever the model's attention
        m.mapped("attention", "apply_cp in parallelize(): the ring's causal SDPA, as traced under context parallelism")
    else:
        map_attention(m, tuned, "ATTENTION: model.set_attn_implementation(ATTENTION) once built")
    return build_export(fmt="fsdp2", filename="train_fsdp2.py", target=TARGET, tuned=tuned, mapper=m,
                        expresses=("op_level_ac", "hsdp", "bf16_pure"),
                        prologue="#!/usr/bin/env python\n", body=_script(tuned))


def _model_config(t: Tuned) -> dict:
    return {k: v for k, v in t.model_config.items() if k not in ("model_type", "transformers_version")}


def _script(t: Tuned) -> str:
    launch = f"{torchrun_launch(t)} train_fsdp2.py"
    knobs = ", ".join(f"{knob.name}={getattr(t, knob.name)!r}" for knob in _knobs.KNOBS)  # TrainConfig's fields
    knobs = "\n                    ".join(textwrap.wrap(knobs, 96, break_long_words=False, break_on_hyphens=False))
    return f'''"""The tuned FSDP2 configuration as a training script, for a Hugging Face checkpoint of any size.

Run: {launch} --checkpoint MODEL_DIR --steps 10 --save OUT_DIR
(MODEL_DIR: a folder save_pretrained wrote: config.json and safetensors files. A smoke test on CPUs:
torchrun --standalone --nproc_per_node 2 train_fsdp2.py --random-init --steps 2.)
Each rank builds the model on the meta device, wraps it with autotune's parallelize() (the code autotune
measured), allocates only its own shards and reads only its slices of the checkpoint; --save writes
the trained weights as a folder AutoModelForCausalLM.from_pretrained loads. It imports autotune (the
version that wrote it) for all of that. Replace batches() with your data.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from autotune.backends.real._trial import make_grad_scaler
from autotune.problem.catalog.models import ModelSpec, resolve_model
from autotune.problem.config import TrainConfig
from autotune.util.errors import UsageError
from autotune.util.quick_exit import quick_exit
from autotune.results.hf_checkpoint import save_hf_checkpoint, sharded_model
from autotune.distributed.parallel import ParallelDims
from autotune.distributed.training import OffloadedActivations, make_optimizer, token_batches, train_step

TUNED = TrainConfig({knobs})
GRAD_ACCUM_STEPS = {t.grad_accum_steps}
SEQ_LEN = {t.seq_len}
WORLD_SIZE = {t.gpus}
ATTENTION = {t.attention!r}  # transformers' attn_implementation the memory was predicted for
# The model tuned: what --random-init builds, and what a --checkpoint is compared with.
MODEL = ModelSpec(name={t.model_name!r}, model_type={t.model_type!r}, default_seq_len=SEQ_LEN,
                  source="autotune run {t.run_id}", config_dict={_model_config(t)!r})
# As tuned: gradients are reduce-scattered after every micro-batch. True would call
# model.set_requires_gradient_sync(False) on all but the last micro-batch: fewer reduce-scatters,
# but unsharded gradients of every block are kept until then (more memory than was tuned).
DEFER_GRAD_SYNC = False
SHAPES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "vocab_size")


def batches(vocab_size: int, device: torch.device, rank: int):
    """Random token micro-batches (TUNED.micro_batch_size x SEQ_LEN): replace with your data."""
    return token_batches(vocab_size=vocab_size, micro_batch_size=TUNED.micro_batch_size, seq_len=SEQ_LEN,
                         device=device, seed=rank // TUNED.ranks_per_batch)  # a tensor- or context-parallel group: one batch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train with the FSDP2 configuration autotune found.")
    weights = parser.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint", help="Hugging Face model folder to start from (config.json and "
                                              "safetensors, one file or several: what save_pretrained writes)")
    weights.add_argument("--random-init", action="store_true",
                         help="random weights for the tuned model instead (smoke tests)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to run")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    parser.add_argument("--save", help="folder to write the trained model to after the last step (safetensors and "
                                       "config.json, plus the --checkpoint folder's tokenizer files); on several "
                                       "nodes a folder every node sees")
    parser.add_argument("--report", help="write what FSDP2 applied (each parameter's shard dimension and "
                                         "unsharded shape: an expert-parallel rank's own experts) to this JSON file")
    args = parser.parse_args(argv)
    if args.checkpoint and not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        parser.error(f"--checkpoint {{args.checkpoint}} has no config.json: give the folder save_pretrained wrote")
    if TUNED.expert_parallel > 1 and (args.checkpoint or args.save):
        # Each expert-parallel rank holds other experts under the same tensor names: not one checkpoint's slices.
        parser.error("--checkpoint and --save are not built for expert parallelism: use --random-init, no --save")

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    try:  # a checkpoint that is not this model's: one line (every rank finds the same)
        spec = resolve_model(args.checkpoint) if args.checkpoint else MODEL
        differ = [k for k in SHAPES if spec.config_dict.get(k) != MODEL.config_dict.get(k)]
        if rank == 0 and differ:
            print(f"note: {{args.checkpoint}} is not the model tuned ({{', '.join(differ)}} differ): memory and "
                  "speed will differ")
        if rank == 0 and world != WORLD_SIZE:
            print(f"note: tuned for {{WORLD_SIZE}} ranks, running on {{world}}: memory and speed will differ")
        mesh = ParallelDims.of(TUNED, world).build_mesh(device.type)
        model = sharded_model(spec, mesh, TUNED, device=device, checkpoint=args.checkpoint)
        if TUNED.context_parallel == 1:  # (context parallelism's ring runs its own causal SDPA)
            model.set_attn_implementation(ATTENTION)
    except UsageError as exc:
        parser.exit(2, f"train_fsdp2.py: error: {{exc}}\\n")
    optimizer = make_optimizer(model, impl=TUNED.optimizer_impl, lr=args.lr)
    scaler = make_grad_scaler(TUNED.precision, device)
    tokens = batches(spec.config_dict["vocab_size"], device, rank)
    tokens_per_step = TUNED.micro_batch_size * SEQ_LEN * GRAD_ACCUM_STEPS * (world // TUNED.ranks_per_batch)
    # Activation offload needs an accelerator: on CPUs the host is the device.
    offloaded = OffloadedActivations() if TUNED.activation_offload and use_cuda else None
    for step in range(args.steps):
        start = time.perf_counter()
        loss = train_step(model, optimizer, tokens, grad_accum_steps=GRAD_ACCUM_STEPS, scaler=scaler,
                          defer_grad_sync=DEFER_GRAD_SYNC, saved_activations=offloaded)
        dist.all_reduce(loss)
        elapsed = time.perf_counter() - start
        if rank == 0:
            print(f"step {{step}} loss {{loss.item() / world:.6f}} "
                  f"tokens/s {{tokens_per_step / elapsed:.0f}} (measured here)", flush=True)
    if args.report and rank == 0:
        # Read from the live model: each sharded parameter is a DTensor, its placements the mesh's.
        placements = {{name: next((p.dim for p in reversed(param.placements) if hasattr(p, "dim")), None)
                      for name, param in model.named_parameters()}}
        shapes = {{name: list(param.shape) for name, param in model.named_parameters()}}  # over the mesh sharding it
        with open(args.report, "w") as fh:
            json.dump({{"placements": placements, "shapes": shapes}}, fh, indent=1)
    if args.save:
        save_hf_checkpoint(model, args.save, copy_from=args.checkpoint)
        if rank == 0:
            print(f"saved the trained model to {{args.save}}", flush=True)
    dist.barrier()  # no rank tears its groups down while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    quick_exit(0)  # the exit handlers run; the interpreter's teardown, where a gloo rank can abort, does not
'''


def tuned_and_wrapping(t: Tuned) -> str:
    """The tuned knobs as constants, and the wrapping and training code copied from autotune:
    what every FSDP2 export (the torchrun script, Lightning's configure_model) embeds."""
    dtypes = ", ".join(f"{k!r}: torch.{str(v).removeprefix('torch.')}" for k, v in _parallel.PARAM_DTYPES.items())
    return f'''# ---- The tuned configuration -------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    """The knobs autotune tuned (the fields of autotune.problem.config.TrainConfig)."""

    precision: str
    activation_checkpointing: "Checkpointing"
    cpu_offload: bool
    reshard_after_forward: bool
    micro_batch_size: int
    optimizer_impl: str
    shard_group_size: int
    reshard_group_size: int = 0
    shard_placement: str = "dim0"
    activation_offload: bool = False
    compile: str = "none"
    float8: str = "none"
    expert_parallel: int = 1
    tensor_parallel: int = 1
    async_tensor_parallel: bool = False
    loss_parallel: bool = False
    context_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_schedule: str = "1F1B"

    @property
    def ranks_per_batch(self) -> int:
        """GPUs that share one batch: a tensor- or context-parallel group, a pipeline's stages."""
        return self.tensor_parallel * self.context_parallel * self.pipeline_parallel

    @property
    def fsdp_reshard_after_forward(self) -> bool | int:
        """What fully_shard takes for the blocks: a bool, or the group size to reshard to."""
        return self.reshard_group_size or self.reshard_after_forward


GRAD_ACCUM_STEPS = {t.grad_accum_steps}
SEQ_LEN = {t.seq_len}
WORLD_SIZE = {t.gpus}
MODEL_TYPE = {t.model_type!r}
MODEL_CONFIG = {_model_config(t)!r}
STATE_DICT_TYPE = {t.state_dict_type!r}  # {t.state_dict_reason}
# As tuned: gradients are reduce-scattered after every micro-batch. True would call
# model.set_requires_gradient_sync(False) on all but the last micro-batch: fewer reduce-scatters,
# but unsharded gradients of every block are kept until then (more memory than was tuned).
DEFER_GRAD_SYNC = False

# ---- Copied from autotune.problem.knobs, autotune.distributed.parallel and autotune.distributed.training ----------------


class UnsupportedModelError(ValueError):
    pass


UsageError = ValueError
AC_MODES = {_knobs.AC_MODES!r}
OP_POLICIES = {_knobs.OP_POLICIES!r}
_EVERY = re.compile({_knobs._EVERY.pattern!r})
_OP = re.compile({_knobs._OP.pattern!r})


SUPPORTED_FAMILIES = {_blocks.SUPPORTED_FAMILIES!r}
MIN_OFFLOAD_BYTES = {_training.MIN_OFFLOAD_BYTES!r}
TRL_STEPS = {_training.TRL_STEPS!r}
PACKED_STEP = {_training.PACKED_STEP!r}
COMPILE_BACKEND = {_knobs.COMPILE_BACKEND!r}
FLOAT8_SKIPPED = {_parallel.FLOAT8_SKIPPED!r}
BLOCK_PREFIX = {_knobs.BLOCK_PREFIX!r}
PARAM_DTYPES = {{{dtypes}}}


{copied_sources()}


TUNED = TrainConfig(precision={t.precision!r}, activation_checkpointing=Checkpointing.parse({t.activation_checkpointing!r}),
                    cpu_offload={t.cpu_offload!r}, reshard_after_forward={t.reshard_after_forward!r},
                    micro_batch_size={t.micro_batch_size!r}, optimizer_impl={t.optimizer_impl!r},
                    shard_group_size={t.shard_group_size!r}, reshard_group_size={t.reshard_group_size!r},
                    shard_placement={t.shard_placement!r}, activation_offload={t.activation_offload!r},
                    compile={t.compile!r}, float8={t.float8!r}, expert_parallel={t.expert_parallel!r},
                    tensor_parallel={t.tensor_parallel!r}, async_tensor_parallel={t.async_tensor_parallel!r},
                    loss_parallel={t.loss_parallel!r},
                    context_parallel={t.context_parallel!r},
                    pipeline_parallel={t.pipeline_parallel!r}, pipeline_schedule={t.pipeline_schedule!r})

'''


def build_model_source(t: Tuned) -> str:
    return f'''def build_model() -> nn.Module:
    """The model from its transformers config: fp32 master weights (FSDP casts for compute), or
    bf16 throughout for bf16-pure.
    fully_shard moves each rank's shard to the mesh's device; for models whose fp32 copy does
    not fit in host memory once per rank, build on the meta device and load a checkpoint after
    parallelize()."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(MODEL_TYPE, **MODEL_CONFIG)
    config._attn_implementation = {t.attention!r}  # the attention the memory was predicted for
    config.use_cache = False
    torch.manual_seed(0)
    dtype = torch.bfloat16 if TUNED.precision == "bf16-pure" else torch.float32
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


'''
