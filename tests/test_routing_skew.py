"""MoE routing skew (issue 58): `--routing-skew` parsed once, the profile's rows per expert-parallel
rank, the simulator tracing the binding rank, and real gloo trials with a forced skewed router.

The real check: two MoE families (mixtral: 2 experts, top-1; qwen3_moe: 4 experts, top-2) with
expert parallelism over 2 gloo ranks, each under a stated skew. The real trial replaces the router's
top-k choices by the profile's (parallel.ExpertDispatch), so rank 0 receives the profile's larger
share from both ranks; the simulator traces that rank's all-to-all sizes under fake tensors. The
worst rank's measured tensor peak must match the prediction within 1%, and the ranks must differ
(the router was forced: under balanced routing the two ranks' peaks are equal). The trials run in
the session's shared 2-rank launch (tests/shared_runs.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from autotune.problem.catalog.models import ModelSpec, resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec
from autotune.util.errors import UsageError
from autotune.problem.routing import BALANCED, RoutingSkew, parse_routing_skew
from tests.shared_runs import register

SEQ_LEN = 128


def tiny_qwen3_moe() -> ModelSpec:
    """The qwen3_moe family at test size: 4 experts, top-2, every layer MoE."""
    return ModelSpec(name="tiny-qwen3-moe", model_type="qwen3_moe",
                     config_dict=dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=32, vocab_size=4000, max_position_embeddings=1024, num_experts=4,
                                      num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True),
                     default_seq_len=SEQ_LEN, source="tests/test_routing_skew.py (qwen3_moe, 4 experts, top-2)")


SKEWED = [(resolve_model("tiny-mixtral"), "capacity:1.5"), (tiny_qwen3_moe(), "zipf:1.2")]


def _skewed_specs(folder=None) -> list[TrialSpec]:
    return [TrialSpec(model=model, cluster=Cluster(num_gpus=2), seq_len=SEQ_LEN,
                      train=TrainConfig(micro_batch_size=2, expert_parallel=2), routing_skew=skew)
            for model, skew in SKEWED]


register("routing-skew", __name__, _skewed_specs)


# -- parsing ---------------------------------------------------------------------------------------
def test_the_values_parse_once_into_a_profile(tmp_path):
    assert parse_routing_skew(None) is BALANCED and parse_routing_skew("balanced").balanced
    assert parse_routing_skew("zipf:1.2") == RoutingSkew(kind="zipf", value=1.2)
    assert parse_routing_skew("capacity:1.5") == RoutingSkew(kind="capacity", value=1.5)
    histogram = tmp_path / "counts.txt"
    histogram.write_text("700, 100\n100 100\n")
    skew = parse_routing_skew(str(histogram))
    assert skew.kind == "histogram" and skew.counts == (700, 100, 100, 100)
    (tmp_path / "counts.json").write_text("[3, 1]")
    assert parse_routing_skew(str(tmp_path / "counts.json")).counts == (3, 1)
    assert RoutingSkew.from_dict(skew.to_dict()) == skew


@pytest.mark.parametrize("value, says", [
    ("zipf:0", "positive exponent"), ("zipf:x", "is not a number"), ("capacity:0.5", "at least 1"),
    ("hot", "is not balanced, zipf:S, capacity:C or a readable histogram"),
])
def test_a_bad_value_is_one_line_naming_the_flag(value, says):
    with pytest.raises(UsageError) as caught:
        parse_routing_skew(value)
    assert str(caught.value).startswith("--routing-skew ") and says in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_bad_histogram_and_a_dense_model_are_refused(tmp_path):
    (tmp_path / "bad.txt").write_text("1 -2")
    with pytest.raises(UsageError, match="non-negative token count"):
        parse_routing_skew(str(tmp_path / "bad.txt"))
    (tmp_path / "three.txt").write_text("5 1 1")
    with pytest.raises(UsageError, match="3 counts for the 2 experts of tiny-mixtral"):
        TrialSpec(model=resolve_model("tiny-mixtral"), cluster=Cluster(num_gpus=2), seq_len=SEQ_LEN,
                  train=TrainConfig(expert_parallel=2), routing_skew=str(tmp_path / "three.txt"))
    with pytest.raises(UsageError, match="tiny-llama has no routed experts"):
        TrialSpec(model=resolve_model("tiny-llama"), cluster=Cluster(num_gpus=2), seq_len=SEQ_LEN,
                  train=TrainConfig(), routing_skew="zipf:1")


def test_the_command_line_refuses_a_bad_skew_with_exit_2():
    from autotune.drivers.cli import EXIT_USAGE, main

    assert main(["trial", "--model", "tiny-mixtral", "--gpus", "2", "--backend", "analytic",
                 "--routing-skew", "capacity:0"]) == EXIT_USAGE


def test_the_library_refuses_it_as_the_command_line_does(tmp_path, capsys):
    import autotune
    from autotune.drivers.cli import EXIT_USAGE, main

    runs = tmp_path / "runs"
    with pytest.raises(UsageError) as raised:
        autotune.tune("tiny-mixtral", gpus=2, global_tokens="4Ki", runs_dir=str(runs), routing_skew="zipf:-1")
    assert main(["--model", "tiny-mixtral", "--gpus", "2", "--global-tokens", "4Ki", "--runs-dir", str(runs),
                 "--routing-skew=zipf:-1"]) == EXIT_USAGE
    assert capsys.readouterr().err == f"autotune: error: {raised.value}\n"
    assert "--routing-skew" in str(raised.value) and not runs.exists()


# -- the profile as rows ---------------------------------------------------------------------------
def test_rows_per_rank_and_the_binding_rank():
    zipf = RoutingSkew(kind="zipf", value=1.0)
    shares = zipf.expert_shares(4)  # 1, 1/2, 1/3, 1/4 normalised
    assert shares[0] == pytest.approx(12 / 25) and shares[3] == pytest.approx(3 / 25)
    assert zipf.rank_rows(1000, 4, 2) == [720, 280] and zipf.binding_rank(4, 2) == 0
    assert zipf.split_sizes(1000, 4, 2) == ([720, 280], [720, 720])  # the binding rank's send and receive
    capacity = RoutingSkew(kind="capacity", value=1.5)
    assert capacity.rank_rows(1000, 8, 4) == [375, 209, 208, 208]
    assert RoutingSkew(kind="capacity", value=9).rank_rows(10, 2, 2) == [10, 0]  # capped: all on one rank
    histogram = RoutingSkew(kind="histogram", counts=(1, 1, 6, 2), source="h")
    assert histogram.binding_rank(4, 2) == 1 and histogram.binding(4, 2)["experts"] == [2, 3]
    assert histogram.binding(4, 2)["load_vs_balanced"] == 1.6
    assert BALANCED.binding(4, 2)["binding_rank"] is None


def test_the_forced_router_routes_exactly_the_profiles_rows():
    """One function makes the rows: the real trial's forced top-k choices count to the same rows per
    expert as the simulator's split sizes."""
    for skew in (RoutingSkew(kind="zipf", value=1.2), RoutingSkew(kind="capacity", value=1.5)):
        ids = skew.forced_expert_ids(tokens=256, top_k=2, experts=4, ranks=2)
        assert len(ids) == 256 and all(len(choice) == 2 for choice in ids)
        counts = [sum(row.count(e) for row in ids) for e in range(4)]
        assert counts == skew.expert_rows(512, 4, 2)
        assert [counts[0] + counts[1], counts[2] + counts[3]] == skew.split_sizes(512, 4, 2)[0]


