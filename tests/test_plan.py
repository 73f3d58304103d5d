"""`autotune plan` and `--seq-len max`: each option against the tune command's own answer for the
same problem, shared traces against fresh ones, bad input as one line, plan.json against its schema."""

import json
from pathlib import Path

import jsonschema
import pytest

from autotune.drivers.cli import EXIT_NOTHING_FITS, EXIT_OK, EXIT_USAGE, main

ROOT = Path(__file__).resolve().parent.parent
PLAN_SCHEMA = json.loads((ROOT / "schemas" / "plan.schema.json").read_text())
RESULT_SCHEMA = json.loads((ROOT / "schemas" / "result.schema.json").read_text())

# What differs between two runs of the same problem without being an answer.
RUN_IDENTITY = ("run_id", "provenance", "study")


def _plan(tmp_path: Path, *argv: str) -> dict:
    """A plan, eager unless asked otherwise: these tests are about the plan, not compile's candidates
    (tests/test_compile.py; test_a_plan_option_explores_compile_as_tune_does below)."""
    eager = () if "--compile" in argv else ("--compile", "none", "--float8", "none")
    assert main(["plan", *argv, *eager, "--runs-dir", str(tmp_path / "runs")]) == EXIT_OK
    (path,) = (tmp_path / "runs").glob("plan-*/plan.json")
    plan = json.loads(path.read_text())
    jsonschema.validate(plan, PLAN_SCHEMA)
    return plan


def _answer(document: dict) -> dict:
    return {k: v for k, v in document.items() if k not in RUN_IDENTITY}


@pytest.fixture(scope="module")
def shared_plan(tmp_path_factory):
    """a100 first, so the h100 option of each GPU count runs on traces the a100 option made; 32 GPUs
    after 8 and 16, so some of its traces are derived from theirs (_world)."""
    tmp = tmp_path_factory.mktemp("plan")
    from autotune.backends.sim import _world
    from autotune.backends.sim._trace import Tracer

    traced: list[tuple] = []
    derived: list[int] = []
    original, original_derive = Tracer.trace, _world.derive

    def counting(self, model, **kwargs):
        traced.append((kwargs["world_size"], kwargs["depth"], kwargs["train"].cache_key()))
        return original(self, model, **kwargs)

    def counting_derive(first, w1, second, w2, w):
        trace = original_derive(first, w1, second, w2, w)
        if trace is not None:
            derived.append(w)
        return trace

    Tracer.trace, _world.derive = counting, counting_derive
    try:
        plan = _plan(tmp, "--model", "llama3.2-1b", "--train-tokens", "100G", "--gpus", "8..32",
                     "--gpu-type", "a100-80gb,h100-80gb", "--global-tokens", "4Mi", "--price", "h100-80gb=2.49",
                     "--jobs", "1")
    finally:
        Tracer.trace, _world.derive = original, original_derive
    return plan, (traced, derived), tmp


