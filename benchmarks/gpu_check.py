"""The GPU memory check: real cuda trials against the simulator's predictions, in one table.

    python benchmarks/gpu_check.py                  # on every GPU here, in under 5 minutes
    python benchmarks/gpu_check.py --device cpu     # the same plumbing on 2 gloo ranks, no GPU
    python benchmarks/gpu_check.py --json out.json  # also write every figure as JSON
    python benchmarks/gpu_check.py --cases speed    # eager, compiled and float8 columns (torchao)

For a 0.5B model (qwen2.5-0.5b) at world size 1 and at every GPU present, a few configurations
(precision, checkpointing, resharding, offload, micro-batch) run as real FSDP2 trials through the
cuda backend and are predicted by the simulator. Each measured peak is compared with its
predicted counterpart:

    allocated  torch.cuda.max_memory_allocated   vs  the traced tensor peak (+ cuBLAS workspaces)
    reserved   torch.cuda.max_memory_reserved    vs  tensor peak + in-allocator runtime terms
    device     reserved + outside the allocator  vs  the predicted total (what prunes trials)

Then OOM agreement: under a per-process memory cap set between two configurations' predicted
totals, the one predicted to fit must run and the one predicted not to fit must run out of
memory for real. The runtime terms (context, cuBLAS, NCCL) are measured in a fresh process.
Exit status 0 when every target holds: device total within 5% of the prediction, no
configuration predicted to fit runs out of memory, OOM agreement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataclasses import replace  # noqa: E402

from autotune.backends.base import TrialResult  # noqa: E402
from autotune.backends.real import RealBackend  # noqa: E402
from autotune.backends.sim import SimBackend  # noqa: E402
from autotune.problem.catalog.gpus import GPUS, detect_gpu  # noqa: E402
from autotune.problem.catalog.models import resolve_model  # noqa: E402
from autotune.problem.config import Cluster, TrainConfig, TrialSpec  # noqa: E402
from autotune.estimate.runtime_memory import alloc_conf  # noqa: E402
from autotune.util.units import format_bytes  # noqa: E402

TOTAL_TOLERANCE = 0.05

# (label, knobs): the configurations every world size runs.
CASES = [
    ("bf16 mb2", dict(micro_batch_size=2)),
    ("bf16 mb4 ac:full", dict(micro_batch_size=4, activation_checkpointing="full")),
    ("bf16 mb2 no-reshard", dict(micro_batch_size=2, reshard_after_forward=False)),
    ("fp16 mb2", dict(micro_batch_size=2, precision="fp16")),
    ("bf16 mb2 ac:full offload", dict(micro_batch_size=2, cpu_offload=True, activation_checkpointing="full")),
    ("bf16 mb4 ac:op", dict(micro_batch_size=4, activation_checkpointing="op")),
    ("bf16 mb4 ac:every:2", dict(micro_batch_size=4, activation_checkpointing="every:2")),
    ("bf16 mb8", dict(micro_batch_size=8)),
]
CASES.insert(1, ("bf16 mb4", dict(micro_batch_size=4)))
# (label, knobs): eager against compiled blocks and float8 linears at one micro-batch, so the speed
# table (--cases speed or all) reads each knob's measured and estimated effect on tokens/s, and the
# memory table checks the simulator's compiled and float8 traces on a GPU. float8 needs torchao
# and a GPU with float8 tensor cores (H100, H200, Ada).
SPEED_CASES = [
    ("bf16 mb4", dict(micro_batch_size=4)),
    ("bf16 mb4 compile", dict(micro_batch_size=4, compile="blocks")),
    ("bf16 mb4 float8:tensorwise", dict(micro_batch_size=4, float8="tensorwise")),
    ("bf16 mb4 compile float8:tensorwise", dict(micro_batch_size=4, compile="blocks", float8="tensorwise")),
    ("bf16 mb4 compile float8:rowwise", dict(micro_batch_size=4, compile="blocks", float8="rowwise")),
    ("bf16 mb8 ac:full compile", dict(micro_batch_size=8, activation_checkpointing="full", compile="blocks")),
]
# The same columns for a model that fills a GPU (a 7B on one H200): micro-batch 2, every block checkpointed.
LARGE_CASES = [
    ("bf16 mb2 ac:full", dict(micro_batch_size=2, activation_checkpointing="full")),
    ("bf16 mb2 ac:full compile", dict(micro_batch_size=2, activation_checkpointing="full", compile="blocks")),
    ("bf16 mb2 ac:full compile float8:tensorwise", dict(micro_batch_size=2, activation_checkpointing="full",
                                                       compile="blocks", float8="tensorwise")),
    ("bf16 mb2 ac:full compile float8:rowwise", dict(micro_batch_size=2, activation_checkpointing="full",
                                                    compile="blocks", float8="rowwise")),
]
CASE_SETS = {"memory": CASES, "speed": SPEED_CASES, "large": LARGE_CASES,
             "all": CASES + [case for case in SPEED_CASES if case not in CASES]}
TIMING_SETS = ("speed", "large")
"""Sets that time tokens/s: no OOM caps (those are the memory set's), more timed steps by default."""
EAGER_BASELINES = (SPEED_CASES[0][0], LARGE_CASES[0][0])
"""The eager bf16 case each set's speed-ups are read against."""
CPU_CASES = [("bf16 mb2", dict(micro_batch_size=2)), ("bf16 mb4 ac:full", dict(micro_batch_size=4, activation_checkpointing="full")),
             ("bf16 mb8", dict(micro_batch_size=8))]


def spec_for(model, *, world: int, gpu, seq_len: int, limit: int | None = None, **knobs) -> TrialSpec:
    return TrialSpec(model=model, cluster=Cluster(num_gpus=world, gpu=gpu), seq_len=seq_len,
                     train=TrainConfig(**knobs), grad_accum_steps=2, memory_limit_bytes=limit)


def error(predicted, measured) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def compare(label: str, spec: TrialSpec, predicted, measured) -> dict:
    p, m = predicted.extras, measured.extras
    row = dict(label=label, world=spec.cluster.num_gpus, limit_bytes=spec.memory_limit_bytes,
               predicted_status=predicted.status, measured_status=measured.status, message=measured.message[:300],
               # max_memory_allocated includes cuBLAS workspaces, which no traced op makes.
               predicted_tensor=p.get("predicted_allocated_bytes", p.get("tensor_peak_bytes")),
               measured_allocated=m.get("tensor_peak_bytes"),
               predicted_reserved=p.get("predicted_reserved_bytes"), measured_reserved=m.get("reserved_peak_bytes"),
               predicted_total=predicted.peak_memory.value if predicted.peak_memory else None,
               predicted_message=predicted.message[:300],
               measured_device=m.get("device_peak_bytes"), outside_allocator=m.get("outside_allocator_bytes"),
               allocator_persistent=m.get("allocator_persistent_bytes"),
               estimated_tokens_per_sec=predicted.tokens_per_sec.value if predicted.tokens_per_sec else None,
               measured_tokens_per_sec=measured.tokens_per_sec.value if measured.tokens_per_sec else None,
               estimated_range=p.get("tokens_per_sec_range"), step_times_s=m.get("step_times_s"),
               compile_s=(m.get("compile_s") or {}).get("value"), compiled_graphs=m.get("compiled_graphs"),
               float8_linears=m.get("float8_linears"), mfu=m.get("mfu"),
               optimizer_step_s=m.get("optimizer_step_s"), runtime_terms=p.get("runtime_memory"))
    row["tensor_error"] = error(row["predicted_tensor"], row["measured_allocated"])
    row["reserved_error"] = error(row["predicted_reserved"], row["measured_reserved"])
    row["total_error"] = error(row["predicted_total"], row["measured_device"])
    return row


def probe_runtime_terms() -> dict:
    """The context, cuBLAS and NCCL terms, measured in a fresh process."""
    code = "import json; from autotune.estimate.runtime_memory import measure_runtime_terms; print(json.dumps(measure_runtime_terms()))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    if done.returncode:
        return dict(error=done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def predict(device: str, model_name: str, seq_len: int, worlds: list[int], *, gpu, cases: str,
            hardware=None) -> dict[str, dict]:
    """The simulator's result for every trial the check runs, by key (world, label, limit).
    Traces do not depend on the machine: they can be made on another one with `--predict-only`
    (for a GPU machine whose torch is older than the simulator supports) and passed in with
    `--predictions`."""
    model = resolve_model(model_name)
    sim = SimBackend(device_kind=device, hardware=hardware)
    predictions: dict[str, dict] = {}
    for world in worlds:
        for label, spec in planned_trials(model, device=device, seq_len=seq_len, world=world, gpu=gpu, cases=cases,
                                          sim=sim):
            predictions[key(world, label)] = sim.evaluate(spec).to_dict()
    return predictions


def key(world: int, label: str) -> str:
    return f"{world}:{label}"


def planned_trials(model, *, device: str, seq_len: int, world: int, gpu, cases: str, sim=None, predictions=None):
    """(label, spec) of every trial: the cases, then the OOM-agreement trials under caps set from
    the predicted totals: the smallest case under 1.10x its total (must fit), the largest under
    the same cap (must not), and a middle case under 1.02x (must fit) and 0.90x (must not) of
    its own total, the sharpest test that nothing predicted to fit runs out of memory."""
    chosen = CASE_SETS[cases] if device == "cuda" else CPU_CASES
    trials = [(label, spec_for(model, world=world, gpu=gpu, seq_len=seq_len, **knobs)) for label, knobs in chosen]

    def total(label: str, spec: TrialSpec) -> int | None:
        if predictions is not None:
            peak = predictions.get(key(world, label), {}).get("peak_memory")
            return peak["value"] if peak else None
        result = sim.evaluate(spec)
        return result.peak_memory.value if result.peak_memory else None

    if cases in TIMING_SETS:
        return trials
    plain = [t for t in trials if "compile" not in t[0] and "float8" not in t[0]]
    (small_label, small), (large_label, large) = plain[0], plain[-1]
    middle_label, middle = plain[1] if device == "cpu" else next(t for t in plain if t[0] == "bf16 mb4")
    small_total, middle_total = total(small_label, small), total(middle_label, middle)
    if small_total is not None:
        limit = int(small_total * 1.10)
        for label, spec in ((small_label, small), (large_label, large)):
            trials.append((f"{label} under {format_bytes(limit)}", replace(spec, memory_limit_bytes=limit)))
    if middle_total is not None:
        for factor in (1.02, 0.90):
            limit = int(middle_total * factor)
            trials.append((f"{middle_label} under {factor:.2f}x", replace(middle, memory_limit_bytes=limit)))
    return trials


def run(device: str, model_name: str, seq_len: int, worlds: list[int], predictions: dict[str, dict], *, gpu,
        cases: str, warmup_steps: int = 1, timed_steps: int = 2) -> dict:
    model = resolve_model(model_name)
    rows, agreement = [], []
    started = time.monotonic()
    for world in worlds:
        trials = planned_trials(model, device=device, seq_len=seq_len, world=world, gpu=gpu, cases=cases,
                                predictions=predictions)
        with RealBackend(device=device, timed_steps=timed_steps, warmup_steps=warmup_steps, timeout_s=300) as real:
            measured = real.evaluate_many([spec for _, spec in trials])
        for (label, spec), result in zip(trials, measured):
            predicted = predictions.get(key(world, label))
            if predicted is None:
                print(f"no prediction for {label} at world size {world}: skipped", file=sys.stderr)
                continue
            row = compare(label, spec, TrialResult.from_dict(predicted), result)
            (agreement if spec.memory_limit_bytes is not None else rows).append(row)
    return dict(device=device, gpu=gpu.name, model=model_name, seq_len=seq_len, worlds=worlds,
                alloc_conf=alloc_conf(), cases=cases, warmup_steps=warmup_steps, timed_steps=timed_steps,
                rows=rows, oom_agreement=agreement, seconds=time.monotonic() - started)


def rescore(report: dict, predictions: dict[str, dict], predicted_on: str) -> dict:
    """A measured report's rows against other predictions (the simulator changed since, say):
    the measurements are kept, the predicted figures and errors recomputed."""
    for row in report["rows"] + report["oom_agreement"]:
        predicted = predictions.get(key(row["world"], row["label"]))
        if predicted is None and row.get("limit_bytes"):
            # A capped trial whose cap was set from older predictions: the uncapped case's new
            # prediction, judged against the cap the trial ran under.
            predicted = dict(predictions[key(row["world"], row["label"].split(" under ")[0])])
            total = (predicted.get("peak_memory") or {}).get("value")
            predicted["status"] = "ok" if total is not None and total <= row["limit_bytes"] else "oom"
        predicted = TrialResult.from_dict(predicted)
        extras = predicted.extras
        row.update(predicted_status=predicted.status,
                   predicted_tensor=extras.get("predicted_allocated_bytes", extras.get("tensor_peak_bytes")),
                   predicted_reserved=extras.get("predicted_reserved_bytes"),
                   predicted_total=predicted.peak_memory.value if predicted.peak_memory else None,
                   estimated_tokens_per_sec=predicted.tokens_per_sec.value if predicted.tokens_per_sec else None,
                   estimated_range=extras.get("tokens_per_sec_range"))
        row["tensor_error"] = error(row["predicted_tensor"], row["measured_allocated"])
        row["reserved_error"] = error(row["predicted_reserved"], row["measured_reserved"])
        row["total_error"] = error(row["predicted_total"], row["measured_device"])
    report["predicted_on"] = predicted_on
    return report


def percent(value) -> str:
    return "-" if value is None else f"{value:+.1%}"


def size(value) -> str:
    return "-" if value is None else format_bytes(value)


def print_table(report: dict) -> None:
    print(f"GPU check on {report['device']}: {report['model']}, seq {report['seq_len']}, "
          f"PYTORCH_CUDA_ALLOC_CONF={report['alloc_conf']}, {report['predicted_on']}; "
          "errors are (predicted - measured) / measured")
    header = (f"{'ws':>2} {'configuration':<42} {'status p/m':<11} {'allocated':>10} {'err':>7} "
              f"{'reserved':>10} {'err':>7} {'device':>10} {'err':>7} {'tok/s meas':>11} {'tok/s est':>11}")
    print(header)
    for row in report["rows"] + report["oom_agreement"]:
        print(f"{row['world']:>2} {row['label']:<42} {row['predicted_status'] + '/' + row['measured_status']:<11} "
              f"{size(row['measured_allocated']):>10} {percent(row['tensor_error']):>7} "
              f"{size(row['measured_reserved']):>10} {percent(row['reserved_error']):>7} "
              f"{size(row['measured_device']):>10} {percent(row['total_error']):>7} "
              f"{row['measured_tokens_per_sec'] or 0:>11,.0f} {row['estimated_tokens_per_sec'] or 0:>11,.0f}")
    print_speed_table(report)
    if report.get("runtime_terms"):
        print("runtime terms measured in a fresh process:", json.dumps(report["runtime_terms"]))


def print_speed_table(report: dict) -> None:
    """Tokens/s of each uncapped trial, measured against the simulator's estimate, and each
    configuration's speed-up over its set's eager case (EAGER_BASELINES) at the same world size, both
    ways: what the compile and float8 knobs are worth here, and whether the estimate ranks them as
    measured."""
    rows = [r for r in report["rows"] if r["measured_tokens_per_sec"]]
    if not rows:
        return
    print(f"\ntokens/s on {report.get('gpu', report['device'])} (measured: the slowest rank's timed steps; "
          f"estimated: the simulator's cost model on {report.get('hardware') or 'the shipped profile'})")
    print(f"{'ws':>2} {'configuration':<42} {'measured':>10} {'estimated':>10} {'err':>7} {'in range':>8} "
          f"{'x eager m':>9} {'x eager e':>9} {'compile s':>9} {'MFU':>6}")
    eager = {r["world"]: r for r in rows if r["label"] in EAGER_BASELINES}
    for row in rows:
        base = eager.get(row["world"])
        estimated, measured = row["estimated_tokens_per_sec"], row["measured_tokens_per_sec"]
        low_high = row.get("estimated_range")
        inside = "-" if not low_high else ("yes" if low_high[0] <= measured <= low_high[1] else "no")
        ratio_m = f"{measured / base['measured_tokens_per_sec']:.2f}" if base else "-"
        ratio_e = (f"{estimated / base['estimated_tokens_per_sec']:.2f}"
                   if base and estimated and base["estimated_tokens_per_sec"] else "-")
        compile_s = f"{row['compile_s']:.0f}" if row.get("compile_s") is not None else "-"
        mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else "-"
        print(f"{row['world']:>2} {row['label']:<42} {measured:>10,.0f} {estimated or 0:>10,.0f} "
              f"{percent(error(estimated, measured)):>7} {inside:>8} {ratio_m:>9} {ratio_e:>9} {compile_s:>9} {mfu:>6}")


def verdict(report: dict) -> list[str]:
    """The targets that failed (empty: all hold)."""
    failed = []
    ok = [r for r in report["rows"] if r["measured_status"] == "ok"]
    totals = [abs(r["total_error"]) for r in ok if r["total_error"] is not None]
    if report["device"] == "cuda" and totals and max(totals) > TOTAL_TOLERANCE:
        failed.append(f"predicted total off the device-level peak by up to {max(totals):.1%} (target {TOTAL_TOLERANCE:.0%})")
    for row in report["rows"] + report["oom_agreement"]:
        if row["predicted_status"] == "ok" and row["measured_status"] == "oom":
            failed.append(f"{row['label']} (ws {row['world']}) was predicted to fit and ran out of memory")
        if row["measured_status"] not in ("ok", "oom"):
            failed.append(f"{row['label']} (ws {row['world']}) ended {row['measured_status']}: {row['message'][:200]}")
    for row in report["rows"]:
        if row["measured_status"] == "ok" and "compile" in row["label"] and not row.get("compiled_graphs"):
            failed.append(f"{row['label']} (ws {row['world']}) compiled no graph: its blocks ran eager")
        if row["measured_status"] == "ok" and "float8" in row["label"] and not row.get("float8_linears"):
            failed.append(f"{row['label']} (ws {row['world']}) converted no linear to float8")
    for row in report["oom_agreement"]:
        if row["predicted_status"] != row["measured_status"]:
            failed.append(f"OOM disagreement: {row['label']} predicted {row['predicted_status']}, "
                          f"measured {row['measured_status']}")
    if report["device"] == "cuda" and not report["oom_agreement"] and report.get("cases") not in TIMING_SETS:
        failed.append("no OOM-agreement pair could be set up")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--model", default=None, help="default: qwen2.5-0.5b on cuda, micro-llama on cpu")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--predict-only", type=Path, default=None, metavar="FILE",
                        help="only write the simulator's predictions for the check's trials to FILE")
    parser.add_argument("--predictions", type=Path, default=None, metavar="FILE",
                        help="use predictions written by --predict-only instead of tracing here")
    parser.add_argument("--gpus", type=int, default=None, help="with --predict-only: the GPUs of the machine to check")
    parser.add_argument("--gpu-type", choices=sorted(GPUS), default=None,
                        help="with --predict-only: the GPU type of the machine to check (default: this machine's, "
                             "else h100-80gb)")
    parser.add_argument("--cases", choices=sorted(CASE_SETS), default="memory",
                        help="memory: precision, checkpointing, resharding, offload, micro-batch and the OOM caps "
                             "(the default); speed: eager, compiled and float8 at one micro-batch; large: the same "
                             "at micro-batch 2 with full checkpointing (a model that fills the GPU); all: memory "
                             "and speed")
    parser.add_argument("--warmup-steps", type=int, default=None, help="untimed steps per trial (compiled: the first "
                        "compiles); default 1, 2 where the cases time tokens/s (speed, large, all)")
    parser.add_argument("--timed-steps", type=int, default=None, help="timed steps per trial; default 2, 5 where the "
                        "cases time tokens/s (two timed steps of one H200 trial differed by 14%%)")
    parser.add_argument("--hardware", default=None, metavar="PROFILE",
                        help="with --predict-only: estimate tokens/s on this hardware profile (autotune calibrate's "
                             "JSON) instead of the GPU's shipped one")
    parser.add_argument("--rescore", type=Path, default=None, metavar="REPORT",
                        help="print a measured report (--json) against --predictions, measuring nothing")
    args = parser.parse_args(argv)
    timing = args.cases in TIMING_SETS or args.cases == "all"  # more steps, the first compiled one untimed
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (2 if timing else 1)
    args.timed_steps = args.timed_steps if args.timed_steps is not None else (5 if timing else 2)
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.predict_only and args.device == "auto":
        device = "cuda"
    if device == "cuda":
        count = args.gpus or torch.cuda.device_count()
        worlds = [1] + ([count] if count > 1 else [])
        model, seq_len = args.model or "qwen2.5-0.5b", args.seq_len or 1024
    else:
        worlds, model, seq_len = [2], args.model or "micro-llama", args.seq_len or 64
    detected = detect_gpu() if device == "cuda" and not args.predict_only else None
    gpu = GPUS[args.gpu_type] if args.gpu_type else (detected or GPUS["h100-80gb"])
    if args.predict_only:
        from autotune.estimate.hardware import load_profile

        hardware = load_profile(args.hardware) if args.hardware else None
        args.predict_only.write_text(json.dumps(dict(
            torch=torch.__version__, gpu=gpu.name, cases=args.cases, hardware=hardware and hardware.name,
            predictions=predict(device, model, seq_len, worlds, gpu=gpu, cases=args.cases, hardware=hardware)),
            default=str))
        return 0
    if args.rescore:
        if not args.predictions:
            parser.error("--rescore needs --predictions")
        loaded = json.loads(args.predictions.read_text())
        report = rescore(json.loads(args.rescore.read_text()), loaded["predictions"],
                         f"rescored with predictions of torch {loaded['torch']}")
        report["hardware"] = loaded.get("hardware")
        return finish(report, args.json)
    if args.predictions:
        loaded = json.loads(args.predictions.read_text())
        predictions, predicted_on = loaded["predictions"], f"predicted with torch {loaded['torch']}"
        predicted_gpu = loaded.get("gpu", "h100-80gb")
        if device == "cuda" and predicted_gpu != gpu.name:
            print(f"error: {args.predictions} was predicted for {predicted_gpu}, this GPU is {gpu.name}: "
                  f"predict again with --gpu-type {gpu.name}", file=sys.stderr)
            return 2
    else:
        predictions = predict(device, model, seq_len, worlds, gpu=gpu, cases=args.cases)
        predicted_on = f"predicted here (torch {torch.__version__})"
    terms = probe_runtime_terms() if device == "cuda" else None
    report = run(device, model, seq_len, worlds, predictions, gpu=gpu, cases=args.cases,
                 warmup_steps=args.warmup_steps, timed_steps=args.timed_steps)
    report["predicted_on"] = predicted_on
    report["hardware"] = loaded.get("hardware") if args.predictions else None
    report["runtime_terms"] = terms
    return finish(report, args.json)


def finish(report: dict, json_path: Path | None) -> int:
    """Print the table and the verdict, write the JSON; the exit status says whether the targets hold."""
    report["failed"] = verdict(report)
    print_table(report)
    ok = [r for r in report["rows"] if r["total_error"] is not None and r["measured_status"] == "ok"]
    if ok:
        print(f"device-level total: median |error| {statistics.median(abs(r['total_error']) for r in ok):.1%}, "
              f"worst {max(abs(r['total_error']) for r in ok):.1%} over {len(ok)} trials")
    print("PASS" if not report["failed"] else "FAIL:\n  " + "\n  ".join(report["failed"]))
    if json_path:
        json_path.write_text(json.dumps(report, indent=1, default=str))
    return 0 if not report["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