# -- the simulator and real runs -------------------------------------------------------------------
def test_the_simulator_traces_the_binding_rank_above_balanced(cpu_sim):
    spec = _skewed_specs()[0]
    skewed = cpu_sim.evaluate(spec).extras["tensor_peak_bytes"]
    balanced = cpu_sim.evaluate(dataclasses.replace(spec, routing_skew=BALANCED)).extras["tensor_peak_bytes"]
    assert skewed > balanced


@pytest.mark.slow
def test_the_worst_ranks_predicted_peak_matches_a_forced_skewed_router(gloo_runs):
    from tests.test_sim_accuracy import predict_cpu_runs

    specs, measured = gloo_runs.run("routing-skew")
    predicted = predict_cpu_runs(specs)
    for spec, real, sim in zip(specs, measured, predicted):
        assert real.status == "ok", real.message
        assert sim.status == "ok", sim.message
        ranks = real.extras["per_rank_tensor_peak_bytes"]
        worst, binding = real.extras["tensor_peak_bytes"], spec.routing_skew.binding_rank(spec.model.num_experts, 2)
        assert worst == ranks[binding] > min(ranks), ranks  # the forced router loaded the binding rank
        peak = sim.extras["tensor_peak_bytes"]
        print(f"{spec.model.name} {spec.routing_skew.label()}: predicted {peak:,} B, measured {worst:,} B "
              f"(ranks {ranks}), {(peak - worst) / worst:+.3%}")
        assert abs(peak - worst) <= 0.01 * worst, (spec.model.name, peak, worst)


def test_a_tune_names_the_assumption_and_the_binding_rank(tmp_path, capsys):
    """The tune under a stated skew: every trial predicted under it, best.json's `routing_skew` names
    it and the rank that binds at the winner's degree, and the console says so."""
    import json

    import jsonschema

    from autotune.drivers.cli import EXIT_OK, main
    from tests.test_cli import SCHEMA

    out = tmp_path / "best.json"
    assert main(["--model", "tiny-mixtral", "--gpus", "2", "--global-tokens", "4Ki", "--backend", "sim",
                 "--routing-skew", "capacity:2", "--max-trials", "6", "--runs-dir", str(tmp_path / "runs"),
                 "--out", str(out)]) == EXIT_OK
    document = json.loads(out.read_text())
    jsonschema.validate(document, SCHEMA)
    section = document["routing_skew"]
    assert section["kind"] == "capacity" and section["value"] == 2.0 and "capacity:2 assumed" in section["assumption"]
    assert section["expert_parallel"] == document["fsdp"]["expert_parallel"]
    if section["expert_parallel"] > 1:
        assert section["binding_rank"] == 0 and section["load_vs_balanced"] == 2.0
    assert any("routing skew capacity:2 assumed" in note and "the winner:" in note for note in document["notes"])
    said = " ".join(capsys.readouterr().out.split())
    assert "MoE routing: routing skew capacity:2 assumed" in said
