"""The accuracy figures of benchmarks/bench_costmodel.py, asserted over stored data (issue 60).

No new runs: the published rows (autotune/estimate/data/published_runs.json), the recorded real GPU trials
(benchmarks/results) and their stored estimates. Each threshold is the target an issue set where the
figure meets it, else the figure as it stands (2026-11-28, said so beside it), so that a change that
worsens it fails. Also: the printed ranges are the held-out figures stored in autotune.estimate.heldout (stale
figures fail), the validation page is current, the constant registry is complete, and no test asserts
equality with a module constant (the grep below).
"""

from __future__ import annotations

import ast
import importlib
import dataclasses
import json
import re
import statistics
import sys
from pathlib import Path

import pytest

from autotune.drivers import constants
from autotune.estimate import costmodel, heldout

ROOT = Path(__file__).resolve().parents[1]

# --- targets and current figures -------------------------------------------------------------------
PUBLISHED_MEDIAN = 0.08
"""Issue 56's target, leave-one-publisher-out, publishers weighted equally: median |error| <= 8% (met: 5.9%)."""
PUBLISHED_WORST = 0.233
"""Issue 56's target is worst <= 20%: NOT met. 23.2% (llm-foundry's MPT 30B at seq 8192 on H100s, held
out with every llm-foundry table) is the figure of 2026-11-28, asserted so that it does not grow."""
RANGE_HALF_WIDTH = {("roofline", "a100"): 0.115, ("roofline", "hopper"): 0.155,
                    ("roofline-host-bound", "hopper"): 0.315, ("per-op", "hopper"): 0.37,
                    ("per-op-host-bound", "hopper"): 0.62}
"""The printed ranges' half widths may not grow: no issue sets them; the current figures (11.1%, 15.1%,
31.1%, 36.9%, 61.5%) rounded up."""
RECORDED_MEDIAN = {"roofline-host-bound": 0.12, "per-op": 0.175, "per-op-host-bound": 0.37}
"""Median |error| of the recorded H100 trials by kind: current figures (11.5%, 17.3%, 36.5%), no issue target."""
RECORDED_TAU = 0.85
"""Kendall tau of the estimates against the 52 recorded H100 trials' measured tokens/s, for the default
estimate and for the per-operation model on the calibrated profiles (0.88 and 0.87 on 2026-11-28). Issue 11's
ranking target, tau >= 0.8, on real trials; here on stored ones, so that a timing-free check can fail."""
COMPILE_PAIRS_MEDIAN, COMPILE_PAIRS_WITHIN_5, COMPILE_PAIRS_WORST = 0.088, 0.28, 0.125
"""torch.compile's estimated gain (the eager step against the same step with the blocks' memory-bound ops fused,
costmodel.compiled_throughput; no published ratio in it, no compile constant fitted) against the published
compiled/eager ratios of the 7 pairs compile alone separates (torchtitan 2, IBM fms-fsdp 4, AWS 1), each pair's
eager constants fitted without its publisher. Issue 56's target (median <= 3 points, >= 80% within 5 points,
over >= 8 pairs from >= 3 sources) is NOT met: median 8.7 points, 2 of 7 within 5 (29%), worst 12.5 on 2026-11-28
(torchtitan and AWS +4.9 to +5.5: the estimate gains more than they did; fms-fsdp's 7B and 13B -8.7 to -12.5:
less). The 11 pairs with fms-fsdp's 34B and 70B (checkpointing changed with compile there): median 8.7, 2 of 11
within 5, worst 13.5 points: asserted below as well."""
COMPILE_ALL_PAIRS_MEDIAN, COMPILE_ALL_PAIRS_WORST = 0.088, 0.136
COMPILED_ROWS_MEDIAN, COMPILED_ROWS_WORST = 0.037, 0.116
"""The 11 compiled published rows (no float8) estimated as the tool does (the compiled step with the eager
constants fitted without the row's publisher): median |error| 3.6%, worst 11.5% (llama-70b, 96 H100s) on
2026-11-28 (7.8% and 18.3% while the eager estimate was multiplied by one published ratio). No issue target:
current figures."""


