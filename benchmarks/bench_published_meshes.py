"""autotune's throughput estimate against published FSDP x TP and FSDP x CP runs (issue 55).

Reads benchmarks/results/published_mesh_runs.json (each row's source quoted, the `autotune trial` arguments of
the nearest configuration autotune can express) and runs each expressible row's trial with the simulator,
printing the published and estimated tokens/s per GPU, the error, and the median and worst |error| per
source and overall. No constant is fitted to these rows: every error is out of sample. Rows that compiled or
used float8 run so where autotune combines it with their mesh (TP with selective checkpointing, CP) and eager in
bf16 where it does not (TP with whole-block checkpointing, which torch 2.13 cannot compile under TP):
their error mixes that in, and the table's "run as" column says which. Sources A-C ran 500 W HBM2e H100s: their rows
run at the peak and HBM bandwidth the file's hardware_basis gives them, as the published fit costs the same parts. A row
with an FSDP-only control from its source (same model, same tokens per GPU) also prints its error over the control's,
the control run as the row is: what the mesh's own terms (TP's collectives, CP's ring) miss.
The last table compares each published async-TP run's gain over its synchronous twin with the estimate's: the same
trial with and without --async-tp.

    .venv/bin/python benchmarks/bench_published_meshes.py          # about 15 minutes on 2 cores (traces cached after)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "benchmarks" / "results" / "published_mesh_runs.json"
FLOAT8_SITE = ROOT / ".float8-site"
sys.path.insert(0, str(ROOT))

from autotune.util.cache import CACHE_DIR_ENV, cache_dir  # noqa: E402


# Runs `autotune` with the catalog GPU of --gpu-type at the row's own peak and HBM bandwidth (the file's
# hardware_basis: torchtitan's 500 W HBM2e H100s), as bench_published_pipelines.py and the published fit cost them.
_AT_ROW_HARDWARE = """
import dataclasses, json, sys
from autotune.problem.catalog import gpus
facts = json.loads(sys.argv[1])
name = sys.argv[sys.argv.index("--gpu-type") + 1]
base = gpus.GPUS[name]
gpus.GPUS[name] = dataclasses.replace(base, peak_tflops=facts["peak_tflops"], hbm_gbps=facts["hbm_gbps"],
                                      float8_tflops=base.float8_tflops * facts["peak_tflops"] / base.peak_tflops)
sys.argv = ["autotune", *sys.argv[2:]]
from autotune.drivers.cli import run
run()
"""


def estimate(args: list[str], row: dict | None = None) -> float | None:
    """The trial's estimated tokens/s per GPU (None where the trial gives none), on the row's GPU facts where it
    states them (peak_tflops, hbm_gbps)."""
    env = dict(os.environ)
    if FLOAT8_SITE.is_dir():  # torchao for the float8 rows where `make setup` put it beside the venv
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FLOAT8_SITE), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "autotune", *args]
    if row is not None and row.get("peak_tflops"):
        facts = json.dumps({"peak_tflops": row["peak_tflops"], "hbm_gbps": row["hbm_gbps"]})
        command = [sys.executable, "-c", _AT_ROW_HARDWARE, facts, *args]
        # The cache keys a prediction by the GPU's catalog name: keep these apart from the data sheet's.
        folder = cache_dir()
        if folder is not None:
            env[CACHE_DIR_ENV] = str(folder / f"gpu-{row['peak_tflops']:g}-tflops-{row['hbm_gbps']:g}-gbps")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return None
    result = json.loads(done.stdout)
    throughput = result.get("tokens_per_sec")
    return throughput["value"] / result["gpus"] if throughput else None


def _run_as(row: dict) -> str:
    """What the row's arguments run, beside what was published where the two differ."""
    args = row["autotune_args"]
    compiled = args[args.index("--compile") + 1] if "--compile" in args else "none"
    float8 = args[args.index("--float8") + 1] if "--float8" in args else "none"
    ran = ("eager" if compiled == "none" else f"compile {compiled}") + (", bf16" if float8 == "none" else
                                                                        f", float8 {float8}")
    if (compiled, float8) == (row["compile"], row["float8"]):
        return ran
    return f"{ran} (published: compile {row['compile']}, float8 {row['float8']})"


