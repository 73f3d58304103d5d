"""Time to train as runs see it, against published pretraining runs, held out by publisher.

    python benchmarks/bench_time_to_train.py [--runs benchmarks/results/published_pretraining_runs.json]

For each published run (benchmarks/results/published_pretraining_runs.json): autotune's own
estimated tokens/s for that model on that cluster (`autotune plan` on the analytic backend, one
option: the run's GPU type and count, sequence length and global batch, rounded to whole
sequences per GPU), then

- the old formula: GPU-hours = train tokens / tokens/s x GPUs (the benchmark time), and
- the time-to-train model (autotune/estimate/time_to_train.py) with its default assumptions and its one
  fitted constant, the goodput factor, fitted WITHOUT the row's publisher: the factor g for which
  the mean over the other publishers (each publisher's rows averaged first, so every publisher
  weighs the same) of log(published / predicted) is zero. The goodput range is the smallest and
  largest factor one of those publishers would get alone. A row whose published figure counts steps
  alone ('published_counts': 'steps': step time x steps, from measured throughput or logged iteration
  time, as LLaMA-65B's Table 15 and Pythia's Table 5) is compared with the model's compute term
  (benchmark time / g, every loss term off): restarts, saves, evaluation and start-up are not in it.

Per row: autotune's tokens/s per GPU and pub/est, the published run's sustained tokens/s per GPU
over it (the factor that row alone would fit: how far autotune's step estimate is from the run's
stack), published and predicted GPU-hours, the error (predicted / published - 1), and whether the
published figure is inside the printed range; then the median error, the worst, the fraction
inside the range, by row and with each publisher weighted equally. A row autotune cannot answer
(nothing fits, the global batch cannot be kept) is printed as unanswered and counted as such.
The last line prints the goodput fitted on every publisher (time_to_train.FITTED_GOODPUT) and
its spread (FITTED_GOODPUT_RANGE).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune.estimate import time_to_train as ttt  # noqa: E402

DEFAULT_BATCH = 4 * 2**20  # a row whose global batch is not published


def estimate(run: dict, folder: Path) -> dict:
    """autotune's answer for the run's model on its cluster: tokens/s (and its range), parameters."""
    from autotune.util.errors import AutotuneError
    from autotune.drivers.plan import PlanOptions, run_plan

    model = run["model"]
    if model is None:
        path = folder / "models" / run["id"]
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(run["config"]))
        model = str(path)
    seq, gpus = run["seq_len"], run["gpus"]
    batch = run["global_batch_tokens"] or DEFAULT_BATCH
    per_gpu = round(batch / (gpus * seq))
    global_tokens = per_gpu * gpus * seq if per_gpu >= 1 else batch  # below a sequence per GPU: tune decides
    options = PlanOptions(model=model, train_tokens=int(run["train_tokens"]), gpus=(gpus,), gpu_types=(run["gpu"],),
                          global_tokens=str(global_tokens), seq_len=seq, backend="analytic",
                          runs_dir=str(folder / "runs"), gpus_per_node=8, jobs=1)
    try:
        plan = run_plan(options, lambda *a, **k: None)
    except AutotuneError as exc:
        return {"answered": False, "why": str(exc).splitlines()[0], "global_tokens": global_tokens}
    except Exception as exc:  # noqa: BLE001 -- a bug is not an answer either: said, not hidden
        return {"answered": False, "why": f"internal error: {type(exc).__name__}: {exc}", "global_tokens": global_tokens}
    option = plan["options"][0]
    if option["status"] != "ok":
        return {"answered": False, "why": f"{option['status']}: {option['binds']['detail']}", "global_tokens": global_tokens}
    tps = option["tokens_per_sec"]
    return {"answered": True, "tokens_per_sec": tps["value"], "range": tps["range"], "global_tokens": global_tokens,
            "parameters": plan["model"]["parameters"], "configuration": option["configuration"]}


def published_gpu_hours(run: dict) -> float:
    pub = run["published"]
    return pub["gpu_hours"] if "gpu_hours" in pub else pub["wall_clock_days"] * 24 * run["gpus"]


def counts_steps(run: dict) -> bool:
    """Whether the published figure is step time x steps (measured throughput or logged iteration time), not
    wall-clock: then no restart, checkpoint stall, evaluation or start-up is in it."""
    return run.get("published_counts") == "steps"


def predict(run: dict, est: dict, goodput: float, goodput_range: tuple[float, float]) -> dict:
    """The time-to-train model for the row: its whole expected wall-clock, or, for a row whose published figure
    counts steps alone, the same model with every loss term off (benchmark time / goodput): what that figure
    measures."""
    if counts_steps(run):
        a = ttt.Assumptions(goodput=goodput, goodput_range=goodput_range, failures_per_gpu_hour=0.0,
                            eval_fraction=0.0, startup_s=0.0)
        write = 0.0
    else:
        a, write = ttt.Assumptions(goodput=goodput, goodput_range=goodput_range), None
    rng = tuple(est["range"]) if est["range"] else None
    return ttt.expected_time(train_tokens=run["train_tokens"], tokens_per_sec=est["tokens_per_sec"], gpus=run["gpus"],
                             nodes=run["gpus"] // 8, checkpoint_size_bytes=ttt.checkpoint_bytes(est["parameters"]),
                             write_s=write, tokens_per_sec_range=rng, assumptions=a)


def fit_goodput(rows: list[dict]) -> tuple[float, tuple[float, float], dict[str, float]]:
    """The goodput g zeroing the publisher-weighted mean log(published / predicted(g)); its spread: each
    publisher's own g."""
    def by_publisher(subset):
        out: dict[str, list[dict]] = {}
        for r in subset:
            out.setdefault(r["publisher"], []).append(r)
        return out

    def solve(subset) -> float:
        groups = by_publisher(subset)

        def mean_log(g: float) -> float:
            return statistics.fmean(statistics.fmean(
                math.log(r["published"] / predict(r["run"], r["est"], g, (g, g))["gpu_hours"]) for r in rs)
                for rs in groups.values())

        lo, hi = 0.02, 20.0  # predicted hours fall as g rises: mean_log rises with g
        for _ in range(60):
            mid = math.sqrt(lo * hi)
            if mean_log(mid) > 0:
                hi = mid
            else:
                lo = mid
        return math.sqrt(lo * hi)

    own = {p: solve(rs) for p, rs in by_publisher(rows).items()}
    return solve(rows), (min(own.values()), max(own.values())), own


