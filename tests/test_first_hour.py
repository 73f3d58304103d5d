"""What a new user meets first (issue 54): the winner is one their stack runs, and one convention for
the cluster's shape. Each on the closed form (seconds); the stacks' abilities come from the real
exporters, the cluster's shape from the run's own best.json."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from autotune.drivers.cli import EXIT_OK, EXIT_USAGE, main
from autotune.results.export import export_result


def run(*line: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(line))
    return code, " ".join(out.getvalue().split()), err.getvalue()


def best(folder) -> dict:
    return json.loads(next(folder.glob("*/best.json")).read_text())


def test_a_stack_that_cannot_set_compile_gets_a_winner_it_runs(tmp_path):
    """llama-7b on 8 H100: the default tune's winner has compiled blocks; llama-cookbook's file cannot
    set compile, so --stack llama-cookbook gets the fastest eager configuration, and the run says what
    the faster one was. Checked against the llama-cookbook exporter's own mapping of the winner."""
    code, out, err = run("--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M", "--backend", "analytic",
                         "--runs-dir", str(tmp_path / "fsdp2"))
    assert code == EXIT_OK, err
    default = best(tmp_path / "fsdp2")
    assert default["compile"]["mode"] == "blocks"
    assert "compile" in {m.knob for m in export_result(default, "llama-cookbook").mappings if m.status == "unsupported"}
    assert "runs as tuned in fsdp2" in out  # the console says which stacks run the default winner

    code, out, err = run("--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M", "--backend", "analytic",
                         "--stack", "llama-cookbook", "--runs-dir", str(tmp_path / "cookbook"))
    assert code == EXIT_OK, err
    chosen = best(tmp_path / "cookbook")
    assert chosen["compile"]["mode"] == "none"
    assert not [m for m in export_result(chosen, "llama-cookbook").mappings if m.status == "unsupported"
                and m.knob == "compile"]
    assert "winner for --stack llama-cookbook" in out
    assert chosen["tokens_per_sec"] < default["tokens_per_sec"]


@pytest.mark.parametrize("flags, nodes", [(("--gpus", "64"), 8), (("--gpus", "4"), 1),
                                          (("--gpus", "16", "--gpus-per-node", "4"), 4),
                                          (("--gpus", "16", "--nodes", "2"), 2)])
def test_one_convention_for_the_cluster_shape(tmp_path, flags, nodes):
    code, _, err = run("--model", "qwen2.5-0.5b", *flags, "--global-tokens", "4Mi", "--backend", "analytic",
                       "--compile", "none", "--runs-dir", str(tmp_path))
    assert code == EXIT_OK, err
    assert best(tmp_path)["nodes"] == nodes


def test_a_count_that_is_not_whole_nodes_is_refused_and_one_big_node_is_said(tmp_path):
    code, _, err = run("--model", "qwen2.5-0.5b", "--gpus", "12", "--global-tokens", "4Mi", "--backend", "analytic",
                       "--runs-dir", str(tmp_path))
    assert code == EXIT_USAGE and "--gpus 12 is not a whole number of nodes" in err
    code, _, err = run("trial", "--model", "qwen2.5-0.5b", "--gpus", "16", "--nodes", "2", "--gpus-per-node", "4",
                       "--backend", "analytic")
    assert code == EXIT_USAGE and "--nodes 2 x --gpus-per-node 4" in err
    code, out, err = run("--model", "qwen2.5-0.5b", "--gpus", "16", "--nodes", "1", "--global-tokens", "4Mi",
                         "--backend", "analytic", "--compile", "none", "--runs-dir", str(tmp_path / "one"))
    assert code == EXIT_OK, err
    assert "one node of 16 GPUs" in out


def test_compiled_activation_offload_is_traced():
    """Compiled blocks with activation offload: the simulator traces them (a recomputed random op's
    saved generator state, brought back empty by the trace's offload, is not restored in a fake
    trace), so the search's explore trials no longer end in a multi-line torch error."""
    code, out, err = run("trial", "--model", "tiny-llama", "--gpus", "2", "--compile", "blocks",
                         "--activation-offload", "--ac", "full", "--backend", "sim")
    assert code == EXIT_OK, err
    result = json.loads(out)
    assert result["status"] == "ok" and result["peak_memory"]["value"] > 0
    assert "traceback" not in result["extras"]


def test_a_hardware_profile_the_backend_would_ignore_is_refused(tmp_path):
    code, _, err = run("--model", "qwen2.5-0.5b", "--gpus", "8", "--global-tokens", "4Mi", "--backend", "analytic",
                       "--hardware", "h100-80gb", "--runs-dir", str(tmp_path))
    assert code == EXIT_USAGE and "--hardware applies to --backend sim" in err
    assert not list(tmp_path.iterdir())
