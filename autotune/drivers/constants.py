"""Every constant that shapes a printed throughput or memory figure, with its source and its check (issue 60).

One entry per constant: its value (read from the module that uses it, never copied), its unit, what it was
measured or fitted on (the rows named), and which out-of-sample check covers it, or "none". The validation
page (docs/VALIDATION.md) is generated from this registry and from the held-out ranges (autotune.estimate.heldout):

    python -m autotune.drivers.constants --write      # regenerate docs/VALIDATION.md
    python -m autotune.drivers.constants --held-out   # recompute the held-out ranges (a fit per publisher, ~10 s)

tests/test_validation.py fails where the page or the stored ranges are stale.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from autotune.estimate import costmodel, heldout, runtime_memory, time_to_train
from autotune.problem.catalog.gpus import GPUS

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "VALIDATION.md"
GPU_RECORDED_FILE = ROOT / "benchmarks" / "results" / "gpu_recorded_estimates.json"
"""The estimates of the recorded real H100 trials (benchmarks/bench_costmodel.py --gpu-recorded --json)."""

LOPO_TEST = "tests/test_validation.py::test_published_runs_leave_one_publisher_out"
RECORDED_TEST = "tests/test_validation.py::test_recorded_gpu_trials_hold_their_ranges"
COMPILE_TEST = "tests/test_validation.py::test_compiled_rows_not_taken_into_the_ratio"
FLOAT8_TEST = "tests/test_float8.py::test_float8_ratios_against_published_and_measured_rows"
RUNTIME_TEST = "tests/test_runtime_memory.py::test_runtime_terms_against_recorded_calibrations"


@dataclass(frozen=True)
class Constant:
    name: str
    value: object
    unit: str
    source: str
    """"fitted", "measured", "published", "data sheet", "assumption" or "derived"."""
    basis: str
    """What it was measured or fitted on, rows named."""
    check: str
    """The out-of-sample check that covers it, or "none" (and why)."""


_PUBLISHED_FIT = ("the 128 published eager FSDP rows of "
                  "autotune/estimate/data/published_runs.json (torchtitan 10, IBM fms-fsdp 11, MosaicML llm-foundry 106, "
                  "TinyLlama 1), each source weighed once (autotune/drivers/costmodel_fit.py)")


def registry() -> tuple[Constant, ...]:
    """The constants, in the order the page lists them."""
    cm, rm = costmodel, runtime_memory
    lopo = f"{LOPO_TEST} (held out by publisher)"
    return (
        Constant("costmodel.MATMUL_EFFICIENCY (A100)", cm.MATMUL_EFFICIENCY["a100-80gb"], "fraction of bf16 peak",
                 "fitted", _PUBLISHED_FIT + "; the A100 80GB and 40GB rows", lopo),
        Constant("costmodel.MATMUL_EFFICIENCY (H100, H200)", cm.MATMUL_EFFICIENCY["h100-80gb"],
                 "fraction of bf16 peak", "fitted",
                 _PUBLISHED_FIT + "; the H100 rows (no eager H200 row: H200 takes the H100's)", lopo + "; H100 rows only"),
        Constant("costmodel.DEFAULT_MATMUL_EFFICIENCY", cm.DEFAULT_MATMUL_EFFICIENCY, "fraction of bf16 peak",
                 "assumption", "no published FSDP run on the part (L40S, RTX 4090, A10G, V100, ...)",
                 "none: estimates on these GPUs print 'not validated on <gpu>' instead of a range"),
        Constant("costmodel.HALF_EFFICIENCY_TOKENS", cm.HALF_EFFICIENCY_TOKENS, "tokens per GPU per micro-batch",
                 "fitted", _PUBLISHED_FIT, lopo),
        Constant("costmodel.HALF_EFFICIENCY_HIDDEN", cm.HALF_EFFICIENCY_HIDDEN, "hidden size", "fitted",
                 _PUBLISHED_FIT, lopo),
        Constant("costmodel.ATTENTION_KERNEL_SPEEDUP (triton)", cm.ATTENTION_KERNEL_SPEEDUP["triton"],
                 "x published kernel bars", "fitted", _PUBLISHED_FIT + "; only llm-foundry's rows ran it",
                 "none by publisher: llm-foundry is the only publisher that ran the kernel (left out, the fit has "
                 "no row of it); tests/test_costmodel.py::test_published_runs_leave_one_source_out refits it "
                 "without each of its tables"),
        Constant("costmodel.ATTENTION_KERNEL_TFLOPS", "per kernel and GPU family", "TFLOP/s", "published",
                 "the flash kernels' published benchmark bars (costmodel.ATTENTION_KERNEL_TFLOPS docstring)", lopo),
        Constant("costmodel.MEMORY_BYTES_PER_TOKEN", "per stack", "bytes per token", "derived",
                 "the memory-bound ops' bytes counted per stack, at the HBM data sheet", lopo),
        Constant("costmodel.EAGER_SCORE_BYTES", f"{cm.EAGER_SCORE_BYTES[0]:g} / {cm.EAGER_SCORE_BYTES[1]:g}",
                 "bytes per score per block (fwd+bwd / fwd)", "derived",
                 "transformers' eager attention's memory-bound ops on the seq x seq scores, counted in micro-llama's "
                 "trace (eager less SDPA); costs --attention eager in the closed form (the simulator costs the "
                 "traced ops themselves)",
                 "tests/test_attention.py::test_eager_score_bytes_hold_on_another_model (recounted on tiny-qwen2); "
                 "::test_closed_form_prices_eager_attention_as_the_trace_does (against the simulator's traced ops)"),
        Constant("costmodel.INTRA_NODE_BUS_EFFICIENCY", cm.INTRA_NODE_BUS_EFFICIENCY, "fraction of link rate",
                 "assumption", "NCCL busbw on NVLink 3/4 (~75-80% of the one-way data sheet); applied to NVLink "
                 "and PCIe alike", lopo + ": NVLink nodes only; none on PCIe parts"),
        Constant("costmodel.NIC_BUS_EFFICIENCY", cm.NIC_BUS_EFFICIENCY, "fraction of NIC rate", "assumption",
                 "the same fraction as NVLink's, for every NIC", lopo + ": the published multi-node rows' "
                 "InfiniBand/RoCE clusters only"),
        Constant("costmodel.CP_RING_GRADIENT_BYTES", cm.CP_RING_GRADIENT_BYTES, "bytes per key/value gradient element",
                 "derived", "torch 2.13's ring attention accumulates and passes the key and value gradients in fp32 "
                 "(_cp_options.convert_to_f32, its default)",
                 "tests/test_context_parallel.py::test_cp_ring_bytes_are_what_torchs_ring_receives (counted from "
                 "torch's own collectives on the fake process group; the time: the published CP rows, bench only)"),
        Constant("costmodel.HOST_OP_US", cm.HOST_OP_US, "us per dispatched op", "measured",
                 "autotune calibrate --backend cuda on H100 VMs, torch 2.11: 16.7, 21.5, 27.3, 32.9 us "
                 "(benchmarks/results/h100_calibrated_*.json), the median", RECORDED_TEST + " (host-bound kinds)"),
        Constant("costmodel.CPU_ADAM_PARAMS_PER_S_PER_NODE", cm.CPU_ADAM_PARAMS_PER_S_PER_NODE, "parameters/s",
                 "measured", "the host optimizer step of the 9 recorded one-GPU offload trials (H100 and H200 hosts)",
                 "none: the trials it was taken from are the only ones (bench_costmodel.py --offload prints them)"),
        Constant("costmodel.OFFLOAD_ACCUMULATE_NS_PER_PARAM", cm.OFFLOAD_ACCUMULATE_NS_PER_PARAM,
                 "ns per gradient element", "fitted", "the 9 recorded one-GPU offload trials",
                 "tests/test_costmodel.py::test_offload_accumulation_holds_on_hosts_and_models_left_out_of_its_fit"),
        Constant("costmodel.RANKING_ERROR", cm.RANKING_ERROR, "fraction", "derived",
                 "the worst same-table pair of the published rows held out by source (llama-70b, 64 A100s)",
                 "none asserts the figure itself (the pairs' order is asserted in "
                 "tests/test_costmodel.py::test_published_runs_leave_one_source_out)"),
        Constant("costmodel.COMPILED_KERNELS", cm.COMPILED_KERNELS, "MEMORY_BYTES_PER_TOKEN level", "derived",
                 "a compiled block's memory-bound ops taken to move what a hand-fused Llama block moves (fused "
                 "RMSNorm, rotary, SwiGLU: counted kernel by kernel, not fitted); the compile estimate is the "
                 "eager step with the blocks' memory-bound bytes at that level (costmodel.compiled_work); no "
                 "published ratio is applied and no compile constant is fitted",
                 COMPILE_TEST + " (11 published compiled/eager pairs: torchtitan 2, IBM fms-fsdp 8, AWS 1; eager "
                 "constants fitted without each pair's publisher)"),
        Constant("costmodel.COMPILE_RATIO_ERROR_POINTS", cm.COMPILE_RATIO_ERROR_POINTS, "x eager tokens/s (points)",
                 "derived", "the worst held-out |error| of the estimated compiled/eager ratio over the 7 published "
                 "pairs that compile alone separates, rounded up: the half width of a compiled estimate's ratio in "
                 "its range", COMPILE_TEST + " (recomputed: the figure may not exceed it)"),
        Constant("costmodel.BF16_GEMM_FRACTION", cm.BF16_GEMM_FRACTION, "fraction of bf16 peak", "measured",
                 "4 bf16 GEMM calibrations on H100 VMs (benchmarks/results/h100_calibrated_*.json)",
                 "tests/test_costmodel.py::test_float8_gemm_rate_assumed_against_a_real_h200 (H200 float8 GEMMs)"),
        Constant("costmodel.FLOAT8_CAST_BYTES", dict(cm.FLOAT8_CAST_BYTES), "bytes per element", "derived",
                 "eager: counted from torchao's cast under a dispatch mode; compiled: the least a cast can move",
                 "tests/test_float8.py::test_eager_cast_bytes_are_what_torchaos_own_cast_moves (eager only; compiled: "
                 "none)"),
        Constant("costmodel.FLOAT8_PRE_ALL_GATHER_CAST_BYTES", dict(cm.FLOAT8_PRE_ALL_GATHER_CAST_BYTES),
                 "bytes per shard element, by the shard's bytes per element", "derived",
                 "counted from torchao's fsdp_pre_all_gather (scale precomputed: multiply, clamp, cast) under a "
                 "dispatch mode; eager, as FSDP's hooks run outside the compiled blocks",
                 "tests/test_float8.py::test_fsdp_gather_cast_bytes_are_what_torchaos_pre_all_gather_moves (the bytes); "
                 + FLOAT8_TEST + " (llama3.2-1b on an H200 and torchtitan's 8B ratio, with the term)"),
        Constant("costmodel.ROWWISE_GEMM_RATE", cm.ROWWISE_GEMM_RATE, "x tensorwise GEMM rate", "fitted",
                 "one published row: torchao's docs rowwise run (1.100x over compiled bf16); contradicted by the "
                 "H200's measured GEMMs (benchmarks/results/float8_gemms_h200.json: rowwise not slower there)",
                 FLOAT8_TEST + " checks llama3.2-1b's rowwise row on an H200 (not the rate itself); torchtitan 7a04053's "
                 "rowwise row: bench only"),
        Constant("costmodel.FLOAT8_ONE_GPU_MEASURED", len(cm.FLOAT8_ONE_GPU_MEASURED), "rows (ratio pairs)",
                 "measured", "4 compiled float8/bf16 ratios on one H200 (mistral-7b, qwen2.5-1.5b; "
                 "benchmarks/results/gpu_check_h200_*_large.json), beside the estimates the tool printed on "
                 "2026-11-27: stale as soon as the model moves", "none for the estimates it holds (stale); its measured ratios are checked against the recorded reports "
                 "in tests/test_validation.py::test_float8_one_gpu_measured_ratios_are_the_recorded_ones"),
        Constant("costmodel.FLOAT8_RANGE_LOW", round(cm.FLOAT8_RANGE_LOW, 4), "x the float8 estimate",
                 "derived", "the lowest measured/estimated ratio of FLOAT8_ONE_GPU_MEASURED",
                 "none: its only check (llama3.2-1b's rows) had a range that also held compiled bf16"),
        Constant("costmodel._PCIE_GBPS / _PCIE_GEN4_GBPS", "50 / 25", "GB/s", "assumption",
                 "~80% of PCIe Gen5 / Gen4 x16", "none"),
        Constant("runtime_memory.CUDA_CONTEXT_BYTES", rm.CUDA_CONTEXT_BYTES, "bytes", "measured",
                 "one H100, world size 1 (runtime_memory.MEASURED_ON); applied to every GPU and world size",
                 RUNTIME_TEST + " (other H100 VMs and an H200, world size 1)"),
        Constant("runtime_memory.NCCL_COMMUNICATOR_BASE_BYTES", rm.NCCL_COMMUNICATOR_BASE_BYTES, "bytes",
                 "measured", "one H100, world size 1 (no peers: no channel buffers)",
                 RUNTIME_TEST + " (other H100 VMs and an H200, world size 1)"),
        Constant("runtime_memory.NCCL_BUFFSIZE_DEFAULT x NCCL_CHANNELS_DEFAULT x NCCL_RING_PEERS",
                 f"{rm.NCCL_BUFFSIZE_DEFAULT} x {rm.NCCL_CHANNELS_DEFAULT} x {rm.NCCL_RING_PEERS}", "bytes",
                 "assumption", "NCCL's documented defaults: EXTRAPOLATED, never measured at world size >= 2",
                 "none (needs a multi-GPU device)"),
        Constant("runtime_memory.CUBLAS_WORKSPACE_BYTES", rm.CUBLAS_WORKSPACE_BYTES, "bytes", "measured",
                 "one H100, world size 1, after one bf16 matmul", RUNTIME_TEST),
        Constant("runtime_memory.CUBLAS_WORKSPACE_STREAMS", rm.CUBLAS_WORKSPACE_STREAMS, "workspaces",
                 "measured", "65-66 MiB left allocated after every trial on one H100, world size 1", "none"),
        Constant("runtime_memory.FRAGMENTATION (expandable_segments)",
                 "largest x 0.521 + root shard x 1.111", "bytes", "fitted",
                 "14 configurations of qwen2.5-0.5b and llama3.2-1b at seq 1024, one H100, world size 1",
                 "docs/BENCHMARKS.md GPU check at seq 2048 (not in the suite); world size > 1: none"),
        Constant("runtime_memory.FRAGMENTATION (default)", "max(largest x 1.0, peak x 0.12)", "bytes",
                 "measured", "seven qwen2.5-0.5b configurations, one H100, world size 1", "none"),
        Constant("catalog.gpus (peak_tflops, hbm_gbps, memory)", f"{len(GPUS)} parts", "TFLOP/s, GB/s, bytes",
                 "data sheet", "each part's vendor data sheet (GPUSpec.source)",
                 "tests/test_catalog_and_config.py::test_gpu_catalog (against figures written in the test)"),
        Constant("costmodel.pipeline_bubble_ratio", "(p - 1) / (v m)", "x the ideal step", "published",
                 costmodel.PIPELINE_BUBBLE_SOURCE + ": GPipe and 1F1B (v = 1), Interleaved1F1B (v stages per rank)",
                 "tests/test_costmodel_pipeline.py::test_bubble_matches_torch_schedules (torch's own action lists); "
                 "python benchmarks/bench_published_pipelines.py (9 published rows, torchtitan and Llama 3: not a test)"),
        Constant("time_to_train.FAILURES_PER_GPU_HOUR", f"{time_to_train.FAILURES_PER_GPU_HOUR:.3g}", "per GPU-hour",
                 "published", "Llama 3 (arXiv 2407.21783, section 3.3.4): 419 unexpected interruptions in 54 days on "
                 "16,384 H100s", "none by itself (it is one term of the time to train below)"),
        Constant("time_to_train.FITTED_GOODPUT", f"{time_to_train.FITTED_GOODPUT} "
                 f"({time_to_train.FITTED_GOODPUT_RANGE[0]}-{time_to_train.FITTED_GOODPUT_RANGE[1]})",
                 "x estimated tokens/s", "fitted",
                 "benchmarks/results/published_pretraining_runs.json (published wall-clock or GPU-hours of pretraining "
                 "runs, each publisher weighed once; the rows named in the constant's docstring)",
                 "python benchmarks/bench_time_to_train.py refits it without each row's publisher (not a test)"),
        Constant("heldout.RANGE_QUANTILE", heldout.RANGE_QUANTILE, "quantile", "assumption",
                 "the share of held-out |error| a printed range spans", "the ranges below"),
    )


# --- the held-out ranges, recomputed ---------------------------------------------------------------

def published_errors(held_out: dict | None = None) -> dict[str, list[tuple[str, str, float]]]:
    """The published eager rows' errors, leave-one-publisher-out, by GPU family: (publisher, gpu, error).
    `held_out`: costmodel_fit.held_out_by_publisher of the published rows, where already computed."""
    from autotune.drivers import costmodel_fit

    rows = list(costmodel_fit.published_runs())
    publishers = costmodel_fit.source_publishers()
    errors: dict[str, list[tuple[str, str, float]]] = {}
    held_out = costmodel_fit.held_out_by_publisher(rows) if held_out is None else held_out
    for _, (_, held) in held_out.items():
        for i, estimate in held.items():
            run = rows[i]
            errors.setdefault(heldout.gpu_family(run.gpu), []).append(
                (publishers[run.source], run.gpu, estimate / run.tokens_per_sec_per_gpu - 1))
    return errors


RECORDED_PUBLISHER = "autotune gpu_check (H100 VMs)"


def recorded_errors(path: Path = GPU_RECORDED_FILE) -> dict[str, list[tuple[str, str, float]]]:
    """The recorded H100 trials' errors by estimate kind: the default estimate (roofline, or
    roofline-host-bound) and the per-operation model on the calibrated H100 profiles (per-op, or
    per-op-host-bound)."""
    rows = json.loads(path.read_text())["rows"]
    out: dict[str, list[tuple[str, str, float]]] = {}
    for r in rows:
        kind = "roofline-host-bound" if r["default_host_bound"] else "roofline"
        out.setdefault(kind, []).append((RECORDED_PUBLISHER, "h100-80gb", r["default_after"] / r["measured"] - 1))
        kind = "per-op-host-bound" if r["host_bound"] else "per-op"
        out.setdefault(kind, []).append((RECORDED_PUBLISHER, "h100-80gb", r["after"] / r["measured"] - 1))
    return out


def held_out_figures(path: Path = GPU_RECORDED_FILE, held_out: dict | None = None) -> dict[tuple[str, str], heldout.HeldOut]:
    """Every recomputable range: the default GPU estimate's from the published rows held out by publisher
    and the recorded H100 trials, the others from the recorded trials. (The CPU grid's is stored from
    docs/BENCHMARKS.md: its per-row errors are not.)"""
    errors: dict[tuple[str, str], list[tuple[str, str, float]]] = {}
    for fam, errs in published_errors(held_out).items():
        errors.setdefault(("roofline", fam), []).extend(errs)
    for kind, errs in recorded_errors(path).items():
        errors.setdefault((kind, "hopper"), []).extend(errs)
    out = {}
    for key, errs in sorted(errors.items()):
        recorded = any(p == RECORDED_PUBLISHER for p, _, _ in errs)
        published = any(p != RECORDED_PUBLISHER for p, _, _ in errs)
        how = "; ".join(h for h, used in ((heldout.LOPO, published), (heldout.RECORDED, recorded)) if used)
        out[key] = heldout.summarize(key[0], key[1], errs, how)
    return out


def published_compile_ratios(compile_only: bool = True) -> list[float]:
    """Compiled over eager tokens/s of every published pair (costmodel_fit.compile_pairs: a compiled row, no
    float8, and the same publisher's eager row of the same model, GPUs, sequence and micro-batch): torchtitan's
    two, fms-fsdp's four (eight with the 34B and 70B rows, whose checkpointing changed too: `compile_only`
    False), AWS's one."""
    from autotune.drivers import costmodel_fit

    return [pair.published_ratio for pair in costmodel_fit.compile_pairs() if pair.compile_only or not compile_only]


