"""`autotune models` and `autotune gpus`: the catalog's entries with their key figures and where each
comes from, as rows for the console's table and for --json."""

from __future__ import annotations

from typing import Any

MODELS_WHAT = ("shapes from each model's config.json (the source); parameters counted on a meta-device "
               "build of the model")
GPUS_WHAT = ("data-sheet peaks (the source): dense TFLOP/s, HBM and per-GPU link bandwidth in GB/s, one "
             "direction")


def model_rows() -> list[dict[str, Any]]:
    """One row per catalog model: its figures read from its config (parameters counted), and its source."""
    from autotune.problem.catalog.models import MODELS, resolve_model

    rows = []
    for name, entry in MODELS.items():
        model = resolve_model(name)
        config = entry.config
        rows.append(dict(name=name, model_type=entry.model_type, num_parameters=model.num_parameters,
                         num_layers=model.num_layers, hidden_size=config.get("hidden_size"),
                         num_attention_heads=config.get("num_attention_heads"),
                         num_key_value_heads=config.get("num_key_value_heads", config.get("num_attention_heads")),
                         num_experts=config.get("num_local_experts", config.get("num_experts")),
                         vocab_size=config.get("vocab_size"), default_seq_len=entry.default_seq_len,
                         max_positions=model.max_positions, source=entry.source))
    return rows


def gpu_rows() -> list[dict[str, Any]]:
    """One row per catalog GPU: its data-sheet figures and their sources."""
    from autotune.problem.catalog.gpus import DEFAULT_GPU, GPUS

    return [dict(gpu.to_dict(), default=gpu.name == DEFAULT_GPU, source=gpu.source,
                 float8_source=gpu.float8_source or None) for gpu in GPUS.values()]