@pytest.fixture(scope="module")
def by_publisher():
    """costmodel_fit.held_out_by_publisher over the published rows: a fit per publisher (about 6 s)."""
    from autotune.drivers import costmodel_fit

    return costmodel_fit.held_out_by_publisher(list(costmodel_fit.published_runs()))


def test_published_runs_leave_one_publisher_out(by_publisher):
    """Every publisher's tables held out of the fit at once, the constants refitted on the other publishers,
    each publisher weighted equally in the median and the quantiles (issue 56). The stored ranges
    (autotune.estimate.heldout.HELD_OUT) are these figures: stale ones fail here."""
    recomputed = constants.held_out_figures(held_out=by_publisher)
    for key, figures in recomputed.items():
        stored = heldout.HELD_OUT.get(key)
        assert stored is not None, f"{key}: no stored range (python -m autotune.drivers.constants --held-out)"
        assert (stored.rows, stored.gpus) == (figures.rows, figures.gpus), key
        for name in ("half_width", "median", "worst"):
            assert getattr(stored, name) == pytest.approx(getattr(figures, name), abs=0.002), (
                f"{key}: the stored {name} is stale: python -m autotune.drivers.constants --held-out, then update "
                f"autotune/estimate/heldout.py and docs/VALIDATION.md", figures)
        assert figures.half_width <= RANGE_HALF_WIDTH[key], (key, figures)
    published = [(p, e) for errs in constants.published_errors(by_publisher).values() for p, _, e in errs]
    assert len({p for p, _ in published}) >= 4 and len(published) >= 120
    assert heldout.weighted_quantile(published, 0.5) <= PUBLISHED_MEDIAN
    assert max(abs(e) for _, e in published) <= PUBLISHED_WORST


def _kendall(xs: list[float], ys: list[float]) -> float:
    pairs = [(i, j) for i in range(len(xs)) for j in range(i + 1, len(xs))]
    score = sum((xs[i] - xs[j]) * (ys[i] - ys[j]) > 0 for i, j in pairs) - \
        sum((xs[i] - xs[j]) * (ys[i] - ys[j]) < 0 for i, j in pairs)
    return score / len(pairs)


RECOMPUTED = {("gpu_check_h100_qwen2.5-0.5b_seq1024_knobs.json", "bf16 mb2"),
              ("gpu_check_h100_qwen2.5-0.5b_seq1024_knobs.json", "bf16 mb4 ac:op"),
              ("gpu_check_h100_qwen2.5-0.5b_seq1024_knobs.json", "bf16 mb2 ac:full offload"),
              ("gpu_check_h100_qwen2.5-1.5b_seq2048_expandable.json", "bf16 mb4")}
"""The recorded trials the test estimates afresh: host-bound, op-level checkpointing, CPU offload, and a
compute-bound one (seconds, not the benchmark's two minutes)."""


