"""The knob registry by behaviour: every knob reaches the simulator's cache keys, the command line,
best.json and back, the study, and every exporter; old results still load."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autotune.util import cache
from autotune.problem import knobs
from autotune.backends.sim import SimBackend
from autotune.problem.catalog.models import resolve_model
from autotune.drivers.cli import EXIT_OK, EXIT_USAGE, main
from autotune.problem.config import Cluster, TrainConfig, TrialSpec
from autotune.problem.knobs import Checkpointing

TINY = ["--model", "tiny-llama", "--gpus", "4", "--global-tokens", "64K"]
MODEL_FOR = {"shard_placement": "tiny-mixtral", "expert_parallel": "tiny-mixtral"}
"""Knobs whose alternative changes only some models: a model where it does (2 experts on 4 GPUs)."""


def _spec(model: str = "tiny-llama", **changes) -> TrialSpec:
    return TrialSpec(model=resolve_model(model), cluster=Cluster(num_gpus=4), seq_len=256,
                     train=TrainConfig(**changes), grad_accum_steps=2)  # 2: a 1F1B pipeline of 2 stages can run it


def test_train_config_has_one_field_per_knob():
    assert set(f.name for f in dataclasses.fields(TrainConfig)) == set(knobs.BY_NAME)


@pytest.mark.parametrize("knob", knobs.KNOBS, ids=[k.name for k in knobs.KNOBS])
def test_every_knob_changes_the_simulators_cache_keys(knob):
    """A knob whose value changes must never reuse a prediction or a trace made for another value."""
    sim = SimBackend(device_kind="cpu")
    model = MODEL_FOR.get(knob.name, "tiny-llama")
    base, changed = _spec(model, **knob.alternative_with), _spec(model, **knob.alternative_with,
                                                                  **{knob.name: knob.alternative})
    assert changed.train != base.train
    assert (cache.key_of("sim-result", sim._cache_inputs(base))
            != cache.key_of("sim-result", sim._cache_inputs(changed)))
    keys = [sim._trace_key(s, depth=2, micro_batch_size=1, keep_middle=True) for s in (base, changed)]
    # Traced at the micro-batch asked; offload modelled; async TP's fused ops allocate what the unfused graph does
    # (its workspace is a runtime term: tests/test_async_tp.py).
    if knob.name not in ("micro_batch_size", "cpu_offload", "async_tensor_parallel"):
        assert keys[0] != keys[1]


@pytest.mark.parametrize("knob", knobs.KNOBS, ids=[k.name for k in knobs.KNOBS])
def test_every_knob_round_trips_through_the_cli_and_best_json(knob, tmp_path, capsys):
    """The flag reaches the trial; a best.json holding the value is re-evaluated with it."""
    value = knob.to_json(knob.alternative)
    flag = ([f"--{'no-' if not value else ''}{knob.flag[2:]}"] if knob.boolean else [knob.flag, str(value)])
    for name, needed in knob.alternative_with.items():
        flag += [knobs.BY_NAME[name].flag, str(knobs.BY_NAME[name].to_json(needed))]
    model = MODEL_FOR.get(knob.name, "tiny-llama")
    assert main(["trial", "--model", model, "--gpus", "4", "--backend", "analytic", *flag]) == EXIT_OK
    printed = json.loads(capsys.readouterr().out)["config"]
    assert printed[knob.name] == value
    assert TrainConfig.from_dict(printed) == TrainConfig(**knob.alternative_with, **{knob.name: knob.alternative})

    runs = tmp_path / "runs"
    # An eager winner: the knob's value is then the one change (expert parallelism refuses compile).
    assert main(["--model", model, *TINY[2:], "--backend", "analytic", "--compile", "none", "--runs-dir", str(runs),
                 "--json"]) == EXIT_OK
    document = json.loads(capsys.readouterr().out)
    node = document
    for part in knob.result_path[:-1]:
        node = node.setdefault(part, {})
    node[knob.result_path[-1]] = value
    if knob.name == "reshard_group_size":  # a group applies to a configuration that reshards
        document["fsdp"]["reshard_after_forward"] = True
    for name, needed in knob.alternative_with.items():
        node = document
        for part in knobs.BY_NAME[name].result_path[:-1]:
            node = node.setdefault(part, {})
        node[knobs.BY_NAME[name].result_path[-1]] = knobs.BY_NAME[name].to_json(needed)
    best = tmp_path / "best.json"
    best.write_text(json.dumps(document))
    assert main(["trial", "--config", str(best), "--backend", "analytic"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["config"][knob.name] == value


def test_a_result_from_before_the_new_knobs_loads(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert main([*TINY, "--backend", "analytic", "--runs-dir", str(runs), "--json"]) == EXIT_OK
    document = json.loads(capsys.readouterr().out)
    document["fsdp"].pop("shard_group_size")
    document.pop("optimizer")
    document["fsdp"]["activation_checkpointing"] = "every:2"
    train = TrainConfig.from_result(document)
    assert train.shard_group_size == 0 and train.optimizer_impl == "for-loop"  # what such runs ran
    assert train.activation_checkpointing == Checkpointing(mode="every", every=2)
    from autotune.results.export import export_result

    assert "HSDP" not in "".join(export_result(document, "fsdp2").warnings)


@pytest.mark.parametrize("argv, message", [
    (["--hsdp", "3"], "must divide the 4 GPUs per node"),
    (["--ac", "op:all"], "op:alt-mm"),
    (["--hsdp", "-1"], "shard group size must be 0"),
])
def test_bad_knob_values_are_one_line_usage_errors(argv, message, capsys):
    assert main(["trial", "--model", "tiny-llama", "--gpus", "4", "--backend", "analytic", *argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_study_parameters_keep_their_value_spaces_and_old_trials_match():
    """A study refuses a parameter whose distribution changes; resuming matches trials recorded
    before the new knobs existed (their identity has no shard_group_size)."""
    from autotune.search.records import config_key

    params, distributions = knobs.optuna_params(TrainConfig(activation_checkpointing="op:mm").knob_values())
    assert params["checkpoint_op_policy"] == "mm" and params["checkpoint_every"] == 0
    plain, _ = knobs.optuna_params(TrainConfig(activation_checkpointing="every:2").knob_values())
    assert plain["checkpoint_every"] == 2 and "checkpoint_op_policy" not in plain
    for name, dist in distributions.items():
        dist._contains(dist.to_internal_repr(params[name]))
    old = json.dumps({"precision": "bf16", "activation_checkpointing": "full", "cpu_offload": False,
                      "reshard_after_forward": True, "micro_batch_size": 2, "optimizer_impl": "fused",
                      "grad_accum_steps": 1, "backend": "sim"}, sort_keys=True)
    train = TrainConfig(activation_checkpointing="full", micro_batch_size=2)
    assert config_key(train, grad_accum_steps=1, backend="sim") == old
    assert config_key(train.with_(shard_group_size=2), grad_accum_steps=1, backend="sim") != old


def test_the_sampled_domains_follow_the_problem():
    from autotune.problem.knobs import Checkpointing, SampleContext, sample_domains

    # 4 layers: every:2 -> blocks {0, 2}, every:3 -> {0, 3}, every:4 and beyond -> {0}: three distinct.
    domains = sample_domains(SampleContext(precision="bf16", micro_batches=(1, 2, 4), num_layers=4,
                                           hsdp_groups=(8, 16)))
    assert domains["activation_checkpointing"] == (
        "none", "full", "every:2", "every:3", "every:4", "op", "op:mm")
    assert domains["precision"] == ("bf16",) and domains["micro_batch_size"] == (1, 2, 4)
    assert domains["shard_group_size"] == (0, 8, 16)
    assert set(domains["cpu_offload"]) == {False, True}
    narrow = sample_domains(SampleContext(precision="fp16", micro_batches=(1,), num_layers=4, checkpointing=False,
                                          offload=False, reshard=(True,)))
    assert narrow["activation_checkpointing"] == (Checkpointing(),) and narrow["cpu_offload"] == (False,)
    assert narrow["reshard_after_forward"] == (True,) and narrow["shard_group_size"] == (0,)
