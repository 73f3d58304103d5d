"""What a trial is: the model, the cluster, the tuned FSDP knobs and the global batch.

`TrainConfig` holds exactly the knobs the controller varies; `TrialSpec` is everything a
backend needs to evaluate one of them. Both serialise to plain dicts so that trial workers,
the study and the result JSON carry the same fields.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from autotune.problem.catalog.gpus import GPUSpec, GPUS
from autotune.problem.catalog.models import ModelSpec
from autotune.problem import knobs
from autotune.problem.catalog.attention import check_attention
from autotune.util.errors import UsageError
from autotune.problem.knobs import Checkpointing
from autotune.problem.packing import STEP as PACKED_STEP, Packing, check_packing_problem
from autotune.problem.routing import RoutingSkew, parse_routing_skew

Precision = Literal["bf16", "fp16", "fp32", "bf16-pure"]
PARAM_DTYPE_NAMES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
                                     "bf16-pure": "bfloat16"}
"""torch dtype of the parameters FSDP gathers and computes with, by precision (parallel.py
builds the policy from it; named here so what reads it need not import torch)."""
PARAM_DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "bf16-pure": 2}
MASTER_DTYPE_NAMES: dict[str, str] = {"bf16": "float32", "fp16": "float32", "fp32": "float32",
                                      "bf16-pure": "bfloat16"}
"""dtype of the sharded trained parameters, their gradients, the gradient reduction and AdamW's
state: fp32 master weights in mixed precision; bf16 throughout in pure bf16 (LitGPT's `bf16-true`,
torchtune's recipes: no fp32 copy, so small updates can round away: docs/KNOBS.md)."""
MASTER_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2}


def parse_ac(text: Any) -> Checkpointing:
    """An activation-checkpointing value from its string ('none', 'full', 'every:K', 'op')."""
    return Checkpointing.parse(text)


