"""`autotune plan`: how many GPUs of which type, how long, what cost -- before anyone books a cluster.

Each option (a GPU type x a GPU count) is one `autotune tune` run (api.run_tune: the same
controller, study and run folder), on the sim or analytic backend. From each winner the plan
derives the time to train --train-tokens, GPU-hours, cost (only where --price gives one),
scaling efficiency against the smallest option of its GPU type, and which limit binds. The time
to train is given twice: the benchmark time (tokens / tokens/s) and, beside it, the expected
wall-clock and GPU-hours with what real runs lose (autotune/estimate/time_to_train.py).

Sharing work between options: a trace depends on the model, the world size, the sequence length
and the configuration, never on the GPU type (the sim backend's trace key has no GPU in it; the
GPU enters only in the memory limit, the runtime terms and the step-time estimate computed from
the trace). So the options of one GPU count run one after another on one backend and reuse its
traces exactly. Across GPU counts the same backend derives a configuration's trace from its
traces at two other world sizes where that is exact (from one where HSDP shards nothing over all
ranks: backends/sim/_world.py). With --jobs > 1 each GPU count runs in its own process; the
processes leave their traces in a folder they share and derive from each other's, the two
smallest GPU counts running first.
tests/test_plan.py checks shared and derived rows against fresh `autotune tune` runs.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
import dataclasses
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from autotune.problem.config import GPUS_PER_NODE  # an 8-GPU node unless --gpus-per-node says otherwise
from autotune.util.errors import NothingFits, UsageError
from autotune.problem.options import TuneOptions, positive_int
from autotune.estimate.time_to_train import Assumptions

PLAN_SCHEMA_VERSION = 1
PLAN_BACKENDS = ("sim", "analytic")  # the first is the default; real trials would need the cluster asked about

COMMUNICATION_BOUND = 0.3
"""Exposed (not hidden under compute) communication at or above this share of the step time: the
option is communication-bound -- more GPUs of this type mostly buy more waiting on the network."""


@dataclass(frozen=True)
class PlanOptions:
    """What `autotune plan` is asked (its flags, parsed)."""

    model: str
    train_tokens: int
    gpus: tuple[int, ...]
    gpu_types: tuple[str, ...]
    global_tokens: str
    prices: dict[str, float] = field(default_factory=dict)
    seq_len: int | None = None
    backend: str = "sim"
    gpus_per_node: int | None = None
    """None: tune's default (config.GPUS_PER_NODE), not named in an error as if the user gave it."""
    headroom: float | None = None
    global_tolerance: float | None = None
    space: str | None = None
    runs_dir: str = "runs"
    storage: str | None = None
    trust_remote_code: bool = False
    text_only: bool = False
    attention: str | None = None
    """As tune's --attention."""
    jobs: int | None = None
    compile: str | None = None
    """As tune's --compile: None, the search space's (auto: compiled candidates explored where tune would)."""
    float8: str | None = None
    """As tune's --float8."""
    whole_sequences: bool = False
    """--seq-len max: --global-tokens rounded to whole sequences per GPU at the length found, as
    each probe had it (autotune/drivers/seqlen.py), so no option is refused for a length only it divides."""
    train_assumptions: Assumptions = field(default_factory=Assumptions)
    """What the expected time to train assumes beyond the benchmark throughput (checkpoint interval
    and write bandwidth, failure rate, restart, evaluation, start-up: autotune/estimate/time_to_train.py)."""

    def global_tokens_for(self, gpus: int, seq_len: int) -> str | int:
        if not self.whole_sequences:
            return self.global_tokens
        from autotune.drivers.seqlen import global_tokens_at
        from autotune.util.units import parse_count

        return global_tokens_at(parse_count(self.global_tokens, what="--global-tokens"), gpus=gpus, seq_len=seq_len)

    def tune_options(self, gpu_type: str, gpus: int, *, seq_len: int | None = None) -> TuneOptions:
        """The `autotune tune` options of one option: the command it stands for, with the same search
        (compile's and float8's candidates explored where tune would; --compile none --float8 none
        plans eager, at half the traces: docs/PLAN.md)."""
        seq_len = seq_len or self.seq_len
        return TuneOptions(model=self.model, gpus=gpus, nodes=nodes_for(gpus, self.gpus_per_node),
                           global_tokens=self.global_tokens_for(gpus, seq_len) if seq_len else self.global_tokens,
                           gpu_type=gpu_type, seq_len=seq_len, backend=self.backend, headroom=self.headroom,
                           global_tolerance=self.global_tolerance, space=self.space, runs_dir=self.runs_dir,
                           storage=self.storage, trust_remote_code=self.trust_remote_code,
                           text_only=self.text_only, attention=self.attention, compile=self.compile,
                           float8=self.float8)


