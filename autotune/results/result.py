"""The result document (best.json, schema_version 1; see schemas/result.schema.json)."""

from __future__ import annotations

import json
import platform
import shlex
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from autotune.search.records import Step, TuneRequest, eligible, prediction_summary, why_lost
from autotune.util.version import __version__
from autotune.problem import knobs
from autotune.problem.config import (MASTER_DTYPE_BYTES, MASTER_DTYPE_NAMES, PARAM_DTYPE_BYTES, PARAM_DTYPE_NAMES,
                             reduce_dtype_name, stack_section, stack_step)
from autotune.problem.packing import packing_section
from autotune.problem.routing import routing_section
from autotune.estimate.runtime_memory import ALLOC_CONF_ENV, alloc_conf
from autotune.util.secrets import mask

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / "result.schema.json"


def _installed(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def provenance() -> dict[str, str]:
    import optuna

    return {
        "tool": f"autotune {__version__}",
        # Installed versions, read without importing (a plan served from the cache needs neither).
        "torch": _installed("torch"),
        "transformers": _installed("transformers"),
        "optuna": optuna.__version__,
        "python": platform.python_version(),
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "command": mask(shlex.join(["autotune", *sys.argv[1:]])),  # never a storage password
    }


def model_section(request: TuneRequest) -> dict[str, Any]:
    model = request.model
    config = model.config_dict
    return {
        "name": model.name,
        "parameters": model.num_parameters,
        "model_type": model.model_type,
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "vocab_size": model.vocab_size,
        "mlp_width": model.mlp_width,
        "source": model.source,
        "attention_implementation": model.attention_implementation,
        "config": {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool)) or v is None},
    }


