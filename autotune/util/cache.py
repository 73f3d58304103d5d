"""A persistent cache in the user's cache folder, shared by every run on the machine.

People re-plan often (each model, cluster size, sequence length, nightly matrix cell), and a
prediction depends only on what it was made from. Entries are keyed by everything that
determines them: the caller's inputs, the torch, transformers, peft and bitsandbytes versions, and a fingerprint
of autotune's own source files (so a changed simulator never reuses an old answer). Values are
JSON. Writes are atomic (a temporary file renamed into place), so processes sharing the folder
never read half an entry; an unreadable entry is a miss. A folder that cannot be written
(read-only home) only costs the speed.

    AUTOTUNE_CACHE_DIR   the folder (default: $XDG_CACHE_HOME/autotune, else ~/.cache/autotune)
    AUTOTUNE_CACHE=off   no persistent cache
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

CACHE_ENV, CACHE_DIR_ENV = "AUTOTUNE_CACHE", "AUTOTUNE_CACHE_DIR"


def cache_dir() -> Path | None:
    if os.environ.get(CACHE_ENV, "").lower() in ("off", "0", "false", "no"):
        return None
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autotune"


@functools.cache
def fingerprint() -> dict[str, str]:
    """What every entry depends on besides its inputs: library versions (read from package
    metadata, without importing them) and a hash of autotune's source files."""
    versions = {}
    for name in ("torch", "transformers", "peft", "bitsandbytes"):  # peft, bnb: what LoRA and QLoRA trace
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]  # autotune/, every subpackage
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    versions["autotune_sources"] = digest.hexdigest()[:16]
    return versions


@functools.cache
def code_digest() -> str:
    """One short hex of `fingerprint()`: which autotune sources and library versions made a result (a study's
    estimated trials record it, and are reused only by the same code)."""
    return hashlib.sha256(json.dumps(fingerprint(), sort_keys=True).encode()).hexdigest()[:16]


def key_of(kind: str, inputs: Any) -> str:
    payload = json.dumps([kind, inputs, fingerprint()], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def _path(kind: str, key: str) -> Path | None:
    folder = cache_dir()
    return None if folder is None else folder / kind / key[:2] / f"{key}.json"


def load(kind: str, key: str) -> Any | None:
    path = _path(kind, key)
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def store(kind: str, key: str, value: Any) -> None:
    path = _path(kind, key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".tmp-", suffix=".json", delete=False) as handle:
            json.dump(value, handle)
        os.replace(handle.name, path)
    except OSError:
        try:
            os.unlink(handle.name)  # type: ignore[possibly-undefined]
        except (OSError, NameError):
            pass


def cached(kind: str, inputs: Any, compute):
    """`compute()` once per inputs (and versions and code) on this machine; JSON values only."""
    key = key_of(kind, inputs)
    value = load(kind, key)
    if value is None:
        value = compute()
        store(kind, key, value)
    return value
