"""What a person sees: one line per decision-graph step with its reason, a trial table, the winner.

Every figure is printed with what it is (measured, predicted, estimated). With --json the
human output is silenced and stdout carries only the result document.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from rich.console import Console as RichConsole
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from autotune.secrets import mask
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


_SOURCE_LETTER = {"measured": "M", "predicted": "P", "estimated": "E", "predicted+estimated": "P+E"}


def _short_figure(figure, fmt) -> str:
    if figure is None or figure.value is None:
        return "-"
    return f"{fmt(figure.value)} {_SOURCE_LETTER.get(figure.source, '?')}"


def _short_label(train) -> str:
    """'mb2 ac:full offload no-rs': the configuration in a couple of dozen characters (the
    precision is the run's, said in the table's title)."""
    parts = [f"mb{train.micro_batch_size}", f"ac:{train.activation_checkpointing}"]
    if train.cpu_offload:
        parts.append("offload")
    if getattr(train, "activation_offload", False):
        parts.append("act-off")
    if not train.reshard_after_forward:
        parts.append("no-rs")
    if getattr(train, "shard_group_size", 0):
        parts.append(f"hsdp{train.shard_group_size}")
    if getattr(train, "reshard_group_size", 0):
        parts.append(f"rs{train.reshard_group_size}")
    if getattr(train, "shard_placement", "dim0") != "dim0":
        parts.append(f"shard:{train.shard_placement}")
    if getattr(train, "optimizer_impl", "fused") != "fused":  # sampled trials vary it
        parts.append(train.optimizer_impl)
    if getattr(train, "compile", "none") != "none":
        parts.append("compiled")
    return " ".join(parts)


_SHORT_STAGE = {"checkpointing": "ckpt", "baseline": "base", "act-offload": "actoff"}


_STATUS_STYLE = {"ok": "green", "oom": "red", "pruned": "yellow", "error": "magenta", "timeout": "magenta"}


def _compact(value: float) -> str:
    """56.6K, 1.2M: three significant figures in five or six characters (a table cell)."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


