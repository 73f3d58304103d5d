"""Shrink any transformers config to a tiny model of the same architecture, generically.

`shrink_config("gpt2", num_layers=6)` builds the family's default config with
`AutoConfig.for_model` and returns the keyword arguments of a tiny one: hidden size 64, 4 heads,
2 KV heads where the family has them, head_dim 16 where it has one, MLP width 128 under whatever
name (`intermediate_size`, `ffn_dim`, `n_inner`, `ffn_hidden_size`, ...), 4 experts and 2 per
token, a vocabulary of 512 with every token id inside it, 256 positions, sliding windows of 32,
and the requested depth. Fields are set through their canonical names (transformers maps them
through the config class's `attribute_map`), and any other integer field whose default equals
the default hidden size, MLP width or depth is set to the tiny one, so that a family's own
spelling of a derived size follows (a head count equal to the default depth is not a depth:
Qwen3.5's 32 value heads). Where a routed family leaves experts per token to its checkpoints
(None: DeepSeek-V2), it is set as for any other. Sub-configs (MPT's `attn_config`, DBRX's `ffn_config`) are
shrunk alike. `shrunk_config` builds the config (`save_pretrained` writes it as a user's
config.json would be written).

Used by benchmarks/bench_families.py and tests/test_model_coverage.py: the generated family matrix.
"""

from __future__ import annotations

from typing import Any

from autotune.problem.catalog.layers import layer_index_dict

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
MLP_WIDTH = 128
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
VOCAB = 512
POSITIONS = 256
WINDOW = 32

# The MLP's width under the names families give it (a None default means "derived": n_inner).
MLP_NAMES = ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff", "inner_hidden_size",
             "mlp_hidden_size", "ffn_size", "dim_feedforward", "moe_intermediate_size",
             "shared_expert_intermediate_size", "expert_ffn_hidden_size", "moe_ffn_hidden_size",
             "expert_intermediate_size", "shared_intermediate_size", "dense_intermediate_size")
MLP_SUFFIXES = ("ffn_dim", "dim_ff", "dff", "d_inner", "intermediate_size", "ffn_hidden_size")
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN_NAMES = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "moe_top_k",
                           "top_k_experts")
