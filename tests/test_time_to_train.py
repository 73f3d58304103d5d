"""Time to train as runs see it (autotune/estimate/time_to_train.py) and its place in `autotune plan`: a hand
count of every loss term for a stated case, the properties the model must keep whatever its
constants (never below the benchmark time, more GPUs fail more often, the range holds the expected
figure, Young/Daly's interval beats its neighbours), the plan's new flags refusing bad input in one
line, and plan.json carrying the new figures beside the old ones."""

import json
import math
from pathlib import Path

import jsonschema
import pytest

from autotune.estimate import time_to_train as ttt
from autotune.drivers.cli import EXIT_OK, EXIT_USAGE, main
from autotune.util.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
PLAN_SCHEMA = json.loads((ROOT / "schemas" / "plan.schema.json").read_text())


def test_hand_count_of_the_loss_terms():
    """100 h of benchmark time on 80 GPUs (10 nodes), counted by hand: goodput 0.8 -> 125 h of
    compute; evaluation 2% -> 2.5 h; a save per hour -> 125 saves of 1.2 TB at 1 GB/s per node on 10
    nodes = 120 s each -> 15,000 s; start-up 1 h; failures at 1e-4 per GPU-hour on 80 GPUs = 0.008
    per wall-clock hour, each costing 15 min restart + 120 s reload + half an hour of lost work."""
    a = ttt.Assumptions(checkpoint_every_s=3600, write_bytes_per_s_per_node=1e9, failures_per_gpu_hour=1e-4,
                        restart_s=900, eval_fraction=0.02, startup_s=3600, goodput=0.8, goodput_range=(0.8, 0.8))
    result = ttt.expected_time(train_tokens=3.6e11, tokens_per_sec=1e6, gpus=80, nodes=10,
                               checkpoint_size_bytes=1.2e12, assumptions=a)
    base_h = 125 + 2.5 + 125 * 120 / 3600 + 1
    per_failure_h = 0.25 + 120 / 3600 + 0.5
    wall_h = base_h / (1 - 0.008 * per_failure_h)
    assert result["wall_s"] == pytest.approx(wall_h * 3600)
    assert result["gpu_hours"] == pytest.approx(wall_h * 80)
    terms = result["terms"]
    assert terms["benchmark_s"] == pytest.approx(100 * 3600)
    assert terms["checkpoint_saves"] == pytest.approx(125)
    assert result["checkpoint_write_s"] == pytest.approx(120)
    assert terms["checkpointing_s"] == pytest.approx(15_000)
    assert terms["evaluation_s"] == pytest.approx(2.5 * 3600)
    assert terms["failures"] == pytest.approx(0.008 * wall_h)
    assert terms["failure_loss_s"] == pytest.approx(0.008 * wall_h * per_failure_h * 3600)
    # The terms add up to the wall time.
    parts = (terms["benchmark_s"] + terms["goodput_loss_s"] + terms["evaluation_s"] + terms["checkpointing_s"]
             + terms["failure_loss_s"] + terms["startup_s"])
    assert parts == pytest.approx(result["wall_s"])


def test_a_given_write_time_replaces_the_bandwidth():
    a = ttt.Assumptions(checkpoint_every_s=3600, goodput=1.0, goodput_range=(1.0, 1.0), failures_per_gpu_hour=0,
                        eval_fraction=0, startup_s=0)
    result = ttt.expected_time(train_tokens=3.6e9, tokens_per_sec=1e5, gpus=8, checkpoint_size_bytes=1e15,
                               write_s=30, assumptions=a)
    assert result["checkpoint_write_s"] == 30 and result["checkpoint_write_basis"] == "given"
    assert result["wall_s"] == pytest.approx(36_000 + 10 * 30)


def test_the_default_failure_rate_is_llama3s():
    """419 unexpected interruptions in 54 days on 16,384 GPUs (Llama 3 §3.3.4)."""
    assert ttt.FAILURES_PER_GPU_HOUR == pytest.approx(419 / (16_384 * 54 * 24))
    assert 1.9e-5 < ttt.FAILURES_PER_GPU_HOUR < 2.0e-5


