"""What a person sees: one line per decision-graph step with its reason, a trial table, the winner.

Every figure is printed with what it is (measured, predicted, estimated). With --json the
human output is silenced and stdout carries only the result document.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from rich.console import Console as RichConsole
from rich.table import Table
from rich.text import Text

from autotune.units import format_bytes, format_count


def _figure(figure, fmt) -> str:
    if figure is None or figure.value is None:
        return "-"
    return f"{fmt(figure.value)} [dim]{figure.source}[/dim]"


def _basis(source: str, basis: str) -> str:
    """'measured: <basis>' without saying the source twice."""
    basis = basis.strip()
    return basis if basis.startswith(source) else f"{source}: {basis}"


def _tps(value: float) -> str:
    return f"{value:,.0f} tok/s"


_STATUS_STYLE = {"ok": "green", "oom": "red", "pruned": "yellow", "error": "magenta", "timeout": "magenta"}


class Console:
    def __init__(self, *, quiet: bool = False, notes_to_stderr: bool = False) -> None:
        """quiet: no human output on stdout (--json). notes_to_stderr: stdout carries data (trial)."""
        self.quiet = quiet
        self.notes_to_stderr = notes_to_stderr
        self.out = RichConsole(highlight=False, quiet=quiet, soft_wrap=True)
        if not self.out.is_terminal:  # logs and CI: wide enough for the trial table
            self.out.width = 150
        self.err = RichConsole(stderr=True, highlight=False, soft_wrap=True)
        self._status = None

    # -- plain lines -------------------------------------------------------------------------------
    def note(self, text: str) -> None:
        if self.notes_to_stderr:
            self.err.print(f"autotune: {text}", markup=False)
        else:
            self.out.print(Text("• ", style="cyan") + Text(text))  # user text is never markup

    def error_line(self, text: str) -> None:
        # One line, no markup interpretation of user-provided text.
        self.err.print(f"autotune: {text}", markup=False, highlight=False)

    def header(self, request, backend_name, backend_why, backend_description, store, finished, run_dir: Path) -> None:
        model, cluster = request.model, request.cluster
        self.out.print(f"[bold]autotune[/bold] {model.name} ({format_count(model.num_parameters)} parameters, "
                       f"{model.num_layers} × {model.block_class}) on {cluster.num_gpus} × {cluster.gpu.name}"
                       f" ({cluster.num_nodes} node{'s' if cluster.num_nodes > 1 else ''}), seq_len {request.seq_len}")
        self.note(f"backend: {backend_name} ({backend_why})")
        self.note(f"figures: {backend_description}")
        self.note(f"memory limit per GPU: {format_bytes(request.memory_limit_bytes)} "
                  f"({format_bytes(cluster.capacity_bytes)} less {request.headroom:.0%} headroom)")
        self.note(f"global batch target: {request.target_tokens:,} tokens per step "
                  f"(tolerance {request.tolerance:.1%}); micro-batch at most {request.max_micro_batch}")
        resumed = f", resuming {len(finished)} finished trials" if finished else ""
        self.note(f"study: {store.name}{resumed}; run folder: {run_dir}")

    # -- progress ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def progress(self):
        if self.quiet or not self.out.is_terminal:
            yield
            return
        with self.out.status("starting") as status:
            self._status = status
            try:
                yield
            finally:
                self._status = None

    def trial_started(self, stage: str, train, reason: str) -> None:
        if self._status is not None:
            self._status.update(f"[bold]{stage}[/bold] {train.label()}: running trial")

    def step(self, step, trial_number: int) -> None:
        result = step.result
        style = _STATUS_STYLE.get(result.status, "white")
        verdict = "fits" if step.fits else result.status
        reused = f" [dim](reused trial #{step.reused_from})[/dim]" if step.reused_from is not None else ""
        figures = f"peak {_figure(result.peak_memory, format_bytes)}"
        if result.tokens_per_sec is not None and result.tokens_per_sec.value is not None:
            figures += f", {_figure(result.tokens_per_sec, _tps)}"
        if step.prediction_error is not None:
            figures += f" [dim](tensor peak predicted {step.prediction_error:+.2%} off)[/dim]"
        self.out.print(f"[bold]{step.step:>2}[/bold] {step.stage:<13} {step.train.label():<38} "
                       f"[{style}]{verdict:<7}[/{style}] {figures}{reused}")
        self.out.print(Text(f"   why: {step.reason}", style="dim"))
        if result.message and result.status != "ok":
            self.out.print(Text(f"   {result.message}", style="dim"))

    # -- summaries ---------------------------------------------------------------------------------
    def trial_table(self, steps, request) -> None:
        if not steps:
            return
        table = Table(title="trials", show_lines=False)
        for column in ("#", "stage", "precision", "mb", "accum", "ac", "offload", "reshard", "status",
                       "peak memory", "tokens/s"):
            table.add_column(column)
        for s in steps:
            result = s.result
            table.add_row(str(s.step), s.stage, s.train.precision, str(s.train.micro_batch_size),
                          str(s.batch.grad_accum_steps), s.train.activation_checkpointing,
                          "yes" if s.train.cpu_offload else "no", "yes" if s.train.reshard_after_forward else "no",
                          "fits" if s.fits else result.status,
                          _figure(result.peak_memory, format_bytes), _figure(result.tokens_per_sec, _tps))
        self.out.print(table)

    def winner(self, document: dict, run_dir: Path, out: str | None) -> None:
        fsdp = document["fsdp"]
        self.out.print(
            f"[bold green]winner[/bold green]: {document['precision']} micro-batch {document['micro_batch_size']} × "
            f"{document['grad_accum_steps']} accumulation × {document['gpus']} GPUs × {document['seq_len']} = "
            f"{document['global_tokens']:,} tokens/step ({document['global_tokens_deviation']:+.2%} vs target), "
            f"checkpointing {fsdp['activation_checkpointing']}, offload {'on' if fsdp['cpu_offload'] else 'off'}, "
            f"reshard {'on' if fsdp['reshard_after_forward'] else 'off'}")
        peak = document["peak_memory_bytes"]
        tps = document["tokens_per_sec"]
        self.out.print(f"   peak {format_bytes(peak)} per GPU "
                       f"({_basis(document['memory_source'], document['memory_basis'])})", markup=False)
        if tps is not None:
            self.out.print(f"   {tps:,.0f} tokens/s "
                           f"({_basis(document['throughput_source'], document['throughput_basis'])})", markup=False)
        error = document.get("prediction_error")
        if error:
            self.out.print(f"   simulator vs measured tensor peak over {error['trials']} trials: median "
                           f"{error['median_abs']:.2%}, worst {error['max_abs']:.2%} off")
        checkpoint = document.get("checkpoint") or {}
        if checkpoint.get("recommended"):
            self.out.print(f"   checkpoint: save {checkpoint['recommended']} ({checkpoint['state_dict_type']}): "
                           f"{checkpoint['reason']} (estimated)", markup=False)
        self.out.print(f"   wrote {run_dir / 'best.json'}" + (f" and {out}" if out else ""))

    def exported(self, fmt: str, path: Path, warnings: list[str]) -> None:
        self.note(f"export {fmt}: {path}")
        for warning in warnings:
            self.err.print(f"autotune: warning: {fmt}: {warning}", markup=False)
