"""The command line, end to end: the real `autotune` entry point in a subprocess, and main() in-process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from autotune.problem.catalog.models import resolve_model
from autotune.drivers.cli import EXIT_NOTHING_FITS, EXIT_OK, EXIT_USAGE, main

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "schemas" / "result.schema.json").read_text())
TINY = ["--model", "tiny-llama", "--gpus", "2", "--global-tokens", "64K"]


def run_cli(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, **(env or {})}, timeout=300)


def printed(capsys) -> str:
    """What main() printed on stdout, its words joined by single spaces (the console wraps at words)."""
    return " ".join(capsys.readouterr().out.split())


def run_dirs(runs: Path):
    return sorted(p for p in runs.iterdir() if p.is_dir()) if runs.exists() else []


BAD_INPUTS = [
    (["--model", "llama-7", "--gpus", "8", "--global-tokens", "4M"], "did you mean llama-7b"),
    (["--model", "/nonexistent/config.json", "--gpus", "8", "--global-tokens", "4M"], "not found"),
    (["--model", "llama-7b", "--gpus", "0", "--global-tokens", "4M"], "must be a positive integer"),
    (["--model", "llama-7b", "--gpus", "2.5", "--global-tokens", "4M"], "is not an integer"),
    (["--model", "llama-7b", "--gpus", "8", "--nodes", "3", "--global-tokens", "4M"], "not divisible"),
    (["--model", "llama-7b", "--gpus", "8", "--global-tokens", "four"], "cannot parse --global-tokens"),
    (["--model", "llama-7b", "--gpus", "8", "--global-tokens", "1K"], "smaller than one sequence per GPU"),
    (["--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M", "--gpu-type", "h100"], "did you mean h100-80gb"),
    (["--model", "micro-llama", "--gpus", "2", "--global-tokens", "2020"], "cannot be reached within 1.0%"),
    (["--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M", "--seq-len", "9000"], "longer than llama-7b supports"),
    (["--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M", "--headroom", "1.5"], "fraction"),
    (["--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M", "--export", "deepspeed"], "unknown export format"),
    (["--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M", "--workload", "grpo",
      "--vllm-gpu-memory-utilization", "1.5"], "must be a fraction in (0, 1)"),
    (["--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M", "--vllm-gpu-memory-utilization", "0.5"],
     "applies to --workload grpo only"),
    (["--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M", "--workload", "rl"], "invalid choice"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-tokens", "1Mi", "--workload", "grpo",
      "--vllm-gpu-memory-utilization", "0.1"], "needs at least"),
    (["--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M", "--workload", "grpo",
      "--max-completion-length", "4096"], "leaves no room for the prompt"),
    (["--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M", "--workload", "grpo",
      "--num-generations", "1"], "--num-generations 1 must be an integer of at least 2"),
    (["--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M", "--num-generations", "4"],
     "--num-generations applies to --workload grpo only"),
    (["--model", "llama-7b", "--gpus", "100000", "--nodes", "3", "--global-tokens", "4M"], "not divisible by --nodes 3"),
    (["--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M", "--lora-rank", "8"],
     "--lora-rank applies to --peft lora only"),
    (["--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M", "--peft", "lora", "--lora-dropout", "1.5"],
     "--lora-dropout must be a fraction in [0, 1)"),
    (["--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M", "--peft", "dora"], "invalid choice"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_in_process(tmp_path, capsys, argv, message):
    runs = tmp_path / "runs"
    assert main([*argv, "--runs-dir", str(runs)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not runs.exists(), "a bad input left files behind"


@pytest.mark.parametrize("argv, message", BAD_INPUTS[:6], ids=[m for _, m in BAD_INPUTS[:6]])
def test_bad_input_real_cli(tmp_path, argv, message):
    runs = tmp_path / "runs"
    proc = run_cli(*argv, "--runs-dir", str(runs))
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert message in proc.stderr and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert not runs.exists()


def test_a_storage_that_is_not_a_database_is_one_line_and_touches_nothing(tmp_path):
    """runs/autotune.db full of random bytes (a corrupted or foreign file): one line naming it and
    what to do, exit 2, the file unchanged and no run folder made."""
    runs = tmp_path / "runs"
    runs.mkdir()
    junk = os.urandom(4096)
    (runs / "autotune.db").write_bytes(junk)
    proc = run_cli(*TINY, "--backend", "analytic", "--runs-dir", str(runs))
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "autotune.db" in proc.stderr and "not a study database" in proc.stderr and "--storage" in proc.stderr
    assert (runs / "autotune.db").read_bytes() == junk
    assert [p.name for p in runs.iterdir()] == ["autotune.db"]


def test_malformed_space_and_unwritable_runs_dir(tmp_path):
    space = tmp_path / "space.toml"
    space.write_text("[micro_batch]\nmax = \"many\"\n")
    proc = run_cli(*TINY, "--space", str(space), "--runs-dir", str(tmp_path / "runs"))
    assert proc.returncode == EXIT_USAGE and "micro_batch.max must be int" in proc.stderr
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    proc = run_cli(*TINY, "--backend", "analytic", "--runs-dir", str(blocker / "runs"))
    assert proc.returncode == EXIT_USAGE and "not writable" in proc.stderr
    assert proc.stderr.count("\n") == 1


def test_tune_writes_valid_result_and_resumes(tmp_path, capsys):
    runs = tmp_path / "runs"
    argv = [*TINY, "--backend", "analytic", "--runs-dir", str(runs)]
    assert main(argv) == EXIT_OK
    out = printed(capsys)
    assert "backend: analytic" in out and "winner" in out and "estimated" in out
    (first,) = run_dirs(runs)
    document = json.loads((first / "best.json").read_text())
    jsonschema.validate(document, SCHEMA)
    assert document["global_tokens"] == (document["micro_batch_size"] * document["gpus"]
                                         * document["grad_accum_steps"] * document["seq_len"])
    assert abs(document["global_tokens"] - 64_000) / 64_000 <= 0.01
    assert document["memory_source"] == "estimated" and document["fsdp"]["wrap"] == "LlamaDecoderLayer"
    assert [s["step"] for s in document["decision_path"]] == list(range(1, len(document["decision_path"]) + 1))
    assert (first / "trials.csv").read_text().count("\n") == len(document["decision_path"]) + 1
    import pandas as pd  # an independent reader of the table the csv module wrote

    table = pd.read_csv(first / "trials.csv")
    for column in ("step", "status", "fits", "peak_memory_bytes", "grad_accum_steps", "reason"):
        assert list(table[column]) == [s[column] for s in document["decision_path"]], column

    # The same command again resumes the study: every trial is reused, the winner is the same.
    assert main(argv) == EXIT_OK
    out = printed(capsys)
    assert "resuming" in out and "reused from the study" in out
    second = [d for d in run_dirs(runs) if d != first][0]
    again = json.loads((second / "best.json").read_text())
    assert again["study"] == document["study"]
    assert {k: again[k] for k in ("micro_batch_size", "fsdp")} == {k: document[k] for k in ("micro_batch_size", "fsdp")}
    assert all("reused trial" in s["reason"] for s in again["decision_path"])
    # ... without adding those trials to the study again (counted by Optuna itself), while the second
    # run's trial table still lists every step it took.
    import optuna

    study = optuna.load_study(study_name=document["study"], storage=f"sqlite:///{runs / 'autotune.db'}")
    assert len(study.trials) == len(document["decision_path"])
    assert (second / "trials.csv").read_text().count("\n") == len(again["decision_path"]) + 1


def test_workers_creating_one_new_study_at_the_same_moment_all_succeed(tmp_path):
    """SQLite's schema and Optuna's study created by three processes at once (it crashed one in
    three rounds of five before creation retried): every process gets the study, in every round."""
    script = ("import sys, time\n"
              "from autotune.search.store import TrialStore\n"
              "start = float(sys.argv[2])\n"
              "while time.time() < start: time.sleep(0.001)\n"
              "TrialStore(sys.argv[1], 'race')\n")
    import time

    for round_ in range(4):
        url = f"sqlite:///{tmp_path / f'race{round_}.db'}"
        start = time.time() + 3.0  # after every process has imported what it needs
        procs = [subprocess.Popen([sys.executable, "-c", script, url, str(start)], stderr=subprocess.PIPE, text=True)
                 for _ in range(3)]
        for proc in procs:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err


def test_nothing_fits_exit_code(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert main([*TINY, "--backend", "analytic", "--gpu-memory", "1MiB", "--runs-dir", str(runs)]) == EXIT_NOTHING_FITS
    assert "no configuration fits" in capsys.readouterr().err
    (run,) = run_dirs(runs)
    assert not (run / "best.json").exists() and (run / "trials.csv").exists()


def test_small_capacity_walks_to_offload(tmp_path, capsys):
    # Capacity for the states of a 7B model on 8 GPUs but not its activations: the graph must
    # go baseline -> checkpointing -> activation offload -> parameter offload, in that order.
    runs = tmp_path / "runs"
    code = main(["--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M", "--backend", "analytic",
                 "--gpu-memory", "12GiB", "--runs-dir", str(runs), "--json"])
    assert code == EXIT_OK
    document = json.loads(capsys.readouterr().out)
    stages = [s["stage"] for s in document["decision_path"]]
    assert stages[:4] == ["baseline", "checkpointing", "act-offload", "offload"]
    assert document["fsdp"]["cpu_offload"] is True


def test_trial_command_prints_json(tmp_path):
    proc = run_cli("trial", "--model", "tiny-llama", "--gpus", "2", "--micro-batch", "2", "--ac", "every:2",
                   "--backend", "analytic")
    assert proc.returncode == EXIT_OK, proc.stderr
    result = json.loads(proc.stdout)
    assert result["config"]["activation_checkpointing"] == "every:2" and result["config"]["micro_batch_size"] == 2
    assert result["peak_memory"]["source"] == "estimated" and result["status"] in ("ok", "oom")
    proc = run_cli("trial", "--model", "tiny-llama", "--gpus", "2", "--ac", "sometimes", "--backend", "analytic")
    assert proc.returncode == EXIT_USAGE and "every:K" in proc.stderr


def test_default_backend_without_gpus_is_the_simulator():
    from autotune.drivers.api import choose_backend
    from autotune.problem.config import Cluster

    name, why = choose_backend("auto", Cluster(num_gpus=8))
    assert name == "sim" and "no GPU here" in why


def test_interrupted_run_keeps_finished_trials_and_resumes(tmp_path, capsys, monkeypatch):
    import autotune.drivers.api as api
    import autotune.drivers.cli as cli

    real_make_backend = api.make_backend
    calls = {"n": 0}

    from autotune.backends.analytic import AnalyticBackend

    class InterruptedOnThird(AnalyticBackend):
        """The analytic backend, with Ctrl-C arriving during the third trial."""

        def evaluate(self, spec):
            calls["n"] += 1
            if calls["n"] == 3:
                raise KeyboardInterrupt
            return super().evaluate(spec)

    monkeypatch.setattr(api, "make_backend", lambda name, options: InterruptedOnThird())
    runs = tmp_path / "runs"
    argv = [*TINY, "--backend", "analytic", "--runs-dir", str(runs)]
    assert main(argv) == cli.EXIT_INTERRUPTED
    assert "rerun the same command to resume" in capsys.readouterr().err
    (interrupted,) = run_dirs(runs)
    assert not (interrupted / "best.json").exists()
    assert not list(interrupted.glob(".*.tmp")), "a temporary file was left behind"

    monkeypatch.setattr(api, "make_backend", real_make_backend)
    assert main(argv) == EXIT_OK
    out = printed(capsys)
    assert "resuming 2 finished trials" in out
    resumed = [d for d in run_dirs(runs) if d != interrupted][0]
    path = json.loads((resumed / "best.json").read_text())["decision_path"]
    assert [("reused trial" in s["reason"]) for s in path[:3]] == [True, True, False]


def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path):
    from autotune.problem.catalog.models import resolve_model
    from autotune.problem.config import Cluster
    from autotune.search.records import TuneRequest
    from autotune.results.run_folder import new_run_dir

    request = TuneRequest(model=resolve_model("tiny-llama"), cluster=Cluster(num_gpus=2), seq_len=256,
                          target_tokens=64_000)
    folders = [new_run_dir(request, tmp_path) for _ in range(3)]
    assert len(set(folders)) == 3 and all(folder.is_dir() for folder in folders)


def test_trial_re_evaluates_a_result_file(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert main([*TINY, "--backend", "analytic", "--runs-dir", str(runs), "--json"]) == EXIT_OK
    document = json.loads(capsys.readouterr().out)
    (run,) = run_dirs(runs)
    assert main(["trial", "--config", str(run / "best.json"), "--backend", "analytic"]) == EXIT_OK
    again = json.loads(capsys.readouterr().out)
    assert again["config"]["micro_batch_size"] == document["micro_batch_size"]
    assert again["config"]["activation_checkpointing"] == document["fsdp"]["activation_checkpointing"]
    assert again["grad_accum_steps"] == document["grad_accum_steps"]
    assert again["peak_memory"]["value"] == document["peak_memory_bytes"]
    assert main(["trial", "--config", str(tmp_path / "missing.json")]) == EXIT_USAGE


_BAD_CONFIGS = [
    ({"model_type": "bert", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
      "vocab_size": 100, "intermediate_size": 128}, "not a decoder-only causal language model"),
    ({"model_type": "t5", "num_hidden_layers": 2, "num_layers": 2, "d_model": 64, "vocab_size": 100},
     "not a decoder-only causal language model"),
    ({"model_type": "llama", "num_hidden_layers": 0, "hidden_size": 64, "num_attention_heads": 4,
      "vocab_size": 100}, "num_hidden_layers must be a positive integer"),
    ({"model_type": "llama", "num_hidden_layers": -3, "hidden_size": 64, "num_attention_heads": 4,
      "vocab_size": 100}, "num_hidden_layers must be a positive integer"),
    ({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 65, "num_attention_heads": 4,
      "vocab_size": 100}, "not a multiple of the number of attention heads"),
    ({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
      "vocab_size": "lots"}, "vocab_size"),
]


@pytest.mark.parametrize("backend", ["analytic", "sim"])
@pytest.mark.parametrize("config, message", _BAD_CONFIGS, ids=[m for _, m in _BAD_CONFIGS])
def test_bad_model_config_is_one_line_exit_2_nothing_written(tmp_path, capsys, config, message, backend):
    """Refused before anything heavy runs, whatever the backend: never exit 1, never a run folder."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    runs = tmp_path / "runs"
    argv = ["--model", str(path), "--gpus", "2", "--global-tokens", "64Ki", "--seq-len", "64",
            "--backend", backend, "--runs-dir", str(runs)]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not runs.exists()


