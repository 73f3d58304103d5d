"""What a person reads: the main job at 80 columns (at most 60 lines, each trial once), the winner's
details on request, why each trial lost, close calls, progress lines, library noise kept off it.

The reference for "nothing wraps mid-word" is the same output laid out 400 columns wide: wrapping
at words only moves line breaks, so both must hold the same words in the same order."""

import io
import json
import time
from pathlib import Path

from rich.console import Console as RealRichConsole

from autotune.results.console import Console

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
    from autotune.results import console as console_module
    from autotune.drivers.cli import EXIT_OK, main

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
    # 12, one for eager vs compiled (vs float8), one for the longer labels of a float8 winner, one for the
    # held-out rows and publishers the throughput range comes from (issue 60), one for a float8 winner whose lead
    # over bf16 is within what float8 has measured short (result.float8_call).
    assert len(winner) <= 16, winner
    best = next((tmp_path / "runs").glob("*/best.json"))
    document = json.loads(best.read_text())
    assert " ".join(document["memory_basis"].split()) not in " ".join(narrow.split())
    # At most 60 lines, each trial once (a row of the table); the trials' reasons are in the report.
    assert len(lines) <= 60, len(lines)
    assert _trial_numbers(lines) == [entry["step"] for entry in document["decision_path"]]
    assert f"{document['tokens_per_sec']:,.0f} tok/s" in narrow
    assert "--verbose" in narrow and best.parent.name in narrow


def _document(tmp_path: Path) -> dict:
    """A real result document: the micro model's tune on the analytic backend (seconds)."""
    from autotune.drivers.api import tune

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
    from autotune.drivers.api import tune

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
    from autotune.results import console as console_module

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
    from autotune.problem.config import TrainConfig
    from autotune.problem.knobs import Checkpointing

    return TrainConfig(micro_batch_size=2, activation_checkpointing=Checkpointing(mode="full"))


# -- one trial, one line; why each lost; honest close calls; library noise in the log -------------------
def _request(**fields):
    from autotune.problem.catalog.gpus import GPUS
    from autotune.problem.catalog.models import resolve_model
    from autotune.problem.config import Cluster
    from autotune.search.records import TuneRequest

    return TuneRequest(model=resolve_model("llama-7b"), cluster=Cluster(num_gpus=8, gpu=GPUS["h100-80gb"]),
                       seq_len=4096, target_tokens=4_000_000, **fields)


def _step(number, request, *, micro_batch=2, tokens_per_sec=50_000.0, peak_gib=40.0, status="ok", fits=True,
          message="", grad_accum=None, **knobs):
    """A Step as the controller records it, with an estimated throughput and a predicted peak."""
    from autotune.backends.base import Figure, TrialResult
    from autotune.problem.batch import GlobalBatch
    from autotune.problem.config import TrainConfig
    from autotune.search.records import Step

    batch = request.global_batch(micro_batch)
    if grad_accum is not None:  # a global batch off the target (as a sampled trial can have)
        batch = GlobalBatch(micro_batch_size=micro_batch, grad_accum_steps=grad_accum,
                            global_tokens=micro_batch * grad_accum * 8 * 4096, target_tokens=request.target_tokens)
    result = TrialResult(status=status, peak_memory=Figure(peak_gib * 2**30, "predicted"),
                         tokens_per_sec=Figure(tokens_per_sec, "estimated"), message=message)
    return Step(step=number, stage="explore", train=TrainConfig(micro_batch_size=micro_batch, **knobs), batch=batch,
                result=result, fits=fits, reason="because", backend="sim")


def _table(steps, request, winner) -> list[str]:
    console = Console()
    console.out = RealRichConsole(file=io.StringIO(), width=80, highlight=False)
    console.trial_table(steps, request, winner=winner)
    return console.out.file.getvalue().splitlines()


def _trial_numbers(lines: list[str]) -> list[int]:
    """The trial numbers the console printed, in order: every line that starts like a trial's, a
    number (marked * or + in the table) then its stage and configuration (a table row, or with
    --verbose the line printed as the trial finished)."""
    import re

    rows = (re.match(r"^[ *+]{0,4}(\d+) +[a-z]+ +mb=", line) for line in lines)
    return [int(row.group(1)) for row in rows if row]


