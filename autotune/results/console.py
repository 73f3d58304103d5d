"""What a person sees: one line per decision-graph step with its reason, a trial table, the winner.

Every figure is printed with what it is (measured, predicted, estimated). With --json the
human output is silenced and stdout carries only the result document.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from pathlib import Path

from rich.console import Console as RichConsole
from rich.progress import Progress, ProgressColumn, SpinnerColumn, TextColumn
from rich.table import Column, Table
from rich.text import Text

from autotune.problem.batch import data_ranks_text
from autotune.problem.config import TrainConfig
from autotune.util.secrets import mask
from autotune.util.units import format_bytes, format_count


def _basis(source: str, basis: str) -> str:
    """'measured: <basis>' without saying the source twice."""
    basis = basis.strip()
    return basis if basis.startswith(source) else f"{source}: {basis}"


def _first_line(message: str | None) -> str:
    """A message's first line: a torch error can run to dozens (the rest goes to autotune.log)."""
    lines = (message or "").strip().splitlines()
    return lines[0] if lines else "no message"


def _tps(value: float) -> str:
    return f"{value:,.0f} tok/s"


_SOURCE_LETTER = {"measured": "M", "predicted": "P", "estimated": "E", "predicted+estimated": "P+E"}


def _short_figure(figure, fmt) -> str:
    if figure is None or figure.value is None:
        return "-"
    return f"{fmt(figure.value)} {_SOURCE_LETTER.get(figure.source, '?')}"


def _short_label(train) -> str:
    """'mb=2 ac=full offload no-rs': the configuration without its precision (said once above it)."""
    return train.label(omit=("precision",), short=True)


_SHORT_STAGE = {"checkpointing": "ckpt", "baseline": "base", "act-offload": "actoff"}


_STATUS_STYLE = {"ok": "green", "oom": "red", "pruned": "yellow", "error": "magenta", "timeout": "magenta"}


def _days(days: float) -> str:
    return f"{days:,.0f}" if days >= 100 else f"{days:.1f}"


