"""The winning configuration in the formats of the stacks people train with.

    export = export_result(result, "accelerate")   # result: a best.json document
    export.text, export.filename, export.warnings

Each format is one private module with a key-mapping table (see `_base.py`): every tuned knob
is mapped, approximated or unsupported, and whatever is not mapped is said in the file and in
`Export.warnings`. See docs/EXPORTS.md for the tables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from autotune.util.errors import UsageError
from autotune.results.export_formats import DESCRIPTIONS
from autotune.results.export._base import KNOBS, Export, ExportRefused, KnobMapping, Tuned
from autotune.results.export._cookbook import export_cookbook
from autotune.results.export._fsdp1 import export_fsdp1, export_lightning_fsdp1
from autotune.results.export._fsdp2 import export_fsdp2
from autotune.results.export._lightning import export_lightning
from autotune.results.export._litgpt import export_litgpt
from autotune.results.export._hf import export_accelerate, export_hf_trainer, export_trl
from autotune.results.export._torchtitan import export_torchtitan

__all__ = ["DESCRIPTIONS", "FORMATS", "KNOBS", "ON_REQUEST", "Export", "KnobMapping", "Tuned", "export_result",
           "write_exports"]

FORMATS: dict[str, Callable[[Tuned], Export]] = {
    "fsdp2": export_fsdp2,
    "fsdp1": export_fsdp1,
    "lightning": export_lightning,
    "lightning-fsdp1": export_lightning_fsdp1,
    "accelerate": export_accelerate,
    "hf-trainer": export_hf_trainer,
    "trl": export_trl,
    "torchtitan": export_torchtitan,
    "llama-cookbook": export_cookbook,
    "litgpt": export_litgpt,
}


ON_REQUEST = ("lightning-fsdp1",)
"""Formats `all` leaves out: written only when named (FSDP1's flat parameters are not what was
traced; the `lightning` format is the FSDP2 one)."""


def export_result(result: dict[str, Any], fmt: str) -> Export:
    """Render a best.json document in one format (a key of FORMATS)."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown export format {fmt!r}: choose from {', '.join(FORMATS)}")
    return FORMATS[fmt](Tuned.from_result(result))


def write_exports(result: dict[str, Any], formats: Iterable[str], out_dir: str | Path, *,
                  on_written: Callable[[Export, Path], None] | None = None,
                  on_refused: Callable[[str, str], None] | None = None) -> list[Path]:
    """Write each format's file into out_dir (atomically); returns the paths in order.

    `on_written(export, path)` is called per file, e.g. to show its warnings. A format that cannot
    express this result at all (torchtitan without a model of these shapes) raises ExportRefused,
    or, given `on_refused(format, why)` (the CLI's), is reported there and skipped."""
    out = Path(out_dir)
    exports = []
    for fmt in formats:  # all checked before any is written
        try:
            exports.append(export_result(result, fmt))
        except ExportRefused as exc:
            if on_refused is None:
                raise
            on_refused(fmt, str(exc))
    from autotune.util.files import write_atomic

    if exports:  # a folder only where something goes into it
        out.mkdir(parents=True, exist_ok=True)
    paths = []
    for exported in exports:
        path = out / exported.filename
        write_atomic(path, exported.text)
        if exported.text.startswith("#!"):  # scripts: runnable as they are
            path.chmod(0o755)
        paths.append(path)
        if on_written is not None:
            on_written(exported, path)
    return paths
