"""`autotune plan` cold, end to end, and its 64-GPU H100 row against `autotune tune` (issue 30).

    python benchmarks/bench_plan.py [--model llama3-70b] [--gpus 8,16,32,64,128]
                                    [--gpu-type h100-80gb,a100-80gb] [--backend sim] [--jobs N]
                                    [--compare 64]

Cold: an empty runs folder and an empty prediction cache folder (AUTOTUNE_CACHE_DIR), so every
option is traced afresh (only traces shared within the plan are reused). Prints the wall time and
the CPU time the plan's processes used (user + system: what the machine's load does not stretch
as it stretches the wall time), with the machine's load average before and after, each option's
wall time, and, with
--compare N, whether the N-GPU row of the first GPU type equals `autotune --model M --gpus N
--nodes N/8 --global-tokens 4Mi` run afterwards in a folder and cache of its own (a memory basis
that says the row's trace was derived exactly, where the tune traced it, counts as the same).
Measured wall-clock figures on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IDENTITY = ("run_id", "provenance", "study")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-70b")
    parser.add_argument("--gpus", default="8,16,32,64,128")
    parser.add_argument("--gpu-type", default="h100-80gb,a100-80gb")
    parser.add_argument("--backend", default="sim")
    parser.add_argument("--jobs", default=None)
    parser.add_argument("--compare", type=int, default=64)
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"load before {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as folder:
        env = {**os.environ, "AUTOTUNE_CACHE_DIR": str(Path(folder) / "cache")}
        env.pop("AUTOTUNE_CACHE", None)
        command = [sys.executable, "-m", "autotune", "plan", "--model", args.model, "--train-tokens", "1T",
                   "--gpus", args.gpus, "--gpu-type", args.gpu_type, "--global-tokens", "4Mi",
                   "--backend", args.backend, "--runs-dir", str(Path(folder) / "runs")]
        if args.jobs:
            command += ["--jobs", args.jobs]
        began, cpu = time.monotonic(), _children_cpu_s()
        subprocess.run(command, check=True, env=env)
        wall, cpu = time.monotonic() - began, _children_cpu_s() - cpu
        print(f"plan: {wall:.1f} s wall, {cpu:.1f} s CPU (cold, measured), load after {os.getloadavg()}")
        (path,) = (Path(folder) / "runs").glob("plan-*/plan.json")
        plan = json.loads(path.read_text())
        for option in plan["options"]:
            print(f"  {option['id']:<16} {option['wall_s']:6.1f} s  {option['status']}")
        if not args.compare:
            return
        first = args.gpu_type.split(",")[0]
        row = next(o for o in plan["options"] if o["id"] == f"{first}x{args.compare}")
        out = Path(folder) / "tune.json"
        env["AUTOTUNE_CACHE_DIR"] = str(Path(folder) / "cache-tune")
        began, cpu = time.monotonic(), _children_cpu_s()
        subprocess.run([sys.executable, "-m", "autotune", "--model", args.model, "--gpus", str(args.compare),
                        "--nodes", str(max(1, args.compare // 8)), "--gpu-type", first, "--global-tokens", "4Mi",
                        "--backend", args.backend, "--runs-dir", str(Path(folder) / "tune"), "--out", str(out)],
                       check=True, env=env, stdout=subprocess.DEVNULL)
        tuned = json.loads(out.read_text())
        ours = {k: v for k, v in row["result"].items() if k not in IDENTITY}
        if "derived exactly" in ours["memory_basis"]:  # says how the trace was made; every figure is the same
            ours["memory_basis"] = tuned["memory_basis"]
        same = ours == {k: v for k, v in tuned.items() if k not in IDENTITY}
        print(f"tune --gpus {args.compare} alone: {time.monotonic() - began:.1f} s wall, {_children_cpu_s() - cpu:.1f} s "
              f"CPU; plan row {row['id']} "
              f"{'equals' if same else 'DIFFERS FROM'} its winner and figures "
              f"({row['tokens_per_sec']['value']:,.0f} vs {tuned['tokens_per_sec']:,.0f} tokens/s, "
              f"peak {row['peak_memory_bytes']['value']:,} vs {tuned['peak_memory_bytes']:,} B)")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