def _compact(value: float) -> str:
    """56.6K, 1.2M: three significant figures in five or six characters (a table cell)."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


_SHORT_LIMIT = {"memory": "mem", "global batch": "batch", "communication": "comm", "search space": "space"}


class _Wrapped:
    """Text wrapped at words to the console's width, its continuation lines indented (a hanging
    indent under a bullet, or a block indented under the line it explains). No trailing spaces:
    piped output stays clean."""

    def __init__(self, text: Text, indent: int = 3, *, first: Text | None = None) -> None:
        self.text, self.indent, self.first = text, indent, first

    def __rich_console__(self, console, options):
        text = self.first + self.text if self.first is not None else self.text
        # The first line carries its own lead (a bullet, 'winner: '), the others the indent.
        lines = text.wrap(console, max(20, options.max_width - self.indent), no_wrap=False)
        for i, line in enumerate(lines):
            line.rstrip()
            yield line if i == 0 and self.first is not None else Text(" " * self.indent) + line


class _Trimmed:
    """A table without the spaces rich pads its last cells with (piped output stays clean)."""

    def __init__(self, renderable) -> None:
        self.renderable = renderable

    def __rich_console__(self, console, options):
        for segments in console.render_lines(self.renderable, options, pad=False):
            line = Text.assemble(*((segment.text, segment.style) for segment in segments if not segment.control))
            line.rstrip()
            yield line


class _PlanRows:
    """The plan's table, one line a row, then each winner in full whose row was cut to the width (an ellipsis), or
    that is always said (a pipeline's), wrapped at words under a bullet. The winner's cell takes what the other
    columns leave of the width: a long winner (a large plan's 'mb=2 full act-off hsdp=8 tp=4 pp=8 cmp f8r') is cut
    in its cell, not every figure beside it."""

    TITLE = "options (E estimated; days, GPU-h, cost from tok/s; exp: with losses; eff/GPU)"
    COLUMNS = (("option", "left"), ("winner", "left"), ("tok/s", "right"), ("days", "right"), ("exp", "right"),
               ("GPU-h", "right"), ("cost", "right"), ("eff", "right"), ("binds", "left"))

    def __init__(self, rows: list[tuple[str, ...]], winners: list[tuple[str, str, bool] | None]) -> None:
        self.rows, self.winners = rows, winners

    def table(self, width: int) -> Table:
        # At least as wide as its title: rich wraps a title to the table's width, and a plan whose
        # columns are all short (every option 100% efficient, binding on memory) would split it.
        # One space between columns (not two): the expected days beside the benchmark's still fit 80.
        table = Table(title=self.TITLE, box=None, pad_edge=False, padding=(0, 1, 0, 0), title_justify="left",
                      header_style="bold underline", min_width=len(self.TITLE))
        others = sum(max([len(name), *(len(row[i]) for row in self.rows)]) + 1
                     for i, (name, _) in enumerate(self.COLUMNS) if i != 1)
        for name, justify in self.COLUMNS:
            table.add_column(name, justify=justify, no_wrap=True,
                             max_width=max(len("nothing-fits"), width - others - 1) if name == "winner" else None)
        for row in self.rows:
            table.add_row(*row)
        return table

    def __rich_console__(self, console, options):
        lines = []
        for segments in console.render_lines(self.table(options.max_width), options, pad=False):
            line = Text.assemble(*((segment.text, segment.style) for segment in segments if not segment.control))
            line.rstrip()
            lines.append(line)
        yield from lines
        rows = lines[len(lines) - len(self.winners):]
        for line, winner in zip(rows, self.winners):
            if winner is not None and (winner[2] or "…" in line.plain):
                yield _hanging(Text("•", style="cyan"), Text(f"{winner[0]} winner: {winner[1]}"))


def _plan_winner(train, document: dict) -> str:
    """A plan option's winner in full: every knob but the precision (the plan's title says it), a pipeline's
    schedule named (1F1B too) and the accumulation steps (a pipeline's micro-batches a step):
    'mb=1 ac=full tp=4 pp=8 schedule=1F1B accum=16 (16 micro-batches a step through the pipeline)'."""
    text = train.label(omit=("precision", "pipeline_schedule"))
    accum = document.get("grad_accum_steps") or 1
    if train.pipeline_parallel > 1:
        return f"{text} schedule={train.pipeline_schedule} accum={accum} ({accum} micro-batch" \
               f"{'es' if accum > 1 else ''} a step through the pipeline)"
    return f"{text} accum={accum}"


def _hanging(mark: Text, text: Text) -> _Wrapped:
    """`• text`, the text wrapped under itself."""
    return _Wrapped(text, 2, first=mark + Text(" "))


def _indented(text: Text, indent: int = 3) -> _Wrapped:
    return _Wrapped(text, indent)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


def _peak_line(document: dict) -> str:
    """'peak 65.39 GiB/GPU P+E: tensor peak 62.72 GiB P + runtime 2.67 GiB E of a 71.68 GiB limit'."""
    letter = _SOURCE_LETTER.get(document["memory_source"], "?")
    line = f"peak {format_bytes(document['peak_memory_bytes'])}/GPU {letter}"
    parts = document.get("memory") or {}
    tensor, runtime = parts.get("tensor_peak"), parts.get("runtime")
    if tensor and runtime and runtime.get("total_bytes"):
        line += (f": tensor peak {format_bytes(tensor['bytes'])} {_SOURCE_LETTER.get(tensor['source'], '?')} "
                 f"+ runtime {format_bytes(runtime['total_bytes'])} {_SOURCE_LETTER.get(runtime['source'], '?')}")
    return line + f" (limit {format_bytes(document['memory_limit_bytes'])})"


def _throughput_line(document: dict) -> str:
    """'31,990 tok/s E for the job (27,150-36,830: from 61 held-out rows (...)), 3,999/GPU, 125 s/step,
    MFU 35.6%': the range names the held-out rows it comes from, or the line says "not validated on <gpu>"."""
    tps, gpus = document["tokens_per_sec"], document["gpus"]
    line = f"{tps:,.0f} tok/s {_SOURCE_LETTER.get(document['throughput_source'], '?')} for the job"
    span, source = document.get("tokens_per_sec_range"), document.get("tokens_per_sec_range_from")
    if span:
        line += f" ({span[0]:,.0f}-{span[1]:,.0f}" + (f": {source})" if source else ")")
    elif source:  # an estimate with no held-out row on its GPU family: "not validated on <gpu>"
        line += f" ({source})"
    line += f", {tps / gpus:,.0f}/GPU, {document['global_tokens'] / tps:.3g} s/step"
    if document.get("mfu"):
        line += f", MFU {document['mfu']:.1%}"
    return line


def _precision_words(train) -> str:
    """'bf16', or 'float8 tensorwise block linears, else bf16': a float8 winner is not a bf16 one."""
    if train.float8 == "none":
        return train.precision
    return f"float8 {train.float8} block linears, else {train.precision}"


_COMPILE_WORDS = {"none": "eager", "blocks": "compiled"}


def _side_by_side_line(document: dict) -> str | None:
    """'vs eager 44,790 E: compiled +34.2%, compiled float8 tensorwise +62.5%': the fastest fitting
    compiled and float8 configurations against the fastest eager one (best.json's compile section has
    every kind evaluated); None where one kind alone was."""
    rows = (document.get("compile") or {}).get("side_by_side") or []
    if len(rows) < 2 or (rows[0]["compile"], rows[0]["float8"]) != ("none", "none"):
        return None
    eager, *others = rows
    compiled = [row for row in others if row["float8"] == "none" and row.get("over_eager")]
    float8 = sorted((row for row in others if row["float8"] != "none" and row.get("over_eager")),
                    key=lambda row: row["over_eager"], reverse=True)[:1]
    parts = [f"{_COMPILE_WORDS.get(row['compile'], row['compile'])}"
             + (f" float8 {row['float8']}" if row["float8"] != "none" else "") + f" {row['over_eager'] - 1:+.1%}"
             for row in (*compiled, *float8)]
    if not parts:
        return None
    return (f"vs eager {eager['tokens_per_sec']:,.0f} {_SOURCE_LETTER.get(eager['throughput_source'], '?')}: "
            + ", ".join(parts))


def _short_why(document: dict, why: dict) -> str:
    """why_winner's sentence without the labels and commands (they are in best.json)."""
    runner = why.get("runner_up_step")
    if runner is None:
        return f"the only configuration that fits within the global batch's tolerance"
    entry = next((e for e in document["decision_path"] if e["step"] == runner), None)
    runner_tps = entry and entry.get("tokens_per_sec")
    text = f"ahead of the runner-up, trial {runner}"
    if runner_tps and document["tokens_per_sec"]:
        text = (f"{document['tokens_per_sec'] / runner_tps - 1:+.1%} "
                f"{_SOURCE_LETTER.get(document['throughput_source'], '?')} against the runner-up, trial {runner}")
    margin = why.get("close_call_margin")
    if why.get("close_call"):
        text += f": a close call, not settled (two estimates can be {margin:.1%} apart); a real trial of each decides"
    elif why.get("close_call") is False:
        text += f", beyond the {margin:.1%} two estimates can be apart"
    float8 = why.get("float8_call")
    if float8 and float8["close"]:  # float8 won on an estimate the one GPU measurement of it contradicts
        text += (f"; float8, {float8['lead']:+.1%} E over trial {float8['versus_step']} without it, is within the "
                 f"{float8['margin']:.0%} it has measured short: unsettled")
    return text


def _catalog_table(title: str, left: tuple[str, ...], right: tuple[str, ...]) -> Table:
    """A catalog listing's table: names left-aligned, figures right-aligned, no cell wrapped."""
    table = Table(title=title, box=None, pad_edge=False, padding=(0, 1), title_justify="left",
                  header_style="bold underline")
    for column in left + right:
        table.add_column(column, justify="left" if column in left else "right", no_wrap=True)
    return table


class _LiveWork:
    """The piece of work running now (a trial, a plan's options), its elapsed time and what is left.

    On a terminal: rich's progress display, one live line under the output. Piped, in a log or with
    --json: plain lines on stderr (stdout stays the summary, or the JSON): one when slow work starts
    (real trials, minutes each) and one a minute while anything runs, so a CI log shows it is alive."""

    HEARTBEAT_S = 60.0

    def __init__(self, console: "Console") -> None:
        self.console = console
        self.description = ""
        self.started: float | None = None
        self.expected_s: float | None = None
        self.basis = ""
        self._progress = None
        self._task = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "_LiveWork":
        terminal = self.console.out.is_terminal and not self.console.quiet
        if terminal:
            # One line: the description gives way (ellipsis) before the clock does.
            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}", table_column=Column(
                no_wrap=True, overflow="ellipsis", ratio=1)), _ClockColumn(self), expand=True,
                                      console=self.console.out, transient=True, refresh_per_second=2)
            self._progress.start()
            self._task = self._progress.add_task("starting", total=None)
        elif self.console.progress_lines:
            self._thread = threading.Thread(target=self._heartbeat, name="autotune-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._progress is not None:
            self._progress.stop()
        if self._thread is not None:
            self._thread.join(timeout=1)

    def begin(self, description: str, *, expected_s: float | None, basis: str, announce: bool = False,
              started: float | None = None) -> None:
        self.description, self.expected_s, self.basis = description, expected_s, basis
        self.started = time.monotonic() if started is None else started
        if self._progress is not None:
            self._progress.update(self._task, description=description, refresh=True)
        elif announce and self.console.progress_lines:
            self._plain(f"{description}: started, {self.remaining()}")

    def end(self) -> float | None:
        """The seconds the work took (None if nothing had begun)."""
        if self.started is None:
            return None
        seconds, self.started = time.monotonic() - self.started, None
        return seconds

    def remaining(self, *, basis: bool = True) -> str:
        said = f" ({self.basis})" if basis else ""
        if self.expected_s is None:
            return f"no estimate yet{said}"
        left = self.expected_s - (time.monotonic() - (self.started or time.monotonic()))
        if left <= 0:
            return f"past the expected {_clock(self.expected_s)}{said}"
        return f"~{_clock(left)} left{said}"

    def elapsed(self) -> str:
        return _clock(time.monotonic() - self.started) if self.started is not None else "0:00"

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.HEARTBEAT_S):
            if self.started is not None and time.monotonic() - self.started >= self.HEARTBEAT_S:
                self._plain(f"{self.description}: running {self.elapsed()}, {self.remaining()}")

    def _plain(self, text: str) -> None:
        self.console.error_line(text)  # one line on stderr, password masked