def text_only_section(model, *, num_gpus: int, precision: str) -> dict[str, Any] | None:
    """--text-only: what of the multimodal model was left out of the tune, and an estimate of the
    memory per GPU its parameters would add under FSDP at this GPU count (the language model's
    precision: sharded master weight, gradient and AdamW's two states; the weights gathered whole
    once). None for a text model."""
    left = model.text_tower_of
    if not left:
        return None
    count = int(left["left_out_parameters"])
    state_bytes = 4 * MASTER_DTYPE_BYTES[MASTER_DTYPE_NAMES[precision]]
    return {
        "of": left["model_type"],
        "gpus": num_gpus,
        "model_class": left["model_class"],
        "language_model_class": left.get("language_model_class"),
        "whole_model_parameters": int(left["parameters"]),
        "tuned_parameters": model.num_parameters,
        "left_out_parameters": count,
        "left_out_modules": dict(left["left_out_modules"]),
        "left_out_state_bytes_per_gpu_estimated": -(-count * state_bytes // num_gpus),
        "left_out_gathered_bytes_estimated": count * PARAM_DTYPE_BYTES[precision],
        "basis": (f"estimated, not traced: {state_bytes} B a left-out parameter ({MASTER_DTYPE_NAMES[precision]} "
                  f"weight, gradient, AdamW's two states) sharded over {num_gpus} GPUs, and its "
                  f"{PARAM_DTYPE_NAMES[precision]} weights gathered whole while they compute"),
        "not_traced": "the left-out towers' activations (image/patch tokens) and the image tokens' share of "
                      "the sequence",
    }


def text_only_note(section: dict[str, Any]) -> str:
    """The console's line for `text_only_section`."""
    from autotune.util.units import format_bytes, format_count

    modules = ", ".join(f"{name} {format_count(n)}" for name, n in section["left_out_modules"].items())
    return (f"--text-only: tuned {section['of']}'s language model alone ({format_count(section['tuned_parameters'])} "
            f"of its {format_count(section['whole_model_parameters'])} parameters); left out {modules} "
            f"({format_count(section['left_out_parameters'])} parameters): at {section['gpus']} GPUs they would add "
            f"an estimated {format_bytes(section['left_out_state_bytes_per_gpu_estimated'])} per GPU of sharded "
            f"weights, gradients and AdamW states, plus {format_bytes(section['left_out_gathered_bytes_estimated'])} while gathered, and "
            "their image/patch activations, none of it traced: the memory figures here are the language model's")


def decision_path(steps: list[Step], winner: Step, request: TuneRequest) -> list[dict[str, Any]]:
    """Every trial, with why it lost where it ran (records.why_lost: a word and its sentence)."""
    lost = {s.step: why_lost(s, winner, request) or (None, None) for s in steps}
    return [{
        "step": s.step,
        "stage": s.stage,
        "config": s.train.to_dict(),
        "grad_accum_steps": s.batch.grad_accum_steps,
        "status": s.result.status,
        "fits": s.fits,
        "peak_memory_bytes": s.result.peak_bytes,
        "memory_source": s.result.peak_memory.source if s.result.peak_memory else None,
        "tokens_per_sec": s.result.throughput,
        "throughput_source": s.result.tokens_per_sec.source if s.result.tokens_per_sec else None,
        "reason": s.reason + (" (reused trial: no new trial)" if s.reused_from is not None else ""),
        "lost": lost[s.step][0],
        "lost_detail": lost[s.step][1],
    } for s in steps]


def loss_section(request: TuneRequest, winner: Step) -> dict[str, Any]:
    """Which loss path the prediction traced, and what its logits weigh, so that a user whose stack
    computes the loss differently (chunked or fused cross-entropy) knows how far the peak moves."""
    train = winner.train
    elements = train.micro_batch_size * request.seq_len * request.model.vocab_size
    compute_bytes = PARAM_DTYPE_BYTES[train.precision]
    site = str(winner.result.extras.get("peak_site", ""))
    return {
        "path": "transformers ForCausalLMLoss: logits in the compute dtype, upcast to fp32, cross-entropy "
                "over the whole vocabulary (log-probabilities kept for backward)",
        "logits_bytes": elements * (compute_bytes + 4),
        "logits_grad_bytes": elements * (compute_bytes + 4),
        "source": "estimated",
        "basis": f"micro-batch x seq_len x vocab = {elements:,} elements x ({compute_bytes} B logits + 4 B fp32 "
                 "log-probabilities); their gradients the same in backward",
        # Forward/backward sites of the root unit are the loss's (optimizer and weight-sync sites are not).
        "peak_at_loss": (site.split(" / ")[0] in ("fw", "bw") and site.split(" / ")[2] == "root")
        if site.count(" / ") >= 2 else None,
        "peak_site": site or None,
        "note": "a chunked or fused cross-entropy (torchtitan's ChunkedLossWrapper, Liger) keeps a fraction of "
                "this; where peak_at_loss is true the peak falls by up to logits_bytes + logits_grad_bytes",
    }


def finetuning_section(request: TuneRequest) -> dict[str, Any]:
    """What trained: every parameter (the model's cached count: no torch needed, so a cached plan
    stays free), or LoRA's adapters, counted on meta builds of the model as peft wraps it."""
    if not request.finetuning.lora:
        total = request.model.num_parameters
        return {**request.finetuning.to_dict(), "trainable_parameters": total, "total_parameters": total}
    from autotune.distributed.training import parameter_counts

    counts = parameter_counts(request.model, request.finetuning)
    return {**request.finetuning.to_dict(), "trainable_parameters": counts.trainable,
            "total_parameters": counts.total}


def workload_section(request: TuneRequest, winner: Step) -> dict[str, Any]:
    """What shared the GPUs with training, what it took from the limit, and the weight sync's peak."""
    workload, capacity = request.workload, request.cluster.capacity_bytes
    section: dict[str, Any] = {"kind": workload.kind,
                               "vllm_gpu_memory_utilization": workload.vllm_gpu_memory_utilization}
    if workload.kind == "grpo":
        # The simulator's figures (the winner's own, or the prediction that screened a real trial).
        sync = winner.result.extras.get("weight_sync") or (winner.predicted.extras.get("weight_sync")
                                                           if winner.predicted else None)
        section.update(max_completion_length=workload.max_completion_length,
                       num_generations=workload.num_generations, vllm_share=request.vllm_share)
        section.update(vllm_mode="colocate", vllm_memory_bytes=workload.vllm_bytes(capacity),
                       training_memory_bytes=capacity - workload.vllm_bytes(capacity),
                       weight_sync=sync)
    return section


def _range(span) -> list[float] | None:
    return [float(span[0]), float(span[1])] if span else None


def why_winner(winner: Step, steps: list[Step], request: TuneRequest) -> dict[str, Any]:
    """One sentence on why the winner won, against the runner-up (the next fastest configuration
    that fits within the global-batch tolerance)."""
    def figure(step: Step) -> str:
        tps = step.result.tokens_per_sec
        return f"{tps.value:,.0f} tokens/s ({tps.source})" if tps and tps.value else "no throughput figure"

    others = [s for s in eligible(steps, request.tolerance) if s.train != winner.train and s.result.throughput]
    runner = max(others, key=lambda s: s.result.throughput, default=None)
    if runner is None:
        sentence = (f"step {winner.step} ({winner.train.label()}) is the only configuration that fits with the "
                    f"global batch within {request.tolerance:.1%}: {figure(winner)}")
        return {"winner_step": winner.step, "runner_up_step": None, "sentence": sentence}
    gain = (winner.result.throughput or 0) / runner.result.throughput - 1
    sentence = (f"step {winner.step} ({winner.train.label()}) won with {figure(winner)}, {gain:+.1%} against the "
                f"runner-up, step {runner.step} ({runner.train.label()}) at {figure(runner)}")
    section = {"winner_step": winner.step, "runner_up_step": runner.step}
    tps = winner.result.tokens_per_sec
    if tps and tps.source == "estimated" and tps.value:
        margin, basis = ranking_margin(winner, runner)
        close = (runner.result.throughput or 0) >= tps.value * (1 - margin)
        span = winner.result.extras.get("tokens_per_sec_range")
        section.update(close_call=close, close_call_margin=margin, range_tokens_per_sec=_range(span))
        if close:
            commands = [_trial_command(request, s) for s in (winner, runner)]
            section["decide_with"] = commands
            sentence += (f"; a close call: a lead within {margin:.1%} ({basis}), so the ranking is not settled: a real "
                         f"trial of each decides ({commands[0]}; {commands[1]})")
        else:
            sentence += f"; the lead is beyond the {margin:.1%} two such estimates can be off ({basis})"
        if (versus := float8_versus(winner, runner, others)) is not None:
            float8, text = float8_call(winner, versus)
            section["float8_call"] = float8
            sentence += "; " + text
            if float8["close"]:
                section.setdefault("decide_with", [_trial_command(request, winner)])
                section["decide_with"].append(_trial_command(request, versus))
    return {**section, "sentence": sentence}


def float8_versus(winner: Step, runner: Step, others: list[Step]) -> Step | None:
    """The fastest configuration without float8 that a float8 winner's estimate is weighed against, where
    the runner-up is float8 too (a runner-up without float8 is weighed by ranking_margin already); None
    where the winner is not float8 or every other configuration is."""
    if winner.train.float8 == "none" or runner.train.float8 == "none":
        return None
    without = [s for s in others if s.train.float8 == "none"]
    return max(without, key=lambda s: s.result.throughput, default=None)


def float8_call(winner: Step, versus: Step) -> tuple[dict[str, Any], str]:
    """Whether a float8 winner's estimated lead over the fastest configuration without float8 is within
    what float8 estimates have measured short (costmodel.FLOAT8_RANGE_LOW, with the ranking error): then
    the choice of float8 rests on an estimate the one GPU measurement contradicts, and the result says so
    rather than picking it silently (issue 56)."""
    from autotune.estimate import costmodel

    lead = (winner.result.throughput or 0) / versus.result.throughput - 1
    margin = _float8_margin()
    close = lead < margin / (1 - margin)  # the winner's estimate x (1 - margin) would not beat versus's
    call = {"versus_step": versus.step, "lead": lead, "margin": margin, "close": close,
            "measured": costmodel.float8_measured_summary()}
    tps = versus.result.tokens_per_sec
    text = (f"float8's lead over the fastest configuration without it, step {versus.step} ({versus.train.label()}) "
            f"at {tps.value:,.0f} tokens/s ({tps.source}), is {lead:+.1%} (estimated)")
    if close:
        text += (f", within the {margin:.1%} a float8 estimate can fall short ({call['measured']}): float8 is not "
                 "settled; a real trial of each decides")
    else:
        text += f", beyond the {margin:.1%} a float8 estimate has fallen short ({call['measured']})"
    return call, text


def _float8_margin() -> float:
    """How far below another's a float8 configuration's estimate could really be: the ranking error widened by the
    worst float8 speed-up measured against its estimate (costmodel.FLOAT8_RANGE_LOW)."""
    from autotune.estimate import costmodel

    return 1 - (1 - costmodel.RANKING_ERROR) * costmodel.FLOAT8_RANGE_LOW


def ranking_margin(winner: Step, runner: Step) -> tuple[float, str]:
    """How far below the runner-up's estimate the winner's could really be, by the validation figures
    (costmodel): (the fraction, what it is). Two GPU estimates of one model on one cluster share most
    of their error, so their ratio is surer than either (costmodel.RANKING_ERROR); a float8 speed-up only
    the winner has can fall short of its estimate (costmodel.FLOAT8_RANGE_LOW). CPU profiles and host-bound
    estimates have no validated ranking: there the winner's whole range."""
    from autotune.estimate import costmodel

    extras = winner.result.extras
    span = extras.get("tokens_per_sec_range")
    unvalidated = extras.get("real_backend") == "cpu" or (extras.get("step_time") or {}).get("host_bound")
    if unvalidated and span:
        return (1 - span[0] / winner.result.tokens_per_sec.value,
                f"the winner's estimated range {span[0]:,.0f}-{span[1]:,.0f} tokens/s: no ranking of such estimates "
                "is validated")
    margin = costmodel.RANKING_ERROR
    basis = f"the worst a ratio of two GPU estimates has been off, costmodel.RANKING_ERROR {margin:.1%}"
    if winner.train.float8 not in ("none", runner.train.float8):
        margin = _float8_margin()
        basis += (f", with the winner's float8 speed-up at the worst measured against its estimate "
                  f"(x{costmodel.FLOAT8_RANGE_LOW:.2f})")
    return margin, basis


def _trial_command(request: TuneRequest, step: Step) -> str:
    """The `autotune trial` that measures `step`'s configuration for real."""
    t = step.train
    backend = step.result.extras.get("real_backend", "cuda")  # cpu: the estimate was of a cpu run
    return (f"autotune trial --model {request.model.name} --gpus {request.cluster.num_gpus} "
            f"--nodes {request.cluster.num_nodes} --gpu-type {request.cluster.gpu.name} --backend {backend} "
            f"--seq-len {request.seq_len} --micro-batch {t.micro_batch_size} "
            f"--grad-accum {step.batch.grad_accum_steps} --ac {t.activation_checkpointing} "
            f"--{'' if t.reshard_after_forward else 'no-'}reshard --{'' if t.cpu_offload else 'no-'}offload "
            f"--precision {t.precision} --optimizer-impl {t.optimizer_impl}"
            + (f" --hsdp {t.shard_group_size}" if t.shard_group_size else "")
            + (f" --reshard-group {t.reshard_group_size}" if t.reshard_group_size else "")
            + (f" --shard-placement {t.shard_placement}" if t.shard_placement != "dim0" else "")
            + (f" --ep {t.expert_parallel}" if t.expert_parallel > 1 else "")
            + (f" --tp {t.tensor_parallel}" if t.tensor_parallel > 1 else "")
            + (" --async-tp" if t.async_tensor_parallel else "")
            + (" --loss-parallel" if t.loss_parallel else "")
            + (f" --cp {t.context_parallel}" if t.context_parallel > 1 else "")
            + (f" --pp {t.pipeline_parallel} --pp-schedule {t.pipeline_schedule}" if t.pipeline_parallel > 1 else "")
            + (" --activation-offload" if t.activation_offload else "")
            + (f" --compile {t.compile}" if t.compile != "none" else "")
            + (f" --float8 {t.float8}" if t.float8 != "none" else "")
            + finetuning_flags(request.finetuning)
            + (f" --stack {request.stack}" if request.stack != "fsdp2" else "")
            + (f" --routing-skew {shlex.quote(request.routing_skew.source or request.routing_skew.label())}"
               if not request.routing_skew.balanced else "")
            + (f" --token-budget {t.micro_batch_size * request.seq_len} --doc-lengths "
               f"{shlex.quote(request.packing.lengths.source)}" if request.packing is not None else ""))


def compile_section(winner: Step, steps: list[Step], *, tolerance: float) -> dict[str, Any]:
    """torch.compile and float8 in best.json: the winner's compile mode, and the fastest fitting
    configuration of each (compile, float8) combination evaluated within the global batch's
    tolerance side by side: eager, compiled, float8 recipes eager and compiled (each figure with its
    source: compiled and float8 throughput on GPUs are estimates, docs/COMPILE.md).
    `eager_vs_compiled` keeps the high-precision pair (as before float8 existed)."""
    def fastest(compile_mode: str, float8: str) -> dict[str, Any] | None:
        fitting = [s for s in eligible(steps, tolerance) if s.train.compile == compile_mode
                   and s.train.float8 == float8 and s.stage != "confirm"]
        if not fitting:
            return None
        best = max(fitting, key=lambda s: s.result.throughput or 0.0)
        tps = best.result.tokens_per_sec
        bases = [(best.result.extras.get(key) or {}).get("basis") for key in ("compile_speedup", "float8")]
        return dict(step=best.step, configuration=best.train.label(), tokens_per_sec=best.result.throughput,
                    throughput_source=tps.source if tps else None, peak_memory_bytes=best.result.peak_bytes,
                    memory_source=best.result.peak_memory.source if best.result.peak_memory else None,
                    speedup_basis="; ".join(b for b in bases if b) or None)

    eager, compiled = fastest("none", "none"), fastest("blocks", "none")
    section: dict[str, Any] = {"mode": winner.train.compile,
                               "backend": knobs.COMPILE_BACKEND if winner.train.compile != "none" else None}
    if compiled is not None or eager is not None:
        section["eager_vs_compiled"] = {"eager": eager, "compiled": compiled}
        if eager and compiled and eager["tokens_per_sec"] and compiled["tokens_per_sec"]:
            section["eager_vs_compiled"]["compiled_over_eager"] = compiled["tokens_per_sec"] / eager["tokens_per_sec"]
    rows = []
    for compile_mode in knobs.COMPILE_MODES:
        for float8 in knobs.FLOAT8_RECIPES:
            row = fastest(compile_mode, float8)
            if row is not None:
                if eager and eager["tokens_per_sec"] and row["tokens_per_sec"]:
                    row["over_eager"] = row["tokens_per_sec"] / eager["tokens_per_sec"]
                rows.append(dict(compile=compile_mode, float8=float8, **row))
    if len(rows) > 1:
        section["side_by_side"] = rows
    if winner.train.compile != "none":
        # What compiling costs once per launch, before tokens/s is steady: measured by a real trial's
        # first step; the simulator does not estimate it (docs/COMPILE.md, compile time).
        section["compile_time"] = winner.result.extras.get("compile_s") or dict(
            value=None, source="not estimated",
            basis="the simulator traces no compile time; a real trial measures it (its first step less a "
                  "timed one): 32-42 s for two tiny models' blocks with inductor's CPU backend, 2 gloo ranks")
    return section


def float8_section(winner: Step) -> dict[str, Any]:
    """float8 training in best.json: the winner's recipe (its knob), whether FSDP2 all-gathers the
    converted weights in float8, and what converts them."""
    recipe = winner.train.float8
    return {"recipe": recipe, "fsdp_float8_all_gather": recipe == "tensorwise",
            "implementation": None if recipe == "none" else
            "torchao convert_to_float8_training on the decoder blocks' linears (lm_head and dimensions not "
            "divisible by 16 stay high precision)"}


def finetuning_flags(finetuning) -> str:
    """The command-line flags that ask for `finetuning` (empty for a full fine-tune)."""
    if not finetuning.lora:
        return ""
    return (f" --peft {finetuning.peft} --lora-rank {finetuning.rank} --lora-alpha {finetuning.alpha:g} "
            f"--lora-dropout {finetuning.dropout:g} --lora-targets {finetuning.targets}")


def offload_host_time(result, train) -> dict | None:
    """CPU offload's host work in the winner's estimated step: FSDP2's blocking gradient copies and
    host adds in every micro-batch after the first, and the host AdamW step (costmodel,
    "CPU offload while gradients accumulate"). None without offload or without an estimated step."""
    from autotune.estimate import costmodel

    step = result.extras.get("step_time") or {}
    if not train.cpu_offload or not step.get("seconds"):
        return None
    return dict(accumulate_s=float(step.get("offload_accumulate_s", 0.0)),
                host_s=costmodel.host_offload_seconds(step), eager_step_s=float(step["seconds"]),
                source="estimated", basis=f"{costmodel.OFFLOAD_ACCUMULATE_BASIS}; and the host AdamW step "
                "(the hardware profile's cpu_adam_params_per_s: by default the median of the same trials')")


def build_result(request: TuneRequest, winner: Step, steps: list[Step], *, backend: str, wrap: str,
                 run_id: str, study: str, notes: list[str], sampling: dict | None = None) -> dict[str, Any]:
    train, result, batch = winner.train, winner.result, winner.batch
    peak, tps = result.peak_memory, result.tokens_per_sec
    host = result.host_memory_per_node
    document: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "study": study,
        "model": model_section(request),
        "gpus": request.cluster.num_gpus,
        "nodes": request.cluster.num_nodes,
        "gpu": {"type": request.cluster.gpu.name, "memory_bytes": request.cluster.capacity_bytes,
                "supports_bf16": request.cluster.gpu.supports_bf16,
                "peak_tflops": request.cluster.gpu.peak_tflops},
        "host_memory_bytes": request.cluster.host_memory_bytes,
        "seq_len": request.seq_len,
        "micro_batch_size": train.micro_batch_size,
        "grad_accum_steps": batch.grad_accum_steps,
        "global_tokens": batch.global_tokens,
        "global_tokens_target": batch.target_tokens,
        "global_tokens_deviation": batch.deviation,
        "precision": train.precision,
        "workload": workload_section(request, winner),
        "finetuning": finetuning_section(request),
        "stack": stack_section(request.stack, train.precision, request.model.model_type),
        # A MoE model's routing assumption, named, and the expert-parallel rank that binds under it.
        **({"routing_skew": routing_section(request.routing_skew, request.model, train.expert_parallel)}
           if not request.routing_skew.balanced or train.expert_parallel > 1 else {}),
        # Packed token-budget batches: the budget, the length assumption, the expected fill and spread.
        **({"packing": dict(packing_section(request.spec(train)),
                            global_tokens_spread=round(batch.spread_tokens))} if request.packing is not None else {}),
        "fsdp": {
            "param_dtype": PARAM_DTYPE_NAMES[train.precision],
            "reduce_dtype": reduce_dtype_name(train.precision, stack_step(request.stack, train.precision,
                                                                                 request.model.model_type)),
            **knobs.fsdp_section(train.knob_values()),
            "wrap": wrap,
            "sharded_grad_scaler": train.precision == "fp16",
        },
        "parallelism": {
            "tensor_parallel": train.tensor_parallel,
            "context_parallel": train.context_parallel,
            "pipeline_parallel": train.pipeline_parallel,
            "pipeline_schedule": train.pipeline_schedule,
            "async_tensor_parallel": train.async_tensor_parallel,
            "loss_parallel": train.loss_parallel,
            "data_parallel_ranks": request.cluster.num_gpus // train.ranks_per_batch,
            "note": "each tensor- or context-parallel group of GPUs, and each pipeline of stages, takes one batch; FSDP "
                    "shards over the data-parallel ranks (with context parallelism, over every GPU; with pipeline "
                    "parallelism, each stage's blocks over the ranks holding that stage)",
        },
        "optimizer": {
            "name": "AdamW",
            "impl": train.optimizer_impl,
            "note": "the implementation traced and run; exports pin it (foreach allocates temporaries "
                    "for a whole parameter group, see docs/SIMULATOR.md)",
        },
        "loss": loss_section(request, winner),
        "compile": compile_section(winner, steps, tolerance=request.tolerance),
        "float8": float8_section(winner),
        "peak_memory_bytes": result.peak_bytes,
        "memory_source": peak.source if peak else "estimated",
        "memory_basis": peak.basis if peak else "",
        "memory_breakdown": {k: int(v) for k, v in result.memory_breakdown.items()},
        "memory": memory_parts(winner),
        "environment": {ALLOC_CONF_ENV: alloc_conf()},
        "memory_limit_bytes": request.memory_limit_bytes,
        "headroom": request.headroom,
        "host_memory_per_node_bytes": int(host.value) if host and host.value is not None else None,
        "offload_host_time": offload_host_time(result, train),
        "tokens_per_sec": result.throughput,
        "throughput_source": tps.source if tps else "estimated",
        "throughput_basis": tps.basis if tps else "no throughput figure from this backend",
        # An estimate's range from held-out errors (autotune.estimate.heldout); a measurement has none.
        "tokens_per_sec_range": _range(result.extras.get("tokens_per_sec_range")),
        # The held-out rows the range comes from (count, publishers), or "not validated on <gpu>" (autotune.estimate.heldout).
        "tokens_per_sec_range_from": result.extras.get("tokens_per_sec_range_from") if tps and tps.source == "estimated"
        else None,
        # Measured by real trials, estimated by the simulator and the closed form (throughput_source says which).
        "mfu": result.extras.get("mfu", result.extras.get("mfu_estimated")),
        "predicted": winner.predicted.to_dict() if winner.predicted else None,
        "prediction_error": prediction_summary(steps),
        "decision_path": decision_path(steps, winner, request),
        # Which part of the search found the winner: the graph's stages, or `sample` beyond it.
        "found_by": found_by(winner, steps),
        "sampling": sampling,
        "why_winner": why_winner(winner, steps, request),
        "notes": notes,
        "text_only": text_only_section(request.model, num_gpus=request.cluster.num_gpus, precision=train.precision),
        "backend": backend,
        "provenance": provenance(),
    }
    try:
        from autotune.estimate.checkpoint_plan import plan_checkpoint
    except ImportError:  # the checkpoint advisor is optional in trimmed installs
        plan_checkpoint = None
    if plan_checkpoint is not None:
        document["checkpoint"] = plan_checkpoint(document)
    return document


