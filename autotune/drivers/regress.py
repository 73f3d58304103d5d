"""Nightly regressions: one sweep's winners against an earlier sweep of the same matrix.

For every problem of the new sweep: a new failure (error, nothing fits, bad input, or missing),
a changed winning configuration, throughput down by more than `throughput_drop`, peak memory up
by more than `memory_rise`. Each finding names the figures and their sources (a measured figure
compared with an estimated one is said to be so). Written as JSON and HTML; the command exits
EXIT_REGRESSION when anything regressed.
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from autotune.util.errors import UsageError
from autotune.drivers.sweep import SWEEP_PREFIX, sweep_results

EXIT_REGRESSION = 4
DEFAULT_THROUGHPUT_DROP = 0.05
DEFAULT_MEMORY_RISE = 0.05


@dataclass(frozen=True)
class Finding:
    problem: str
    kind: str  # failure | config | throughput | memory | fixed | improved
    regression: bool
    detail: str


def _load(storage_url: str, name: str):
    import optuna

    from autotune.util.secrets import with_password
    from autotune.search.store import rdb_storage, storage_errors

    try:
        with storage_errors(storage_url):
            return optuna.load_study(storage=rdb_storage(with_password(storage_url)), study_name=f"{SWEEP_PREFIX}{name}")
    except KeyError:
        raise UsageError(f"no sweep named {name!r} in this storage (autotune sweep ... --name {name})") from None


def previous_sweep(storage_url: str, name: str) -> str:
    """The latest sweep created before `name` with the same matrix."""
    import optuna

    from autotune.util.secrets import with_password
    from autotune.search.store import rdb_storage

    current = _load(storage_url, name)
    matrix, created = current.user_attrs.get("matrix"), current.user_attrs.get("created", 0)
    candidates = []
    for summary in optuna.get_all_study_summaries(rdb_storage(with_password(storage_url)), include_best_trial=False):
        other = summary.study_name.removeprefix(SWEEP_PREFIX)
        if not summary.study_name.startswith(SWEEP_PREFIX) or other == name:
            continue
        attrs = summary.user_attrs
        if attrs.get("matrix") == matrix and attrs.get("created", 0) < created:
            candidates.append((attrs["created"], other))
    if not candidates:
        raise UsageError(f"no earlier sweep with the matrix of {name!r} in this storage: pass --baseline NAME")
    return max(candidates)[1]


def compare(new: dict[str, dict[str, Any]], old: dict[str, dict[str, Any]], *,
            throughput_drop: float = DEFAULT_THROUGHPUT_DROP, memory_rise: float = DEFAULT_MEMORY_RISE) -> list[Finding]:
    findings: list[Finding] = []
    for problem in sorted(set(new) | set(old)):
        now, before = new.get(problem), old.get(problem)
        if now is None:
            findings.append(Finding(problem, "failure", True, "not finished in the new sweep"))
            continue
        if before is None:
            findings.append(Finding(problem, "new", False, f"new problem: {now['state']}"))
            continue
        if now["state"] != "done":
            if before["state"] == "done":
                findings.append(Finding(problem, "failure", True,
                                        f"{now['state']} (was done): {now.get('message', '')}".rstrip(": ")))
            continue
        if before["state"] != "done":
            findings.append(Finding(problem, "fixed", False, f"done (was {before['state']})"))
            continue
        if now["config"] != before["config"]:
            changed = {k: (before["config"].get(k), v) for k, v in now["config"].items() if before["config"].get(k) != v}
            findings.append(Finding(problem, "config", True, "winner changed: " + ", ".join(
                f"{k} {a} -> {b}" for k, (a, b) in changed.items())))
        findings += _figure_finding(problem, "throughput", now, before, "tokens_per_sec", "throughput_source",
                                    worse=lambda r: r < -throughput_drop, threshold=throughput_drop, unit="tokens/s")
        findings += _figure_finding(problem, "memory", now, before, "peak_memory_bytes", "memory_source",
                                    worse=lambda r: r > memory_rise, threshold=memory_rise, unit="bytes")
    return findings


def _figure_finding(problem, kind, now, before, key, source_key, *, worse, threshold, unit) -> list[Finding]:
    a, b = before.get(key), now.get(key)
    if not a or b is None:
        return []
    change = (b - a) / a
    sources = f"{before[source_key]} -> {now[source_key]}"
    if before[source_key] != now[source_key]:
        sources += " (different sources: not like for like)"
    detail = f"{a:,.0f} -> {b:,.0f} {unit} ({change:+.1%}, {sources})"
    if worse(change):
        return [Finding(problem, kind, True, f"{detail}; threshold {threshold:.0%}")]
    return []


def regress(storage_url: str, name: str, *, baseline: str | None, out_dir: Path,
            throughput_drop: float, memory_rise: float) -> tuple[list[Finding], dict[str, Path], str]:
    baseline = baseline or previous_sweep(storage_url, name)
    new = sweep_results(_load(storage_url, name))
    old = sweep_results(_load(storage_url, baseline))
    findings = compare(new, old, throughput_drop=throughput_drop, memory_rise=memory_rise)
    out_dir.mkdir(parents=True, exist_ok=True)
    document = dict(sweep=name, baseline=baseline, thresholds=dict(throughput_drop=throughput_drop,
                                                                   memory_rise=memory_rise),
                    regressions=sum(f.regression for f in findings), problems=len(new),
                    findings=[asdict(f) for f in findings])
    from autotune.util.files import write_atomic

    paths = {"json": out_dir / f"regress-{name}.json", "html": out_dir / f"regress-{name}.html"}
    write_atomic(paths["json"], json.dumps(document, indent=2) + "\n")
    write_atomic(paths["html"], _html(document))
    return findings, paths, baseline


def _html(document: dict[str, Any]) -> str:
    rows = "\n".join(
        f"<tr class={'bad' if f['regression'] else 'ok'}><td>{html.escape(f['problem'])}</td>"
        f"<td>{html.escape(f['kind'])}</td><td>{'regression' if f['regression'] else ''}</td>"
        f"<td>{html.escape(f['detail'])}</td></tr>" for f in document["findings"])
    verdict = (f"{document['regressions']} regression(s)" if document["regressions"] else "no regression")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>autotune regress {html.escape(document['sweep'])}</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:4px 8px;border-bottom:1px solid #ddd;text-align:left}}
tr.bad td{{background:#fde8e8}}</style></head><body>
<h1>{html.escape(document['sweep'])} against {html.escape(document['baseline'])}: {verdict}</h1>
<p>{document['problems']} problems; thresholds: throughput drop {document['thresholds']['throughput_drop']:.0%},
memory rise {document['thresholds']['memory_rise']:.0%}. Each figure is shown with its source.</p>
<table><tr><th>problem</th><th>kind</th><th></th><th>detail</th></tr>
{rows or '<tr><td colspan=4>nothing changed</td></tr>'}
</table></body></html>
"""