# -- parsing the flags ------------------------------------------------------------------------------
def parse_gpu_counts(text: str) -> tuple[int, ...]:
    """'8,16,32' or '8..256' (doubling from 8 up to 256) or a mix ('8..64,96'); sorted, distinct."""
    counts: set[int] = set()
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        low, dots, high = part.partition("..")
        try:
            start = positive_int(low)
            end = positive_int(high) if dots else start
        except Exception:
            raise UsageError(f"--gpus {text!r}: {part!r} is not a GPU count or a range like 8..256") from None
        if end < start:
            raise UsageError(f"--gpus {text!r}: the range {part!r} runs backwards")
        value = start
        while value <= end:  # ranges double: the shard sizes (and the costs) change by powers of two
            counts.add(value)
            value *= 2
    if not counts:
        raise UsageError("--gpus needs at least one GPU count, e.g. 8,16,32 or 8..256")
    return tuple(sorted(counts))


def parse_gpu_types(text: str) -> tuple[str, ...]:
    from autotune.problem.catalog.gpus import resolve_gpu

    names = [resolve_gpu(p.strip()).name for p in str(text).split(",") if p.strip()]
    if not names:
        raise UsageError("--gpu-type needs at least one GPU catalog entry, e.g. h100-80gb,a100-80gb")
    return tuple(dict.fromkeys(names))


def parse_prices(text: str | None, gpu_types: tuple[str, ...]) -> dict[str, float]:
    """'h100-80gb=2.49,a100-80gb=1.79' (per GPU-hour). No default prices: a type without one has no cost."""
    from autotune.problem.catalog.gpus import resolve_gpu

    prices: dict[str, float] = {}
    for part in (p.strip() for p in str(text or "").split(",")):
        if not part:
            continue
        name, equals, value = part.partition("=")
        if not equals:
            raise UsageError(f"--price {part!r}: write TYPE=PRICE per GPU-hour, e.g. h100-80gb=2.49")
        gpu = resolve_gpu(name.strip()).name
        if gpu not in gpu_types:
            raise UsageError(f"--price for {gpu}, which is not in --gpu-type ({', '.join(gpu_types)})")
        try:
            price = float(value)
        except ValueError:
            raise UsageError(f"--price {part!r}: {value!r} is not a number") from None
        if not price > 0:
            raise UsageError(f"--price {part!r}: a price per GPU-hour must be positive")
        prices[gpu] = price
    return prices


