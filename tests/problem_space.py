"""The problems a user types, as data: one definition for the property tests (Hypothesis draws from
it, tests/test_problem_space.py) and the long fuzz run (benchmarks/fuzz_problems.py draws from it
with a seeded random generator).

A problem is a dict of choices; `argv` turns it into the command line a user would type, with a
global batch chosen reachable (a whole number of sequences per GPU), and `verdict` says whether the
tool's answer to it is a clean one: exit 0 (a winner), 3 (nothing fits) or 2 with one line that
names only flags the user gave.
"""

from __future__ import annotations

import re
from pathlib import Path

from autotune.problem.catalog.gpus import GPUS
from autotune.problem.catalog.models import MODELS

SPACE: dict[str, tuple] = {
    "model": tuple(MODELS),
    "gpus_per_node": (1, 2, 4, 8),
    "nodes": (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32, 55, 64),
    "seq_len": (512, 1024, 2048, 4096, 8192),
    "gpu_type": tuple(GPUS),
    "peft": ("none", "none", "lora"),
    "workload": ("sft", "sft", "sft", "grpo"),
    "stack": ("fsdp2", "fsdp2", "fsdp2", "trl", "torchtitan", "accelerate", "lightning", "litgpt", "llama-cookbook"),
    "time_budget": (None, None, None, "3s"),
    "headroom": (None, None, "0.05", "0.3"),
    "sequences_per_gpu": (1, 2, 3, 4, 8),
    "precision": (None, None, None, None, "bf16-pure", "fp32"),
    "attention": (None, None, None, None, "eager", "flash_attention_2", "flash_attention_3"),
    "compile": (None, None, None, "none", "explore", "blocks"),
    "float8": (None, None, None, "none", "explore", "tensorwise", "rowwise"),
    "pipelines": (False, False, False, True),
}
"""Each field's values, repeated where a value is what most users type (the default)."""

OK_EXITS = (0, 3)
EXIT_USAGE = 2


def argv(problem: dict, runs_dir: str) -> list[str]:
    """The command line of `problem`, tuned on the closed form (seconds a problem) into `runs_dir`."""
    gpus = problem["gpus_per_node"] * problem["nodes"]
    tokens = gpus * problem["seq_len"] * problem["sequences_per_gpu"]
    line = ["tune", "--model", problem["model"], "--gpus", str(gpus), "--nodes", str(problem["nodes"]),
            "--seq-len", str(problem["seq_len"]), "--gpu-type", problem["gpu_type"],
            "--global-tokens", str(tokens), "--backend", "analytic", "--runs-dir", runs_dir]
    if problem["peft"] != "none":
        line += ["--peft", problem["peft"]]
    if problem["workload"] != "sft":
        line += ["--workload", problem["workload"]]
    if problem["stack"] != "fsdp2":
        line += ["--stack", problem["stack"]]
    if problem["time_budget"]:
        line += ["--time-budget", problem["time_budget"]]
    if problem["headroom"]:
        line += ["--headroom", problem["headroom"]]
    if problem.get("precision"):
        line += ["--precision", problem["precision"]]
    if problem.get("attention"):
        line += ["--attention", problem["attention"]]
    if problem.get("compile"):
        line += ["--compile", problem["compile"]]
    if problem.get("float8"):
        line += ["--float8", problem["float8"]]
    if problem.get("pipelines"):  # the search space that adds pipeline parallelism to the meshes searched
        space = Path(runs_dir) / "pipelines.toml"
        space.parent.mkdir(parents=True, exist_ok=True)
        space.write_text("[explore]\npipeline_parallel = true\n")
        line += ["--space", str(space)]
    return line


_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def verdict(line: list[str], code: int, stderr: str) -> str:
    """'' where the answer is clean, else what is wrong with it (one line)."""
    if code in OK_EXITS:
        return ""
    if code != EXIT_USAGE:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else "(nothing on stderr)"
        return f"exit {code}: {last}"
    errors = [text for text in stderr.strip().splitlines() if "error:" in text]
    if len(errors) != 1:
        return f"exit 2 with {len(errors)} error lines: {stderr.strip()[:300]}"
    # What the error is about comes before its first colon ("--hsdp 16: the shard group ..."); a
    # flag after it may be the fix ("... or raise --global-tolerance").
    given = {word.split("=")[0] for word in line if word.startswith("--")}
    subject = errors[0].split("error:", 1)[1].split(": ", 1)[0]
    foreign = sorted(set(_FLAG.findall(subject)) - given)
    if foreign:
        return f"exit 2 naming {', '.join(foreign)}, which the user did not give: {errors[0]}"
    return ""