@pytest.mark.parametrize("gpus", [16, 32])
def test_option_equals_tune_on_fresh_traces(shared_plan, tmp_path, gpus):
    """The h100 rows (on traces the a100 option made; at 32 GPUs partly derived from the traces at 8
    and 16) are what `autotune tune` says for the same problem with traces of its own, figure for
    figure: every step of the decision path, the winner, its peak and tokens/s."""
    plan, _, _ = shared_plan
    option = next(o for o in plan["options"] if o["id"] == f"h100-80gbx{gpus}")
    fresh = tmp_path / "fresh"
    assert main(["--model", "llama3.2-1b", "--gpus", str(gpus), "--nodes", str(gpus // 8), "--gpu-type", "h100-80gb",
                 "--global-tokens", "4Mi", "--backend", "sim", "--compile", "none", "--float8", "none",
                 "--runs-dir", str(fresh),
                 "--out", str(tmp_path / "best.json")]) == EXIT_OK
    tuned = json.loads((tmp_path / "best.json").read_text())
    jsonschema.validate(option["result"], RESULT_SCHEMA)
    ours, theirs = _answer(option["result"]), _answer(tuned)
    if "derived exactly" in ours["memory_basis"]:  # says how the trace was made; every figure is the same
        ours["memory_basis"] = theirs["memory_basis"]
    assert ours == theirs
    assert option["tokens_per_sec"]["value"] == tuned["tokens_per_sec"]
    assert option["peak_memory_bytes"]["value"] == tuned["peak_memory_bytes"]


def test_options_share_traces(shared_plan):
    """Each (world size, depth, configuration) is traced once across GPU types: the a100 and h100
    options of a GPU count did not trace the same thing twice; and at 32 GPUs some traces were
    derived from those at 8 and 16 instead of traced."""
    _, (traced, derived), _ = shared_plan
    assert traced, "the plan traced nothing: the cache was on?"
    assert len(traced) == len(set(traced))
    assert {world for world, _, _ in traced} <= {8, 16, 32}
    assert derived and set(derived) == {32}


def test_derived_figures(shared_plan):
    """Time, GPU-hours and cost follow from tokens/s; cost only where a price was given; scaling
    efficiency is tokens/s per GPU against the type's smallest option."""
    plan, _, _ = shared_plan
    by_id = {o["id"]: o for o in plan["options"]}
    for option in plan["options"]:
        assert option["status"] == "ok"
        tps = option["result"]["tokens_per_sec"]
        assert option["time_to_train_s"]["value"] == pytest.approx(100e9 / tps)
        assert option["gpu_hours"]["value"] == pytest.approx(100e9 / tps / 3600 * option["gpus"])
        assert option["tokens_per_sec"]["source"] == option["result"]["throughput_source"] == "estimated"
        low, high = option["tokens_per_sec"]["range"]
        assert low < tps < high
        assert option["time_to_train_s"]["range"] == pytest.approx([100e9 / high, 100e9 / low])
        if option["gpu_type"] == "h100-80gb":
            assert option["cost"]["value"] == pytest.approx(option["gpu_hours"]["value"] * 2.49)
        else:
            assert option["cost"] is None
        base = by_id[f"{option['gpu_type']}x8"]["result"]["tokens_per_sec"] / 8
        assert option["scaling_efficiency"]["value"] == pytest.approx(tps / option["gpus"] / base)
        assert option["binds"]["limit"] in ("memory", "communication", "global batch", "search space")


def test_export_an_option(shared_plan, tmp_path):
    """`autotune export plan.json --option` writes what exporting the option's own best.json writes."""
    plan, _, tmp = shared_plan
    (path,) = (tmp / "runs").glob("plan-*/plan.json")
    option = next(o for o in plan["options"] if o["id"] == "h100-80gbx16")
    assert main(["export", str(path), "--option", "h100-80gbx16", "--format", "fsdp2",
                 "--out-dir", str(tmp_path / "a")]) == EXIT_OK
    assert main(["export", str(Path(option["run_dir"]) / "best.json"), "--format", "fsdp2",
                 "--out-dir", str(tmp_path / "b")]) == EXIT_OK
    written = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert written and written == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in written:
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()


def test_console_table_reads_at_80_columns(shared_plan, capsys):
    from autotune.results.console import Console

    plan, _, _ = shared_plan
    Console().plan_table(plan)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + len(plan["options"])
    assert max(len(line.rstrip()) for line in lines) <= 80


def test_schema_describes_the_expected_time_to_train(shared_plan):
    """plan.json's expected wall-clock, GPU-hours and cost (with what runs lose), the model behind them and its
    assumptions are in the schema: each described as an estimate, every term and assumption the plan writes named,
    and a wrong value refused where the schema once let anything through."""
    import copy

    plan, _, _ = shared_plan
    jsonschema.validate(plan, PLAN_SCHEMA)
    defs, option_schema = PLAN_SCHEMA["$defs"], PLAN_SCHEMA["$defs"]["option"]["properties"]
    for key in ("expected_time_to_train_s", "expected_gpu_hours", "expected_cost"):
        assert option_schema[key]["$ref"] == "#/$defs/figure"
        assert option_schema[key]["description"].startswith("estimated: ")
    assert "estimated" in defs["time_to_train_model"]["description"]
    assert "time_to_train_assumptions" in PLAN_SCHEMA["required"]
    assumptions = defs["assumptions"]["properties"]
    assert set(plan["time_to_train_assumptions"]) == set(assumptions) == set(defs["assumptions"]["required"])
    terms = defs["time_to_train_model"]["properties"]["terms"]["properties"]
    for option in plan["options"]:
        model = option["time_to_train_model"]
        assert set(model["terms"]) == set(terms) and set(model["assumptions"]) == set(assumptions)
        assert all(terms[name].get("description") for name in terms)
        wall, hours = option["expected_time_to_train_s"], option["expected_gpu_hours"]
        assert wall["source"] == hours["source"] == "estimated"
        assert wall["value"] > option["time_to_train_s"]["value"]  # what runs lose comes on top
        assert hours["value"] == pytest.approx(wall["value"] / 3600 * option["gpus"])
        priced = option["gpu_type"] == "h100-80gb"
        assert (option["expected_cost"] is not None) == priced
        if priced:
            assert option["expected_cost"]["value"] == pytest.approx(hours["value"] * 2.49)
    wrong = [("expected_gpu_hours", "lots"), ("expected_cost", {"value": 1.0}),
             ("time_to_train_model", {"terms": {}}), ("expected_time_to_train_s", {**wall, "source": "guessed"})]
    for key, value in wrong:
        broken = copy.deepcopy(plan)
        broken["options"][0][key] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, PLAN_SCHEMA)
    broken = copy.deepcopy(plan)
    broken["time_to_train_assumptions"]["goodput_range"] = [0.5]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, PLAN_SCHEMA)