def parse_train_assumptions(*, checkpoint_every: str | None = None, write_bandwidth: str | None = None,
                            failure_rate: str | None = None, restart_time: str | None = None,
                            eval_fraction: str | None = None, startup: str | None = None) -> Assumptions:
    """The time-to-train flags (None: the default of autotune/estimate/time_to_train.py), each checked."""
    from autotune.estimate.time_to_train import parse_duration, with_overrides
    from autotune.util.units import parse_bytes

    def number(text: str | None, flag: str, *, low: float, high: float | None = None, what: str) -> float | None:
        if text is None:
            return None
        try:
            value = float(text)
        except ValueError:
            raise UsageError(f"{flag} {text!r} is not a number: give {what}") from None
        if not math.isfinite(value) or value < low or (high is not None and value >= high):
            raise UsageError(f"{flag} {text!r} is out of range: give {what}")
        return value

    every = None
    if checkpoint_every is not None:
        every = parse_duration(checkpoint_every, what="--checkpoint-every")
        if every <= 0:
            raise UsageError("--checkpoint-every must be a positive duration, e.g. 30m or 1h")
    bandwidth = None
    if write_bandwidth is not None:
        bandwidth = parse_bytes(str(write_bandwidth).removesuffix("/s"), what="--checkpoint-write-bandwidth")
        if bandwidth <= 0:
            raise UsageError("--checkpoint-write-bandwidth must be positive, e.g. 2GB (per second per node)")
    rate = number(failure_rate, "--failure-rate", low=0, what="interruptions per million GPU-hours, e.g. 20")
    return with_overrides(
        checkpoint_every_s=every, write_bytes_per_s_per_node=bandwidth,
        failures_per_gpu_hour=None if rate is None else rate / 1e6,
        restart_s=None if restart_time is None else parse_duration(restart_time, what="--restart-time"),
        eval_fraction=number(eval_fraction, "--eval-fraction", low=0, high=1, what="a fraction in [0, 1), e.g. 0.01"),
        startup_s=None if startup is None else parse_duration(startup, what="--startup"))


def nodes_for(gpus: int, gpus_per_node: int | None) -> int:
    """Nodes of a plan's option: tune's convention (config.cluster_nodes)."""
    from autotune.problem.config import cluster_nodes

    return cluster_nodes(gpus, gpus_per_node=gpus_per_node)[0]


# -- running the options ----------------------------------------------------------------------------
def _quiet():
    from autotune.results.console import Console

    return Console(quiet=True)


def batch_refusal(options: PlanOptions, gpus: int, seq_len: int) -> str | None:
    """Why the global batch cannot be kept on `gpus` GPUs at `seq_len` (tune's own checks, tensor
    parallelism's fallback past FSDP's batch wall included), or None."""
    from autotune.drivers.api import check_batch_beyond_fsdp
    from autotune.problem.batch import DEFAULT_TOLERANCE, check_reachable, check_target
    from autotune.problem.catalog.models import resolve_model
    from autotune.util.units import parse_count

    target = parse_count(options.global_tokens_for(gpus, seq_len), what="--global-tokens")
    tolerance = DEFAULT_TOLERANCE if options.global_tolerance is None else options.global_tolerance

    def check(ranks: int, seq: int, who: str = "") -> None:
        check_target(target_tokens=target, num_gpus=ranks, seq_len=seq, ranks=who)
        check_reachable(target_tokens=target, num_gpus=ranks, seq_len=seq, tolerance=tolerance, ranks=who)

    try:
        check_batch_beyond_fsdp(check, gpus=gpus, gpus_per_node=gpus // nodes_for(gpus, options.gpus_per_node),
                                seq_len=seq_len, model=lambda: resolve_model(
                                    options.model, trust_remote_code=options.trust_remote_code,
                                    text_only=options.text_only).with_attention(options.attention))
    except UsageError as exc:
        return str(exc)
    return None


def plan_backend(options: PlanOptions, gpus: int, seq_len: int, *, shared_traces: str | None = None):
    """One backend for options that share traces; on sim it derives traces across world sizes (_world),
    from its own traces and, with `shared_traces` (a folder), from other processes' (--jobs)."""
    from autotune.drivers.api import make_backend

    backend = make_backend(options.backend, options.tune_options(options.gpu_types[0], gpus, seq_len=seq_len))
    if hasattr(backend, "derive_world_sizes"):
        backend.derive_world_sizes = True
        backend.shared_traces = shared_traces
    return backend