def test_recorded_gpu_trials_hold_their_ranges():
    """The real H100 trials benchmarks/gpu_check.py recorded (52 rows, 3 models; nothing was fitted to them),
    against their estimates stored in benchmarks/results/gpu_recorded_estimates.json: four rows (RECOMPUTED) are
    estimated afresh here and must match the stored estimates (a change to the model that moves them makes the
    file stale: `python benchmarks/bench_costmodel.py --gpu-recorded --json X.json`, then keep its rows), and
    the stored figures must hold the thresholds: medians by kind, the ranking (Kendall tau)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        gc = importlib.import_module("gpu_check")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from autotune.estimate import hardware
    from autotune.backends.sim import SimBackend
    from autotune.problem.catalog.models import resolve_model

    stored = json.loads(constants.GPU_RECORDED_FILE.read_text())["rows"]
    assert len(stored) >= 50
    rows = [r for r in stored if (r["report"], r["label"]) in RECOMPUTED]
    assert len(rows) == len(RECOMPUTED) and {r["host_bound"] for r in rows} == {True, False}
    shipped_host = hardware.shipped_profile(hardware.GPUS["h100-80gb"]).figures["host_op_us"]
    default = SimBackend(device_kind="cuda")
    cases = dict(gc.CASES)
    for row in rows:
        profile = hardware.load_profile(str(ROOT / "benchmarks" / "results" / row["profile"]))
        host = profile.figures.get("host_op_us") or shipped_host
        calibrated = SimBackend(device_kind="cuda", hardware=dataclasses.replace(
            profile, figures={**profile.figures, "host_op_us": host}))
        spec = gc.spec_for(resolve_model(row["model"]), world=1, gpu=hardware.GPUS["h100-80gb"], seq_len=row["seq"],
                           **cases[row["label"]])
        after, default_after = calibrated.evaluate(spec), default.evaluate(spec)
        assert after.tokens_per_sec.value == pytest.approx(row["after"], rel=0.01), (row, "stale: rerun the bench")
        assert default_after.tokens_per_sec.value == pytest.approx(row["default_after"], rel=0.01), row
        assert bool(after.extras["step_time"].get("host_bound")) == row["host_bound"], row
    errors = constants.recorded_errors()
    for kind, limit in RECORDED_MEDIAN.items():
        assert heldout.weighted_quantile([(p, e) for p, _, e in errors[kind]], 0.5) <= limit, kind
    measured = [r["measured"] for r in stored]
    assert _kendall([r["default_after"] for r in stored], measured) >= RECORDED_TAU
    assert _kendall([r["after"] for r in stored], measured) >= RECORDED_TAU


def test_compiled_rows_not_taken_into_the_ratio(by_publisher):
    """torch.compile's gain, estimated per configuration from its own step (no published ratio is taken into it),
    against every published compiled/eager pair held out by publisher (costmodel_fit.compile_ratio_estimates), and
    the compiled published rows estimated as the tool estimates them. The thresholds are the figures of
    2026-11-28 (COMPILE_PAIRS_*: issue 56's targets are NOT met, see there); the range's half width
    (costmodel.COMPILE_RATIO_ERROR_POINTS) must cover the worst compile-only pair."""
    from autotune.drivers import costmodel_fit

    rows = list(costmodel_fit.published_runs())
    all_rows = costmodel_fit.fit(rows)  # for a publisher with no eager row in the fit (AWS)
    estimates = costmodel_fit.compile_ratio_estimates(by_publisher, all_rows)
    assert len(estimates) >= 8 and len({pair.publisher for pair, _ in estimates}) >= 3
    only = [abs(ratio - pair.published_ratio) for pair, ratio in estimates if pair.compile_only]
    assert len(only) >= 7 and len({pair.publisher for pair, _ in estimates if pair.compile_only}) >= 3
    assert statistics.median(only) <= COMPILE_PAIRS_MEDIAN and max(only) <= COMPILE_PAIRS_WORST, only
    assert sum(e <= 0.05 for e in only) / len(only) >= COMPILE_PAIRS_WITHIN_5, only
    assert max(only) <= costmodel.COMPILE_RATIO_ERROR_POINTS
    every = [abs(ratio - pair.published_ratio) for pair, ratio in estimates]
    assert statistics.median(every) <= COMPILE_ALL_PAIRS_MEDIAN and max(every) <= COMPILE_ALL_PAIRS_WORST, every
    # The ratio moves with the configuration (width, sequence, checkpointing, GPUs): not one figure for all.
    assert len({round(ratio, 3) for _, ratio in estimates}) >= 8
    errors = []
    for pair in costmodel_fit.compile_pairs():
        fit = by_publisher[pair.publisher][0] if pair.publisher in by_publisher else all_rows
        errors.append(abs(costmodel_fit.compiled_estimate(pair.compiled, fit) / pair.compiled.tokens_per_sec_per_gpu - 1))
    assert len(errors) >= 8
    assert statistics.median(errors) <= COMPILED_ROWS_MEDIAN and max(errors) <= COMPILED_ROWS_WORST, errors


def test_float8_one_gpu_measured_ratios_are_the_recorded_ones():
    """costmodel.FLOAT8_ONE_GPU_MEASURED's measured ratios are those of the recorded H200 reports (its
    estimated ones are what the tool printed then, stale by construction: the registry says so)."""
    for model, recipe, measured, _ in costmodel.FLOAT8_ONE_GPU_MEASURED:
        report = json.loads((ROOT / "benchmarks" / "results" / f"gpu_check_h200_{model}_seq2048_large.json").read_text())
        rows = {row["label"]: row["measured_tokens_per_sec"] for row in report["rows"]}
        assert measured == pytest.approx(rows[f"bf16 mb2 ac:full compile float8:{recipe}"]
                                         / rows["bf16 mb2 ac:full compile"], rel=0.002), (model, recipe)


def test_unvalidated_gpus_print_no_range_and_say_so():
    """A GPU family with no held-out row gets no range: "not validated on <gpu>" (the +-22% printed on L40S,
    RTX 4090, A10G and V100 is gone); a validated one names its held-out rows and publishers."""
    from autotune.estimate import hardware

    for name in ("l40s-48gb", "rtx4090-24gb", "a10g-24gb", "v100-32gb"):
        profile = hardware.shipped_profile(hardware.GPUS[name])
        assert costmodel.estimate_range(1000.0, profile) is None
        assert costmodel.range_note(profile) == f"not validated on {name}"
        assert "not validated" in costmodel.range_source(profile, host_bound=True)
    h100 = hardware.shipped_profile(hardware.GPUS["h100-80gb"])
    note = costmodel.range_note(h100)
    assert "held-out rows" in note and "MosaicML (llm-foundry)" in note and "IBM (fms-fsdp)" in note


def test_the_ranges_families_are_the_fits():
    """A range's GPU family is the family that shares one fitted efficiency (costmodel_fit.gpu_family)."""
    from autotune.drivers import costmodel_fit
    from autotune.problem.catalog.gpus import GPUS

    assert all(heldout.gpu_family(name) == costmodel_fit.gpu_family(name) for name in GPUS)