# --- the page --------------------------------------------------------------------------------------

def _cell(value: object) -> str:
    return str(value).replace("|", "/")


def render_page() -> str:
    lines = [
        "# Validation: what each printed figure rests on",
        "",
        "Generated by `python -m autotune.drivers.constants --write` from autotune/drivers/constants.py (the registry) and",
        "autotune/estimate/heldout.py (the ranges); tests/test_validation.py fails when this page is stale.",
        "",
        "## Ranges printed around estimated tokens/s",
        "",
        f"Each range is the {heldout.RANGE_QUANTILE:.0%} quantile of |estimated / measured - 1| over rows left out of "
        "everything the estimate rests on, each publisher weighted equally. A GPU family with no held-out row gets no "
        "range: the estimate says \"not validated on <gpu>\".",
        "",
        "| estimate kind | GPU family | range | statistic | median | worst | held-out rows (publisher: rows) | GPUs | how |",
        "|---|---|---:|---|---:|---:|---|---|---|",
    ]
    for (kind, fam), h in sorted(heldout.HELD_OUT.items()):
        rows = "; ".join(f"{p}: {n}" for p, n in h.rows)
        lines.append(f"| {kind} | {fam} | +-{h.half_width:.1%} | {h.statistic} | {h.median:.1%} | {h.worst:.1%} | "
                     f"{h.count} ({rows}) | {', '.join(h.gpus)} | {h.how} |")
    validated = {fam for _, fam in heldout.HELD_OUT}
    unvalidated = sorted(name for name in GPUS if heldout.gpu_family(name) not in validated)
    lines += ["", f"Not validated (no held-out row on the family): {', '.join(unvalidated)}.", "",
              "## Constants", "",
              "| constant | value | unit | source | measured or fitted on | out-of-sample check |",
              "|---|---|---|---|---|---|"]
    for c in registry():
        lines.append(f"| `{c.name}` | {_cell(c.value)} | {c.unit} | {c.source} | {_cell(c.basis)} | {_cell(c.check)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {PAGE.relative_to(ROOT)}")
    parser.add_argument("--held-out", action="store_true", help="recompute the held-out ranges and print them")
    args = parser.parse_args(argv)
    if args.held_out:
        for key, h in held_out_figures().items():
            stored = heldout.HELD_OUT.get(key)
            print(f"{key[0]} / {key[1]}: {h.label()}" + ("" if stored == h else "   [STORED FIGURE DIFFERS]"))
            print(f"    {h!r}")
    if args.write:
        PAGE.write_text(render_page())
        print(f"wrote {PAGE}")
    if not (args.write or args.held_out):
        sys.stdout.write(render_page())
    return 0


if __name__ == "__main__":
    sys.exit(main())