@pytest.mark.parametrize("gpus", [8, 64, 512, 4096, 16384])
@pytest.mark.parametrize("params", [1e9, 70e9, 405e9])
def test_expected_time_is_never_below_the_benchmark_time(gpus, params):
    tps = 400.0 * gpus
    result = ttt.expected_time(train_tokens=1e12, tokens_per_sec=tps, gpus=gpus,
                               checkpoint_size_bytes=ttt.checkpoint_bytes(params))
    assert result["wall_s"] >= 1e12 / tps
    low, high = result["wall_range_s"]
    assert low <= result["wall_s"] <= high


def test_more_gpus_fail_more_often_per_wall_clock_hour():
    rates = []
    for gpus in (64, 256, 1024, 4096, 16384):
        result = ttt.expected_time(train_tokens=1e12, tokens_per_sec=500.0 * gpus, gpus=gpus,
                                   checkpoint_size_bytes=ttt.checkpoint_bytes(8e9))
        rates.append(result["terms"]["failures"] / (result["wall_s"] / 3600))
        assert result["terms"]["failure_share"] < 1
    assert rates == sorted(rates) and rates[-1] > 100 * rates[0]


def test_the_range_carries_the_throughput_range():
    a = ttt.Assumptions(goodput_range=(ttt.FITTED_GOODPUT, ttt.FITTED_GOODPUT))
    plain = ttt.expected_time(train_tokens=1e12, tokens_per_sec=1e6, gpus=64, checkpoint_size_bytes=1e11, assumptions=a)
    ranged = ttt.expected_time(train_tokens=1e12, tokens_per_sec=1e6, gpus=64, checkpoint_size_bytes=1e11,
                               tokens_per_sec_range=(0.8e6, 1.25e6), assumptions=a)
    assert ranged["wall_s"] == plain["wall_s"]
    assert ranged["wall_range_s"][0] < plain["wall_range_s"][0] and ranged["wall_range_s"][1] > plain["wall_range_s"][1]


def test_young_daly_interval_beats_its_neighbours():
    """On 16,384 GPUs the default interval (sqrt(2 x write x MTBF), under an hour) loses less than
    saving twice as often or half as often."""
    common = dict(train_tokens=15e12, tokens_per_sec=16384 * 400.0, gpus=16384, checkpoint_size_bytes=4.9e12)
    auto = ttt.expected_time(**common)
    interval = auto["terms"]["checkpoint_every_s"]
    assert interval < ttt.CHECKPOINT_EVERY_MAX_S
    for factor in (0.5, 2.0):
        other = ttt.expected_time(**common, assumptions=ttt.Assumptions(checkpoint_every_s=interval * factor))
        assert other["wall_s"] > auto["wall_s"]


def test_a_run_whose_failures_take_all_its_time_never_finishes():
    a = ttt.Assumptions(failures_per_gpu_hour=1e-3, restart_s=3600)
    result = ttt.expected_time(train_tokens=1e12, tokens_per_sec=1e7, gpus=16384, checkpoint_size_bytes=1e12,
                               assumptions=a)
    assert math.isinf(result["wall_s"])


RUNS = json.loads((ROOT / "benchmarks" / "results" / "published_pretraining_runs.json").read_text())
BY_ID = {run["id"]: run for run in RUNS["runs"]}

# The published non-gated MLP widths (4 x hidden in each paper or card) of the rows given as llama-shaped
# stand-ins: BLOOM 57,344, MPT-7B 16,384, Falcon-180B 59,392, Pythia 12B 20,480 and 6.9B 16,384,
# StarCoderBase 24,576, BloombergGPT 30,720.
NON_GATED_MLP = {"bloom-176b": 57_344, "mpt-7b": 16_384, "falcon-180b": 59_392, "pythia-12b": 20_480,
                 "pythia-6.9b": 16_384, "starcoderbase-15b": 24_576, "bloomberggpt-50b": 30_720}


