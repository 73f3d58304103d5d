"""The library API (autotune.tune, autotune/drivers/api.py) is what the CLI wraps, not the reverse."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.drivers.cli import EXIT_USAGE, build_parser, main
from autotune.util.errors import UsageError
from autotune.problem.options import TuneOptions

ROOT = Path(__file__).resolve().parent.parent
PROBLEM = dict(gpus=2, global_tokens="64K", backend="analytic", gpu_memory="3GiB")  # 3 GiB: not the largest micro-batch
LIBRARY_ONLY = """
import json, sys
import autotune
document = autotune.tune("tiny-llama", runs_dir=sys.argv[1], **json.loads(sys.argv[2]))
assert "autotune.drivers.cli" not in sys.modules, "the library imported the CLI"
print(json.dumps(document))
"""


def _best(runs: Path) -> dict:
    (path,) = runs.glob("*/best.json")
    return json.loads(path.read_text())


def test_the_library_tunes_without_the_cli_and_agrees_with_it(tmp_path, capsys):
    proc = subprocess.run([sys.executable, "-c", LIBRARY_ONLY, str(tmp_path / "library"), json.dumps(PROBLEM)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    assert document == _best(tmp_path / "library")

    argv = ["--model", "tiny-llama", "--runs-dir", str(tmp_path / "cli")]
    for name, value in PROBLEM.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    assert main(argv) == 0
    capsys.readouterr()
    from_cli = _best(tmp_path / "cli")
    assert from_cli["fsdp"] == document["fsdp"]
    assert (from_cli["micro_batch_size"], from_cli["grad_accum_steps"]) == (document["micro_batch_size"],
                                                                          document["grad_accum_steps"])


@pytest.mark.parametrize("option, value", [("headroom", "1.5"), ("global_tolerance", "x"), ("gpus", 0),
                                           ("max_trials", "-3"), ("time_budget", "5x"), ("timeout", "soon"),
                                           ("backend", "gpu"), ("workload", "rl"), ("seq_len", "1.5"),
                                           ("vllm_gpu_memory_utilization", "lots")])
def test_a_bad_value_is_the_same_one_line_error_from_the_library_and_the_cli(option, value, tmp_path, capsys):
    import autotune

    runs = tmp_path / "runs"
    given = {"gpus": 2, "global_tokens": "64K", "runs_dir": str(runs), option: value}
    with pytest.raises(UsageError) as raised:
        autotune.tune("tiny-llama", **given)
    argv = ["--model", "tiny-llama"]
    for name, text in given.items():
        argv.append(f"--{name.replace('_', '-')}={text}")
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err == f"autotune: error: {raised.value}\n"
    assert not runs.exists(), "bad input wrote something"


def test_tune_options_are_the_tune_commands_options_with_its_defaults():
    tune = build_parser()._subparsers._group_actions[0].choices["tune"]
    flags = {a.dest: a.default for a in tune._actions
             if a.option_strings and a.dest not in ("help", "json", "verbose", "node_rank")}  # the CLI's printing
    fields = {f.name: f.default for f in dataclasses.fields(TuneOptions)}
    fields["model"] = fields["global_tokens"] = None  # required on both sides
    assert fields == flags


def test_seq_len_max_from_the_library_is_checked_by_plain_tunes_either_side(tmp_path):
    """autotune.tune(..., seq_len="max") returns the tune at the longest length that fits, with the
    search's probes; plain tunes at that length and one step longer, asked for apart, say the same:
    the first fits, the second finds nothing."""
    import autotune
    from autotune.util.errors import NothingFits

    problem = dict(gpus=2, global_tokens="64K", backend="analytic", gpu_memory="2200MiB")
    document = autotune.tune("tiny-llama", seq_len="max", seq_len_step=128, runs_dir=str(tmp_path / "max"), **problem)
    found = document["sequence_length"]
    length = document["seq_len"]
    assert length == found["max_seq_len"] and length % 128 == 0 and length < 1024  # bound by memory here
    assert any(p["seq_len"] == length and p["fits"] for p in found["probes"])
    assert autotune.tune("tiny-llama", seq_len=length, runs_dir=str(tmp_path / "at"), **problem)["seq_len"] == length
    with pytest.raises(NothingFits):
        autotune.tune("tiny-llama", seq_len=length + 128, runs_dir=str(tmp_path / "above"), **problem)
