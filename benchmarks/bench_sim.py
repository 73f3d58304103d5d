"""Benchmark of the simulator: what a trace costs, how exact depth extrapolation is, and how
long the whole decision graph takes to plan on the sim backend.

    python benchmarks/bench_sim.py                 # everything (~6 min on 2 idle cores)
    python benchmarks/bench_sim.py trace-cost extrapolation accuracy graph
    python benchmarks/bench_sim.py extrapolation --quick   # llama-7b only

Figures are wall-clock seconds on this machine (say which when quoting them: the reference in
docs/BENCHMARKS.md is a shared 2-core CPU without a GPU); CPU seconds are printed beside
them because other processes on a shared machine inflate wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autotune.backends.sim import SimBackend, Tracer, fake_mesh
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec
from autotune.distributed.parallel import ParallelDims

GiB = 2**30

# (model, checkpointing, micro-batch): >= 16 blocks each; mb 4 is extrapolated in micro-batch too.
EXTRAPOLATION_CASES = [
    ("llama-7b", "none", 1), ("llama-7b", "full", 2), ("llama-7b", "every:2", 1), ("llama-7b", "none", 4),
    ("mistral-7b", "full", 1), ("mistral-7b", "every:2", 2),
    ("qwen2.5-7b", "none", 1), ("qwen2.5-7b", "every:2", 4),
]
# (model, GPUs, --global-tokens): 4M is not reachable in steps of 64 x 8192 tokens, 4Mi is.
GRAPHS = [("llama-7b", 8, "4M", []), ("llama3-70b", 64, "4Mi", ["--nodes", "8"])]


def _clock():
    return time.perf_counter(), time.process_time()


def _since(start) -> tuple[float, float]:
    wall, cpu = _clock()
    return wall - start[0], cpu - start[1]


def trace_cost(repeats: int) -> None:
    print("## trace cost: llama-7b shape, world size 8, seq 4096, micro-batch 1, no checkpointing")
    model = resolve_model("llama-7b")
    tracer = Tracer()
    mesh = fake_mesh(ParallelDims(dp_replicate=1, dp_shard=8))

    def trace(depth: int, mb: int = 1):
        return tracer.trace(model, depth=depth, mesh=mesh, world_size=8, seq_len=4096, grad_accum_steps=1,
                            train=TrainConfig(micro_batch_size=mb))

    start = _clock()
    trace(2)
    print(f"first trace in the process (imports, model code, caches): {_since(start)[0]:.1f} s wall")
    for depth in (2, 4):
        builds, steps = [], []
        for rep in range(repeats):
            tracer.clear()
            start = _clock()
            trace(depth)
            builds.append(_since(start))
            start = _clock()
            trace(depth, mb=2 + rep)  # the sharded, warmed-up model is reused across micro-batches
            steps.append(_since(start))
        print(f"{depth} blocks: build+shard+warm-up+trace median {statistics.median(w for w, _ in builds):.2f} s wall "
              f"({statistics.median(c for _, c in builds):.2f} s CPU); trace on a cached model "
              f"{statistics.median(w for w, _ in steps):.2f} s wall ({statistics.median(c for _, c in steps):.2f} s CPU)"
              f" [n={repeats}]")
    tracer.clear()
    start = _clock()
    full = trace(32)
    wall, cpu = _since(start)
    print(f"32 blocks (full depth): {wall:.1f} s wall ({cpu:.1f} s CPU), tensor peak {full.tensor_peak_bytes / GiB:.3f} GiB")


def extrapolation(quick: bool) -> None:
    print("## extrapolation: shallow traces vs a full-depth trace (world size 8, accumulation 16, "
          "tensor peak, steady state)")
    print("| model | layers | seq | ac | mb | traced blocks | full depth GiB | extrapolated GiB | error | "
          "bytes off | sim s (wall) | full s (wall) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    # Not screened: a case far over an H100's memory (llama-7b at mb 4) is still traced and compared.
    shallow = SimBackend(device_kind="cuda", screen=False)
    whole = SimBackend(device_kind="cuda", extrapolate=False, screen=False)
    errors = []
    for name, ac, mb in EXTRAPOLATION_CASES:
        if quick and name != "llama-7b":
            continue
        model = resolve_model(name)
        spec = TrialSpec(model=model, cluster=Cluster(num_gpus=8), seq_len=model.default_seq_len,
                         train=TrainConfig(activation_checkpointing=ac, micro_batch_size=mb), grad_accum_steps=16)
        start = _clock()
        predicted = shallow.evaluate(spec)
        sim_s = _since(start)[0]
        start = _clock()
        traced = whole.evaluate(spec)
        full_s = _since(start)[0]
        if predicted.status == "error" or traced.status == "error":
            print(f"| {name} | error: {predicted.message or traced.message} |")
            continue
        p, t = predicted.extras["tensor_peak_bytes"], traced.extras["tensor_peak_bytes"]
        error = (p - t) / t
        errors.append(abs(error))
        blocks = "/".join(map(str, predicted.extras["traced_layers"]))
        mbs = predicted.extras.get("traced_micro_batches", [mb])
        print(f"| {name} | {model.num_layers} | {spec.seq_len} | {ac} | {mb} | {blocks} (mb {'/'.join(map(str, mbs))}) "
              f"| {t / GiB:.3f} | {p / GiB:.3f} | {error:+.4%} | {p - t:+,} | {sim_s:.1f} | {full_s:.1f} |", flush=True)
    if errors:
        print(f"largest |error|: {max(errors):.4%} over {len(errors)} cases")


def accuracy() -> None:
    """The matrix of tests/test_sim_accuracy.py with both figures printed."""
    from autotune.backends.real import RealBackend

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.test_sim_accuracy import MATRIX, _spec

    print("## accuracy: simulator vs real gloo runs (cpu backend, world size 2, seq 256, 2 steps)")
    specs = [_spec(*row) for row in MATRIX]
    with RealBackend(device="cpu", warmup_steps=1, timed_steps=1) as real:
        measured = real.evaluate_many(specs)
    sim = SimBackend(device_kind="cpu")
    print("| model | ac | mb | reshard | measured B | predicted B | difference | traced blocks (micro-batches) |")
    print("|---|---|---|---|---|---|---|---|")
    for row, spec, result in zip(MATRIX, specs, measured):
        predicted = sim.evaluate(spec)
        real_peak, sim_peak = result.extras["tensor_peak_bytes"], predicted.extras["tensor_peak_bytes"]
        blocks = "/".join(map(str, predicted.extras["traced_layers"]))
        mbs = "/".join(map(str, predicted.extras.get("traced_micro_batches", [row[2]])))
        print(f"| {row[0]} | {row[1]} | {row[2]} | {'on' if row[3] else 'off'} | {real_peak:,} | {sim_peak:,} "
              f"| {sim_peak - real_peak:+,} B | {blocks} ({mbs}) |", flush=True)
    sim.close()


def _plan(name: str, gpus: int, tokens: str, cache_dir: str, extra: list[str]) -> tuple[float, dict, int, str]:
    """One `autotune tune` in a fresh process and runs folder: (wall s, best.json, configurations, status)."""
    trial_line = re.compile(r"^\s*\d+ +[a-z]+ +(bf16|fp16|fp32) ")
    with tempfile.TemporaryDirectory() as runs:
        command = [sys.executable, "-m", "autotune", "tune", "--model", name, "--gpus", str(gpus),
                   "--global-tokens", tokens, "--backend", "sim", "--runs-dir", runs, *extra]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True,
                              env={**os.environ, "NO_COLOR": "1", "AUTOTUNE_CACHE_DIR": cache_dir})
        wall = time.perf_counter() - start
        best = [json.loads(p.read_text()) for p in Path(runs).glob("*/best.json")]
    trials = sum(1 for line in done.stdout.splitlines() if trial_line.match(line))
    status = "ok" if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip()[-300:]}"
    return wall, (best[0] if best else {}), trials, status


_FULL_TRACE = """
from autotune.backends.sim import SimBackend
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec
model = resolve_model({name!r})
spec = TrialSpec(model=model, cluster=Cluster(num_gpus={gpus}), seq_len=model.default_seq_len, train=TrainConfig())
assert SimBackend(extrapolate=False, screen=False).evaluate(spec).extras["traced_layers"] == [model.num_layers]
"""


def full_trace(name: str, gpus: int) -> float:
    """Wall seconds of the naive alternative to planning: a fresh process that imports torch and
    transformers and traces the model once at full depth (bf16, micro-batch 1), nothing cached."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", _FULL_TRACE.format(name=name, gpus=gpus)], check=True,
                   env={**os.environ, "AUTOTUNE_CACHE": "off"})
    return time.perf_counter() - start


