"""float8 training of the decoder blocks' linears (`float8=tensorwise|rowwise`, issue 28).

The simulator's float8 tensor peak against real float8 2-rank gloo trials (torchao's Float8Linear and
FSDP2's float8 all-gather on CPU ranks: `torch._scaled_mm` runs on this CPU), the eager cast cost
counted again by a dispatch mode over torchao's own cast, the GPU gating (one-line errors, exit 2),
the search's `--float8 explore` and best.json's side-by-side, and the exports read back by the
stacks' own parsers. docs/COMPILE.md has the benchmark's figures and the published validation.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys

import pytest

from tests import float8_site

float8_site.add_to_path()  # torchao beside the venv (tests/float8_site.py): this process only
pytest.importorskip("torchao.float8", reason="the float8 extra (torchao) is not installed: make test installs it in .float8-site")

from autotune.estimate import costmodel  # noqa: E402
from autotune.problem.catalog.models import resolve_model  # noqa: E402
from autotune.problem.config import Cluster, TrainConfig, TrialSpec  # noqa: E402
from autotune.results.export import export_result  # noqa: E402
from tests.shared_runs import register  # noqa: E402
from tests.test_sim_accuracy import predict_cpu_runs  # noqa: E402

RECIPES = ("tensorwise", "rowwise")
# (recipe, tensor parallel, compile[, pipeline parallel[, context parallel]]): FSDP alone, then TP2 on the same 2
# ranks (tensorwise: torchao's float8 TP styles, the weights and inputs all-gathered in float8; rowwise: torch's own
# styles, compiled as torchtitan runs), then PP2 (each stage's blocks converted, 4 micro-batches under 1F1B), then CP2
# (the ring between float8 linears).
CASES = (("tensorwise", 1, "none"), ("rowwise", 1, "none"), ("tensorwise", 2, "none"), ("rowwise", 2, "blocks"),
         ("tensorwise", 1, "none", 2), ("tensorwise", 1, "none", 1, 2))


def _spec(recipe: str, tp: int = 1, compiled: str = "none", pp: int = 1, cp: int = 1) -> TrialSpec:
    return TrialSpec(model=resolve_model("micro-llama"), cluster=Cluster(num_gpus=2), seq_len=64,
                     train=TrainConfig(micro_batch_size=2, float8=recipe, tensor_parallel=tp, compile=compiled,
                                       pipeline_parallel=pp, context_parallel=cp), grad_accum_steps=4 if pp > 1 else 1)


register("float8", __name__, lambda folder: [_spec(*case) for case in CASES],
         python_path=(str(float8_site.FLOAT8_SITE),))


@pytest.fixture(scope="module")
def measured_and_predicted(gloo_runs):
    specs, measured = gloo_runs.run("float8")  # the session's shared launch (tests/shared_runs.py)
    return specs, measured, predict_cpu_runs(specs)


def _block_linears(model: str) -> int:
    """nn.Linear modules inside the decoder layers of transformers' own model (meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = resolve_model(model)
    config = AutoConfig.for_model(spec.model_type, **{k: v for k, v in spec.config_dict.items() if k != "model_type"})
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config)
    return sum(isinstance(m, torch.nn.Linear) for name, m in net.named_modules() if ".layers." in name)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=["-".join(map(str, case)) for case in CASES])
def test_float8_tensor_peak_matches_a_real_float8_gloo_run(measured_and_predicted, index):
    """Within 1% (docs/COMPILE.md has the bytes: 4 apart eager; compiled, the trace's unfused transients are an
    upper bound of inductor's). The real trial really ran float8: every linear of transformers' decoder layers
    (all of micro-llama's dimensions divide by 16) was a torchao Float8Linear on both ranks, and its losses are
    finite. Under TP the float8 all-gathers cross gloo as bytes (backends/real/_gloo_float8.py); under PP each rank
    converts its stage's blocks' linears."""
    specs, measured, predicted = measured_and_predicted
    real, sim = measured[index], predicted[index]
    assert real.status == "ok", real.message
    assert sim.status == "ok", sim.message
    assert real.extras["float8_linears"] == _block_linears("micro-llama") // specs[index].train.pipeline_parallel
    real_peak, sim_peak = real.extras["tensor_peak_bytes"], sim.extras["tensor_peak_bytes"]
    assert abs(sim_peak - real_peak) <= 0.01 * real_peak, (
        f"{specs[index].train.label()}: predicted {sim_peak:,} B, measured {real_peak:,} B")