def test_small_sizes_print_in_a_unit_that_shows_them(tmp_path, capsys):
    """A micro model on a 3 MiB cap: the limit is 0.9 x 3 MiB = 2.70 MiB, never '0.00 GiB'."""
    argv = ["--model", "micro-llama", "--gpus", "2", "--global-tokens", "2048", "--backend", "sim",
            "--gpu-memory", "3MiB", "--runs-dir", str(tmp_path / "runs")]
    main(argv)
    out = capsys.readouterr()
    text = out.out + out.err
    assert f"{3 * 0.9:.2f} MiB" in text
    assert "0.00 GiB" not in text


def test_version_prints_the_package_version():
    import autotune

    proc = run_cli("--version")
    assert proc.returncode == EXIT_OK and proc.stdout.strip() == f"autotune {autotune.__version__}"


@pytest.mark.parametrize("argv, message", [
    (["--global-tokens", "-4M"], "must be positive"),
    (["--global-tokens", "1000000000000000000000000000000"], "accumulation steps"),
    (["--global-tokens", "4M", "--gpu-memory", "lots"], "use a size such as 40GiB"),
    (["--global-tokens", "4M", "--out", "."], "is a folder"),
])
def test_more_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, message):
    runs = tmp_path / "runs"
    assert main(["--model", "llama-7b", "--gpus", "8", *argv, "--runs-dir", str(runs)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not runs.exists()


def test_unwritable_out_is_refused_before_the_run(tmp_path, capsys):
    not_a_folder = tmp_path / "notes.txt"  # unwritable as a parent even for root
    not_a_folder.write_text("x")
    runs = tmp_path / "runs"
    assert main([*TINY, "--backend", "analytic", "--out", str(not_a_folder / "best.json"),
                 "--runs-dir", str(runs)]) == EXIT_USAGE
    assert "cannot be written" in capsys.readouterr().err
    assert not runs.exists()


def test_outputs_honour_the_umask_and_the_folder_says_how_the_run_ended(tmp_path, capsys):
    runs = tmp_path / "runs"
    old = os.umask(0o027)
    try:
        assert main([*TINY, "--backend", "analytic", "--runs-dir", str(runs), "--export", "accelerate"]) == EXIT_OK
    finally:
        os.umask(old)
    (run,) = run_dirs(runs)
    for name in ("best.json", "trials.csv", "report.html", "accelerate_fsdp2.yaml", "status.json"):
        mode = (run / name).stat().st_mode & 0o777
        assert mode == 0o666 & ~0o027, f"{name}: {oct(mode)}"
    assert json.loads((run / "status.json").read_text())["state"] == "done"
    assert "state: done" in (run / "autotune.log").read_text()


def test_a_model_name_with_markup_is_printed_as_text(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(resolve_model("micro-llama").config_dict
                                 | {"model_type": "llama", "_name_or_path": "[bold]odd[/bold]"}))
    assert main(["--model", str(config), "--gpus", "2", "--global-tokens", "2048", "--backend", "analytic",
                 "--runs-dir", str(tmp_path / "runs")]) == EXIT_OK
    assert "[bold]odd[/bold]" in capsys.readouterr().out


def test_host_memory_is_named_when_it_is_what_fails(tmp_path, capsys):
    argv = ["--model", "llama-70b", "--gpus", "2", "--gpu-type", "rtx4090-24gb", "--global-tokens", "1M",
            "--backend", "analytic", "--runs-dir", str(tmp_path / "runs")]
    assert main([*argv, "--host-memory", "256GiB"]) == EXIT_NOTHING_FITS
    err = capsys.readouterr().err
    assert "not the host" in err and "256.00 GiB" in err and "headroom" not in err
    (run,) = run_dirs(tmp_path / "runs")
    assert json.loads((run / "status.json").read_text())["state"] == "nothing-fits"
    # Without --host-memory the offload winner says what it assumes.
    assert main(argv) == EXIT_OK
    assert "not checked: pass --host-memory" in printed(capsys)


def test_trial_table_fits_an_80_column_terminal_and_marks_the_winner():
    from autotune.backends import get_backend
    from autotune.problem.catalog.gpus import GPUS
    from autotune.problem.config import Cluster
    from autotune.results.console import Console
    from autotune.search.controller import Controller
    from autotune.search.records import TuneRequest

    request = TuneRequest(model=resolve_model("llama-70b"), cluster=Cluster(num_gpus=2, gpu=GPUS["rtx4090-24gb"]),
                          seq_len=4096, target_tokens=1_000_000)
    outcome = Controller(request, get_backend("analytic")).tune()
    console = Console()
    console.out.width, console.out.record = 80, True
    console.trial_table(outcome.steps, request, winner=outcome.winner)
    lines = console.out.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in "\n".join(lines)
    rows = [line for line in lines if line.strip()[:1] in "*0123456789"]
    assert len(rows) == len(outcome.steps)  # one line per trial: nothing wrapped
    (marked,) = [line for line in rows if line.strip().startswith("*")]
    assert marked.split()[0] == f"*{outcome.winner.step}"
    # The throughput column is readable: the winner's figure is printed whole.
    assert f"{outcome.winner.result.throughput:,.0f}" in marked


SECRET = "s3cret-Pw-42"


def test_a_storage_password_reaches_no_stream_or_file(tmp_path, capsys, monkeypatch):
    """Neither when the storage cannot be opened nor in a successful run's files."""
    runs = tmp_path / "runs"
    url = f"postgresql+psycopg://tuner:{SECRET}@127.0.0.1:9/sweeps"
    code = main([*TINY, "--backend", "analytic", "--storage", url, "--runs-dir", str(runs)])
    assert code == EXIT_USAGE
    captured = capsys.readouterr()
    assert SECRET not in captured.out + captured.err and "***" in captured.err
    # A run whose command line holds a password elsewhere (as a sweep's wrapper may pass it) still
    # writes none: provenance, log, report and trials are masked.
    monkeypatch.setattr(sys, "argv", ["autotune", *TINY, "--storage", url])
    monkeypatch.setenv("AUTOTUNE_STORAGE_PASSWORD", SECRET)
    assert main([*TINY, "--backend", "analytic", "--runs-dir", str(runs)]) == EXIT_OK
    captured = capsys.readouterr()
    assert SECRET not in captured.out + captured.err
    for path in runs.rglob("*"):
        if path.is_file() and path.suffix != ".db":
            assert SECRET not in path.read_text(errors="replace"), path


@pytest.mark.slow
def test_sigterm_keeps_finished_trials_and_leaves_no_process(tmp_path):
    """What Slurm and systemd send: exit 143, the run marked interrupted, every child gone."""
    runs = tmp_path / "runs"

    def a_trial_finished() -> bool:
        logs = list(runs.glob("*/autotune.log"))
        return bool(logs) and "step 1 " in logs[0].read_text()

    code, err, children = _terminate_once_children_run(
        ["--model", "micro-llama", "--gpus", "2", "--global-tokens", "2048", "--backend", "cpu", "--runs-dir",
         str(runs)], ready=a_trial_finished)
    assert code == 143, err
    assert "terminated (SIGTERM)" in err and "Traceback" not in err
    (run,) = run_dirs(runs)
    assert json.loads((run / "status.json").read_text())["state"] == "interrupted"
    assert "step 1 " in (run / "autotune.log").read_text()
    assert _still_running(children) == []


def _terminate_once_children_run(argv: list[str], *, ready=lambda: True, env: dict | None = None,
                                 signum: int | None = None):
    """Start the CLI, wait until `ready()` and it has child processes, send it `signum` (SIGTERM):
    (exit code, stderr, the children's pids)."""
    import signal
    import time

    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "autotune", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 240
    children: set[int] = set()
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if ready():
                children = {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
                if children:
                    break
            time.sleep(0.2)
        assert children, "no child process ran"
        proc.send_signal(signum or signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err, children


def _still_running(pids: set[int]) -> list[int]:
    import time

    import psutil

    time.sleep(1)
    return [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_the_library_call_returns_what_the_command_writes(tmp_path, capsys):
    import autotune
    from autotune.util.errors import NothingFits, UsageError

    runs = tmp_path / "runs"
    document = autotune.tune("tiny-llama", gpus=2, global_tokens="64K", backend="analytic", runs_dir=str(runs))
    assert capsys.readouterr().out == ""  # a library call prints nothing
    (run,) = run_dirs(runs)
    assert json.loads((run / "best.json").read_text()) == document
    jsonschema.validate(document, SCHEMA)
    with pytest.raises(UsageError, match="no option 'gpu_typo'"):
        autotune.tune("tiny-llama", gpus=2, global_tokens="64K", gpu_typo="h100")
    with pytest.raises(UsageError, match="did you mean h100-80gb"):
        autotune.tune("tiny-llama", gpus=2, global_tokens="64K", gpu_type="h100", runs_dir=str(runs))
    with pytest.raises(NothingFits, match="no configuration fits"):
        autotune.tune("tiny-llama", gpus=2, global_tokens="64K", backend="analytic", gpu_memory="1MiB",
                      runs_dir=str(runs))


def test_time_budget_samples_beyond_the_graph_and_never_launches_a_predicted_oom(tmp_path, capsys, monkeypatch):
    """Real gloo trials (micro-llama, 2 ranks) under a GPU-memory limit that prunes the larger
    micro-batches: every launched trial is re-predicted here by a fresh simulator (a count made
    apart from the controller's) and must fit; sampled trials show as `sample`; the budget holds.
    The smallest model: its trials take well under a second, so the budget goes to sampling.

    The budget is checked by what it promises, against the trials' own times taken here: no sampled
    trial starts unless the longest trial so far still fits before the budget ends, and the
    confirmation starts before it ends. Not by the whole command's wall time: a loaded machine's
    start-up and launch take what they take (CI's slow VM: 73 s for a 20 s budget, every trial in time)."""
    import time

    import autotune.drivers.api as api
    from autotune.backends import get_backend

    launched = []
    spans = []  # (start, end) of each launched trial, by this process's clock
    make_backend = api.make_backend

    def spy(name, options):
        backend = make_backend(name, options)
        evaluate = backend.evaluate

        def counted(spec):
            launched.append(spec)
            began = time.monotonic()
            try:
                return evaluate(spec)
            finally:
                spans.append((began, time.monotonic()))
        backend.evaluate = counted
        return backend

    monkeypatch.setattr(api, "make_backend", spy)
    runs = tmp_path / "runs"
    argv = ["--model", "micro-llama", "--gpus", "2", "--global-tokens", "4096", "--seq-len", "64",
            "--backend", "cpu", "--gpu-memory", "10MiB", "--headroom", "0", "--runs-dir", str(runs)]
    # The graph first, without a budget (however long a loaded machine takes); the budgeted run
    # resumes the study, so its graph steps are reused trials and the budget goes to sampling.
    assert main(argv) == EXIT_OK
    (graph_run,) = run_dirs(runs)
    assert "sample" not in [s["stage"] for s in json.loads((graph_run / "best.json").read_text())["decision_path"]]
    budget = 20  # room for a few sampled real trials (under a second each here) after the reused graph
    spans.clear()
    assert main([*argv, "--time-budget", str(budget)]) == EXIT_OK
    out = printed(capsys)
    (run,) = [d for d in run_dirs(runs) if d != graph_run]
    document = json.loads((run / "best.json").read_text())
    jsonschema.validate(document, SCHEMA)
    path = document["decision_path"]
    stages = [s["stage"] for s in path]
    assert "sample" in stages and " sample " in out
    assert stages.index("sample") > stages.index("baseline")
    assert not [s for s in path if s["stage"] == "sample" and s["status"] == "pruned"]
    sampled = [json.dumps(s["config"], sort_keys=True) for s in path if s["stage"] == "sample"]
    graph = [json.dumps(s["config"], sort_keys=True) for s in path if s["stage"] not in ("sample", "confirm")]
    assert len(set(sampled)) == len(sampled) and not set(sampled) & set(graph)
    assert document["sampling"]["sampled"] >= 1
    # The winner's origin: a confirmation names the step it confirmed.
    found = document["found_by"]
    assert found["stage"] != "confirm" and path[found["step"] - 1]["stage"] == found["stage"]
    oracle = get_backend("sim", device_kind="cpu")
    try:
        for spec in launched:
            predicted = oracle.evaluate(spec)
            assert predicted.status == "ok" and predicted.peak_bytes <= 10 * 2**20, spec.train.label()
    finally:
        oracle.close()
    # The graph's steps were reused: each launch here is a sampled trial, then the confirmation. The controller's
    # clock started before the first, so the budget ends by the first's start + budget at the latest; a sample
    # starts only with the longest trial so far (the launch's start-up included) left before that end.
    sampled_count = document["sampling"]["sampled"]
    confirmed = sum(s["stage"] == "confirm" for s in path)
    assert len(spans) == sampled_count + confirmed, (len(spans), document["sampling"], stages)
    ends_by = spans[0][0] + budget
    for index in range(1, sampled_count):
        longest = max(end - start for start, end in spans[:index])
        assert spans[index][0] + longest <= ends_by, (index, spans, budget)
    assert all(start <= ends_by for start, _ in spans)


def _deep_model_config(tmp_path: Path, name: str, num_layers: int) -> Path:
    """A catalog model with more blocks: deep enough that the simulator traces shallow copies."""
    config = tmp_path / f"{name}-{num_layers}.json"
    config.write_text(json.dumps(resolve_model(name).config_dict
                                 | {"model_type": "llama", "num_hidden_layers": num_layers}))
    return config


def test_a_sim_plan_stops_its_helper_process(tmp_path, capsys, monkeypatch):
    # The simulator traces the deeper shallow copy in a helper process (a second core): once
    # the command returns, nothing of it runs on.
    import psutil

    monkeypatch.setenv("AUTOTUNE_SIM_HELPER", "on")  # whatever else runs on this machine

    config = _deep_model_config(tmp_path, "micro-llama", 8)
    argv = ["--model", str(config), "--gpus", "2", "--global-tokens", "2048", "--backend", "sim",
            "--compile", "none", "--runs-dir", str(tmp_path / "runs")]  # the helper's life, not compile's
    assert main(argv) == EXIT_OK
    (best,) = (tmp_path / "runs").glob("*/best.json")
    assert "extrapolated from 3 and 4 blocks" in json.loads(best.read_text())["memory_basis"]
    assert psutil.Process().children(recursive=True) == []


@pytest.mark.parametrize("signame, code, said", [("SIGTERM", 143, "terminated (SIGTERM)"),
                                                  ("SIGINT", 130, "interrupted")])
def test_a_signal_while_the_simulator_traces_in_two_processes_leaves_none(tmp_path, signame, code, said):
    import signal

    config = _deep_model_config(tmp_path, "tiny-llama", 24)
    exit_code, err, children = _terminate_once_children_run(
        ["--model", str(config), "--gpus", "2", "--global-tokens", "64K", "--backend", "sim", "--runs-dir",
         str(tmp_path / "runs")], env={"AUTOTUNE_SIM_HELPER": "on"}, signum=getattr(signal, signame))
    assert exit_code == code, err
    assert said in err and "Traceback" not in err
    assert _still_running(children) == []


def test_the_program_exits_with_main_s_code_after_the_exit_handlers_ran():
    """`autotune` (cli.run) skips the interpreter's teardown but not what a normal exit does: the
    exit handlers run (here one registered by the caller), output is flushed, the code is main's."""
    script = ("import atexit, sys; from autotune.drivers import cli; "
              "atexit.register(lambda: print('exit handler ran')); "
              "sys.argv = ['autotune', *sys.argv[1:]]; cli.run()")
    ok = subprocess.run([sys.executable, "-c", script, "--help"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == EXIT_OK and "usage:" in ok.stdout and ok.stdout.rstrip().endswith("exit handler ran")
    bad = subprocess.run([sys.executable, "-c", script, "--model", "tiny-llama", "--gpus", "0", "--global-tokens", "4M"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "error: argument --gpus" in bad.stderr and "exit handler ran" in bad.stdout


def test_float8_without_torchao_is_one_line_before_anything_is_traced():
    """`--float8` traces and runs torchao's float8 linears: where the float8 extra is not installed
    (the test venv keeps it out: tests/float8_site.py), a trial or a tune that would trace it stops
    with one line naming the extra, exit 2; the analytic backend, which does not trace, is not refused."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    has_torchao = subprocess.run([sys.executable, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchao') is None)"],
                                 env=env).returncode == 0
    if has_torchao:
        pytest.skip("torchao is installed in this environment: nothing to refuse")
    problem = ["--model", "micro-llama", "--gpus", "2", "--gpu-type", "h100-80gb", "--float8", "tensorwise"]
    # Refused before the model is built: the process never imported transformers.
    script = ("import sys; from autotune.drivers.cli import main; code = main(sys.argv[1:]); "
              "print('transformers' in sys.modules); sys.exit(code)")
    for argv in (["trial", *problem, "--backend", "sim"], [*problem, "--global-tokens", "4096", "--backend", "sim"]):
        proc = subprocess.run([sys.executable, "-c", script, *argv], env=env, capture_output=True, text=True,
                              timeout=300, cwd=ROOT)
        errors = [line for line in proc.stderr.splitlines() if "error" in line]
        assert proc.returncode == EXIT_USAGE and proc.stdout.split() == ["False"], proc.stderr
        assert len(errors) == 1 and "pip install 'autotune[float8]'" in errors[0] and "Traceback" not in proc.stderr
    analytic = subprocess.run([sys.executable, "-m", "autotune", "trial", *problem, "--backend", "analytic"], env=env,
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert analytic.returncode == EXIT_OK, analytic.stderr


def test_qlora_without_bitsandbytes_is_one_line():
    """`--peft qlora` builds, traces and runs bitsandbytes' 4-bit layers: without bitsandbytes (the
    qlora extra; hidden here from the import system's look-up, since the test venv has it), a trial
    stops with one line naming the extra, exit 2, before anything is built."""
    script = ("import importlib.util, sys; find = importlib.util.find_spec; "
              "importlib.util.find_spec = lambda name, *a: None if name == 'bitsandbytes' else find(name, *a); "
              "from autotune.drivers import cli; sys.argv = ['autotune', *sys.argv[1:]]; cli.run()")
    proc = subprocess.run([sys.executable, "-c", script, "trial", "--model", "micro-llama", "--gpus", "2",
                           "--peft", "qlora", "--backend", "sim"], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert len(errors) == 1 and "pip install 'autotune[qlora]'" in errors[0] and "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", ["models", "gpus"])
def test_the_catalog_lists_each_entry_with_its_figures_and_source_in_80_columns(command, capsys):
    """`autotune models` and `autotune gpus`: one table row per catalog entry with its key figures,
    then each entry's source, every line within 80 columns; --json gives every field for machines."""
    from autotune.problem.catalog.gpus import GPUS
    from autotune.problem.catalog.models import MODELS

    catalog = MODELS if command == "models" else GPUS
    assert main([command]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80
    flat = " ".join(" ".join(lines).split())
    for name, entry in catalog.items():
        assert f"{name}: {' '.join(entry.source.split())}" in flat  # its source, named
        (row,) = [line for line in lines if line.split()[:1] == [name] or line.split()[:2] == [name, "*"]]
        figure = (f"{resolve_model(name).num_layers}" if command == "models" else f"{entry.peak_tflops:g}")
        assert figure in row.split(), row
    assert main([command, "--json"]) == EXIT_OK
    rows = json.loads(capsys.readouterr().out)
    key = "name" if command == "models" else "type"
    assert [row[key] for row in rows] == list(catalog)
    assert all(row["source"] for row in rows)
    if command == "models":
        assert {row["name"]: row["num_parameters"] for row in rows}["llama-7b"] == resolve_model("llama-7b").num_parameters
    else:
        assert {row["type"]: row["memory_bytes"] for row in rows}["h100-80gb"] == GPUS["h100-80gb"].memory_bytes