def test_the_validation_page_is_current():
    """docs/VALIDATION.md is generated from the registry and the stored ranges."""
    assert constants.PAGE.read_text() == constants.render_page(), "python -m autotune.drivers.constants --write"


ISSUE_60_CONSTANTS = ("MATMUL_EFFICIENCY", "DEFAULT_MATMUL_EFFICIENCY", "COMPILED_KERNELS", "INTRA_NODE_BUS_EFFICIENCY",
                      "NIC_BUS_EFFICIENCY", "HOST_OP_US", "CUDA_CONTEXT_BYTES", "NCCL_COMMUNICATOR_BASE_BYTES",
                      "NCCL_BUFFSIZE_DEFAULT", "CUBLAS_WORKSPACE_BYTES", "FRAGMENTATION", "ROWWISE_GEMM_RATE",
                      "FLOAT8_ONE_GPU_MEASURED", "FLOAT8_RANGE_LOW", "CPU_ADAM_PARAMS_PER_S_PER_NODE",
                      "RANKING_ERROR", "catalog.gpus")


def test_the_registry_lists_every_constant_with_its_source_and_check():
    entries = constants.registry()
    names = " ".join(c.name for c in entries)
    for name in ISSUE_60_CONSTANTS:
        assert name in names, name
    for c in entries:
        assert c.unit and c.source in ("fitted", "measured", "published", "data sheet", "assumption", "derived"), c
        assert c.basis and c.check, c
    nccl = next(c for c in entries if "NCCL_BUFFSIZE" in c.name)
    assert "EXTRAPOLATED" in nccl.basis and "world size >= 2" in nccl.basis


# --- no test checks a figure against itself -----------------------------------------------------------
WATCHED = ("autotune.estimate.costmodel", "autotune.estimate.runtime_memory", "autotune.estimate.heldout", "autotune.estimate.hardware",
           "autotune.drivers.constants", "autotune.problem.catalog.gpus")
