"""torch.compile of the decoder blocks (`compile=blocks`, issue 28).

The simulator's compiled tensor peak against real compiled 2-rank gloo trials (inductor's CPU
backend compiling each block; the simulator traces AOT autograd's partitioned graphs on fake
tensors: an independent route to the same memory), the knob through the tune command, the
published-ratio throughput estimate, and the exports read back by the stacks' own parsers.
docs/COMPILE.md has what each route sees and the benchmark's figures.
"""

from __future__ import annotations

import copy
import json
import runpy
from pathlib import Path

import pytest
import yaml

from autotune.estimate import costmodel
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec
from autotune.results.export import export_result
from tests.shared_runs import register
from tests.test_sim_accuracy import predict_cpu_runs

# (model, checkpointing): compiled blocks, micro-batch 2, seq 64, 2 ranks. Full checkpointing puts
# the checkpoint inside each compiled block (AOT autograd's partitioner then recomputes it, and
# wraps SDPA in the run-with-RNG-state ops), no checkpointing lets the partitioner choose.
MATRIX = [("micro-llama", "none"), ("micro-llama", "full")]


def _spec(model: str, ac: str) -> TrialSpec:
    return TrialSpec(model=resolve_model(model), cluster=Cluster(num_gpus=2), seq_len=64,
                     train=TrainConfig(activation_checkpointing=ac, micro_batch_size=2, compile="blocks"))


register("compile", __name__, lambda folder: [_spec(*row) for row in MATRIX])


@pytest.fixture(scope="module")
def measured_and_predicted(gloo_runs):
    specs, measured = gloo_runs.run("compile")  # the session's shared launch (tests/shared_runs.py)
    return specs, measured, predict_cpu_runs(specs)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(MATRIX)), ids=["-".join(row) for row in MATRIX])
def test_compiled_tensor_peak_matches_a_real_compiled_gloo_run(measured_and_predicted, index):
    """Within 5% (issue 28's bound; docs/COMPILE.md has the measured differences). The real trial
    really compiled: dynamo counted graphs on every rank (fullgraph=True makes a skipped block an
    error, not a silent eager run)."""
    specs, measured, predicted = measured_and_predicted
    real, sim = measured[index], predicted[index]
    assert real.status == "ok", real.message
    assert sim.status == "ok", sim.message
    assert real.extras["compiled_graphs"] > 0
    # Compiling is a cost of its own, measured: the first (warm-up) step compiles every block.
    assert real.extras["compile_s"]["source"] == "measured" and real.extras["compile_s"]["value"] > 0
    real_peak, sim_peak = real.extras["tensor_peak_bytes"], sim.extras["tensor_peak_bytes"]
    assert abs(sim_peak - real_peak) <= 0.05 * real_peak, (
        f"{specs[index].train.label()}: predicted {sim_peak:,} B, measured {real_peak:,} B")


def test_a_trace_that_reuses_compiled_blocks_records_what_the_compiling_trace_did():
    """A second simulator (new models, new tracker) tracing the same compiled configuration compiles
    nothing (autotune/backends/sim/_compile_reuse.py: the trackers' module hooks no longer fail
    dynamo's guards) and records the same step: every site, the peak and the op counts. Before, each
    trace compiled every block again; a reusing trace then differed from a compiling one by the
    tensors the compile's garbage held (the blocks' cache_position) and by the first call's
    aliasing-check ops."""
    import torch._dynamo
    from torch._dynamo.callback import callback_handler

    from autotune.backends.sim import SimBackend

    spec = _spec("micro-llama", "none")
    compiles: list[object] = []
    torch._dynamo.reset()  # the first trace compiles, whatever this process traced before
    callback_handler.register_end_callback(compiles.append)
    try:
        recorded = []
        for _ in range(2):
            with SimBackend(device_kind="cpu") as sim:
                result = sim.evaluate(spec)
                (trace,) = sim._traces.values()
            recorded.append((len(compiles), result, trace))
    finally:
        callback_handler.remove_end_callback(compiles.append)
    (compiled_first, first, first_trace), (compiled_both, second, second_trace) = recorded
    assert first.status == second.status == "ok"
    assert compiled_first > 0 and compiled_both == compiled_first  # the second trace compiled nothing
    assert second_trace.sites == first_trace.sites
    assert second.extras["tensor_peak_bytes"] == first.extras["tensor_peak_bytes"]
    assert second.extras["op_work"] == first.extras["op_work"]