def _run_group(options: PlanOptions, gpus: int, gpu_types: tuple[str, ...], seq_len: int,
               shared=None, shared_traces: str | None = None) -> list[dict[str, Any]]:
    """The options of one GPU count, on one backend (their traces are the same: see the module doc);
    `shared`: a backend of the whole plan's (then not closed here); `shared_traces`: the folder where
    the plan's processes leave and find traces."""
    from autotune.drivers.api import run_tune

    rows: list[dict[str, Any]] = []
    refused = batch_refusal(options, gpus, seq_len)
    backend = shared or (None if refused else plan_backend(options, gpus, seq_len, shared_traces=shared_traces))
    try:
        for gpu_type in gpu_types:
            row: dict[str, Any] = {"gpu_type": gpu_type, "gpus": gpus, "nodes": nodes_for(gpus, options.gpus_per_node),
                                   "seq_len": seq_len}
            began = time.monotonic()
            if refused:
                row.update(status="global-batch", message=refused)
            else:
                try:
                    asked = options.tune_options(gpu_type, gpus, seq_len=seq_len)
                    document = run_tune(asked, _quiet(), backend=backend)
                    row.update(status="ok", result=document, records=_records(options, document))
                except NothingFits as exc:
                    row.update(status="global-batch" if exc.binds == "global batch" else "nothing-fits",
                               message=str(exc))
            row["wall_s"] = time.monotonic() - began
            rows.append(row)
    finally:
        if backend is not None and shared is None:
            backend.close()
    return rows


def _records(options: PlanOptions, document: dict) -> list[dict[str, Any]]:
    from autotune.search.store import TrialStore, default_storage

    storage = options.storage or default_storage(Path(options.runs_dir))
    return TrialStore(storage, document["study"]).trials(run_id=document["run_id"])