"""The modules whose constants shape a printed throughput or memory figure."""
ALLOWED = {
    # (test file, the constant): why the equality is not the constant checked against itself
    ("test_costmodel.py", "MATMUL_EFFICIENCY"): "the shipped constant is the fit on all published rows from a fixed "
                                                "start (reproducibility; accuracy: the held-out tests)",
    ("test_costmodel.py", "HALF_EFFICIENCY_TOKENS"): "as MATMUL_EFFICIENCY",
    ("test_costmodel.py", "HALF_EFFICIENCY_HIDDEN"): "as MATMUL_EFFICIENCY",
    ("test_costmodel.py", "ATTENTION_KERNEL_SPEEDUP"): "as MATMUL_EFFICIENCY",
    ("test_costmodel.py", "OFFLOAD_ACCUMULATE_NS_PER_PARAM"): "the refit without each host or model stays near it; "
                                                              "the held-out trials' errors are asserted beside it",
    ("test_costmodel.py", "FRESH_PAGE_NS_PER_BYTE"): "measured on a CPU, compared with the GPU trials' fit of it",
    ("test_float8.py", "FLOAT8_CAST_BYTES"): "counted again from torchao's own cast under a dispatch mode",
    ("test_float8.py", "FLOAT8_PRE_ALL_GATHER_CAST_BYTES"): "counted again from torchao's own fsdp_pre_all_gather under "
                                                            "a dispatch mode",
}
_UPPER = re.compile(r"^_?[A-Z][A-Z0-9_]*$")


def _watched_names(tree: ast.AST) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """Names bound to a watched module (alias -> module), and watched constants imported by name
    (alias -> (module, name))."""
    modules, names = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in WATCHED:
                    modules[alias.asname or alias.name] = full
                elif node.module in WATCHED and _UPPER.match(alias.name):
                    names[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in WATCHED and alias.asname:
                    modules[alias.asname] = alias.name
    return modules, names


def _is_figure(module: str, name: str) -> bool:
    """A constant that is a number (or holds numbers), not a setting's text."""
    return not isinstance(getattr(importlib.import_module(module), name, None), (str, bytes))


def _constant(node: ast.AST, modules: dict[str, str], names: dict[str, tuple[str, str]]) -> str | None:
    """The watched numeric constant `node` reads (through subscripts and pytest.approx), or None."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "approx":
        return _constant(node.args[0], modules, names) if node.args else None
    if isinstance(node, ast.Attribute) and _UPPER.match(node.attr) and isinstance(node.value, ast.Name) \
            and node.value.id in modules and _is_figure(modules[node.value.id], node.attr):
        return node.attr
    if isinstance(node, ast.Name) and node.id in names and _is_figure(*names[node.id]):
        return node.id
    return None


def self_referential_assertions(folder: Path = ROOT / "tests") -> list[str]:
    """Equalities (==, pytest.approx) of a figure with a watched module constant, and ranges rebuilt in a test
    with costmodel.estimate_range (a range built from the value it checks), outside ALLOWED."""
    found = []
    for path in sorted(folder.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        modules, names = _watched_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
                for operand in (node.left, *node.comparators):
                    name = _constant(operand, modules, names)
                    if name and (path.name, name) not in ALLOWED:
                        found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:120]}")
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "estimate_range" \
                    and path.name != Path(__file__).name:
                found.append(f"{path.name}:{node.lineno}: a range rebuilt with estimate_range")
    return found


def test_no_test_asserts_equality_with_a_module_constant():
    assert self_referential_assertions() == []


def test_the_grep_catches_what_it_looks_for(tmp_path):
    (tmp_path / "test_bad.py").write_text(
        "import pytest\nfrom autotune.estimate import costmodel as cm\nfrom autotune.estimate.runtime_memory import CUDA_CONTEXT_BYTES\n"
        "def test_a(ratio, ctx):\n    assert ratio == pytest.approx(cm.COMPILE_RATIO_ERROR_POINTS)\n"
        "    assert ctx == CUDA_CONTEXT_BYTES\n    assert cm.MATMUL_EFFICIENCY['a100-80gb'] == 0.82\n"
        "    low, high = cm.estimate_range(1.0, None)\n")
    assert len(self_referential_assertions(tmp_path)) == 4
