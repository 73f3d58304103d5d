"""The report of a real small run: self-contained, every figure with its source, and rendered
without errors by headless Chromium (installed by tests/setup_browser.sh)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from autotune.results.report import render_report, write_report

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT = ROOT / "docs" / "report.png"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict, list[dict]]:
    """A real (analytic) run whose 2.5 GiB GPUs force out-of-memory trials and checkpointing."""
    from autotune.drivers.cli import main
    from autotune.search.store import STUDY_DB, TrialStore

    runs = tmp_path_factory.mktemp("runs")
    assert main(["--model", "tiny-llama", "--gpus", "2", "--global-tokens", "64K", "--backend", "analytic",
                 "--gpu-memory", "2.5GiB", "--seq-len", "1024", "--runs-dir", str(runs)]) == 0
    (run_dir,) = [p.parent for p in runs.glob("*/best.json")]
    result = json.loads((run_dir / "best.json").read_text())
    trials = TrialStore(f"sqlite:///{runs / STUDY_DB}", result["study"]).trials(run_id=result["run_id"])
    assert any(t["status"] == "oom" for t in trials) and len(trials) >= 5
    return run_dir, result, trials


def test_report_is_self_contained_and_labels_every_figure(run):
    _, result, trials = run
    html = render_report(result, trials)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # nothing fetched
    assert "<link" not in html and "<script src" not in html and "@import" not in html
    assert html.count('<svg class="chart"') == 2
    assert html.count('class="bar"') >= len(trials)  # at least one segment per trial
    assert html.count('class="point oom-mark"') == sum(1 for t in trials if not t["fits"])
    table = html[html.index('<table id="trials"'):]
    assert table.count("<tr class=") == len(trials)
    # Each trial's figures carry their source.
    for t in trials:
        source = t["result"]["peak_memory"]["source"]
        assert f'<span class="src {source}">' in table
    assert html.count("<li>") >= len(result["decision_path"])
    assert "Recommended: " + result["checkpoint"]["recommended"] in html


def test_predicted_versus_measured_shows_the_error(run):
    _, result, trials = run
    measured = copy.deepcopy(trials[0])
    measured["result"]["peak_memory"] = {"value": 100 * 2**20, "source": "measured", "basis": "cpu trial"}
    measured["predicted"] = copy.deepcopy(measured["result"])
    measured["predicted"]["peak_memory"] = {"value": 110 * 2**20, "source": "predicted", "basis": "trace"}
    html = render_report(result, [measured, *trials[1:]])
    section = html[html.index('<table id="predicted-vs-measured"'):]
    assert "+10.0%" in section.split("</table>")[0]
    assert "No trial has both" in render_report(result, trials)


def test_write_report_replaces_the_file_atomically(run, tmp_path):
    _, result, trials = run
    (tmp_path / "report.html").write_text("old")
    path = write_report(tmp_path, result, trials)
    assert path == tmp_path / "report.html" and path.read_text().startswith("<!DOCTYPE html>")
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]


def test_the_tuning_run_wrote_its_report_and_autotune_report_rebuilds_it(run):
    from autotune.drivers.cli import main

    run_dir, _, _ = run
    written = (run_dir / "report.html").read_text()
    (run_dir / "report.html").unlink()
    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "report.html").read_text() == written


def _browser() -> str:
    subprocess.run(["bash", str(ROOT / "tests" / "setup_browser.sh")], capture_output=True, timeout=600)
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    log = Path(tempfile.gettempdir()) / "autotune-setup-browser.log"
    reason = log.read_text().strip().splitlines()[-1] if log.exists() and log.read_text().strip() else "unknown"
    message = f"no Chromium: tests/setup_browser.sh could not install it ({reason})"
    if os.environ.get("CI"):  # CI promises the browser check: never let it pass by skipping
        pytest.fail(message)
    pytest.skip(message)


def _chromium(browser: str, *args: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                   "--disable-background-networking", "--disable-component-update", "--disable-sync",
                   f"--user-data-dir={profile}", *args]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                   start_new_session=True)
        try:
            output, _ = process.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the browser and its helpers
            process.communicate()
            pytest.fail("headless Chromium did not finish in 90 s")
        return output


def test_report_renders_in_headless_chromium(run, tmp_path):
    browser = _browser()
    run_dir, _, _ = run
    url = (run_dir / "report.html").resolve().as_uri()
    dom = _chromium(browser, "--virtual-time-budget=3000", "--dump-dom", url)
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert 'data-rendered="ok"' in body, body
    assert 'data-charts="2"' in body and "data-js-errors" not in body, body
    assert dom.count('class="bar"') > 0 and dom.count('class="point') > 0
    shot = tmp_path / "report.png"
    _chromium(browser, "--window-size=1280,1500", "--hide-scrollbars", f"--screenshot={shot}", url)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    if os.environ.get("AUTOTUNE_UPDATE_SCREENSHOT"):  # refresh docs/report.png from this run
        shutil.copyfile(shot, SCREENSHOT)


def test_throughput_axis_covers_every_point_and_steps_are_numbered_once(run):
    _, result, trials = run
    html = render_report(result, trials)
    chart = html[html.index('id="throughput-chart"'):]
    chart = chart[:chart.index("</svg>")]
    grid = [float(v) for v in re.findall(r'class="grid"/><text x="[\d.]+" y="([\d.]+)"', chart)]
    points = [float(v) for v in re.findall(r'<circle class="point fits" cx="[\d.]+" cy="([\d.]+)"', chart)]
    assert points and grid
    assert min(points) >= min(grid) - 4.0 - 0.5, "a point is drawn above the top tick"  # label y = line y + 4
    # One numbering: the decision path's 1-based steps, nowhere an Optuna trial number.
    steps = {t["step"] for t in trials}
    assert min(steps) == 1
    assert "trial #" not in html and "<th>#</th>" not in html
    for step in steps:
        assert f"step {step} " in chart or f'<td class="num">{step}</td>' in html


def test_report_says_why_the_winner_won_and_what_was_not_explored(run):
    _, result, trials = run
    html = render_report(result, trials)
    why = result["why_winner"]
    assert why["winner_step"] in {t["step"] for t in trials if t["fits"]}
    if why["runner_up_step"] is not None:
        runner = next(t for t in trials if t["step"] == why["runner_up_step"])
        winner = next(t for t in trials if t["step"] == why["winner_step"])
        assert runner["fits"]
        assert winner["result"]["tokens_per_sec"]["value"] >= runner["result"]["tokens_per_sec"]["value"]
    assert 'id="why-winner"' in html and 'id="not-explored"' in html
    for note in result["notes"]:
        assert html_escape(note) in html


def html_escape(text: str) -> str:
    from html import escape

    return escape(text)


def test_every_micro_batch_a_trial_used_has_a_tick(run):
    """Not only powers of two: micro-batch 3 (a bisection step) gets its label. Labels closer than
    18 px are thinned, which on this log axis only happens above 16."""
    _, result, trials = run
    html = render_report(result, trials)
    chart = html[html.index('id="throughput-chart"'):]
    chart = chart[:chart.index("</svg>")]
    ticks = {int(v) for v in re.findall(r'class="axis" text-anchor="middle">(\d+)</text>', chart)}
    used = {t["config"]["micro_batch_size"] for t in trials}
    assert any(m & (m - 1) for m in used), "the run should include a micro-batch that is not a power of two"
    assert {m for m in used if m <= 16} <= ticks