def free_cores() -> int:
    """Cores not busy now (1-minute load average subtracted): other users' work is not ours to slow."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - round(os.getloadavg()[0]))


def run_options(options: PlanOptions, seq_len: int, log, *, progress=None) -> list[dict[str, Any]]:
    """Every option's row (tune's outcome), GPU counts in parallel processes where cores are free."""
    groups = list(options.gpus)
    began = time.monotonic()

    def tell(done: int) -> None:
        if progress is None:
            return
        # What is left: the GPU counts to go at the mean time of those done (the first has no estimate).
        expected = (time.monotonic() - began) / done * len(groups) if done else None
        progress.begin(f"planning {options.model}: {done} of {len(groups)} GPU counts done", expected_s=expected,
                       basis=f"mean of {done} done" if done else "first GPU count", started=began)

    tell(0)
    # The sim backend already traces on a second core (its helper): by default a process per 2 free cores.
    jobs = min(len(groups), options.jobs or max(1, free_cores() // (2 if options.backend == "sim" else 1)))
    log(f"{len(groups) * len(options.gpu_types)} options ({', '.join(options.gpu_types)} x "
        f"{', '.join(map(str, groups))} GPUs) in {jobs} process{'es' if jobs > 1 else ''}")
    rows: list[dict[str, Any]] = []
    if jobs <= 1:
        # One backend for every GPU count: traces at two world sizes give the others where exact (_world).
        backend = plan_backend(options, groups[0], seq_len)
        try:
            for gpus in groups:
                rows += _run_group(options, gpus, options.gpu_types, seq_len, shared=backend)
                log(f"{gpus} GPUs: done ({', '.join(_short(r) for r in rows[-len(options.gpu_types):])})")
                tell(len(rows) // len(options.gpu_types))
        finally:
            backend.close()
    else:
        # The two smallest GPU counts first, then the others, which derive from their traces (left in a
        # folder all the processes share) as one process would; what a later count traces first is
        # left there too, for the counts still to come or running beside it.
        with tempfile.TemporaryDirectory(prefix="autotune-plan-traces-") as shared_traces, \
                ProcessPoolExecutor(max_workers=jobs) as pool:
            for wave in (groups[:2], groups[2:]):
                futures = {gpus: pool.submit(_run_group, options, gpus, options.gpu_types, seq_len,
                                             shared_traces=shared_traces) for gpus in wave}
                for gpus, future in futures.items():
                    rows += future.result()
                    log(f"{gpus} GPUs: done ({', '.join(_short(r) for r in rows[-len(options.gpu_types):])})")
                    tell(len(rows) // len(options.gpu_types))
    return rows


def _short(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['gpu_type']}: {row['status']}"
    return f"{row['gpu_type']}: {row['result']['tokens_per_sec']:,.0f} tokens/s"


# -- figures --------------------------------------------------------------------------------------
def _figure(value: float | None, source: str, basis: str, low: float | None = None,
            high: float | None = None) -> dict[str, Any] | None:
    if value is None:
        return None
    return {"value": value, "source": source, "basis": basis,
            "range": [low, high] if low is not None and high is not None else None}


def binding_limit(row: dict[str, Any]) -> dict[str, Any]:
    """Which limit binds this option: global batch, memory or communication (see COMMUNICATION_BOUND)."""
    if row["status"] == "global-batch":
        return {"limit": "global batch", "detail": row["message"]}
    if row["status"] == "nothing-fits":
        return {"limit": "memory", "detail": row["message"]}
    document = row["result"]
    step_time = (_winner_record(row).get("result") or {}).get("extras", {}).get("step_time") or {}
    share = step_time.get("exposed_comm_s", 0.0) / step_time["seconds"] if step_time.get("seconds") else None
    limit = _limit(document, row["records"], share)
    if share is not None:
        limit["exposed_communication_share"] = share  # estimated, like the step time it comes from
    return limit


def _winner_record(row: dict[str, Any]) -> dict[str, Any]:
    """The study's record of the winning trial (its result's extras: step time, tokens/s range)."""
    step = row["result"]["found_by"]["step"]
    return next((r for r in row["records"] if r["step"] == step), {})


def _limit(document: dict[str, Any], records: list[dict], share: float | None) -> dict[str, Any]:
    from autotune.util.units import format_bytes

    if share is not None and share >= COMMUNICATION_BOUND:
        return {"limit": "communication",
                "detail": f"exposed communication is {share:.0%} of the step time (estimated; bound at "
                          f"{COMMUNICATION_BOUND:.0%})"}
    micro = document["micro_batch_size"]
    per_gpu = document["global_tokens_target"] // (document["gpus"] * document["seq_len"])
    if micro >= per_gpu:
        return {"limit": "global batch",
                "detail": f"{document['global_tokens_target']:,} tokens over {document['gpus']} GPUs x seq {document['seq_len']} "
                          f"allow at most micro-batch {max(per_gpu, 1)}; memory would allow more"}
    failed = min((r["config"]["micro_batch_size"] for r in records
                  if not r["fits"] and r["config"]["micro_batch_size"] > micro), default=None)
    checkpointed = document["fsdp"]["activation_checkpointing"] != "none" or document["fsdp"]["cpu_offload"]
    if failed is not None or checkpointed:
        what = f"micro-batch {failed} does not fit" if failed else "the configuration needs memory savings"
        return {"limit": "memory",
                "detail": f"{what} within {format_bytes(document['memory_limit_bytes'])} per GPU "
                          f"({document['memory_source']}); winner at micro-batch {micro}, checkpointing "
                          f"{document['fsdp']['activation_checkpointing']}"}
    return {"limit": "search space", "detail": f"micro-batch {micro} is the search space's largest"}


def option_figures(rows: list[dict[str, Any]], options: PlanOptions) -> list[dict[str, Any]]:
    """The plan's options: each row's winner and the figures derived from it, sources kept."""
    smallest: dict[str, dict] = {}
    for row in sorted(rows, key=lambda r: r["gpus"]):
        if row["status"] == "ok":
            smallest.setdefault(row["gpu_type"], row)
    out = []
    order = {name: i for i, name in enumerate(options.gpu_types)}
    for row in sorted(rows, key=lambda r: (order[r["gpu_type"]], r["gpus"])):
        option = {"id": f"{row['gpu_type']}x{row['gpus']}", "gpu_type": row["gpu_type"], "gpus": row["gpus"],
                  "nodes": row["nodes"], "seq_len": row["seq_len"], "status": row["status"],
                  "message": row.get("message"), "binds": binding_limit(row),
                  "wall_s": round(row["wall_s"], 2)}
        if row["status"] == "ok":
            option.update(_winner_figures(row, options, smallest[row["gpu_type"]]))
        out.append(option)
    return out


def _winner_figures(row: dict[str, Any], options: PlanOptions, base: dict[str, Any]) -> dict[str, Any]:
    document = row["result"]
    winner = _winner_record(row)
    tps = document["tokens_per_sec"]
    source, basis = document["throughput_source"], document["throughput_basis"]
    low, high = (winner.get("result") or {}).get("extras", {}).get("tokens_per_sec_range") or (None, None)
    on = f"{row['gpus']} x {row['gpu_type']}"
    seconds = options.train_tokens / tps
    time_figure = _figure(seconds, source, f"benchmark time: {options.train_tokens:,} tokens / tokens/s ({source}) "
                                           f"on {on}, nothing lost",
                          options.train_tokens / high if high else None, options.train_tokens / low if low else None)
    hours = _figure(seconds / 3600 * row["gpus"], source, f"benchmark time to train x {row['gpus']} GPUs",
                    *((t / 3600 * row["gpus"] for t in time_figure["range"]) if time_figure["range"] else ()))
    figures: dict[str, Any] = {
        "tokens_per_sec": _figure(tps, source, basis, low, high),
        "time_to_train_s": time_figure,
        "gpu_hours": hours,
        "cost": None,
        "peak_memory_bytes": _figure(document["peak_memory_bytes"], document["memory_source"],
                                     document["memory_basis"]),
        "memory_limit_bytes": document["memory_limit_bytes"],
        "configuration": _configuration(document),
        "run_dir": str(Path(options.runs_dir) / document["run_id"]),
        "result": document,
    }
    price = options.prices.get(row["gpu_type"])
    if price is not None:
        rng = hours["range"]
        figures["cost"] = _figure(hours["value"] * price, source,
                                  f"GPU-hours ({source}) x {price} per GPU-hour (--price)",
                                  *((h * price for h in rng) if rng else ()))
        figures["cost"]["price_per_gpu_hour"] = price
    figures.update(_expected_figures(row, options, tps, (low, high) if low and high else None, price))
    base_tps = base["result"]["tokens_per_sec"]
    figures["scaling_efficiency"] = _figure(
        (tps / row["gpus"]) / (base_tps / base["gpus"]), source,
        f"tokens/s per GPU ({source}) against {base['gpus']} x {row['gpu_type']}, the smallest option of this type")
    return figures


def _expected_figures(row: dict[str, Any], options: PlanOptions, tps: float, tps_range: tuple[float, float] | None,
                      price: float | None) -> dict[str, Any]:
    """The expected wall-clock, GPU-hours and cost with what runs lose (autotune/estimate/time_to_train.py):
    checkpoint saves of the winner's model (the checkpoint advice's 12 bytes per parameter), failures
    and restarts by GPU-hours, evaluation, start-up and the goodput fitted on published runs."""
    from autotune.estimate.time_to_train import basis, checkpoint_bytes, expected_time

    document = row["result"]
    model = expected_time(train_tokens=options.train_tokens, tokens_per_sec=tps, gpus=row["gpus"], nodes=row["nodes"],
                          checkpoint_size_bytes=checkpoint_bytes(document["model"]["parameters"]),
                          tokens_per_sec_range=tps_range, assumptions=options.train_assumptions)
    terms = {k: (v if math.isfinite(v) else None) for k, v in model["terms"].items()}  # JSON has no infinity
    detail = {"terms": terms, "assumptions": model["assumptions"],
              "checkpoint_size_bytes": model["checkpoint_size_bytes"], "checkpoint_write_s": model["checkpoint_write_s"],
              "checkpoint_write_basis": model["checkpoint_write_basis"]}
    if not math.isfinite(model["wall_s"]):
        detail["never_finishes"] = (f"failures take all the time on {row['gpus']} GPUs (each costs "
                                    f"{model['terms']['per_failure_s'] / 3600:.2f} h at "
                                    f"{model['assumptions']['failures_per_gpu_hour'] * 1e6:.3g} per million GPU-hours): "
                                    "checkpoint more often or restart faster")
        return {"expected_time_to_train_s": None, "expected_gpu_hours": None, "expected_cost": None,
                "time_to_train_model": detail}
    text = basis(model, gpus=row["gpus"])
    low, high = model["wall_range_s"]
    finite = math.isfinite(high)
    wall = _figure(model["wall_s"], "estimated", f"expected wall-clock: {text}", low if finite else None,
                   high if finite else None)
    gpu_hours = _figure(model["gpu_hours"], "estimated",
                        f"expected wall-clock x {row['gpus']} GPUs (the job holds them all while it stands)",
                        *((h for h in model["gpu_hours_range"]) if finite else ()))
    cost = None
    if price is not None:
        cost = _figure(gpu_hours["value"] * price, "estimated", f"expected GPU-hours x {price} per GPU-hour (--price)",
                       *((h * price for h in gpu_hours["range"]) if gpu_hours["range"] else ()))
        cost["price_per_gpu_hour"] = price
    return {"expected_time_to_train_s": wall, "expected_gpu_hours": gpu_hours, "expected_cost": cost,
            "time_to_train_model": detail}


def _configuration(document: dict) -> dict[str, Any]:
    """The winner's knobs a plan reader compares across options: batch, memory and the parallel degrees."""
    fsdp, parallel = document["fsdp"], document["parallelism"]
    return {"micro_batch_size": document["micro_batch_size"], "grad_accum_steps": document["grad_accum_steps"],
            "global_tokens": document["global_tokens"], "precision": document["precision"],
            "activation_checkpointing": fsdp["activation_checkpointing"], "cpu_offload": fsdp["cpu_offload"],
            "reshard_after_forward": fsdp["reshard_after_forward"], "shard_group_size": fsdp["shard_group_size"],
            "reshard_group_size": fsdp["reshard_group_size"],
            **{name: parallel[name] for name in ("tensor_parallel", "context_parallel", "pipeline_parallel",
                                                 "pipeline_schedule")},
            "async_tensor_parallel": parallel.get("async_tensor_parallel", False),
            "loss_parallel": parallel.get("loss_parallel", False)}