def test_tune_explores_compiled_candidates_and_best_json_compares_them(tmp_path):
    """--compile explore: the graph walks eager, then its fastest fitting configurations are tried
    with compiled blocks; best.json shows both, and the compiled throughput says it is estimated from the
    configuration's own step, not a measurement."""
    from autotune.drivers.cli import main

    runs = tmp_path / "runs"
    assert main(["--model", "tiny-llama", "--gpus", "2", "--global-tokens", "64K", "--backend", "analytic",
                 "--compile", "explore", "--runs-dir", str(runs), "--json"]) == 0
    (best,) = runs.glob("*/best.json")
    result = json.loads(best.read_text())
    compiled = [s for s in result["decision_path"] if s["config"].get("compile") == "blocks"]
    assert compiled and all(s["stage"] == "explore" for s in compiled)
    side_by_side = result["compile"]["eager_vs_compiled"]
    assert side_by_side["compiled"]["configuration"] == side_by_side["eager"]["configuration"] + " compile=blocks"
    assert "published" in side_by_side["compiled"]["speedup_basis"]
    # The closed form keeps eager's memory, so the compiled configuration is the eager one at its estimated
    # compiled/eager ratio (the same step with the blocks' memory-bound ops fused): it wins, and best.json says on
    # what basis. tiny-llama is narrow, so its memory-bound share, and the gain, are larger than the 8B-70B
    # published pairs' (1.11-1.28x, autotune.drivers.constants.published_compile_ratios): no published ratio bounds it.
    assert side_by_side["compiled_over_eager"] > 1.0
    assert "estimated x" in side_by_side["compiled"]["speedup_basis"]
    assert result["compile"] == dict(result["compile"], mode="blocks", backend="inductor")
    assert "published" in result["throughput_basis"] and result["throughput_source"] == "estimated"


def test_the_tune_flag_overrides_the_search_space_and_is_checked():
    from autotune.util.errors import UsageError
    from autotune.problem.options import tune_options

    assert tune_options(model="tiny-llama", compile="blocks").compile == "blocks"
    with pytest.raises(UsageError, match="--compile"):
        tune_options(model="tiny-llama", compile="whole")


def test_a_host_bound_compiled_step_is_costed_by_its_kernel_launches_not_the_published_ratio():
    """micro-llama on 2 H100s is host-bound (the GPU's work is microseconds): the compiled step's time
    is the host launching the root's eager ops and the compiled blocks' fused kernels, counted in the
    trace, fewer than eager dispatches (inductor's code for a block: benchmarks/bench_compile.py
    --launches); fusing the GPU's memory-bound ops (costmodel.compiled_throughput) does not shorten it: the
    gain reported is the launches'."""
    from autotune.backends.sim import SimBackend

    spec = TrialSpec(model=resolve_model("micro-llama"), cluster=Cluster(num_gpus=2), seq_len=64,
                     train=TrainConfig(micro_batch_size=2))
    with SimBackend() as sim:
        eager, compiled = sim.evaluate(spec), sim.evaluate(spec.with_train(spec.train.with_(compile="blocks")))
    assert eager.status == compiled.status == "ok", (eager.message, compiled.message)
    assert eager.extras["step_time"]["host_bound"] and compiled.extras["step_time"]["host_bound"]
    eager_ops, compiled_ops = eager.extras["op_work"], compiled.extras["op_work"]
    assert "compiled_launches" not in eager_ops and 0 < compiled_ops["compiled_launches"]
    # The eager ops outside the blocks are the same ops in both traces; inside, fused kernels replace ops.
    assert compiled_ops["dispatched_ops"] + compiled_ops["compiled_launches"] < eager_ops["dispatched_ops"]
    assert compiled.throughput > eager.throughput
    # The ratio reported is over eager's step (its dispatched ops), so it is the launches compile removes.
    assert compiled.extras["compile_speedup"]["ratio"] == pytest.approx(compiled.throughput / eager.throughput, rel=0.01)
    assert "host-bound" in compiled.tokens_per_sec.basis and compiled.tokens_per_sec.source == "estimated"


@pytest.fixture(scope="module")
def compiled_result(tmp_path_factory) -> dict:
    """best.json of an analytic run, with compiled blocks as the winner's knob."""
    from autotune.drivers.cli import main

    runs = tmp_path_factory.mktemp("runs")
    assert main(["--model", "tiny-llama", "--gpus", "2", "--global-tokens", "64K", "--backend", "analytic",
                 "--compile", "blocks", "--runs-dir", str(runs)]) == 0
    (best,) = runs.glob("*/best.json")
    result = json.loads(best.read_text())
    assert result["compile"]["mode"] == "blocks"
    return result


def _write(tmp_path: Path, result: dict, fmt: str):
    exported = export_result(result, fmt)
    path = tmp_path / exported.filename
    path.write_text(exported.text)
    return path, exported


