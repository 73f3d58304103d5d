"""The tune command's options, typed (TuneOptions), and the validators that check them.

One set of validators for both doors: the CLI's argparse types are these functions, and
`tune_options()` (what autotune.tune() and sweeps call) runs the same ones on the same text, so a
bad value is the same one-line UsageError whichever way it came in.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from autotune.problem.catalog.attention import ATTENTION_IMPLEMENTATIONS
from autotune.problem.config import PEFT_METHODS, STACKS
from autotune.problem.knobs import COMPILE_SEARCH, FLOAT8_SEARCH, PRECISIONS
from autotune.util.errors import UsageError

BACKENDS = ("auto", "sim", "analytic", "cpu", "cuda")
WORKLOADS = ("sft", "grpo")
SEQ_LEN_STEP = 1024
"""`--seq-len max`'s default granularity (autotune/drivers/seqlen.py): attention kernels and data pipelines
favour multiples of it."""


# -- validators (argparse types: they raise ArgumentTypeError, whose text argparse prints) -----------
def positive_int(text: str) -> int:
    try:
        value = int(str(text).replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a fraction in [0, 1), e.g. 0.1")
    return value


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def duration(text: str) -> float:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: use e.g. 90, 90s, 10m or 1h")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def routing_skew(text: str):
    """--routing-skew: balanced, zipf:S, capacity:C or a histogram file (autotune/problem/routing.py), parsed once."""
    from autotune.problem.routing import read_routing_skew

    try:
        return read_routing_skew(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def token_budget(text: str) -> int | str:
    """--token-budget: search, or a count of tokens per micro-batch (autotune/problem/packing.py)."""
    if str(text).strip().lower() == "search":
        return "search"
    from autotune.util.units import parse_count

    try:
        value = parse_count(text, what="--token-budget")
    except UsageError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'search' nor a count of tokens (e.g. 32k)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive count of tokens")
    return value


def doc_lengths(text: str):
    """--doc-lengths: a file of document lengths, a JSON histogram or loguniform:LOW:HIGH, parsed once."""
    from autotune.problem.packing import read_document_lengths

    try:
        return read_document_lengths(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def usage_error(message: str, prog: str = "autotune tune") -> UsageError:
    """A bad option, as the CLI's parser words it (the library words it the same)."""
    return UsageError(f"{message} (see '{prog} --help')")


def _option(default: Any = None, *, check: Callable[[str], Any] | None = None,
            choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"check": check, "choices": choices})


@dataclass(frozen=True)
class TuneOptions:
    """What `autotune tune` is asked: its flags (underscores for dashes) with their defaults.
    Build one with `tune_options()` to have the values checked as the command line checks them."""

    model: str
    gpus: int | None = _option(check=positive_int)
    global_tokens: int | str | None = None  # checked with the batch arithmetic (autotune/drivers/api.py)
    # model and cluster
    trust_remote_code: bool = False
    text_only: bool = False
    attention: str | None = _option(choices=ATTENTION_IMPLEMENTATIONS)
    """A multimodal config's language model alone (its text_config); the run says what is left out."""
    nodes: int | None = _option(check=positive_int)
    """None: --gpus / --gpus-per-node (config.cluster_nodes)."""
    gpus_per_node: int | None = _option(check=positive_int)
    """None: 8 (config.GPUS_PER_NODE), or gpus / nodes where --nodes is given."""
    gpu_type: str | None = None
    gpu_memory: str | None = None
    host_memory: str | None = None
    seq_len: int | None = _option(check=positive_int)
    seq_len_step: int = _option(SEQ_LEN_STEP, check=positive_int)
    """--seq-len max (the command line's): the granularity of the answer."""
    hardware: str | None = None
    backend: str = _option("auto", choices=BACKENDS)
    # workload
    workload: str | None = _option(choices=WORKLOADS)
    vllm_gpu_memory_utilization: float | None = _option(check=number)
    max_completion_length: int | None = _option(check=positive_int)
    num_generations: int | None = _option(check=positive_int)
    stack: str | None = _option(choices=tuple(STACKS))
    """Whose training step is predicted (config.STACKS); None: fsdp2, autotune's own loop."""
    routing_skew: Any = _option(check=routing_skew)
    """A MoE model's routing assumption (autotune.problem.routing.RoutingSkew, parsed from --routing-skew's text);
    None: balanced."""
    token_budget: Any = _option(check=token_budget)
    """Packed token-budget batches (autotune/problem/packing.py): 'search', or a count of tokens the search stays
    within; None: rows of one sequence each."""
    doc_lengths: Any = _option(check=doc_lengths)
    """The document length distribution of packed batches (packing.DocumentLengths); None: the default."""
    # fine-tuning
    peft: str | None = _option(choices=PEFT_METHODS)
    lora_rank: int | None = _option(check=positive_int)
    lora_alpha: float | None = _option(check=number)
    lora_dropout: float | None = _option(check=number)
    lora_targets: str | None = None
    # real trials
    timeout: float = _option(600.0, check=duration)
    rdzv_endpoint: str | None = None
    shared_dir: str | None = None
    # run
    global_tolerance: float | None = _option(check=fraction)
    headroom: float | None = _option(check=fraction)
    space: str | None = None
    storage: str | None = None
    study: str | None = None
    runs_dir: str = "runs"
    out: str | None = None
    export: str | None = None
    max_trials: int | None = _option(check=positive_int)
    time_budget: float | None = _option(check=duration)
    precision: str | None = _option(choices=PRECISIONS)
    """The numerics of every trial (bf16, fp16, fp32, bf16-pure); None: the search space's
    (baseline.precision, bf16 by default)."""
    compile: str | None = _option(choices=COMPILE_SEARCH)
    """torch.compile in the search: none, explore or blocks; None: the search space's (compile.mode)."""
    float8: str | None = _option(choices=FLOAT8_SEARCH)
    """float8 training in the search: none, explore, tensorwise or rowwise; None: the search space's
    (float8.mode)."""

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> TuneOptions:
        """The parsed `tune` command line (already checked by its parser)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def tune_options(**given: Any) -> TuneOptions:
    """TuneOptions from keyword values, each checked by the validator its flag has on the command
    line, applied to the text the flag would carry. None or False leaves an option at its default;
    True turns on a switch. An unknown name is a UsageError listing the options."""
    fields = {f.name: f for f in dataclasses.fields(TuneOptions)}
    values: dict[str, Any] = {}
    for name, value in given.items():
        spec = fields.get(name)
        if spec is None:
            raise UsageError(f"autotune.tune() has no option {name!r}; options are the tune command's flags "
                             f"with underscores: {', '.join(sorted(fields))}")
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        if spec.type in (bool, "bool"):
            if value is not True:
                raise UsageError(f"{name} is a switch ({flag}): pass True or False, not {value!r}")
            values[name] = True
            continue
        text = str(value)
        check, choices = spec.metadata.get("check"), spec.metadata.get("choices")
        if choices is not None and text not in choices:
            raise usage_error(f"argument {flag}: invalid choice: {text!r} "
                              f"(choose from {', '.join(map(repr, choices))})")
        try:
            values[name] = check(text) if check else text
        except argparse.ArgumentTypeError as exc:
            raise usage_error(f"argument {flag}: {exc}") from None
    return TuneOptions(**values)