def test_the_table_says_in_one_word_why_each_trial_that_ran_lost():
    """A fitting trial with more tokens/s whose global batch misses the target by 3.1% (beyond the 1%
    tolerance) lost on the batch; one over the headroom limit on memory; a fitting one on speed. The
    word is in the table, the sentence in records.why_lost (trials.csv, report.html)."""
    from autotune.search.records import why_lost

    request = _request()
    winner = _step(1, request, micro_batch=2, tokens_per_sec=60_000)
    off_batch = _step(2, request, micro_batch=3, tokens_per_sec=70_000, grad_accum=42)  # 4,128,768 tokens
    assert abs(off_batch.batch.deviation - 0.032) < 0.001
    over = _step(3, request, micro_batch=4, tokens_per_sec=80_000, peak_gib=75.0, fits=False)
    slower = _step(4, request, micro_batch=1, tokens_per_sec=55_000)
    oom = _step(5, request, micro_batch=8, status="oom", fits=False)
    rows = {line.split()[0]: line.split()[-1] for line in _table([winner, off_batch, over, slower, oom], request, winner)
            if line.split() and line.split()[0].lstrip("*").isdigit()}
    assert rows == {"*1": "won", "2": "batch", "3": "headroom", "4": "slower", "5": "oom"}
    assert "+3.2% off the target" in why_lost(off_batch, winner, request)[1]
    assert "over the memory limit" in why_lost(over, winner, request)[1]
    assert "55,000 tokens/s (estimated) against the winner's 60,000" in why_lost(slower, winner, request)[1]
    assert why_lost(winner, winner, request) is None and why_lost(oom, winner, request) is None


def test_a_close_call_is_a_lead_within_what_two_estimates_can_be_off():
    """Two GPU estimates of one model on one cluster: a lead within costmodel.RANKING_ERROR is a close
    call, +11% is not; a float8 winner against a bf16 runner-up carries its float8 speed-up's worst
    shortfall too, so +11% is close there."""
    from autotune.results.result import why_winner

    request = _request()

    def why(lead: float, **winner_knobs) -> dict:
        winner = _step(1, request, tokens_per_sec=50_000 * (1 + lead), **winner_knobs)
        return why_winner(winner, [winner, _step(2, request, micro_batch=1, tokens_per_sec=50_000)], request)

    assert why(0.05)["close_call"] and why(0.05)["decide_with"]
    assert why(0.11)["close_call"] is False and "decide_with" not in why(0.11)
    # The margin lies between the two leads (the published pairs' worst ratio error, 7.6%, sets it: not
    # rebuilt here from the constant it checks).
    assert 0.05 < why(0.11)["close_call_margin"] < 0.11
    assert why(0.11, compile="blocks", float8="tensorwise")["close_call"]


def test_a_float8_winner_within_what_float8_has_measured_short_is_not_settled():
    """A float8 winner over a float8 runner-up is still weighed against the fastest configuration without
    float8: on the one GPU that measured it (docs/BENCHMARKS.md, H200), qwen2.5-1.5b's compiled tensorwise
    float8 ran 12,756 tokens/s against compiled bf16's 19,064 where 26,502 against 23,856 was estimated,
    so an estimated +30% lead could be a loss (1.30 x 0.67 / 1.11 < 1) and is not settled; +100% would
    still be a gain at that shortfall, and is settled. The console says which."""
    from autotune.results.console import _short_why
    from autotune.results.result import why_winner

    request = _request()
    shortfall = (12_756 / 19_064) / (26_502 / 23_856)

    def why(lead: float) -> dict:
        bf16 = _step(3, request, micro_batch=2, tokens_per_sec=50_000, compile="blocks")
        winner = _step(1, request, tokens_per_sec=50_000 * (1 + lead), compile="blocks", float8="tensorwise")
        runner = _step(2, request, micro_batch=1, tokens_per_sec=40_000 * (1 + lead), compile="blocks",
                       float8="tensorwise")
        return why_winner(winner, [winner, runner, bf16], request)

    assert (1.30 * shortfall < 1) and (2.0 * shortfall > 1)  # what the two cases stand for
    close, settled = why(0.30), why(1.0)
    assert close["float8_call"]["versus_step"] == 3 and close["float8_call"]["close"]
    assert close["close_call"] is False  # the float8 runner-up is far behind: only float8 itself is in doubt
    assert len(close["decide_with"]) == 2 and "--float8" in close["decide_with"][0]
    assert "--float8" not in close["decide_with"][1] and "--compile blocks" in close["decide_with"][1]
    assert "measured 0.67-" in close["sentence"] and "not settled" in close["sentence"]
    assert settled["float8_call"]["close"] is False and "decide_with" not in settled
    document = {"decision_path": [{"step": 2, "tokens_per_sec": 52_000}], "tokens_per_sec": 65_000,
                "throughput_source": "estimated"}
    assert "float8, +30.0% E over trial 3 without it, is within" in _short_why(document, close)
    assert "float8" not in _short_why(document, settled)
    # Without float8 anywhere, or with a runner-up without it (ranking_margin weighs that), no float8 call.
    bf16 = _step(1, request, tokens_per_sec=60_000, compile="blocks")
    assert "float8_call" not in why_winner(bf16, [bf16, _step(2, request, micro_batch=1)], request)


