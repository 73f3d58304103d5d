"""Tensor parallelism (--tp): the trace against real gloo runs, family by family, and the tune at scale.

    python benchmarks/bench_tensor_parallel.py [--no-real] [--families llama,qwen2,mistral] [--no-tune] [--compiled]

Memory: for each family whose transformers config has a tensor-parallel plan of colwise/rowwise entries,
a shrunk config (autotune/problem/catalog/shrink.py, 4 layers, seq 64, micro-batch 2) is predicted by the simulator
for a CPU gloo run and, unless --no-real, run for real: TP2 on 2 ranks and FSDP2 x TP2 on 4 ranks, each with
checkpointing none and full (with --compiled also compiled blocks, checkpointing none and op: inductor in the
real runs, AOT autograd's partition in the trace; a cold compile is 30-60 s a world size), every trial of a world
size in one launch of the cpu backend. Printed: the predicted and measured tensor peaks
(`extras["tensor_peak_bytes"]`) and their difference.

Tune: llama3-70b on 1024 x h100-80gb at seq 8192 with a 4Mi-token global batch (512 sequences for 1024 GPUs:
past FSDP's batch wall), and a Llama-3.1-405B-shaped config on 128 x h100-80gb (FSDP alone fits only with
offload): each tune's winner, printed with what it is (predicted memory, estimated throughput).
docs/BENCHMARKS.md states the current figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "gemma2", "olmo2", "granite")
CHECKPOINTING = ("none", "full")
COMPILED_CHECKPOINTING = ("none", "op")  # compiled TP blocks checkpointed whole are refused (knobs._check_tensor_parallel)
SEQ_LEN = 64
MICRO_BATCH = 2

RUN_FOR_REAL = ("import json, sys\n"
                "from autotune.backends.real import RealBackend\n"
                "from autotune.problem.config import TrialSpec\n"
                "specs = [TrialSpec.from_dict(d) for d in json.load(sys.stdin)]\n"
                "with RealBackend(device='cpu', persistent=True, warmup_steps=1, timed_steps=1) as real:\n"
                "    print(json.dumps([r.to_dict() for r in real.evaluate_many(specs)]))\n")

LLAMA_405B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16384,
              "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
              "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
"""Llama 3.1 405B's shapes, from its published config.json (meta-llama/Llama-3.1-405B)."""


def memory_matrix(families: list[str], *, real: bool, folder: Path, compiled: bool = False) -> list[dict]:
    from autotune.backends.base import TrialResult
    from autotune.backends.sim import SimBackend
    from autotune.problem.catalog.models import resolve_model
    from autotune.problem.catalog.shrink import shrunk_config
    from autotune.problem.config import Cluster, TrainConfig, TrialSpec
    from autotune.problem.knobs import KNOBS, ProblemShape, why_not_buildable

    specs, rows = [], []
    for family in families:
        path = folder / family
        shrunk_config(family).save_pretrained(path)
        model = resolve_model(str(path))
        for ranks in (2, 4):
            why = why_not_buildable({**{k.name: k.default for k in KNOBS}, "tensor_parallel": 2},
                                    ProblemShape(num_gpus=ranks, gpus_per_node=ranks, model=model))
            if why:
                rows.append(dict(family=family, ranks=ranks, refused=why))
                continue
            cases = [(ac, "none") for ac in CHECKPOINTING] + [(ac, "blocks") for ac in COMPILED_CHECKPOINTING if compiled]
            for ac, compile_mode in cases:
                specs.append(TrialSpec(model=model, cluster=Cluster(num_gpus=ranks), seq_len=SEQ_LEN, grad_accum_steps=1,
                                       train=TrainConfig(tensor_parallel=2, micro_batch_size=MICRO_BATCH,
                                                         activation_checkpointing=ac, compile=compile_mode)))
                rows.append(dict(family=family, ranks=ranks, ac=ac + (" compiled" if compile_mode != "none" else "")))
    with SimBackend(device_kind="cpu") as sim:
        predicted = [sim.evaluate(spec) for spec in specs]
    measured: list = [None] * len(specs)
    if real and specs:
        done = subprocess.run([sys.executable, "-c", RUN_FOR_REAL], input=json.dumps([s.to_dict() for s in specs]),
                              capture_output=True, text=True, timeout=3600)
        if done.returncode:
            raise SystemExit(f"the real launch failed:\n{done.stderr[-3000:]}")
        measured = [TrialResult.from_dict(d) for d in json.loads(done.stdout.strip().splitlines()[-1])]
    built = iter(zip(predicted, measured))
    for row in rows:
        if "refused" in row:
            continue
        sim, run = next(built)
        row["predicted"] = sim.extras.get("tensor_peak_bytes") if sim.status == "ok" else sim.message
        if run is not None:
            row["measured"] = run.extras.get("tensor_peak_bytes") if run.status == "ok" else run.message
    return rows


