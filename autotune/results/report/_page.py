"""report.html: one self-contained page (inline CSS, inline SVG, a few lines of inline script).

It opens offline: no CDN, no external file. The script only checks that the charts are there
(`data-rendered="ok"` on <body>) and records JavaScript errors in `data-js-errors`, which is
what the browser test reads.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from autotune.results.report._charts import memory_chart, throughput_chart
from autotune.util.units import format_bytes

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1180px;
color:#1d2330;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #dde2ea;padding-bottom:4px}
.sub{color:#5b6478}.cards{display:flex;flex-wrap:wrap;gap:12px;margin:14px 0}
.card{border:1px solid #dde2ea;border-radius:8px;padding:10px 14px;min-width:190px}
.card b{display:block;font-size:18px}.src{font-size:11px;border-radius:4px;padding:1px 5px;margin-left:4px;
text-transform:uppercase;letter-spacing:.03em}.src.measured{background:#d9f2e0;color:#155d2b}
.src.predicted{background:#dce8fb;color:#1c4a8f}.src.estimated{background:#fdf0d5;color:#7a5200}
table{border-collapse:collapse;width:100%;font-size:12.5px}th,td{border-bottom:1px solid #edf0f5;padding:4px 6px;
text-align:left;vertical-align:top}th{background:#f5f7fa;position:sticky;top:0}td.num{text-align:right;white-space:nowrap;
font-variant-numeric:tabular-nums}tr.win td{background:#eef8f0}tr.bad td{color:#8d2a2a}
svg.chart{width:100%;height:auto;max-width:1180px}.chart text.axis{font-size:11px;fill:#5b6478}.chart text.small{font-size:10px}.chart .grid{stroke:#edf0f5}
.chart .capacity{stroke:#c0392b;stroke-width:2}.chart .limit{stroke:#c0392b;stroke-dasharray:6 4}
.chart .capacity-label,.chart .limit-label{font-size:11px;fill:#c0392b}.chart text.value{font-size:10px;fill:#333}
.chart text.winner{font-size:11px;fill:#155d2b;font-weight:700}
.chart text.oom,b.oom{font-size:10px;fill:#c0392b;color:#c0392b;font-weight:700}
.chart .series{fill:none;stroke-width:2}.chart .oom-mark{stroke-width:2.5;fill:none}
.legend{display:flex;flex-wrap:wrap;gap:6px 16px;font-size:12px;color:#444;margin:4px 0 0 60px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:5px;vertical-align:-1px}
ol.path li{margin:3px 0}.muted{color:#7a8294}.empty{color:#7a8294;font-style:italic}
.scroll{max-height:460px;overflow:auto;border:1px solid #edf0f5}
"""

_SCRIPT = """
window.onerror = function (message) {
  var errors = document.body.getAttribute('data-js-errors') || '';
  document.body.setAttribute('data-js-errors', errors + (errors ? ' | ' : '') + message);
};
document.addEventListener('DOMContentLoaded', function () {
  var charts = document.querySelectorAll('svg.chart');
  var drawn = 0;
  charts.forEach(function (svg) {
    if (svg.querySelectorAll('rect.bar, .point').length > 0 && svg.getBBox().width > 0) { drawn += 1; }
  });
  document.body.setAttribute('data-charts', String(drawn));
  document.body.setAttribute('data-rendered', drawn === charts.length && drawn > 0 ? 'ok' : 'incomplete');
});
"""


def _gib(value: float | None) -> str:
    return "-" if value is None else format_bytes(value)