GROUPS = ("n_group", "num_expert_group", "topk_group")  # expert groups must divide the tiny expert count
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shrink_dict(data: dict[str, Any], *, hidden: Any, mlp: Any, depth: Any, num_layers: int,
                 top: bool = True) -> dict[str, Any]:
    """Generic replacements in one (sub-)config dict: sizes equal to the defaults' hidden size or
    MLP width (and, at the top, depth) follow to the tiny ones; token ids and windows move inside
    the tiny model; state-space heads keep heads x head size = expand x hidden."""
    out: dict[str, Any] = {}
    next_id = 3
    for key, value in data.items():
        if isinstance(value, dict) and key not in ("id2label", "label2id") and layer_index_dict(value):  # per-layer: {"05": {...}}
            out[key] = {k: _shrink_dict(v, hidden=hidden, mlp=mlp, depth=depth, num_layers=num_layers, top=False)
                        if isinstance(v, dict) else v for k, v in value.items() if int(k) < num_layers}
            continue
        if isinstance(value, dict) and key.endswith("_config"):
            out[key] = _shrink_dict(value, hidden=hidden, mlp=mlp, depth=depth, num_layers=num_layers, top=False)
            continue
        if key.endswith(("_token_id", "_token_index", "_token_ids")):
            values = value if isinstance(value, list) else [value]
            if any(_is_int(v) and v >= VOCAB for v in values):
                fixed = []
                for v in values:
                    if _is_int(v) and v >= VOCAB:
                        v = TOKEN_IDS.get(key, next_id)
                        next_id += key not in TOKEN_IDS
                    fixed.append(v)
                out[key] = fixed if isinstance(value, list) else fixed[0]
            continue
        if not _is_int(value) or value <= 1:
            continue
        if "window" in key:
            out[key] = min(value, WINDOW)
        elif "vocab_size" in key:
            out[key] = VOCAB
        elif "rotary_dim" in key or "rope_dim" in key:
            out[key] = min(value, HEAD_DIM)
        elif key.startswith("hidden_size_per_layer"):
            out[key] = min(value, HIDDEN)
        elif key == "first_k_dense_replace":
            out[key] = 1
        elif hidden and value == hidden:
            out[key] = HIDDEN
        elif mlp and value == mlp:
            out[key] = MLP_WIDTH
        elif top and depth and value == depth and "heads" not in key:  # a head count that equals the depth is not it
            out[key] = num_layers
        elif key in MLP_NAMES or key.endswith(MLP_SUFFIXES):
            out[key] = MLP_WIDTH
        elif key in EXPERT_COUNTS:
            out[key] = EXPERTS
        elif key in EXPERTS_PER_TOKEN_NAMES:
            out[key] = EXPERTS_PER_TOKEN
        elif key in GROUPS:
            out[key] = 1
        elif "head_dim" in key or key == "d_head":
            out[key] = HEAD_DIM
        elif "lora_rank" in key:
            out[key] = 32
        elif key in ("num_attention_heads", "num_heads", "n_heads", "n_head"):
            out[key] = HEADS
        elif key in ("num_key_value_heads", "kv_n_heads", "num_kv_heads"):
            out[key] = min(value, KV_HEADS)
    merged = {**data, **out}
    for prefix in ("", "mamba_", "ssm_"):  # state-space mixers: heads x head size = expand x hidden
        expand = merged.get(f"{prefix}expand")
        heads_key = next((k for k in (f"{prefix}num_heads", f"{prefix}n_heads") if k in merged), None)
        size_key = next((k for k in (f"{prefix}head_dim", f"{prefix}d_head") if k in merged), None)
        if _is_int(expand) and heads_key and size_key:
            merged[size_key] = HEAD_DIM
            merged[heads_key] = max(expand * HIDDEN // HEAD_DIM, 1)
            if _is_int(merged.get(f"{prefix}d_ssm")):
                merged[f"{prefix}d_ssm"] = merged[heads_key] * HEAD_DIM
            for groups in (f"{prefix}n_groups", f"{prefix}num_groups"):
                if _is_int(merged.get(groups)) and merged[groups] > 1:
                    merged[groups] = 1
    return merged


def shrink_config(model_type: str, *, num_layers: int = 4) -> dict[str, Any]:
    """Keyword arguments of a tiny `model_type` config (canonical names; see the module doc).
    Raises whatever transformers raises where the family's default config cannot be built."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    stored = default.to_dict()
    attribute_map = dict(getattr(type(default), "attribute_map", None) or {})
    fields = set(vars(default)) | set(stored)

    def value_of(name: str) -> Any:
        try:
            return getattr(default, name)
        except Exception:  # noqa: BLE001 - unset, read-only, or per-layer only
            return None

    def has(name: str) -> bool:
        """A field the family stores (under this name or its alias), not a derived property."""
        return name in fields or attribute_map.get(name) in fields

    hidden = value_of("hidden_size")
    depth = value_of("num_hidden_layers")
    mlp = next((value_of(n) for n in MLP_NAMES if _is_int(value_of(n))), None)
    for key in ("model_type", "transformers_version", "architectures", "_name_or_path", "auto_map"):
        stored.pop(key, None)
    # Per-layer lists of the default depth: the same pattern, cut or repeated to the new depth.
    if _is_int(depth):
        for key, value in list(stored.items()):
            if isinstance(value, list) and len(value) == depth and value and not key.endswith(("_token_id", "_token_ids")):
                stored[key] = [value[i % len(value)] for i in range(num_layers)]
    data = _shrink_dict(stored, hidden=hidden if _is_int(hidden) else None, mlp=mlp,
                        depth=depth if _is_int(depth) else None, num_layers=num_layers)
    # Stored aliases become canonical names (a value set twice is set once).
    for canonical, alias in attribute_map.items():
        if alias in data and alias != canonical and canonical in ("num_hidden_layers", "hidden_size",
                                                                   "num_attention_heads", "vocab_size",
                                                                   "max_position_embeddings"):
            data.pop(alias)
    explicit: dict[str, Any] = {}
    if has("hidden_size"):
        explicit["hidden_size"] = HIDDEN
    if has("num_hidden_layers"):
        explicit["num_hidden_layers"] = num_layers
    if has("num_attention_heads"):
        explicit["num_attention_heads"] = HEADS
    if has("num_key_value_heads"):
        kv = value_of("num_key_value_heads")
        heads = value_of("num_attention_heads")
        # 1 stays 1 (multi-query); otherwise grouped where the default groups, else as many as heads
        explicit["num_key_value_heads"] = 1 if kv == 1 else (KV_HEADS if kv is None or kv != heads else HEADS)
    if has("head_dim") and value_of("head_dim") is not None:
        explicit["head_dim"] = HEAD_DIM
    if has("vocab_size"):
        explicit["vocab_size"] = VOCAB
    if has("max_position_embeddings") and value_of("max_position_embeddings") is not None:
        explicit["max_position_embeddings"] = POSITIONS
    for name in MLP_NAMES:
        if has(name) and (value_of(name) is None or _is_int(value_of(name))):
            explicit[name] = MLP_WIDTH
    for name in EXPERT_COUNTS:
        if _is_int(stored.get(name)) and stored[name] > 1:
            explicit[name] = EXPERTS
    routed = any(_is_int(stored.get(name)) and stored[name] > 1 for name in EXPERT_COUNTS)
    for name in EXPERTS_PER_TOKEN_NAMES:
        # None where the family leaves it to the checkpoint (DeepSeek-V2's default config cannot run a
        # forward: topk's k is None); every released config of a routed family sets it.
        if (_is_int(stored.get(name)) and stored[name] > 1) or (name in stored and stored[name] is None and routed):
            explicit[name] = EXPERTS_PER_TOKEN
    shrunk = {**data, **explicit}
    if explicit.get("num_key_value_heads") not in (None, HEADS):
        try:
            AutoConfig.for_model(model_type, **shrunk)
        except Exception:  # noqa: BLE001 - a family whose validation wants as many KV heads as heads
            shrunk["num_key_value_heads"] = HEADS
    return shrunk


def shrunk_config(model_type: str, *, num_layers: int = 4, **overrides: Any):
    """The tiny config itself (`save_pretrained` writes its config.json); `overrides` win."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**shrink_config(model_type, num_layers=num_layers), **overrides})
