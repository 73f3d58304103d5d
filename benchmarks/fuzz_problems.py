"""Fuzz the tool with problems a user types (issue 53): every one must end cleanly.

    python benchmarks/fuzz_problems.py [--count 500] [--seed 0] [--jobs 2]

Draws `--count` problems from tests/problem_space.py's SPACE with a seeded generator (catalog
models, 1-8 GPUs per node, 1-64 nodes with odd counts, seq 512-8192, every GPU type, LoRA, GRPO,
the stacks, --time-budget, --headroom, --precision, --attention, --compile, --float8, a search space with
pipelines; a reachable global batch), runs each as `autotune
tune ... --backend analytic` in-process, and prints each problem that did not end in exit 0, exit 3
or an exit-2 line naming only flags the user gave, then the counts. Exits 1 if any did not.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.problem_space import SPACE, argv, verdict  # noqa: E402


def draw(rng: random.Random) -> dict:
    return {field: rng.choice(values) for field, values in SPACE.items()}


def run_one(problem: dict) -> tuple[dict, list[str], int, str, float]:
    from autotune.drivers.cli import main

    with tempfile.TemporaryDirectory() as runs:
        line = argv(problem, runs)
        out, err = io.StringIO(), io.StringIO()
        began = time.monotonic()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(line)
        return problem, line, code, err.getvalue(), time.monotonic() - began


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    problems = [draw(rng) for _ in range(args.count)]
    began = time.monotonic()
    codes: Counter = Counter()
    bad = 0
    with multiprocessing.get_context("spawn").Pool(args.jobs, maxtasksperchild=25) as pool:
        for index, (problem, line, code, stderr, seconds) in enumerate(pool.imap(run_one, problems)):
            codes[code] += 1
            if (why := verdict(line, code, stderr)):
                bad += 1
                print(f"[{index}] autotune {' '.join(w for w in line if not w.startswith('/'))}\n    {why}",
                      flush=True)
    wall = time.monotonic() - began
    print(f"{args.count} problems (seed {args.seed}) in {wall:.0f} s wall, {args.jobs} jobs: "
          + ", ".join(f"exit {code}: {n}" for code, n in sorted(codes.items()))
          + f"; {bad} not clean")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