_D = knobs.BY_NAME


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The knobs the controller tunes: one field per entry of autotune.problem.knobs.KNOBS, which
    validates, serialises and labels them (a test checks the two agree)."""

    precision: Precision = _D["precision"].default
    activation_checkpointing: Checkpointing = _D["activation_checkpointing"].default
    cpu_offload: bool = _D["cpu_offload"].default
    activation_offload: bool = _D["activation_offload"].default
    """Saved activations to pinned host memory in forward, back in backward (training.OffloadedActivations)."""
    reshard_after_forward: bool = _D["reshard_after_forward"].default
    micro_batch_size: int = _D["micro_batch_size"].default
    optimizer_impl: str = _D["optimizer_impl"].default
    shard_group_size: int = _D["shard_group_size"].default
    """HSDP: shard within groups of this many GPUs, replicate across them; 0 = every GPU (FSDP)."""
    reshard_group_size: int = _D["reshard_group_size"].default
    """Reshard block parameters after forward to groups of this many GPUs; 0 = as reshard_after_forward."""
    shard_placement: str = _D["shard_placement"].default
    """dim0, or largest: parameters whose first dimension is smaller than the shard group (fused
    experts) shard on their largest evenly divisible dimension (parallel.shard_placement_fn)."""
    expert_parallel: int = _D["expert_parallel"].default
    """Expert-parallel degree: each MoE block's fused experts split over groups of this many GPUs
    (parallel.apply_ep); 1: none."""
    tensor_parallel: int = _D["tensor_parallel"].default
    """Tensor-parallel degree: each block's linears split over groups of this many GPUs (parallel.apply_tp); 1: none."""
    async_tensor_parallel: bool = _D["async_tensor_parallel"].default
    """Async TP: inductor's micro-pipeline pass overlaps the tensor-parallel collectives (parallel.enable_async_tp)."""
    loss_parallel: bool = _D["loss_parallel"].default
    """Loss parallelism: the head split by vocabulary, the loss on each tp GPU's logits (parallel.apply_tp)."""
    context_parallel: int = _D["context_parallel"].default
    """Context-parallel degree: each sequence split over groups of this many GPUs (parallel/context.py); 1: none."""
    pipeline_parallel: int = _D["pipeline_parallel"].default
    """Pipeline-parallel degree: the decoder blocks split into this many stages' worth of ranks (parallel/pipeline.py); 1: none."""
    pipeline_schedule: str = _D["pipeline_schedule"].default
    """The pipeline schedule (knobs.PIPELINE_SCHEDULES); the default where pipeline_parallel is 1."""
    compile: str = _D["compile"].default
    """torch.compile of the decoder blocks: none or blocks (parallel.apply_compile)."""
    float8: str = _D["float8"].default
    """float8 training of the blocks' linears: none, tensorwise or rowwise (parallel.apply_float8)."""

    def __post_init__(self) -> None:
        for knob in knobs.KNOBS:
            object.__setattr__(self, knob.name, knob.parse(getattr(self, knob.name)))
        if self.reshard_group_size and not self.reshard_after_forward:
            # Kept gathered after forward: there is nothing to reshard to a group (one configuration, one name).
            object.__setattr__(self, "reshard_group_size", 0)
        if self.pipeline_parallel == 1:  # no pipeline: no schedule (one configuration, one name)
            object.__setattr__(self, "pipeline_schedule", knobs.BY_NAME["pipeline_schedule"].default)

    @property
    def fsdp_reshard_after_forward(self) -> bool | int:
        """What fully_shard takes for the blocks: a bool, or the group size to reshard to."""
        return self.reshard_group_size or self.reshard_after_forward

    @property
    def ranks_per_batch(self) -> int:
        """GPUs that share one batch: a tensor-parallel group's, a context-parallel group's, a pipeline's
        stages (each holds a share of the blocks and sees every micro-batch)."""
        return self.tensor_parallel * self.context_parallel * self.pipeline_parallel

    @property
    def ac(self) -> Checkpointing:
        return self.activation_checkpointing

    def with_(self, **changes: Any) -> "TrainConfig":
        return replace(self, **changes)

    def label(self, *, omit: tuple[str, ...] = (), short: bool = False) -> str:
        return knobs.label(self.knob_values(), omit=omit, short=short)

    def knob_values(self) -> dict[str, Any]:
        return {knob.name: getattr(self, knob.name) for knob in knobs.KNOBS}

    def to_dict(self) -> dict[str, Any]:
        return knobs.to_json(self.knob_values())

    def cache_key(self) -> tuple:
        return knobs.cache_key(self.knob_values())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        return cls(**{k: data[k] for k in knobs.BY_NAME if k in data})

    @classmethod
    def from_result(cls, document: dict[str, Any]) -> "TrainConfig":
        """The configuration a best.json records (old results: the knobs they predate at what ran)."""
        return cls(**knobs.from_result(document))


GPUS_PER_NODE = 8
"""GPUs per node where the user does not say (--gpus-per-node): what HGX/DGX nodes hold."""


def cluster_nodes(gpus: int, *, nodes: int | None = None, gpus_per_node: int | None = None) -> tuple[int, str]:
    """(nodes, a note or '') from --gpus and what the user gave of --nodes and --gpus-per-node, the one
    convention of tune, trial, plan and sweep: --nodes given wins (GPUs per node = gpus / nodes);
    else nodes of --gpus-per-node GPUs (default 8), one node where the job has no more than that.
    The note says where a single node holds more GPUs than nodes commonly do."""
    if nodes is not None and gpus_per_node is not None and nodes * gpus_per_node != gpus:
        raise UsageError(f"--gpus {gpus} is not --nodes {nodes} x --gpus-per-node {gpus_per_node}: give two of them")
    if nodes is None:
        per_node = gpus_per_node or GPUS_PER_NODE
        if gpus <= per_node:
            nodes = 1
        elif gpus % per_node:
            given = f"--gpus-per-node {gpus_per_node}" if gpus_per_node else f"{per_node} GPUs a node (the default)"
            raise UsageError(f"--gpus {gpus} is not a whole number of nodes of {given}: choose a multiple of "
                             f"{per_node}, or set --gpus-per-node (or --nodes)")
        else:
            nodes = gpus // per_node
    note = ""
    if nodes == 1 and gpus > GPUS_PER_NODE:
        note = (f"one node of {gpus} GPUs (more than the {GPUS_PER_NODE} a node commonly holds: every collective "
                "costed on its links, no HSDP across nodes explored); if they span nodes, pass --nodes or "
                "--gpus-per-node")
    return nodes, note


