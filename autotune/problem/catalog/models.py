"""The model catalog: transformers configs with the published shapes, never downloaded.

Each entry is data: the transformers `model_type`, the config fields that define its shape,
the default training sequence length, and where the shapes come from. The `tiny-*` entries
are small enough to train for real on CPUs in tests.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from autotune.problem.catalog import attention
from autotune.problem.catalog import layers
from autotune.util.errors import UsageError

CANONICAL_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                    "vocab_size", "max_position_embeddings")
"""The config fields autotune reads by name, in transformers' canonical spelling. A family that stores
one under another name (GPT-2's `n_layer`, BLOOM's `n_head`, MPT's `d_model`) declares the alias in
its config class's `attribute_map`, through which transformers itself reads it; `canonical_config`
renames such keys, and transformers accepts the canonical names back as keyword arguments."""


def config_class_of(model_type: str):
    """The installed transformers' config class of `model_type`, or None where it has none."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except KeyError:
        return None


def canonical_config(model_type: str, data: dict[str, Any]) -> dict[str, Any]:
    """`data` with every stored alias of a CANONICAL_FIELDS name (the config class's
    `attribute_map`, canonical -> stored) renamed to the canonical name. A value given under both
    names keeps the canonical one; nothing else changes."""
    attribute_map = getattr(config_class_of(model_type), "attribute_map", None) or {}
    out = dict(data)
    for canonical in CANONICAL_FIELDS:
        stored = attribute_map.get(canonical)
        if not stored or stored == canonical or stored not in out:
            continue
        value = out.pop(stored)
        if out.get(canonical) is None:
            out[canonical] = value
    return out


@dataclass(frozen=True, kw_only=True)
class CatalogEntry:
    model_type: str
    config: dict[str, Any]
    default_seq_len: int
    source: str


MODELS: dict[str, CatalogEntry] = {
    "llama-7b": CatalogEntry(
        model_type="llama",
        config=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                    max_position_embeddings=4096, rms_norm_eps=1e-5),
        default_seq_len=4096,
        source="meta-llama/Llama-2-7b-hf config.json",
    ),
    "llama-13b": CatalogEntry(
        model_type="llama",
        config=dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                    num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
                    max_position_embeddings=4096, rms_norm_eps=1e-5),
        default_seq_len=4096,
        source="meta-llama/Llama-2-13b-hf config.json",
    ),
    "llama-70b": CatalogEntry(
        model_type="llama",
        config=dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                    num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                    max_position_embeddings=4096, rms_norm_eps=1e-5),
        default_seq_len=4096,
        source="meta-llama/Llama-2-70b-hf config.json",
    ),
    "codellama-34b": CatalogEntry(
        model_type="llama",
        config=dict(hidden_size=8192, intermediate_size=22016, num_hidden_layers=48,
                    num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                    max_position_embeddings=16384, rms_norm_eps=1e-5, rope_theta=1000000.0),
        default_seq_len=4096,
        source="codellama/CodeLlama-34b-hf config.json (the shape of fms-fsdp's llama2_34b)",
    ),
    "llama3-8b": CatalogEntry(
        model_type="llama",
        config=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0),
        default_seq_len=8192,
        source="meta-llama/Meta-Llama-3-8B config.json",
    ),
    "llama3-70b": CatalogEntry(
        model_type="llama",
        config=dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                    num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0),
        default_seq_len=8192,
        source="meta-llama/Meta-Llama-3-70B config.json",
    ),
    "mistral-7b": CatalogEntry(
        model_type="mistral",
        config=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                    max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=4096,
                    rope_theta=10000.0),
        default_seq_len=8192,
        source="mistralai/Mistral-7B-v0.1 config.json",
    ),
    "qwen2.5-7b": CatalogEntry(
        model_type="qwen2",
        config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                    num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                    max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    tie_word_embeddings=False, use_sliding_window=False),
        default_seq_len=8192,
        source="Qwen/Qwen2.5-7B config.json",
    ),
    "qwen2.5-0.5b": CatalogEntry(
        model_type="qwen2",
        config=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                    num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                    max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    tie_word_embeddings=True, use_sliding_window=False),
        default_seq_len=2048,
        source="Qwen/Qwen2.5-0.5B config.json (tied input and output embeddings; the GPU check's model)",
    ),
    "qwen2.5-1.5b": CatalogEntry(
        model_type="qwen2",
        config=dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                    num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                    max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    tie_word_embeddings=True, use_sliding_window=False),
        default_seq_len=4096,
        source="Qwen/Qwen2.5-1.5B config.json (tied embeddings)",
    ),
    "llama3.2-1b": CatalogEntry(
        model_type="llama",
        config=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                    tie_word_embeddings=True,
                    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=8192)),
        default_seq_len=8192,
        source="meta-llama/Llama-3.2-1B config.json (tied embeddings, llama3 RoPE scaling)",
    ),
    "llama3.1-8b": CatalogEntry(
        model_type="llama",
        config=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=8192)),
        default_seq_len=8192,
        source="meta-llama/Llama-3.1-8B config.json (128k positions via llama3 RoPE scaling)",
    ),
    "llama3.1-70b": CatalogEntry(
        model_type="llama",
        config=dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                    num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=8192)),
        default_seq_len=8192,
        source="meta-llama/Llama-3.1-70B config.json (128k positions via llama3 RoPE scaling)",
    ),
    "llama3.1-405b": CatalogEntry(
        model_type="llama",
        config=dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                    num_attention_heads=128, num_key_value_heads=8, vocab_size=128256,
                    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=8192)),
        default_seq_len=8192,
        source="meta-llama/Llama-3.1-405B config.json (128k positions via llama3 RoPE scaling)",
    ),
    "qwen2.5-32b": CatalogEntry(
        model_type="qwen2",
        config=dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                    num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1000000.0,
                    tie_word_embeddings=False, use_sliding_window=False),
        default_seq_len=8192,
        source="Qwen/Qwen2.5-32B config.json",
    ),
    "qwen2.5-72b": CatalogEntry(
        model_type="qwen2",
        config=dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                    num_attention_heads=64, num_key_value_heads=8, vocab_size=152064,
                    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1000000.0,
                    tie_word_embeddings=False, use_sliding_window=False),
        default_seq_len=8192,
        source="Qwen/Qwen2.5-72B config.json",
    ),
    "qwen3-8b": CatalogEntry(
        model_type="qwen3",
        config=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    tie_word_embeddings=False),
        default_seq_len=8192,
        source="Qwen/Qwen3-8B config.json",
    ),
    "qwen3-32b": CatalogEntry(
        model_type="qwen3",
        config=dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                    num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    tie_word_embeddings=False),
        default_seq_len=8192,
        source="Qwen/Qwen3-32B config.json (Qwen3 has no dense 72B; the largest dense model is 32B)",
    ),
    "mixtral-8x7b": CatalogEntry(
        model_type="mixtral",
        config=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                    max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
                    num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
        default_seq_len=4096,
        source="mistralai/Mixtral-8x7B-v0.1 config.json",
    ),
    "qwen3-30b-a3b": CatalogEntry(
        model_type="qwen3_moe",
        config=dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                    norm_topk_prob=True, tie_word_embeddings=False, use_sliding_window=False),
        default_seq_len=4096,
        source="Qwen/Qwen3-30B-A3B config.json (128 experts, 8 routed per token, every layer MoE)",
    ),
    "gemma2-9b": CatalogEntry(
        model_type="gemma2",
        config=dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                    max_position_embeddings=8192, rms_norm_eps=1e-6, sliding_window=4096,
                    query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        default_seq_len=8192,
        source="google/gemma-2-9b config.json (sliding and full attention alternate: layer period 2)",
    ),
    "gemma2-27b": CatalogEntry(
        model_type="gemma2",
        config=dict(hidden_size=4608, intermediate_size=36864, num_hidden_layers=46,
                    num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=256000,
                    max_position_embeddings=8192, rms_norm_eps=1e-6, sliding_window=4096,
                    query_pre_attn_scalar=144, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        default_seq_len=8192,
        source="google/gemma-2-27b config.json (sliding and full attention alternate: layer period 2)",
    ),
    # Tiny models for CPU trials and tests. tiny-llama is the model in shared/NOTES-measured.md.
    "tiny-llama": CatalogEntry(
        model_type="llama",
        config=dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=4, vocab_size=8000,
                    max_position_embeddings=1024),
        default_seq_len=256,
        source="autotune test model (llama family, multi-head attention)",
    ),
    "tiny-qwen2": CatalogEntry(
        model_type="qwen2",
        config=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=8000,
                    max_position_embeddings=1024, tie_word_embeddings=False),
        default_seq_len=256,
        source="autotune test model (qwen2 family, grouped-query attention)",
    ),
    "tiny-mixtral": CatalogEntry(
        model_type="mixtral",
        config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=4000,
                    max_position_embeddings=1024, num_local_experts=2, num_experts_per_tok=1,
                    sliding_window=None),
        default_seq_len=128,
        source="autotune test model (mixtral family: 2 fused experts, fewer than the ranks of a 4-rank trial)",
    ),
    "micro-llama": CatalogEntry(
        model_type="llama",
        config=dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                    max_position_embeddings=512),
        default_seq_len=64,
        source="autotune test model (smallest; fastest CPU trials)",
    ),
}


