"""The library: `autotune.tune(...)` tunes one problem and returns the result document (best.json's
content); the `autotune tune` command is a wrapper over it (autotune/drivers/cli.py parses the flags into
TuneOptions, prints through its console, turns the outcome into an exit code).

    import autotune
    result = autotune.tune("llama-7b", gpus=8, global_tokens="4M", backend="sim")
    result["fsdp"], result["micro_batch_size"], result["tokens_per_sec"]

Options are the `tune` command's, by their flag names with underscores (`nodes=8`,
`seq_len=4096`, `runs_dir="runs"`, `export="fsdp2,torchtitan"`, ...), checked by the validators
the command line uses (autotune/problem/options.py: a bad value raises the CLI's one-line UsageError).
The run is recorded in the study and runs/ like any other. Raises NothingFits when no
configuration fits.

The problem-building helpers here (resolve_problem, choose_backend, make_backend, ...) serve the
other commands too (`autotune trial`, `export`, `calibrate`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from autotune.util.errors import NothingFits, UsageError
from autotune.problem.options import TuneOptions, tune_options

Options = Any  # TuneOptions, or the parsed flags of a command with the same options (`autotune trial`)


def tune(model: str, *, gpus: int, global_tokens: int | str, **options: Any) -> dict[str, Any]:
    """Tune `model` on `gpus` GPUs for `global_tokens` per optimizer step; quiet (prints nothing)."""
    from autotune.results.console import Console

    checked = tune_options(model=model, gpus=gpus, global_tokens=global_tokens, **options)
    return run_tune(checked, Console(quiet=True))


def run_tune(options: TuneOptions, console, *, backend=None) -> dict[str, Any]:
    """A whole tuning run: the result document, or NothingFits (its message says why and where the
    trials are). Progress goes to `console` (the CLI's; autotune.tune() passes a quiet one), what the
    libraries print on their own to the run's autotune.log (run_folder.LibraryOutput).
    `backend`: a trial backend of options.backend's kind to use (and not close), so that runs of
    one `autotune plan` share its traces; None makes one for this run."""
    from autotune.results.run_folder import LibraryOutput

    with LibraryOutput() as library:
        return _run_tune(options, console, backend=backend, library=library)


def _run_tune(options: TuneOptions, console, *, backend, library) -> dict[str, Any]:
    from autotune.problem.batch import DEFAULT_TOLERANCE, check_reachable, check_target
    from autotune.search.records import DEFAULT_HEADROOM, TuneRequest
    from autotune.problem.packing import check_packing_problem, resolve_packing
    from autotune.problem.routing import parse_routing_skew
    from autotune.search.space import load_space
    from autotune.results.run_folder import RunLog, ensure_writable, new_run_dir, write_run_state
    from autotune.search.store import TrialStore, default_storage, study_name
    from autotune.util.units import format_bytes, parse_count

    check_multi_node(options)
    if str(options.global_tokens).strip().startswith("-"):
        raise UsageError(f"--global-tokens must be positive, got {options.global_tokens}: e.g. 4M")
    target = parse_count(options.global_tokens, what="--global-tokens")
    if target < 1:
        raise UsageError("--global-tokens must be positive, e.g. 4M")
    tolerance = DEFAULT_TOLERANCE if options.global_tolerance is None else options.global_tolerance
    workload = resolve_workload(options)
    finetuning = resolve_finetuning(options)
    stack = resolve_stack(options)

    def check_batch(num_gpus: int, seq_len: int, ranks: str = "") -> None:
        check_target(target_tokens=target, num_gpus=num_gpus, seq_len=seq_len, ranks=ranks)
        if options.token_budget is not None:  # packed batches hit the target in expectation (autotune/problem/packing.py)
            return
        check_reachable(target_tokens=target, num_gpus=num_gpus, seq_len=seq_len, tolerance=tolerance, ranks=ranks)

    model, cluster, seq_len, gpu_note = resolve_problem(options, check_batch=check_batch)
    packing, budget_rows = resolve_packing(options.token_budget, options.doc_lengths, seq_len=seq_len)
    if packing is not None:
        check_packing_problem(stack=stack, config=model.config_dict, model_name=model.name)
    space = load_space(options.space)
    if budget_rows is not None:  # --token-budget N: the search stays within it
        space = dataclasses.replace(space, max_micro_batch=min(space.max_micro_batch, budget_rows))
    if options.precision is not None:  # --precision overrides the search space's baseline.precision
        space = dataclasses.replace(space, precision=options.precision)
    if options.compile is not None:  # --compile overrides the search space's compile.mode
        space = dataclasses.replace(space, compile=options.compile)
    if options.float8 is not None:  # --float8 overrides the search space's float8.mode
        space = dataclasses.replace(space, float8=options.float8)
    from autotune.problem.config import check_float8_gpu, check_float8_library

    check_float8_gpu(space.float8, cluster.gpu)  # before the run folder: nothing half-written
    formats = parse_formats(options.export) if options.export else []
    check_out_file(options.out)
    check_hardware(options)
    backend_name, backend_why = choose_backend(options.backend, cluster)
    if space.float8 not in ("none", "auto") and cluster.gpu.has_float8 and backend_name != "analytic":
        check_float8_library(f"--float8 {space.float8}")  # traced or run: torchao's float8 linears
    check_wrappable(model)  # builds the model on the meta device: after the checks that need no model
    routing = parse_routing_skew(options.routing_skew)  # parsed once (options.routing_skew)
    if not routing.balanced:
        routing.check_experts(model.num_experts, model.name)
    check_precision_runs(model, space.precision)
    finetuning, finetuning_note = fit_finetuning(options, finetuning, model)
    if space.precision == "bf16-pure" and not cluster.gpu.supports_bf16:  # bf16 mixed falls back to fp16; pure cannot
        given = "--precision bf16-pure" if options.precision else f"search space {options.space!r}: baseline.precision bf16-pure"
        raise UsageError(f"{given}: {cluster.gpu.name} has no bf16; use fp16 (mixed) or fp32")
    vllm_share = None
    if workload.kind == "grpo":  # before the run folder: a share vLLM cannot start in is a usage error
        chosen = with_vllm_share(TuneRequest(model=model, cluster=cluster, seq_len=seq_len, target_tokens=target,
                                             tolerance=tolerance, space=space, workload=workload),
                                 fixed=options.vllm_gpu_memory_utilization is not None,
                                 completion_given=options.max_completion_length is not None)
        workload, vllm_share = chosen.workload, chosen.vllm_share
    runs_dir = ensure_writable(Path(options.runs_dir))
    check_backend_traces(model, backend_name)
    if backend_name in ("cpu", "cuda") and cluster.host_memory_bytes is None:
        # Real trials run where the job will run: this machine's memory is the host memory per node.
        detected = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        cluster = dataclasses.replace(cluster, host_memory_bytes=detected)
        gpu_note += f"; host memory {format_bytes(detected)} per node (detected here; set --host-memory to override)"
    request = TuneRequest(model=model, cluster=cluster, seq_len=seq_len, target_tokens=target,
                          tolerance=tolerance,
                          headroom=DEFAULT_HEADROOM if options.headroom is None else options.headroom,
                          space=space, max_trials=options.max_trials, time_budget_s=options.time_budget,
                          workload=workload, finetuning=finetuning, stack=stack, vllm_share=vllm_share,
                          routing_skew=routing, packing=packing)
    store = TrialStore(options.storage or default_storage(runs_dir), options.study or study_name(request, backend_name))
    finished = store.finished()
    run_dir = new_run_dir(request, runs_dir)
    log = RunLog(run_dir / "autotune.log")
    library.attach(log)
    write_run_state(run_dir, "running", log)
    state = "failed"
    try:
        document = _tune_in_run_dir(options, console, request=request, store=store, finished=finished,
                                    run_dir=run_dir, log=log, backend_name=backend_name,
                                    backend_why=backend_why, gpu_note=gpu_note, formats=formats, backend=backend,
                                    notes=[finetuning_note] if finetuning_note else [])
        state = "done"
        return document
    except NothingFits:
        state = "nothing-fits"
        raise
    except KeyboardInterrupt:
        state = "interrupted"
        raise
    finally:
        write_run_state(run_dir, state, log)  # the folder says how the run ended, whatever happened
        log.close()


def _tune_in_run_dir(options: TuneOptions, console, *, request, store, finished, run_dir: Path, log,
                     backend_name: str, backend_why: str, gpu_note: str, formats: list[str],
                     backend=None, notes: list[str] = ()) -> dict[str, Any]:
    """The run itself, once its folder is claimed: trials, then the files. `notes`: what the run
    changed of what was asked, first among the outcome's notes."""
    from autotune.backends import get_backend
    from autotune.search.controller import Controller
    from autotune.search.records import at_batch_wall, why_lost, why_nothing_fits
    from autotune.util.files import write_atomic
    from autotune.results.result import build_result, dumps, text_only_note, text_only_section
    from autotune.results.run_folder import trials_csv
    from autotune.search.store import step_record

    run_id = run_dir.name
    model = request.model
    shared = backend is not None
    backend = backend or make_backend(backend_name, options)
    predictor = _predictor_for(backend_name)
    console.header(request, backend_name, backend_why, backend.describe(), store, finished, run_dir)
    console.note(gpu_note)
    log(f"run {run_id}: study {store.name} on {store.storage}; backend {backend_name} ({backend_why})")

    def on_step(step) -> None:
        number = store.record(step, run_id=run_id)
        console.step(step, number)
        record = dict(step_record(step)["result"])
        record["extras"] = dict(record.get("extras") or {})
        trace = record["extras"].pop("traceback", None)
        log(f"step {step.step} [{step.stage}] {step.train.label()} -> {step.result.status} "
            f"fits={step.fits} {json.dumps(record, default=str)} reason: {step.reason}"
            + (f"\n{trace}" if trace else ""))  # a failed trace's whole traceback: the console has its first line

    controller = Controller(request, backend, predictor=predictor, estimator=get_backend("analytic"),
                            finished=finished, on_step=on_step, on_start=console.trial_started)
    try:
        with console.progress():
            outcome = controller.tune()
    finally:
        if not shared:
            backend.close()
        if predictor is not None:
            predictor.close()
    def build(step, steps=None) -> dict:
        return build_result(request, step, outcome.steps if steps is None else steps, backend=backend_name,
                            wrap=model.block_class, run_id=run_id, study=store.name, notes=outcome.notes,
                            sampling=outcome.sampling)

    # The stack the user runs: a winner whose knobs its file cannot set gives way to the fastest it can,
    # before the table and trials.csv say which trial won and why the others lost.
    runnable = None
    if outcome.winner is not None:
        document = build(outcome.winner)
        stack_winner, runnable = winner_for_stack(request, outcome, document, build)
        if stack_winner is not None:
            outcome.winner, document = stack_winner, build(stack_winner, runnable)
        outcome.notes.extend(note for note in stack_notes(request, document) if note not in outcome.notes)
        if not request.routing_skew.balanced:  # the assumption, the rank that binds, what it ruled out
            from autotune.problem.routing import tune_note

            tried = [(s.train.label(short=True), s.result.peak_bytes, s.fits, s.result.throughput) for s in outcome.steps
                     if s.train.expert_parallel > 1 and s.result.status in ("ok", "oom")]
            outcome.notes.append(tune_note(request.routing_skew, model.num_experts,
                                           outcome.winner.train.expert_parallel, tried))
    records = store.trials(run_id=run_id)
    lost = {s.step: why_lost(s, outcome.winner, request, runnable) for s in outcome.steps}
    for record in records:  # why a trial that ran lost, for trials.csv and report.html
        word, detail = lost.get(record["step"]) or (None, None)
        record.update(lost=word, lost_detail=detail)
    write_atomic(run_dir / "trials.csv", trials_csv(records))
    if model.text_tower_of and outcome.winner is not None:  # what --text-only left out, at the winner's precision
        left_out = text_only_section(model, num_gpus=request.cluster.num_gpus, precision=outcome.winner.train.precision)
        outcome.notes.insert(0, text_only_note(left_out))
    outcome.notes[:0] = notes
    for note in outcome.notes:
        console.note(note)
        log(f"note: {note}")
    console.trial_table(outcome.steps, request, winner=outcome.winner, runnable=runnable)
    if outcome.winner is None:
        # The last FSDP configuration says which limit binds (a tensor- or context-parallel one tried after it fitted
        # no better).
        last = next((s for s in reversed(outcome.steps) if s.train.ranks_per_batch == 1),
                    outcome.steps[-1] if outcome.steps else None)
        reason = why_nothing_fits(last, request, outcome.steps) if last is not None else "no configuration was evaluated"
        raise NothingFits(f"{reason}; trials are in {run_dir}",
                          binds="global batch" if at_batch_wall(outcome.steps) else "memory")
    document = build(outcome.winner, runnable)
    text = dumps(document)
    write_atomic(run_dir / "best.json", text)
    if options.out:
        write_atomic(Path(options.out), text)
    _write_report(run_dir, document, records, console)
    if formats:
        write_formats(document, formats, run_dir, console)
    log(f"winner: step {outcome.winner.step} {outcome.winner.train.label()}; wrote {run_dir / 'best.json'}")
    console.winner(document, run_dir, options.out)
    return document


STACK_FORMATS = {"trl-padding-free": "trl"}
"""A stack's export format, where the names differ (config.STACKS)."""
WRITTEN_PER_STACK = ("compile", "float8", "async_tensor_parallel", "loss_parallel", "activation_offload",
                     "expert_parallel", "shard_placement", "shard_group_size", "reshard_group_size")
"""Knobs an export may leave unwritten (export._base.map_knobs_not_expressed): a stack whose file marks one
of them unsupported does not run the winner as tuned."""


def _at_default(train, names) -> bool:
    """Whether every knob of `names` is at its default in `train`."""
    from autotune.problem import knobs

    return all(getattr(train, name) == knobs.BY_NAME[name].default for name in names)


def not_run_as_tuned(document: dict, fmt: str) -> list[str] | None:
    """The winner's knobs `fmt`'s file cannot set (the real exporter's mapping says so), or None where
    the format cannot express the result at all (torchtitan without a model of these shapes)."""
    from autotune.results.export import ExportRefused, export_result

    try:
        export = export_result(document, fmt)
    except ExportRefused:
        return None
    return [m.knob for m in export.mappings if m.status == "unsupported" and m.knob in WRITTEN_PER_STACK]


def winner_for_stack(request, outcome, document: dict, build):
    """Under --stack S (not fsdp2): (the fastest eligible step whose every knob S's file sets, the steps
    without the knobs S cannot set) where the winner needs one S cannot, else (None, None): the winner
    stands. A knob the user's stack cannot run is not picked for it; the note says what the faster
    configuration was."""
    from autotune.search.records import eligible

    fmt = STACK_FORMATS.get(request.stack, request.stack)
    missing = not_run_as_tuned(document, fmt) if fmt != "fsdp2" else []
    if not missing:
        return None, None
    winner = outcome.winner
    runnable = [s for s in outcome.steps if _at_default(s.train, missing)]
    for step in sorted(eligible(outcome.steps, request.tolerance), key=lambda s: -(s.result.throughput or 0.0)):
        if step is winner or step.stage == "confirm":
            continue
        if not_run_as_tuned(build(step), fmt) == []:
            gain = (winner.result.throughput or 0) / (step.result.throughput or 1) - 1
            source = winner.result.tokens_per_sec.source if winner.result.tokens_per_sec else "no figure"
            outcome.notes.append(
                f"winner for --stack {request.stack}: {step.train.label()} (step {step.step}); the fastest, "
                f"{winner.train.label()} (step {winner.step}, {gain:+.1%} tokens/s, {source}), needs "
                f"{', '.join(missing)}, which {fmt}'s file cannot set (autotune export --format {fmt} says how "
                "to by hand); best.json's decision path lists the trials that stack runs")
            return step, runnable
    return None, None


def stack_notes(request, document: dict) -> list[str]:
    """Which stacks' exports run the winner as tuned: one note where some cannot (checked with each
    format's real exporter), and the stack the memory was predicted for."""
    from autotune.util import cache
    from autotune.problem.config import TrainConfig

    if _at_default(TrainConfig.from_result(document), WRITTEN_PER_STACK):
        return []  # every knob a file may leave unwritten is at its default: every stack runs it
    # The exporters import torch: a repeated tune answered from the cache keeps not needing it.
    same = {k: v for k, v in document.items() if k not in ("run_id", "study", "provenance", "notes")}
    return cache.cached("stack-notes", {"stack": request.stack, "result": same},
                        lambda: _stack_notes(request, document))


def _stack_notes(request, document: dict) -> list[str]:
    from autotune.results.export import FORMATS, ON_REQUEST

    runs, not_runs = [], {}
    for fmt in FORMATS:
        if fmt in ON_REQUEST:
            continue
        missing = not_run_as_tuned(document, fmt)
        if missing == []:
            runs.append(fmt)
        elif missing:
            not_runs.setdefault(", ".join(missing), []).append(fmt)
    if not not_runs:
        return []
    others = "; ".join(f"{', '.join(fmts)} cannot set its {knobs}" for knobs, fmts in not_runs.items())
    from autotune.problem.config import STACKS

    stacks = [fmt for fmts in not_runs.values() for fmt in fmts if fmt in STACKS]
    tip = f" (--stack {stacks[0]} tunes for that stack)" if stacks else ""
    return [f"predicted for {request.stack}'s step; runs as tuned in {', '.join(runs)}; {others}{tip}"]


def parse_formats(text: str) -> list[str]:
    """--format / --export: comma-separated format names in any case, or 'all'."""
    from autotune.results.export import FORMATS, ON_REQUEST

    if text.strip().lower() == "all":
        return [f for f in FORMATS if f not in ON_REQUEST]
    given = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [g for g in given if g.lower() not in FORMATS]
    if unknown or not given:
        raise UsageError(f"unknown export format {', '.join(unknown) or text!r}: choose from "
                         f"{', '.join(FORMATS)} or 'all' (every one but {', '.join(ON_REQUEST)})")
    return list(dict.fromkeys(g.lower() for g in given))  # fsdp2,FSDP2 is one file


def write_formats(document: dict, formats: list[str], out_dir: Path, console) -> list[Path]:
    """Write each format; one that cannot express this result (torchtitan without a model it has) is
    skipped with a warning, named or in 'all', and the others are written. Nothing written at all is
    a UsageError (exit 2) that says why."""
    from autotune.results.export import write_exports

    refused: list[str] = []
    paths = write_exports(document, formats, out_dir,
                          on_refused=lambda fmt, why: refused.append(f"{fmt} not written: {why}"),
                          on_written=lambda exported, path: console.exported(exported.format, path, exported.warnings))
    if refused and not paths:
        raise UsageError("; ".join(refused))
    for line in refused:
        console.err.print(f"autotune: warning: {line}", markup=False)
    return paths


def _write_report(run_dir: Path, document: dict, records: list[dict], console) -> None:
    try:
        from autotune.results.report import write_report
    except ImportError:
        return
    path = write_report(run_dir, document, records)
    console.note(f"report: {path}")


# -- building the problem from options (TuneOptions, or the trial command's flags: the same names) --
def check_multi_node(options: Options) -> None:
    """Multi-node options, checked before anything is written (docs/REAL_TRIALS.md)."""
    if getattr(options, "node_rank", None) is not None:  # a CLI flag only, kept to say what replaced it
        raise UsageError("--node-rank is gone: torchrun's c10d rendezvous assigns node ranks. Run autotune on one "
                         "node with --shared-dir DIR and `autotune agent --shared-dir DIR` on the others "
                         "(docs/REAL_TRIALS.md)")
    if options.shared_dir and options.backend not in ("cpu", "cuda"):
        raise UsageError(f"--shared-dir is for real trials across nodes: add --backend cuda (or cpu), not "
                         f"{options.backend}")
    if options.shared_dir and not options.rdzv_endpoint:
        raise UsageError("--shared-dir needs --rdzv-endpoint HOST:PORT, a port on this node every node reaches "
                         "(torchrun's rendezvous)")


def check_batch_beyond_fsdp(check, *, gpus: int, gpus_per_node: int, seq_len: int, model) -> None:
    """`check(ranks, seq_len, who)` (the global batch's checks, UsageError when it cannot be kept) on every GPU,
    and where FSDP alone cannot keep it, on the data ranks of the widest split the model and the cluster
    allow: tensor-, context- or pipeline-parallel, or pipeline stages over tensor-parallel groups (a group of
    GPUs then shares each sequence; the error, if any, counts those ranks). `model`: a callable giving the
    ModelSpec, asked for only past the wall."""
    try:
        check(gpus, seq_len, "")
    except UsageError:
        from autotune.problem.batch import data_ranks_text
        from autotune.problem.knobs import ProblemShape, widest_split

        widest = widest_split(ProblemShape(num_gpus=gpus, gpus_per_node=gpus_per_node, model=model(), seq_len=seq_len))
        ways = widest[0] * widest[1] * widest[2]
        if ways == 1:
            raise
        check(gpus // ways, seq_len, data_ranks_text(gpus, *widest))


def resolve_problem(options: Options, *, check_batch=None) -> tuple[Any, Any, int, str]:
    """(ModelSpec, Cluster, seq_len, how the GPU type was chosen) from the shared options, validated.
    `check_batch(num_gpus, seq_len)` runs before anything slow (GPU detection imports torch)."""
    from autotune.problem.catalog.gpus import DEFAULT_GPU, GPUS, detect_gpu, resolve_gpu
    from autotune.problem.catalog.models import resolve_model
    from autotune.problem.config import Cluster
    from autotune.util.units import parse_bytes

    if not options.model:
        raise UsageError("--model is required (a catalog name or a path to a config.json)")
    if options.gpus is None:
        raise UsageError("--gpus is required: the total number of GPUs of the job, e.g. --gpus 8")
    model = resolve_model(options.model, trust_remote_code=options.trust_remote_code,
                          text_only=options.text_only).with_attention(getattr(options, "attention", None))
    seq_len = options.seq_len or model.default_seq_len
    if model.max_positions and seq_len > model.max_positions:
        raise UsageError(f"--seq-len {seq_len} is longer than {model.name} supports "
                         f"({model.max_positions} positions): lower --seq-len")
    gpu_memory = parse_bytes(options.gpu_memory, what="--gpu-memory") if options.gpu_memory else None
    host_memory = parse_bytes(options.host_memory, what="--host-memory") if options.host_memory else None
    if gpu_memory is not None and gpu_memory < 1:
        raise UsageError("--gpu-memory must be positive, e.g. 40GiB")
    from autotune.problem.config import cluster_nodes

    nodes, shape_note = cluster_nodes(options.gpus, nodes=options.nodes,
                                      gpus_per_node=getattr(options, "gpus_per_node", None))
    Cluster(num_gpus=options.gpus, num_nodes=nodes)  # the cluster's shape first: the first error is the real one
    if check_batch is not None:
        check_batch_beyond_fsdp(check_batch, gpus=options.gpus, gpus_per_node=options.gpus // nodes, seq_len=seq_len,
                                model=lambda: model)
    if options.gpu_type:
        gpu, gpu_note = resolve_gpu(options.gpu_type), "given with --gpu-type"
    else:
        gpu, gpu_note = detect_gpu(), "detected"
        if gpu is None:
            gpu, gpu_note = GPUS[DEFAULT_GPU], "the default: no GPU detected here; set --gpu-type"
    cluster = Cluster(num_gpus=options.gpus, num_nodes=nodes, gpu=gpu, gpu_memory_bytes=gpu_memory,
                      host_memory_bytes=host_memory)
    return model, cluster, seq_len, f"GPU type {gpu.name} ({gpu_note})" + (f"; {shape_note}" if shape_note else "")


def resolve_workload(options: Options, recorded: dict | None = None):
    """The workload from the flags; `recorded` (a result's) fills what the flags leave out."""
    from autotune.problem.config import Workload

    recorded = recorded or {}
    kind = options.workload or recorded.get("kind", "sft")
    def flag_or_recorded(name: str):
        value = getattr(options, name, None)
        return recorded.get(name) if value is None and kind == recorded.get("kind") else value

    return Workload(kind=kind, vllm_gpu_memory_utilization=flag_or_recorded("vllm_gpu_memory_utilization"),
                    max_completion_length=flag_or_recorded("max_completion_length"),
                    num_generations=flag_or_recorded("num_generations"))


def with_vllm_share(request, *, fixed: bool, completion_given: bool):
    """A GRPO request with vLLM's share checked (fixed: the user's) or chosen (vllm_share.choose_share),
    and the record of why on the request."""
    from autotune.estimate.vllm_share import check_completion, choose_share, generation_sequences, share_note, vllm_need

    workload, completion = check_completion(request.workload, request.seq_len, given=completion_given)
    cluster = request.cluster
    sequences = generation_sequences(target_tokens=request.target_tokens, num_gpus=cluster.num_gpus,
                                     seq_len=request.seq_len, max_micro_batch=request.max_micro_batch,
                                     tolerance=request.tolerance)
    need = vllm_need(request.model, seq_len=request.seq_len, sequences=sequences)
    workload, record = choose_share(workload, need, cluster.capacity_bytes, fixed=fixed, completion=completion)
    record["note"] = share_note(workload, record)
    return dataclasses.replace(request, workload=workload, vllm_share=record)


def resolve_stack(options: Options, recorded: str | None = None) -> str:
    """The stack whose step is predicted: the flag, else a result's, else fsdp2 (autotune's own loop)."""
    from autotune.problem.config import check_stack

    return check_stack(getattr(options, "stack", None) or recorded or "fsdp2")


def resolve_finetuning(options: Options, recorded: dict | None = None):
    """What trains, from the flags; `recorded` (a result's) fills what the flags leave out. A LoRA
    flag without `--peft lora` or `qlora` is refused: it would change nothing. QLoRA needs
    bitsandbytes (its 4-bit layers are built, traced and run: training.quantize_base)."""
    from autotune.problem.config import FineTuning

    given = {name: getattr(options, f"lora_{name}", None) for name in ("rank", "alpha", "dropout", "targets")}
    peft = getattr(options, "peft", None) or (recorded or {}).get("peft", "none")
    if peft not in ("lora", "qlora"):
        extra = [f"--lora-{name}" for name, value in given.items() if value is not None]
        if extra:
            raise UsageError(f"{', '.join(extra)} applies to --peft lora only (and qlora); add --peft lora or drop it")
        return FineTuning()
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise UsageError(f"--peft {peft} needs the peft library: pip install 'autotune[finetune]' (or pip install peft)")
    if peft == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
        raise UsageError("--peft qlora needs bitsandbytes (its 4-bit layers are traced and run): "
                         "pip install 'autotune[qlora]' (or pip install bitsandbytes)")
    base = dict(recorded or {}) if (recorded or {}).get("peft") == peft else {}
    base.update({name: value for name, value in given.items() if value is not None})
    for name in ("rank", "alpha"):  # whole numbers as integers (peft's and TRL's fields are ints)
        if isinstance(base.get(name), float) and base[name].is_integer():
            base[name] = int(base[name])
    return FineTuning.from_dict({**base, "peft": peft})


def fit_finetuning(options: Options, finetuning, model):
    """(`finetuning` as peft can build it on `model`, a note saying what changed or None). Where its
    targets reach an MoE's fused experts, which peft adapts without dropout, the dropout is 0,
    said in a note; a dropout given with --lora-dropout there is refused."""
    if not finetuning.lora or not finetuning.dropout:
        return finetuning, None
    from autotune.distributed.training import fused_expert_targets

    experts = fused_expert_targets(model, finetuning)
    if not experts:
        return finetuning, None
    targets = (f"--lora-targets {finetuning.targets}" if getattr(options, "lora_targets", None) is not None
               else f"the default targets ({finetuning.targets})")
    reach = f"{targets} reach {model.name}'s fused experts ({', '.join(experts)}), which peft adapts without dropout"
    if getattr(options, "lora_dropout", None) is not None:
        raise UsageError(f"--lora-dropout {finetuning.dropout:g}: {reach}; give --lora-dropout 0, or --lora-targets "
                         f"naming linear layers only (e.g. q_proj,k_proj,v_proj,o_proj)")
    return dataclasses.replace(finetuning, dropout=0.0), f"LoRA dropout 0, not {finetuning.dropout:g}: {reach}"


def check_wrappable(model) -> None:
    """Fail now, with the supported families, if FSDP cannot wrap the model (a meta build: run it
    after the cheap checks, so a typo in a number is refused at once)."""
    _ = model.block_class


SPACE_BF16_PURE = 'tune it in bf16-pure (a --space file with [baseline] precision = "bf16-pure")'


def check_precision_runs(model, precision: str, *, instead: str = SPACE_BF16_PURE) -> None:
    """Refuse, before any trial, a model that cannot train in this precision: under mixed precision
    (compute dtype other than the master dtype), one whose float32 buffers meet bf16 activations
    (ModelSpec.mixed_precision_clash); in bf16-pure or fp32 transformers builds buffers and
    parameters alike."""
    from autotune.problem.config import MASTER_DTYPE_NAMES, PARAM_DTYPE_NAMES

    if PARAM_DTYPE_NAMES[precision] == MASTER_DTYPE_NAMES[precision]:
        return
    clash = model.mixed_precision_clash
    if clash:
        raise UsageError(f"{model.name} cannot train in {precision} mixed precision: {clash}; {instead}")


def check_backend_traces(model, backend: str) -> None:
    """Refuse the simulator, before any trial, for a model fake tensors cannot run
    (ModelSpec.untraceable): every trial would fail alike."""
    if backend == "sim" and model.untraceable:
        raise UsageError(f"{model.name} cannot be simulated: {model.untraceable}; tune it with real trials, "
                         "--backend cpu or cuda")


def check_hardware(options) -> None:
    """UsageError (one line) for a --hardware profile that cannot be read, before the model is
    built (seconds with the cache off); make_backend loads it again for the sim."""
    if getattr(options, "hardware", None):
        if options.backend in ("analytic", "cpu", "cuda"):  # only the simulator's cost model reads a profile
            raise UsageError(f"--hardware applies to --backend sim (its per-operation cost model on the profile); "
                             f"--backend {options.backend} would ignore it: drop --hardware or use --backend sim")
        from autotune.estimate.hardware import load_profile

        load_profile(options.hardware)


def check_out_file(out: str | None) -> None:
    """--out must be writable before any trial runs: finding out after an hour is no help."""
    if not out:
        return
    import tempfile

    path = Path(out)
    if path.is_dir():
        raise UsageError(f"--out {out!r} is a folder: give a file name, e.g. --out best.json")
    folder = path.parent if str(path.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".autotune-probe."):
            pass
    except OSError as exc:
        raise UsageError(f"--out {out!r} cannot be written ({exc.strerror}): choose a writable path") from None


def choose_backend(name: str, cluster) -> tuple[str, str]:
    """(backend name, why) -- `auto` takes the GPUs when they are here, else the simulator."""
    if name != "auto":
        return name, "chosen with --backend"
    from autotune.problem.catalog.gpus import nvidia_driver_present

    visible = 0
    if nvidia_driver_present():  # else no GPU can be here: torch need not be imported to say so
        try:
            import torch

            visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception:
            visible = 0
    if visible >= cluster.gpus_per_node and cluster.num_nodes == 1:
        return "cuda", f"{visible} GPUs visible here"
    reason = "no GPU here" if visible == 0 else f"{visible} GPUs here, {cluster.gpus_per_node} needed"
    return "sim", f"{reason}: memory predicted by tracing the real model with fake tensors, throughput estimated"


def make_backend(name: str, options: Options):
    from autotune.backends import get_backend

    if name == "cpu" and not options.shared_dir:  # every rank on this machine, whatever --nodes says
        return get_backend(name, timeout_s=options.timeout)
    if name in ("cpu", "cuda"):
        from autotune.problem.config import cluster_nodes

        # Real trials launch on the problem's nodes, by the one convention (resolve_problem's too).
        nodes = options.nodes or (cluster_nodes(options.gpus, gpus_per_node=getattr(options, "gpus_per_node", None))[0]
                                  if options.gpus else 1)
        return get_backend(name, timeout_s=options.timeout, nnodes=nodes, rdzv_endpoint=options.rdzv_endpoint,
                           shared_dir=options.shared_dir)
    if name == "sim":  # the two shallow depths of each configuration traced on two cores
        if getattr(options, "hardware", None):
            from autotune.estimate.hardware import load_profile

            profile = load_profile(options.hardware)  # a cpu profile: the sim predicts a cpu backend run here
            return get_backend(name, hardware=profile, device_kind=profile.device, parallel=True)
        return get_backend(name, parallel=True)
    return get_backend(name)


def _predictor_for(name: str):
    """Real trials are filtered by the simulator: predicted not to fit means never launched."""
    if name not in ("cpu", "cuda"):
        return None
    from autotune.backends import get_backend

    return get_backend("sim", device_kind=name)