@dataclass(frozen=True, kw_only=True)
class Cluster:
    num_gpus: int
    num_nodes: int = 1
    gpu: GPUSpec = field(default_factory=lambda: GPUS["h100-80gb"])
    gpu_memory_bytes: int | None = None
    """Capacity per GPU; None means the catalog's."""
    host_memory_bytes: int | None = None
    """Host memory per node, for CPU offload; None means unchecked."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_gpus, int) or self.num_gpus < 1:
            raise UsageError(f"--gpus must be a positive integer, got {self.num_gpus!r}")
        if not isinstance(self.num_nodes, int) or self.num_nodes < 1:
            raise UsageError(f"--nodes must be a positive integer, got {self.num_nodes!r}")
        if self.num_gpus % self.num_nodes:
            raise UsageError(f"--gpus {self.num_gpus} is not divisible by --nodes {self.num_nodes}: "
                             "every node needs the same number of GPUs")

    @property
    def gpus_per_node(self) -> int:
        return self.num_gpus // self.num_nodes

    @property
    def capacity_bytes(self) -> int:
        return self.gpu_memory_bytes if self.gpu_memory_bytes is not None else self.gpu.memory_bytes

    def to_dict(self) -> dict[str, Any]:
        return dict(num_gpus=self.num_gpus, num_nodes=self.num_nodes, gpu=self.gpu.name,
                    gpu_memory_bytes=self.gpu_memory_bytes, host_memory_bytes=self.host_memory_bytes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Cluster":
        from autotune.problem.catalog.gpus import resolve_gpu

        return cls(num_gpus=data["num_gpus"], num_nodes=data.get("num_nodes", 1),
                   gpu=resolve_gpu(data["gpu"]), gpu_memory_bytes=data.get("gpu_memory_bytes"),
                   host_memory_bytes=data.get("host_memory_bytes"))


WORKLOADS: tuple[str, ...] = ("sft", "grpo")
"""`sft`: the GPUs only train. `grpo`: TRL's GRPOTrainer with vLLM colocated (`vllm_mode="colocate"`):
vLLM holds a share of every GPU, and the trained weights are gathered for it after every step."""
TRL_VLLM_GPU_MEMORY_UTILIZATION = 0.3
"""GRPOConfig.vllm_gpu_memory_utilization's default (trl 1.16, trl/trainer/grpo_config.py): the share
`autotune trial --workload grpo` assumes when not given; a tune chooses one instead (autotune/estimate/vllm_share.py)."""
TRL_MAX_COMPLETION_LENGTH = 512
"""GRPOConfig.max_completion_length's default (trl 1.16)."""
TRL_NUM_GENERATIONS = 8
"""GRPOConfig.num_generations' default (trl 1.16)."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What shares the GPUs with the tuned training step."""

    kind: str = "sft"
    vllm_gpu_memory_utilization: float | None = None
    """grpo: the fraction of each GPU's total memory vLLM takes (vLLM's gpu_memory_utilization is a
    fraction of total memory, and vLLM refuses to start unless that much is free); TRL's default
    when not given (a tune replaces it with the share it chooses: vllm_share.choose_share)."""
    max_completion_length: int | None = None
    """grpo: the longest completion vLLM generates (GRPOConfig.max_completion_length; TRL's default
    when not given). The prompt gets the rest of seq_len, which is vllm_max_model_length: prompt +
    completion, the sequences GRPO trains on (trl 1.16 has no max_prompt_length)."""
    num_generations: int | None = None
    """grpo: completions per prompt (GRPOConfig.num_generations); None: TRL's default where it divides
    the tuned global batch, else the largest divisor below it (export._hf.grpo_num_generations)."""

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise UsageError(f"--workload {self.kind!r} is not one of {', '.join(WORKLOADS)}")
        share = self.vllm_gpu_memory_utilization
        if self.kind != "grpo":
            for flag, value in (("--vllm-gpu-memory-utilization", share),
                                ("--max-completion-length", self.max_completion_length),
                                ("--num-generations", self.num_generations)):
                if value is not None:
                    raise UsageError(f"{flag} applies to --workload grpo only (vLLM colocated)")
            return
        if share is None:
            object.__setattr__(self, "vllm_gpu_memory_utilization", TRL_VLLM_GPU_MEMORY_UTILIZATION)
        elif isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share < 1.0:
            raise UsageError(f"--vllm-gpu-memory-utilization {share!r} must be a fraction in (0, 1): the share of "
                             f"each GPU's memory vLLM takes (TRL's default {TRL_VLLM_GPU_MEMORY_UTILIZATION})")
        else:
            object.__setattr__(self, "vllm_gpu_memory_utilization", float(share))
        completion = self.max_completion_length
        if completion is None:
            object.__setattr__(self, "max_completion_length", TRL_MAX_COMPLETION_LENGTH)
        elif isinstance(completion, bool) or not isinstance(completion, int) or completion < 1:
            raise UsageError(f"--max-completion-length {completion!r} must be a positive number of tokens "
                             f"(TRL's default {TRL_MAX_COMPLETION_LENGTH})")
        generations = self.num_generations
        if generations is not None and (isinstance(generations, bool) or not isinstance(generations, int)
                                        or generations < 2):
            raise UsageError(f"--num-generations {generations!r} must be an integer of at least 2: GRPO compares "
                             f"completions of one prompt (TRL's default {TRL_NUM_GENERATIONS})")

    @property
    def weight_sync(self) -> bool:
        """Whether every step ends with the trained weights gathered for vLLM."""
        return self.kind == "grpo"

    def vllm_bytes(self, capacity_bytes: int) -> int:
        return int(capacity_bytes * (self.vllm_gpu_memory_utilization or 0.0))

    def label(self) -> str:
        if self.kind == "sft":
            return "sft"
        return f"grpo (vLLM colocated, {self.vllm_gpu_memory_utilization:g} of each GPU)"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "Workload":
        data = data or {}
        return cls(kind=data.get("kind", "sft"), vllm_gpu_memory_utilization=data.get("vllm_gpu_memory_utilization"),
                   max_completion_length=data.get("max_completion_length"),
                   num_generations=data.get("num_generations"))