def _tokens(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _src(source: str | None) -> str:
    return f'<span class="src {escape(source or "")}">{escape(source or "?")}</span>' if source else ""


def _config_label(config: dict[str, Any]) -> str:
    parts = [config.get("precision", "?"), f"mb={config.get('micro_batch_size', '?')}",
             f"ac={config.get('activation_checkpointing', '?')}"]
    if config.get("cpu_offload"):
        parts.append("offload")
    if config.get("activation_offload"):
        parts.append("act-offload")
    if config.get("reshard_after_forward") is False:
        parts.append("no-reshard")
    return " ".join(str(p) for p in parts)


def _cards(result: dict[str, Any]) -> str:
    fsdp = result["fsdp"]
    tps = result.get("tokens_per_sec")
    cards = [
        ("winner", f"{result['precision']} mb={result['micro_batch_size']} x {result['grad_accum_steps']} accum",
         f"ac={fsdp['activation_checkpointing']}, offload {'on' if fsdp['cpu_offload'] else 'off'}, "
         f"reshard {'on' if fsdp['reshard_after_forward'] else 'off'}"),
        ("peak memory per GPU", _gib(result.get("peak_memory_bytes")) + _src(result.get("memory_source")),
         result.get("memory_basis", "")),
        ("stack", escape((result.get("stack") or {}).get("name", "fsdp2")),
         (result.get("stack") or {}).get("predicted_for", "memory predicted for autotune's own FSDP2 loop")),
        ("throughput (whole job)", ("-" if tps is None else f"{tps:,.0f} tokens/s") + _src(result.get("throughput_source")),
         result.get("throughput_basis", "")),
        ("global batch", f"{result['global_tokens']:,} tokens",
         f"target {result['global_tokens_target']:,}; seq_len {result['seq_len']}"),
    ]
    routing = result.get("routing_skew")  # a MoE model's routing assumption (autotune/problem/routing.py)
    if routing:
        cards.append(("MoE routing", escape(routing["kind"]), f"{routing['assumption']}; {routing['note']}"))
    return '<div class="cards">' + "".join(
        f'<div class="card"><span class="muted">{escape(title)}</span><b>{value}</b>'
        f'<span class="muted">{escape(note)}</span></div>' for title, value, note in cards) + "</div>"


def _trial_table(trials: list[dict[str, Any]], winner_step: int | None, lost: dict[int, str]) -> str:
    head = ("step", "stage", "config", "accum", "status", "peak memory", "tokens/s", "backend", "why / message")
    rows = []
    for t in trials:
        result = t.get("result") or {}
        peak, tps = result.get("peak_memory") or {}, result.get("tokens_per_sec") or {}
        fits = t.get("fits", t["status"] == "ok")
        css = "win" if t["step"] == winner_step else ("bad" if not fits else "")
        why = escape(t.get("reason", "")) + "".join(
            f'<br><span class="muted">{escape(text)}</span>' for text in (lost.get(t["step"]), result.get("message"))
            if text)
        rows.append(
            f'<tr class="{css}"><td class="num">{t["step"]}</td>'
            f'<td>{escape(t["stage"])}</td><td>{escape(_config_label(t["config"]))}</td>'
            f'<td class="num">{t.get("grad_accum_steps", "")}</td><td>{escape(t["status"])}'
            f'{"" if fits else " (does not fit)" if t["status"] == "ok" else ""}</td>'
            f'<td class="num">{_gib(peak.get("value"))}{_src(peak.get("source"))}</td>'
            f'<td class="num">{_tokens(tps.get("value"))}{_src(tps.get("source"))}</td>'
            f'<td>{escape(t.get("backend", ""))}</td><td>{why}</td></tr>')
    return ('<div class="scroll"><table id="trials"><thead><tr>' + "".join(f"<th>{h}</th>" for h in head)
            + "</tr></thead><tbody>" + "".join(rows) + "</tbody></table></div>")


def _lost(result: dict[str, Any]) -> dict[int, str]:
    """'lost (batch): global batch ... beyond the 1.0% tolerance' by trial, from best.json's decision path."""
    return {s["step"]: f"lost ({s['lost']}): {s['lost_detail']}" for s in result.get("decision_path", [])
            if s.get("lost")}


def _decision_path(result: dict[str, Any]) -> str:
    items = []
    for s in result.get("decision_path", []):
        peak = s.get("peak_memory_bytes")
        figures = []
        if peak is not None:
            figures.append(f"{_gib(peak)}{_src(s.get('memory_source'))}")
        if s.get("tokens_per_sec") is not None:
            figures.append(f"{s['tokens_per_sec']:,.0f} tokens/s{_src(s.get('throughput_source'))}")
        items.append(f'<li><b>{escape(s["stage"])}</b> {escape(_config_label(s["config"]))} &rarr; '
                     f'{escape(s["status"])}{"" if s.get("fits", True) else " (does not fit)"}'
                     f'{" &middot; " + ", ".join(figures) if figures else ""}<br>'
                     f'<span class="muted">{escape(s.get("reason", ""))}</span></li>')
    return '<ol class="path" id="decision-path">' + "".join(items) + "</ol>"


def _why(result: dict[str, Any]) -> str:
    sentence = (result.get("why_winner") or {}).get("sentence")
    out = f'<p id="why-winner">{escape(sentence)}.</p>' if sentence else ""
    notes = result.get("notes") or []
    if notes:
        out += ('<p class="muted">Alternatives not explored, and other notes from the controller:</p>'
                '<ul id="not-explored">' + "".join(f"<li>{escape(n)}</li>" for n in notes) + "</ul>")
    else:
        out += '<p class="muted" id="not-explored">Every alternative the search space allows was evaluated.</p>'
    return out


def _error(measured: float | None, predicted: float | None) -> str:
    if not measured or predicted is None:
        return "-"
    return f"{(predicted - measured) / measured:+.1%}"


def _predicted_vs_measured(result: dict[str, Any], trials: list[dict[str, Any]]) -> str:
    rows = []
    for t in trials:
        predicted = t.get("predicted")
        if not predicted:
            continue
        got, want = t.get("result") or {}, predicted
        peak_m, peak_p = (got.get("peak_memory") or {}), (want.get("peak_memory") or {})
        tps_m, tps_p = (got.get("tokens_per_sec") or {}), (want.get("tokens_per_sec") or {})
        rows.append(
            f'<tr><td class="num">{t["step"]}</td><td>{escape(_config_label(t["config"]))}</td>'
            f'<td class="num">{_gib(peak_m.get("value"))}{_src(peak_m.get("source"))}</td>'
            f'<td class="num">{_gib(peak_p.get("value"))}{_src(peak_p.get("source"))}</td>'
            f'<td class="num">{_error(peak_m.get("value"), peak_p.get("value"))}</td>'
            f'<td class="num">{_tokens(tps_m.get("value"))}{_src(tps_m.get("source"))}</td>'
            f'<td class="num">{_tokens(tps_p.get("value"))}{_src(tps_p.get("source"))}</td>'
            f'<td class="num">{_error(tps_m.get("value"), tps_p.get("value"))}</td></tr>')
    if not rows:
        return (f'<p class="empty">No trial has both a measurement and a prediction: the {escape(result["backend"])} '
                "backend's figures are shown as they are, with their sources.</p>")
    head = ("step", "config", "peak (this trial)", "peak (prediction)", "error", "tokens/s (this trial)",
            "tokens/s (prediction)", "error")
    return ('<table id="predicted-vs-measured"><thead><tr>' + "".join(f"<th>{h}</th>" for h in head)
            + "</tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def _checkpoint(result: dict[str, Any]) -> str:
    plan = result.get("checkpoint")
    if not plan:
        return '<p class="empty">No checkpoint plan in this result.</p>'
    rows = "".join(
        f'<tr><td>{escape(o["description"])}</td><td class="num">{_gib(o["device_bytes"]["value"])}'
        f'{_src(o["device_bytes"]["source"])}</td><td class="num">{_gib(o["host_rank0_bytes"]["value"])}'
        f'{_src(o["host_rank0_bytes"]["source"])}</td><td>{"yes" if o["fits"] else "no"}</td></tr>'
        for o in plan["options"].values())
    return (f'<p><b>Recommended: {escape(plan["recommended"])} ({escape(plan["state_dict_type"])})</b> &mdash; '
            f'{escape(plan["reason"])}. Capacity: {_gib(plan["device_capacity_bytes"])} per GPU '
            f'({escape(plan["device_capacity_basis"])}), {_gib(plan["host_capacity_bytes"])} host per node '
            f'({escape(plan["host_capacity_basis"])}).</p><table id="checkpoint"><thead><tr><th>form</th>'
            '<th>per-GPU memory</th><th>rank-0 node host memory</th><th>fits</th></tr></thead><tbody>'
            + rows + "</tbody></table>")


def page_head(title: str) -> str:
    """A page's head and its first heading: the CSS, and the script the browser check reads."""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style>
<script>{_SCRIPT}</script></head>
<body data-rendered="pending">
<h1>{escape(title)}</h1>"""


def render_report(result: dict[str, Any], trials: list[dict[str, Any]]) -> str:
    """The whole report as one HTML string (see the module docstring)."""
    trials = sorted(trials, key=lambda t: (t["step"], t.get("number", 0)))
    winner_step = next((s["step"] for s in reversed(result.get("decision_path", []))
                        if s["config"].get("micro_batch_size") == result["micro_batch_size"]
                        and s["config"].get("activation_checkpointing") == result["fsdp"]["activation_checkpointing"]
                        and s["config"].get("cpu_offload") == result["fsdp"]["cpu_offload"]
                        and s["config"].get("reshard_after_forward") == result["fsdp"]["reshard_after_forward"]
                        and s.get("fits", True)), None)
    model, gpu = result["model"], result["gpu"]
    sources = sorted({((t.get("result") or {}).get("peak_memory") or {}).get("source") for t in trials} - {None})
    title = f"autotune: {model['name']} on {result['gpus']} x {gpu['type']}"
    provenance = result.get("provenance", {})
    return f"""{page_head(title)}
<div class="sub">run {escape(str(result.get('run_id', '')))} &middot; {model['parameters']:,} parameters &middot;
{result['nodes']} node(s) &middot; {_gib(gpu['memory_bytes'])} per GPU &middot; backend {escape(result['backend'])}
&middot; {escape(provenance.get('tool', ''))}, torch {escape(provenance.get('torch', ''))}, {escape(provenance.get('time', ''))}</div>
{_cards(result)}
<h2>Per-GPU memory at each step of the decision graph</h2>
<p class="muted">Stacked by category at each trial's peak ({escape(', '.join(sources) or 'no figures')}); red line: GPU
capacity, dashed: usable limit after headroom.</p>
{memory_chart(trials, capacity=int(gpu['memory_bytes']), limit=result.get('memory_limit_bytes'), winner_step=winner_step)}
<h2>Throughput against micro-batch size</h2>
<p class="muted">One line per checkpointing / offload setting; whole-job tokens/s with each point's source in its tooltip.</p>
{throughput_chart(trials)}
<h2>Why this configuration</h2>
{_why(result)}
<h2>Decision path</h2>
{_decision_path(result)}
<h2>Predicted versus measured</h2>
{_predicted_vs_measured(result, trials)}
<h2>Checkpointing</h2>
{_checkpoint(result)}
<h2>All trials</h2>
{_trial_table(trials, winner_step, _lost(result))}
<p class="muted">Sources: <span class="src measured">measured</span> a real run;
<span class="src predicted">predicted</span> an exact trace of the real model;
<span class="src estimated">estimated</span> a model of the hardware.</p>
</body></html>
"""


def write_report(run_dir: Path, result: dict[str, Any], trials: list[dict[str, Any]]) -> Path:
    """Write runs/<id>/report.html atomically; returns its path."""
    from autotune.util.files import write_atomic

    path = Path(run_dir) / "report.html"
    write_atomic(path, render_report(result, trials))
    return path
