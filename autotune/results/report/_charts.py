"""Inline SVG charts for the report, drawn in Python: no script or network needed to see them.

Every mark says where its figure comes from (measured / predicted / estimated) in its tooltip
and label; the charts' captions say it once more.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

from autotune.backends.base import MEMORY_CATEGORIES

GiB = 2**30
COLORS = {
    "parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer_state": "#e15759", "activations": "#76b7b2",
    "communication_buffers": "#59a14f", "other": "#edc948", "runtime_overhead": "#b07aa1",
    "unclassified": "#bab0ac",
}
SERIES_COLORS = ("#4e79a7", "#e15759", "#59a14f", "#f28e2b", "#b07aa1", "#76b7b2", "#9c755f", "#ff9da7")
SOURCE_MARK = {"measured": "M", "predicted": "P", "estimated": "E", "predicted+estimated": "P+E"}


def _figure(record: dict[str, Any], key: str) -> tuple[float | None, str]:
    figure = (record.get("result") or {}).get(key) or {}
    return figure.get("value"), figure.get("source") or "?"


def _ticks(top: float, count: int = 5) -> list[float]:
    raw = top / count
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    # The last tick is at or above `top`: no point is ever drawn above the axis.
    return [i * step for i in range(math.ceil(top / step - 1e-9) + 1)]


def _legend(items: list[tuple[str, str]], *, marks: str = "") -> str:
    """An HTML legend under a chart (wraps, unlike SVG text)."""
    spans = "".join(f'<span><i style="background:{color}"></i>{escape(label)}</span>' for label, color in items)
    return f'<div class="legend">{spans}{marks}</div>'


def memory_chart(trials: list[dict[str, Any]], *, capacity: int, limit: int | None,
                 winner_step: int | None = None) -> str:
    """Stacked bars of per-GPU memory by category, one per trial in decision order, against the
    GPU capacity (solid) and the usable limit (dashed)."""
    bars = []
    for t in trials:
        peak, source = _figure(t, "peak_memory")
        breakdown = {k: v for k, v in ((t.get("result") or {}).get("memory_breakdown") or {}).items() if v}
        if not breakdown and peak:
            breakdown = {"unclassified": peak}
        if breakdown:
            bars.append((t, breakdown, peak or sum(breakdown.values()), source))
    if not bars:
        return '<p class="empty">No trial reported per-GPU memory.</p>'
    tallest = max(total for *_, total, _ in bars)
    top = min(max(capacity * 1.1, tallest * 1.05), capacity * 2.0)
    width, height, left, bottom, plot_top = max(640, 190 + 56 * len(bars)), 390, 62, 300, 40
    right = 130  # room for the capacity labels

    def y(value: float) -> float:
        return bottom - (bottom - plot_top) * min(value, top) / top

    out = [f'<svg class="chart" id="memory-chart" viewBox="0 0 {width} {height}" width="{width}" '
           f'height="{height}" role="img" aria-label="per-GPU memory by category per trial">']
    for tick in _ticks(top / GiB):
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{y(tick * GiB):.1f}" y2="{y(tick * GiB):.1f}" '
                   f'class="grid"/><text x="{left - 6}" y="{y(tick * GiB) + 4:.1f}" class="axis" '
                   f'text-anchor="end">{tick:g}</text>')
    out.append(f'<text x="14" y="{(plot_top + bottom) / 2:.0f}" class="axis" transform="rotate(-90 14 '
               f'{(plot_top + bottom) / 2:.0f})" text-anchor="middle">GiB per GPU</text>')
    for i, (t, breakdown, total, source) in enumerate(bars):
        x = left + 14 + 56 * i
        base = 0.0
        for category in (*MEMORY_CATEGORIES, "unclassified"):
            value = breakdown.get(category, 0)
            if value <= 0 or base >= top:
                base += max(value, 0)
                continue
            y0, y1 = y(base), y(base + value)
            out.append(f'<rect class="bar" x="{x}" y="{y1:.1f}" width="36" height="{max(y0 - y1, 0.5):.1f}" '
                       f'fill="{COLORS[category]}"><title>step {t["step"]} {escape(t["stage"])}: '
                       f'{escape(category)} {value / GiB:.2f} GiB ({source})</title></rect>')
            base += value
        status = t["status"]
        label = f"{total / GiB:.1f}{'+' if total > top else ''} {SOURCE_MARK.get(source, '?')}"
        css = "oom" if status == "oom" or not t.get("fits", status == "ok") else "value"
        out.append(f'<text x="{x + 18}" y="{y(total) - 4:.1f}" class="{css}" text-anchor="middle">'
                   f'{escape(label)}</text>')
        if css == "oom":
            out.append(f'<text x="{x + 18}" y="{y(total) - 16:.1f}" class="oom" text-anchor="middle">'
                       f'{escape(status.upper())}</text>')
        out.append(f'<text x="{x + 18}" y="{bottom + 14}" class="axis" text-anchor="middle">'
                   f'{t["step"]}</text>'
                   f'<text x="{x + 22}" y="{bottom + 26}" class="axis small" text-anchor="end" '
                   f'transform="rotate(-60 {x + 22} {bottom + 26})">{escape(t["stage"])}</text>')
        if t["step"] == winner_step:
            out.append(f'<text x="{x + 18}" y="{y(total) - 16:.1f}" class="winner" text-anchor="middle">'
                       '&#9733; winner</text>')
    for value, css, name in ((capacity, "capacity", "capacity"), (limit, "limit", "usable")):
        if value and value <= top:
            label_y = y(value) + (-4 if css == "capacity" else 12)
            out.append(f'<line x1="{left}" x2="{width - right}" y1="{y(value):.1f}" y2="{y(value):.1f}" class="{css}">'
                       f'<title>{name} {value / GiB:.2f} GiB</title></line>'
                       f'<text x="{width - right + 4}" y="{label_y:.1f}" class="{css}-label">'
                       f'{name} {value / GiB:.1f} GiB</text>')
    present = [c for c in (*MEMORY_CATEGORIES, "unclassified") if any(c in b for _, b, *_ in bars)]
    out.append("</svg>")
    marks = ('<span>bar labels: peak GiB and its source, M measured, P predicted, E estimated; '
             '<b class="oom">OOM</b> = over the usable limit</span>')
    return "".join(out) + _legend([(c.replace("_", " "), COLORS[c]) for c in present], marks=marks)


def _series_key(config: dict[str, Any]) -> str:
    parts = [f"ac={config.get('activation_checkpointing', '?')}"]
    parts.append("offload" if config.get("cpu_offload") else "no offload")
    if config.get("activation_offload"):
        parts.append("act-offload")
    if config.get("reshard_after_forward") is False:
        parts.append("no reshard")
    if config.get("precision", "bf16") != "bf16":
        parts.append(config["precision"])
    return ", ".join(parts)


class Log2Frame:
    """An SVG chart's frame: a log2 x axis from `low` to `high`, a linear y axis from 0 to a tick above
    `top_value` (no point drawn above the axis) with its grid lines; `out` holds the opening tag and
    the grid, for the caller to add its marks and close."""

    width, left, right = 1100, 78, 20  # the page width: no scaling

    def __init__(self, low: float, high: float, top_value: float, *, chart_id: str, aria: str, height: int,
                 bottom: int, plot_top: int, y_format=None) -> None:
        self.lo, self.hi = math.log2(low), math.log2(high)
        self.hi = self.hi if self.hi > self.lo else self.lo + 1
        self.top = _ticks(top_value * 1.05)[-1] if top_value else 1.0
        self.height, self.bottom, self.plot_top = height, bottom, plot_top
        self.out = [f'<svg class="chart" id="{chart_id}" viewBox="0 0 {self.width} {height}" width="{self.width}" '
                    f'height="{height}" role="img" aria-label="{escape(aria)}">']
        for tick in _ticks(self.top):
            self.out.append(f'<line x1="{self.left}" x2="{self.width - self.right}" y1="{self.y(tick):.1f}" '
                            f'y2="{self.y(tick):.1f}" class="grid"/><text x="{self.left - 6}" y="{self.y(tick) + 4:.1f}" '
                            f'class="axis" text-anchor="end">{(y_format or _short)(tick)}</text>')

    def x(self, value: float) -> float:
        return self.left + (self.width - self.left - self.right) * (math.log2(value) - self.lo) / (self.hi - self.lo)

    def y(self, value: float) -> float:
        return self.bottom - (self.bottom - self.plot_top) * value / self.top


def throughput_chart(trials: list[dict[str, Any]]) -> str:
    """Tokens/s against micro-batch (log2 axis), one line per checkpointing/offload setting;
    trials that fit are dots, out-of-memory ones crosses on the axis."""
    series: dict[str, list[tuple[int, float | None, dict[str, Any], str]]] = {}
    for t in trials:
        tps, source = _figure(t, "tokens_per_sec")
        micro = t["config"].get("micro_batch_size")
        if micro:
            fits = t.get("fits", t["status"] == "ok")
            series.setdefault(_series_key(t["config"]), []).append((micro, tps if fits else None, t, source))
    values = [v for points in series.values() for _, v, *_ in points if v]
    if not series:
        return '<p class="empty">No trial has a micro-batch size.</p>'
    micro_all = [m for points in series.values() for m, *_ in points]
    frame = Log2Frame(min(micro_all), max(micro_all), max(values) if values else 0.0, chart_id="throughput-chart",
                      aria="tokens per second against micro-batch size", height=335, bottom=290, plot_top=20)
    x, y, out = frame.x, frame.y, frame.out
    lo, hi, width, left, bottom, plot_top = frame.lo, frame.hi, frame.width, frame.left, frame.bottom, frame.plot_top
    # Every power of two in range, and every micro-batch a trial used (3, 6, 21 ...) too.
    labels = {2 ** p for p in range(int(math.floor(lo)), int(math.ceil(hi)) + 1) if lo <= p <= hi} | set(micro_all)
    placed: list[float] = []
    for micro in sorted(labels):
        if all(abs(x(micro) - other) >= 18 for other in placed):  # never two labels on top of each other
            placed.append(x(micro))
            out.append(f'<text x="{x(micro):.1f}" y="{bottom + 16}" class="axis" text-anchor="middle">{micro}</text>')
    out.append(f'<text x="{(left + width) / 2:.0f}" y="{bottom + 34}" class="axis" text-anchor="middle">'
               f'micro-batch size (sequences per GPU, log scale)</text>'
               f'<text x="14" y="{(plot_top + bottom) / 2:.0f}" class="axis" text-anchor="middle" '
               f'transform="rotate(-90 14 {(plot_top + bottom) / 2:.0f})">tokens/s (whole job)</text>')
    legend = []
    for index, (key, points) in enumerate(sorted(series.items())):
        color = SERIES_COLORS[index % len(SERIES_COLORS)]
        legend.append((key, color))
        fitting = sorted((m, v) for m, v, *_ in points if v)
        if len(fitting) > 1:
            path = " ".join(f"{'M' if i == 0 else 'L'}{x(m):.1f},{y(v):.1f}" for i, (m, v) in enumerate(fitting))
            out.append(f'<path d="{path}" class="series" stroke="{color}"/>')
        for micro, value, t, source in points:
            tip = (f'step {t["step"]} {t["stage"]}: micro-batch {micro}, {key}, '
                   + (f"{value:,.0f} tokens/s ({source})" if value else t["status"]))
            if value:
                out.append(f'<circle class="point fits" cx="{x(micro):.1f}" cy="{y(value):.1f}" r="5" '
                           f'fill="{color}"><title>{escape(tip)}</title></circle>')
            else:
                # Series often run out of memory at the same micro-batch: each gets its own place.
                cx, cy = x(micro) + 9 * (index - (len(series) - 1) / 2), bottom - 8
                out.append(f'<path class="point oom-mark" d="M{cx - 5:.1f},{cy - 5:.1f}L{cx + 5:.1f},{cy + 5:.1f}'
                           f'M{cx - 5:.1f},{cy + 5:.1f}L{cx + 5:.1f},{cy - 5:.1f}" stroke="{color}">'
                           f'<title>{escape(tip)}</title></path>')
    out.append("</svg>")
    marks = "<span>● fits &nbsp; ✕ out of memory (no throughput)</span>"
    return "".join(out) + _legend(legend, marks=marks)


def _short(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:g}{unit}"
    return f"{value:g}"
