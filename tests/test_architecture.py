"""The architecture, as import-linter contracts (pyproject.toml, [tool.importlinter]; the layers
are drawn in docs/ARCHITECTURE.md): a change that imports upwards, lets a backend or the catalog
know a higher layer, or closes an import circle fails here.

Run by hand: `lint-imports` in the repository root (the test extra installs it)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter's own command on the package and contracts under `root`."""
    env = dict(os.environ, PYTHONPATH=str(root), COLUMNS="1000")  # one line per contract
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_import_contracts_are_kept():
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("autotune/problem/catalog/gpus.py", "from autotune.problem import config", "The catalog is plain data"),
    ("autotune/backends/base.py", "from autotune.search import records", "Backends evaluate one trial"),
    ("autotune/problem/config.py", "from autotune.distributed import training", "Layers"),
    ("autotune/backends/sim/_helper.py", "from autotune.backends.sim import _backend", "No import circles"),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path, module, line, contract):
    """The check checks: one offending import added to a copy of the package breaks the contract
    that forbids it (and the command says which)."""
    shutil.copytree(ROOT / "autotune", tmp_path / "autotune", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}  # added by the test\n")
    run = lint_imports(tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    broken = [text for text in run.stdout.splitlines() if text.endswith("BROKEN")]
    assert any(text.startswith(contract) for text in broken), run.stdout