def summary(label: str, errors: list[tuple[str, float, bool | None]]) -> str:
    """errors: (publisher, predicted / published, inside the range or None)."""
    if not errors:
        return f"{label}: no answered rows"
    rel = [abs(r - 1) for _, r, _ in errors]
    worst = max(errors, key=lambda e: abs(math.log(e[1])))
    beyond = sum(1 for _, r, _ in errors if r > 1.5 or r < 1 / 1.5)
    inside = [i for _, _, i in errors if i is not None]
    pubs: dict[str, list[tuple[float, bool | None]]] = {}
    for p, r, i in errors:
        pubs.setdefault(p, []).append((r, i))
    # Publisher-weighted: every publisher weighs 1, split over its rows.
    weighted = sorted((abs(r - 1), 1 / len(v)) for v in pubs.values() for r, _ in v)
    total, acc, wmedian = sum(w for _, w in weighted), 0.0, None
    for value, w in weighted:
        acc += w
        if acc >= total / 2:
            wmedian = value
            break
    winside = (sum(sum(1 for _, i in v if i) / len(v) for v in pubs.values()) / len(pubs)) if inside else None
    line = (f"{label}: median |error| {statistics.median(rel):.1%} (publisher-weighted {wmedian:.1%}), worst "
            f"{worst[1] - 1:+.1%} ({worst[0]}), beyond 1.5x: {beyond} of {len(errors)}")
    if inside:
        line += (f", inside the printed range: {sum(inside)} of {len(inside)} ({sum(inside) / len(inside):.0%}; "
                 f"publisher-weighted {winside:.0%})")
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=str(ROOT / "benchmarks" / "results" / "published_pretraining_runs.json"))
    args = parser.parse_args()
    data = json.loads(Path(args.runs).read_text())
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}; "
          f"{len(data['runs'])} published runs from {len({r['source'] for r in data['runs']})} sources")
    began = time.monotonic()
    rows, unanswered = [], []
    with tempfile.TemporaryDirectory(prefix="bench-ttt-") as tmp:
        os.environ.setdefault("AUTOTUNE_CACHE_DIR", str(Path(tmp) / "cache"))
        for run in data["runs"]:
            est = estimate(run, Path(tmp))
            publisher = data["sources"][run["source"]]["publisher"]
            if not est["answered"]:
                unanswered.append((run, publisher, est))
                continue
            rows.append({"run": run, "est": est, "publisher": publisher, "published": published_gpu_hours(run)})
    print(f"estimated {len(rows)} rows in {time.monotonic() - began:.0f} s (analytic backend); "
          f"{len(unanswered)} unanswered")

    header = (f"{'run':<18} {'publisher':<13} {'GPUs':>6} {'tok/s/GPU':>9} {'pub/est':>7} {'published':>10} {'old':>10} "
              f"{'err':>7} {'expected':>10} {'err':>7} {'range':>21} {'in':>3} {'g':>5}")
    print("\nGPU-hours: published; old = tokens / tokens/s x GPUs; expected = autotune/estimate/time_to_train.py with the goodput "
          "fitted without the row's publisher (g); * = the published figure counts steps alone (step time x steps), "
          "compared with benchmark time / g; pub/est = the published run's sustained tokens/s per GPU over autotune's "
          "estimate (the factor that row alone would fit)")
    print(header)
    old_errors, new_errors = [], []
    for row in rows:
        others = [r for r in rows if r["publisher"] != row["publisher"]]
        g, g_range, _ = fit_goodput(others)
        run, est = row["run"], row["est"]
        old = run["train_tokens"] / est["tokens_per_sec"] / 3600 * run["gpus"]
        new = predict(run, est, g, g_range)
        low, high = new["gpu_hours_range"]
        inside = low <= row["published"] <= high
        old_errors.append((row["publisher"], old / row["published"], None))
        new_errors.append((row["publisher"], new["gpu_hours"] / row["published"], inside))
        sustained = run["train_tokens"] / (row["published"] * 3600) * run["gpus"]
        name = run["id"] + ("*" if counts_steps(run) else "")
        print(f"{name:<18} {row['publisher'][:13]:<13} {run['gpus']:>6} {est['tokens_per_sec'] / run['gpus']:>9,.0f} "
              f"{sustained / est['tokens_per_sec']:>7.2f} {row['published']:>10,.0f} {old:>10,.0f} {old / row['published'] - 1:>+7.0%} {new['gpu_hours']:>10,.0f} "
              f"{new['gpu_hours'] / row['published'] - 1:>+7.0%} {low:>10,.0f}-{high:<10,.0f} {'yes' if inside else 'no':>3} "
              f"{g:>5.2f}")
    for run, publisher, est in unanswered:
        print(f"{run['id']:<18} {publisher[:13]:<13} {run['gpus']:>6} unanswered: {est['why'][:110]}")
    print()
    print(summary("old formula (benchmark time)", old_errors))
    print(summary("time to train (held out by publisher)", new_errors))
    print(f"rows: {len(rows)} answered of {len(data['runs'])}, from {len({r['publisher'] for r in rows})} publishers "
          f"({len({data['sources'][r['source']]['publisher'] for r in data['runs']})} in the set)")
    goals = [("median |error| <= 20%", statistics.median(abs(r - 1) for _, r, _ in new_errors) <= 0.2),
             ("none beyond 1.5x", all(1 / 1.5 <= r <= 1.5 for _, r, _ in new_errors)),
             (">= 80% inside the range", sum(i for _, _, i in new_errors) / len(new_errors) >= 0.8)]
    print("issue 57 goals: " + "; ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in goals))
    g, g_range, own = fit_goodput(rows)
    print(f"goodput fitted on all {len(own)} publishers: {g:.3f} (time_to_train.FITTED_GOODPUT = {ttt.FITTED_GOODPUT}); "
          f"spread {g_range[0]:.3f}-{g_range[1]:.3f} (FITTED_GOODPUT_RANGE = {ttt.FITTED_GOODPUT_RANGE}); by publisher: "
          + ", ".join(f"{p} {v:.2f}" for p, v in sorted(own.items(), key=lambda kv: kv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