_COUNT_TP_COLLECTIVES = """
import json, sys
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from autotune.distributed.parallel import ParallelDims, parallelize
from autotune.distributed.training import build_model, make_optimizer, token_batches, train_step
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import TrainConfig

KINDS = {torch.ops._c10d_functional.all_gather_into_tensor.default: "all_gather",
         torch.ops._c10d_functional.reduce_scatter_tensor.default: "reduce_scatter"}

class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes = {}
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in KINDS:
            data = getattr(args[0], "_data", args[0])  # torchao's Float8TrainingTensor holds its float8 data
            key = KINDS[func] + " " + str(data.dtype).replace("torch.", "")
            self.bytes[key] = self.bytes.get(key, 0) + data.numel() * data.element_size()
        return func(*args, **(kwargs or {}))

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
out = {}
for recipe in ("none", "tensorwise"):
    train = TrainConfig(tensor_parallel=2, micro_batch_size=2, float8=recipe)
    model = build_model(resolve_model("micro-llama"))
    parallelize(model, ParallelDims.of(train, 2).build_mesh("cpu"), train)
    count = Count()
    with count:
        train_step(model, make_optimizer(model), token_batches(vocab_size=model.config.vocab_size, micro_batch_size=2,
                   seq_len=64, device="cpu"), grad_accum_steps=1)
    out[recipe] = count.bytes
print(json.dumps(out))
"""


