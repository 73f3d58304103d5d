"""Atomic file writes: a reader (a user, a launcher polling a folder) never sees half a file.

Kept free of heavy imports so trial workers can use it too.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0o022)  # the only portable way to read it is to set it, so set it straight back
    os.umask(mask)
    return mask


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` via a temporary file in the same folder and an atomic rename.

    The file gets the permissions an ordinary open() would give (0666 less the umask), not
    mkstemp's private 0600: teammates on a shared file system read results like the log."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Any) -> None:
    """`data` as JSON, atomically."""
    write_atomic(path, json.dumps(data))
