"""Sweep throughput: the same 12-problem matrix done by 1, 2 and 4 local workers on one SQLite storage.

    python benchmarks/bench_sweep.py [--workers 1,2,4] [--repeats 1] [--backend sim]

Each run starts from an empty runs folder with the prediction cache off (every problem is traced
afresh) and times `autotune sweep FILE --local N` end to end: process start-up, the queue, every
problem's decision graph and its study. Prints the wall time per worker count (median of the
repeats), the speed-up over one worker, and checks that every problem finished exactly once.
Measured wall-clock figures on this machine; the speed-up is bounded by its cores.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MATRIX = """
name = "bench"
[matrix]
model = ["tiny-llama", "micro-llama", "tiny-qwen2"]
gpus = [2, 4]
global_tokens = ["64K", "128K"]
backend = ["{backend}"]
"""


def run(workers: int, backend: str) -> tuple[float, int]:
    import optuna
    from optuna.trial import TrialState

    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as folder:
        sweep = Path(folder) / "bench.toml"
        sweep.write_text(MATRIX.format(backend=backend))
        runs = Path(folder) / "runs"
        env = dict(os.environ, AUTOTUNE_CACHE="off")
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "autotune", "sweep", str(sweep), "--runs-dir", str(runs),
                        "--local", str(workers), "--heartbeat", "5"], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        elapsed = time.perf_counter() - start
        trials = optuna.load_study(storage=f"sqlite:///{runs / 'autotune.db'}", study_name="sweep:bench").get_trials()
        done = len({t.user_attrs["problem"] for t in trials if t.state == TrialState.COMPLETE})
        assert done == 12 and len(trials) == 12, f"{done} problems finished in {len(trials)} trials"
        return elapsed, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--backend", default="sim")
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; 12 problems, backend {args.backend}, "
          f"cache off; {args.repeats} repeat(s) per worker count")
    baseline = None
    for workers in counts:
        times = [run(workers, args.backend)[0] for _ in range(args.repeats)]
        median = statistics.median(times)
        baseline = baseline or median
        print(f"  {workers} worker(s): {median:6.1f} s wall (measured), speed-up {baseline / median:.2f}x, "
              "12 of 12 problems once each")


if __name__ == "__main__":
    main()