@dataclass(frozen=True)
class ModelSpec:
    """A model by name and transformers config, serialisable for trial workers."""

    name: str
    model_type: str
    config_dict: dict[str, Any] = field(hash=False, compare=False)
    default_seq_len: int
    source: str
    trust_remote_code: bool = False
    text_tower_of: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    """--text-only: this model is the language model (text_config) of a multimodal one, and this
    says what of that model was left out (`_towers_left_out`); None for a text model."""
    attention: str | None = None
    """--attention: the attention implementation the user's stack runs (problem/catalog/attention.py); None: the
    model's default (default_attention)."""

    def hf_config(self, *, num_layers: int | None = None):
        """The transformers config; `num_layers` makes a shallower copy (for depth extrapolation)
        whose blocks are the real model's first `num_layers` blocks: every per-layer field is cut
        alike (see catalog/layers.py), and a copy that would lack a kind of layer the model has is
        refused rather than traced."""
        overrides = dict(self.config_dict)
        completed = self.completed_config
        # Per-layer fields as transformers completed them: explicit, so that a cut copy cannot
        # re-derive them differently (Qwen2 derives layer_types from max_window_layers).
        for key in layers.per_layer_keys(completed):
            overrides[key] = completed[key]
        if num_layers is not None and num_layers != self.num_layers:
            structures = self._block_structures or []
            if layers.missing_kinds(completed, num_layers) or set(structures) - set(structures[:num_layers]):
                raise ValueError(f"a {num_layers}-layer copy of {self.name} would lack some of its kinds of "
                                 f"layer (period {self.layer_period}): trace at least one whole period")
            overrides = layers.shallow_config_dict(overrides, num_layers)
        return self._config(overrides)

    def _config(self, overrides: dict[str, Any]):
        import copy

        from transformers import AutoConfig

        # A deep copy: transformers writes into nested fields (rope_theta into rope_scaling), which
        # would change config_dict, and with it every key made from it, after the first build.
        overrides = copy.deepcopy(dict(overrides))
        overrides.pop("model_type", None)
        overrides.pop("transformers_version", None)
        config = AutoConfig.for_model(self.model_type, **overrides)
        config._attn_implementation = attention.traced_name(self.attention_implementation)
        config.use_cache = False
        return config

    @property
    def attention_implementation(self) -> str:
        """transformers' attn_implementation of this problem: the one stated (--attention), else the
        model's default."""
        return self.attention or self.default_attention

    def with_attention(self, name: str | None) -> "ModelSpec":
        """This model with `name` stated as its attention; None or the model's default: the model as it is
        (its keys, and the traces cached under them, unchanged)."""
        return self if name is None or name == self.default_attention else replace(self, attention=name)

    @cached_property
    def default_attention(self) -> str:
        """SDPA where the model supports it: fused attention on CPUs and GPUs alike keeps no
        seq x seq score matrix, so what a CPU trace or CPU trial counts is what a GPU run keeps.
        Models without an SDPA path (Gemma 2's logit softcapping) are traced with eager
        attention, which keeps the scores: an upper bound for a flash-attention GPU run
        (--attention flash_attention_2 traces the flash kernel instead)."""
        from autotune.util import cache

        return cache.cached("attention-implementation", self.model_type, self._attention_implementation)

    def _attention_implementation(self) -> str:
        try:
            from transformers import AutoConfig
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
        except ImportError:  # a stack's own venv (torchtitan, LitGPT): their own models run SDPA
            return "sdpa"
        try:
            config_class = type(AutoConfig.for_model(self.model_type))
            model_class = MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
        except (KeyError, ValueError):
            return "sdpa"  # not a causal LM the auto classes know: validation refuses it elsewhere
        return "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"

    @cached_property
    def completed_config(self) -> dict[str, Any]:
        """The config as transformers completes it: defaults and derived per-layer fields explicit."""
        return canonical_config(self.model_type, self._config(dict(self.config_dict)).to_dict())

    @cached_property
    def layer_period(self) -> int:
        """Layers per repeating pattern of block structures (1 when every block is alike): from the
        config's per-layer fields and the blocks transformers builds."""
        return layers.layer_period(self.completed_config, self._block_structures)

    @cached_property
    def _block_structures(self) -> list[str] | None:
        """One fingerprint per decoder layer of the model transformers builds at full depth (meta
        device): its modules and parameter shapes. None where the blocks are not one per layer
        (`_count_on_meta` says why). Raises UnsupportedModelError if FSDP has no blocks to wrap."""
        return self._once_per_shape("block-structures", self._structures_on_meta)

    def _once_per_shape(self, kind: str, compute):
        """compute() once per model shape and library version on this machine (autotune.util.cache), then
        read back: a repeated plan need not import transformers for it."""
        from autotune.util import cache

        # Wrapped: cache.cached reads a stored None as a miss, and None is an answer here.
        return cache.cached(kind, dict(model_type=self.model_type, config=self.config_dict,
                                       remote=self.trust_remote_code, layers=self.num_layers),
                            lambda: dict(value=compute()))["value"]

    def _structures_on_meta(self) -> list[str] | None:
        import torch

        from autotune.problem.catalog.blocks import find_decoder_blocks

        with torch.device("meta"):
            model = causal_lm_from_config(self.hf_config(), trust_remote_code=self.trust_remote_code)
        blocks = find_decoder_blocks(model)  # the full model's, as FSDP wraps them: raises if it has none
        if len(blocks.layers) != self.num_layers:
            return None
        return [block_structure(block) for block in blocks.layers]

    @property
    def num_layers(self) -> int:
        return int(self.config_dict["num_hidden_layers"])

    @property
    def max_positions(self) -> int | None:
        value = self.config_dict.get("max_position_embeddings")
        return int(value) if value else None

    @cached_property
    def _meta_summary(self) -> dict[str, Any]:
        """What the tuner needs to know about the model, from a copy of one period of layers built
        on the meta device (`_count_on_meta`): blocks repeat with the period, so the counts are
        exact at any depth and cost the same for a 70B model as for a tiny one. Raises
        UnsupportedModelError if FSDP has no blocks to wrap."""
        from autotune.util import cache

        # Counted once per model shape and library version on this machine, then read back:
        # a repeated plan need not import transformers for these numbers.
        key = cache.key_of("model-summary", dict(model_type=self.model_type, config=self.config_dict,
                                                 remote=self.trust_remote_code, layers=self.num_layers))
        cached = cache.load("model-summary", key)
        if isinstance(cached, dict) and "param_shapes" in cached:  # else written before the field
            return cached
        summary = self._count_on_meta()
        cache.store("model-summary", key, summary)
        return summary

    def _count_on_meta(self) -> dict[str, Any]:
        import torch

        from autotune.util.errors import UnsupportedModelError
        from autotune.problem.catalog.blocks import find_decoder_blocks, fused_experts

        period = self.layer_period
        config = self.hf_config(num_layers=period)
        with torch.device("meta"):
            model = causal_lm_from_config(config, trust_remote_code=self.trust_remote_code)
        blocks = find_decoder_blocks(model)
        if len(blocks.layers) != period:
            raise UnsupportedModelError(
                f"{type(model).__name__}'s repeated blocks ({len(blocks.layers)} x {blocks.class_name} in a "
                f"{period}-layer copy) do not follow num_hidden_layers: autotune cannot scale it in depth")
        per_block = [sum(p.numel() for p in block.parameters()) for block in blocks.layers]
        total = sum(p.numel() for p in model.parameters())
        all_blocks = sum(per_block[i % period] for i in range(self.num_layers))
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        embedding = _input_embedding(model)
        hidden = _positive_int(_read(text, "hidden_size")) or (embedding[1] if embedding else 0)
        heads = _positive_int(_read(text, "num_attention_heads")) or 1
        head_dim = _positive_int(_read(text, "head_dim")) or max(hidden // heads, 1)
        kv_heads = _positive_int(_read(text, "num_key_value_heads")) or heads
        vocab = _positive_int(_read(text, "vocab_size")) or (embedding[0] if embedding else 0)
        return dict(root_parameters=total - sum(per_block), all_block_parameters=all_blocks,
                    block_parameters=max(per_block), block_class=blocks.class_name,
                    hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                    head_dim=head_dim, vocab_size=vocab,
                    mlp_width=max(mlp_width(block, hidden) for block in blocks.layers),
                    num_experts=max((m.num_experts for block in blocks.layers for m in fused_experts(block)), default=0),
                    experts_per_token=_positive_int(_read(text, "num_experts_per_tok")) or 0,
                    moe_layers=sum(bool(fused_experts(blocks.layers[i % period])) for i in range(self.num_layers)),
                    block_expert_parameters=max((sum(p.numel() for m in fused_experts(block) for p in m.parameters())
                                                 for block in blocks.layers), default=0),
                    block_param_shapes=sorted({tuple(p.shape) for block in blocks.layers
                                               for p in block.parameters() if p.dim() >= 2}),
                    param_shapes=_shape_counts(model, blocks.layers, period=period, depth=self.num_layers))

    @property
    def mixed_precision_clash(self) -> str | None:
        """Why the model cannot train under FSDP2's mixed precision, or None. FSDP2 casts the
        parameters to the compute dtype and leaves buffers as built; a model that multiplies its
        activations by a float32 buffer (openai-gpt's causal-mask `bias`, MiniMax's lightning-attention
        decay factors) then matmuls the float32 product with bf16 and fails, in a real run as in the
        simulator (`_fake_forward`)."""
        failure = self._fake_forward
        return failure["why"] if failure and failure["kind"] == "dtype" else None

    @property
    def untraceable(self) -> str | None:
        """Why fake tensors (the simulator) cannot run the model's forward, or None: it reads a
        tensor's value (.item(), a data-dependent shape: jetmoe's and modernbert-decoder's routing).
        Real trials run it (`_fake_forward`)."""
        failure = self._fake_forward
        return failure["why"] if failure and failure["kind"] == "data-dependent" else None

    @cached_property
    def _fake_forward(self) -> dict[str, str] | None:
        """What stops one forward of one period of layers on fake tensors, with the parameters in bf16
        and the buffers as built (what FSDP2's mixed precision computes with), or None: a dtype clash
        or a data-dependent op, with the module it stopped in."""
        return self._once_per_shape("fake-forward", self._run_fake_forward)

    def _run_fake_forward(self) -> dict[str, str] | None:
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        running: list[torch.nn.Module] = []  # the modules whose forward has begun and not returned

        def returned(_module, _args, _output) -> None:  # None: the output stays the module's
            running.pop()

        with _quiet_transformers(), _quiet_fake_tensors(), FakeTensorMode(allow_non_fake_inputs=True):
            try:
                # float32 as training.build_model builds it under mixed precision, whatever dtype the
                # config.json names (a released checkpoint's says bfloat16)
                model = causal_lm_from_config(self.hf_config(num_layers=self.layer_period), dtype=torch.float32,
                                              trust_remote_code=self.trust_remote_code)
                for parameter in model.parameters():
                    parameter.data = parameter.data.to(torch.bfloat16)
                for module in model.modules():
                    module.register_forward_pre_hook(lambda module, _args: running.append(module))
                    module.register_forward_hook(returned)
                with torch.no_grad():
                    model(input_ids=torch.zeros((1, 8), dtype=torch.long))
            except Exception as exc:  # noqa: BLE001 - any other failure is left to the trial to report
                return _fake_forward_failure(exc, running[-1] if running else None)
        return None

    @property
    def block_param_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The distinct shapes of the decoder blocks' multi-dimensional parameters (a fused expert
        weight's first dimension is the number of experts): where FSDP2 can shard them."""
        return tuple(tuple(shape) for shape in self._meta_summary["block_param_shapes"])

    @property
    def param_shapes(self) -> tuple[tuple[tuple[int, ...], int], ...]:
        """Every parameter's shape at full depth, as (shape, how many): what FSDP2 shards one tensor
        at a time (a tied embedding once)."""
        return tuple((tuple(shape), int(count)) for shape, count in self._meta_summary["param_shapes"])

    @property
    def num_experts(self) -> int:
        """Experts per MoE block (the most of any block), 0 for a dense model: what expert
        parallelism splits (blocks.fused_experts)."""
        return int(self._meta_summary["num_experts"])

    @property
    def experts_per_token(self) -> int:
        """Experts each token is routed to (the config's num_experts_per_tok), 0 for a dense model."""
        return int(self._meta_summary["experts_per_token"])

    @property
    def moe_layers(self) -> int:
        """Decoder blocks with fused experts (at full depth)."""
        return int(self._meta_summary["moe_layers"])

    @property
    def block_expert_parameters(self) -> int:
        """Parameters of the fused experts of the largest MoE block (what expert parallelism splits)."""
        return int(self._meta_summary["block_expert_parameters"])

    @property
    def idle_expert_parameters(self) -> int:
        """Expert parameters a token does not compute with: in each MoE block the experts it is not
        routed to ((num_experts - num_experts_per_tok) of num_experts); 0 for a dense model."""
        experts, routed = self.num_experts, self.experts_per_token
        if not experts or not routed:
            return 0
        return self.moe_layers * self.block_expert_parameters * (experts - routed) // experts

    @property
    def active_parameters(self) -> int:
        """Parameters a token computes with (MoE papers' "active" parameters): all of them in a
        dense model; the experts it is not routed to left out in a MoE model."""
        return self.num_parameters - self.idle_expert_parameters

    @property
    def root_parameters(self) -> int:
        """Parameters outside the decoder blocks: embeddings, final norm, LM head (once if tied)."""
        return int(self._meta_summary["root_parameters"])

    @property
    def block_parameters(self) -> int:
        """Parameters of the largest decoder block (all blocks are alike in most models; where
        dense and MoE layers alternate, the largest sets the all-gather buffers)."""
        return int(self._meta_summary["block_parameters"])

    @property
    def num_parameters(self) -> int:
        """Exact parameter count."""
        return self.root_parameters + int(self._meta_summary["all_block_parameters"])

    # The model's shape, read through transformers' own accessors (the config class's
    # attribute_map, get_text_config()) or, where no config field holds it, measured from the
    # meta-built blocks. Every other part of autotune reads these, never a family's field names.
    @property
    def hidden_size(self) -> int:
        return int(self._meta_summary["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self._meta_summary["vocab_size"])

    @property
    def num_attention_heads(self) -> int:
        return int(self._meta_summary["num_attention_heads"])

    @property
    def num_key_value_heads(self) -> int:
        return int(self._meta_summary["num_key_value_heads"])

    @property
    def head_dim(self) -> int:
        return int(self._meta_summary["head_dim"])

    @property
    def mlp_width(self) -> int:
        """The MLP's inner width (for MoE, one expert's), measured from the block (see `mlp_width`)."""
        return int(self._meta_summary["mlp_width"])

    @cached_property
    def tp_plan(self) -> dict[str, str] | None:
        """The base model's tensor-parallel plan as transformers' config class states it
        (`base_model_tp_plan`: module pattern -> style), or None where it has none. Read once per config
        class on this machine: a repeated tune need not import transformers for it."""
        from autotune.util import cache

        text = self.config_dict.get("text_config")
        inputs = dict(model_type=self.model_type, remote=self.trust_remote_code,
                      text=text.get("model_type") if isinstance(text, dict) else None)
        return cache.cached("tp-plan", inputs, self._tp_plan) or None

    def _tp_plan(self) -> dict[str, str]:
        config = self._config(dict(self.config_dict))
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return dict(getattr(text, "base_model_tp_plan", None) or {})

    @property
    def block_class(self) -> str:
        """The decoder block class FSDP wraps one by one, e.g. LlamaDecoderLayer."""
        return str(self._meta_summary["block_class"])

    def to_dict(self) -> dict[str, Any]:
        return dict(name=self.name, model_type=self.model_type, config=self.config_dict,
                    default_seq_len=self.default_seq_len, source=self.source,
                    trust_remote_code=self.trust_remote_code, text_tower_of=self.text_tower_of,
                    # Only where stated: a default model keeps the keys (and cached traces) it had.
                    **({"attention": self.attention} if self.attention is not None else {}))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelSpec":
        return cls(name=data["name"], model_type=data["model_type"], config_dict=data["config"],
                   default_seq_len=data["default_seq_len"], source=data["source"],
                   trust_remote_code=data.get("trust_remote_code", False),
                   text_tower_of=data.get("text_tower_of"), attention=data.get("attention"))


def resolve_model(name_or_path: str, *, trust_remote_code: bool = False, text_only: bool = False) -> ModelSpec:
    """A catalog name, or a local config.json / model folder. Never downloads. `text_only`
    (--text-only): a multimodal config's language model (its text_config), alone."""
    if name_or_path in MODELS and text_only:
        raise UsageError(_not_multimodal(repr(name_or_path)))
    if name_or_path in MODELS:
        entry = MODELS[name_or_path]
        return ModelSpec(name=name_or_path, model_type=entry.model_type,
                         config_dict=dict(entry.config), default_seq_len=entry.default_seq_len,
                         source=entry.source)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    looks_like_path = "/" in name_or_path or name_or_path.endswith(".json") or path.exists()
    if not looks_like_path:
        close = difflib.get_close_matches(name_or_path, list(MODELS), n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise UsageError(
            f"unknown model {name_or_path!r}: {hint}use a catalog name "
            f"({', '.join(MODELS)}) or a path to a Hugging Face config.json or model folder"
        )
    try:
        data = _decode_special_floats(json.loads(path.read_text()))
    except FileNotFoundError:
        raise UsageError(f"model config {str(path)!r} not found: give a config.json or a folder "
                         "holding one") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read model config {str(path)!r}: {exc}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise UsageError(f"{str(path)!r} is not a Hugging Face config.json: it has no 'model_type'")
    if data.get("auto_map") and not trust_remote_code:
        raise UsageError(f"{str(path)!r} needs custom code (auto_map): pass --trust-remote-code "
                         "if you trust it")
    model_type = data["model_type"]
    where = str(path)
    text_tower_of = None
    if _is_multimodal_with_text(model_type, data):
        if not text_only:
            raise UsageError(_multimodal_refusal(model_type, data, where=where))
        model_type, data, text_tower_of = _text_tower(model_type, data, where=where)
    elif text_only:
        raise UsageError(_not_multimodal(f"{where!r} (model_type {model_type!r})"))
    if not isinstance(model_type, str) or config_class_of(model_type) is None:
        if not trust_remote_code:
            raise UsageError(f"model_type {model_type!r} in {where!r} is unknown to the installed "
                             "transformers: upgrade transformers")
    else:
        data = canonical_config(model_type, data)  # GPT-2's n_layer is num_hidden_layers, ...
    if not trust_remote_code:
        if text_tower_of is None:  # a text tower was checked buildable as a causal LM (_text_tower)
            _check_causal_lm(model_type, data, where=where)
        probe = ModelSpec(name="probe", model_type=model_type, config_dict=data, default_seq_len=1,
                          source=where)
        with _quiet_transformers():  # autotune's own checks below name what must be fixed, in one line
            completed = _completed_config(probe, where=where)
        # The shape fields transformers defaults, written out: the plan, its cache key and the
        # exported config then say what was tuned.
        data = dict(data)
        for key in CANONICAL_FIELDS:
            if data.get(key) is None and completed.get(key) is not None:
                data[key] = completed[key]
    if "num_hidden_layers" not in data:
        if isinstance(getattr(config_class_of(model_type), "num_hidden_layers", None), property):
            raise UsageError(f"{where!r}: {model_type}'s depth (num_hidden_layers) is derived by transformers from "
                             "other fields: autotune cannot make the shallower copies it traces")
        raise UsageError(f"{where!r} has no num_hidden_layers: not a decoder-only config autotune can tune")
    layers_value = data["num_hidden_layers"]
    if not isinstance(layers_value, int) or isinstance(layers_value, bool) or layers_value < 1:
        raise UsageError(f"{where!r}: num_hidden_layers must be a positive integer, got {layers_value!r}")
    max_pos = data.get("max_position_embeddings") or 4096
    if not isinstance(max_pos, int) or isinstance(max_pos, bool) or max_pos < 1:
        raise UsageError(f"{where!r}: max_position_embeddings must be a positive integer, got {max_pos!r}")
    name = data.get("_name_or_path") or path.parent.name or path.stem
    spec = ModelSpec(name=f"{name}-text" if text_tower_of else name,
                     model_type=model_type, config_dict=data,
                     default_seq_len=min(4096, int(max_pos)), source=where,
                     trust_remote_code=trust_remote_code, text_tower_of=text_tower_of)
    if not trust_remote_code:
        with _quiet_transformers():
            _check_buildable(spec, where=where)
    if text_tower_of:
        language = text_tower_of["parameters"] - text_tower_of["left_out_parameters"]
        if spec.num_parameters != language:
            raise UsageError(f"{where!r}: {text_tower_of['model_type']}'s language model built alone from its text_config "
                             f"has {spec.num_parameters:,} parameters, inside the whole model {language:,}: autotune "
                             "cannot tune it alone as it trains there (--text-only)")
    return spec


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' warnings off while a config is checked: its validation logs what it only warns
    about (a token id outside the vocabulary) to stderr, and a usage error is one line."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        yield
        return
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)


def _not_multimodal(what: str) -> str:
    """--text-only given a model that has no text_config to tune alone."""
    return (f"--text-only is for a multimodal config with a text_config (Llava, Gemma 3, ...); {what} has no "
            "language model of its own to tune alone: drop --text-only")


def _fake_forward_failure(exc: BaseException, module) -> dict[str, str] | None:
    """ModelSpec._fake_forward's record of `exc`, raised in `module`'s forward (None: in the build)."""
    import traceback

    import torch
    from torch._subclasses.fake_tensor import DataDependentOutputException

    if module is not None:
        where = f"{type(module).__module__.rsplit('.', 1)[-1]}.{type(module).__name__}"
    else:  # the model's own code that raised, e.g. its weight init
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/transformers/models/" in f.filename]
        where = f"{Path(frames[-1].filename).stem}.{frames[-1].name}" if frames else "the model's build"
    if isinstance(exc, DataDependentOutputException):
        return dict(kind="data-dependent", why=f"{where} reads a tensor's value ({exc}: .item() or a data-dependent "
                                               "shape), which fake tensors cannot give")
    buffers = [name for name, b in module.named_buffers() if b.dtype == torch.float32] if module is not None else []
    if not isinstance(exc, RuntimeError) or "expected scalar type" not in str(exc) and "dtype" not in str(exc) \
            or not buffers:
        return None  # another failure: the trial reports its own
    detail = " ".join(str(exc).split())[:120]
    return dict(kind="dtype", why=f"{where} multiplies bf16 activations by its float32 buffers ({', '.join(buffers)}), "
                                  f"which FSDP2's mixed precision leaves in float32 (it casts parameters only), and "
                                  f"fails ({detail})")


@contextlib.contextmanager
def _quiet_fake_tensors():
    """Fake tensors log the traceback of an op that fails on them; the probe reports it in one line."""
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    previous = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(previous)


def _check_causal_lm(model_type: str, data: dict[str, Any], *, where: str) -> None:
    """Refuse, with the reason, a model that is not a decoder-only causal LM: an encoder such as
    BERT has a causal-LM head in transformers, but FSDP tuning of it is not what autotune predicts;
    an encoder-decoder; a multimodal config whose language model is a sub-config."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    kind = model_type
    if data.get("is_encoder_decoder") or getattr(config_class_of(kind), "is_encoder_decoder", False):
        raise UsageError(f"{where!r}: model_type {kind!r} is an encoder-decoder model, not a decoder-only causal "
                         "language model; autotune tunes "
                         "decoder-only LLMs (llama, mistral, qwen2/3, gemma2/3, gpt2, opt, bloom, falcon, ...)")
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES or kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(f"{where!r}: model_type {kind!r} is not a decoder-only causal language model; "
                         "autotune tunes decoder-only LLMs (llama, mistral, qwen2/3, gemma2/3, gpt2, opt, "
                         "bloom, falcon, ...)")
    sub_configs = getattr(config_class_of(kind), "sub_configs", None) or {}
    towers = sorted(key for key in sub_configs if key in _NON_TEXT_TOWERS)
    if towers and "text_config" not in sub_configs:
        raise UsageError(f"{where!r}: model_type {kind!r} is a multimodal model ({', '.join(towers)} besides the "
                         "language model): autotune tunes decoder-only language models on text")


def _is_multimodal_with_text(kind: Any, data: dict[str, Any]) -> bool:
    """A multimodal config whose language model is a sub-config (Llava, Qwen2-VL, Gemma 3): its
    shape is in text_config, not at the top level."""
    if not isinstance(kind, str) or config_class_of(kind) is None:
        return False
    sub_configs = getattr(config_class_of(kind), "sub_configs", None) or {}
    return "text_config" in sub_configs and "num_hidden_layers" not in data


def _multimodal_refusal(kind: str, data: dict[str, Any], *, where: str) -> str:
    text = data.get("text_config") or {}
    text_type = text.get("model_type") if isinstance(text, dict) else None
    text_type = text_type or getattr(config_class_of(kind).sub_configs["text_config"], "model_type", None)
    named = f" (model_type {text_type!r})" if text_type else ""
    if not _has_causal_lm(text_type):
        return (f"{where!r}: model_type {kind!r} is a multimodal model whose language model is its text_config{named}, "
                "which has no causal-LM class in the installed transformers: autotune cannot tune it, whole or "
                "alone (--text-only)")
    return (f"{where!r}: model_type {kind!r} is a multimodal model whose language model is its text_config{named}; "
            "pass --text-only to tune the language model alone (the run says what of the rest it leaves out)")


def _has_causal_lm(model_type: str | None) -> bool:
    """transformers builds a causal LM of this model_type: its own class, or its base model under
    an output head (catalog/text_tower.py: a text tower such as Qwen2-VL's, built for --text-only)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or _is_text_tower(model_type, MODEL_MAPPING_NAMES)


def _is_text_tower(model_type: str | None, base_models) -> bool:
    return bool(model_type) and model_type.endswith("_text") and model_type in base_models


def _causal_lm_class(model_type: str) -> str:
    """The class causal_lm_from_config builds for model_type, by name."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or "autotune.problem.catalog.text_tower.TextTowerForCausalLM"


def causal_lm_from_config(config, **kwargs):
    """AutoModelForCausalLM.from_config, or, for a text tower transformers has no causal-LM class for
    (Qwen2-VL's qwen2_vl_text), its base model under an output head (catalog/text_tower.py)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    kind = getattr(config, "model_type", None)
    if kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or not _is_text_tower(kind, MODEL_MAPPING_NAMES):
        return AutoModelForCausalLM.from_config(config, **kwargs)
    from autotune.problem.catalog.text_tower import TextTowerForCausalLM

    kwargs.pop("trust_remote_code", None)
    return TextTowerForCausalLM._from_config(config, **kwargs)


def _text_tower(kind: str, data: dict[str, Any], *, where: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """--text-only: (model_type, config dict) of a multimodal config's language model, as
    transformers' own get_text_config() gives it, and what of the whole model is left out."""
    full = _full_multimodal_config(kind, data, where=where)
    text = full.get_text_config()
    text_type = text.model_type
    if not _has_causal_lm(text_type):
        raise UsageError(f"{where!r}: {kind}'s language model (text_config, model_type {text_type!r}) has no "
                         "causal-LM class in the installed transformers, so autotune cannot build it alone: "
                         "--text-only is not available for it")
    text_dict = {k: v for k, v in text.to_dict().items() if k not in ("transformers_version", "architectures")}
    from autotune.util import cache

    try:
        left_out = cache.cached("towers-left-out", dict(model_type=kind, config=data),
                                lambda: _towers_left_out(full))
    except (ImportError, TypeError, ValueError, KeyError, AttributeError, RuntimeError) as exc:
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:240]
        raise UsageError(f"{where!r}: transformers cannot build the whole {kind} model from this config ({detail}), "
                         "on which --text-only counts what it leaves out; fix the field it names") from None
    # The head tied to the embedding as the whole model ties it: its top-level tie_word_embeddings
    # rules there (Mistral 3 ties, its text_config's says not), and that is the model that trains.
    text_dict["tie_word_embeddings"] = left_out.pop("tied_head")
    return text_type, text_dict, dict(left_out, model_type=kind, language_model_class=_causal_lm_class(text_type))


def _full_multimodal_config(kind: str, data: dict[str, Any], *, where: str):
    from transformers import AutoConfig

    try:
        from huggingface_hub.errors import StrictDataclassError  # transformers 5 validates configs with it
    except ImportError:
        StrictDataclassError = ValueError
    fields = {k: v for k, v in data.items() if k not in ("model_type", "transformers_version")}
    try:
        with _quiet_transformers():
            return AutoConfig.for_model(kind, **fields)
    except (ValueError, TypeError, KeyError, AttributeError, StrictDataclassError) as exc:
        detail = " ".join(str(exc).split())
        raise UsageError(f"{where!r} is not a valid {kind} config: {detail[:300]}; fix that field") from None


def _towers_left_out(full_config) -> dict[str, Any]:
    """What --text-only leaves out of a multimodal model: the whole model built on the meta device
    (transformers' image-text-to-text class for it), less its language model (`get_decoder()`)
    and output head (`get_output_embeddings()`), parameters shared between them counted once."""
    import torch
    from transformers.models.auto import modeling_auto as auto

    for mapping in (auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, auto.MODEL_FOR_CAUSAL_LM_MAPPING, auto.MODEL_MAPPING):
        model_class = mapping.get(type(full_config), None)
        if model_class is not None:
            break
    with _quiet_transformers(), torch.device("meta"):
        model = model_class._from_config(full_config)
    head = model.get_output_embeddings()
    language = {id(p) for part in (model.get_decoder(), head) if part is not None for p in part.parameters()}
    tied_head = head is not None and head.weight is model.get_input_embeddings().weight
    left_out_modules: dict[str, int] = {}
    total = 0
    for name, parameter in model.named_parameters():  # each shared parameter once
        total += parameter.numel()
        if id(parameter) in language:
            continue
        parts = name.split(".")
        module = ".".join(parts[:2] if parts[0] == model.base_model_prefix and len(parts) > 2 else parts[:1])
        left_out_modules[module] = left_out_modules.get(module, 0) + parameter.numel()
    return dict(model_class=type(model).__name__, parameters=total, tied_head=tied_head,
                left_out_parameters=sum(left_out_modules.values()), left_out_modules=left_out_modules)


_NON_TEXT_TOWERS = frozenset({"vision_config", "vq_config", "vision_tower_config", "image_config"})
"""Sub-configs of image towers: a causal LM that carries one (GIT) takes images with its text."""


def _completed_config(spec: ModelSpec, *, where: str) -> dict[str, Any]:
    """The config as transformers completes it; transformers' own validation of every field,
    its rejection a usage error that names the field."""
    try:
        from huggingface_hub.errors import StrictDataclassError  # transformers 5 validates configs with it
    except ImportError:
        StrictDataclassError = ValueError
    try:
        return spec.completed_config
    except (ValueError, TypeError, KeyError, AttributeError, StrictDataclassError) as exc:
        detail = " ".join(str(exc).split())
        raise UsageError(f"{where!r} is not a valid {spec.model_type} config: {detail[:300]}; fix that field") from None


def _check_buildable(spec: ModelSpec, *, where: str) -> None:
    """Refuse, as a usage error naming the field, a config that transformers accepts but whose model
    cannot be built (a padding id outside the vocabulary, heads that do not divide the width),
    and a model with no repeated blocks for FSDP to wrap. Builds one period of layers on the meta
    device, as planning does anyway (and cached alike)."""
    from autotune.util.errors import UnsupportedModelError

    completed = spec.completed_config
    vocab = completed.get("vocab_size")
    pad = completed.get("pad_token_id")
    if _positive_int(vocab) and isinstance(pad, int) and not isinstance(pad, bool) and not 0 <= pad < vocab:
        raise UsageError(f"{where!r}: pad_token_id {pad} is outside the vocabulary (vocab_size {vocab}): set "
                         f"pad_token_id to an id below {vocab}, or to null")
    try:
        spec._meta_summary
    except UnsupportedModelError as exc:
        raise UsageError(f"{where!r}: {exc}") from None
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises while building the model
        hidden, heads = completed.get("hidden_size"), completed.get("num_attention_heads")
        if _positive_int(hidden) and _positive_int(heads) and hidden % heads:
            raise UsageError(f"{where!r}: transformers cannot build a {spec.model_type} model whose "
                             f"{_spelled(spec.model_type, 'hidden_size')} ({hidden}) is not a multiple of its "
                             f"{_spelled(spec.model_type, 'num_attention_heads')} ({heads}): make it one") from None
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise UsageError(f"{where!r}: transformers cannot build a {spec.model_type} model from this config "
                         f"({type(exc).__name__}: {detail[:300]}); fix the field it names") from None


def model_flops_per_token(model: ModelSpec, seq_len: int, *, num_parameters: int | None = None) -> float:
    """Training FLOPs per token without recompute: 6N plus attention (PaLM paper, appendix B:
    6N + 12 * L * H * Q * T with H*Q the attention width and T the sequence length), N the active
    parameters (a MoE token computes with the experts it is routed to only: MFU counted against all
    of mixtral-8x7b's 46.7 B parameters read 114%). `num_parameters` (all of them) saves the meta
    build of the model when the caller already knows it."""
    num_layers = model.num_layers
    hidden = model.hidden_size
    n = (model.num_parameters if num_parameters is None else num_parameters) - model.idle_expert_parameters
    return 6 * n + 12 * num_layers * hidden * seq_len


def _spelled(model_type: str, canonical: str) -> str:
    """A canonical field as the family's config.json spells it: `n_embd (hidden_size)` for GPT-2."""
    stored = (getattr(config_class_of(model_type), "attribute_map", None) or {}).get(canonical)
    return f"{stored} ({canonical})" if stored and stored != canonical else canonical


def _read(config, name: str) -> Any:
    """config.<name> through transformers' accessors (attribute_map), or None where it has none
    (or, in a per-layer config, no single value)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001
        return None


def _positive_int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _input_embedding(model) -> tuple[int, int] | None:
    """(rows, width) of the model's input embedding, where it has one."""
    try:
        weight = model.get_input_embeddings().weight
    except (AttributeError, NotImplementedError, TypeError):
        return None
    return (int(weight.shape[0]), int(weight.shape[1])) if weight.dim() == 2 else None


def _shape_counts(model, layers, *, period: int, depth: int) -> list[list]:
    """[shape, count] of every parameter of a `depth`-layer copy of `model`, counted on its
    `period`-layer copy: the root's once, each block's as often as the block repeats."""
    counts: dict[tuple[int, ...], int] = {}
    in_blocks = {id(p) for block in layers for p in block.parameters()}
    for p in model.parameters():
        if id(p) not in in_blocks:
            counts[tuple(p.shape)] = counts.get(tuple(p.shape), 0) + 1
    for i in range(depth):
        for p in layers[i % period].parameters():
            counts[tuple(p.shape)] = counts.get(tuple(p.shape), 0) + 1
    return [[list(shape), count] for shape, count in sorted(counts.items())]


def block_structure(block) -> str:
    """A fingerprint of a block's structure: its module classes and parameter shapes by name."""
    parts = [f"{name}:{type(module).__name__}" for name, module in block.named_modules()]
    parts += [f"{name}:{tuple(param.shape)}" for name, param in block.named_parameters()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


_ATTENTION_PATH = re.compile(r"attn|attention", re.IGNORECASE)


def mlp_width(block, hidden: int) -> int:
    """The inner width of a decoder block's MLP, measured from its modules, whatever the family
    calls it (`intermediate_size`, `ffn_dim`, `n_inner`, 4 x hidden by default, ...).

    Outside the attention modules: where experts keep their weights as 3-d parameters (a fused
    gate-and-up and a down projection per expert, [experts, in, out] or [experts, out, in]), one expert's width is the smallest dimension
    that is not the hidden size (a fused gate-and-up is twice as wide as the down projection's
    input); otherwise it is the widest input of a projection back to the hidden size (nn.Linear,
    or transformers' Conv1D as GPT-2 has), the MLP's down projection. A block with neither has no
    wider inner width than the hidden size."""
    from torch import nn

    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        Conv1D = ()
    downs: list[int] = []
    experts: list[int] = []
    ups: list[int] = []
    for name, module in block.named_modules():
        if _ATTENTION_PATH.search(name):
            continue
        if isinstance(module, nn.Linear):
            fan_in, fan_out = module.in_features, module.out_features
        elif Conv1D and isinstance(module, Conv1D):
            fan_in, fan_out = int(module.weight.shape[0]), int(module.weight.shape[1])
        else:
            for param in module.parameters(recurse=False):
                if param.dim() == 3 and param.shape[0] > 1 and min(param.shape[1:]) > 1 and hidden in param.shape[1:]:
                    others = [int(d) for d in param.shape[1:] if d != hidden]
                    experts.append(min(others) if others else hidden)
            continue
        if fan_out == hidden:
            downs.append(fan_in)
        elif fan_in == hidden:
            ups.append(fan_out)
    if experts:
        return min(experts)
    if downs:
        return max(downs)
    return max(ups, default=hidden)


def _decode_special_floats(data: Any) -> Any:
    """Floats as transformers writes what JSON cannot hold (`{"__float__": "Infinity"}`), read back
    as transformers reads them."""
    try:
        from transformers import PretrainedConfig

        return PretrainedConfig._decode_special_floats(data)
    except (ImportError, AttributeError):  # pragma: no cover - older transformers write plain JSON
        return data