def test_each_options_configuration_says_its_parallel_degrees(shared_plan):
    """An option's configuration names the winner's tensor, context and pipeline degrees and schedule: the ones
    the winner's own result rebuilds into (TrainConfig.from_result), so a reader comparing options need not dig."""
    from autotune.problem.config import TrainConfig

    plan, _, _ = shared_plan
    answered = [option for option in plan["options"] if option["status"] == "ok"]
    assert answered
    for option in answered:
        train = TrainConfig.from_result(option["result"])
        said = option["configuration"]
        assert (said["tensor_parallel"], said["context_parallel"], said["pipeline_parallel"],
                said["pipeline_schedule"]) == (train.tensor_parallel, train.context_parallel, train.pipeline_parallel,
                                               train.pipeline_schedule)
        assert (said["micro_batch_size"], said["grad_accum_steps"]) == (train.micro_batch_size,
                                                                       option["result"]["grad_accum_steps"])


def test_the_plan_report_says_a_pipeline_winners_degrees(shared_plan):
    """plan.html's winner column names the parallel degrees and schedule of the option's configuration (built
    from its result as plan.json's is), where the degree is past 1."""
    import copy

    from autotune.drivers.plan import _configuration
    from autotune.results.report import render_plan

    plan, _, _ = shared_plan
    option = _pipeline_winner(next(o for o in plan["options"] if o["status"] == "ok"))
    option["configuration"] = _configuration(option["result"])
    page = render_plan({**copy.deepcopy(plan), "options": [option]})
    assert "tp 4" in page and "pp 8 1F1B" in page and "cp 1" not in page


def _pipeline_winner(option: dict) -> dict:
    """`option` (a plan's, with a winner) with a long pipeline winner in its place, as a large plan's row has
    (tp 4 x pp 8, 1F1B over 16 micro-batches of 2, activation offload, HSDP over 8, compiled, float8)."""
    import copy

    option = copy.deepcopy(option)
    result = option["result"]
    result["parallelism"].update(tensor_parallel=4, pipeline_parallel=8, pipeline_schedule="1F1B")
    result["micro_batch_size"], result["grad_accum_steps"] = 2, 16
    result["fsdp"].update(activation_checkpointing="full", activation_offload=True, shard_group_size=8)
    result["compile"]["mode"] = "blocks"
    result["float8"] = {**(result.get("float8") or {}), "recipe": "rowwise"}
    option["configuration"].update(micro_batch_size=2, grad_accum_steps=16)
    option["id"] = "h100-80gbx16384"
    return option


@pytest.mark.parametrize("width", [80, 120])
def test_console_table_says_a_long_pipeline_winner_in_full(shared_plan, width):
    """A large plan's pipeline winner is longer than the table's winner cell at 80 columns: under the table, the
    winner in full (tensor and pipeline degree, schedule, micro-batch, accumulation), within the width; a row that
    fits and runs no pipeline gets no such line."""
    import io

    from rich.console import Console as RichConsole

    from autotune.problem.config import TrainConfig
    from autotune.results.console import Console

    plan, _, _ = shared_plan
    winner = _pipeline_winner(plan["options"][0])
    train = TrainConfig.from_result(winner["result"])
    assert (train.tensor_parallel, train.pipeline_parallel, train.micro_batch_size) == (4, 8, 2)
    long_plan = {**plan, "options": [winner, *plan["options"][1:]]}
    jsonschema.validate(long_plan, PLAN_SCHEMA)
    console = Console()
    console.out = RichConsole(file=io.StringIO(), width=width, highlight=False)
    console.plan_table(long_plan)
    text = console.out.file.getvalue()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    assert len(lines) > 2 + len(plan["options"])  # the winner in full under the table
    said = " ".join(line.strip() for line in lines[2 + len(plan["options"]):])
    assert said.startswith("• h100-80gbx16384 winner: ")
    for part in ("mb=2", "ac=full", "act-offload", "hsdp=8", "tp=4", "pp=8", "schedule=1F1B", "accum=16",
                 "compile=blocks", "float8=rowwise", "16 micro-batches a step"):
        assert part in said, part
    assert all(f"• {option['id']} winner:" not in said for option in plan["options"][1:])


