"""What every exporter shares: the tuned knobs read from best.json, the key-mapping table and
the header that says where a file came from and what it could not express.

Like Accelerate's FSDP1-to-FSDP2 converter, each exporter records one `KnobMapping` per tuned
knob: `mapped` (the stack expresses it exactly), `approximated` (the closest thing it has, with
what differs) or `unsupported` (left to the user). Anything not `mapped` becomes a warning, in
the file and in `Export.warnings`: an export never changes what was tuned silently.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any, Literal

from autotune.problem import knobs as knob_registry
from autotune.problem.knobs import Checkpointing
from autotune.util.errors import UsageError
from autotune.problem.config import QLORA_QUANTIZATION
from autotune.estimate.runtime_memory import ALLOC_CONF_ENV, RECOMMENDED_ALLOC_CONF

Status = Literal["mapped", "approximated", "unsupported"]

# The knobs autotune tunes (autotune/problem/knobs.py) or fixes, and the attention it was told to predict for;
# every exporter accounts for each of them.
KNOBS: tuple[str, ...] = tuple(dict.fromkeys((
    *knob_registry.BY_NAME, "reduce_dtype", "grad_accum_steps", "wrap", "world_size", "state_dict_type", "alloc_conf",
    "attention",
)))


class ExportRefused(UsageError):
    """This result cannot be expressed in the format at all (not a knob the stack lacks)."""


@dataclass(frozen=True)
class KnobMapping:
    knob: str
    status: Status
    key: str
    """Where the knob lands in the stack ('' when unsupported)."""
    note: str = ""
    """What differs from the tuned configuration (required unless mapped)."""


@dataclass(frozen=True, kw_only=True)
class Export:
    """One exported file: its text, where it should go, and what it could not express."""

    format: str
    filename: str
    text: str
    target: str
    """The stack and the version the file was written for."""
    mappings: tuple[KnobMapping, ...]
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Tuned:
    """The winning configuration, read from a best.json document."""

    run_id: str
    tool: str
    model_name: str
    model_type: str
    model_config: dict[str, Any]
    num_layers: int
    wrap: str
    gpus: int
    nodes: int
    seq_len: int
    precision: str
    param_dtype: str
    reduce_dtype: str
    activation_checkpointing: str
    cpu_offload: bool
    reshard_after_forward: bool
    micro_batch_size: int
    grad_accum_steps: int
    global_tokens: int
    state_dict_type: Literal["full", "sharded"]
    state_dict_reason: str
    optimizer_impl: str = "for-loop"
    """AdamW implementation traced (results from before the knob existed ran the per-parameter loop)."""
    alloc_conf: str = RECOMMENDED_ALLOC_CONF
    """PYTORCH_CUDA_ALLOC_CONF the prediction assumed (its fragmentation term depends on it)."""
    workload: str = "sft"
    """'grpo': tuned for TRL GRPO with vLLM colocated (results from before the knob: sft)."""
    vllm_gpu_memory_utilization: float | None = None
    max_completion_length: int | None = None
    """grpo: GRPOConfig.max_completion_length tuned for (None: a result from before the knob, TRL's default)."""
    num_generations: int | None = None
    """grpo: the user's --num-generations (None: TRL's default where it divides the global batch)."""
    finetuning: dict[str, Any] = field(default_factory=lambda: {"peft": "none"})
    """The result's `finetuning` section (peft method and LoRA settings)."""
    shard_group_size: int = 0
    """HSDP: GPUs per shard group (replicated across groups); 0 = plain FSDP over every GPU."""
    reshard_group_size: int = 0
    """Blocks resharded after forward to groups of this many GPUs; 0 = as reshard_after_forward."""
    shard_placement: str = "dim0"
    activation_offload: bool = False
    """`largest`: parameters whose first dimension is smaller than the shard group sharded on their
    largest evenly divisible dimension (autotune.problem.knobs.shard_dim)."""
    compile: str = "none"
    """torch.compile of the decoder blocks: none or blocks (results from before the knob: none)."""
    expert_parallel: int = 1
    """Expert-parallel degree (1: none; results from before the knob: 1)."""
    tensor_parallel: int = 1
    """Tensor-parallel degree (1: none; results from before the knob: 1)."""
    async_tensor_parallel: bool = False
    """Async TP (results from before the knob: off)."""
    loss_parallel: bool = False
    """Loss parallelism: the head and the loss split by vocabulary (results from before the knob: off)."""
    context_parallel: int = 1
    """Context-parallel degree (1: none; results from before the knob: 1)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel degree (1: none; results from before the knob: 1)."""
    pipeline_schedule: str = "1F1B"
    """The pipeline schedule (knobs.PIPELINE_SCHEDULES); 1F1B where pipeline_parallel is 1."""
    stack: str = "fsdp2"
    """Whose step the memory was predicted for (results from before `--stack`: fsdp2, autotune's loop)."""
    token_budget: int = 0
    """Packed batches' tokens per micro-batch at most (autotune/problem/packing.py); 0: rows of one sequence each."""
    float8: str = "none"
    """float8 training of the blocks' linears: none, tensorwise or rowwise (before the knob: none)."""
    text_only: dict[str, Any] | None = None
    """--text-only: the result's `text_only` section (the multimodal model whose language model alone
    was tuned); None for a text model."""
    attention: str = "sdpa"
    """transformers' attn_implementation the memory was predicted for (best.json model.attention_implementation;
    results from before the key: sdpa)."""

    @property
    def stack_precision(self) -> str:
        """The precision mode to ask of a stack that has only bf16 / fp16 / fp32 modes: pure bf16 as
        bf16 (the stack's bf16 keeps fp32 masters: map_knobs_not_expressed says so)."""
        return "bf16" if self.precision == "bf16-pure" else self.precision

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def checkpointing(self) -> Checkpointing:
        return Checkpointing.parse(self.activation_checkpointing)

    @property
    def ac_every(self) -> int | None:
        """Blocks checkpointed whole, one every this many (op-level: every block, 1)."""
        return self.checkpointing.block_every

    @property
    def op_level_ac(self) -> bool:
        return self.checkpointing.mode == "op"

    @property
    def hsdp_degrees(self) -> tuple[int, int]:
        """(replicate, shard) degrees of the data-parallel mesh (a tensor- or context-parallel group is one data rank)."""
        data = self.gpus // self.ranks_per_batch
        shard = self.shard_group_size or data
        return data // shard, shard

    @property
    def checkpointed_blocks(self) -> int:
        every = self.ac_every
        return 0 if every is None else len(range(0, self.num_layers, every))

    @property
    def sharding_strategy(self) -> str:
        """FSDP1's name for reshard_after_forward (FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2)."""
        if self.shard_group_size == self.gpus_per_node:  # FSDP1's hybrid sharding: within a node
            return "HYBRID_SHARD" if self.reshard_after_forward else "_HYBRID_SHARD_ZERO2"
        return "FULL_SHARD" if self.reshard_after_forward else "SHARD_GRAD_OP"

    @property
    def state_dict_enum(self) -> str:
        """The recommended checkpoint form as a StateDictType member name."""
        return "SHARDED_STATE_DICT" if self.state_dict_type == "sharded" else "FULL_STATE_DICT"

    @property
    def data_ranks_text(self) -> str:
        """Who takes a batch each, for comments: the GPUs, or the tensor-parallel groups of them."""
        from autotune.problem.batch import data_ranks_text

        return data_ranks_text(self.gpus, self.tensor_parallel, self.context_parallel, self.pipeline_parallel)

    @property
    def ranks_per_batch(self) -> int:
        """GPUs that share one batch: a tensor- or context-parallel group, a pipeline's stages."""
        return self.tensor_parallel * self.context_parallel * self.pipeline_parallel

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step, all data ranks together (a tensor- or context-parallel group takes one batch)."""
        return self.micro_batch_size * (self.gpus // self.ranks_per_batch) * self.grad_accum_steps

    @classmethod
    def from_result(cls, result: dict[str, Any]) -> "Tuned":
        try:
            fsdp, model = result["fsdp"], result["model"]
            plan = result.get("checkpoint") or _plan(result)
            values = knob_registry.from_result(result)
            return cls(
                run_id=str(result.get("run_id") or "(unnamed run)"),
                tool=str(result.get("provenance", {}).get("tool", "autotune")),
                model_name=model["name"], model_type=model["model_type"],
                model_config=dict(model.get("config") or {}), num_layers=int(model["num_layers"]),
                wrap=fsdp["wrap"], gpus=int(result["gpus"]), nodes=int(result.get("nodes", 1)),
                seq_len=int(result["seq_len"]), precision=result["precision"],
                param_dtype=fsdp["param_dtype"], reduce_dtype=fsdp["reduce_dtype"],
                activation_checkpointing=str(Checkpointing.parse(fsdp["activation_checkpointing"])),
                shard_group_size=int(values["shard_group_size"]),
                reshard_group_size=int(values["reshard_group_size"]),
                shard_placement=str(values["shard_placement"]),
                activation_offload=bool(values["activation_offload"]),
                compile=str(values["compile"]),
                float8=str(values["float8"]),
                expert_parallel=int(values["expert_parallel"]),
                tensor_parallel=int(values["tensor_parallel"]),
                async_tensor_parallel=bool(values["async_tensor_parallel"]),
                loss_parallel=bool(values["loss_parallel"]),
                context_parallel=int(values["context_parallel"]),
                pipeline_parallel=int(values["pipeline_parallel"]),
                pipeline_schedule=str(values["pipeline_schedule"]),
                cpu_offload=bool(fsdp["cpu_offload"]),
                reshard_after_forward=bool(fsdp["reshard_after_forward"]),
                micro_batch_size=int(result["micro_batch_size"]),
                grad_accum_steps=int(result["grad_accum_steps"]),
                global_tokens=int(result["global_tokens"]),
                state_dict_type=plan["recommended"], state_dict_reason=plan["reason"],
                optimizer_impl=str((result.get("optimizer") or {}).get("impl", "for-loop")),
                alloc_conf=str((result.get("environment") or {}).get(ALLOC_CONF_ENV) or RECOMMENDED_ALLOC_CONF),
                workload=str((result.get("workload") or {}).get("kind", "sft")),
                vllm_gpu_memory_utilization=(result.get("workload") or {}).get("vllm_gpu_memory_utilization"),
                max_completion_length=(result.get("workload") or {}).get("max_completion_length"),
                num_generations=(result.get("workload") or {}).get("num_generations"),
                finetuning=dict(result.get("finetuning") or {"peft": "none"}),
                stack=str((result.get("stack") or {}).get("name", "fsdp2")),
                token_budget=int((result.get("packing") or {}).get("token_budget", 0)),
                text_only=result.get("text_only"),
                attention=str(model.get("attention_implementation") or "sdpa"),
            )
        except (KeyError, TypeError) as exc:
            raise UsageError(f"not an autotune result (best.json): missing or malformed field {exc}; "
                             "pass runs/<run-id>/best.json") from None


def _plan(result: dict[str, Any]) -> dict[str, Any]:
    from autotune.estimate.checkpoint_plan import plan_checkpoint

    return plan_checkpoint(result)


@dataclass
class Mapper:
    """Collects one KnobMapping per knob while an exporter writes its keys."""

    mappings: list[KnobMapping] = field(default_factory=list)
    extra_warnings: list[str] = field(default_factory=list)

    def mapped(self, knob: str, key: str, note: str = "") -> None:
        self.mappings.append(KnobMapping(knob, "mapped", key, note))

    def approximated(self, knob: str, key: str, note: str) -> None:
        self.mappings.append(KnobMapping(knob, "approximated", key, note))

    def unsupported(self, knob: str, note: str) -> None:
        self.mappings.append(KnobMapping(knob, "unsupported", "", note))

    def warn(self, message: str) -> None:
        self.extra_warnings.append(message)

    @property
    def warnings(self) -> tuple[str, ...]:
        lost = [f"{m.knob}: {m.status}: {m.note}" for m in self.mappings if m.status != "mapped"]
        return tuple(lost + self.extra_warnings)

    def check_complete(self) -> None:
        missing = set(KNOBS) - {m.knob for m in self.mappings}
        assert not missing, f"exporter left knobs unaccounted for: {sorted(missing)}"


FLASH_ATTENTION_NEEDS = {
    "flash_attention_2": "the flash-attn package (pip install flash-attn --no-build-isolation; imported as "
                         "flash_attn) and an NVIDIA GPU of Ampere or newer",
    "flash_attention_3": "flash-attention's Hopper build (the flash-attn-3 package from flash-attention's "
                         "hopper/ directory, imported as flash_attn_interface; pip install flash-attn is FA2 only) "
                         "and a Hopper GPU (H100, H200)",
}
"""What transformers needs to load a model with each flash-attention attn_implementation (it refuses without)."""


def map_attention(m: Mapper, t: Tuned, key: str) -> None:
    """The file loads the model with the tuned attention at `key`; flash-attention's needs are warned of."""
    m.mapped("attention", key)
    warn_flash_attention(m, t)


def warn_flash_attention(m: Mapper, t: Tuned, attention: str | None = None) -> None:
    """A flash-attention attn_implementation runs only where its package and GPU are: say so."""
    attention = attention or t.attention
    if attention in FLASH_ATTENTION_NEEDS:
        m.warn(f"attn_implementation {attention!r} needs {FLASH_ATTENTION_NEEDS[attention]}: without them "
               "transformers refuses to load the model")


def map_attention_by_hand(m: Mapper, t: Tuned, where: str) -> None:
    """A config that does not load the model: transformers' default attention (sdpa) is the tuned one,
    any other is for the user's script to pass."""
    if t.attention == "sdpa":
        m.mapped("attention", "transformers' default attn_implementation (sdpa), as tuned")
        return
    m.unsupported("attention", f"not {where}: load the model with from_pretrained(..., attn_implementation="
                               f"{t.attention!r}) in your script, the attention the memory was predicted for "
                               "(transformers' default is sdpa)")
    warn_flash_attention(m, t)


def map_own_attention(m: Mapper, t: Tuned, stack: str) -> None:
    """Stacks that run a model of their own, whose attention is SDPA whatever was tuned."""
    key = f"{stack}'s own model: its attention through SDPA"
    if t.attention == "sdpa":
        m.mapped("attention", key + ", as tuned")
        return
    m.approximated("attention", key, f"{stack} runs its own SDPA attention, not the {t.attention} tuned: "
                                     f"{sdpa_instead(t)}")


def sdpa_instead(t: Tuned) -> str:
    """What running SDPA instead of the tuned attention changes, in a clause."""
    if t.attention == "eager":
        return "less activation memory than predicted: eager keeps every block's (tokens x tokens) scores, SDPA does not"
    return "activation memory close to flash-attention's, speed may differ"


EXPRESSIBLE = ("op_level_ac", "hsdp", "bf16_pure", "lora", "qlora", "packing")
"""Knob values only some stacks can express: an exporter names those it writes in build_export's
`expresses`; for the rest the mapping is derived here, as approximated or unsupported."""


QLORA_BNB_CONFIG = (f"load_in_4bit=True, bnb_4bit_quant_type={QLORA_QUANTIZATION['quant_type']!r}, "
                    f"bnb_4bit_use_double_quant={QLORA_QUANTIZATION['compress_statistics']}, "
                    "bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16")
"""transformers' BitsAndBytesConfig of the layout QLoRA was traced with (training.QLORA_QUANTIZATION)."""


def _approximate(mapper: Mapper, knobs: tuple[str, ...], note: str) -> None:
    """Downgrade the exporter's `mapped` entries of `knobs` to approximated, saying what differs."""
    mapper.mappings[:] = [KnobMapping(m.knob, "approximated", m.key, note)
                          if m.knob in knobs and m.status == "mapped" else m for m in mapper.mappings]


def _map_unless_written(mapper: Mapper, knob: str, *, at_default: bool, default: str, missing: str) -> None:
    """A knob the exporter did not map: mapped when it is at its default (the stack's behaviour too),
    else unsupported with what to do by hand."""
    if knob in {m.knob for m in mapper.mappings}:
        return
    if at_default:
        mapper.mapped(knob, default)
    else:
        mapper.unsupported(knob, missing)


def map_knobs_not_expressed(tuned: Tuned, mapper: Mapper, *, stack: str, expresses: tuple[str, ...]) -> None:
    """Downgrade or add the mappings of knob values the stack cannot express (see EXPRESSIBLE)."""
    unknown = set(expresses) - set(EXPRESSIBLE)
    assert not unknown, f"unknown expressible values {sorted(unknown)}"
    if tuned.precision == "bf16-pure" and "bf16_pure" not in expresses:
        _approximate(mapper, ("precision", "reduce_dtype"),
                     f"pure bf16 was tuned (parameters, gradients, reduction and AdamW state in bf16, no fp32 copy); "
                     f"{stack}'s bf16 setting keeps fp32 master weights (more memory than tuned): load the model in "
                     "bfloat16 to train as tuned")
    if tuned.op_level_ac and "op_level_ac" not in expresses:
        _approximate(mapper, ("activation_checkpointing",),
                     f"{stack} has no op-level selective checkpointing ({tuned.activation_checkpointing} was tuned): "
                     "every block is checkpointed whole instead (less memory, more recompute)")
    _map_unless_written(mapper, "reshard_group_size", at_default=not tuned.reshard_group_size,
                        default="resharded over the whole shard group (or kept gathered), as tuned",
                        missing=f"resharding after forward to groups of {tuned.reshard_group_size} GPUs is not "
                                f"expressible in {stack}: the file reshards over the whole shard group (less memory "
                                "between forward and backward, backward's all-gather over every shard rank)")
    _map_unless_written(mapper, "activation_offload", at_default=not tuned.activation_offload,
                        default="saved activations stay on the GPU, as tuned",
                        missing=f"activation offload is not written for {stack}: wrap each forward in torch's "
                                "torch.autograd.graph.save_on_cpu(pin_memory=True) (it also copies parameters; "
                                "torchtune's OffloadActivations skips them, as tuned) or the GPU runs out of memory; "
                                "the fsdp2 script and Lightning exports apply it")
    _map_unless_written(mapper, "compile", at_default=tuned.compile == "none",
                        default="eager, as tuned",
                        missing=f"torch.compile of each decoder block is not written for {stack}: compile each "
                                "block yourself (block.compile(fullgraph=True) after checkpointing, before FSDP "
                                "wraps it), or run eager (slower, and memory differs from the compiled trace: "
                                "docs/COMPILE.md)")
    _map_unless_written(mapper, "float8", at_default=tuned.float8 == "none",
                        default="high-precision linears, as tuned",
                        missing=f"float8 training ({tuned.float8}) is not written for {stack}: convert the decoder "
                                "blocks' linears yourself with torchao (convert_to_float8_training, lm_head left out; "
                                "tensorwise with Float8LinearConfig(enable_fsdp_float8_all_gather=True) and "
                                "precompute_float8_dynamic_scale_for_fsdp after each optimizer step) before FSDP "
                                "wraps them, or train in high precision (slower than estimated; docs/COMPILE.md)")
    _map_unless_written(mapper, "expert_parallel", at_default=tuned.expert_parallel == 1,
                        default="no expert parallelism, as tuned",
                        missing=f"expert parallelism over {tuned.expert_parallel} GPUs is not written for {stack}: "
                                "every GPU would gather every expert (more memory and all-gather traffic than "
                                "tuned); the fsdp2 script, Lightning and torchtitan exports apply it")
    _map_unless_written(mapper, "tensor_parallel", at_default=tuned.tensor_parallel == 1,
                        default="no tensor parallelism, as tuned",
                        missing=f"tensor parallelism over {tuned.tensor_parallel} GPUs is not written for {stack}: "
                                "each GPU would hold and compute whole blocks, and the global batch tuned (one batch "
                                f"per {tuned.tensor_parallel} GPUs) would be {tuned.tensor_parallel}x larger; the "
                                "fsdp2 script and torchtitan exports apply it")
    if tuned.token_budget and "packing" not in expresses:
        mapper.unsupported("token_budget",
                           f"packed batches of up to {tuned.token_budget:,} tokens of whole documents per micro-batch "
                           f"(attention within each document) are not written for {stack}: pack them yourself, one "
                           "padding-free row per micro-batch with position_ids restarting at each document and a varlen "
                           f"attention (attn_implementation='flash_attention_2'); verl: use_dynamic_bsz with "
                           f"ppo_max_token_len_per_gpu={tuned.token_budget}. Rows of --seq-len instead have another "
                           "memory and throughput than tuned; the trl export writes the packing")
    _map_unless_written(mapper, "async_tensor_parallel", at_default=not tuned.async_tensor_parallel,
                        default="synchronous tensor-parallel collectives, as tuned",
                        missing=f"async tensor parallelism is not written for {stack}: its tensor-parallel all-gathers "
                                "and reduce-scatters then wait for the matmuls beside them (slower than estimated, "
                                "the same memory less the symmetric-memory workspace); the torchtitan export and the "
                                "fsdp2 script turn it on")
    _map_unless_written(mapper, "loss_parallel", at_default=not tuned.loss_parallel,
                        default="the head whole on each GPU, as tuned",
                        missing=f"loss parallelism is not written for {stack}: each tensor-parallel GPU computes the "
                                "whole vocabulary's logits and holds the whole head (more memory than predicted); the "
                                "fsdp2 script and the torchtitan export split them")
    _map_unless_written(mapper, "context_parallel", at_default=tuned.context_parallel == 1,
                        default="no context parallelism, as tuned",
                        missing=f"context parallelism over {tuned.context_parallel} GPUs is not written for {stack}: "
                                "each GPU would hold whole sequences (more activation memory than tuned), and the "
                                f"global batch tuned (one batch per {tuned.context_parallel} GPUs) would be "
                                f"{tuned.context_parallel}x larger; the torchtitan and accelerate exports set it")
    _map_unless_written(mapper, "pipeline_parallel", at_default=tuned.pipeline_parallel == 1,
                        default="no pipeline parallelism, as tuned",
                        missing=f"pipeline parallelism over {tuned.pipeline_parallel} stages is not written for {stack}: "
                                "each GPU would hold and run every block (more memory than tuned), and the global "
                                f"batch tuned (one batch per {tuned.pipeline_parallel} GPUs) would be "
                                f"{tuned.pipeline_parallel}x larger; the torchtitan export sets it")
    _map_unless_written(mapper, "pipeline_schedule", at_default=tuned.pipeline_parallel == 1,
                        default="no pipeline, no schedule",
                        missing=f"the {tuned.pipeline_schedule} pipeline schedule is not written for {stack} (no "
                                "pipeline is); the torchtitan export sets it")
    if "shard_placement" not in {m.knob for m in mapper.mappings}:
        if tuned.shard_placement == "dim0":
            mapper.mapped("shard_placement", "every parameter sharded on dimension 0 (FSDP's default), as tuned")
        elif "FSDP1" in stack:
            mapper.approximated("shard_placement", "FSDP1's flat parameters",
                                "FSDP1 flattens each wrapped block and shards the flat buffer evenly, so no "
                                "parameter is padded per expert: close to the placement tuned, not the same "
                                "shards (FSDP1 was not traced)")
        else:
            mapper.unsupported("shard_placement",
                               f"{stack} shards every parameter on dimension 0: parameters whose first dimension "
                               "(the experts of a fused MoE weight) is smaller than the shard group are mostly "
                               "padding on each GPU (more memory than tuned); the fsdp2 script and Lightning "
                               "exports pass fully_shard a shard_placement_fn")
    if "shard_group_size" in {m.knob for m in mapper.mappings}:
        return
    if not tuned.shard_group_size:
        mapper.mapped("shard_group_size", "plain FSDP: parameters sharded over every GPU, as tuned")
    elif "hsdp" not in expresses:
        replicate, shard = tuned.hsdp_degrees
        mapper.unsupported("shard_group_size",
                           f"HSDP (shard within groups of {shard} GPUs, replicate across {replicate}) is not "
                           f"written for {stack}: set its hybrid-sharding option by hand, or shard over every GPU "
                           "(less memory per GPU, more inter-node traffic than tuned)")


def build_export(*, fmt: str, filename: str, target: str, tuned: Tuned, mapper: Mapper, body: str,
                 prologue: str = "", expresses: tuple[str, ...] = ()) -> Export:
    """Assemble the file: optional prologue (shebang), the header comment, then the body, with
    the allocator setting the prediction assumed pinned where the file can set it. `expresses`:
    which of EXPRESSIBLE the file writes exactly."""
    map_knobs_not_expressed(tuned, mapper, stack=target, expresses=expresses)
    warn_other_stack(fmt, tuned, mapper)
    body = pin_allocator(filename, tuned=tuned, mapper=mapper, body=body)
    if tuned.workload == "grpo" and fmt != "trl":
        mapper.warn(f"tuned for TRL GRPO with vLLM colocated ({tuned.vllm_gpu_memory_utilization:g} of each GPU "
                    "left to vLLM): this file trains without vLLM or its weight sync; the trl format writes the "
                    "GRPOConfig")
    if tuned.finetuning.get("peft") == "qlora" and "qlora" not in expresses:
        mapper.warn(f"tuned as QLoRA (base weights in 4-bit NF4 by bitsandbytes, {QLORA_BNB_CONFIG}): this file "
                    "does not quantize the base; load it with transformers' BitsAndBytesConfig("
                    f"{QLORA_BNB_CONFIG}) before the adapters, or the base takes 2 bytes a weight instead of about "
                    "0.53 (far more memory than tuned)")
    if tuned.finetuning.get("peft") in ("lora", "qlora") and "lora" not in expresses:
        f = tuned.finetuning
        targets = f.get("targets", "all-linear")
        targets = repr(targets) if targets == "all-linear" else repr(targets.split(","))
        mapper.warn(f"tuned as a LoRA fine-tune (peft; base weights frozen in {tuned.param_dtype}): this file does "
                    f"not add the adapters; wrap the model before FSDP with peft.get_peft_model(model, LoraConfig("
                    f"r={f.get('rank')}, lora_alpha={f.get('alpha')}, lora_dropout={f.get('dropout')}, "
                    f"target_modules={targets})) as autotune traced it, or every parameter trains (far more "
                    "memory than tuned)")
    if tuned.text_only:
        from autotune.util.units import format_bytes

        left = tuned.text_only
        mapper.warn(f"tuned with --text-only: {left['of']}'s language model alone (a script builds that model from "
                    f"its config); these settings used on the full {left['of']} checkpoint also hold its "
                    f"{left['left_out_parameters']:,} other parameters ({', '.join(left['left_out_modules'])}): an "
                    f"estimated {format_bytes(left['left_out_state_bytes_per_gpu_estimated'])} per GPU of sharded "
                    f"states and {format_bytes(left['left_out_gathered_bytes_estimated'])} gathered, plus their "
                    "image activations, none of it costed by the tune: keep headroom for them, or freeze those towers")
        if str(left.get("language_model_class") or "").startswith("autotune."):
            mapper.warn(f"transformers has no causal-LM class for {tuned.model_type}: autotune built it as its "
                        f"{left['language_model_class']} (the language model under the output head); a script here "
                        f"that builds the model from its config fails with AutoModelForCausalLM: build "
                        f"{left['model_class']} from the full checkpoint instead")
    mapper.check_complete()
    text = prologue + header(tuned=tuned, target=target, mapper=mapper) + "\n" + body.lstrip("\n")
    return Export(format=fmt, filename=filename, text=text, target=target,
                  mappings=tuple(mapper.mappings), warnings=mapper.warnings)


FORMAT_STACKS: dict[str, str] = {"fsdp2": "fsdp2", "lightning": "lightning", "accelerate": "accelerate",
                                 "hf-trainer": "hf-trainer", "trl": "trl", "torchtitan": "torchtitan",
                                 "llama-cookbook": "llama-cookbook", "litgpt": "litgpt"}
"""The stack (config.STACKS) each format trains with; the FSDP1 formats' flat parameters are warned of apart."""


def warn_other_stack(fmt: str, tuned: Tuned, mapper: Mapper) -> None:
    """One line where the file trains another step than the one whose memory was predicted: a
    stack whose step differs (config.stack_step), or one with a model of its own."""
    from autotune.problem.config import OWN_MODEL_STACKS, TRL_STEPS, stack_step

    target = FORMAT_STACKS.get(fmt)
    if target in TRL_STEPS and tuned.stack in TRL_STEPS:
        target = tuned.stack  # the trl format writes the packing of the TRL step tuned (_hf.trl_packing)
    if target is None or target == tuned.stack:
        return
    tuned_step = stack_step(tuned.stack, tuned.precision, tuned.model_type)
    target_step = stack_step(target, tuned.precision, tuned.model_type)
    if tuned_step != target_step or target in OWN_MODEL_STACKS or tuned.stack in OWN_MODEL_STACKS:
        mapper.warn(f"memory predicted for {tuned.stack}'s step ({tuned_step}), not {target}'s: its peak differs; "
                    f"tune with --stack {target} for this file's")


def pin_allocator(filename: str, *, tuned: Tuned, mapper: Mapper, body: str) -> str:
    """Set PYTORCH_CUDA_ALLOC_CONF in scripts (before torch initialises CUDA); a YAML config
    cannot set the environment, so its launch has to, and the file says so."""
    key, value = ALLOC_CONF_ENV, tuned.alloc_conf
    if filename.endswith(".sh"):
        mapper.mapped("alloc_conf", f"export {key}={value}")
        return f"export {key}={shlex.quote(value)}  # the allocator setting autotune assumed for its memory figures\n" + body
    if filename.endswith(".py"):
        mapper.mapped("alloc_conf", f"os.environ[{key!r}] before torch is imported")
        pin = (f"import os\n\nos.environ[{key!r}] = {value!r}  # the allocator setting autotune's memory "
               "figures assume; set before torch initialises CUDA\n")
        future = "from __future__ import annotations\n"
        if future in body:
            head, _, rest = body.partition(future)
            return head + future + "\n" + pin + rest
        return pin + "\n" + body
    mapper.unsupported("alloc_conf", f"a {filename.rsplit('.', 1)[-1].upper()} config cannot set the environment: "
                                     f"launch with {key}={value} (the setting autotune's memory figures assume)")
    return body


def header(*, tuned: Tuned, target: str, mapper: Mapper) -> str:
    """The comment block at the top of every export ('#' comments: Python, YAML, TOML, shell)."""
    lines = [
        f"Generated by {tuned.tool} from run {tuned.run_id}: {tuned.model_name} on {tuned.gpus} GPUs "
        f"({tuned.nodes} node{'s' if tuned.nodes > 1 else ''}).",
        f"Targets: {target}.",
        f"Tuned: {tuned.precision} params, {tuned.reduce_dtype} gradient reduction, "
        f"activation checkpointing {tuned.activation_checkpointing}, cpu_offload {tuned.cpu_offload}, "
        f"reshard_after_forward {tuned.reshard_after_forward}, "
        f"{'HSDP %d x %d (replicate x shard)' % tuned.hsdp_degrees if tuned.shard_group_size else 'FSDP over every GPU'}, "
        f"micro-batch {tuned.micro_batch_size}, "
        f"grad accumulation {tuned.grad_accum_steps}, seq_len {tuned.seq_len}.",
        f"Checkpoints: {tuned.state_dict_type} state dict ({tuned.state_dict_reason}).",
        *([f"Workload: TRL GRPO, vLLM colocated with vllm_gpu_memory_utilization "
           f"{tuned.vllm_gpu_memory_utilization:g} (training tuned for what vLLM leaves, weight sync included)."]
          if tuned.workload == "grpo" else []),
        "",
        "Knob mapping (mapped = exact; approximated / unsupported = differs from what was tuned):",
    ]
    width = max(len(m.knob) for m in mapper.mappings)
    for m in mapper.mappings:
        where = f" -> {m.key}" if m.key else ""
        note = f"  [{m.note}]" if m.note and m.status == "mapped" else ""
        lines.append(f"  {m.knob:<{width}}  {m.status}{where}{note}")
    if mapper.warnings:
        lines += ["", "WARNINGS (this file cannot express everything that was tuned):"]
        lines += [f"  - {w}" for w in mapper.warnings]
    return "".join(f"# {line}".rstrip() + "\n" for line in lines)


RDZV_PORT = 29500
MAIN_ADDR_PLACEHOLDER = "MAIN_NODE_ADDRESS"
"""Written where a config file needs the main node's address: replace it (or override it on the
launch line); left as it is, the rendezvous fails on the name instead of waiting on localhost."""


def torchrun_launch(t: Tuned) -> str:
    """torchrun's node arguments. On several nodes every node runs the same line, with a c10d
    rendezvous at the main node (node ranks are assigned by it): MAIN_ADDR must be set, and the
    shell stops with that message when it is not."""
    line = f"torchrun --nnodes {t.nodes} --nproc_per_node {t.gpus_per_node}"
    if t.nodes > 1:
        # (no apostrophe in the message: bash would read it as a quote inside "${...}")
        endpoint = f'"${{MAIN_ADDR:?set MAIN_ADDR to the address of the main node}}:{RDZV_PORT}"'
        line += f" --rdzv_backend c10d --rdzv_endpoint {endpoint}"
    return line


def accelerate_launch(t: Tuned, config: str = "") -> str:
    """`accelerate launch` with the world size (or a config file): on several nodes each node also
    passes its own --machine_rank (0 on the main node) and the main node's address and port; the
    shell stops with a message where NODE_RANK or MAIN_ADDR is unset (never a rank 0 twice, or a
    rendezvous on localhost)."""
    line = f"accelerate launch --config_file {config}" if config else \
        f"accelerate launch --num_processes {t.gpus} --num_machines {t.nodes}"
    if t.nodes > 1:
        # (no apostrophe in the messages: bash would read it as a quote inside "${...}")
        rank = f'"${{NODE_RANK:?set NODE_RANK to 0 on the main node, {_other_ranks(t)}}}"'
        line += (f' --machine_rank {rank} --main_process_ip "${{MAIN_ADDR:?set MAIN_ADDR to the address of the main '
                 f'node}}" --main_process_port {RDZV_PORT}')
    return line


def nodes_note(t: Tuned, *, ranks: bool) -> str:
    """The comment line under a launch line on several nodes ('' on one node)."""
    if t.nodes == 1:
        return ""
    rank = f"; NODE_RANK 0 on the main node, {_other_ranks(t)}" if ranks else ""
    return f"# Run it on each of the {t.nodes} nodes: MAIN_ADDR the main node's address{rank}.\n"


def _other_ranks(t: Tuned) -> str:
    return "1 on the other" if t.nodes == 2 else f"1..{t.nodes - 1} on the others"


def fabric_nodes_note(t: Tuned) -> str:
    """How Lightning (Trainer, Fabric) is started on several nodes ('' on one): its
    LightningEnvironment reads the rendezvous from these variables (SLURM sets its own)."""
    if t.nodes == 1:
        return ""
    return (f"On {t.nodes} nodes: run the same command on each with MASTER_ADDR=<main node address> "
            f"MASTER_PORT={RDZV_PORT} NODE_RANK=<0 on the main node, {_other_ranks(t)}> (under SLURM, Lightning reads "
            "SLURM's variables instead).\n")


def block_import(tuned: Tuned) -> str:
    """Python import of the decoder block class that FSDP wraps, from the transformers model."""
    return f"from transformers.models.{tuned.model_type}.modeling_{tuned.model_type} import {tuned.wrap}"