def graph(models: list[tuple[str, int, str, list[str]]], repeats: int) -> None:
    """Each plan twice per repeat in a fresh persistent cache: cold (nothing cached: every
    configuration traced) and repeated (a new runs folder, the cache warm). The first model's
    cold plans are compared with one full-depth trace of it in a fresh process (issue 15)."""
    print("## whole decision graph on the sim backend (autotune CLI in a fresh process)")
    for index, (name, gpus, tokens, extra) in enumerate(models):
        cold, warm = [], []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as cache_dir:
                wall, best, trials, status = _plan(name, gpus, tokens, cache_dir, extra)
                cold.append(wall)
                again, best_again, _, status_again = _plan(name, gpus, tokens, cache_dir, extra)
                warm.append(again)
            same = all(best.get(k) == best_again.get(k) for k in ("micro_batch_size", "fsdp", "peak_memory_bytes",
                                                                  "tokens_per_sec"))
            print(f"  {name} {gpus} GPUs: cold {wall:.2f} s ({trials} configurations, {status}), repeated "
                  f"{again:.2f} s ({status_again}); same winner and figures: {same}", flush=True)
        print(f"{name} on {gpus} GPUs {' '.join(extra)}, --global-tokens {tokens}: cold median "
              f"{statistics.median(cold):.2f} s, repeated median {statistics.median(warm):.2f} s "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
        if index == 0:
            whole = full_trace(name, gpus)
            print(f"one full-depth trace of {name} on {gpus} GPUs in a fresh process: {whole:.2f} s; cold plan "
                  f"median / full trace = {statistics.median(cold) / whole:.2f}x (load {os.getloadavg()[0]:.1f})",
                  flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers.models.llama.modeling_llama"], check=True)
    print(f"(starting Python and importing torch + transformers alone: {time.perf_counter() - start:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="*", default=["trace-cost", "extrapolation", "accuracy", "graph"],
                        choices=["trace-cost", "extrapolation", "accuracy", "graph"])
    parser.add_argument("--quick", action="store_true", help="llama-7b only in the extrapolation table")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"# bench_sim on {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    if "trace-cost" in args.sections:
        trace_cost(args.repeats)
    if "extrapolation" in args.sections:
        extrapolation(args.quick)
    if "accuracy" in args.sections:
        accuracy()
    if "graph" in args.sections:
        graph(GRAPHS, args.repeats)


if __name__ == "__main__":
    main()
