"""A run's folder, runs/<run-id>/: its name, best.json's neighbours, and how the run ended.

    runs/                    --runs-dir, checked writable before any trial runs
      autotune.db            the study (autotune/search/store.py), unless --storage puts it elsewhere
      <run-id>/              a timestamp, the model and the GPU count (new_run_dir)
        status.json          running, done, nothing-fits, failed or interrupted (write_run_state)
        autotune.log         one line per event (RunLog)
        trials.csv           the run's trials (trials_csv), best.json, report.html, exports

Files here are written to a temporary name and renamed into place (autotune/util/files.py): never
half-written.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from autotune.util.errors import UsageError
from autotune.search.records import TuneRequest


def ensure_writable(runs_dir: Path) -> Path:
    """Create the runs folder and check it takes files, before any trial runs."""
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=runs_dir, prefix=".probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"runs directory {str(runs_dir)!r} is not writable ({exc.strerror}): "
                         "pass a writable folder with --runs-dir") from None
    return runs_dir


def new_run_dir(request: TuneRequest, runs_dir: Path) -> Path:
    """Create and claim runs/<run-id>/: a timestamp, the model and GPU count, and a suffix when
    another run (a rerun, a sweep worker) started in the same second."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.model.name)
    base = f"{stamp}-{name}-{request.cluster.num_gpus}gpu"
    for attempt in range(1, 1000):
        candidate = runs_dir / (base if attempt == 1 else f"{base}-{attempt}")
        try:
            candidate.mkdir(parents=True)  # atomic: exactly one run gets each folder
            return candidate
        except FileExistsError:
            continue
    raise UsageError(f"cannot create a run folder under {str(runs_dir)!r}: too many runs named {base}")


def trials_csv(records: list[dict[str, Any]]) -> str:
    """The trial table as CSV text (one row per trial, figures with their sources; an empty cell
    where a trial has no value). Written with the csv module: importing pandas for it cost
    0.4 s of every plan."""
    import csv
    import io

    rows = []
    for r in records:
        result = r["result"]
        peak = result.get("peak_memory") or {}
        tps = result.get("tokens_per_sec") or {}
        predicted = (r.get("predicted") or {}).get("peak_memory") or {}
        rows.append({
            "trial": r.get("number"), "step": r["step"], "stage": r["stage"], "status": r["status"],
            "fits": r["fits"], **{k: v for k, v in r["config"].items()},
            "grad_accum_steps": r["grad_accum_steps"], "global_tokens": r.get("global_tokens"),
            "peak_memory_bytes": peak.get("value"), "memory_source": peak.get("source"),
            "predicted_peak_bytes": predicted.get("value"),
            "tokens_per_sec": tps.get("value"), "throughput_source": tps.get("source"),
            "lost": r.get("lost") or "", "lost_detail": r.get("lost_detail") or "",
            "backend": r["backend"], "reason": r["reason"], "message": result.get("message", ""),
            "duration_s": result.get("duration_s"),
        })
    columns = list(dict.fromkeys(key for row in rows for key in row))  # in order of first appearance
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return text.getvalue()


def write_run_state(run_dir: Path, state: str, log=None) -> None:
    """runs/<id>/status.json: running, done, nothing-fits, failed or interrupted, with the time, so a
    folder left by a killed or failed run says so (and the log says it too)."""
    from autotune.util.files import write_json

    write_json(run_dir / "status.json", {"state": state,
                                         "time": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    if log is not None:
        log(f"state: {state}")


class RunLog:
    """runs/<id>/autotune.log: one line per event, flushed as it happens."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.logger = logging.getLogger(f"autotune.run.{path.parent.name}")
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False
        self.handler = logging.FileHandler(path)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        self.logger.addHandler(self.handler)

    def __call__(self, message: str) -> None:
        from autotune.util.secrets import mask

        self.logger.info(mask(message))

    def close(self) -> None:
        self.logger.removeHandler(self.handler)
        self.handler.close()


class LibraryOutput:
    """What the libraries a run uses print on their own (torch's and transformers' log records,
    bitsandbytes' "Failed to load CPU gemm_4bit_forward", FutureWarnings) goes to the run's
    autotune.log instead of the console, while this is open. The loggers that write to stderr have
    that handler swapped for one into the log; the root logger gets one too (libraries that set up
    none, like bitsandbytes); warnings.warn's messages are written there. What arrives before the run's
    log exists is held and written once `attach` gives it; with no log by the end, it is shown on
    stderr as it would have been."""

    def __init__(self) -> None:
        self._held: list[str] = []
        self._log: RunLog | None = None
        self._swapped: list[tuple[logging.Logger, logging.Handler]] = []
        self._warnings = None
        outer = self

        class _ToLog(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                outer.write(f"{record.name} {record.levelname}: {record.getMessage()}")

        self._handler = _ToLog(logging.WARNING)

    def write(self, text: str) -> None:
        if self._log is None:
            self._held.append(text)
        else:
            self._log(f"library: {text}")

    def attach(self, log: RunLog) -> None:
        self._log = log
        for text in self._held:
            log(f"library: {text}")
        self._held.clear()

    def __enter__(self) -> "LibraryOutput":
        import sys
        import warnings

        loggers = [logging.root, *(logger for logger in logging.root.manager.loggerDict.values()
                                   if isinstance(logger, logging.Logger))]
        for logger in loggers:
            for handler in list(logger.handlers):
                if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.__stderr__):
                    logger.removeHandler(handler)
                    logger.addHandler(self._handler)
                    self._swapped.append((logger, handler))
        if self._handler not in logging.root.handlers:
            logging.root.addHandler(self._handler)
            self._swapped.append((logging.root, None))
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: self.write(
            f"{category.__name__}: {message} ({filename}:{lineno})")
        return self

    def __exit__(self, *exc) -> None:
        import sys

        self._warnings.__exit__(*exc)
        for logger, handler in self._swapped:
            logger.removeHandler(self._handler)
            if handler is not None:
                logger.addHandler(handler)
        self._swapped.clear()
        for text in self._held:  # no run log came to be (the run stopped before its folder)
            print(text, file=sys.stderr)
        self._held.clear()