# -- the plan -------------------------------------------------------------------------------------
def run_plan(options: PlanOptions, log, *, seq_len_max=None, progress=None) -> dict[str, Any]:
    """The plan document (plan.json's content; schemas/plan.schema.json). `progress`: the console's
    live line (begin(description, expected_s=, basis=, started=)), told as GPU counts finish."""
    from autotune.drivers.api import check_backend_traces, check_precision_runs, check_wrappable
    from autotune.problem.catalog.models import resolve_model
    from autotune.search.space import load_space
    from autotune.results.result import provenance, text_only_note, text_only_section

    began = time.monotonic()
    model = resolve_model(options.model, trust_remote_code=options.trust_remote_code,
                          text_only=options.text_only).with_attention(options.attention)
    check_wrappable(model)
    check_backend_traces(model, options.backend)  # refused once here, not by every option's tune
    precision = load_space(options.space).precision
    check_precision_runs(model, precision)
    for gpus in options.gpus:
        nodes_for(gpus, options.gpus_per_node)  # refuse a count that is not whole nodes before any trial
    seq_len = options.seq_len or model.default_seq_len
    if model.max_positions and seq_len > model.max_positions:
        raise UsageError(f"--seq-len {seq_len} is longer than {model.name} supports ({model.max_positions} "
                         "positions): lower --seq-len")
    sequence = None
    if seq_len_max is not None:
        sequence = seq_len_max(model)
        seq_len = sequence["max_seq_len"]
        options = dataclasses.replace(options, seq_len=seq_len, whole_sequences=True)
    left_out = text_only_section(model, num_gpus=min(options.gpus), precision=precision)
    if left_out:  # at the smallest GPU count; each option's result says it at its own
        log(text_only_note(left_out))
    rows = run_options(options, seq_len, log, progress=progress)
    return {
        "schema_version": PLAN_SCHEMA_VERSION,
        "kind": "autotune-plan",
        "model": {"name": model.name, "parameters": model.num_parameters, "max_positions": model.max_positions,
                  **({"text_only_of": model.text_tower_of["model_type"],
                      "left_out_parameters": left_out["left_out_parameters"]} if left_out else {})},
        "train_tokens": options.train_tokens,
        "global_tokens": options.global_tokens,
        "seq_len": seq_len,
        "backend": options.backend,
        "gpus_per_node": options.gpus_per_node or GPUS_PER_NODE,
        "prices": options.prices,
        "time_to_train_assumptions": _assumptions_doc(options.train_assumptions),
        "options": option_figures(rows, options),
        "sequence_length": sequence,
        "wall_s": round(time.monotonic() - began, 2),
        "provenance": provenance(),
    }