def tune(args: list[str], runs: Path) -> dict:
    from autotune.drivers.cli import main

    code = main([*args, "--backend", "sim", "--runs-dir", str(runs), "--compile", "none", "--float8", "none"])
    if code != 0:
        return {"exit": code}
    (best,) = sorted(runs.glob("*/best.json"))[-1:]
    return json.loads(best.read_text())


def _describe(best: dict) -> str:
    if "exit" in best:
        return f"exit {best['exit']}"
    fsdp, mesh = best["fsdp"], best.get("parallelism", {})
    parts = [f"tp={mesh.get('tensor_parallel', 1)}", f"mb={best['micro_batch_size']}", f"ac={fsdp['activation_checkpointing']}",
             *(["offload"] if fsdp["cpu_offload"] else []), *(["act-offload"] if fsdp.get("activation_offload") else [])]
    return (f"{' '.join(parts)}: peak {best['peak_memory_bytes'] / 2**30:.1f} GiB ({best['memory_source']}), "
            f"{best['tokens_per_sec']:,.0f} tokens/s ({best['throughput_source']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--no-real", action="store_true", help="predict only")
    parser.add_argument("--no-tune", action="store_true", help="skip the two tunes at scale")
    parser.add_argument("--compiled", action="store_true", help="also compiled blocks (checkpointing none and op)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows = memory_matrix(args.families.split(","), real=not args.no_real, folder=folder, compiled=args.compiled)
        print(f"{'family':10} {'ranks':>5} {'ac':>12} {'predicted B':>14} {'measured B':>14} {'error':>9}")
        for row in rows:
            if "refused" in row:
                print(f"{row['family']:10} {row['ranks']:>5}   refused: {row['refused']}")
                continue
            predicted, measured = row["predicted"], row.get("measured")
            error = (f"{(predicted - measured) / measured:+.4%}" if isinstance(predicted, int) and isinstance(measured, int)
                     else "-")
            print(f"{row['family']:10} {row['ranks']:>5} {row['ac']:>12} {predicted!s:>14} {measured!s:>14} {error:>9}")
        if args.no_tune:
            return
        config = folder / "llama3.1-405b-shaped" / "config.json"
        config.parent.mkdir()
        config.write_text(json.dumps(LLAMA_405B))
        for name, problem in (
                ("llama3-70b, 1024 x h100-80gb, 4Mi tokens, seq 8192",
                 ["--model", "llama3-70b", "--gpus", "1024", "--gpu-type", "h100-80gb", "--global-tokens", "4Mi",
                  "--seq-len", "8192"]),
                ("Llama-3.1-405B-shaped, 128 x h100-80gb, 2Mi tokens, seq 8192",
                 ["--model", str(config), "--gpus", "128", "--gpu-type", "h100-80gb", "--global-tokens", "2Mi",
                  "--seq-len", "8192"])):
            print(f"\n{name}: {_describe(tune(problem, folder / 'runs' / name.split(',')[0]))}")


if __name__ == "__main__":
    main()
