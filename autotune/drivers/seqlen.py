"""`--seq-len max`: the longest sequence length that fits with some configuration, and its throughput.

A bisection over multiples of a stated granularity (--seq-len-step, default options.SEQ_LEN_STEP) up to
the model's positions. Each probe is a whole tune (api.run_tune: the controller's answer), so
"fits" means the decision graph found a configuration within the memory limit -- checkpointing
and CPU offload included -- and the probe's throughput is its winner's. Memory grows with the
sequence length, so fitting is monotone in it and the bisection is exact on the grid.

At each length the global batch is --global-tokens rounded to a whole number of sequences per GPU
(at least one): a length is not refused for a global batch that only another length divides.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from autotune.util.errors import NothingFits, UsageError
from autotune.problem.options import positive_int

UNBOUNDED_POSITIONS = 1 << 20
"""The ceiling for a model whose config states no maximum position count."""


def seq_len_or_max(text: str) -> int | str:
    """The --seq-len argparse type: a positive integer, or 'max'."""
    return "max" if str(text).strip().lower() == "max" else positive_int(text)


def global_tokens_at(target: int, *, gpus: int, seq_len: int) -> int:
    """--global-tokens rounded to a whole number (>= 1) of sequences per GPU at this length."""
    unit = gpus * seq_len
    return max(1, round(target / unit)) * unit


def find_max_seq_len(probe: Callable[[int], dict[str, Any]], *, max_positions: int | None, step: int,
                     log=lambda text: None) -> dict[str, Any]:
    """Bisect on multiples of `step` up to `max_positions`; `probe(seq_len)` returns a row with
    `fits`. Returns the answer, what bounds it, and every probe (the throughput table)."""
    ceiling = ((max_positions or UNBOUNDED_POSITIONS) // step) * step
    if ceiling < step:
        raise UsageError(f"--seq-len-step {step} is longer than the model's {max_positions} positions")
    probes: dict[int, dict[str, Any]] = {}

    def fits(length: int) -> bool:
        if length not in probes:
            probes[length] = probe(length)
            row = probes[length]
            figure = f", {row['tokens_per_sec']:,.0f} tokens/s estimated" if row.get("tokens_per_sec") else ""
            log(f"seq_len {length}: {'fits' if row['fits'] else 'does not fit'}{figure}")
        return probes[length]["fits"]

    if fits(ceiling):
        answer, bound = ceiling, f"the model's positions ({max_positions})" if max_positions else "the search ceiling"
    else:
        low, high = 0, ceiling // step  # grid indices: low fits (0: nothing yet), high does not
        while high - low > 1:
            middle = (low + high) // 2
            if fits(middle * step):
                low = middle
            else:
                high = middle
        answer = low * step or None
        bound = f"memory: {high * step} does not fit" if answer else f"memory: not even {step} fits"
    return {"max_seq_len": answer, "step": step, "bound": bound, "positions": max_positions,
            "probes": [probes[k] for k in sorted(probes)],
            "method": f"bisection on multiples of {step}; each probe a tune (the controller's winner)"}


def tune_probe(options, console_factory, *, target: int, backend=None) -> Callable[[int], dict[str, Any]]:
    """A probe that tunes `options` (TuneOptions) at a sequence length. Probes ask what fits, so they do
    not explore compile's and float8's candidates (a compiled or float8 run is probed as asked, every
    trial with it); the tune at the answer does (docs/PLAN.md, `--seq-len max`)."""
    from autotune.drivers.api import run_tune

    fixed = dict(compile=options.compile if options.compile in ("none", "blocks") else "none",
                 float8=options.float8 if options.float8 in ("none", "tensorwise", "rowwise") else "none")

    def probe(length: int) -> dict[str, Any]:
        tokens = global_tokens_at(target, gpus=options.gpus, seq_len=length)
        asked = dataclasses.replace(options, seq_len=length, global_tokens=tokens, **fixed)
        try:
            document = run_tune(asked, console_factory(), backend=backend)
        except NothingFits as exc:
            return {"seq_len": length, "fits": False, "global_tokens": tokens, "message": str(exc)}
        return {"seq_len": length, "fits": True, "global_tokens": tokens,
                "tokens_per_sec": document["tokens_per_sec"], "throughput_source": document["throughput_source"],
                "peak_memory_bytes": document["peak_memory_bytes"], "memory_source": document["memory_source"],
                "micro_batch_size": document["micro_batch_size"],
                "activation_checkpointing": document["fsdp"]["activation_checkpointing"],
                "cpu_offload": document["fsdp"]["cpu_offload"], "run_id": document["run_id"],
                "result": document}
    return probe


def tune_at_longest(options, console, *, log=None) -> dict[str, Any]:
    """`--seq-len max` for tune (the command and `autotune.tune(..., seq_len="max")`): bisect the
    length, each probe a quiet tune, then tune at the answer through `console`. Returns that tune's
    result document with the search's probes under `sequence_length` (the throughput table)."""
    from autotune.drivers.api import resolve_problem, run_tune
    from autotune.results.console import Console
    from autotune.util.units import parse_count

    options = dataclasses.replace(options, seq_len=None)
    model, _, _, _ = resolve_problem(options)
    target = parse_count(options.global_tokens, what="--global-tokens")
    probe = tune_probe(options, lambda: Console(quiet=True), target=target)
    sequence = find_max_seq_len(probe, max_positions=model.max_positions, step=options.seq_len_step,
                                log=log or console.note)
    console.seq_len_table(sequence)
    if sequence["max_seq_len"] is None:
        raise NothingFits(f"no sequence length fits, not even {options.seq_len_step} ({sequence['bound']})")
    length = sequence["max_seq_len"]
    tokens = global_tokens_at(target, gpus=options.gpus, seq_len=length)
    console.note(f"longest sequence length that fits: {length} (bound: {sequence['bound']}); tuning at it with "
                 f"{tokens:,} global tokens (--global-tokens in whole sequences per GPU)")
    document = run_tune(dataclasses.replace(options, seq_len=length, global_tokens=tokens), console)
    probes = [{k: v for k, v in row.items() if k != "result"} for row in sequence["probes"]]
    return {**document, "sequence_length": {**sequence, "probes": probes}}