def memory_limit_bytes(capacity_bytes: int, *, headroom: float, workload: Workload) -> int:
    """Per-GPU memory training may use: vLLM's share comes off first (a fraction of the total, as
    vLLM counts it), then the headroom off what training is left with."""
    return int((capacity_bytes - workload.vllm_bytes(capacity_bytes)) * (1.0 - headroom))


STACKS: dict[str, str] = {
    "fsdp2": "autotune's own FSDP2 loop (training.train_step)",
    "accelerate": "Accelerate's FSDP2 plugin: forward under autocast, outputs converted to fp32",
    "hf-trainer": "transformers' Trainer on Accelerate's FSDP2 plugin: forward under autocast, outputs "
                  "converted to fp32",
    "trl": "TRL's SFTTrainer on Accelerate's FSDP2 plugin: its fused LM head (no full logits), forward under "
           "autocast",
    "trl-padding-free": "TRL's SFTTrainer with padding-free batches (packing: true, bfd): each micro-batch "
                        "flattened into one row with position_ids, attention through the block-diagonal mask "
                        "transformers builds from them (SDPA); its fused LM head, forward under autocast",
    "torchtitan": "torchtitan",
    "litgpt": "LitGPT",
    "lightning": "Lightning's ModelParallelStrategy (FSDP2)",
    "llama-cookbook": "llama-cookbook",
}
"""The training stacks `--stack` names (default fsdp2): which stack's training step the memory is
predicted for. Not a searched knob: the stack is part of what a trial is (TrialSpec.stack)."""
ACCELERATE_STACKS: tuple[str, ...] = ("accelerate", "hf-trainer", "trl", "trl-padding-free")
"""Stacks that train through Accelerate's FSDP2 plugin, whose step autotune traces (training.stack_forward):
under bf16/fp16 mixed precision, the plugin's MixedPrecisionPolicy (param, reduce and output dtype all the
compute dtype: accelerate 1.15, FullyShardedDataParallelPlugin.set_mixed_precision), the forward wrapped in
autocast and convert_outputs_to_fp32 (Accelerator.prepare_model)."""
TRL_STEPS: tuple[str, ...] = ("trl", "trl-padding-free")
"""TRL SFT's steps (each its own stack and step name): the fused LM head on batches of `micro_batch`
rows of `seq_len` tokens ('trl', TRL's packing_strategy 'wrapped'), or those rows flattened into one
padding-free row ('trl-padding-free', TRL's default 'bfd' packing: training.padding_free_batch)."""
OWN_MODEL_STACKS: tuple[str, ...] = ("torchtitan", "litgpt", "llama-cookbook")
"""Stacks that train a model or step of their own: their memory is predicted for autotune's step on the
Hugging Face model, and said so (stack_note), except torchtitan's and LitGPT's own for the families each
has where its package is importable (OWN_STEPS)."""
OWN_ATTENTION_STACKS: tuple[str, ...] = ("torchtitan", "litgpt")
"""Stacks whose own model runs its own SDPA attention, not transformers' attn_implementation: --attention other
than sdpa is refused for them (catalog/attention.check_attention). llama-cookbook trains transformers' model."""
TORCHTITAN_FAMILIES: dict[str, str] = {"llama": "llama3", "qwen3": "qwen3"}
"""transformers model types whose torchtitan 0.3 model autotune builds, traces and runs (autotune/distributed/titan.py),
and the torchtitan module that has it."""
TORCHTITAN_PRECISIONS: tuple[str, ...] = ("bf16", "fp32")
"""torchtitan's parameter dtypes (--training.mixed-precision-param): bfloat16 under fp32 masters, or float32."""
LITGPT_FAMILIES: dict[str, str] = {"llama": "LLaMAMLP"}
"""transformers model types whose LitGPT 0.5 `GPT` autotune builds, traces and runs (autotune/distributed/litgpt_step.py),
and the MLP class LitGPT's config names for it."""
LITGPT_PRECISIONS: dict[str, str] = {"bf16": "bf16-mixed", "bf16-pure": "bf16-true", "fp32": "32-true"}
"""Fabric's precision string for each tuned precision LitGPT's step is built at (export/_litgpt.py writes the same)."""