def test_global_batch_binds_where_it_cannot_be_kept(tmp_path, capsys):
    """4Mi tokens at seq 8192 is half a sequence per GPU on 1024 GPUs: FSDP alone cannot keep it, a
    tensor-parallel group (or a pipeline) sharing each sequence can, and the plan's row (and tune) goes past it
    split; 256Ki tokens is 32 sequences, fewer than any one split's data ranks (pp=16: 64), which only pipeline
    stages over tensor-parallel groups keep (tp 8 x pp 4: 32), a search the default space leaves out: that row
    says the global batch binds and how to search them, and the plan goes on with the others; 32Ki tokens (4
    sequences) is fewer than even tp 8 x pp 16's 8 data ranks: refused up front."""
    plan = _plan(tmp_path, "--model", "llama3-8b", "--train-tokens", "1T", "--gpus", "256,1024",
                 "--global-tokens", "4Mi", "--backend", "analytic")
    rows = {o["gpus"]: o for o in plan["options"]}
    split = rows[1024]["result"]["parallelism"]
    assert rows[1024]["status"] == "ok" and split["tensor_parallel"] * split.get("pipeline_parallel", 1) > 1
    assert rows[1024]["result"]["global_tokens"] == 4 * 2**20
    assert main(["--model", "llama3-8b", "--gpus", "1024", "--nodes", "128", "--global-tokens", "4Mi",
                 "--backend", "analytic", "--runs-dir", str(tmp_path / "t")]) == EXIT_OK
    # 256 GPUs: 2 sequences per GPU at most, whatever memory allows
    assert rows[256]["status"] == "ok"
    if rows[256]["result"]["micro_batch_size"] == 2:
        assert rows[256]["binds"]["limit"] in ("global batch", "communication")
    small = {o["gpus"]: o for o in _plan(tmp_path / "small", "--model", "llama3-8b", "--train-tokens", "1T",
                                          "--gpus", "256,1024", "--global-tokens", "256Ki",
                                          "--backend", "analytic")["options"]}
    assert small[1024]["status"] == "global-batch" and small[1024]["binds"]["limit"] == "global batch"
    assert "explore.pipeline_parallel = true" in small[1024]["message"]
    assert small[256]["status"] == "ok"
    assert main(["--model", "llama3-8b", "--gpus", "1024", "--nodes", "128", "--global-tokens", "256Ki",
                 "--backend", "analytic", "--runs-dir", str(tmp_path / "t2")]) == EXIT_NOTHING_FITS
    capsys.readouterr()
    assert main(["--model", "llama3-8b", "--gpus", "1024", "--nodes", "128", "--global-tokens", "32Ki",
                 "--backend", "analytic", "--runs-dir", str(tmp_path / "t3")]) == EXIT_USAGE
    assert "8 data ranks (1024 GPUs / tensor parallel 8 x pipeline parallel 16)" in capsys.readouterr().err