def main() -> None:
    rows = json.loads(ROWS.read_text())["rows"]
    errors: dict[str, list[float]] = defaultdict(list)
    print("| row | kind | run as | published | estimated | error | over its control |\n|---|---|---|---:|---:|---:|---:|")
    by_id = {row["id"]: row for row in rows}
    as_published: list[float] = []
    for row in rows:
        if not row["autotune_args"] or row["async_tp"]:
            continue
        tps = estimate(row["autotune_args"], row)
        if tps is None:
            print(f"| {row['id']} | {row['kind']} | not estimated | {row['published_tokens_per_s_per_gpu']:,.1f} | - | - | - |")
            continue
        error = tps / row["published_tokens_per_s_per_gpu"] - 1
        over_control = "-"
        if row.get("control"):  # the row's error over its FSDP-only control's: what the mesh's own terms miss
            control = by_id[row["control"]]
            control_tps = estimate(_run_like(control["autotune_args"], row["autotune_args"]), control)
            if control_tps:
                control_ratio = control_tps / control["published_tokens_per_s_per_gpu"]
                over_control = f"{(1 + error) / control_ratio - 1:+.1%}"
        run_as = ("as published" if row["expressible"] == "exact" else
                  f"as published ({row['expressible']})" if row["expressible"].startswith("exact") else _run_as(row))
        if row["kind"].startswith("FSDP x"):  # the FSDP-only controls are printed, not summarised
            errors[row["source"]].append(abs(error))
            if "(published:" not in run_as:  # run with the published compile and float8
                as_published.append(abs(error))
        print(f"| {row['id']} | {row['kind']} | {run_as} | {row['published_tokens_per_s_per_gpu']:,.1f} | "
              f"{tps:,.1f} | {error:+.1%} | {over_control} |")
    every = [e for source in errors.values() for e in source]
    print("\n| source (FSDP x TP and FSDP x CP rows) | rows | median abs error | worst |\n|---|---:|---:|---:|")
    for source, values in errors.items():
        print(f"| {source} | {len(values)} | {statistics.median(values):.1%} | {max(values):.1%} |")
    print(f"| all | {len(every)} | {statistics.median(every):.1%} | {max(every):.1%} |")
    if as_published:
        print(f"| all run with the published compile and float8 | {len(as_published)} | "
              f"{statistics.median(as_published):.1%} | {max(as_published):.1%} |")
    async_gains(rows)


_RUN_AS_FLAGS = ("--compile", "--float8", "--backend")


def _run_like(control_args: list[str], row_args: list[str]) -> list[str]:
    """A control's arguments run as its mesh row is (the row's compile, float8 and backend), so that the two errors
    share what the row's "run as" changes (an eager bf16 row against a compiled float8 publication)."""
    args = list(control_args)
    for flag in _RUN_AS_FLAGS:
        if flag in args:
            del args[args.index(flag):args.index(flag) + 2]
        if flag in row_args:
            args += [flag, row_args[row_args.index(flag) + 1]]
    return args


def _compiled_twin(row: dict) -> tuple[list[str], str]:
    """The arguments an async-TP gain is estimated on: the synchronous row's, compiled with the published float8
    recipe (async TP is a pass of inductor's), whole-block checkpointing as op-level where the row had it (torch 2.13
    cannot compile a tensor-parallel block checkpointed whole: knobs refuses it), and what changed, said."""
    args = [a for a in row["autotune_args"]]
    changed = []
    if "--compile" not in args:
        args += ["--compile", "blocks"]
        changed.append("compiled")
    recipe = row["float8"].split()[0] if row["float8"] != "none" else "none"
    if recipe != "none" and "--float8" not in args:
        args += ["--float8", recipe]
        changed.append(f"float8 {recipe}")
    if args[args.index("--ac") + 1] == "full":
        args[args.index("--ac") + 1] = "op"
        changed.append("op-level checkpointing for full")
    return args, ", ".join(changed) or "as published"


def async_gains(rows: list[dict]) -> None:
    """Published async-TP gains (each async row over its synchronous twin, same source, same run otherwise) against
    the estimate's: the same trial with and without --async-tp (costmodel.async_tp_exposed_seconds)."""
    by_id = {row["id"]: row for row in rows}
    print("\n| pair | run as | published gain | estimated gain | difference (points) |\n|---|---|---:|---:|---:|")
    differences = []
    for row in rows:
        twin = by_id.get(row["id"].removesuffix("-async")) if row["async_tp"] else None
        if twin is None or not twin["autotune_args"]:
            continue
        args, run_as = _compiled_twin(twin)
        sync, asynchronous = estimate(args, twin), estimate([*args, "--async-tp"], twin)
        published = row["published_tokens_per_s_per_gpu"] / twin["published_tokens_per_s_per_gpu"] - 1
        if sync is None or asynchronous is None:
            print(f"| {twin['id']} | {run_as} | {published:+.1%} | not estimated | - |")
            continue
        gain = asynchronous / sync - 1
        differences.append(abs(gain - published) * 100)
        print(f"| {twin['id']} | {run_as} | {published:+.1%} | {gain:+.1%} | {(gain - published) * 100:+.1f} |")
    if differences:
        print(f"\n{len(differences)} pairs: median |difference| {statistics.median(differences):.1f} points, worst "
              f"{max(differences):.1f}; within 5 points: {sum(d <= 5 for d in differences)} of {len(differences)}")


if __name__ == "__main__":
    main()
