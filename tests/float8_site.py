"""Where the tests find torchao (the `float8` extra): beside the test environment, not in it.

`make test` installs torchao with `pip install --no-deps --target .float8-site`. Installed in the
venv, transformers imports it on every model build (its quantizers do), which costs each process
about 1.5 s of CPU (measured: 1.55 s, torch 2.13 CPU, torchao 0.18) and writes torchao's CUDA
library warnings to stderr that one-line-error tests read; the suite starts hundreds of such
processes (trial ranks, CLI runs, sweep workers). So only the float8 tests, and the processes they
start, put it on their path. A user installs the extra into their environment as usual.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

FLOAT8_SITE = Path(__file__).resolve().parent.parent / ".float8-site"


def add_to_path() -> None:
    """This process can import torchao (if `make test` installed it)."""
    if FLOAT8_SITE.is_dir() and str(FLOAT8_SITE) not in sys.path:
        sys.path.insert(0, str(FLOAT8_SITE))


def python_path(*first: str) -> str:
    """A PYTHONPATH for a child process that can import torchao: `first`, then the site, then the
    current PYTHONPATH."""
    parts = [*first, str(FLOAT8_SITE), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)
