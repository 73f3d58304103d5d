"""torch.compile (`--compile blocks`) and float8 (`--float8`): the simulator's tensor peak against real
gloo trials, what compilation costs in time, and the float8 GPU estimate against published runs.

    python benchmarks/bench_compile.py            # the matrix below, 2 gloo ranks, seq 256
    python benchmarks/bench_compile.py --steps 6  # more steps: when tokens/s is steady
    python benchmarks/bench_compile.py --float8   # the float8 rows (FLOAT8_MATRIX), real and predicted
    python benchmarks/bench_compile.py --published  # llama3-8b on 8 H100s (sim, estimated) against the
                                                    # published float8 runs (costmodel.FLOAT8_PUBLISHED)
    python benchmarks/bench_compile.py --fit-rowwise  # costmodel.ROWWISE_GEMM_RATE from one published run,
                                                      # checked on another
    python benchmarks/bench_compile.py --launches   # the kernels a compiled block launches: the
                                                    # simulator's count against inductor's own code
    python benchmarks/bench_compile.py --pairs      # compile's estimated gain against every published
                                                    # compiled/eager pair, held out by publisher (~30 s)

Each row runs for real (the cpu backend: torchrun, gloo, inductor's CPU backend compiling each
block; persistent launch, no warm-up step, so the first step's time includes compilation) and is
predicted by the simulator for that CPU run (SimBackend(device_kind="cpu"): AOT autograd with
inductor's decompositions and min-cut partitioner on fake tensors). Prints one row per
configuration: measured and predicted tensor peaks (bytes), their difference, and every step's
time (measured, slowest rank). docs/COMPILE.md has the figures of the last run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from autotune.backends.real import RealBackend
from autotune.backends.sim import SimBackend
from autotune.problem.catalog.gpus import GPUS
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec

FLOAT8_SITE = Path(__file__).resolve().parent.parent / ".float8-site"

MATRIX = [  # (model, checkpointing, micro-batch, compile[, float8])
    ("tiny-llama", "none", 2, "none"),
    ("tiny-llama", "none", 2, "blocks"),
    ("tiny-llama", "full", 2, "none"),
    ("tiny-llama", "full", 2, "blocks"),
    ("tiny-qwen2", "none", 2, "none"),
    ("tiny-qwen2", "none", 2, "blocks"),
    ("tiny-qwen2", "full", 2, "none"),
    ("tiny-qwen2", "full", 2, "blocks"),
    ("tiny-llama", "op", 2, "none"),
    ("tiny-llama", "op", 2, "blocks"),
]
FLOAT8_MATRIX = [
    ("tiny-llama", "none", 2, "none", "tensorwise"),
    ("tiny-llama", "none", 2, "none", "rowwise"),
    ("tiny-llama", "full", 2, "none", "tensorwise"),
    ("tiny-llama", "none", 2, "blocks", "tensorwise"),
    ("tiny-llama", "none", 2, "blocks", "rowwise"),
]
PUBLISHED_ROWS = [  # llama3-8b, 8 H100s, seq 8192, op-level checkpointing: (micro-batch, compile, float8)
    (2, "blocks", "none"), (2, "blocks", "tensorwise"), (2, "none", "none"), (2, "none", "tensorwise"),
    (1, "blocks", "none"), (1, "blocks", "tensorwise"), (1, "blocks", "rowwise"), (1, "none", "rowwise"),
]


def spec(model: str, ac: str, mb: int, compile: str, float8: str = "none", *, seq_len: int = 256) -> TrialSpec:
    return TrialSpec(model=resolve_model(model), cluster=Cluster(num_gpus=2), seq_len=seq_len,
                     train=TrainConfig(activation_checkpointing=ac, micro_batch_size=mb, compile=compile,
                                       float8=float8))


def published() -> None:
    """The simulator's GPU estimates (the roofline, the published compile ratio, the float8 model) for the
    configurations of the published float8 runs, next to them: a validation, nothing fitted to it."""
    from autotune.estimate import costmodel

    started = time.perf_counter()
    print("| mb | compile | float8 | estimated tokens/s/GPU | float8 speed-up (estimated) | predicted+estimated GiB |")
    print("|---:|---|---|---:|---:|---:|")
    with SimBackend() as sim:
        for mb, compile, float8 in PUBLISHED_ROWS:
            result = sim.evaluate(TrialSpec(
                model=resolve_model("llama3-8b"), cluster=Cluster(num_gpus=8), seq_len=8192,
                train=TrainConfig(micro_batch_size=mb, activation_checkpointing="op", compile=compile, float8=float8)))
            speedup = (result.extras.get("float8") or {}).get("speedup")
            print(f"| {mb} | {compile} | {float8} | {result.throughput / 8:,.0f} | "
                  f"{f'{speedup:.3f}' if speedup else '-'} | {result.peak_bytes / 2**30:.2f} |", flush=True)
    print(f"\nsimulator {time.perf_counter() - started:.0f} s. Published (measured, compiled, tokens/s/GPU):")
    for label, gpus, bf16, float8 in costmodel.FLOAT8_PUBLISHED:
        print(f"  {label}, {gpus} GPUs: {bf16:,} -> {float8:,}, {float8 / bf16:.3f}")


ROWWISE_FITTED_TO = "torchao docs, rowwise"
ROWWISE_CHECKED_ON = "torchtitan commit 7a04053, rowwise"


def fit_rowwise() -> None:
    """costmodel.ROWWISE_GEMM_RATE: the rate at which the rowwise estimate of the configuration of torchao's
    published rowwise run (llama3-8b, 8 H100s, seq 8192, micro-batch 1, op-level checkpointing, compiled)
    gives its published ratio over compiled bf16; then that rate's ratio against torchtitan commit
    7a04053's rowwise run of the same configuration, which is not fitted to. One trace; the rate enters
    only the saved GEMM time (costmodel.float8_step_seconds), so other rates are computed from it."""
    from autotune.estimate import costmodel

    published = {label: float8 / bf16 for label, _, bf16, float8 in costmodel.FLOAT8_PUBLISHED}
    started = time.perf_counter()
    with SimBackend() as sim:
        result = sim.evaluate(TrialSpec(
            model=resolve_model("llama3-8b"), cluster=Cluster(num_gpus=8), seq_len=8192,
            train=TrainConfig(micro_batch_size=1, activation_checkpointing="op", compile="blocks", float8="rowwise")))
    float8, gpu = result.extras["float8"], GPUS["h100-80gb"]
    if result.extras["step_time"].get("host_bound"):
        raise SystemExit("the step is host-bound: the rate does not enter it")
    ratio, saved, casts = float8["speedup"], float8["saved_s"], float8["casts_s"]
    step = ratio * (saved - casts) / (ratio - 1)  # the compiled bf16 step: ratio = step / (step - saved + casts)
    slowdown = gpu.peak_tflops / gpu.float8_tflops
    gemm = saved / (1 - slowdown / costmodel.ROWWISE_GEMM_RATE)  # the converted GEMMs' bf16 time

    def rate_for(target: float) -> float:
        return slowdown / (1 - (casts + step * (1 - 1 / target)) / gemm)

    def ratio_at(rate: float) -> float:
        return step / (step - gemm * (1 - slowdown / rate) + casts)

    fitted = rate_for(published[ROWWISE_FITTED_TO])
    estimate = ratio_at(fitted)
    print(f"simulator {time.perf_counter() - started:.0f} s; estimated with ROWWISE_GEMM_RATE "
          f"{costmodel.ROWWISE_GEMM_RATE:g}: rowwise {ratio:.3f}x over compiled bf16, tensorwise's GEMM rate "
          f"{ratio_at(1.0):.3f}x")
    print(f"rate fitted to {ROWWISE_FITTED_TO} ({published[ROWWISE_FITTED_TO]:.3f}x, measured): {fitted:.3f}; "
          f"the estimate there {estimate:.3f}x")
    print(f"checked on {ROWWISE_CHECKED_ON} (the same configuration, not fitted to): published "
          f"{published[ROWWISE_CHECKED_ON]:.3f}x (measured), estimated {estimate:.3f}x "
          f"({estimate / published[ROWWISE_CHECKED_ON] - 1:+.1%})")


LAUNCH_MODELS = ("micro-llama", "tiny-llama", "tiny-qwen2")


def inductor_launches_per_block(model_name: str, *, micro_batch: int = 2, seq_len: int = 64) -> int:
    """The kernels inductor's generated code launches for one decoder block's forward and backward (CPU,
    bf16, no checkpointing): every block shares one compiled forward and one backward (the same code and
    shapes), so the launches of their wrappers' `call` are one block's. Counted in the code itself: each
    generated kernel (`cpp_fused_*`), extern kernel (`extern_kernels.*`) and fallback op (`torch.ops.*`)."""
    import re

    import torch
    from torch._inductor.utils import run_and_get_code

    from autotune.problem.catalog.blocks import find_decoder_blocks
    from autotune.distributed.parallel import apply_compile
    from autotune.distributed.training import build_model

    net = build_model(resolve_model(model_name), num_layers=2).to(torch.bfloat16)
    apply_compile(find_decoder_blocks(net), "blocks")
    ids = torch.randint(0, net.config.vocab_size, (micro_batch, seq_len))
    _, codes = run_and_get_code(lambda: net(input_ids=ids, labels=ids).loss.backward())
    calls = re.compile(r"^\s+(?:buf\w*\s*=\s*)?(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.[\w.]+)\(", re.M)
    return sum(len(calls.findall(code[code.index("def call("):])) for code in codes if "def call(" in code)


def launches() -> None:
    """The simulator's count of a compiled block's kernel launches (its host-time proxy: a matmul or an
    attention each, one fused kernel per run of memory-bound ops between them) against inductor's own
    generated code for the same block (CPU: Triton's GPU fusion differs in detail)."""
    print("| model | inductor's code (measured) | simulator (counted) | difference |")
    print("|---|---:|---:|---:|")
    with SimBackend(device_kind="cuda", extrapolate=False) as sim:
        for name in LAUNCH_MODELS:
            started = time.perf_counter()
            measured = inductor_launches_per_block(name)
            compiled = sim.evaluate(TrialSpec(model=resolve_model(name), cluster=Cluster(num_gpus=2), seq_len=64,
                                              train=TrainConfig(micro_batch_size=2, compile="blocks")))
            counted = compiled.extras["op_work"]["compiled_launches"] / resolve_model(name).num_layers
            print(f"| {name} | {measured} | {counted:g} | {counted / measured - 1:+.0%} |"
                  f" ({time.perf_counter() - started:.0f} s)", flush=True)


def pairs() -> dict:
    """torch.compile's estimated gain (costmodel.compiled_throughput: the eager step against the same step with
    the blocks' memory-bound ops fused) against every published compiled/eager pair (costmodel_fit.compile_pairs),
    the eager constants fitted without each pair's publisher; then the compiled rows' own tokens/s. Printed, with
    the summary issue 56 asks for (median |error| in points, share within 5 points, by publisher)."""
    import statistics

    from autotune.drivers import costmodel_fit

    estimates = costmodel_fit.compile_ratio_estimates()
    print("## Published compiled/eager pairs: estimated ratio (the eager constants fitted without the pair's publisher)")
    print("| publisher | source | model | GPUs | checkpointing (eager -> compiled) | published | estimated | error (points) |")
    print("|---|---|---|---|---|---:|---:|---:|")
    errors = []
    for pair, ratio in estimates:
        e, c = pair.eager, pair.compiled
        error = ratio - pair.published_ratio
        errors.append((pair, error))
        ac = e.activation_checkpointing if pair.compile_only else f"{e.activation_checkpointing} -> {c.activation_checkpointing}"
        source = e.source if e.source == c.source else f"{e.source}; {c.source}"
        print(f"| {pair.publisher} | {source} | {e.model} | {e.num_gpus}x {e.gpu} | "
              f"{ac} | {pair.published_ratio:.3f} | {ratio:.3f} | {100 * error:+.1f} |")

    def summary(label: str, errs: list[float]) -> dict:
        figures = dict(pairs=len(errs), median_points=100 * statistics.median(errs),
                       within_5_points=sum(x <= 0.05 for x in errs) / len(errs), worst_points=100 * max(errs))
        print(f"{label}: {figures['pairs']} pairs, median |error| {figures['median_points']:.1f} points, "
              f"{figures['within_5_points']:.0%} within 5 points, worst {figures['worst_points']:.1f}")
        return figures

    print()
    out = {"compile only": summary("compile alone separates them", [abs(x) for p, x in errors if p.compile_only]),
           "all": summary("every pair (fms-fsdp's 34B and 70B changed checkpointing too)", [abs(x) for _, x in errors])}
    for publisher in dict.fromkeys(p.publisher for p, _ in errors):
        out[publisher] = summary(f"  {publisher}", [abs(x) for p, x in errors if p.publisher == publisher])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per trial, all timed (the first compiles)")
    parser.add_argument("--rows", default="", help="comma-separated row indices (default: all)")
    parser.add_argument("--float8", action="store_true", help="the float8 matrix instead")
    parser.add_argument("--published", action="store_true", help="the float8 estimate against published runs")
    parser.add_argument("--launches", action="store_true", help="a compiled block's kernel launches: counted vs inductor's")
    parser.add_argument("--pairs", action="store_true",
                        help="compile's estimated gain against the published compiled/eager pairs, held out by publisher")
    parser.add_argument("--fit-rowwise", action="store_true",
                        help="costmodel.ROWWISE_GEMM_RATE from torchao's published rowwise run, checked on torchtitan's")
    args = parser.parse_args()
    if args.published or args.fit_rowwise:
        if FLOAT8_SITE.is_dir():
            sys.path.insert(0, str(FLOAT8_SITE))
        return published() if args.published else fit_rowwise()
    if args.launches:
        return launches()
    if args.pairs:
        pairs()
        return None
    if args.float8 and FLOAT8_SITE.is_dir():
        # `make test` puts torchao beside the venv, not in it (tests/float8_site.py says why): this
        # process and the trials' ranks import it from there.
        sys.path.insert(0, str(FLOAT8_SITE))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(FLOAT8_SITE), os.environ.get("PYTHONPATH", "")) if p)
    matrix = FLOAT8_MATRIX if args.float8 else MATRIX
    rows = [matrix[int(i)] for i in args.rows.split(",")] if args.rows else matrix
    specs = [spec(*row) for row in rows]
    started = time.perf_counter()
    with RealBackend(device="cpu", warmup_steps=0, timed_steps=args.steps, timeout_s=1200) as real:
        measured = real.evaluate_many(specs)
    real_s = time.perf_counter() - started
    started = time.perf_counter()
    with SimBackend(device_kind="cpu") as sim:
        predicted = [sim.evaluate(s) for s in specs]
    sim_s = time.perf_counter() - started
    print(f"| model | ac | mb | compile | float8 | measured B | predicted B | predicted - measured | "
          "step times s (measured) |")
    print("|---|---|---|---|---|---:|---:|---:|---|")
    for row, m, p in zip(rows, measured, predicted):
        mp = m.extras.get("tensor_peak_bytes") if m.status == "ok" else None
        pp = p.extras.get("tensor_peak_bytes") if p.status == "ok" else None
        diff = f"{pp - mp:+,} ({(pp - mp) / mp:+.3%})" if mp and pp else f"{m.status}/{p.status}: {m.message or p.message}"
        times = max(m.extras.get("step_times_s") or [[]], key=sum) if m.status == "ok" else []
        print(f"| {row[0]} | {row[1]} | {row[2]} | {row[3]} | {(row[4:] or ('none',))[0]} | {mp or 0:,} | {pp or 0:,} | {diff} | "
              f"{', '.join(f'{t:.2f}' for t in times)} |")
    print(f"\nreal trials {real_s:.0f} s (one launch), simulator {sim_s:.0f} s")


if __name__ == "__main__":
    main()
