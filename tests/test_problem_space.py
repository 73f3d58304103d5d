"""Every problem a user can type ends cleanly (issue 53): a winner, "nothing fits", or one line at exit 2
about a flag the user gave. Hypothesis draws problems from tests/problem_space.py's SPACE (catalog
models, 1-8 GPUs per node, 1-64 nodes with odd counts, every GPU type, LoRA, GRPO, the stacks, budgets,
headroom, precision, attention kernels, compile, float8, pipelines searched) and tunes each on the closed form
in-process; the failures the fuzz run found
are pinned as examples. The long run (500+ problems) is benchmarks/fuzz_problems.py."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from autotune.problem import knobs
from autotune.drivers.cli import EXIT_OK, EXIT_USAGE, build_parser, main
from tests.problem_space import SPACE, argv, verdict

ROOT = Path(__file__).resolve().parent.parent
PROBLEM = st.fixed_dictionaries({field: st.sampled_from(values) for field, values in SPACE.items()})


def problem(**given) -> dict:
    """A problem with every field at its most common value, `given` changed."""
    return {**{field: values[0] for field, values in SPACE.items()}, **given}


def tune(line: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(line)
    return code, out.getvalue(), err.getvalue()


# Found by the fuzz run on the tool before issue 53 (each ended in an error about a flag the user never
# gave): HSDP group sizes that do not divide the world on 7, 12 and 12 nodes, a node's group of one GPU
# as a reshard group, expert parallelism proposed with a reshard group.
FOUND = [
    problem(model="llama3.1-70b", gpus_per_node=4, nodes=7, seq_len=1024, gpu_type="l40s-48gb", stack="trl",
            headroom="0.3"),
    problem(model="codellama-34b", gpus_per_node=8, nodes=12, seq_len=2048, gpu_type="v100-32gb", peft="lora",
            sequences_per_gpu=2),
    problem(model="llama3-70b", gpus_per_node=4, nodes=12, seq_len=4096, gpu_type="a100-40gb", time_budget="3s",
            sequences_per_gpu=4),
    problem(model="codellama-34b", gpus_per_node=1, nodes=4, seq_len=1024, gpu_type="h100-80gb", workload="grpo"),
    problem(model="qwen3-30b-a3b", gpus_per_node=4, nodes=4, seq_len=4096, gpu_type="l40s-48gb", headroom="0.05",
            sequences_per_gpu=2),
]


@settings(max_examples=30, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(PROBLEM)
@example(FOUND[0]).via("fuzz run, seed 1: --hsdp 8 on 4 GPUs a node")
@example(FOUND[1]).via("fuzz run, seed 1: --hsdp 64 on 96 GPUs")
@example(FOUND[2]).via("fuzz run, seed 1: --hsdp 32 on 48 GPUs")
@example(FOUND[3]).via("fuzz run, seed 1: a reshard group of 1 GPU")
@example(FOUND[4]).via("fuzz run, seed 1: --ep 4 with --reshard-group 4")
@example(problem(model="qwen3-30b-a3b", peft="lora", gpus_per_node=8, nodes=1)).via("issue 53: LoRA on MoE")
@example(problem(model="gemma2-9b", peft="lora", gpus_per_node=8, nodes=1)).via("issue 53: gemma2 LoRA, closed form")
def test_every_problem_a_user_types_ends_cleanly(tmp_path_factory, drawn):
    line = argv(drawn, str(tmp_path_factory.mktemp("runs")))
    code, _, err = tune(line)
    assert not verdict(line, code, err), f"autotune {' '.join(line)}: {verdict(line, code, err)}"


@pytest.mark.parametrize("gpus, nodes", [(24, 3), (48, 6), (56, 7), (440, 55)])
def test_odd_node_counts_explore_only_hsdp_groups_that_divide_the_world(tmp_path, gpus, nodes):
    """llama3-70b does not fit sharded within a node of 8 A100-40GB: the search explores HSDP groups of
    several nodes, each a whole number of nodes dividing the node count (counted here from the cluster,
    not from knobs.hsdp_group_sizes)."""
    seq = 4096
    code, _, err = tune(["tune", "--model", "llama3-70b", "--gpus", str(gpus), "--nodes", str(nodes),
                         "--gpu-type", "a100-40gb", "--seq-len", str(seq), "--global-tokens", str(gpus * seq * 2),
                         "--backend", "analytic", "--runs-dir", str(tmp_path)])
    assert code == EXIT_OK, err
    document = json.loads(next(tmp_path.glob("*/best.json")).read_text())
    groups = {t["config"]["shard_group_size"] for t in document["decision_path"] if t["config"]["shard_group_size"]}
    assert groups, "no HSDP group was explored"
    for group in groups:
        assert group % 8 == 0 and gpus % group == 0 and group < gpus, (group, gpus)


def test_hsdp_group_sizes_are_whole_nodes_dividing_the_node_count():
    class Model:
        name, num_experts, block_param_shapes = "m", 0, ()

    def sizes(gpus, per_node):
        return knobs.hsdp_group_sizes(knobs.ProblemShape(num_gpus=gpus, gpus_per_node=per_node, model=Model()))

    assert sizes(440, 8) == (8, 40, 88)
    assert sizes(24, 8) == (8,)
    assert sizes(8, 8) == ()
    for gpus, per_node in ((48, 8), (96, 4), (64, 1), (440, 8)):
        for size in sizes(gpus, per_node):  # each accepted by the check the CLI applies to --hsdp
            values = {k.name: k.default for k in knobs.KNOBS} | {"shard_group_size": size}
            assert not knobs.why_not_buildable(values, knobs.ProblemShape(num_gpus=gpus, gpus_per_node=per_node,
                                                                          model=Model()))


def test_a_user_given_hsdp_that_cannot_divide_is_still_refused_naming_it(tmp_path):
    code, _, err = tune(["trial", "--model", "llama-7b", "--gpus", "24", "--nodes", "3", "--hsdp", "16",
                         "--backend", "analytic"])
    assert code == EXIT_USAGE
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--hsdp 16" in errors[0], err


def test_tune_accepts_precision_and_every_trial_runs_it(tmp_path):
    code, _, err = tune(["tune", "--model", "qwen2.5-0.5b", "--gpus", "8", "--global-tokens", "1Mi",
                         "--backend", "analytic", "--precision", "bf16-pure", "--runs-dir", str(tmp_path)])
    assert code == EXIT_OK, err
    document = json.loads(next(tmp_path.glob("*/best.json")).read_text())
    assert document["precision"] == "bf16-pure"
    assert {t["config"]["precision"] for t in document["decision_path"]} == {"bf16-pure"}


def test_bf16_pure_on_a_gpu_without_bf16_is_refused_naming_the_flag(tmp_path):
    code, _, err = tune(["tune", "--model", "qwen2.5-0.5b", "--gpus", "8", "--gpu-type", "v100-32gb",
                         "--global-tokens", "1Mi", "--backend", "analytic", "--precision", "bf16-pure",
                         "--runs-dir", str(tmp_path)])
    assert code == EXIT_USAGE and "--precision bf16-pure" in err
    assert not list(tmp_path.iterdir())  # nothing half-written


def _help_flags(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {option for action in sub.choices[command]._actions if action.help != argparse.SUPPRESS
            for option in action.option_strings if option.startswith("--") and option != "--help"}


def test_the_readme_options_table_and_tune_help_list_the_same_flags():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("Options of `tune`"):].split("\n\n")[1]
    rows = table.splitlines()[2:]
    in_readme = {flag for row in rows for flag in re.findall(r"--[a-z0-9-]+", row.split("|")[1])}
    assert in_readme == _help_flags("tune"), (sorted(in_readme - _help_flags("tune")),
                                              sorted(_help_flags("tune") - in_readme))


def test_plan_and_sweep_finish_on_odd_node_counts(tmp_path):
    code, _, err = tune(["plan", "--model", "llama3-70b", "--train-tokens", "1T", "--gpus", "24,48,440",
                         "--global-tokens", str(440 * 8192), "--backend", "analytic",
                         "--runs-dir", str(tmp_path / "plan")])
    assert code == EXIT_OK, err
    sweep = tmp_path / "odd.toml"
    sweep.write_text('name = "odd"\n[matrix]\nmodel = ["llama3-70b"]\ngpus = [24, 48]\nnodes = [3, 6]\n'
                     'gpu_type = ["a100-40gb"]\nglobal_tokens = ["786432"]\nseq_len = [4096]\nbackend = ["analytic"]\n')
    code, out, err = tune(["sweep", str(sweep), "--runs-dir", str(tmp_path / "sweep")])
    assert code == EXIT_OK, err
    assert "4 of 4 problems finished" in " ".join(out.split()), out