def _assumptions_doc(a: Assumptions) -> dict[str, Any]:
    from dataclasses import asdict

    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(a).items()}


def plan_dir(runs_dir: str) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    for attempt in range(1, 1000):
        path = Path(runs_dir) / (f"plan-{stamp}" if attempt == 1 else f"plan-{stamp}-{attempt}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise UsageError(f"cannot claim a plan folder in {runs_dir}")


def find_option(plan: dict[str, Any], name: str) -> dict[str, Any]:
    """The result document of option `name` (<gpu-type>x<gpus>, e.g. h100-80gbx64) of a plan."""
    ids = [o["id"] for o in plan["options"]]
    option = next((o for o in plan["options"] if o["id"] == name.strip().lower()), None)
    if option is None:
        raise UsageError(f"no option {name!r} in the plan: choose one of {', '.join(ids)}")
    if option.get("result") is None:
        raise UsageError(f"option {name!r} has no winner ({option['status']}: {option['binds']['detail']})")
    return option["result"]


def is_plan(document: dict[str, Any]) -> bool:
    return document.get("kind") == "autotune-plan"


def plan_max_seq_len(options: PlanOptions, model, *, step: int, log) -> dict[str, Any]:
    """--seq-len max in a plan: the longest length on the smallest GPU count of each type (more GPUs
    shard the model further, so what fits there fits on more of them); the plan runs at the
    shortest of these, so every option is compared at one length that fits on all of them."""
    from autotune.drivers.seqlen import find_max_seq_len, tune_probe
    from autotune.util.units import parse_count

    target = parse_count(options.global_tokens, what="--global-tokens")
    smallest = options.gpus[0]
    by_type = {}
    for gpu_type in options.gpu_types:
        log(f"--seq-len max on {smallest} x {gpu_type}")
        probe = tune_probe(options.tune_options(gpu_type, smallest), _quiet, target=target)
        found = find_max_seq_len(probe, max_positions=model.max_positions, step=step, log=log)
        for row in found["probes"]:
            row.pop("result", None)  # each probe's run folder keeps its best.json
        by_type[gpu_type] = found
    answers = [found["max_seq_len"] for found in by_type.values() if found["max_seq_len"]]
    if not answers:
        raise NothingFits(f"no sequence length fits on {smallest} GPUs of any type, not even {step}")
    first = next(iter(by_type.values()))
    return {"max_seq_len": min(answers), "step": step, "gpus": smallest, "by_gpu_type": by_type,
            "method": first["method"], "bound": "; ".join(f"{t}: {f['bound']}" for t, f in by_type.items()),
            "probes": first["probes"]}
