"""plan.html: the plan on one self-contained page, next to plan.json.

Charts against the GPU count (log scale), one line per GPU type: tokens/s, cost (GPU-hours where
no --price was given), time to train, and per-GPU memory at the winner against the usable limit;
with --seq-len max, tokens/s against the sequence length. The table carries every figure with
its source and range. Same CSS and browser check as the run report (_page).
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from autotune.results.report._charts import SERIES_COLORS, Log2Frame, _legend, _short
from autotune.results.report._page import _gib, _src, page_head

Series = dict[str, list[tuple[float, float, str]]]  # name -> [(x, y, tooltip)]


def line_chart(series: Series, *, chart_id: str, x_label: str, y_label: str, dashed: Series | None = None,
               y_format=_short) -> str:
    """Lines over a log2 x axis; `dashed` series (a limit) drawn dashed in the same colours."""
    dashed = dashed or {}
    points = [p for pts in (*series.values(), *dashed.values()) for p in pts]
    if not points:
        return '<p class="empty">No option has this figure.</p>'
    xs = sorted({x for x, _, _ in points})
    frame = Log2Frame(xs[0], xs[-1], max(y for _, y, _ in points), chart_id=chart_id,
                      aria=f"{y_label} against {x_label}", height=300, bottom=255, plot_top=16, y_format=y_format)
    px, py, out = frame.x, frame.y, frame.out
    width, left, bottom, plot_top = frame.width, frame.left, frame.bottom, frame.plot_top
    for x in xs:
        out.append(f'<text x="{px(x):.1f}" y="{bottom + 16}" class="axis" text-anchor="middle">{x:g}</text>')
    out.append(f'<text x="{(left + width) / 2:.0f}" y="{bottom + 34}" class="axis" text-anchor="middle">'
               f'{escape(x_label)} (log scale)</text><text x="14" y="{(plot_top + bottom) / 2:.0f}" class="axis" '
               f'text-anchor="middle" transform="rotate(-90 14 {(plot_top + bottom) / 2:.0f})">{escape(y_label)}</text>')
    legend = []
    for index, name in enumerate(sorted(set(series) | set(dashed))):
        color = SERIES_COLORS[index % len(SERIES_COLORS)]
        legend.append((name, color))
        for pts, style in ((series.get(name, []), ""), (dashed.get(name, []), ' stroke-dasharray="6 4"')):
            pts = sorted(pts)
            if len(pts) > 1:
                path = " ".join(f"{'M' if i == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for i, (x, y, _) in enumerate(pts))
                out.append(f'<path d="{path}" class="series" stroke="{color}"{style}/>')
            for x, y, tip in pts:
                shape = (f'<circle class="point" cx="{px(x):.1f}" cy="{py(y):.1f}" r="5" fill="{color}">' if not style
                         else f'<rect class="point" x="{px(x) - 4:.1f}" y="{py(y) - 4:.1f}" width="8" height="8" '
                              f'fill="white" stroke="{color}">')
                out.append(f'{shape}<title>{escape(tip)}</title>{"</circle>" if not style else "</rect>"}')
    out.append("</svg>")
    return "".join(out) + _legend(legend)


def _by_type(plan: dict, figure: str, scale: float = 1.0) -> Series:
    series: Series = {}
    for option in plan["options"]:
        value = option.get(figure)
        if option["status"] == "ok" and value:
            rng = value.get("range")
            tip = (f"{option['id']}: {value['value'] * scale:,.4g} ({value['source']}"
                   + (f"; range {rng[0] * scale:,.4g}-{rng[1] * scale:,.4g}" if rng else "") + f"); {value['basis']}")
            series.setdefault(option["gpu_type"], []).append((option["gpus"], value["value"] * scale, tip))
    return series


def _range(figure: dict | None, fmt) -> str:
    if not figure:
        return "-"
    rng = figure.get("range")
    return (f"{fmt(figure['value'])}{_src(figure['source'])}"
            + (f'<br><span class="muted">{fmt(rng[0])}&ndash;{fmt(rng[1])}</span>' if rng else ""))


def _expected(option: dict) -> str:
    """The expected wall-clock and GPU-hours (autotune/estimate/time_to_train.py), each with its range; the basis on hover."""
    wall, hours = option.get("expected_time_to_train_s"), option.get("expected_gpu_hours")
    if not wall:
        never = (option.get("time_to_train_model") or {}).get("never_finishes")
        return escape(never) if never else "-"
    return (f'<span title="{escape(wall["basis"])}">{_range(wall, lambda v: f"{v / 86400:,.1f} d")}</span>'
            f'<br>{_range(hours, lambda v: f"{v:,.0f} GPU-h")}')


def _table(plan: dict) -> str:
    rows = []
    for o in plan["options"]:
        if o["status"] != "ok":
            rows.append(f'<tr class="bad"><td>{escape(o["id"])}</td><td colspan="8">{escape(o["status"])}</td>'
                        f'<td>{escape(o["binds"]["limit"])}: {escape(o["binds"]["detail"])}</td></tr>')
            continue
        c = o["configuration"]
        config = (f"mb {c['micro_batch_size']} &times; {c['grad_accum_steps']} acc, ac {escape(c['activation_checkpointing'])}"
                  + (", offload" if c["cpu_offload"] else "") + (f", hsdp {c['shard_group_size']}" if c["shard_group_size"] else "")
                  + (f", reshard to {c['reshard_group_size']}" if c["reshard_group_size"] else "")
                  + "".join(f", {flag} {c[name]}" for name, flag in (("tensor_parallel", "tp"), ("context_parallel", "cp"))
                            if c.get(name, 1) > 1)
                  + (f", pp {c['pipeline_parallel']} {escape(c['pipeline_schedule'])}" if c.get("pipeline_parallel", 1) > 1
                     else ""))
        rows.append(
            f'<tr><td>{escape(o["id"])}</td><td>{config}</td>'
            f'<td class="num">{_range(o["tokens_per_sec"], lambda v: f"{v:,.0f}")}</td>'
            f'<td class="num">{_range(o["time_to_train_s"], lambda v: f"{v / 86400:,.1f} d")}</td>'
            f'<td class="num">{_expected(o)}</td>'
            f'<td class="num">{_range(o["gpu_hours"], lambda v: f"{v:,.0f}")}</td>'
            f'<td class="num">{_range(o["cost"], lambda v: f"{v:,.0f}")}</td>'
            f'<td class="num">{_range(o["scaling_efficiency"], lambda v: f"{v:.0%}")}</td>'
            f'<td class="num">{_gib(o["peak_memory_bytes"]["value"])}{_src(o["peak_memory_bytes"]["source"])}'
            f'<br><span class="muted">limit {_gib(o["memory_limit_bytes"])}</span></td>'
            f'<td>{escape(o["binds"]["limit"])}<br><span class="muted">{escape(o["binds"]["detail"])}</span></td></tr>')
    # Every row shown (a plan has tens of options, not hundreds); ranges wrap under their figure.
    return ('<style>table.plan td.num{white-space:normal}table.plan td:first-child{white-space:nowrap}</style>'
            '<table class="plan"><tr><th>option</th><th>winner</th><th>tokens/s</th><th>time to train (benchmark)</th>'
            '<th>expected time, GPU-hours (with what runs lose)</th>'
            '<th>GPU-hours</th><th>cost</th><th>scaling eff.</th><th>peak/GPU</th><th>binds</th></tr>'
            + "".join(rows) + "</table>")


def _sequence(plan: dict) -> str:
    sequence = plan.get("sequence_length")
    if not sequence:
        return ""
    found = sequence.get("by_gpu_type") or {"": sequence}
    series: Series = {}
    for gpu_type, result in found.items():
        for row in result["probes"]:
            if row["fits"]:
                series.setdefault(gpu_type or "tokens/s", []).append(
                    (row["seq_len"], row["tokens_per_sec"], f"seq {row['seq_len']}: {row['tokens_per_sec']:,.0f} "
                                                           f"tokens/s ({row['throughput_source']})"))
    bounds = "; ".join(f"{escape(t or 'answer')}: {r['max_seq_len']} ({escape(r['bound'])})" for t, r in found.items())
    return (f"<h2>Sequence length (--seq-len max, on {sequence.get('gpus', '')} GPUs)</h2>"
            f'<p class="muted">{escape(sequence["method"])}. Longest that fits: {bounds}. The plan runs at '
            f'{sequence["max_seq_len"]}. Probes that fit:</p>'
            + line_chart(series, chart_id="seq-len-chart", x_label="sequence length", y_label="tokens/s (whole job)"))


def render_plan(plan: dict[str, Any]) -> str:
    model = plan["model"]
    title = f"autotune plan: {model['name']}, {plan['train_tokens']:,} tokens"
    priced = any(o.get("cost") for o in plan["options"])
    cost_chart = (line_chart(_by_type(plan, "cost"), chart_id="cost-chart", x_label="GPUs", y_label="cost (--price)")
                  if priced else line_chart(_by_type(plan, "gpu_hours"), chart_id="cost-chart", x_label="GPUs",
                                            y_label="GPU-hours (no --price given)"))
    memory = _by_type(plan, "peak_memory_bytes", scale=1 / 2**30)
    limits: Series = {}
    for o in plan["options"]:
        if o["status"] == "ok":
            limits.setdefault(o["gpu_type"], []).append(
                (o["gpus"], o["memory_limit_bytes"] / 2**30, f"{o['id']}: usable limit {_gib(o['memory_limit_bytes'])}"))
    return f"""{page_head(title)}