_SHORT_LIMIT = {"memory": "mem", "global batch": "batch", "communication": "comm", "search space": "space"}


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
        text = mask(text)
        if self.notes_to_stderr:
            self.err.print(f"autotune: {text}", markup=False)
        else:
            self.out.print(Text("• ", style="cyan") + Text(text))  # user text is never markup

    def error_line(self, text: str) -> None:
        # One line, no markup interpretation of user-provided text, no storage password.
        self.err.print(f"autotune: {mask(text)}", markup=False, highlight=False)

    def header(self, request, backend_name, backend_why, backend_description, store, finished, run_dir: Path) -> None:
        model, cluster = request.model, request.cluster
        # Names come from the user (a config path, _name_or_path): printed as text, never as markup.
        self.out.print(f"[bold]autotune[/bold] {escape(model.name)} ({format_count(model.num_parameters)} "
                       f"parameters, {model.num_layers} × {escape(model.block_class)}) on {cluster.num_gpus} × "
                       f"{escape(cluster.gpu.name)}"
                       f" ({cluster.num_nodes} node{'s' if cluster.num_nodes > 1 else ''}), seq_len {request.seq_len}")
        self.note(f"backend: {backend_name} ({backend_why})")
        self.note(f"figures: {backend_description}")
        self.note(f"workload: {request.workload.label()}")
        if request.finetuning.lora:
            from autotune.training import parameter_counts

            counts = parameter_counts(request.model, request.finetuning)
            self.note(f"training: {request.finetuning.label()}: {format_count(counts.trainable)} of "
                      f"{format_count(counts.total)} parameters train (counted on the model as peft wraps it)")
        self.note(f"memory limit per GPU: {request.describe_limit()}")
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
        reused = " [dim](reused trial from the study: not run again)[/dim]" if step.reused_from is not None else ""
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
    def trial_table(self, steps, request, winner=None) -> None:
        """One row per trial, narrow enough for an 80-column terminal (details are in report.html)."""
        if not steps:
            return
        precisions = sorted({s.train.precision for s in steps})
        table = Table(title=f"trials, {'/'.join(precisions)} (* winner; P/E/M predicted/estimated/measured; "
                            "tok/s: whole job)",
                      box=None, pad_edge=False, padding=(0, 1), title_justify="left", header_style="bold underline")
        for column, justify, width in (("#", "right", 3), ("stage", "left", 7), ("configuration", "left", None),
                                       ("acc", "right", 4), ("status", "left", 6), ("peak/GPU", "right", 11),
                                       ("tok/s", "right", None)):
            table.add_column(column, justify=justify, no_wrap=True, min_width=width)
        for s in steps:
            result = s.result
            mark = "*" if winner is not None and s is winner else ""
            table.add_row(f"{mark}{s.step}", _SHORT_STAGE.get(s.stage, s.stage), _short_label(s.train),
                          str(s.batch.grad_accum_steps), "fits" if s.fits else result.status,
                          _short_figure(result.peak_memory, format_bytes),
                          _short_figure(result.tokens_per_sec, lambda v: f"{v:,.0f}"))
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
        if tps:  # a figure of 0 (no throughput) has no step time
            gpus = document["gpus"]
            step_s = document["global_tokens"] / tps
            mfu = document.get("mfu")
            mfu_text = f", MFU {mfu:.1%}" if mfu else ""
            self.out.print(f"   {tps:,.0f} tokens/s for the whole job = {tps / gpus:,.0f} per GPU, "
                           f"{step_s:.3g} s per optimizer step{mfu_text} "
                           f"({_basis(document['throughput_source'], document['throughput_basis'])})", markup=False)
        offloads = [what for what, on in (("CPU offload", fsdp["cpu_offload"]),
                                          ("activation offload", fsdp.get("activation_offload"))) if on]
        if offloads and document.get("host_memory_bytes") is None and document.get("host_memory_per_node_bytes"):
            self.out.print(f"   assumes {format_bytes(document['host_memory_per_node_bytes'])} of host memory per "
                           f"node for {' and '.join(offloads)} (estimated), not checked: pass --host-memory to "
                           "check it", markup=False, style="yellow")
        error = document.get("prediction_error")
        if error:
            self.out.print(f"   simulator vs measured tensor peak over {error['trials']} trials: median "
                           f"{error['median_abs']:.2%}, worst {error['max_abs']:.2%} off")
        checkpoint = document.get("checkpoint") or {}
        if checkpoint.get("recommended"):
            self.out.print(f"   checkpoint: save {checkpoint['recommended']} ({checkpoint['state_dict_type']}): "
                           f"{checkpoint['reason']} (estimated)", markup=False)
        why = document.get("why_winner") or {}
        if why.get("sentence"):
            self.out.print(f"   why: {why['sentence']}", markup=False)
        self.out.print(f"   wrote {run_dir / 'best.json'}" + (f" and {out}" if out else ""))

    def plan_table(self, plan: dict) -> None:
        """One row per plan option, within 80 columns; every figure's source and range are in plan.json."""
        from autotune.config import TrainConfig

        table = Table(title="options (E estimated; days, GPU-h, cost from tok/s; eff: per GPU vs smallest)",
                      box=None, pad_edge=False, padding=(0, 1), title_justify="left", header_style="bold underline")
        for column, justify in (("option", "left"), ("winner", "left"), ("tok/s", "right"), ("days", "right"),
                                ("GPU-h", "right"), ("cost", "right"), ("eff", "right"), ("binds", "left")):
            table.add_column(column, justify=justify, no_wrap=True)
        for option in plan["options"]:
            binds = _SHORT_LIMIT.get(option["binds"]["limit"], option["binds"]["limit"])
            if option["status"] != "ok":
                table.add_row(option["id"], option["status"], "-", "-", "-", "-", "-", binds)
                continue
            tps, cost = option["tokens_per_sec"], option["cost"]
            days = option["time_to_train_s"]["value"] / 86400
            table.add_row(option["id"], _short_label(TrainConfig.from_result(option["result"])).replace("ac:", ""),
                          f"{_compact(tps['value'])} {_SOURCE_LETTER.get(tps['source'], '?')}",
                          f"{days:,.0f}" if days >= 100 else f"{days:.1f}",
                          _compact(option["gpu_hours"]["value"]), _compact(cost["value"]) if cost else "-",
                          f"{option['scaling_efficiency']['value']:.0%}", binds)
        self.out.print(table)

    def seq_len_table(self, sequence: dict) -> None:
        """--seq-len max: the probes, throughput vs sequence length."""
        tables = sequence.get("by_gpu_type") or {"": sequence}
        for gpu_type, found in tables.items():
            self.note(f"sequence length{' on ' + gpu_type if gpu_type else ''}: longest that fits "
                      f"{found['max_seq_len'] or 'none'} (step {found['step']}; bound: {found['bound']})")
            table = Table(title="throughput vs sequence length (P predicted, E estimated)",
                          box=None, pad_edge=False, padding=(0, 1), title_justify="left",
                          header_style="bold underline", width=80)
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
            self.out.print(table)

    def exported(self, fmt: str, path: Path, warnings: list[str]) -> None:
        self.note(f"export {fmt}: {path}")
        for warning in warnings:
            self.err.print(f"autotune: warning: {fmt}: {warning}", markup=False)
