"""`--stack torchtitan` and `--stack litgpt`: the simulator's tensor peak of the stack's own step against a real
2-rank gloo run of it, on tiny-llama's shape (docs/STACKS.md, docs/BENCHMARKS.md).

    python benchmarks/bench_torchtitan_step.py                 # torchtitan, every case: measured, predicted, difference
    python benchmarks/bench_torchtitan_step.py --stack litgpt  # LitGPT 0.5 (.venv-litgpt), the same way

Measured: torchtitan 0.3 in its own environment (.venv-torchtitan, or AUTOTUNE_TORCHTITAN_PYTHON: it pins
huggingface_hub < 2, below transformers 5), two gloo ranks forked from one process, each running the cpu
backend's own trial (`backends.real._trial.run_trial`: build on meta, torchtitan's parallelisation, one
warm-up step and one measured step under the CapacityTracker). Predicted: the simulator (`SimBackend`,
device kind cpu) in this environment, with torchtitan's packages from that one on the path
(`torchtitan_path`: they are not installed here). Each side prints one JSON line per case. LitGPT the same
way: measured in .venv-litgpt (AUTOTUNE_LITGPT_PYTHON; it needs huggingface-hub < 1.4), predicted here with
its `litgpt` package on the path (it imports beside this environment's lightning and torch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = [(2, "none"), (2, "full"), (3, "op"), (4, "full")]
"""(micro-batch, activation checkpointing) of tiny-llama at seq 256 on 2 ranks (torchtitan's cases)."""
LITGPT_CASES = [(2, "none", "bf16"), (2, "full", "bf16"), (2, "none", "bf16-pure"), (3, "full", "bf16-pure")]
"""LitGPT's: (micro-batch, checkpointing, precision): bf16-mixed and bf16-true."""
SEQ_LEN = 256
TITAN_PACKAGES = ("torchtitan", "spmd_types", "tyro", "docstring_parser", "triton")
"""What importing torchtitan 0.3's model, parallelisation and loss needs beyond this environment."""


PACKAGES = {"torchtitan": TITAN_PACKAGES, "litgpt": ("litgpt",)}
"""Per stack: what importing its model and step needs beyond this environment."""


def torchtitan_python(stack: str = "torchtitan") -> str:
    """The stack's own environment's interpreter (AUTOTUNE_TORCHTITAN_PYTHON, AUTOTUNE_LITGPT_PYTHON)."""
    return os.environ.get(f"AUTOTUNE_{stack.upper()}_PYTHON") or str(ROOT / f".venv-{stack}" / "bin" / "python")


def torchtitan_path(folder: Path, stack: str = "torchtitan") -> Path:
    """A folder of links to the stack's packages in its own environment, for this one's PYTHONPATH."""
    # Found, not imported (importing torch there would cost seconds of CPU).
    site = subprocess.run([torchtitan_python(stack), "-c", f"import importlib.util, os; print(os.path.dirname("
                           f"os.path.dirname(importlib.util.find_spec({stack!r}).origin)))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    folder.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES[stack]:
        link = folder / name
        if not link.exists():
            link.symlink_to(Path(site) / name)
    return folder


def _spec(mb: int, ac: str, precision: str = "bf16", stack: str = "torchtitan"):
    from autotune.problem.catalog.models import resolve_model
    from autotune.problem.config import Cluster, TrainConfig, TrialSpec

    return TrialSpec(model=resolve_model("tiny-llama"), cluster=Cluster(num_gpus=2), seq_len=SEQ_LEN,
                     train=TrainConfig(micro_batch_size=mb, activation_checkpointing=ac, precision=precision),
                     stack=stack)


def _rank(rank: int, port: int, cases, stack: str, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autotune.backends.real._cpu_bf16 import compute_bf16_kernels_in_fp32
    from autotune.backends.real._trial import run_trial

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)  # as the cpu backend's ranks run
        compute_bf16_kernels_in_fp32()
        dist.init_process_group("gloo", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        for index, case in enumerate(cases):
            spec = _spec(*case, stack=stack)
            figures = run_trial(spec, mesh=mesh, device=torch.device("cpu"), rank=rank, warmup_steps=1,
                                timed_steps=1, seed=0, faults=[], trial_index=index)
            queue.put((rank, index, spec.step, figures["tensor_peak_bytes"]))
        dist.destroy_process_group()
    except BaseException as exc:  # the parent reports it
        queue.put((rank, -1, f"{type(exc).__name__}: {exc}", 0))


def measure(cases, stack: str = "torchtitan") -> None:
    """Run in the stack's environment: both ranks forked after the imports (one interpreter start)."""
    import importlib
    import socket

    import torch.multiprocessing as mp

    import autotune.backends.real._trial  # noqa: F401  (imported once, before the fork)

    for module in {"torchtitan": ("torchtitan.components.loss", "torchtitan.models.llama3"),
                   "litgpt": ("litgpt.model", "litgpt.utils")}[stack]:
        importlib.import_module(module)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("fork")
    queue = context.Queue()
    ranks = [context.Process(target=_rank, args=(rank, port, cases, stack, queue)) for rank in range(2)]
    for process in ranks:
        process.start()
    got = [queue.get(timeout=600) for _ in range(2 * len(cases))]
    for process in ranks:
        process.join()
    errors = [g for g in got if g[1] < 0]
    if errors:
        raise SystemExit(f"a rank failed: {errors[0][2]}")
    for index, case in enumerate(cases):
        peaks = {peak for _, i, _, peak in got if i == index}
        step = next(s for _, i, s, _ in got if i == index)
        print(json.dumps({**_case(case), "step": step, "measured_bytes": max(peaks)}), flush=True)


def _case(case) -> dict:
    return dict(zip(("mb", "ac", "precision"), case))


def predict(cases, stack: str = "torchtitan") -> None:
    """Run in this environment with torchtitan_path on PYTHONPATH."""
    from autotune.backends.sim import SimBackend

    with SimBackend(device_kind="cpu") as sim:
        for case in cases:
            spec = _spec(*case, stack=stack)
            result = sim.evaluate(spec)
            assert result.status == "ok", result.message
            print(json.dumps({**_case(case), "step": spec.step,
                              "predicted_bytes": result.extras["tensor_peak_bytes"],
                              "peak_site": result.extras.get("peak_site")}), flush=True)


def run_both(cases, folder: Path, stack: str = "torchtitan") -> list[dict]:
    """Measured and predicted side by side, the two processes at once."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), AUTOTUNE_CACHE="off")
    argument = json.dumps(cases)
    real = subprocess.Popen([torchtitan_python(stack), __file__, "measure", argument, stack], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    path = torchtitan_path(folder, stack)
    sim = subprocess.run([sys.executable, __file__, "predict", argument, stack], cwd=ROOT, capture_output=True, text=True,
                         env=dict(env, PYTHONPATH=os.pathsep.join([str(ROOT), str(path)])))
    out, err = real.communicate(timeout=600)
    if real.returncode or sim.returncode:
        raise RuntimeError((err if real.returncode else sim.stderr)[-3000:])
    measured = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    predicted = [json.loads(line) for line in sim.stdout.splitlines() if line.startswith("{")]
    return [dict(m, **p) for m, p in zip(measured, predicted)]


def main(stack: str) -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        rows = run_both(LITGPT_CASES if stack == "litgpt" else CASES, Path(folder), stack)
    print(f"{stack}'s own step, tiny-llama, seq {SEQ_LEN}, 2 gloo ranks (step traced and run: {rows[0]['step']})")
    print(f"{'mb':>3} {'ac':>5} {'precision':>10} {'measured B':>13} {'predicted B':>13} {'difference':>11}")
    for row in rows:
        diff = row["predicted_bytes"] - row["measured_bytes"]
        print(f"{row['mb']:>3} {row['ac']:>5} {row.get('precision', 'bf16'):>10} {row['measured_bytes']:>13,} "
              f"{row['predicted_bytes']:>13,} {diff:>+11,} ({diff / row['measured_bytes']:+.2%})")
    print(f"({time.perf_counter() - start:.0f} s wall)")


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] in ("measure", "predict"):
        mode, cases = sys.argv[1], [tuple(c) for c in json.loads(sys.argv[2])]
        (measure if mode == "measure" else predict)(cases, sys.argv[3])
    else:
        import argparse

        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--stack", choices=sorted(PACKAGES), default="torchtitan")
        main(parser.parse_args().stack)