<div class="sub">{model['parameters']:,} parameters &middot; seq_len {plan['seq_len']} &middot; global batch
{escape(plan['global_tokens'])} tokens &middot; backend {escape(plan['backend'])} &middot; {plan['gpus_per_node']} GPUs per node
&middot; {escape(plan['provenance'].get('tool', ''))}, {escape(plan['provenance'].get('time', ''))}</div>
<h2>Tokens/s against GPU count</h2>
<p class="muted">Each option's winner (the tune command's); tooltips carry each figure's source, range and basis.</p>
{line_chart(_by_type(plan, "tokens_per_sec"), chart_id="tps-chart", x_label="GPUs", y_label="tokens/s (whole job)")}
<h2>{'Cost' if priced else 'GPU-hours'} to train</h2>
{cost_chart}
<h2>Time to train</h2>
{line_chart(_by_type(plan, "time_to_train_s", scale=1 / 86400), chart_id="time-chart", x_label="GPUs", y_label="days",
            y_format=lambda v: f"{v:g}")}
<h2>Memory at the limit</h2>
<p class="muted">Per-GPU peak of each winner (dots) against the usable limit after headroom (dashed squares).</p>
{line_chart(memory, chart_id="memory-chart", x_label="GPUs", y_label="GiB per GPU", dashed=limits,
            y_format=lambda v: f"{v:g}")}
{_sequence(plan)}
<h2>Options</h2>
{_table(plan)}
<p class="muted">Sources: <span class="src predicted">predicted</span> an exact trace of the real model;
<span class="src estimated">estimated</span> a model of the hardware (time, GPU-hours and cost follow from the
estimated tokens/s, ranges included). Each option's run folder has its own report.</p>
</body></html>
"""


def write_plan_report(folder: Path, plan: dict[str, Any]) -> Path:
    from autotune.util.files import write_atomic

    path = Path(folder) / "plan.html"
    write_atomic(path, render_plan(plan))
    return path