@dataclass(frozen=True)
class OwnStep:
    """A stack whose own model and step autotune builds, traces and runs: the package that has them, the
    transformers model types and precisions it is built for."""

    package: str
    families: Mapping[str, str]
    precisions: Collection[str]

    def importable(self) -> bool:
        import importlib.util

        return importlib.util.find_spec(self.package) is not None

    def applies(self, precision: str, model_type: str | None) -> bool:
        return model_type in self.families and precision in self.precisions and self.importable()

    def why_not(self, stack: str) -> str:
        """Why the stack's own step is not traced, where it is not (its package missing, or the model or precision)."""
        if not self.importable():
            return f" ({self.package} is not importable here)"
        return (f" ({STACKS[stack]}'s model is built for {', '.join(self.families)} at "
                f"{'/'.join(self.precisions)} only)")


OWN_STEPS: dict[str, OwnStep] = {
    "torchtitan": OwnStep("torchtitan", TORCHTITAN_FAMILIES, TORCHTITAN_PRECISIONS),
    "litgpt": OwnStep("litgpt", LITGPT_FAMILIES, tuple(LITGPT_PRECISIONS)),
}
"""The stacks whose step is their own where it applies (stack_step returns the stack's name as the step)."""



def check_stack(stack: Any) -> str:
    if stack not in STACKS:
        raise UsageError(f"--stack {stack!r} is not one of {', '.join(STACKS)}")
    return stack


def stack_step(stack: str, precision: str, model_type: str | None = None) -> str:
    """The training step traced and run for `stack` at `precision`: `autotune` (training.train_step's own
    forward), `hf` (Accelerate's: autocast and fp32 outputs, under mixed precision only; Accelerate with
    mixed_precision 'no' runs the plain forward), TRL's (TRL_STEPS: `trl`, SFT's fused LM head plus
    Accelerate's wrapping under mixed precision, and `trl-padding-free`, the same on a padding-free batch)
    `torchtitan` (torchtitan's own model, FSDP units and chunked loss: autotune/distributed/titan.py) or `litgpt` (LitGPT's
    GPT, Block units, Fabric's precision and chunked loss: autotune/distributed/litgpt_step.py), each for the model types
    and precisions of OWN_STEPS where its package is importable."""
    if stack in OWN_STEPS and OWN_STEPS[stack].applies(precision, model_type):
        return stack
    if stack in TRL_STEPS:
        return stack
    if stack in ACCELERATE_STACKS and precision in ("bf16", "fp16"):
        return "hf"
    return "autotune"


