"""The tuned knobs, defined once.

Each `Knob` says what a `TrainConfig` field is: its type and default, how a value is read from
the command line or a stored result (old spellings included), how it is written to JSON, its
Optuna parameter, its fragment of a configuration's label, where it sits in best.json and its
CLI flag. Everything that lists knobs derives from `KNOBS`: TrainConfig's validation and
serialisation, the `trial` command's flags, the study's flattened parameters, best.json's fsdp
section, the simulator's cache keys (so a new knob can never reuse a stale trace) and the
exporters' completeness check (every exporter must account for every knob).

Adding a knob: one `Knob` entry below, the TrainConfig field, and its apply/trace code in
parallel.py (docs/KNOBS.md).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, Literal

from autotune.util.errors import UsageError

PRECISIONS: tuple[str, ...] = ("bf16", "fp16", "fp32", "bf16-pure")
"""bf16 / fp16: mixed precision (fp32 master weights, gradients reduced in fp32, compute in the
half type); fp32 throughout; bf16-pure: parameters, gradients, reduction and AdamW state in bf16,
no fp32 copy (LitGPT's `bf16-true`, torchtune's default recipes)."""
OPTIMIZER_IMPLS: tuple[str, ...] = ("fused", "foreach", "for-loop")
"""AdamW implementations: `fused` (one kernel per step: HF Trainer's and torchtitan's default on GPUs),
`foreach` (torch.optim's default on CUDA: temporaries for a whole group of parameters at once),
`for-loop` (one parameter at a time: the least memory)."""
COMPILE_MODES: tuple[str, ...] = ("none", "blocks")
"""torch.compile: `none` (eager), `blocks`: each decoder block's forward compiled with
`fullgraph=True` after checkpointing wraps it and before FSDP2 shards it, as torchtitan's
`apply_compile` and FSDP2's documentation do (the root, embeddings, head and loss stay eager;
FSDP2's hooks run eager between the compiled blocks). Whole-model compile is not a value: no
stack autotune exports to compiles an FSDP2 model whole by default (docs/COMPILE.md)."""
SHARD_PLACEMENTS: tuple[str, ...] = ("dim0", "largest")
"""Which dimension FSDP2 shards a parameter on (fully_shard's shard_placement_fn). `dim0`: every
parameter on its first dimension (FSDP2's default). `largest`: a multi-dimensional parameter whose
first dimension is smaller than the shard group (a fused expert weight, [experts, ...], on more ranks
than experts) on its largest dimension that the group divides evenly, as torchtitan shards experts
on dimension 1; every other parameter on its first."""
FLOAT8_RECIPES: tuple[str, ...] = ("none", "tensorwise", "rowwise")
"""float8 training of the decoder blocks' linears (torchao's convert_to_float8_training, as torchtitan's
float8 converter: lm_head and linears with a dimension not divisible by 16 stay high precision).
`tensorwise`: one dynamic scale per tensor, with FSDP2's float8 all-gather of the weights
(`enable_fsdp_float8_all_gather`, scales precomputed after each optimizer step); `rowwise`: torchao's
rowwise recipe (a scale per row, communication in high precision). Needs a GPU with float8 tensor
cores (catalog `float8_tflops`: H100, H200, Ada); docs/COMPILE.md."""
FLOAT8_SEARCH = ("auto", "none", "explore", "tensorwise", "rowwise")
"""float8 in the search (--float8, and the search space's float8.mode): `auto` (the default), `explore`
where the run can evaluate float8 (a GPU with float8, torchao installed, not real CPU trials, not LoRA,
not a stack's own step, not the closed form), else `none` with the reason in the run's notes; `none`; `explore`, the graph
high precision, then its fastest fitting candidates tried with each recipe (predicted first, as every
trial; only on a GPU with float8); `tensorwise` / `rowwise`, every trial with that recipe."""
PIPELINE_SCHEDULES: tuple[str, ...] = ("1F1B", "Interleaved1F1B", "GPipe")
"""torch.distributed.pipelining's schedules, by its names (torchtitan's `pipeline_parallel_schedule`): `1F1B`
(one stage per rank, stage s keeps up to pp - s micro-batches' activations in flight), `Interleaved1F1B`
(PIPELINE_VIRTUAL_STAGES stages per rank, round-robin: a smaller bubble for more p2p sends), `GPipe` (every
micro-batch's forward, then every backward: all in flight at once)."""
PIPELINE_VIRTUAL_STAGES: dict[str, int] = {"1F1B": 1, "GPipe": 1, "Interleaved1F1B": 2}
"""Stages each rank holds under a schedule (torchtitan's default for its multi-stage schedules: 2 per rank)."""
COMPILE_BACKEND = "inductor"
"""What real trials and the exports compile blocks with (torch.compile's default)."""
COMPILE_SEARCH = ("auto", "none", "explore", "blocks")
"""torch.compile in the search (--compile, and the search space's compile.mode): `auto` (the default),
`explore` unless trials are real CPU trials or a stack's own step (then `none`, the reason in the run's
notes); `none`, every trial
eager; `explore`, the graph eager, then its fastest fitting candidates compiled (each predicted
first, as every trial); `blocks`, every trial compiled."""


def shard_dim(shape: tuple[int, ...], shard_size: int, placement: str) -> int:
    """The dimension a parameter of `shape` is sharded on over `shard_size` ranks.

    `dim0` is FSDP2's default. `largest` moves a multi-dimensional parameter whose first dimension
    is smaller than the shard group (fused experts, [experts, ...], on more ranks than experts:
    dim-0 shards would be padding on most ranks, and the padding grows with the GPU count) to its
    largest dimension that `shard_size` divides (FSDP2 shards a dimension other than 0 only
    evenly), as torchtitan's fsdp.py puts experts on Shard(1) when the FSDP degree exceeds them."""
    if placement == "dim0" or len(shape) < 2 or shape[0] >= shard_size:
        return 0
    even = [d for d in range(1, len(shape)) if shape[d] % shard_size == 0]
    return max(even, key=lambda d: (shape[d], -d)) if even else 0


def shapes_moved_by_placement(shapes, shard_size: int) -> list[tuple[int, ...]]:
    """Of a model's block parameter `shapes` (ModelSpec.block_param_shapes), those
    `--shard-placement largest` shards off dimension 0 on a shard group of `shard_size` ranks
    (none: it is the default placement)."""
    return [shape for shape in shapes if shard_dim(shape, shard_size, "largest")]


def float8_converts(shape: tuple[int, ...]) -> bool:
    """Whether float8 training converts a block linear whose weight has `shape`: both dimensions
    divisible by 16, the float8 matmul's requirement (torchtitan's float8 converter skips the others)."""
    return len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % 16 == 0


# --- activation checkpointing: a typed value -------------------------------------------------------

AC_MODES: tuple[str, ...] = ("none", "full", "every", "op")
OP_POLICIES: tuple[str, ...] = ("alt-mm", "mm")
"""Op-level selective checkpointing policies: `alt-mm` saves every other matmul's output
(torchtitan's `op` selective AC: mm, attention and reduce-scatter outputs are saved, but only
every second mm), `mm` saves every matmul's output; everything else is recomputed."""
_EVERY = re.compile(r"^every[:\-](\d+)$")
_OP = re.compile(r"^(?:op|selective-op|sac)(?:[:\-]([a-z\-]+))?$")


@dataclass(frozen=True, slots=True, eq=False)
class Checkpointing:
    """Activation checkpointing of the decoder blocks.

    none: nothing recomputed. full: every block checkpointed whole. every (K >= 2): blocks 0, K,
    2K, ... checkpointed whole (torchtitan's selective layer AC). op: every block checkpointed
    with an op-level policy (torch.utils.checkpoint.create_selective_checkpoint_contexts) that
    saves matmul outputs and recomputes the rest.
    """

    mode: Literal["none", "full", "every", "op"] = "none"
    every: int = 1
    policy: str = ""

    def __post_init__(self) -> None:
        if self.mode not in AC_MODES:
            raise UsageError(f"activation checkpointing mode {self.mode!r} is not one of {', '.join(AC_MODES)}")
        if self.mode == "every" and (not isinstance(self.every, int) or self.every < 2):
            raise UsageError(f"every:K checkpointing needs K >= 2, got {self.every!r} (every:1 is 'full')")
        if self.mode == "op" and self.policy not in OP_POLICIES:
            raise UsageError(f"op-level checkpointing policy {self.policy!r} is not one of {', '.join(OP_POLICIES)}")

    @classmethod
    def parse(cls, value: Any) -> "Checkpointing":
        """From a Checkpointing, its string ('none', 'full', 'every:K', 'op', 'op:mm') or the dict
        to_json wrote. Results stored before the type existed hold the strings."""
        if isinstance(value, Checkpointing):
            return value
        if isinstance(value, dict):
            return cls(**value)
        text = str(value).strip().lower()
        if text in ("none", "full"):
            return cls(mode=text)
        match = _EVERY.match(text)
        if match and int(match.group(1)) >= 1:
            k = int(match.group(1))
            return cls(mode="full") if k == 1 else cls(mode="every", every=k)
        match = _OP.match(text)
        if match and (match.group(1) or "alt-mm") in OP_POLICIES:
            return cls(mode="op", policy=match.group(1) or "alt-mm")
        raise UsageError(f"activation checkpointing {value!r} is not one of none, full, every:K (K a positive "
                         f"integer, e.g. every:2), op (op-level: {', '.join('op:' + p for p in OP_POLICIES)})")

    def __str__(self) -> str:
        if self.mode == "every":
            return f"every:{self.every}"
        if self.mode == "op":
            return "op" if self.policy == "alt-mm" else f"op:{self.policy}"
        return self.mode

    def __eq__(self, other: object) -> bool:
        """Equal to another Checkpointing or to a string naming the same value (stored results and
        callers written before the type compare with 'none', 'full', 'every:K')."""
        if isinstance(other, str):
            try:
                other = Checkpointing.parse(other)
            except UsageError:
                return False
        return isinstance(other, Checkpointing) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    @property
    def block_every(self) -> int | None:
        """Blocks wrapped in a checkpoint, one every this many: None for none, 1 for full and op."""
        return {"none": None, "full": 1, "op": 1}.get(self.mode, self.every)

    def wraps_block(self, index: int) -> bool:
        every = self.block_every
        return every is not None and index % every == 0

    def blocks(self, num_layers: int) -> frozenset[int]:
        """The blocks wrapped in a model of `num_layers`: on a 2-layer model every:2 and every:4
        are the same configuration."""
        return frozenset(i for i in range(num_layers) if self.wraps_block(i))


# --- the registry ------------------------------------------------------------------------------


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise UsageError(f"expected true or false, got {value!r}")


def _choice(name: str, choices: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in choices:
            raise UsageError(f"{name} {value!r} is not one of {', '.join(choices)}")
        return value
    return parse


def _positive(name: str) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be a positive integer, got {value!r}")
        return value
    return parse


def _group_size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(f"HSDP shard group size must be 0 (shard over every GPU) or a positive number of GPUs, "
                         f"got {value!r}")
    return value


def _degree(kind: str) -> Callable[[Any], int]:
    """The parse of a parallelism degree (`kind`: expert, tensor, context): a positive number of GPUs, 1 none."""
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{kind}-parallel degree must be a positive number of GPUs (1: no {kind} parallelism), "
                             f"got {value!r}")
        return value
    return parse


def _reshard_group(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value == 1:
        raise UsageError(f"reshard group size must be 0 (reshard over the whole shard group, or not at all with "
                         f"--no-reshard) or a number of GPUs >= 2, got {value!r} (1 is --no-reshard)")
    return value


@dataclass(frozen=True, kw_only=True)
class Knob:
    """One tuned knob: a TrainConfig field and everything derived from it."""

    name: str
    """The TrainConfig field."""
    default: Any
    help: str
    parse: Callable[[Any], Any]
    """A CLI or stored value to the typed value; UsageError (one line, how to fix) when invalid."""
    flag: str
    """The `trial` command's flag."""
    result_path: tuple[str, ...]
    """Where best.json holds the value."""
    legacy_default: Any = None
    """What a best.json written before the knob existed ran (None: the default)."""
    label: Callable[[Any], str] = lambda value: ""
    """The fragment of TrainConfig.label(): '' when it says nothing."""
    short: Callable[[Any], str] | None = None
    """The fragment in an 80-column table, where it differs from the label (None: the label)."""
    to_json: Callable[[Any], Any] = lambda value: value
    optuna: Callable[[Any], dict[str, tuple[Any, Any]]] | None = None
    """value -> {parameter: (encoded value, distribution factory)}: fixed value spaces, since a
    study refuses a parameter whose space changes between trials."""
    choices: tuple[Any, ...] | None = None
    boolean: bool = False
    alternative: Any = None
    """A valid non-default value (tests change every knob to it: each must change the cache key)."""
    alternative_with: dict[str, Any] = dataclass_field(default_factory=dict)
    """Other knobs' values the alternative needs to mean anything (a pipeline schedule needs a pipeline)."""
    keyed_at_default: bool = True
    """False for knobs added after studies existed: a trial's identity (records.config_key)
    leaves them out at their default, so a resumed study still finds its old trials."""
    domain: Callable[["SampleContext"], tuple[Any, ...]] | None = None
    """The values the sampler beyond the graph draws from (None: the default only)."""

    def add_argument(self, parser: argparse._ActionsContainer) -> None:
        dest = self.name
        if self.boolean:
            parser.add_argument(self.flag, dest=dest, action=argparse.BooleanOptionalAction,
                                default=self.default, help=self.help)
        else:
            parser.add_argument(self.flag, dest=dest, default=self.to_json(self.default), help=self.help,
                                choices=self.choices, type=type(self.to_json(self.default)))

    def from_result(self, document: dict[str, Any]) -> Any:
        node: Any = document
        for part in self.result_path:
            if not isinstance(node, dict) or part not in node:
                return self.default if self.legacy_default is None else self.legacy_default
            node = node[part]
        return node


@dataclass(frozen=True, kw_only=True)
class SampleContext:
    """What bounds the sampled space beyond the graph: the problem and the search-space file."""

    precision: str
    """The graph's precision (sampling never changes the numerics)."""
    micro_batches: tuple[int, ...]
    """Micro-batches whose global batch is within tolerance."""
    num_layers: int
    checkpointing: bool = True
    op_level: bool = True
    offload: bool = True
    activation_offload: bool = True
    reshard: tuple[bool, ...] = (True, False)
    compile_modes: tuple[str, ...] = ("none",)
    """torch.compile values the sampler may draw (`blocks` where the search space allows it)."""
    float8_recipes: tuple[str, ...] = ("none",)
    """float8 recipes the sampler may draw (beyond none only on a GPU with float8, where the search allows it)."""
    placements: tuple[str, ...] = ("dim0",)
    """Shard placements that change something (`largest` where a parameter's first dimension is
    smaller than the shard group)."""
    expert_parallel: tuple[int, ...] = (1,)
    """Expert-parallel degrees that apply (an MoE model: degrees dividing both its experts and the GPUs)."""
    tensor_parallel: tuple[int, ...] = (1,)
    """Tensor-parallel degrees that apply (tensor_parallel_degrees: a model with a plan, degrees within a node)."""
    context_parallel: tuple[int, ...] = (1,)
    """Context-parallel degrees that apply (context_parallel_degrees)."""
    pipeline_parallel: tuple[int, ...] = (1,)
    """Pipeline-parallel degrees that apply (pipeline_parallel_degrees)."""
    pipeline_schedules: tuple[str, ...] = ("1F1B",)
    """Pipeline schedules the sampler may draw (only where a degree above 1 applies)."""
    async_tensor_parallel: tuple[bool, ...] = (False,)
    """Async TP values (both where tensor-parallel degrees and compiled blocks are drawn and trials run it)."""
    loss_parallel: tuple[bool, ...] = (False,)
    """Loss-parallel values (both where tensor-parallel degrees are drawn and the search allows it)."""
    hsdp_groups: tuple[int, ...] = ()
    """HSDP group sizes that apply (several nodes): node, 2 nodes, ..."""
    reshard_groups: tuple[int, ...] = ()
    """Reshard-after-forward group sizes that apply (several nodes): a node's GPUs."""

    def every(self) -> tuple[int, ...]:
        """every:K values checkpointing distinct sets of blocks (K up to the number of layers)."""
        seen, values = {frozenset(range(self.num_layers))}, []  # full's blocks
        for k in range(2, max(2, self.num_layers) + 1):
            blocks = Checkpointing(mode="every", every=k).blocks(self.num_layers)
            if blocks not in seen:
                seen.add(blocks)
                values.append(k)
        return tuple(values[:6])  # the lightest few: beyond every:7, one block in eight changes little


def _ac_domain(ctx: SampleContext) -> tuple[Checkpointing, ...]:
    if not ctx.checkpointing:
        return (Checkpointing(),)
    return (Checkpointing(), Checkpointing(mode="full"), *(Checkpointing(mode="every", every=k) for k in ctx.every()),
            *((Checkpointing(mode="op", policy=p) for p in OP_POLICIES) if ctx.op_level else ()))


def _int_param(name: str, encode: Callable[[Any], int]):
    def params(value: Any) -> dict[str, tuple[Any, Any]]:
        from optuna.distributions import IntDistribution

        return {name: (encode(value), lambda: IntDistribution(0, 1 << 16))}
    return params


def _categorical_param(name: str, choices: tuple[Any, ...], encode: Callable[[Any], Any] = lambda v: v):
    def params(value: Any) -> dict[str, tuple[Any, Any]]:
        from optuna.distributions import CategoricalDistribution

        return {name: (encode(value), lambda: CategoricalDistribution(list(choices)))}
    return params


def _precision_params(value: str) -> dict[str, tuple[Any, Any]]:
    # The first three precisions keep the distribution studies were created with (Optuna refuses a
    # parameter whose choices change); pure bf16 is bf16 compute plus a parameter only it carries.
    if value == "bf16-pure":
        return {**_categorical_param("precision", PRECISIONS[:3])("bf16"),
                **_categorical_param("master_dtype", ("bfloat16",))("bfloat16")}
    return _categorical_param("precision", PRECISIONS[:3])(value)


def _ac_params(value: Checkpointing) -> dict[str, tuple[Any, Any]]:
    params = _int_param("checkpoint_every", lambda v: 0 if v.mode in ("none", "op") else v.block_every)(value)
    if value.mode == "op":  # a parameter only op-level trials carry: older studies stay valid
        params.update(_categorical_param("checkpoint_op_policy", OP_POLICIES)(value.policy))
    return params


KNOBS: tuple[Knob, ...] = (
    Knob(name="precision", default="bf16", flag="--precision", choices=PRECISIONS,
         parse=_choice("precision", PRECISIONS), result_path=("precision",),
         help="parameter/compute dtype: bf16, fp16 (mixed: fp32 master weights, gradients reduced in fp32), "
              "fp32, or bf16-pure (everything in bf16, no fp32 copy)",
         label=lambda v: v, optuna=_precision_params, alternative="fp32",
         domain=lambda ctx: (ctx.precision,)),
    Knob(name="micro_batch_size", default=1, flag="--micro-batch", parse=_positive("micro-batch size"),
         result_path=("micro_batch_size",), help="sequences per GPU per forward/backward",
         label=lambda v: f"mb={v}", optuna=_int_param("micro_batch_size", int), alternative=2,
         domain=lambda ctx: ctx.micro_batches),
    Knob(name="activation_checkpointing", default=Checkpointing(), flag="--ac", parse=Checkpointing.parse,
         result_path=("fsdp", "activation_checkpointing"), to_json=str,
         help="activation checkpointing: none, full, every:K (blocks 0, K, 2K, ...) or op / op:mm "
              "(op-level selective: save every other / every matmul output, recompute the rest)",
         label=lambda v: f"ac={v}", optuna=_ac_params, alternative=Checkpointing(mode="op", policy="alt-mm"),
         domain=_ac_domain),
    Knob(name="cpu_offload", default=False, flag="--offload", parse=_bool, boolean=True,
         result_path=("fsdp", "cpu_offload"),
         help="FSDP2 CPUOffloadPolicy: sharded params, grads and optimizer state live on the host",
         label=lambda v: "offload" if v else "", optuna=_categorical_param("cpu_offload", (False, True)),
         alternative=True, domain=lambda ctx: (False, True) if ctx.offload else (False,)),
    Knob(name="activation_offload", default=False, flag="--activation-offload", parse=_bool, boolean=True,
         result_path=("fsdp", "activation_offload"),
         help="tensors saved for backward (not parameters, at least 1 KiB: torchtune's rule) go to pinned host "
              "memory in forward and come back in backward (training.OffloadedActivations); GPUs only",
         label=lambda v: "act-offload" if v else "", short=lambda v: "act-off" if v else "",
         optuna=lambda v: _categorical_param("activation_offload", (False, True))(v) if v else {},
         alternative=True, keyed_at_default=False,
         domain=lambda ctx: (False, True) if ctx.activation_offload else (False,)),
    Knob(name="reshard_after_forward", default=True, flag="--reshard", parse=_bool, boolean=True,
         result_path=("fsdp", "reshard_after_forward"),
         help="free gathered block parameters after forward (ZeRO-3); --no-reshard keeps them (ZeRO-2-like)",
         label=lambda v: "" if v else "no-reshard", short=lambda v: "" if v else "no-rs",
         optuna=_categorical_param("reshard_after_forward", (True, False)), alternative=False,
         domain=lambda ctx: ctx.reshard),
    Knob(name="shard_group_size", default=0, flag="--hsdp", parse=_group_size,
         result_path=("fsdp", "shard_group_size"),
         help="HSDP: shard parameters within groups of this many GPUs (dividing the GPUs per node) and "
              "replicate across groups (a 2-D mesh: replicate x shard); 0 shards over every GPU (plain FSDP)",
         label=lambda v: f"hsdp={v}" if v else "", optuna=_int_param("shard_group_size", int), alternative=2,
         keyed_at_default=False, domain=lambda ctx: (0, *ctx.hsdp_groups)),
    Knob(name="reshard_group_size", default=0, flag="--reshard-group", parse=_reshard_group,
         result_path=("fsdp", "reshard_group_size"),
         help="after forward, reshard block parameters to groups of this many GPUs (a factor of the shard "
              "group, e.g. a node's GPUs: backward's all-gather stays within the group) instead of over the "
              "whole shard group; FSDP2's reshard_after_forward=N. 0: as --reshard says (--no-reshard ignores it)",
         label=lambda v: f"reshard={v}" if v else "", optuna=_int_param("reshard_group_size", int), alternative=2,
         keyed_at_default=False, domain=lambda ctx: (0, *ctx.reshard_groups)),
    Knob(name="optimizer_impl", default="fused", flag="--optimizer-impl", choices=OPTIMIZER_IMPLS,
         parse=_choice("optimizer implementation", OPTIMIZER_IMPLS), result_path=("optimizer", "impl"),
         legacy_default="for-loop",  # results written before the knob existed ran the per-parameter loop
         help="AdamW implementation traced and run (default fused, as HF Trainer and torchtitan use on GPUs); "
              "exports pin it, so the memory a user gets is the memory predicted",
         label=lambda v: "" if v == "fused" else f"adamw={v}",
         optuna=_categorical_param("optimizer_impl", OPTIMIZER_IMPLS), alternative="foreach",
         domain=lambda ctx: OPTIMIZER_IMPLS),
    Knob(name="shard_placement", default="dim0", flag="--shard-placement", choices=SHARD_PLACEMENTS,
         parse=_choice("shard placement", SHARD_PLACEMENTS), result_path=("fsdp", "shard_placement"),
         help="which dimension FSDP2 shards parameters on: dim0 (FSDP2's default) or largest (a parameter whose "
              "first dimension is smaller than the shard group, e.g. fused experts on more GPUs than experts, "
              "on its largest evenly divisible dimension, as torchtitan shards experts)",
         label=lambda v: "" if v == "dim0" else f"shard={v}",
         optuna=_categorical_param("shard_placement", SHARD_PLACEMENTS), alternative="largest",
         keyed_at_default=False, domain=lambda ctx: ctx.placements),
    Knob(name="expert_parallel", default=1, flag="--ep", parse=_degree("expert"),
         result_path=("fsdp", "expert_parallel"),
         help="expert parallelism: the fused experts of each MoE block split over groups of this many GPUs "
              "(each holds experts/N whole experts, tokens reach them by all-to-all), FSDP sharding each "
              "expert over the other GPUs/N; every other parameter sharded over every GPU. 1: none "
              "(docs/KNOBS.md, expert parallelism)",
         label=lambda v: f"ep={v}" if v > 1 else "", optuna=lambda v: _int_param("expert_parallel", int)(v) if v > 1 else {},
         alternative=2, keyed_at_default=False, domain=lambda ctx: ctx.expert_parallel),
    Knob(name="tensor_parallel", default=1, flag="--tp", parse=_degree("tensor"),
         result_path=("parallelism", "tensor_parallel"),
         help="tensor parallelism: each decoder block's linears split over groups of this many GPUs within a node, "
              "as the model's tensor-parallel plan says (transformers' base_model_tp_plan: colwise/rowwise), the "
              "group sharing one batch; FSDP shards over the GPUs/N data ranks. 1: none (docs/KNOBS.md)",
         label=lambda v: f"tp={v}" if v > 1 else "", optuna=lambda v: _int_param("tensor_parallel", int)(v) if v > 1 else {},
         alternative=2, keyed_at_default=False, domain=lambda ctx: ctx.tensor_parallel),
    Knob(name="async_tensor_parallel", default=False, flag="--async-tp", parse=_bool, boolean=True,
         result_path=("parallelism", "async_tensor_parallel"),
         help="async tensor parallelism (torchtitan's enable_async_tensor_parallel): inductor's micro-pipeline pass "
              "splits each tensor-parallel all-gather and reduce-scatter into per-rank chunks over symmetric memory "
              "that overlap the matmul they feed or follow; needs --tp and --compile blocks, CUDA GPUs only "
              "(docs/KNOBS.md)",
         label=lambda v: "async-tp" if v else "", short=lambda v: "atp" if v else "",
         optuna=lambda v: _categorical_param("async_tensor_parallel", (False, True))(v) if v else {},
         alternative=True, alternative_with={"tensor_parallel": 2, "compile": "blocks"}, keyed_at_default=False,
         domain=lambda ctx: ctx.async_tensor_parallel),
    Knob(name="loss_parallel", default=False, flag="--loss-parallel", parse=_bool, boolean=True,
         result_path=("parallelism", "loss_parallel"),
         help="loss parallelism (torchtitan's default under TP): the LM head split by vocabulary over the "
              "tensor-parallel GPUs, the logits and the cross-entropy computed on each GPU's share (torch's "
              "loss_parallel); needs --tp and an untied head (docs/KNOBS.md)",
         label=lambda v: "loss-par" if v else "", short=lambda v: "lp" if v else "",
         optuna=lambda v: _categorical_param("loss_parallel", (False, True))(v) if v else {},
         alternative=True, alternative_with={"tensor_parallel": 2}, keyed_at_default=False,
         domain=lambda ctx: ctx.loss_parallel),
    Knob(name="context_parallel", default=1, flag="--cp", parse=_degree("context"),
         result_path=("parallelism", "context_parallel"),
         help="context parallelism: each sequence split over groups of this many GPUs (torch's ring attention "
              "through SDPA, head-tail load balanced), the group sharing one batch; FSDP shards over every GPU. "
              "1: none (docs/KNOBS.md)",
         label=lambda v: f"cp={v}" if v > 1 else "", optuna=lambda v: _int_param("context_parallel", int)(v) if v > 1 else {},
         alternative=2, keyed_at_default=False, domain=lambda ctx: ctx.context_parallel),
    Knob(name="pipeline_parallel", default=1, flag="--pp", parse=_degree("pipeline"),
         result_path=("parallelism", "pipeline_parallel"),
         help="pipeline parallelism: the decoder blocks split into stages over groups of this many GPUs (torch's "
              "pipelining: each stage on its own GPUs, activations sent stage to stage, the accumulation steps "
              "its micro-batches), FSDP sharding each stage over the GPUs/N data ranks. 1: none (docs/PIPELINE.md)",
         label=lambda v: f"pp={v}" if v > 1 else "", optuna=lambda v: _int_param("pipeline_parallel", int)(v) if v > 1 else {},
         alternative=2, alternative_with={"pipeline_schedule": "GPipe"},  # one micro-batch: GPipe runs it
         keyed_at_default=False, domain=lambda ctx: ctx.pipeline_parallel),
    Knob(name="pipeline_schedule", default="1F1B", flag="--pp-schedule", choices=PIPELINE_SCHEDULES,
         parse=_choice("pipeline schedule", PIPELINE_SCHEDULES), result_path=("parallelism", "pipeline_schedule"),
         help="the pipeline schedule under --pp (torch.distributed.pipelining's): 1F1B, Interleaved1F1B (2 stages "
              "per GPU) or GPipe; ignored without --pp",
         label=lambda v: "" if v == "1F1B" else f"pp-sched={v}", short=lambda v: "" if v == "1F1B" else f"{v[:5]}",
         optuna=lambda v: _categorical_param("pipeline_schedule", PIPELINE_SCHEDULES)(v) if v != "1F1B" else {},
         alternative="GPipe", alternative_with={"pipeline_parallel": 2}, keyed_at_default=False,
         domain=lambda ctx: ctx.pipeline_schedules),
    Knob(name="compile", default="none", flag="--compile", choices=COMPILE_MODES,
         parse=_choice("compile", COMPILE_MODES), result_path=("compile", "mode"),
         help="torch.compile: none (eager) or blocks (each decoder block compiled, fullgraph=True, before FSDP2 "
              "shards it, as torchtitan does); real trials compile with inductor, the simulator traces what AOT "
              "autograd's min-cut partitioner saves (docs/COMPILE.md)",
         label=lambda v: "" if v == "none" else f"compile={v}", short=lambda v: "" if v == "none" else "cmp",
         optuna=lambda v: _categorical_param("compile", COMPILE_MODES)(v) if v != "none" else {},
         alternative="blocks", keyed_at_default=False, domain=lambda ctx: ctx.compile_modes),
    Knob(name="float8", default="none", flag="--float8", choices=FLOAT8_RECIPES,
         parse=_choice("float8", FLOAT8_RECIPES), result_path=("float8", "recipe"),
         help="float8 training of the decoder blocks' linears (torchao): none, tensorwise (with FSDP2's float8 "
              "all-gather) or rowwise; only on GPUs with float8 (H100, H200, Ada): docs/COMPILE.md",
         label=lambda v: "" if v == "none" else f"float8={v}", short=lambda v: "" if v == "none" else f"f8{v[0]}",
         optuna=lambda v: _categorical_param("float8", FLOAT8_RECIPES)(v) if v != "none" else {},
         alternative="tensorwise", keyed_at_default=False, domain=lambda ctx: ctx.float8_recipes),
)
BY_NAME: dict[str, Knob] = {knob.name: knob for knob in KNOBS}


# --- what may combine: the one place a configuration is checked against its problem --------------


@dataclass(frozen=True, kw_only=True)
class ProblemShape:
    """What bounds which knob values a problem can hold: its cluster and its model (a
    catalog.ModelSpec: its name, experts and block parameter shapes are read only by the checks
    that need them, since they build the model on the meta device)."""

    num_gpus: int
    gpus_per_node: int
    model: Any
    seq_len: int = 0
    """The sequence length (context parallelism splits it); 0 where not known (not checked then)."""
    packed: bool = False
    """Token-budget batches (autotune/problem/packing.py): rows of several documents, which the ring does not attend."""
    step: str = "autotune"
    """The training step traced and run (config.stack_step): context parallelism slices the model's own loss only."""

    @property
    def num_nodes(self) -> int:
        return self.num_gpus // self.gpus_per_node


def hsdp_group_sizes(shape: ProblemShape) -> tuple[int, ...]:
    """HSDP shard group sizes the search proposes, smallest first: a node's GPUs, then whole numbers of
    nodes that divide the node count (3 nodes of 8: 8 only; 6 nodes: 8, 16, 24; 55 nodes: 8, 40, 88, 440
    is plain FSDP and not listed). Only sizes check_combination accepts."""
    per_node, nodes = shape.gpus_per_node, shape.num_nodes
    if nodes < 2 or per_node < 1:
        return ()
    return tuple(per_node * k for k in range(1, nodes) if nodes % k == 0)


# --- tensor parallelism: what a model's plan allows (parallel/tensor.py applies it) ----------------------

BUILT_STYLES = ("colwise", "rowwise")
"""The plan styles this module applies (the ones the dense causal LMs' plans use)."""

BLOCK_PREFIX = "layers.*."
"""Where a base model's plan entries for the decoder blocks start (transformers' convention)."""


def block_plan(tp_plan: dict[str, str] | None) -> dict[str, str]:
    """The plan's entries for one decoder block, relative to the block ({} where the model has no
    plan, or none for its blocks)."""
    return {key.removeprefix(BLOCK_PREFIX): style for key, style in (tp_plan or {}).items()
            if key.startswith(BLOCK_PREFIX)}


def why_no_tensor_parallel(tp_plan: dict[str, str] | None, *, degree: int, heads: int, kv_heads: int,
                           widths: dict[str, int]) -> str:
    """'' where `degree`-way tensor parallelism can be built from this plan, else why not (one
    clause, for an error or a skipped candidate). `widths`: each planned linear's output width."""
    plan = block_plan(tp_plan)
    if not plan:
        return "its transformers config has no tensor-parallel plan (base_model_tp_plan) for its decoder blocks"
    other = sorted({style for style in plan.values() if style not in BUILT_STYLES})
    if other:
        return f"its tensor-parallel plan uses {', '.join(other)}, which is not built here (only colwise/rowwise)"
    for what, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if count % degree:
            return f"the degree must divide its {count} {what}"
    for name, width in widths.items():
        if width % degree:
            return f"the degree must divide the {width} outputs of its {name}"
    return ""


TENSOR_PARALLEL_DEGREES = (2, 4, 8)
"""Tensor-parallel degrees the search proposes (within a node: its per-layer collectives want NVLink)."""


def default_values() -> dict[str, Any]:
    """Every knob at its default: the configuration a degree or a split is checked on."""
    return {knob.name: knob.default for knob in KNOBS}


def tensor_parallel_degrees(shape: ProblemShape) -> tuple[int, ...]:
    """Tensor-parallel degrees the search proposes for `shape`: 1, then those of TENSOR_PARALLEL_DEGREES
    check_combination accepts (dividing a node's GPUs, the model's heads and MLP, a plan to apply)."""
    base = default_values()
    return (1, *(tp for tp in TENSOR_PARALLEL_DEGREES
                 if not why_not_buildable({**base, "tensor_parallel": tp}, shape)))


def check_combination(values: dict[str, Any], shape: ProblemShape) -> dict[str, Any]:
    """The knob values of one configuration, checked against `shape` and each other: the values to
    run (a value that names the default configuration another way, e.g. one HSDP group of every
    GPU, becomes the default: one configuration, one name), or a UsageError (one line, the flags
    that clash and how to fix it). The CLI's flags, a stored result and every candidate the search
    proposes go through this one function (config.TrialSpec calls it)."""
    values = dict(values)
    _check_tensor_parallel(values, shape)
    _check_context_parallel(values, shape)
    _check_pipeline_parallel(values, shape)
    size, gpus, per_node = values["shard_group_size"], shape.num_gpus, shape.gpus_per_node
    if size == gpus:
        values["shard_group_size"] = 0
    elif size and (per_node % size if size <= per_node else size % per_node or gpus % size):
        raise UsageError(f"--hsdp {size}: the shard group size must divide the {per_node} GPUs per node "
                         f"(or be a multiple of it dividing {gpus}); 0 shards over every GPU")
    shard = values["shard_group_size"] or gpus
    group = values["reshard_group_size"]
    if group == shard:  # resharding to the whole shard group is plain resharding
        values["reshard_group_size"] = 0
    elif group and (group > shard or shard % group):
        raise UsageError(f"--reshard-group {group}: the group must be a factor of the {shard} GPUs parameters "
                         f"are sharded over (e.g. {min(per_node, shard)}, a node's); 0 reshards over all of them")
    _check_expert_parallel(values, shape)
    if values["shard_placement"] != "dim0":
        if not shapes_moved_by_placement(shape.model.block_param_shapes, shard):  # nothing moves: the default
            values["shard_placement"] = "dim0"
        elif values["reshard_group_size"]:
            # FSDP2 reshards after forward to a smaller group by splitting dimension 0 only.
            raise UsageError(f"--reshard-group {values['reshard_group_size']} with --shard-placement "
                             f"{values['shard_placement']}: FSDP2 reshards to a group only parameters sharded on "
                             "dimension 0; drop one of them")
    return values


def _check_tensor_parallel(values: dict[str, Any], shape: ProblemShape) -> None:
    """--tp: a degree within a node, dividing the model's heads and MLP, a plan of the model's to apply
    (parallel/tensor.py), and only the knobs tensor parallelism is built with here."""
    tp = values["tensor_parallel"]
    if values["async_tensor_parallel"]:
        if tp == 1:
            raise UsageError("--async-tp without --tp: async TP overlaps the tensor-parallel collectives with the "
                             "matmuls beside them; add --tp 2 (or 4, 8) or drop --async-tp")
        if values["compile"] == "none":
            # torchtitan's maybe_enable_async_tp refuses it too: the overlap is inductor's micro-pipeline pass.
            raise UsageError("--async-tp without compiled blocks: async TP is a pass of inductor's over the compiled "
                             "blocks; add --compile blocks or drop --async-tp")
    if values["loss_parallel"]:
        why = why_no_loss_parallel(shape, tensor_parallel=tp, pipeline_parallel=values["pipeline_parallel"])
        if why:
            raise UsageError(f"--loss-parallel: {why}")
    if tp == 1:
        return
    flag, model, per_node = f"--tp {tp}", shape.model, shape.gpus_per_node
    if per_node % tp or shape.num_gpus % tp:
        raise UsageError(f"{flag}: the tensor-parallel degree must divide the {per_node} GPUs per node (its "
                         f"all-reduces run every layer, within a node), e.g. --tp {_largest_divisor(per_node, 8)}")
    why = why_no_tensor_parallel(model.tp_plan, degree=tp, heads=model.num_attention_heads,
                                 kv_heads=model.num_key_value_heads, widths={"MLP": model.mlp_width})
    if why:
        raise UsageError(f"{flag}: {model.name} cannot be split: {why}; use --tp 1")
    _refuse_unbuilt(values, flag, "tensor parallelism", ("shard_group_size", "reshard_group_size", "expert_parallel",
                                                         "cpu_offload", "shard_placement"))
    ac = Checkpointing.parse(values["activation_checkpointing"])
    if values["compile"] != "none" and ac.mode in ("full", "every"):
        # torch 2.13: AOT autograd's partitioner saves the blocks' DTensor DeviceMesh for backward among the
        # tensors of a whole-block checkpoint inside the compiled region, and save_from_forward asserts
        # (AssertionError "expected all tensors_saved_with_vc_check to be Tensors"), in real runs and traces.
        raise UsageError(f"{flag} with --compile {values['compile']} and --ac {ac}: torch cannot compile a "
                         "tensor-parallel block checkpointed whole (its AOT autograd saves the device mesh as a "
                         "tensor); use --ac op or --ac none, or --compile none")


LOSS_PARALLEL_STEPS = ("autotune",)
"""Steps that run loss parallelism: autotune's loop (the model's own cross-entropy, transformers' ForCausalLMLoss,
computed by torch's loss_parallel on vocabulary shards). Not the HF Trainer's and Accelerate's ('hf': transformers'
tensor-parallel plan gathers the logits whole), TRL's fused head, nor the stacks' own losses."""


def why_no_loss_parallel(shape: ProblemShape, *, tensor_parallel: int, pipeline_parallel: int = 1) -> str:
    """'' where loss parallelism applies to `shape` at these degrees, else why not (the user's fix in the clause)."""
    if tensor_parallel == 1:
        return "it splits the head over the tensor-parallel GPUs; add --tp 2 (or 4, 8) or drop --loss-parallel"
    if shape.step not in LOSS_PARALLEL_STEPS:
        return ("the stack tuned for does not compute its loss on vocabulary shards (built for autotune's own loop, "
                "--stack fsdp2); drop --loss-parallel")
    if pipeline_parallel > 1:
        return "not built with pipeline stages here yet (docs/KNOBS.md); drop --loss-parallel or --pp"
    config = shape.model.config_dict
    if (config.get("text_config") or config).get("tie_word_embeddings"):
        return (f"{shape.model.name}'s head is tied to its embeddings, which stay whole on each GPU; drop "
                "--loss-parallel")
    if shape.model.vocab_size % tensor_parallel:
        return (f"{shape.model.name}'s vocabulary of {shape.model.vocab_size} does not split evenly over "
                f"{tensor_parallel} GPUs; drop --loss-parallel")
    return ""


ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop")
"""The transformers config keys of the dropout applied to attention probabilities (Llama-family, GPT-2-family)."""


def attention_dropout(config: dict[str, Any]) -> float:
    """The attention dropout a (transformers config) dict sets, 0.0 where none: what makes eager attention keep a
    mask per layer and what context parallelism's ring cannot apply."""
    text = config.get("text_config") or config
    values = [text.get(key) for key in ATTENTION_DROPOUT_KEYS]
    return max((float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)), default=0.0)


def why_no_context_parallel(config: dict[str, Any], *, seq_len: int, degree: int) -> str:
    """'' where a causal LM of this (transformers config) dict can train with `degree`-way context
    parallelism at `seq_len` (parallel/context.py: torch's ring of plain causal SDPA attention, head-tail
    load balanced), else why not (one clause). Grouped-query attention is fine: the kernels take k/v
    with fewer heads and the ring passes them round as they are."""
    text = config.get("text_config") or config
    if seq_len and seq_len % (2 * degree):
        return (f"the sequence length {seq_len} is not a multiple of 2 x the degree ({2 * degree}): torch's head-tail "
                "load balancing needs 2 x degree equal chunks")
    if text.get("is_encoder_decoder") or text.get("is_causal") is False:
        return "its attention is not causal: the ring computes causal attention only"
    if (dropout := attention_dropout(config)):
        return f"it sets attention dropout {dropout}: the ring's kernels run without dropout"
    if text.get("attn_logit_softcapping") or text.get("attention_logit_softcapping"):
        return "it soft-caps attention logits, which SDPA cannot"
    window, layer_types = text.get("sliding_window"), text.get("layer_types")
    if layer_types:
        others = sorted(set(layer_types) - {"full_attention"})
        if others and not (set(others) == {"sliding_attention"} and window and seq_len and window >= seq_len):
            return f"its layer types {others} are not full causal attention, the only kind the ring computes"
    elif window and text.get("use_sliding_window", True) is not False and (not seq_len or window < seq_len):
        return f"its sliding window of {window} tokens is shorter than the sequence: the ring computes full causal attention only"
    if text.get("alibi") or text.get("position_embedding_type") == "alibi":
        return "its ALiBi position biases are an attention bias, which the ring takes none of"
    return ""


CONTEXT_PARALLEL_STEPS = ("autotune", "hf")
"""The steps (config.stack_step) whose loss takes context parallelism's slices (parallel/context.py
sequence_shards): the model's own loss on input ids, shifted labels and position ids."""

CONTEXT_PARALLEL_DEGREES = (2, 4, 8)
"""Context-parallel degrees the search proposes (within a node: the ring passes keys and values every layer)."""


def context_parallel_degrees(shape: ProblemShape) -> tuple[int, ...]:
    """1, then the degrees of CONTEXT_PARALLEL_DEGREES check_combination accepts for `shape`."""
    base = default_values()
    return (1, *(cp for cp in CONTEXT_PARALLEL_DEGREES
                 if not why_not_buildable({**base, "context_parallel": cp}, shape)))


def _check_context_parallel(values: dict[str, Any], shape: ProblemShape) -> None:
    """--cp: a degree within a node whose ring the model's attention allows (why_no_context_parallel), with
    tensor parallelism inside the same node (torchtitan's mesh order: cp groups of tp groups), and only the
    knobs context parallelism is built with here (FSDP over every GPU's data x cp ranks, no other split)."""
    cp, tp = values["context_parallel"], values["tensor_parallel"]
    if cp == 1:
        return
    flag, model, per_node = f"--cp {cp}", shape.model, shape.gpus_per_node
    if per_node % cp or shape.num_gpus % cp:
        raise UsageError(f"{flag}: the context-parallel degree must divide the {per_node} GPUs per node (its ring "
                         f"passes keys and values every layer, within a node), e.g. --cp {_largest_divisor(per_node, 8)}")
    if tp > 1 and per_node % (tp * cp):
        raise UsageError(f"{flag} with --tp {tp}: the {tp} x {cp} GPUs sharing each batch must divide the {per_node} "
                         f"GPUs per node (both exchange every layer, within a node), e.g. --cp "
                         f"{_largest_divisor(max(per_node // tp, 1), cp)}")
    if shape.packed:
        raise UsageError(f"{flag} with --token-budget: the ring attention computes one causal sequence, not packed "
                         "documents; drop one of them")
    if shape.step not in CONTEXT_PARALLEL_STEPS:
        raise UsageError(f"{flag}: context parallelism slices the model's own loss (--stack fsdp2, accelerate, "
                         f"hf-trainer), not the {shape.step} step of the stack given; use --cp 1")
    if getattr(model, "attention", None) == "eager":
        raise UsageError(f"{flag} with --attention eager: the ring runs SDPA's kernels; use --cp 1 or another --attention")
    why = why_no_context_parallel(model.config_dict, seq_len=shape.seq_len, degree=cp)
    if why:
        raise UsageError(f"{flag}: {model.name} at sequence length {shape.seq_len}: {why}; use --cp 1")
    _refuse_unbuilt(values, flag, "context parallelism", ("shard_group_size", "reshard_group_size",
                                                          "expert_parallel", "cpu_offload",
                                                          "activation_offload", "shard_placement"))


PIPELINE_PARALLEL_STEPS = ("autotune",)
"""The steps (config.stack_step) whose forward parallel/pipeline.py splits into stages: the model's own
decoder blocks, embeddings, final norm and head, with the loss on the last stage."""

PIPELINE_PARALLEL_DEGREES = (2, 4, 8, 16)
"""Pipeline-parallel degrees the search proposes (stages may span nodes: only activations cross between them)."""


def why_no_pipeline_parallel(*, num_layers: int, degree: int, schedule: str, config: dict[str, Any] | None = None,
                             model_type: str | None = None, seq_len: int = 0) -> str:
    """'' where a model of `num_layers` decoder blocks splits into `degree` ranks' stages under `schedule`
    (each of its degree x PIPELINE_VIRTUAL_STAGES stages holding at least one block), else why not (one clause).
    With `config` (the model's config dict; its `model_type` given apart where the dict lacks it) also whether
    parallel/pipeline.py's stage module can split the model: a family whose base model is embeddings, decoder
    layers taking position embeddings, final norm and head alone (llama, qwen2, qwen3, olmo2, mistral), its
    embeddings not tied to its head (two copies on two stages), every layer plain causal attention (the stages
    run SDPA's is_causal without a mask: no other layer types, no sliding window shorter than `seq_len`, or
    any sliding window where seq_len is 0, not known)."""
    families = ("llama", "qwen2", "qwen3", "olmo2", "mistral")
    stages = degree * PIPELINE_VIRTUAL_STAGES[schedule]
    if stages > num_layers:
        return (f"{stages} stages ({degree} ranks x {PIPELINE_VIRTUAL_STAGES[schedule]} under {schedule}) need at "
                f"least as many decoder blocks, and it has {num_layers}")
    if config is None:
        return ""
    kind = model_type or config.get("model_type")
    if kind not in families:
        return (f"the pipeline stage module is built for the model types {families} (embeddings, decoder layers, "
                f"final norm and head alone), not {kind!r}")
    if config.get("tie_word_embeddings"):
        return ("its embeddings are tied to its head: the first and the last stage would hold two copies whose "
                "gradients nothing adds")
    layer_types = config.get("layer_types") or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        return f"its layer types {other} need masks of their own (the stages run causal attention without a mask)"
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", True) and not layer_types and (not seq_len or seq_len > window):
        return (f"its sliding window of {window} tokens needs a mask (the stages run causal attention without "
                "one)" + ("" if seq_len else "; the sequence length is not known here"))
    return ""


EMBEDDING_COST = 1
HEAD_COST = 1
"""What the embeddings and the output (final norm + head) weigh when stages are balanced, in blocks: torchtitan's
`generate_llm_fqn_per_model_part(num_stages, num_layers, input_weight=1, output_weight=1)` counts each as one
layer, and so does split_stages."""


def split_stages(num_layers: int, stages: int, *, embedding_cost: int = EMBEDDING_COST,
                 head_cost: int = HEAD_COST) -> list[tuple[int, int]]:
    """Contiguous blocks [start, end) of the `num_layers` decoder blocks for each of `stages` stages, every
    stage holding at least one block, balanced by cost: a block costs 1, the first stage also pays
    `embedding_cost` and the last `head_cost` (torchtitan's split counts the embedding and the output as one
    layer each). Of the splits whose most costly stage costs least, the one whose earlier stages hold the
    fewest blocks (each stage's count minimal in order): under 1F1B the first stages keep the most
    micro-batches' activations in flight, so the spare blocks go to the later stages."""
    if stages < 1 or num_layers < stages:
        raise ValueError(f"{stages} stages need at least as many decoder blocks, and the model has {num_layers}")

    def cost(stage: int, blocks: int) -> int:
        return blocks + (embedding_cost if stage == 0 else 0) + (head_cost if stage == stages - 1 else 0)

    # best[s][n]: the least possible max cost of stages s.. holding the last n blocks.
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(stages + 1)]
    best[stages][0] = 0
    for s in range(stages - 1, -1, -1):
        for n in range(1, num_layers + 1):
            best[s][n] = min((max(cost(s, k), best[s + 1][n - k]) for k in range(1, n + 1)), default=inf)
    target = best[0][num_layers]
    bounds, start, left = [], 0, num_layers
    for s in range(stages):
        k = next(k for k in range(1, left + 1) if max(cost(s, k), best[s + 1][left - k]) <= target)
        bounds.append((start, start + k))
        start, left = start + k, left - k
    return bounds


def why_no_pipeline_schedule(*, schedule: str, degree: int, microbatches: int) -> str:
    """'' where torch's `schedule` runs `microbatches` micro-batches (the accumulation steps) through `degree`
    ranks' stages, else why not: torch 2.13's own checks (Schedule1F1B: at least one micro-batch per stage;
    ScheduleInterleaved1F1B: whole rounds of `degree` micro-batches)."""
    if schedule == "1F1B" and microbatches < degree:
        return (f"1F1B needs at least one micro-batch per stage: {microbatches} accumulation steps for {degree} "
                "stages (a smaller micro-batch gives more)")
    rounds = max(1, microbatches // degree)
    if schedule == "Interleaved1F1B" and microbatches % rounds:
        return (f"Interleaved1F1B runs whole rounds: {microbatches} accumulation steps are not a multiple of "
                f"{rounds} rounds of {degree}")
    return ""


def pipeline_parallel_degrees(shape: ProblemShape) -> tuple[int, ...]:
    """1, then the degrees of PIPELINE_PARALLEL_DEGREES check_combination accepts for `shape`."""
    base = default_values()
    return (1, *(pp for pp in PIPELINE_PARALLEL_DEGREES
                 if not why_not_buildable({**base, "pipeline_parallel": pp}, shape)))


def widest_split(shape: ProblemShape) -> tuple[int, int, int]:
    """(tp, cp, pp) of the split that shares one sequence over the most GPUs the model and the cluster allow: the
    widest tensor-, context- or pipeline-parallel degree alone, or pipeline stages over the widest tensor-parallel
    groups where they combine (the first of equal widths in that order); (1, 1, 1) where none is allowed."""
    tp, cp, pp = (max(tensor_parallel_degrees(shape)), max(context_parallel_degrees(shape)),
                  max(pipeline_parallel_degrees(shape)))
    splits = [(tp, 1, 1), (1, cp, 1), (1, 1, pp)]
    if tp > 1 and pp > 1 and not why_not_buildable({**default_values(), "tensor_parallel": tp, "pipeline_parallel": pp},
                                                    shape):
        splits.insert(0, (tp, 1, pp))
    return max(splits, key=lambda split: split[0] * split[1] * split[2])


def _check_pipeline_parallel(values: dict[str, Any], shape: ProblemShape) -> None:
    """--pp: a degree dividing the GPUs, stages the model's blocks can fill (why_no_pipeline_parallel), the
    model's own step, and only the knobs pipeline parallelism is built with here (FSDP over each stage's ranks,
    tensor and context parallelism within each stage: _check_tensor_parallel's and _check_context_parallel's
    conditions, and a sequence the cp x tp ranks split evenly, the stages passing on equal sequence shards)."""
    pp = values["pipeline_parallel"]
    if pp == 1:
        return
    flag, model = f"--pp {pp}", shape.model
    if shape.num_gpus % pp:
        raise UsageError(f"{flag}: the pipeline-parallel degree must divide the {shape.num_gpus} GPUs")
    if shape.packed:
        raise UsageError(f"{flag} with --token-budget: the stages pass fixed-shape activations, not packed rows of "
                         "documents; drop one of them")
    if shape.step not in PIPELINE_PARALLEL_STEPS:
        raise UsageError(f"{flag}: pipeline stages split the model's own forward and loss (--stack fsdp2), not the "
                         f"{shape.step} step of the stack given; use --pp 1")
    if model.num_experts:
        raise UsageError(f"{flag}: {model.name} is a mixture-of-experts model, whose stages are not built here; use --pp 1")
    if values.get("precision") == "fp16":
        raise UsageError(f"{flag} with fp16: the schedule runs each micro-batch's backward itself, without the loss "
                         "scaling fp16 needs (not built here); use bf16")
    why = why_no_pipeline_parallel(num_layers=model.num_layers, degree=pp, schedule=values["pipeline_schedule"])
    if why:
        raise UsageError(f"{flag}: {model.name} cannot be split: {why}; use a smaller --pp")
    why = why_no_pipeline_parallel(num_layers=model.num_layers, degree=pp, schedule=values["pipeline_schedule"],
                                   config=getattr(model, "config_dict", None),
                                   model_type=getattr(model, "model_type", None), seq_len=shape.seq_len)
    if why:
        raise UsageError(f"{flag}: {model.name} cannot be split into pipeline stages: {why}; use --pp 1")
    tp, cp = values.get("tensor_parallel", 1), values.get("context_parallel", 1)
    if tp * cp > 1 and shape.num_gpus % (pp * tp * cp):
        splits = [(option, name, n) for option, name, n in (("cp", "context", cp), ("tp", "tensor", tp)) if n > 1]
        given = " ".join(f"--{option} {n}" for option, _, n in splits)
        names = " x ".join(["pipeline", *(name for _, name, _ in splits)])
        raise UsageError(f"{flag} with {given}: the {names}-parallel degrees ({pp * tp * cp}) must divide the "
                         f"{shape.num_gpus} GPUs")
    if tp > 1 and shape.seq_len and shape.seq_len % (tp * cp):
        given = f"--cp {cp} --tp {tp}" if cp > 1 else f"--tp {tp}"
        raise UsageError(f"{flag} with {given}: the stages pass each tp rank's sequence shard, and {tp * cp} does not "
                         f"divide the sequence length {shape.seq_len}; use a sequence length divisible by {tp * cp}")
    _refuse_unbuilt(values, flag, "pipeline parallelism", ("shard_group_size",
                                                           "reshard_group_size", "expert_parallel",
                                                           "cpu_offload", "activation_offload", "shard_placement"))


def _refuse_unbuilt(values: dict[str, Any], flag: str, section: str, names: tuple[str, ...]) -> None:
    """`flag` (a split) with any of the knobs `names` away from its default: not built together here, refused by both flags."""
    for name in names:
        if values[name] != BY_NAME[name].default:
            raise UsageError(f"{flag} with {BY_NAME[name].flag}: not built here yet (docs/KNOBS.md, {section}); "
                             "drop one of them")


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def _check_expert_parallel(values: dict[str, Any], shape: ProblemShape) -> None:
    """--ep: a MoE model, a degree dividing both its experts and the GPUs, and only the knobs expert
    parallelism is built with here."""
    ep = values["expert_parallel"]
    if ep == 1:
        return
    flag, model = f"--ep {ep}", shape.model
    if not model.num_experts:
        raise UsageError(f"{flag}: {model.name} has no fused experts (not a mixture-of-experts model); use --ep 1")
    if model.num_experts % ep or shape.num_gpus % ep:
        raise UsageError(f"{flag}: the expert-parallel degree must divide both the {model.num_experts} experts of "
                         f"{model.name} and the {shape.num_gpus} GPUs")
    if values["shard_group_size"]:
        raise UsageError(f"{flag} with --hsdp {values['shard_group_size']}: expert parallelism with replicated shard "
                         "groups is not built here; drop one of them")
    if values["reshard_group_size"]:
        raise UsageError(f"{flag} with --reshard-group {values['reshard_group_size']}: not built here; drop one of them")
    if values["compile"] != "none":
        raise UsageError(f"{flag} with --compile {values['compile']}: the all-to-all's split sizes are read back to "
                         "the host (.tolist()), which a fullgraph compile of the block refuses; use --compile none")


def why_not_buildable(values: dict[str, Any], shape: ProblemShape) -> str:
    """'' where check_combination accepts `values`, else its reason (for a candidate the search skips)."""
    try:
        check_combination(values, shape)
    except UsageError as exc:
        return str(exc)
    return ""


def to_json(values: dict[str, Any]) -> dict[str, Any]:
    """A TrainConfig's fields as JSON values, in registry order."""
    return {knob.name: knob.to_json(values[knob.name]) for knob in KNOBS}


def cache_key(values: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """What a configuration contributes to a cache key: every knob, by name, so a new knob's value
    is always part of it."""
    return tuple(to_json(values).items())


def identity(values: dict[str, Any]) -> dict[str, Any]:
    """A configuration's identity in a study (what resuming matches trials on)."""
    return {knob.name: knob.to_json(values[knob.name]) for knob in KNOBS
            if knob.keyed_at_default or values[knob.name] != knob.default}


def label(values: dict[str, Any], *, omit: tuple[str, ...] = (), short: bool = False) -> str:
    """'bf16 mb=2 ac=full offload': each knob's part, knobs at a default that says nothing left out.
    short: the parts an 80-column table prints."""
    def part(knob: Knob) -> str:
        return (knob.short or knob.label)(values[knob.name]) if short else knob.label(values[knob.name])

    return " ".join(text for knob in KNOBS if knob.name not in omit and (text := part(knob)))


def optuna_params(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(params, distributions) of a configuration as an Optuna trial records them."""
    params, distributions = {}, {}
    for knob in KNOBS:
        if knob.optuna is None:
            continue
        for name, (value, distribution) in knob.optuna(values[knob.name]).items():
            params[name], distributions[name] = value, distribution()
    return params, distributions


def from_result(document: dict[str, Any]) -> dict[str, Any]:
    """The knob values a best.json records (defaults for knobs it predates)."""
    return {knob.name: knob.from_result(document) for knob in KNOBS}


def fsdp_section(values: dict[str, Any]) -> dict[str, Any]:
    """The knobs best.json keeps in its fsdp section."""
    return {knob.name: knob.to_json(values[knob.name]) for knob in KNOBS if knob.result_path[0] == "fsdp"}


def sample_domains(ctx: SampleContext) -> dict[str, tuple[Any, ...]]:
    """Each knob's values for the sampler beyond the graph (a knob without a domain: its default)."""
    return {knob.name: tuple(knob.domain(ctx)) if knob.domain else (knob.default,) for knob in KNOBS}


def add_arguments(parser: argparse._ActionsContainer, *, skip: tuple[str, ...] = ()) -> None:
    for knob in KNOBS:
        if knob.name not in skip:
            knob.add_argument(parser)


def from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {knob.name: getattr(args, knob.name) for knob in KNOBS if hasattr(args, knob.name)}