def test_on_a_calibrated_gpu_profile_compiled_blocks_cost_the_eager_twins_memory_ops():
    """The per-operation model (a calibrated profile, --hardware) costs a compiled configuration's memory-bound
    ops as its eager twin's, then the same step with the blocks' ops fused, as the roofline does: its own trace runs
    inductor's decomposed graphs unfused (more bytes than eager). On one H200 (benchmarks/gpu_check.py, the
    calibrated profile of that machine) it had costed compiled bf16 blocks below eager's rate, 8.6-12.6%
    under the measured tokens/s of llama3.2-1b and mistral-7b (the rows that showed it: not held out)."""
    from autotune.backends.sim import SimBackend
    from autotune.problem.catalog.gpus import GPUS
    from autotune.estimate.hardware import load_profile

    profile = load_profile(str(Path(__file__).resolve().parents[1] / "benchmarks" / "results" /
                               "h200_calibrated_llama3.2-1b_float8.json"))
    spec = TrialSpec(model=resolve_model("tiny-llama"), cluster=Cluster(num_gpus=1, gpu=GPUS["h200-141gb"]),
                     seq_len=1024, train=TrainConfig(micro_batch_size=8), grad_accum_steps=2)
    with SimBackend(hardware=profile) as sim:
        eager = sim.evaluate(spec)
        compiled = sim.evaluate(spec.with_train(spec.train.with_(compile="blocks")))
    assert compiled.extras["op_work"]["memory_bytes"] > eager.extras["op_work"]["memory_bytes"]  # unfused
    assert "eager high-precision twin" in compiled.extras["memory_bytes_from"]
    assert compiled.extras["step_time"]["memory_s"] == pytest.approx(eager.extras["step_time"]["memory_s"])
    # tiny-llama on an H200 is host-bound: its time is the host's dispatch, which compiling shortens
    assert compiled.extras["step_time"]["host_bound"] and compiled.throughput > eager.throughput


def test_accelerate_compiles_regions_through_its_own_launcher(compiled_result, tmp_path, monkeypatch):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import TorchDynamoPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    path, exported = _write(tmp_path, compiled_result, "accelerate")
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    for key, value in prepare_multi_gpu_env(args).items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    plugin = TorchDynamoPlugin()
    assert plugin.backend.value == "INDUCTOR" and plugin.fullgraph and plugin.use_regional_compilation
    assert any(w.startswith("compile: approximated") for w in exported.warnings)


@pytest.mark.parametrize("fmt", ["hf-trainer", "trl"])
def test_trainer_configs_turn_torch_compile_on(compiled_result, tmp_path, fmt):
    from transformers import HfArgumentParser, TrainingArguments
    from trl import SFTConfig

    path, exported = _write(tmp_path, compiled_result, fmt)
    fields = yaml.safe_load(path.read_text())
    fields["use_cpu"] = True
    (args,) = HfArgumentParser(TrainingArguments if fmt == "hf-trainer" else SFTConfig).parse_dict(fields)
    assert args.torch_compile is True
    assert any(w.startswith("compile: approximated") for w in exported.warnings)  # whole model, not per block


def test_eager_exports_do_not_compile(compiled_result, tmp_path):
    eager = copy.deepcopy(compiled_result)
    eager["compile"] = {"mode": "none"}
    path, _ = _write(tmp_path, eager, "hf-trainer")
    assert "torch_compile" not in yaml.safe_load(path.read_text())
    assert "dynamo_config" not in yaml.safe_load(_write(tmp_path, eager, "accelerate")[0].read_text())


def test_fsdp2_and_lightning_exports_compile_in_parallelize(compiled_result, tmp_path):
    """Both run autotune's parallelize() (the fsdp2 script imports it, Lightning's embeds it), which
    compiles each block (apply_compile) between checkpointing and fully_shard, as real trials and
    the simulator do."""
    fsdp2 = runpy.run_path(str(_write(tmp_path, compiled_result, "fsdp2")[0]), run_name="fsdp2_export")
    assert fsdp2["TUNED"].compile == "blocks"
    path, exported = _write(tmp_path, compiled_result, "lightning")
    module = runpy.run_path(str(path), run_name="lightning_export")
    assert module["TUNED"].compile == "blocks" and "apply_compile" in module
    assert {m.knob: m.status for m in exported.mappings}["compile"] == "mapped"


def test_stacks_without_a_compile_switch_say_so(compiled_result):
    for fmt in ("fsdp1", "llama-cookbook", "litgpt"):
        warnings = export_result(compiled_result, fmt).warnings
        assert any(w.startswith("compile: unsupported") for w in warnings), fmt


def test_compiled_memory_moves_the_way_the_published_pairs_say():
    """Compile's memory direction: of the published compiled/eager pairs, torchtitan's two state memory (Llama 3.1 8B,
    selective op checkpointing: 82.4 -> 77.0 GiB on 8 H100s, 67.0 -> 62.0 on 128; autotune/estimate/data/published_runs.json),
    both lower compiled. The simulator's traced compiled peak of a Llama block under op-level checkpointing is lower
    than eager's too (the partitioner saves less; docs/COMPILE.md, "Validation")."""
    from autotune.drivers import costmodel_fit
    from autotune.backends.sim import SimBackend

    stated = [pair for pair in costmodel_fit.compile_pairs()
              if pair.eager.memory_gib is not None and pair.compiled.memory_gib is not None]
    assert len(stated) >= 2 and all(pair.compiled.memory_gib < pair.eager.memory_gib for pair in stated)
    assert {pair.eager.activation_checkpointing for pair in stated} == {"op"}
    spec = TrialSpec(model=resolve_model("micro-llama"), cluster=Cluster(num_gpus=8), seq_len=64,
                     train=TrainConfig(micro_batch_size=2, activation_checkpointing="op"))
    with SimBackend() as sim:
        eager, compiled = sim.evaluate(spec), sim.evaluate(spec.with_train(spec.train.with_(compile="blocks")))
    assert compiled.extras["tensor_peak_bytes"] < eager.extras["tensor_peak_bytes"]