def test_a_failed_trial_is_one_line_and_each_trial_is_printed_once(tmp_path):
    """Without --verbose a finished trial prints nothing until the table; a failed one says so in one
    line, its message's first line (a torch error runs to dozens: the rest is in autotune.log)."""
    request = _request()
    console = Console()
    console.out = RealRichConsole(file=io.StringIO(), width=80, highlight=False)
    console.step(_step(1, request), 1)
    console.step(_step(2, request, status="error", fits=False, message=(
        "simulation failed: RuntimeError: boom\nException raised from foo at /pytorch/c10/core/x.cpp:1 "
        "(most recent call first):\nframe #0: c10::Error (Caffe2)")), 2)
    text = console.out.file.getvalue()
    # One note (wrapped at words to the width like any other), the first line of the message only.
    assert text.count("•") == 1 and text.startswith("• trial 2 "), text
    assert " ".join(text.split()) == "• trial 2 mb=2 ac=none: simulation failed: RuntimeError: boom (in full: autotune.log)"


def test_library_warnings_and_log_records_go_to_the_run_log(tmp_path, capfd):
    """bitsandbytes logs through the root logger, transformers and torch through their own stderr
    handlers, FutureWarnings through warnings: inside LibraryOutput each lands in autotune.log (held
    until the log exists), none on the console; on exit the libraries' handlers are back."""
    import logging
    import sys
    import warnings

    from autotune.results.run_folder import LibraryOutput, RunLog

    own = logging.getLogger("a_library_with_its_own_handler")
    own.propagate = False
    stderr_handler = logging.StreamHandler(sys.stderr)
    own.addHandler(stderr_handler)
    try:
        with LibraryOutput() as library:
            warnings.warn("`x` is deprecated", FutureWarning)  # before the run's folder exists: held
            log = RunLog(tmp_path / "run" / "autotune.log")
            library.attach(log)
            logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load CPU gemm_4bit_forward")
            own.warning("a torch-style message")
        log.close()
        captured = capfd.readouterr()
        assert captured.err == "" and captured.out == ""
        text = (tmp_path / "run" / "autotune.log").read_text()
        for said in ("FutureWarning: `x` is deprecated", "Failed to load CPU gemm_4bit_forward",
                     "a torch-style message"):
            assert said in text, text
        assert own.handlers == [stderr_handler]
    finally:
        own.removeHandler(stderr_handler)


def test_an_analytic_tune_prints_each_trial_once_in_80_columns(tmp_path, capsys):
    """The whole console of a cheap tune: every line within 80 columns, each trial one table row (the
    trial numbers of best.json's decision path, each once), and the step's own lines only with --verbose."""
    from autotune.drivers.cli import EXIT_OK, main

    argv = ["--model", "llama-7b", "--gpus", "8", "--global-tokens", "4M", "--backend", "analytic"]
    outputs = {}
    for verbose in (False, True):
        assert main([*argv, "--runs-dir", str(tmp_path / f"runs{verbose}"), *(["--verbose"] if verbose else [])]) \
            == EXIT_OK
        outputs[verbose] = capsys.readouterr().out.splitlines()
    lines = outputs[False]
    assert max(len(line) for line in lines) <= 80 and len(lines) <= 60, len(lines)
    document = json.loads(next((tmp_path / "runsFalse").glob("*/best.json")).read_text())
    steps = [entry["step"] for entry in document["decision_path"]]
    assert _trial_numbers(lines) == steps  # each trial once
    assert not any(line.lstrip().startswith("why: ") and "runner-up" not in line for line in lines)
    assert sum(line.lstrip().startswith("why: ") for line in outputs[True]) == len(steps) + 1
    assert _trial_numbers(outputs[True]) == steps + steps  # --verbose: as each finished, then the table