def test_pipeline_stages_over_tensor_parallel_groups_keep_a_batch_neither_keeps_alone(tmp_path, capsys):
    """llama3-70b on 1024 GPUs with 512Ki tokens at seq 8192 is 64 sequences a step: tensor or context
    parallelism (8 GPUs of a node at most) leaves 128 groups each needing a sequence, so the default search finds
    nothing and says it is the global batch (not memory) that binds, naming the space key that lets pipelines
    share sequences. With pipelines searched, stages over tensor-parallel groups (FSDP x TP x PP, with context
    parallelism within them where it wins) keep it: the winner's data ranks x accumulation x micro-batch x seq,
    counted from its degrees, is the target exactly, and the console says the data ranks the splits leave."""
    problem = ["--model", "llama3-70b", "--gpus", "1024", "--nodes", "128", "--seq-len", "8192", "--global-tokens",
               "512Ki", "--backend", "analytic", *EAGER]
    assert main([*problem, "--runs-dir", str(tmp_path / "fsdp-tp")]) == EXIT_NOTHING_FITS
    said = " ".join(capsys.readouterr().err.split())
    assert "no configuration keeps the global batch" in said and "explore.pipeline_parallel = true" in said
    assert "fits within" not in said  # not a memory limit
    space, out = tmp_path / "pp.toml", tmp_path / "best.json"
    space.write_text("[explore]\npipeline_parallel = true\n")
    assert main([*problem, "--space", str(space), "--runs-dir", str(tmp_path / "runs"), "--out", str(out)]) == EXIT_OK
    best = json.loads(out.read_text())
    tp, cp, pp = (best["parallelism"][f"{split}_parallel"] for split in ("tensor", "context", "pipeline"))
    assert tp > 1 and pp > 1  # with context parallelism too where the estimate puts the three together first
    data_ranks = 1024 // (tp * cp * pp)
    assert data_ranks * best["grad_accum_steps"] * best["micro_batch_size"] * 8192 == 512 * 2**10 == best["global_tokens"]
    printed = " ".join(capsys.readouterr().out.split())
    splits = " x ".join(f"{name} parallel {degree}" for name, degree in (("tensor", tp), ("context", cp),
                                                                         ("pipeline", pp)) if degree > 1)
    assert f"{data_ranks} data ranks (1024 GPUs / {splits})" in printed
    # Counted apart from the search: every layout of tensor (2-8), context (1, 2) and pipeline (2, 4, 8) splits
    # that keeps the batch at micro-batch 1, no checkpointing and kept gathered after forward (what the winners of
    # such meshes run), each a trial of its own on the same closed form: none that fits is faster than the winner.
    trial = ["trial", *problem[:8], "--backend", "analytic", "--micro-batch", "1", "--ac", "none", "--no-reshard",
             "--compile", "none", "--pp-schedule", "Interleaved1F1B"]
    fastest = 0.0
    for tp_, cp_, pp_ in ((t, c, p) for t in (2, 4, 8) for c in (1, 2) for p in (2, 4, 8) if t * c <= 8):
        if (tp_ * cp_ * pp_) % 16:
            continue  # 64 sequences a step over 1024 GPUs: a data rank per 16 GPUs at most
        capsys.readouterr()
        if main([*trial, "--tp", str(tp_), "--cp", str(cp_), "--pp", str(pp_),
                 "--grad-accum", str(tp_ * cp_ * pp_ // 16)]) != EXIT_OK:
            continue  # refused (a schedule's micro-batches): not a configuration
        result = json.loads(capsys.readouterr().out)
        if result["status"] == "ok" and result["fits"]:
            fastest = max(fastest, result["tokens_per_sec"]["value"])
    assert fastest > 0 and best["tokens_per_sec"] >= fastest * 0.999


BAD_PLANS = [
    (["--gpus", "8..x"], "is not a GPU count"),
    (["--gpus", "16..8"], "runs backwards"),
    (["--gpus", "12"], "not a whole number of nodes of 8 GPUs a node (the default)"),
    (["--gpu-type", "h100"], "did you mean h100-80gb"),
    (["--price", "a100-80gb=1.5"], "not in --gpu-type"),
    (["--price", "h100-80gb=cheap"], "is not a number"),
    (["--train-tokens", "lots"], "cannot parse --train-tokens"),
    (["--seq-len", "max", "--seq-len-step", "0"], "must be a positive integer"),
]


@pytest.mark.parametrize("extra, message", BAD_PLANS, ids=[m for _, m in BAD_PLANS])
def test_bad_plan_input_is_one_line(tmp_path, capsys, extra, message):
    argv = {"--model": "llama3-8b", "--train-tokens": "1T", "--gpus": "8", "--gpu-type": "h100-80gb",
            "--global-tokens": "4Mi"}
    for flag, value in zip(extra[::2], extra[1::2]):
        argv[flag] = value
    args = [x for pair in argv.items() for x in pair]
    assert main(["plan", *args, "--runs-dir", str(tmp_path / "runs")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def _trial(capsys, *argv: str) -> dict:
    """`autotune trial` on the sim backend: a fresh backend, fresh traces (the cache is off in tests)."""
    capsys.readouterr()
    assert main(["trial", "--backend", "sim", *argv]) == EXIT_OK
    return json.loads(capsys.readouterr().out)


EAGER = ("--compile", "none", "--float8", "none")
"""The length search is the point of these tests, not compile's candidates at the answer (the tune at it
would trace them: 46 s more on llama3-8b); tests/test_compile.py has those."""


def test_seq_len_max_is_the_longest_that_fits(tmp_path, capsys):
    """llama3.2-1b (131,072 positions) on 8 x h100 with FSDP alone: the answer fits by a fresh trace of its
    winner, and one step up the most memory-saving configuration the graph has (full checkpointing and
    CPU offload, micro-batch 1) does not fit by a fresh trace. With context parallelism in the search (the
    default), the answer is the model's whole 131,072 positions, each sequence split over a node's GPUs."""
    from autotune.drivers.seqlen import global_tokens_at

    step = 8192
    out, fsdp_only = tmp_path / "best.json", tmp_path / "fsdp-only.toml"
    fsdp_only.write_text("[explore]\ntensor_parallel = false\ncontext_parallel = false\n")
    problem = ["--model", "llama3.2-1b", "--gpus", "8", "--gpu-type", "h100-80gb", "--global-tokens", "4Mi",
               "--backend", "sim", "--seq-len", "max", "--seq-len-step", str(step), *EAGER]
    assert main([*problem, "--runs-dir", str(tmp_path / "cp-runs"), "--out", str(tmp_path / "cp.json")]) == EXIT_OK
    split = json.loads((tmp_path / "cp.json").read_text())
    assert split["seq_len"] == 131072 and split["parallelism"]["context_parallel"] > 1
    capsys.readouterr()
    assert main([*problem, "--space", str(fsdp_only), "--runs-dir", str(tmp_path / "runs"), "--out", str(out)]) == EXIT_OK
    printed = " ".join(capsys.readouterr().out.split())  # the console wraps at words
    assert "throughput vs sequence length" in printed
    best = json.loads(out.read_text())
    length = best["seq_len"]
    assert length % step == 0 and length < 131072 and f"memory: {length + step} does not fit" in printed
    fits = _trial(capsys, "--config", str(out))
    assert fits["fits"] and fits["peak_memory"]["value"] <= fits["memory_limit_bytes"]
    above = length + step
    accum = global_tokens_at(4 * 2**20, gpus=8, seq_len=above) // (8 * above)
    over = _trial(capsys, "--model", "llama3.2-1b", "--gpus", "8", "--gpu-type", "h100-80gb", "--seq-len", str(above),
                  "--micro-batch", "1", "--grad-accum", str(accum), "--ac", "full", "--offload")
    assert not over["fits"]


def test_seq_len_max_stops_at_the_models_positions(tmp_path, capsys):
    """llama3-8b on 8 x h100 fits its 8,192 positions (by a fresh trace of the winner); tune itself
    refuses the next step up as longer than the model supports."""
    out = tmp_path / "best.json"
    assert main(["--model", "llama3-8b", "--gpus", "8", "--gpu-type", "h100-80gb", "--global-tokens", "4Mi",
                 "--backend", "sim", "--seq-len", "max", *EAGER, "--runs-dir", str(tmp_path / "runs"),
                 "--out", str(out)]) == EXIT_OK
    printed = " ".join(capsys.readouterr().out.split())  # the console wraps at words
    assert "the model's positions (8192)" in printed
    assert json.loads(out.read_text())["seq_len"] == 8192
    assert _trial(capsys, "--config", str(out))["fits"]
    assert main(["--model", "llama3-8b", "--gpus", "8", "--global-tokens", "4Mi", "--backend", "sim",
                 "--seq-len", str(8192 + 1024), "--runs-dir", str(tmp_path / "r2")]) == EXIT_USAGE
    assert "longer than llama3-8b supports" in capsys.readouterr().err


def test_plan_report_renders_in_headless_chromium(shared_plan, tmp_path):
    import os
    import re
    import shutil

    from tests.test_report import _browser, _chromium

    browser = _browser()
    _, _, tmp = shared_plan
    (page,) = (tmp / "runs").glob("plan-*/plan.html")
    dom = _chromium(browser, "--virtual-time-budget=3000", "--dump-dom", page.resolve().as_uri())
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert 'data-rendered="ok"' in body and 'data-charts="4"' in body and "data-js-errors" not in body, body
    shot = tmp_path / "plan.png"
    _chromium(browser, "--window-size=1280,2400", "--hide-scrollbars", f"--screenshot={shot}", page.resolve().as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    if os.environ.get("AUTOTUNE_UPDATE_SCREENSHOT"):  # refresh docs/plan_report.png from this run
        shutil.copyfile(shot, ROOT / "docs" / "plan_report.png")


def test_plan_seq_len_max_is_tunes_answer_on_the_smallest_option(tmp_path, capsys):
    """plan --seq-len max plans every option at the length tune --seq-len max finds on the smallest."""
    plan = _plan(tmp_path, "--model", "llama3.2-1b", "--train-tokens", "1T", "--gpus", "8,16",
                 "--global-tokens", "4Mi", "--backend", "analytic", "--seq-len", "max", "--seq-len-step", "16384")
    out = tmp_path / "best.json"
    assert main(["--model", "llama3.2-1b", "--gpus", "8", "--gpu-type", "h100-80gb", "--global-tokens", "4Mi",
                 "--backend", "analytic", "--seq-len", "max", "--seq-len-step", "16384",
                 "--runs-dir", str(tmp_path / "tune"), "--out", str(out)]) == EXIT_OK
    length = json.loads(out.read_text())["seq_len"]
    assert plan["sequence_length"]["max_seq_len"] == plan["seq_len"] == length
    assert {o["seq_len"] for o in plan["options"]} == {length}
    probes = plan["sequence_length"]["by_gpu_type"]["h100-80gb"]["probes"]
    assert [p["seq_len"] for p in probes if p["fits"]][-1] == length


def test_parallel_processes_give_the_same_plan(tmp_path):
    """--jobs 2 (a process per GPU count) and --jobs 1 (one after another) plan the same winners
    and figures."""
    argv = ("--model", "llama3.2-1b", "--train-tokens", "1T", "--gpus", "8,16", "--gpu-type", "h100-80gb,a100-80gb",
            "--global-tokens", "4Mi", "--backend", "analytic")
    one = _plan(tmp_path / "one", *argv, "--jobs", "1")
    two = _plan(tmp_path / "two", *argv, "--jobs", "2")
    assert [o["id"] for o in one["options"]] == [o["id"] for o in two["options"]]
    for a, b in zip(one["options"], two["options"]):
        assert _answer(a["result"]) == _answer(b["result"])
        assert a["tokens_per_sec"] == b["tokens_per_sec"] and a["binds"] == b["binds"]


def test_parallel_processes_derive_as_one_process_does(shared_plan, tmp_path):
    """--jobs 2 on the sim backend (a process per GPU count, 8 and 16 first, then 32 deriving from
    the traces they left in the folder the processes share) plans what --jobs 1 planned: every
    option's whole result but the run's identity, its basis included (32 GPUs: derived)."""
    plan, _, _ = shared_plan
    parallel = _plan(tmp_path, "--model", "llama3.2-1b", "--train-tokens", "100G", "--gpus", "8..32",
                     "--gpu-type", "a100-80gb,h100-80gb", "--global-tokens", "4Mi", "--price", "h100-80gb=2.49",
                     "--jobs", "2")
    assert [o["id"] for o in parallel["options"]] == [o["id"] for o in plan["options"]]
    for one, two in zip(plan["options"], parallel["options"]):
        assert _answer(one["result"]) == _answer(two["result"])
        for figure in ("tokens_per_sec", "time_to_train_s", "gpu_hours", "cost", "scaling_efficiency", "binds"):
            assert one[figure] == two[figure]
    assert any("derived exactly" in o["result"]["memory_basis"] for o in parallel["options"] if o["gpus"] == 32)


def test_export_from_a_plan_needs_a_known_option(shared_plan, tmp_path, capsys):
    _, _, tmp = shared_plan
    (path,) = (tmp / "runs").glob("plan-*/plan.json")
    for argv, message in (([], "choose an option with --option, one of a100-80gbx8"),
                          (["--option", "h100-80gbx64"], "no option 'h100-80gbx64' in the plan")):
        capsys.readouterr()
        assert main(["export", str(path), *argv, "--format", "fsdp2", "--out-dir", str(tmp_path)]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def _trace_spec(gpus: int, train, model: str = "llama3.2-1b", target_tokens: int = 4 * 2**20):
    from autotune.drivers.api import resolve_problem
    from autotune.problem.options import TuneOptions
    from autotune.search.records import TuneRequest
    from autotune.search.space import load_space

    options = TuneOptions(model=model, gpus=gpus, nodes=max(1, gpus // 8), global_tokens="4Mi", gpu_type="h100-80gb")
    model_spec, cluster, seq_len, _ = resolve_problem(options)
    request = TuneRequest(model=model_spec, cluster=cluster, seq_len=seq_len, target_tokens=target_tokens,
                          space=load_space(None))
    return request.spec(train)


def _fields(trace) -> dict:
    return {"sites": {key: {ref: n for ref, n in cats.items() if n} for key, cats in trace.sites.items()},
            "flops": trace.flops, "tensor_peak_bytes": trace.tensor_peak_bytes, "op_work": trace.op_work,
            "pinned": trace.pinned_param_bytes, "largest": trace.largest_allocation_bytes,
            "params": (trace.block_params, trace.root_params), "depth": trace.depth}


# llama3-70b's shape scaled down 32 times (hidden and sequence 256, vocabulary 4,096, untied
# embeddings): as in llama3-70b, the root's pre-backward site, reached twice, peaks at its first
# occurrence at 4 and 8 GPUs and at its second from 16 GPUs on.
SCALED_70B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
              "intermediate_size": 896, "num_attention_heads": 8, "num_key_value_heads": 1, "num_hidden_layers": 8,
              "vocab_size": 4096, "max_position_embeddings": 256, "tie_word_embeddings": False}

DERIVED = [("full", 1, {}, (8, 16, 32), None), ("none", 2, {}, (8, 16, 32), None),
           ("full", 1, {"shard_group_size": 8}, (16, 64), None),
           ("full", 1, {"reshard_group_size": 8}, (16, 32, 64), None),
           ("full", 1, {}, (4, 8, 16), SCALED_70B)]


@pytest.mark.parametrize("ac, micro, knobs, worlds, config_json", DERIVED,
                         ids=["full", "none-mb2", "hsdp8", "reshard8", "peak-moves"])
def test_a_trace_derived_from_two_world_sizes_equals_a_fresh_trace(ac, micro, knobs, worlds, config_json, tmp_path):
    """What plan reuses across GPU counts: the trace at the last world size derived from those at
    the others is the fresh trace there, site by site and category by category (and FLOPs, op
    work, pinned bytes): for plain FSDP and resharding to a node from two world sizes; for HSDP
    within a node from one (nothing is sharded over all ranks); and where a site reached twice
    peaks at another occurrence at the third world size than at the first two (the largest of two
    affine functions is not affine: derived per occurrence)."""
    from autotune.backends.sim._backend import SimBackend
    from autotune.problem.config import TrainConfig

    model = "llama3.2-1b"
    if config_json:
        model = str(tmp_path / "config.json")
        Path(model).write_text(json.dumps(config_json))
    config = TrainConfig(activation_checkpointing=ac, micro_batch_size=micro, **knobs)
    *traced, third = worlds
    deriving = SimBackend(derive_world_sizes=True)
    try:
        bases = [deriving._trace(_trace_spec(gpus, config, model), depth=3, micro_batch_size=config.micro_batch_size,
                                 keep_middle=False) for gpus in traced]
        assert not any(base.derived_from for base in bases)
        derived = deriving._trace(_trace_spec(third, config, model), depth=3,
                                  micro_batch_size=config.micro_batch_size, keep_middle=False)
    finally:
        deriving.close()
    assert derived.derived_from == tuple(traced)
    fresh_backend = SimBackend()
    try:
        fresh = fresh_backend._trace(_trace_spec(third, config, model), depth=3,
                                     micro_batch_size=config.micro_batch_size, keep_middle=False)
    finally:
        fresh_backend.close()
    assert not fresh.derived_from
    if config_json:  # the case this one is for: the peaking occurrence of a repeated site moves
        def peaking(trace):
            return {key: max(range(len(seen)), key=lambda i: seen[i][0]) for key, seen in trace.repeats.items()}
        assert peaking(bases[0]) == peaking(bases[1]) != peaking(fresh)
    large = "memory_bytes_large"  # not affine in 1/W (a size threshold): left out unless W leaves it alone
    derived_fields, fresh_fields = _fields(derived), _fields(fresh)
    if large not in derived.op_work:
        fresh_fields["op_work"] = {k: v for k, v in fresh.op_work.items() if k != large}
    assert derived_fields == fresh_fields


@pytest.mark.parametrize("gpus, knobs, config_json", [
    (64, dict(shard_placement="largest", micro_batch_size=2, activation_checkpointing="none"), SCALED_70B),
    (8, dict(tensor_parallel=2, activation_checkpointing="full"), None)], ids=["largest", "tp2"])
def test_fsdp_chunks_made_on_demand_trace_as_fsdps_own_code(gpus, knobs, config_json, monkeypatch, tmp_path):
    """What keeps a trace at thousands of GPUs from making thousands of fake views per parameter
    (_fewer_views): FSDP2's per-rank chunks made only where read, and its reordering of shards off
    dimension 0 one strided copy. The trace is the one FSDP2's own code gives, site by site (the same ops counted: the sites' names are op counts), FLOPs
    and op work: for largest-dimension shards with accumulation (SCALED_70B's k and v projections, 32
    rows, on dimension 1 over 64 GPUs: all-gather copy-out and reduce-scatter input reordered) and for
    TP2 (shards of DTensors' local tensors)."""
    from autotune.backends.sim import _fewer_views
    from autotune.backends.sim._backend import SimBackend
    from autotune.problem.config import TrainConfig

    model = "llama3.2-1b"
    if config_json:
        model = str(tmp_path / "config.json")
        Path(model).write_text(json.dumps(config_json))
    config = TrainConfig(**knobs)
    spec = _trace_spec(gpus, config, model)
    assert spec.grad_accum_steps > 1

    def traced(on_demand: bool):
        monkeypatch.setattr(_fewer_views, "ENABLED", on_demand)
        backend = SimBackend()
        try:
            return backend._trace(spec, depth=3, micro_batch_size=config.micro_batch_size, keep_middle=False)
        finally:
            backend.close()

    made, reordered = [], []
    monkeypatch.setattr(_fewer_views._Chunks, "__init__", _counting(_fewer_views._Chunks.__init__, made))
    monkeypatch.setattr(_fewer_views._Chunks, "cat", _counting(_fewer_views._Chunks.cat, reordered))
    fsdps_own = traced(False)
    assert not made
    on_demand = traced(True)
    assert made and bool(reordered) == (config.shard_placement == "largest")
    assert _fields(on_demand) == _fields(fsdps_own)


def _counting(method, calls: list):
    def counted(*args, **kwargs):
        calls.append(1)
        return method(*args, **kwargs)
    return counted


def test_a_trace_for_the_other_accumulation_equals_a_fresh_trace():
    """The tracer traces one micro-batch with or without gradient accumulation; a step that
    accumulates holds, at each site, the gradients earlier micro-batches reduced. Traces with
    accumulation at 8 and 16 GPUs give the trace without it at 16 GPUs (converted) and at 32
    (converted and derived): each is the fresh trace of a step without accumulation."""
    from autotune.backends.sim._backend import SimBackend
    from autotune.problem.config import TrainConfig

    config = TrainConfig(activation_checkpointing="full", micro_batch_size=1)

    def trace(backend, gpus, **target):
        spec = _trace_spec(gpus, config, **target)
        return spec, backend._trace(spec, depth=3, micro_batch_size=1, keep_middle=False)

    deriving = SimBackend(derive_world_sizes=True)
    try:
        assert all(trace(deriving, gpus)[0].grad_accum_steps > 1 for gpus in (8, 16))
        unaccumulated = {gpus: trace(deriving, gpus, target_tokens=gpus * 8192) for gpus in (16, 32)}  # a sequence per GPU
    finally:
        deriving.close()
    for gpus, (spec, converted) in unaccumulated.items():
        assert spec.grad_accum_steps == 1 and converted.derived_from == (() if gpus == 16 else (8, 16))
        fresh_backend = SimBackend()
        try:
            fresh = fresh_backend._trace(spec, depth=3, micro_batch_size=1, keep_middle=False)
        finally:
            fresh_backend.close()
        derived_fields, fresh_fields = _fields(converted), _fields(fresh)
        if "memory_bytes_large" not in converted.op_work:
            fresh_fields["op_work"] = {k: v for k, v in fresh.op_work.items() if k != "memory_bytes_large"}
        assert derived_fields == fresh_fields


def test_a_plan_option_explores_compile_as_tune_does(tmp_path):
    """Without --compile, a plan's option searches what `autotune tune` searches (compiled candidates
    included), so its row is the tune's answer: checked on the closed form, figure for figure."""
    plan = _plan(tmp_path / "plan", "--model", "llama3.2-1b", "--train-tokens", "100G", "--gpus", "16",
                 "--global-tokens", "4Mi", "--backend", "analytic", "--compile", "auto")
    (option,) = plan["options"]
    assert main(["--model", "llama3.2-1b", "--gpus", "16", "--global-tokens", "4Mi", "--backend", "analytic",
                 "--runs-dir", str(tmp_path / "tune"), "--out", str(tmp_path / "best.json")]) == EXIT_OK
    tuned = json.loads((tmp_path / "best.json").read_text())
    assert any(step["config"]["compile"] == "blocks" for step in tuned["decision_path"])
    assert _answer(option["result"]) == _answer(tuned)