class _ClockColumn(ProgressColumn):
    """Progress column: '0:41 elapsed, ~1:20 left' (the estimate's basis goes in plain lines)."""

    def __init__(self, work: _LiveWork) -> None:
        super().__init__()
        self.work = work

    def render(self, task) -> Text:
        if self.work.started is None:
            return Text("")
        return Text(f"{self.work.elapsed()} elapsed, {self.work.remaining(basis=False)}", style="dim", no_wrap=True)


class Console:
    def __init__(self, *, quiet: bool = False, notes_to_stderr: bool = False, verbose: bool = False,
                 progress_lines: bool = False) -> None:
        """quiet: no human output on stdout (--json). notes_to_stderr: stdout carries data (trial).
        verbose: the winner's full bases, checkpoint advice and close-call commands (else in best.json).
        progress_lines: where no live line can be drawn (a pipe, --json), say on stderr that long work
        is alive (the command line's console; the library's quiet consoles stay silent).

        Output follows the terminal's width, and 80 columns where there is none (a pipe, a log):
        rich wraps at words. Error lines stay single lines (soft wrap) whatever their length."""
        self.quiet = quiet
        self.verbose = verbose
        self.notes_to_stderr = notes_to_stderr
        self.progress_lines = progress_lines
        self.out = RichConsole(highlight=False, quiet=quiet)
        self.err = RichConsole(stderr=True, highlight=False, soft_wrap=True)
        self._live: _LiveWork | None = None
        self._slow_work = False  # real trials (minutes each): plain start lines when piped
        self._trial_seconds: list[float] = []
        self._last_step = 0

    # -- plain lines -------------------------------------------------------------------------------
    def note(self, text: str) -> None:
        text = mask(text)
        if self.notes_to_stderr:
            self.err.print(f"autotune: {text}", markup=False)
        else:
            self.out.print(_hanging(Text("•", style="cyan"), Text(text)))  # user text is never markup

    def error_line(self, text: str) -> None:
        # One line, no markup interpretation of user-provided text, no storage password.
        self.err.print(f"autotune: {mask(text)}", markup=False, highlight=False)

    def header(self, request, backend_name, backend_why, backend_description, store, finished, run_dir: Path) -> None:
        model, cluster = request.model, request.cluster
        self._slow_work = backend_name in ("cpu", "cuda")
        # Names come from the user (a config path, _name_or_path): printed as text, never as markup.
        self.out.print(_Wrapped(Text(
            f"{model.name} ({format_count(model.num_parameters)} parameters, {model.num_layers} × "
            f"{model.block_class}) on {cluster.num_gpus} × {cluster.gpu.name} ({cluster.num_nodes} "
            f"node{'s' if cluster.num_nodes > 1 else ''}), seq_len {request.seq_len}, workload "
            f"{request.workload.label()}"), 0, first=Text("autotune ", style="bold")))
        self.note(f"backend: {backend_name} ({backend_why})")
        if model.attention is not None:  # stated (--attention); the default is in best.json only
            from autotune.problem.catalog.attention import kernel_note

            self.note(f"attention: {model.attention} (--attention)"
                      + (f"; {kernel_note(model.attention)}" if kernel_note(model.attention) else ""))
        if self.verbose:  # the backend's line above says what its figures are; this is their full basis
            self.note(f"figures: {backend_description}")
        if request.vllm_share:
            self.note(request.vllm_share["note"])
        if request.stack != "fsdp2":
            from autotune.problem.config import OWN_MODEL_STACKS, STACKS

            step = (f"{STACKS[request.stack]}'s own where it is built here, else autotune's on the Hugging Face "
                    "model (the winner says which)" if request.stack in OWN_MODEL_STACKS else STACKS[request.stack])
            self.note(f"stack: {request.stack}: the step traced and run is {step}")
        if request.finetuning.lora:
            from autotune.distributed.training import parameter_counts

            counts = parameter_counts(request.model, request.finetuning)
            self.note(f"training: {request.finetuning.label()}: {format_count(counts.trainable)} of "
                      f"{format_count(counts.total)} parameters train (counted on the model as peft wraps it)")
        if not request.routing_skew.balanced:
            self.note(f"MoE routing: {request.routing_skew.describe()}; with expert parallelism every trial "
                      "is predicted on the rank that receives the most tokens")
        if request.packing is not None:
            self.note(f"packed batches: each micro-batch one padding-free row of whole documents, the budget searched "
                      f"in steps of --seq-len {request.seq_len:,} (the longest document); {request.packing.lengths.describe()}; "
                      "memory predicted for a row filled to the budget, throughput estimated at the expected fill, "
                      "the global batch hit in expectation")
        self.note(f"memory limit: {request.describe_limit()}")
        self.note(f"global batch target: {request.target_tokens:,} tokens per step "
                  f"(tolerance {request.tolerance:.1%}); micro-batch at most {request.max_micro_batch}")
        resumed = f", resuming {len(finished)} finished trials" if finished else ""
        self.note(f"run folder: {run_dir} (study {store.name}{resumed})")

    # -- progress ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def progress(self):
        """While trials run: a live line on a terminal, plain lines on stderr otherwise."""
        with _LiveWork(self) as live:
            self._live = live
            try:
                yield live
            finally:
                self._live = None

    def trial_started(self, stage: str, train, reason: str) -> None:
        if self._live is None:
            return
        number = self._last_step + 1
        durations = self._trial_seconds
        if durations:
            expected = statistics.median(durations)
            basis = f"median of {len(durations)} earlier trial{'s' if len(durations) > 1 else ''}"
        else:
            expected, basis = None, "first trial of this run"
        self._live.begin(f"trial {number} {_SHORT_STAGE.get(stage, stage)} {_short_label(train)}",
                         expected_s=expected, basis=basis, announce=self._slow_work)

    def step(self, step, trial_number: int) -> None:
        """A finished trial. Each trial is printed once, in the table at the end; with --verbose also
        here as it finishes, with why it was run. A trial that failed says so now in one line (its
        message's first line: the rest, and any traceback, are in autotune.log)."""
        self._last_step = step.step
        if self._live is not None:
            seconds = self._live.end()
            if seconds is not None and step.reused_from is None:
                self._trial_seconds.append(seconds)
        result = step.result
        if result.status in ("error", "timeout") and not self.verbose:
            self.note(f"trial {step.step} {_short_label(step.train)}: {_first_line(result.message)} "
                      "(in full: autotune.log)")
        if not self.verbose:
            return
        style = _STATUS_STYLE.get(result.status, "white")
        verdict = "fits" if step.fits else result.status
        line = Text(f"{step.step:>2} ", style="bold") + Text(
            f"{_SHORT_STAGE.get(step.stage, step.stage):<7} {_short_label(step.train):<18} ")
        line += Text(f"{verdict:<6}", style=style)
        line += Text(f" {_short_figure(result.peak_memory, format_bytes)}")
        if result.tokens_per_sec is not None and result.tokens_per_sec.value is not None:
            line += Text(f", {_short_figure(result.tokens_per_sec, _tps)}")
        if step.prediction_error is not None:
            line += Text(f" (P {step.prediction_error:+.2%} off)", style="dim")
        if step.reused_from is not None:
            line += Text(" (reused from the study)", style="dim")
        self.out.print(_Wrapped(Text(""), first=line))
        self.out.print(_indented(Text(f"why: {step.reason}", style="dim")))
        if result.message and result.status != "ok":
            self.out.print(_indented(Text(_first_line(result.message), style="dim")))

    # -- summaries ---------------------------------------------------------------------------------
    def trial_table(self, steps, request, winner=None, runnable=None) -> None:
        """One row per trial, narrow enough for an 80-column terminal; the last column says how each
        ended, and for a trial that ran but lost, why in one word (records.why_lost; the sentence is in
        trials.csv and report.html)."""
        if not steps:
            return
        from autotune.search.records import why_lost

        precisions = sorted({s.train.precision for s in steps})
        legend = "".join(f"; {word}" for word, shown in (
            ("cmp: compiled blocks", any(s.train.compile != "none" for s in steps)),
            ("f8t/f8r: float8 tensorwise/rowwise", any(s.train.float8 != "none" for s in steps)),
            ("+: reused from the study", any(s.reused_from is not None for s in steps))) if shown)
        self.out.print(_Wrapped(Text(f"trials, {'/'.join(precisions)} (* winner; P/E/M: predicted/estimated/"
                                     f"measured{legend})", style="italic"), 0))
        table = Table(box=None, pad_edge=False, padding=(0, 1), header_style="bold underline")
        # Figures keep their width; a long configuration wraps at its spaces instead of being cut.
        for column, justify in (("#", "right"), ("stage", "left"), ("configuration", "left"), ("acc", "right"),
                                ("peak/GPU", "right"), ("job tok/s", "right"), ("result", "left")):
            table.add_column(column, justify=justify, no_wrap=column != "configuration")
        for s in steps:
            result = s.result
            mark = ("*" if winner is not None and s is winner else "") + ("+" if s.reused_from is not None else "")
            lost = why_lost(s, winner, request, runnable)
            outcome = "won" if winner is not None and s is winner else lost[0] if lost else \
                "fits" if s.fits else result.status
            table.add_row(f"{mark}{s.step}", _SHORT_STAGE.get(s.stage, s.stage), _short_label(s.train),
                          str(s.batch.grad_accum_steps),
                          _short_figure(result.peak_memory, format_bytes),
                          _short_figure(result.tokens_per_sec, lambda v: f"{v:,.0f}"),
                          Text(outcome, style=_STATUS_STYLE.get(result.status, "white")))
        self.out.print(_Trimmed(table))

    def winner(self, document: dict, run_dir: Path, out: str | None) -> None:
        """The winner in a few short lines; the full bases with --verbose (and always in best.json)."""
        fsdp = document["fsdp"]
        train = TrainConfig.from_result(document)
        self.out.print(_Wrapped(Text(
            f"{_short_label(train)} ({_precision_words(train)}), {document['grad_accum_steps']} accumulation "
            f"step{'s' if document['grad_accum_steps'] != 1 else ''} "
            f"x {data_ranks_text(document['gpus'], train.tensor_parallel, train.context_parallel, train.pipeline_parallel)} x "
            + (f"seq {document['seq_len']} = " if not document.get("packing") else
               f"{document['packing']['expected_tokens_per_micro_batch']:,.0f} packed tokens (expected) = ")
            + f"{document['global_tokens']:,} tokens/step "
            f"({document['global_tokens_deviation']:+.2%} vs target)"), first=Text("winner: ", style="bold green")))
        self.out.print(_indented(Text(_peak_line(document))))
        if packing := document.get("packing"):
            self.out.print(_indented(Text(
                f"packed: token budget {packing['token_budget']:,} per micro-batch (estimated {packing['fill']:.1%} filled, "
                f"{packing['documents_per_micro_batch']:.1f} documents); a step's tokens vary by about "
                f"{packing['global_tokens_spread']:,} (1 std) around the {document['global_tokens']:,} expected")))
        stack = document.get("stack") or {}
        if stack.get("name", "fsdp2") != "fsdp2":
            self.out.print(_indented(Text(f"stack {stack['name']}: {stack['predicted_for']}")))
        if document["tokens_per_sec"]:  # a figure of 0 (no throughput) has no step time
            self.out.print(_indented(Text(_throughput_line(document))))
            side_by_side = _side_by_side_line(document)
            if side_by_side:
                self.out.print(_indented(Text(side_by_side)))
        offload = document.get("offload_host_time")
        if offload and offload["host_s"] > 0.1 * offload["eager_step_s"]:
            accumulating = document["grad_accum_steps"] - 1
            self.out.print(_indented(Text(
                f"CPU offload: {offload['host_s']:.3g} s of each step is the host's work (E): its AdamW step"
                + (f" and {offload['accumulate_s']:.3g} s of blocking gradient copies in {accumulating} accumulating "
                   "micro-batches; fewer, larger micro-batches cut those" if offload["accumulate_s"] else ""),
                style="yellow")))
        offloads = [what for what, on in (("CPU offload", fsdp["cpu_offload"]),
                                          ("activation offload", fsdp.get("activation_offload"))) if on]
        if offloads and document.get("host_memory_bytes") is None and document.get("host_memory_per_node_bytes"):
            self.out.print(_indented(Text(
                f"assumes {format_bytes(document['host_memory_per_node_bytes'])} host memory per node for "
                f"{' and '.join(offloads)} (E), not checked: pass --host-memory", style="yellow")))
        error = document.get("prediction_error")
        if error:
            self.out.print(_indented(Text(f"simulator vs measured tensor peak, {error['trials']} trials: median "
                                          f"{error['median_abs']:.2%}, worst {error['max_abs']:.2%} off")))
        why = document.get("why_winner") or {}
        self.out.print(_indented(Text(f"why: {_short_why(document, why)}")))
        if self.verbose:
            self._winner_details(document, why)
        result_path = run_dir / "best.json"
        self.out.print(_indented(Text(f"wrote {result_path}" + (f" and {out}" if out else ""))))
        if not self.verbose:
            self.out.print(_indented(Text(  # one line: best.json holds them too, and the trial commands
                "why each trial lost, bases, ranges: report.html, trials.csv; --verbose: more", style="dim")))
        self.out.print(_indented(Text(f"next: autotune export {run_dir} --format fsdp2 (or accelerate, trl, "
                                      "torchtitan, ...: autotune export --help)", style="dim")))

    def _winner_details(self, document: dict, why: dict) -> None:
        """--verbose: every basis and range in full, each line wrapped at words."""
        lines = [f"memory: {_basis(document['memory_source'], document['memory_basis'])}"]
        if document["tokens_per_sec"]:
            lines.append(f"throughput: {_basis(document['throughput_source'], document['throughput_basis'])}")
        checkpoint = document.get("checkpoint") or {}
        if checkpoint.get("recommended"):
            lines.append(f"checkpoint: save {checkpoint['recommended']} ({checkpoint['state_dict_type']}): "
                         f"{checkpoint['reason']} (estimated)")
        if why.get("sentence"):
            lines.append(f"why, in full: {why['sentence']}")
        for command in why.get("decide_with") or []:
            lines.append(f"decide with: {command}")
        for line in lines:
            self.out.print(_indented(Text(line), 3))

    def plan_table(self, plan: dict) -> None:
        """One row per plan option, within 80 columns; every figure's source and range are in plan.json. Under
        the table, each winner in full (_plan_winner) where its row had to be cut to the width (a long parallel
        winner: 'mb=1 every:4 act-off hsdp=8 tp=4 pp=8 Inter...') and every pipeline's (its schedule and the
        micro-batches a step are no part of the short label)."""
        rows: list[tuple[str, ...]] = []
        winners: list[tuple[str, str, bool] | None] = []  # each row's (id, winner in full, always said)
        for option in plan["options"]:
            binds = _SHORT_LIMIT.get(option["binds"]["limit"], option["binds"]["limit"])
            if option["status"] != "ok":
                rows.append((option["id"], option["status"], "-", "-", "-", "-", "-", "-", binds))
                winners.append(None)
                continue
            tps, cost = option["tokens_per_sec"], option["cost"]
            days = option["time_to_train_s"]["value"] / 86400
            expected = option.get("expected_time_to_train_s")
            train = TrainConfig.from_result(option["result"])
            rows.append((option["id"], _short_label(train).replace("ac=", ""),
                         f"{_compact(tps['value'])} {_SOURCE_LETTER.get(tps['source'], '?')}",
                         _days(days), _days(expected["value"] / 86400) if expected else "never",
                         _compact(option["gpu_hours"]["value"]), _compact(cost["value"]) if cost else "-",
                         f"{option['scaling_efficiency']['value']:.0%}", binds))
            winners.append((option["id"], _plan_winner(train, option["result"]), train.pipeline_parallel > 1))
        self.out.print(_PlanRows(rows, winners))

    def seq_len_table(self, sequence: dict) -> None:
        """--seq-len max: the probes, throughput vs sequence length."""
        tables = sequence.get("by_gpu_type") or {"": sequence}
        for gpu_type, found in tables.items():
            self.note(f"sequence length{' on ' + gpu_type if gpu_type else ''}: longest that fits "
                      f"{found['max_seq_len'] or 'none'} (step {found['step']}; bound: {found['bound']})")
            table = Table(title="throughput vs sequence length (P predicted, E estimated)",
                          box=None, pad_edge=False, padding=(0, 1), title_justify="left",
                          header_style="bold underline")
            for column, justify in (("seq_len", "right"), ("fits", "left"), ("winner", "left"), ("peak/GPU", "right"),
                                    ("tok/s", "right")):
                table.add_column(column, justify=justify, no_wrap=True)
            for row in found["probes"]:
                if not row["fits"]:
                    table.add_row(str(row["seq_len"]), "no", "-", "-", "-")
                    continue
                winner = f"mb{row['micro_batch_size']} ac:{row['activation_checkpointing']}" + \
                    (" offload" if row["cpu_offload"] else "")
                table.add_row(str(row["seq_len"]), "yes", winner,
                              f"{format_bytes(row['peak_memory_bytes'])} "
                              f"{_SOURCE_LETTER.get(row['memory_source'], '?')}",
                              f"{row['tokens_per_sec']:,.0f} {_SOURCE_LETTER.get(row['throughput_source'], '?')}")
            self.out.print(_Trimmed(table))

    def exported(self, fmt: str, path: Path, warnings: list[str]) -> None:
        self.note(f"export {fmt}: {path}")
        for warning in warnings:
            self.err.print(f"autotune: warning: {fmt}: {warning}", markup=False)

    # -- the catalog (autotune models, autotune gpus) ----------------------------------------------
    def models_table(self, rows: list[dict]) -> None:
        """The catalog's models in 80 columns, then each one's source."""
        from autotune.problem.catalog.listing import MODELS_WHAT

        table = _catalog_table(f"catalog models: {MODELS_WHAT}", ("model", "type"),
                               ("params", "layers", "hidden", "heads", "experts", "seq"))
        for row in rows:
            table.add_row(row["name"], row["model_type"], format_count(row["num_parameters"]), str(row["num_layers"]),
                          f"{row['hidden_size']:,}", f"{row['num_attention_heads']}/{row['num_key_value_heads']}",
                          str(row["num_experts"] or "-"), str(row["default_seq_len"]))
        self.out.print(_Trimmed(table))
        self.out.print(_Wrapped(Text("heads: query/key-value; seq: the default --seq-len; --json for every field; "
                                     "sources:"), 0))
        self._sources(rows, "name")

    def _sources(self, rows: list[dict], key: str) -> None:
        for row in rows:
            source = row["source"] + (f"; float8: {row['float8_source']}" if row.get("float8_source") else "")
            self.out.print(_hanging(Text("•", style="cyan"), Text(f"{row[key]}: {source}")))

    def gpus_table(self, rows: list[dict]) -> None:
        """The catalog's GPUs in 80 columns, then each one's sources (the figures are data-sheet ones)."""
        from autotune.problem.catalog.listing import GPUS_WHAT

        table = _catalog_table(f"catalog GPUs: {GPUS_WHAT}", ("gpu",),
                               ("memory", "bf16", "float8", "fp32", "HBM", "in node", "network"))
        for row in rows:
            table.add_row(row["type"] + (" *" if row["default"] else ""), format_bytes(row["memory_bytes"]),
                          f"{row['peak_tflops']:g}", f"{row['float8_tflops']:g}" if row["float8_tflops"] else "-",
                          f"{row['fp32_tflops']:g}" if row["fp32_tflops"] else "-", f"{row['hbm_gbps']:,g}",
                          f"{row['intra_node_gbps']:g}", f"{row['inter_node_gbps']:g}")
        self.out.print(_Trimmed(table))
        self.out.print(_Wrapped(Text("* the default --gpu-type where none is detected; bf16 is fp16 where a GPU "
                                     "has no bf16; sources:"), 0))
        self._sources(rows, "type")