def stack_note(stack: str, precision: str, model_type: str | None = None) -> str:
    """What the memory of `stack` is predicted for, in a sentence (best.json, the console, the report)."""
    step = stack_step(stack, precision, model_type)
    if step == "torchtitan":
        return (f"memory predicted for torchtitan's own step: its {TORCHTITAN_FAMILIES[model_type]} model, FSDP units, "
                "checkpointing policy and chunked loss (attention: its SDPA module for FlexAttention)")
    if step == "litgpt":
        return (f"memory predicted for LitGPT's own step: its GPT model, a FSDP2 unit per Block (FSDP1's under "
                f"Fabric), precision {LITGPT_PRECISIONS[precision]} and chunked_cross_entropy")
    if stack in OWN_MODEL_STACKS:
        why = OWN_STEPS[stack].why_not(stack) if stack in OWN_STEPS else ""
        return (f"memory predicted for autotune's step on the Hugging Face model: {STACKS[stack]}'s own model and "
                f"step are not traced{why}")
    if stack in ACCELERATE_STACKS and step == "autotune":
        return (f"memory predicted for the step of {STACKS[stack].split(':')[0]} at {precision} (Accelerate's "
                "mixed_precision 'no': no autocast, no fp32 outputs)")
    return f"memory predicted for the step of {STACKS[stack]}"


def reduce_dtype_name(precision: str, step: str) -> str:
    """The dtype gradients are reduced in: the master dtype, or the compute dtype under Accelerate's
    mixed-precision policy (parallel.mixed_precision_policy)."""
    return PARAM_DTYPE_NAMES[precision] if step in ("hf", "litgpt", *TRL_STEPS) else MASTER_DTYPE_NAMES[precision]


def stack_section(stack: str, precision: str, model_type: str | None = None) -> dict[str, Any]:
    """best.json's `stack`: which stack's step was predicted (schemas/best.schema.json)."""
    return {"name": stack, "step": stack_step(stack, precision, model_type),
            "predicted_for": stack_note(stack, precision, model_type)}


DEFAULT_LORA_TARGETS = "all-linear"
"""peft's name for every linear layer but the output head: the attention and MLP projections,
what TRL's LoRA examples target."""


QLORA_QUANTIZATION = dict(quant_type="nf4", blocksize=64, compress_statistics=True)
"""QLoRA's 4-bit layout: NF4 in blocks of 64 with double quantization of the block scales, the
BitsAndBytesConfig of HF's FSDP-QLoRA guide (bnb_4bit_quant_type nf4, bnb_4bit_use_double_quant);
the packed codes are stored in the compute dtype (bnb_4bit_quant_storage) so that FSDP shards them."""

PEFT_METHODS = ("none", "lora", "qlora")
"""What trains: `none`, every parameter; `lora`, peft adapters on a frozen base; `qlora`, the same
on a base quantized to 4-bit NF4 by bitsandbytes (FineTuning)."""