@pytest.mark.parametrize("run_id, width", sorted(NON_GATED_MLP.items()))
def test_stand_in_mlps_keep_the_published_width_and_split_as_the_runs_did(run_id, width):
    """A gated stand-in of width 2F/3 keeps the MLP's parameters, and is rounded to a multiple of 8 as the
    published widths are: an odd width would forbid the tensor parallelism these runs used (Falcon-180B's
    TP=8, BLOOM's TP4) in autotune's estimate of them."""
    config = BY_ID[run_id]["config"]
    assert width == 4 * config["hidden_size"]
    assert config["intermediate_size"] % 8 == 0
    assert abs(config["intermediate_size"] - 2 * width / 3) <= 4


def test_rows_flagged_as_step_counts_are_throughput_arithmetic():
    """LLaMA-65B's Table 15 GPU-hours are its §2.4 throughput (380 tokens/s/GPU on 2,048 GPUs over 1.4T
    tokens) to 0.2%: step time x steps, no restarts in it, so the benchmark compares it with the compute term
    alone. Every other row's figure is wall-clock (days x GPUs, or a total of GPU-hours)."""
    llama = BY_ID["llama-65b"]
    assert llama["published_counts"] == "steps"
    assert 1.4e12 / (380 * 2048) / 3600 * 2048 == pytest.approx(llama["published"]["gpu_hours"], rel=2e-3)
    assert {r["id"] for r in RUNS["runs"] if r.get("published_counts") == "steps"} == {
        "llama-65b", "pythia-12b", "pythia-6.9b"}


def test_falcon_row_carries_the_model_cards_batch():
    """tiiuae/falcon-180B model card: 'Batch size 2048', sequence length 2048, TP=8 PP=8 DP=64 on 4,096 A100s."""
    falcon = BY_ID["falcon-180b"]
    assert falcon["global_batch_tokens"] == 2048 * 2048 and falcon["seq_len"] == 2048
    assert falcon["gpus"] == 8 * 8 * 64


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("30m", 1800), ("1h", 3600), ("1.5h", 5400), ("2d", 172800),
                                           ("600", 600), (120, 120)])
def test_durations(text, seconds):
    assert ttt.parse_duration(text, what="x") == seconds


@pytest.mark.parametrize("text", ["soon", "-1h", "1 week", ""])
def test_bad_durations_are_usage_errors(text):
    with pytest.raises(UsageError):
        ttt.parse_duration(text, what="--startup")


PLAN = ["plan", "--model", "llama3.2-1b", "--train-tokens", "100G", "--gpus", "8", "--gpu-type", "h100-80gb",
        "--global-tokens", "4Mi", "--backend", "analytic", "--compile", "none", "--float8", "none"]

BAD_FLAGS = [
    (["--checkpoint-every", "soon"], "cannot parse --checkpoint-every"),
    (["--checkpoint-every", "0"], "--checkpoint-every must be a positive duration"),
    (["--checkpoint-write-bandwidth", "fast"], "cannot parse --checkpoint-write-bandwidth"),
    (["--checkpoint-write-bandwidth", "0"], "--checkpoint-write-bandwidth must be positive"),
    (["--failure-rate", "often"], "--failure-rate 'often' is not a number"),
    (["--failure-rate", "-1"], "--failure-rate '-1' is out of range"),
    (["--failure-rate", "nan"], "--failure-rate 'nan' is out of range"),
    (["--restart-time", "later"], "cannot parse --restart-time"),
    (["--eval-fraction", "1"], "--eval-fraction '1' is out of range"),
    (["--eval-fraction", "some"], "--eval-fraction 'some' is not a number"),
    (["--startup", "3weeks"], "cannot parse --startup"),
]