def test_tensorwise_float8_tensor_parallelism_gathers_in_float8():
    """What costmodel.tp_all_reduce_bytes(float8_gathers=True) assumes, counted another way: one step of
    micro-llama TP2 on the fake process group (2 blocks, hidden 64, 64 tokens a rank) under a dispatch mode over
    the functional collectives. Under tensorwise float8 the blocks' all-gathers carry float8 (the attention and
    MLP inputs in e4m3 forward, the output gradients in e5m2 backward), half bf16's bytes; the embeddings' and
    head's two stay bf16, and so do the reduce-scatters."""
    done = subprocess.run([sys.executable, "-c", _COUNT_TP_COLLECTIVES], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": float8_site.python_path(os.getcwd())})
    assert done.returncode == 0, done.stderr[-3000:]
    counted = json.loads(done.stdout.strip().splitlines()[-1])
    bf16, tensorwise = counted["none"], counted["tensorwise"]
    shard = 2 * 32 * 64 * 2  # one all-gather's input: a rank's sequence shard, bf16
    assert bf16 == {"all_gather bfloat16": 10 * shard, "reduce_scatter bfloat16": 4 * 2 * shard}, bf16
    assert tensorwise["all_gather bfloat16"] == 2 * shard, tensorwise  # the embeddings' output, the head's input
    assert tensorwise["all_gather float8_e4m3fn"] == tensorwise["all_gather float8_e5m2"] == 4 * shard // 2, tensorwise


def _cast_elements_closed_form(model: str, *, tokens: int, tp: int) -> int:
    """float8_cast_elements of one step without checkpointing, counted from the model's shapes alone: every block
    linear (in, out) runs three float8 GEMMs (forward, input gradient, weight gradient) whose operands are the input
    twice, the output gradient twice and the weight twice, at this rank's widths (column-wise linears: q, k, v, gate,
    up split their outputs over tp ranks, row-wise ones: o, down their inputs). Under tensor parallelism the
    column-wise linears' inputs and the row-wise ones' output gradients are what the float8 all-gathers carry
    (test_tensorwise_float8_tensor_parallelism_gathers_in_float8 counts them): cast once each on the sequence shard
    (tokens / tp x hidden: two in forward, two in backward), not once per operand."""
    config = resolve_model(model).config_dict
    h, f = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * config.get("head_dim", h // config["num_attention_heads"])
    linears = [(h, h, True), (h, kv, True), (h, kv, True), (h, h, False), (h, f, True), (h, f, True), (f, h, False)]
    per_block = 0
    for width_in, width_out, column_wise in linears:
        local_in, local_out = (width_in, width_out // tp) if column_wise else (width_in // tp, width_out)
        gathered_in, gathered_out = tp > 1 and column_wise, tp > 1 and not column_wise
        per_block += (0 if gathered_in else 2 * tokens * local_in) + (0 if gathered_out else 2 * tokens * local_out)
        per_block += 2 * local_in * local_out
    if tp > 1:
        per_block += 4 * tokens // tp * h
    return per_block * config["num_hidden_layers"]


@pytest.mark.parametrize("tp, compiled", [(1, "none"), (2, "none"), (2, "blocks")])
def test_the_traced_casts_count_each_gathered_float8_input_once_on_its_shard(tp, compiled):
    """The simulator's float8_cast_elements (what costmodel.float8_step_seconds costs the casts from) on micro-llama,
    2 ranks, tensorwise, no checkpointing, against the closed form above: FSDP alone counts every float8 GEMM operand;
    tensor parallelism casts the gathered inputs once on the shard, where a count per operand took q, k and v's
    gathered input three times over, at tp times its cast size (309,248 elements a step here, not 505,856).
    Compiled, the gathered bytes reach the matmuls through inductor's uint8 concatenation: the same count."""
    from autotune.backends.sim import SimBackend

    spec = TrialSpec(model=resolve_model("micro-llama"), cluster=Cluster(num_gpus=2), seq_len=64,
                     train=TrainConfig(micro_batch_size=2, float8="tensorwise", tensor_parallel=tp, compile=compiled,
                                       activation_checkpointing="none"))
    traced = SimBackend(device_kind="cuda", extrapolate=False).evaluate(spec).extras["op_work"]
    assert traced["float8_cast_elements"] == _cast_elements_closed_form("micro-llama", tokens=2 * 64, tp=tp)


def test_float8_changes_the_step_a_tensor_parallel_group_takes():
    """float8's seconds saved and cast (costmodel.float8_step_seconds) change the step the job's tokens take, where a
    tensor-parallel group shares one batch: eager llama3.2-1b TP2 on an H100 pair at seq 8192 (not host-bound: the
    GPU's time decides), whose step is the roofline's own (extras step_time, no compile ratio). Taken over every
    GPU's tokens, as until 2026-11-30, the step came out tp times too long and float8's change to it tp times too
    small (here 0.84x, eager float8's unfused casts; 0.92x so taken)."""
    from autotune.backends.sim import SimBackend
    from autotune.problem.catalog.gpus import GPUS

    spec = TrialSpec(model=resolve_model("llama3.2-1b"), cluster=Cluster(num_gpus=2, gpu=GPUS["h100-80gb"]),
                     seq_len=8192, train=TrainConfig(micro_batch_size=2, float8="tensorwise", tensor_parallel=2))
    extras = SimBackend(device_kind="cuda").evaluate(spec).extras
    step, float8 = extras["step_time"], extras["float8"]
    gpu, host = step["gpu_compute_s"], step["host_s"]
    float8_step = step["seconds"] - max(gpu, host) + max(gpu - float8["saved_s"] + float8["casts_s"], host)
    assert float8["speedup"] == pytest.approx(step["seconds"] / float8_step, rel=1e-9)
    assert not step["host_bound"] and float8["speedup"] != pytest.approx(1.0, abs=0.05)


def test_eager_cast_bytes_are_what_torchaos_own_cast_moves():
    """FLOAT8_CAST_BYTES['eager'] against a count made by a dispatch mode over torchao's cast of a real
    bf16 tensor (every op's inputs and outputs), for both recipes' scalings."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    def nbytes(values):
        return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))

    class Moved(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Moved.total += nbytes(args) + nbytes((kwargs or {}).values()) + nbytes(
                out if isinstance(out, (tuple, list)) else (out,))
            return out

    x = torch.randn(512, 1024, dtype=torch.bfloat16)
    for granularity, dim in ((ScalingGranularity.TENSORWISE, None), (ScalingGranularity.AXISWISE, -1)):
        Moved.total = 0
        with Moved():
            hp_tensor_to_float8_dynamic(x, torch.float8_e4m3fn, LinearMMConfig(), gemm_input_role=GemmInputRole.INPUT,
                                        scaling_granularity=granularity, axiswise_dim=dim)
        assert Moved.total / x.numel() == pytest.approx(costmodel.FLOAT8_CAST_BYTES["eager"], abs=0.1)


def test_fsdp_gather_cast_bytes_are_what_torchaos_pre_all_gather_moves():
    """FLOAT8_PRE_ALL_GATHER_CAST_BYTES against a count made by a dispatch mode over torchao's own
    `fsdp_pre_all_gather` of a weight shard with its scale precomputed (as autotune's step precomputes it), for
    an fp32 shard (mixed precision's master weights) and a bf16 one (bf16-pure)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    class Moved(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Moved.total += sum(v.numel() * v.element_size() for v in (*args, *(kwargs or {}).values(),
                                                                      *(out if isinstance(out, (tuple, list)) else (out,)))
                               if isinstance(v, torch.Tensor) and v.numel() > 1)  # not the scalar scale
            return out

    for dtype in (torch.float32, torch.bfloat16):
        shard = torch.randn(512, 1024, dtype=dtype)
        weight = WeightWithDynamicFloat8CastTensor(shard, LinearMMConfig(), torch.float8_e4m3fn,
                                                   precomputed_scale=torch.tensor(2.0))
        Moved.total = 0
        with Moved():
            (data,), _ = weight.fsdp_pre_all_gather(None)
        assert data.numel() == shard.numel()
        bytes_per_element = Moved.total / shard.numel()
        assert bytes_per_element == pytest.approx(costmodel.FLOAT8_PRE_ALL_GATHER_CAST_BYTES[shard.element_size()],
                                                  abs=0.1), (dtype, bytes_per_element)


def test_float8_is_refused_on_gpus_without_it(tmp_path):
    """A100 has no float8 tensor cores: the knob is refused with one line and exit 2, on the trial and
    tune commands; `explore` is not an error there, the run says float8 was not explored."""
    from autotune.drivers.cli import EXIT_USAGE

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": float8_site.python_path(os.getcwd())}, timeout=300)

    for command in (["trial", "--float8", "tensorwise"],
                    ["--float8", "rowwise", "--global-tokens", "64K", "--runs-dir", str(tmp_path)]):
        proc = cli(*command, "--model", "tiny-llama", "--gpus", "2", "--gpu-type", "a100-80gb", "--backend", "analytic")
        assert proc.returncode == EXIT_USAGE, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if "float8" in line]
        assert len(errors) == 1 and "no float8 tensor cores" in errors[0]
    from autotune.drivers.cli import main

    runs = tmp_path / "explore"
    assert main(["--model", "tiny-llama", "--gpus", "2", "--gpu-type", "a100-80gb", "--global-tokens", "64K",
                 "--backend", "analytic", "--float8", "explore", "--runs-dir", str(runs)]) == 0
    (best,) = runs.glob("*/best.json")
    result = json.loads(best.read_text())
    assert result["float8"]["recipe"] == "none"
    assert not [s for s in result["decision_path"] if s["config"].get("float8", "none") != "none"]
    assert any("float8 not explored" in note for note in result["notes"])


@pytest.fixture(scope="module")
def explored(tmp_path_factory) -> dict:
    """best.json of an analytic --compile explore --float8 explore run on an H100 pair."""
    from autotune.drivers.cli import main

    runs = tmp_path_factory.mktemp("runs")
    assert main(["--model", "tiny-llama", "--gpus", "2", "--global-tokens", "64K", "--backend", "analytic",
                 "--compile", "explore", "--float8", "explore", "--runs-dir", str(runs)]) == 0
    (best,) = runs.glob("*/best.json")
    return json.loads(best.read_text())


def test_explore_tries_each_recipe_on_the_best_candidates_and_best_json_shows_them_side_by_side(explored):
    """The graph in high precision, then the FLOAT8_CANDIDATES fastest fitting configurations, compiled ones first,
    with each recipe; best.json's compile section shows eager, compiled and float8 rows."""
    from autotune.search.controller import FLOAT8_CANDIDATES

    float8_steps = [s for s in explored["decision_path"] if s["config"].get("float8", "none") != "none"]
    assert float8_steps and all(s["stage"] == "explore" for s in float8_steps)
    assert {s["config"]["float8"] for s in float8_steps} == set(RECIPES)
    assert len(float8_steps) == FLOAT8_CANDIDATES * len(RECIPES)
    # Compiled bases first (here two fit within the batch, the eager winner after them).
    compiled = [s["config"].get("compile", "none") == "blocks" for s in float8_steps]
    assert compiled == sorted(compiled, reverse=True) and compiled[0] and not compiled[-1]
    rows = {(r["compile"], r["float8"]): r for r in explored["compile"]["side_by_side"]}
    assert ("none", "none") in rows and ("blocks", "none") in rows
    assert {f for _, f in rows} >= set(RECIPES)
    assert all(r["throughput_source"] == "estimated" and "over_eager" in r for r in rows.values())
    assert explored["float8"]["recipe"] in ("none", *RECIPES)


def test_float8_gpu_throughput_is_costed_from_the_traced_float8_matmuls():
    """On an H100 the simulator's float8 estimate counts the traced `_scaled_mm` FLOPs and the casts'
    operands, and says it is an estimate checked against published runs, not fitted to them."""
    from autotune.backends.sim import SimBackend

    spec = TrialSpec(model=resolve_model("micro-llama"), cluster=Cluster(num_gpus=2), seq_len=64,
                     train=TrainConfig(micro_batch_size=2, float8="tensorwise"))
    with SimBackend() as sim:
        result = sim.evaluate(spec)
    assert result.status == "ok", result.message
    float8 = result.extras["float8"]
    assert float8["source"] == "estimated" and "not fitted" in float8["basis"]
    assert float8["saved_s"] > 0 and float8["casts_s"] > 0
    assert result.throughput == pytest.approx(float8["high_precision_tokens_per_sec"] * float8["speedup"])
    # Rowwise: the same traced matmuls, at the rowwise GEMM rate, which is fitted (and says so). The
    # memory-bound bytes of both are the high-precision configuration's (their traces hold the casts too).
    with SimBackend() as sim:
        rowwise = sim.evaluate(spec.with_train(spec.train.with_(float8="rowwise")))
    assert 0 < rowwise.extras["float8"]["saved_s"] < float8["saved_s"]
    assert "fitted to torchao's published rowwise run" in rowwise.extras["float8"]["basis"]
    assert "eager high-precision twin" in result.extras["memory_bytes_from"]
    assert rowwise.extras["memory_bytes_from"] == result.extras["memory_bytes_from"]


FLOAT8_H200_RATIO_ERROR = {"bf16 mb4 float8:tensorwise": 0.88, "bf16 mb4 compile float8:tensorwise": 0.39,
                           "bf16 mb4 compile float8:rowwise": 0.23}
"""How far above the measured float8 / bf16 ratio the estimated one may be on llama3.2-1b, one H200 (estimated
ratio / measured ratio - 1). Issue 56's target is the right direction and within 10%; it is NOT met: these are
the figures of 2026-12-01, with the gathered weights' casts counted (costmodel.float8_gathered_weight_seconds):
+87.7%, +39.0%, +21.9% (+84.8%, +45.8%, +22.0% on 2026-11-28, before them: eager float8 loses its weight
operands' 33-byte casts, which the float8 all-gather makes unneeded, for the hook's 21-byte ones), so that a change
that worsens them fails."""

FLOAT8_PUBLISHED_POINTS = 0.05
"""Issue 56's target for the published 8B float8 ratios: within 5 points (met: 1.279 estimated against
torchtitan Table 1's 1.280 on 2026-12-01)."""


def test_float8_ratios_against_published_and_measured_rows():
    """The float8 over high-precision speed-up the estimate gives, against speed-ups it was not fitted to:
    torchtitan's published Llama 3.1 8B tensorwise run (Table 1: 8 H100s, seq 8192, local batch 2, selective
    AC, compiled: 8,532 / 6,667 tokens/s) and the real llama3.2-1b trials on one H200
    (benchmarks/results/gpu_check_h200_llama3.2-1b_seq2048_speed.json; not among FLOAT8_ONE_GPU_MEASURED's
    models). The eager float8 row is against eager bf16, the compiled ones against compiled bf16."""
    from pathlib import Path

    from autotune.backends.sim import SimBackend
    from autotune.problem.catalog.gpus import GPUS

    assert "llama3.2-1b" not in {model for model, *_ in costmodel.FLOAT8_ONE_GPU_MEASURED}
    report = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results" /
                         "gpu_check_h200_llama3.2-1b_seq2048_speed.json").read_text())
    measured = {row["label"]: row["measured_tokens_per_sec"] for row in report["rows"]}

    def h200(**knobs) -> TrialSpec:
        return TrialSpec(model=resolve_model("llama3.2-1b"), cluster=Cluster(num_gpus=1, gpu=GPUS["h200-141gb"]),
                         seq_len=2048, train=TrainConfig(micro_batch_size=4, **knobs), grad_accum_steps=2)

    def h100x8(**knobs) -> TrialSpec:
        return TrialSpec(model=resolve_model("llama3-8b"), cluster=Cluster(num_gpus=8, gpu=GPUS["h100-80gb"]),
                         seq_len=8192, train=TrainConfig(micro_batch_size=2, activation_checkpointing="op", **knobs))

    errors = {}
    with SimBackend() as sim:
        for label, knobs, base, base_label in (
                ("bf16 mb4 float8:tensorwise", dict(float8="tensorwise"), {}, "bf16 mb4"),
                ("bf16 mb4 compile float8:tensorwise", dict(compile="blocks", float8="tensorwise"),
                 dict(compile="blocks"), "bf16 mb4 compile"),
                ("bf16 mb4 compile float8:rowwise", dict(compile="blocks", float8="rowwise"),
                 dict(compile="blocks"), "bf16 mb4 compile")):
            estimated = sim.evaluate(h200(**knobs)).throughput / sim.evaluate(h200(**base)).throughput
            errors[label] = estimated / (measured[label] / measured[base_label]) - 1
        published = 8_532 / 6_667  # torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1
        estimated_8b = (sim.evaluate(h100x8(compile="blocks", float8="tensorwise")).throughput
                        / sim.evaluate(h100x8(compile="blocks")).throughput)
    print(errors, estimated_8b, published)
    assert abs(estimated_8b - published) <= FLOAT8_PUBLISHED_POINTS, (estimated_8b, published)
    for label, error in errors.items():
        assert abs(error) <= FLOAT8_H200_RATIO_ERROR[label], (label, error)


