"""Per-layer structure of a decoder config: which blocks differ, their period, and shallow copies.

Recent transformers configs describe layers one by one (`layer_types`: sliding or full attention
per layer; SmolLM3's `no_rope_layers`; MoE configs whose `mlp_only_layers` or
`decoder_sparse_step` make some layers dense). The simulator traces shallow copies of a model
and extrapolates in depth, which is exact only if the shallow copy's blocks are the real model's
blocks. So a shallow copy of depth d takes the first d layers of every per-layer field, and the
depth extrapolation repeats whole periods of the layer pattern: with d = L (mod period), the
copy's bottom and top blocks are the real model's bottom and top blocks.

Everything here works on the config as transformers completes it (`full_config_dict`): fields
that transformers derives (Qwen2's `layer_types` from `max_window_layers`) are then explicit, so
a cut can never let transformers re-derive them differently for the shallow copy.
"""

from __future__ import annotations

from typing import Any

# Top-level lists that are never per-layer even when their length happens to equal the depth.
_NOT_PER_LAYER = frozenset({
    "architectures", "eos_token_id", "bos_token_id", "pad_token_id", "bad_words_ids", "suppress_tokens",
    "begin_suppress_tokens", "forced_decoder_ids", "id2label", "label2id", "tags",
})
# Lists of layer indices (not one entry per layer).
_LAYER_INDEX_LISTS = ("mlp_only_layers",)


def layer_index_dict(value: Any) -> bool:
    """A dict of per-layer overrides keyed by layer index (Gemma 4's `per_layer_config`: {"05": {...}})."""
    return isinstance(value, dict) and bool(value) and all(
        (isinstance(k, int) and not isinstance(k, bool)) or (isinstance(k, str) and k.isdigit()) for k in value)


def layer_index_dict_keys(config: dict[str, Any]) -> list[str]:
    """Fields holding per-layer overrides keyed by layer index."""
    return sorted(key for key, value in config.items() if key not in _NOT_PER_LAYER and layer_index_dict(value))


def per_layer_keys(config: dict[str, Any]) -> list[str]:
    """Fields holding one entry per decoder layer."""
    num_layers = int(config["num_hidden_layers"])
    return sorted(key for key, value in config.items()
                  if isinstance(value, list) and len(value) == num_layers and key not in _NOT_PER_LAYER)


def layer_signatures(config: dict[str, Any], keys: list[str] | None = None) -> list[tuple]:
    """What distinguishes layer i from another, for every layer of the model: its entries in the
    per-layer fields (`keys`, by default those of `config`) and the rule-based fields (dense vs
    MoE layers). Equal signatures mean blocks of the same structure (same modules, same
    attention pattern)."""
    num_layers = int(config["num_hidden_layers"])
    keys = per_layer_keys(config) if keys is None else keys
    dense = set(config.get("mlp_only_layers") or ())
    sparse_step = config.get("decoder_sparse_step")
    num_experts = config.get("num_experts") or config.get("num_local_experts") or 0
    first_dense = config.get("first_k_dense_replace")
    moe_freq = config.get("moe_layer_freq")
    signatures = []
    indexed = [key for key in layer_index_dict_keys(config)]
    for index in range(num_layers):
        signature: list[Any] = [(key, _hashable(config[key][index])) for key in keys]
        for key in indexed:
            entry = next((v for k, v in config[key].items() if int(k) == index), None)
            if entry is not None:
                signature.append((key, _hashable(entry)))
        if index in dense:
            signature.append(("dense_mlp", True))
        if sparse_step and num_experts:
            signature.append(("moe", (index + 1) % int(sparse_step) == 0 and index not in dense))
        if first_dense is not None:
            is_moe = index >= int(first_dense) and (not moe_freq or index % int(moe_freq) == 0)
            signature.append(("moe", is_moe))
        signatures.append(tuple(signature))
    return signatures


def layer_period(config: dict[str, Any], structures: list[str] | None = None) -> int:
    """The smallest p with signature[i] == signature[i + p] for every layer: 1 for a model of
    identical blocks, 2 for Gemma 2's alternating sliding/full attention. A pattern that does not
    repeat (a dense prefix before MoE layers) has period num_layers: traced whole, never cut.
    `structures` (one per layer: the modules and parameter shapes of the block transformers
    builds) adds what the config's fields do not say (a family's own rule for its MoE layers)."""
    signatures = layer_signatures(config)
    if structures is not None and len(structures) == len(signatures):
        signatures = [(*signature, ("structure", structure)) for signature, structure in zip(signatures, structures)]
    return period_of_signatures(signatures)


def period_of_signatures(signatures: list) -> int:
    """The smallest p with signatures[i] == signatures[i + p] for every i."""
    num_layers = len(signatures)
    for period in range(1, num_layers):
        if all(signatures[i] == signatures[i + period] for i in range(num_layers - period)):
            return period
    return max(num_layers, 1)


def shallow_config_dict(config: dict[str, Any], depth: int) -> dict[str, Any]:
    """The config of the model cut to its first `depth` layers, every per-layer field cut alike.

    Raises ValueError if the cut would drop a kind of layer the full model has (a shallow copy
    must contain every block structure it stands for)."""
    num_layers = int(config["num_hidden_layers"])
    if not 1 <= depth <= num_layers:
        raise ValueError(f"a shallow copy needs 1 <= depth <= {num_layers}, got {depth}")
    cut = dict(config)
    for key in per_layer_keys(config):
        cut[key] = list(config[key][:depth])
    for key in _LAYER_INDEX_LISTS:
        if isinstance(config.get(key), list):
            cut[key] = [i for i in config[key] if i < depth]
    for key in layer_index_dict_keys(config):
        cut[key] = {k: v for k, v in config[key].items() if int(k) < depth}
    cut["num_hidden_layers"] = depth
    return cut


def missing_kinds(config: dict[str, Any], depth: int) -> int:
    """How many kinds of layer of the full model a `depth`-layer copy lacks (0 when it has them all)."""
    keys = per_layer_keys(config)  # the full model's: in a shallow copy any short list has its length
    full = set(layer_signatures(config, keys))
    shallow = set(layer_signatures(shallow_config_dict(config, depth), keys))
    return len(full - shallow)


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value