@dataclass(frozen=True, kw_only=True)
class FineTuning:
    """What trains. `none`: every parameter (a full fine-tune or pretraining). `lora`: the real
    `peft` library wraps the model before FSDP2 (training.apply_finetuning); the base weights are
    frozen (stored in the compute dtype, as TRL and peft users load them, sharded, with no
    gradient or optimizer state) and only the adapters train, in the master dtype. `qlora`: the
    same on a base whose linear layers (but the head) bitsandbytes quantized to QLORA_QUANTIZATION
    (training.quantize_base)."""

    peft: str = "none"
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.05
    targets: str = DEFAULT_LORA_TARGETS
    """Comma-separated module names (peft's target_modules), or `all-linear`."""

    def __post_init__(self) -> None:
        if self.peft not in PEFT_METHODS:
            raise UsageError(f"--peft {self.peft!r} is not one of {', '.join(PEFT_METHODS)}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise UsageError(f"--lora-rank must be a positive integer, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            raise UsageError(f"--lora-alpha must be positive, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise UsageError(f"--lora-dropout must be a fraction in [0, 1), got {self.dropout!r}")
        targets = ",".join(t.strip() for t in str(self.targets).split(",") if t.strip())
        if not targets:
            raise UsageError(f"--lora-targets needs module names (e.g. q_proj,v_proj) or "
                             f"{DEFAULT_LORA_TARGETS}, got {self.targets!r}")
        object.__setattr__(self, "targets", targets)

    @property
    def lora(self) -> bool:
        """Adapters on a frozen base: LoRA and QLoRA."""
        return self.peft in ("lora", "qlora")

    @property
    def qlora(self) -> bool:
        """The frozen base in 4-bit NF4 (bitsandbytes; training.quantize_base)."""
        return self.peft == "qlora"

    @property
    def target_modules(self) -> str | list[str]:
        """peft's target_modules: its `all-linear` shorthand, or the names."""
        return self.targets if self.targets == DEFAULT_LORA_TARGETS else self.targets.split(",")

    def label(self) -> str:
        if not self.lora:
            return "full (every parameter trains)"
        return (f"{'QLoRA' if self.qlora else 'LoRA'} r={self.rank} alpha={self.alpha:g} dropout={self.dropout:g} "
                f"on {self.targets} (peft; base weights frozen{', 4-bit NF4 (bitsandbytes)' if self.qlora else ''})")

    def key(self) -> tuple:
        """What changes the built model: part of every trace's cache key."""
        return (self.peft, self.rank, self.alpha, self.dropout, self.targets) if self.lora else ("none",)

    def to_dict(self) -> dict[str, Any]:
        if not self.lora:
            return {"peft": "none"}
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "FineTuning":
        data = dict(data or {})
        return cls(**{k: data[k] for k in ("peft", "rank", "alpha", "dropout", "targets") if k in data})



def check_float8_gpu(recipe: str, gpu) -> None:
    """A float8 recipe (not `none` or the search's `auto` and `explore`) needs a GPU with float8 tensor cores."""
    if recipe not in ("none", "auto", "explore") and not gpu.has_float8:
        raise UsageError(f"--float8 {recipe}: {gpu.name} has no float8 tensor cores (H100, H200 and Ada GPUs have "
                         "them); use --float8 none")


def check_float8_library(flag: str) -> None:
    """float8 training runs torchao's float8 linears (parallel.apply_float8): without the `float8` extra
    installed, say so in one line before anything is traced or launched."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        raise UsageError(f"{flag}: float8 training needs torchao, the float8 extra: pip install 'autotune[float8]' "
                         "(beside a CUDA torch: pip install --no-deps torchao); or use --float8 none")


def problem_shape(model: ModelSpec, cluster: "Cluster", seq_len: int = 0, *, packed: bool = False,
                  step: str = "autotune") -> knobs.ProblemShape:
    """What knobs.check_combination checks a configuration against: this model, cluster, sequence length,
    whether batches are packed (autotune/problem/packing.py) and the training step (stack_step)."""
    return knobs.ProblemShape(num_gpus=cluster.num_gpus, gpus_per_node=cluster.gpus_per_node, model=model,
                              seq_len=seq_len, packed=packed, step=step)


@dataclass(frozen=True, kw_only=True)
class TrialSpec:
    """Everything a backend needs to evaluate one configuration."""

    model: ModelSpec
    cluster: Cluster
    seq_len: int
    train: TrainConfig
    grad_accum_steps: int = 1
    memory_limit_bytes: int | None = None
    """Usable memory per GPU (`memory_limit_bytes()`); a trial over it is out of memory."""
    workload: Workload = field(default_factory=Workload)
    finetuning: FineTuning = field(default_factory=FineTuning)
    stack: str = "fsdp2"
    """Whose training step runs (STACKS): what the simulator traces and a real trial runs."""
    routing_skew: RoutingSkew = field(default_factory=RoutingSkew)
    """How the MoE router spreads tokens over the experts (autotune/problem/routing.py): an assumption of the
    problem; with expert parallelism the simulator traces the binding rank and a real trial forces it."""
    packing: Packing | None = None
    """Token-budget batches (autotune/problem/packing.py): each micro-batch one packed row of whole documents of up to
    micro_batch_size x seq_len tokens; None: rows of one sequence each."""

    def __post_init__(self) -> None:
        check_stack(self.stack)
        if self.packing is not None:
            check_packing_problem(stack=self.stack, config=self.model.config_dict, model_name=self.model.name)
        object.__setattr__(self, "routing_skew", parse_routing_skew(self.routing_skew))
        if not self.routing_skew.balanced:
            self.routing_skew.check_experts(self.model.num_experts, self.model.name)
        check_float8_gpu(self.train.float8, self.cluster.gpu)
        check_attention(self.model.attention, model=self.model, gpu=self.cluster.gpu, precision=self.train.precision,
                        own_attention=self.stack in OWN_ATTENTION_STACKS, packed=self.packing is not None)
        if self.train.float8 != "none" and self.finetuning.lora:
            raise UsageError(f"--float8 {self.train.float8} with --peft {self.finetuning.peft}: float8 training converts the frozen "
                             "base linears too (not supported here); use --float8 none")
        # Every knob against the cluster, the model and the other knobs: knobs.check_combination.
        values = knobs.check_combination(self.train.knob_values(), problem_shape(
            self.model, self.cluster, self.seq_len, packed=self.packing is not None, step=self.step))
        if values != self.train.knob_values():
            object.__setattr__(self, "train", TrainConfig(**values))
        if self.train.pipeline_parallel > 1:
            why = knobs.why_no_pipeline_schedule(schedule=self.train.pipeline_schedule,
                                                 degree=self.train.pipeline_parallel, microbatches=self.grad_accum_steps)
            if why:
                raise UsageError(f"--pp {self.train.pipeline_parallel} at micro-batch {self.train.micro_batch_size}: {why}")

    @property
    def limit_bytes(self) -> int:
        return self.memory_limit_bytes if self.memory_limit_bytes is not None else self.cluster.capacity_bytes

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step of the job takes: each data rank's micro-batches (a tensor-parallel group, a
        context-parallel group and a pipeline's stages share one batch), as costmodel.StepWork.tokens_per_step
        counts them. A step's seconds are these over the job's tokens/s."""
        return (self.train.micro_batch_size * self.seq_len * self.grad_accum_steps * self.cluster.num_gpus
                // self.train.ranks_per_batch)

    def with_train(self, train: TrainConfig) -> "TrialSpec":
        return replace(self, train=train)

    def to_dict(self) -> dict[str, Any]:
        return dict(model=self.model.to_dict(), cluster=self.cluster.to_dict(), seq_len=self.seq_len,
                    train=self.train.to_dict(), grad_accum_steps=self.grad_accum_steps,
                    memory_limit_bytes=self.memory_limit_bytes, workload=self.workload.to_dict(),
                    finetuning=self.finetuning.to_dict(), stack=self.stack,
                    # Only where stated: balanced specs keep the keys (and cached predictions) they had.
                    **({"routing_skew": self.routing_skew.to_dict()} if not self.routing_skew.balanced else {}),
                    **({"packing": self.packing.to_dict()} if self.packing is not None else {}))

    @property
    def token_budget(self) -> int:
        """Tokens of a packed micro-batch at most (0: not packed)."""
        return self.train.micro_batch_size * self.seq_len if self.packing is not None else 0

    @property
    def documents(self) -> tuple[int, ...]:
        """The document lengths of the micro-batch traced and run (a packed problem's worst case), or ()."""
        return self.packing.worst_case_documents(self.token_budget, self.seq_len) if self.packing is not None else ()

    @property
    def step(self) -> str:
        """The step traced and run (stack_step; 'packed' for token-budget batches on autotune's own step)."""
        if self.packing is not None:
            return PACKED_STEP
        return stack_step(self.stack, self.train.precision, self.model.model_type)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrialSpec":
        return cls(model=ModelSpec.from_dict(data["model"]), cluster=Cluster.from_dict(data["cluster"]),
                   seq_len=data["seq_len"], train=TrainConfig.from_dict(data["train"]),
                   grad_accum_steps=data.get("grad_accum_steps", 1),
                   memory_limit_bytes=data.get("memory_limit_bytes"),
                   workload=Workload.from_dict(data.get("workload")),
                   finetuning=FineTuning.from_dict(data.get("finetuning")), stack=data.get("stack", "fsdp2"),
                   routing_skew=RoutingSkew.from_dict(data.get("routing_skew")),
                   packing=Packing.from_dict(data.get("packing")))