def test_a_calibrated_profile_costs_each_recipes_gemms_at_its_measured_rate():
    """calibrate times float8 GEMMs with both recipes' scales (an H200: tensorwise 1,149, rowwise 1,118
    TFLOP/s at llama3.2-1b's shapes, benchmarks/results/h200_calibrated_llama3.2-1b_float8.json); on that
    profile a rowwise configuration's converted matmuls take the rowwise rate, a tensorwise one's the
    tensorwise rate, the rest of the traced step alike."""
    from pathlib import Path

    from autotune.backends.sim import SimBackend
    from autotune.problem.catalog.gpus import GPUS
    from autotune.estimate.hardware import load_profile

    profile = load_profile(str(Path(__file__).resolve().parents[1] / "benchmarks" / "results" /
                               "h200_calibrated_llama3.2-1b_float8.json"))
    spec = TrialSpec(model=resolve_model("tiny-llama"), cluster=Cluster(num_gpus=1, gpu=GPUS["h200-141gb"]),
                     seq_len=1024, train=TrainConfig(micro_batch_size=8, compile="blocks"), grad_accum_steps=2)
    with SimBackend(hardware=profile) as sim:
        bf16, tensorwise, rowwise = (sim.evaluate(spec.with_train(spec.train.with_(float8=recipe))).extras
                                     for recipe in ("none", "tensorwise", "rowwise"))
    flops = tensorwise["op_work"]["float8_matmul_flops"] * spec.grad_accum_steps
    gap = rowwise["step_time"]["matmul_s"] - tensorwise["step_time"]["matmul_s"]
    expected = (flops / (profile["float8_rowwise_matmul_tflops"] * 1e12)
                - flops / (profile["float8_matmul_tflops"] * 1e12))
    assert gap == pytest.approx(expected, rel=1e-6) and gap > 0
    assert tensorwise["step_time"]["matmul_s"] < bf16["step_time"]["matmul_s"]


def test_fsdp2_script_applies_float8_in_parallelize(explored, tmp_path):
    result = json.loads(json.dumps(explored))
    result["float8"] = {"recipe": "tensorwise"}
    exported = export_result(result, "fsdp2")
    script = tmp_path / exported.filename
    script.write_text(exported.text)
    # TUNED goes to autotune's own parallelize() (apply_float8) and make_optimizer (the scale hook).
    assert runpy.run_path(str(script), run_name="fsdp2_export")["TUNED"].float8 == "tensorwise"
    for fmt in ("fsdp1", "accelerate", "hf-trainer", "litgpt"):
        warnings = export_result(result, fmt).warnings
        assert any(w.startswith("float8: unsupported") for w in warnings), (fmt, warnings)