def found_by(winner: Step, steps: list[Step]) -> dict[str, Any]:
    """The step (and stage) that found the winner: a confirmation names the step it re-ran."""
    origin = winner
    if winner.stage == "confirm":
        origin = next((s for s in steps if s.train == winner.train and s.stage != "confirm"), winner)
    return {"step": origin.step, "stage": origin.stage, "beyond_the_graph": origin.stage == "sample"}


def memory_parts(winner) -> dict[str, Any]:
    """The peak's parts with their own sources: the tensor peak, the runtime terms (the
    simulator's, or the prediction's for a measured winner) and, for real cuda trials, the
    measured allocated, reserved and device-level peaks."""
    result, extras = winner.result, winner.result.extras
    predicted = winner.predicted.extras if winner.predicted else {}
    measured = result.peak_memory is not None and result.peak_memory.source == "measured"
    runtime = extras.get("runtime_memory") or predicted.get("runtime_memory")
    parts: dict[str, Any] = {
        "tensor_peak": {"bytes": extras.get("tensor_peak_bytes"),
                        "source": "measured" if measured else "predicted"},
        "runtime": runtime,
        "measured": None,
    }
    if "device_peak_bytes" in extras:
        parts["measured"] = {key: extras.get(key) for key in (
            "allocated_peak_bytes", "reserved_peak_bytes", "outside_allocator_bytes", "device_peak_bytes",
            "allocator_persistent_bytes", "alloc_conf")}
    return parts


def dumps(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=False) + "\n"


def load_result(path: str | Path) -> dict[str, Any]:
    """Read a best.json; a bad file is the user's to fix."""
    from autotune.util.errors import UsageError

    path = Path(path)
    if path.is_dir():
        path = path / "best.json"
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"result {str(path)!r} not found: pass runs/<run-id>/best.json or its folder") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read result {str(path)!r}: {exc}") from None
    if not isinstance(document, dict) or document.get("schema_version") != SCHEMA_VERSION:
        raise UsageError(f"{str(path)!r} is not an autotune result (schema_version {SCHEMA_VERSION})")
    return document