@pytest.mark.parametrize("extra, message", BAD_FLAGS, ids=[m for _, m in BAD_FLAGS])
def test_bad_time_to_train_flags_are_one_line(tmp_path, capsys, extra, message):
    assert main([*PLAN, *extra, "--runs-dir", str(tmp_path / "runs")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_plan_json_carries_the_expected_figures_beside_the_benchmark(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*PLAN, "--price", "h100-80gb=2.49", "--checkpoint-every", "30m", "--failure-rate", "40",
                 "--restart-time", "20m", "--eval-fraction", "0.02", "--startup", "2h",
                 "--checkpoint-write-bandwidth", "2GB", "--runs-dir", str(tmp_path / "runs"), "--out", str(out)]) == EXIT_OK
    plan = json.loads(out.read_text())
    jsonschema.validate(plan, PLAN_SCHEMA)
    assert plan["time_to_train_assumptions"] == {
        "checkpoint_every_s": 1800.0, "write_bytes_per_s_per_node": 2_000_000_000, "failures_per_gpu_hour": 4e-5,
        "restart_s": 1200.0, "eval_fraction": 0.02, "startup_s": 7200.0, "goodput": ttt.FITTED_GOODPUT,
        "goodput_range": list(ttt.FITTED_GOODPUT_RANGE)}
    (option,) = plan["options"]
    tps = option["tokens_per_sec"]["value"]
    # The benchmark figures are what they were: tokens / tokens/s, labelled as the benchmark's.
    assert option["time_to_train_s"]["value"] == pytest.approx(100e9 / tps)
    assert option["time_to_train_s"]["basis"].startswith("benchmark time:")
    assert option["gpu_hours"]["value"] == pytest.approx(100e9 / tps / 3600 * 8)
    wall, hours, cost = option["expected_time_to_train_s"], option["expected_gpu_hours"], option["expected_cost"]
    assert wall["source"] == hours["source"] == cost["source"] == "estimated"
    assert wall["value"] > option["time_to_train_s"]["value"]
    assert hours["value"] == pytest.approx(wall["value"] / 3600 * 8)
    assert cost["value"] == pytest.approx(hours["value"] * 2.49) and cost["price_per_gpu_hour"] == 2.49
    assert wall["range"][0] <= wall["value"] <= wall["range"][1]
    for term in ("goodput", "checkpoint saves", "failures", "Llama 3", "startup 2.0 h", "one per 30 min"):
        assert term in wall["basis"]
    # The same figures as the model computes for the winner's model and cluster.
    model = ttt.expected_time(train_tokens=100e9, tokens_per_sec=tps, gpus=8, nodes=1,
                              checkpoint_size_bytes=ttt.checkpoint_bytes(plan["model"]["parameters"]),
                              assumptions=ttt.with_overrides(checkpoint_every_s=1800, write_bytes_per_s_per_node=2e9,
                                                             failures_per_gpu_hour=4e-5, restart_s=1200,
                                                             eval_fraction=0.02, startup_s=7200))
    assert wall["value"] == pytest.approx(model["wall_s"])
    assert option["time_to_train_model"]["checkpoint_size_bytes"] == 12 * plan["model"]["parameters"]
    # The console shows the expected days beside the benchmark's, within 80 columns.
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.split()[:1] == ["option"])
    assert header.split()[:6] == ["option", "winner", "tok/s", "days", "exp", "GPU-h"]
    assert max(len(line) for line in lines if not line.startswith("•") and not line.startswith(" ")) <= 80


def test_a_plan_whose_failures_take_all_the_time_says_so(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*PLAN, "--failure-rate", "200000", "--restart-time", "1h", "--runs-dir", str(tmp_path / "runs"),
                 "--out", str(out)]) == EXIT_OK
    plan = json.loads(out.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in plan.json"))
    jsonschema.validate(plan, PLAN_SCHEMA)
    (option,) = plan["options"]
    assert option["expected_time_to_train_s"] is None and option["expected_gpu_hours"] is None
    assert "failures take all the time on 8 GPUs" in option["time_to_train_model"]["never_finishes"]
    assert option["time_to_train_s"]["value"] > 0  # the benchmark time is still given
    assert "never" in capsys.readouterr().out
