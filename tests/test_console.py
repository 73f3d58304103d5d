"""What a person reads: the main job at 80 columns, the winner's details on request, progress lines.

The reference for "nothing wraps mid-word" is the same output laid out 400 columns wide: wrapping
at words only moves line breaks, so both must hold the same words in the same order."""

import io
import json
import time
from pathlib import Path

from rich.console import Console as RealRichConsole

from autotune.console import Console

# The README's main job (make run), on its embedded defaults.
MAIN_JOB = ["--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M"]


class _TwoWidths:
    """stdout's console for the main job, printing everything at 80 and at 400 columns at once (one
    run, two renderings): rich lays out each renderable for each width."""

    def __init__(self, **options) -> None:
        self.consoles = {width: RealRichConsole(file=io.StringIO(), width=width, **options) for width in (80, 400)}
        self.is_terminal = False

    def print(self, *args, **kwargs) -> None:
        for console in self.consoles.values():
            console.print(*args, **kwargs)

    def text(self, width: int) -> str:
        return self.consoles[width].file.getvalue()


def test_main_job_reads_at_80_columns_and_says_the_same_as_wide(tmp_path, monkeypatch, capsys):
    from autotune import console as console_module
    from autotune.cli import EXIT_OK, main

    stdout: list[_TwoWidths] = []

    def rich_console(*, stderr: bool = False, **options):
        if stderr:
            return RealRichConsole(stderr=True, **options)
        stdout.append(_TwoWidths(**options))
        return stdout[-1]

    monkeypatch.setattr(console_module, "RichConsole", rich_console)
    monkeypatch.chdir(tmp_path)  # the default runs/ folder, as `make run` has it
    assert main(MAIN_JOB) == EXIT_OK
    (out,) = stdout
    narrow, wide = out.text(80), out.text(400)
    lines = narrow.splitlines()
    too_long = [line for line in lines if len(line) > 80]
    assert not too_long, too_long
    assert [line for line in lines if line != line.rstrip()] == []  # no padding to the width
    # Wrapping moved line breaks only: the same words in the same order as the wide rendering.
    assert narrow.split() == wide.split()
    assert any(len(line) > 80 for line in wide.splitlines())  # the wide one really was wider
    # The winner in a few short lines; its full bases are in best.json, not on the console.
    winner = lines[next(i for i, line in enumerate(lines) if line.startswith("winner:")):]
    # 12, one for eager vs compiled (vs float8), one for the longer labels of a float8 winner.
    assert len(winner) <= 14, winner
    best = next((tmp_path / "runs").glob("*/best.json"))
    document = json.loads(best.read_text())
    assert " ".join(document["memory_basis"].split()) not in " ".join(narrow.split())
    assert f"{document['tokens_per_sec']:,.0f} tok/s" in narrow
    assert "--verbose" in narrow and best.parent.name in narrow


def _document(tmp_path: Path) -> dict:
    """A real result document: the micro model's tune on the analytic backend (seconds)."""
    from autotune.api import tune

    return tune(model="micro-llama", gpus=2, global_tokens="4K", backend="analytic",
                runs_dir=str(tmp_path / "runs"))


def test_verbose_prints_every_basis_in_full_wrapped_at_words(tmp_path):
    document = _document(tmp_path)
    out = {}
    for verbose in (False, True):
        console = Console(verbose=verbose)
        console.out = RealRichConsole(file=io.StringIO(), width=80, highlight=False)
        console.winner(document, tmp_path / "run", None)
        out[verbose] = console.out.file.getvalue()
    flat = {k: " ".join(v.split()) for k, v in out.items()}
    for text in (document["memory_basis"], document["throughput_basis"], document["why_winner"]["sentence"]):
        assert " ".join(text.split()) in flat[True]
    assert document["throughput_basis"] not in flat[False]
    assert max(len(line) for line in out[True].splitlines()) <= 80


def test_an_offloaded_winner_says_how_much_of_its_step_is_the_hosts(tmp_path):
    """llama3.2-1b on 2 GPUs of 12 GiB fits only with CPU offload; at 64Ki tokens it accumulates 8
    micro-batches, and FSDP2 copies every later one's gradients back blocking. The winner's lines say
    how much of the estimated step that host work is, so a slow offloaded estimate explains itself."""
    from autotune.api import tune

    document = tune(model="llama3.2-1b", gpus=2, global_tokens="64Ki", backend="analytic", seq_len=2048,
                    gpu_memory="12GiB", runs_dir=str(tmp_path / "runs"))
    offload = document["offload_host_time"]
    assert document["fsdp"]["cpu_offload"] and document["grad_accum_steps"] > 1
    assert 0 < offload["accumulate_s"] <= offload["host_s"] <= offload["eager_step_s"]
    assert offload["source"] == "estimated"
    console = Console()
    console.out = RealRichConsole(file=io.StringIO(), width=400, highlight=False)
    console.winner(document, tmp_path / "run", None)
    text = console.out.file.getvalue()
    assert (f"CPU offload: {offload['host_s']:.3g} s of each step is the host's work (E)" in text
            and f"{document['grad_accum_steps'] - 1} accumulating micro-batches" in text), text


def test_piped_progress_says_what_runs_how_long_and_what_is_left(monkeypatch, capsys):
    """No terminal: a start line for slow work and a heartbeat while it runs, on stderr; stdout
    (the summary, or --json's document) gets nothing from it. The library's quiet console says nothing."""
    from autotune import console as console_module

    monkeypatch.setattr(console_module._LiveWork, "HEARTBEAT_S", 0.2)
    for progress_lines in (True, False):
        console = Console(quiet=True, progress_lines=progress_lines)
        console._slow_work = True  # a real backend's trials
        console._trial_seconds = [30.0, 50.0]
        with console.progress() as live:
            console.trial_started("explore", _train(), "because")
            time.sleep(0.7)
            seconds = live.end()
        captured = capsys.readouterr()
        assert captured.out == "" and 0.6 <= seconds
        lines = captured.err.splitlines()
        if not progress_lines:
            assert lines == []
            continue
        assert lines[0].startswith("autotune: trial 1 explore mb=2 ac=full: started, ~0:40 left")
        assert "(median of 2 earlier trials)" in lines[0]
        heartbeats = [line for line in lines[1:] if "running 0:0" in line]
        assert heartbeats and all("left (median of 2 earlier trials)" in line for line in heartbeats)


def _train():
    from autotune.config import TrainConfig
    from autotune.knobs import Checkpointing

    return TrainConfig(micro_batch_size=2, activation_checkpointing=Checkpointing(mode="full"))
