"""The persistent prediction cache: a repeated plan in a new runs folder is answered without
importing torch or transformers and gives the same result; what it depends on keys it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PLAN = ["--model", "micro-llama", "--gpus", "2", "--global-tokens", "64K", "--backend", "sim"]  # the quickest to trace
# Runs the CLI in-process, then reports which heavy libraries the run imported.
PROBE = ("import sys\nfrom autotune.drivers.cli import main\ntry:\n    code = main(sys.argv[1:])\n"
         "except SystemExit as exit:  # --help\n    code = exit.code\n"
         "print('IMPORTED', 'torch' in sys.modules, 'transformers' in sys.modules, code)\n")


def plan(tmp_path: Path, runs: str, *args: str, env: dict | None = None) -> tuple[dict, tuple[str, str, str]]:
    done = subprocess.run([sys.executable, "-c", PROBE, *args, "--runs-dir", str(tmp_path / runs)],
                          capture_output=True, text=True, env=env, timeout=600)
    imported = next(line for line in done.stdout.splitlines() if line.startswith("IMPORTED")).split()[1:]
    best = [json.loads(p.read_text()) for p in (tmp_path / runs).glob("*/best.json")]
    assert imported[2] in ("0", "None"), done.stderr[-2000:]
    return best[0], tuple(imported)


def _env_without_cache_switch(cache_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_CACHE"}
    env["AUTOTUNE_CACHE_DIR"] = str(cache_dir)
    return env


@pytest.fixture(scope="module")
def first_plan(tmp_path_factory) -> tuple[dict, tuple[str, str, str], Path]:
    """The plan made once into an empty cache (traced: the slow part), shared by this module's
    tests; each test gets a copy of the cache folder it filled (see cache_env)."""
    folder = tmp_path_factory.mktemp("first-plan")
    best, imported = plan(folder, "runs", *PLAN, env=_env_without_cache_switch(folder / "cache"))
    return best, imported, folder / "cache"


@pytest.fixture()
def cache_env(tmp_path, first_plan) -> dict:
    """A cache folder of this test's own, holding what the first plan wrote."""
    shutil.copytree(first_plan[2], tmp_path / "cache")
    return _env_without_cache_switch(tmp_path / "cache")


def test_help_imports_neither_torch_nor_transformers():
    done = subprocess.run([sys.executable, "-c", PROBE, "--help"], capture_output=True, text=True, timeout=60)
    assert "IMPORTED False False 0" in done.stdout


def test_repeated_plan_is_served_from_the_cache_without_torch(tmp_path, first_plan, cache_env):
    first, imported, _ = first_plan
    assert imported[:2] == ("True", "True")  # traced: torch and transformers were needed
    again, imported = plan(tmp_path, "runs2", *PLAN, env=cache_env)
    assert imported[:2] == ("False", "False")
    for key in ("micro_batch_size", "grad_accum_steps", "fsdp", "peak_memory_bytes", "tokens_per_sec",
                "memory_breakdown", "decision_path"):
        assert again[key] == first[key], key
    assert again["model"]["parameters"] == first["model"]["parameters"]


def test_cache_is_keyed_by_what_the_prediction_depends_on(tmp_path, first_plan, cache_env):
    first = first_plan[0]  # made into this cache (a copy of it)
    # Another allocator setting changes the fragmentation term: not answered from the cache.
    other = dict(cache_env, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False")
    changed, imported = plan(tmp_path, "runs2", *PLAN, env=other)
    assert imported[0] == "True" and changed["environment"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    assert changed["memory"]["runtime"]["alloc_conf"] == "expandable_segments:False"
    # Unreadable entries are misses, never errors.
    for entry in Path(cache_env["AUTOTUNE_CACHE_DIR"]).rglob("*.json"):
        entry.write_text("{not json")
    again, imported = plan(tmp_path, "runs3", *PLAN, env=cache_env)
    assert imported[0] == "True" and again["peak_memory_bytes"] == first["peak_memory_bytes"]
