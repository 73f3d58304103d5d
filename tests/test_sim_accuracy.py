"""Accuracy contract of the simulator: its tensor peak equals a real gloo run's.

The session's shared torchrun launch of the real cpu backend (tests/shared_runs.py) runs a matrix of small real models (llama with
multi-head attention, qwen2 with grouped-query attention) over checkpointing none/full/every:2,
micro-batches 1-4 and reshard on/off at world size 2; the simulator, in its default mode
(depth- and micro-batch-extrapolated where it applies: the 6-block copies), predicts each.
Measured here: 4 bytes apart, the previous step's loss scalar (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses

import pytest

from autotune.backends.real import RealBackend
from autotune.backends.sim import SimBackend
from autotune.problem.catalog.models import ModelSpec, resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec
from tests.shared_runs import register

pytestmark = pytest.mark.slow

# (model, checkpointing, micro-batch, reshard after forward): every model meets every
# checkpointing mode, micro-batches 1-4 and both reshard settings.
# "@6": the model with 6 blocks, which the simulator traces at 3 and 4 and extrapolates.
MATRIX = [
    ("tiny-llama", "none", 1, True),
    ("tiny-llama", "full", 3, False),
    ("tiny-llama", "every:2", 2, True),
    ("tiny-llama@6", "full", 4, False),
    ("tiny-qwen2@6", "none", 2, False),
    ("tiny-qwen2", "full", 1, True),
    ("tiny-qwen2", "every:2", 3, False),
    ("tiny-qwen2", "full", 4, True),
    ("tiny-qwen2@6", "none", 4, False),  # after micro-batch 2: extrapolated from micro-batches 2 and 3
    # The other AdamW implementations (the rows above use the default, fused): each traced as it runs.
    ("tiny-llama", "full", 1, True, "foreach"),
    ("tiny-llama", "full", 1, True, "for-loop"),
]


def _model(name: str) -> ModelSpec:
    name, _, blocks = name.partition("@")
    model = resolve_model(name)
    if blocks:
        model = dataclasses.replace(model, config_dict={**model.config_dict, "num_hidden_layers": int(blocks)})
    return model


def _spec(model: str, ac: str, mb: int, reshard: bool, optimizer_impl: str = "fused") -> TrialSpec:
    return TrialSpec(model=_model(model), cluster=Cluster(num_gpus=2), seq_len=256,
                     train=TrainConfig(activation_checkpointing=ac, micro_batch_size=mb,
                                       reshard_after_forward=reshard, optimizer_impl=optimizer_impl))


def measure_and_predict(specs: list[TrialSpec]) -> tuple[list[TrialSpec], list, list]:
    """Every spec run for real (one launch of gloo ranks at the specs' world size) and simulated
    for that CPU run. Two steps: the second is the steady state (optimizer state exists), as the
    simulator predicts."""
    with RealBackend(device="cpu", warmup_steps=1, timed_steps=1) as real:
        measured = real.evaluate_many(specs)
    return specs, measured, predict_cpu_runs(specs)


def assert_tensor_peaks_agree(spec: TrialSpec, real, sim) -> None:
    assert real.status == "ok", real.message
    assert sim.status == "ok", sim.message
    real_peak = real.extras["tensor_peak_bytes"]
    sim_peak = sim.extras["tensor_peak_bytes"]
    assert real_peak > 0
    assert abs(sim_peak - real_peak) <= 0.01 * real_peak, (
        f"{spec.train.label()}: predicted {sim_peak:,} B, measured {real_peak:,} B")
    # With no runtime margin on a CPU run, the predicted figure is the tensor peak itself.
    assert sim.peak_bytes == sim_peak
    assert sim.peak_memory.source == "predicted"


def predict_cpu_runs(specs: list[TrialSpec]) -> list:
    """The simulator's prediction of each spec's CPU gloo run (default mode: extrapolated)."""
    with SimBackend(device_kind="cpu") as sim:
        return [sim.evaluate(spec) for spec in specs]


register("sim-accuracy", __name__, lambda folder: [_spec(*row) for row in MATRIX])


@pytest.fixture(scope="module")
def measured_and_predicted(gloo_runs):
    specs, measured = gloo_runs.run("sim-accuracy")  # the session's shared launch (tests/shared_runs.py)
    return specs, measured, predict_cpu_runs(specs)


@pytest.mark.parametrize("index", range(len(MATRIX)), ids=["-".join(map(str, row)) for row in MATRIX])
def test_tensor_peak_matches_a_real_gloo_run(measured_and_predicted, index):
    specs, measured, predicted = measured_and_predicted
    real, sim = measured[index], predicted[index]
    assert_tensor_peaks_agree(specs[index], real, sim)


def test_shallow_traces_were_extrapolated_where_the_model_allows(measured_and_predicted):
    _, _, predicted = measured_and_predicted
    # 6-block models are traced at 3 and 4 blocks; 4-block ones whole.
    for row, result in zip(MATRIX, predicted):
        assert result.extras["extrapolated"] is row[0].endswith("@6")
    qwen_grown = MATRIX.index(("tiny-qwen2@6", "none", 4, False))
    assert predicted[qwen_grown].extras["traced_layers"] == [3, 4]
    assert predicted[qwen_grown].extras["traced_micro_batches"] == [2, 3]
