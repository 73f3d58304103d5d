"""The model catalog: transformers configs with the published shapes, never downloaded.

Each entry is data: the transformers `model_type`, the config fields that define its shape,
the default training sequence length, and where the shapes come from. The `tiny-*` entries
are small enough to train for real on CPUs in tests.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from autotune.catalog import layers
from autotune.errors import UsageError


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
            if layers.missing_kinds(completed, num_layers):
                raise ValueError(f"a {num_layers}-layer copy of {self.name} would lack some of its kinds of "
                                 f"layer (period {self.layer_period}): trace at least one whole period")
            overrides = layers.shallow_config_dict(overrides, num_layers)
        return self._config(overrides)

    def _config(self, overrides: dict[str, Any]):
        from transformers import AutoConfig

        overrides = dict(overrides)
        overrides.pop("model_type", None)
        overrides.pop("transformers_version", None)
        config = AutoConfig.for_model(self.model_type, **overrides)
        config._attn_implementation = self.attention_implementation
        config.use_cache = False
        return config

    @cached_property
    def attention_implementation(self) -> str:
        """SDPA where the model supports it: fused attention on CPUs and GPUs alike keeps no
        seq x seq score matrix, so what a CPU trace or CPU trial counts is what a GPU run keeps.
        Models without an SDPA path (Gemma 2's logit softcapping) are traced with eager
        attention, which keeps the scores: an upper bound for a flash-attention GPU run."""
        from autotune import cache

        return cache.cached("attention-implementation", self.model_type, self._attention_implementation)

    def _attention_implementation(self) -> str:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        try:
            config_class = type(AutoConfig.for_model(self.model_type))
            model_class = MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
        except (KeyError, ValueError):
            return "sdpa"  # not a causal LM the auto classes know: validation refuses it elsewhere
        return "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"

    @cached_property
    def completed_config(self) -> dict[str, Any]:
        """The config as transformers completes it: defaults and derived per-layer fields explicit."""
        return self._config(dict(self.config_dict)).to_dict()

    @cached_property
    def layer_period(self) -> int:
        """Layers per repeating pattern of block structures (1 when every block is alike)."""
        return layers.layer_period(self.completed_config)

    @property
    def num_layers(self) -> int:
        return int(self.config_dict["num_hidden_layers"])

    @property
    def max_positions(self) -> int | None:
        value = self.config_dict.get("max_position_embeddings")
        return int(value) if value else None

    @cached_property
    def _meta_summary(self) -> tuple[int, int, int, str]:
        """(parameters outside the blocks, parameters of all blocks, of the largest block, block
        class) from a copy of one period of layers built on the meta device: blocks repeat with
        the period, so the counts are exact at any depth and cost the same for a 70B model as for
        a tiny one. Raises UnsupportedModelError if FSDP has no blocks to wrap."""
        from autotune import cache

        # Counted once per model shape and library version on this machine, then read back:
        # a repeated plan need not import transformers for these four numbers.
        key = cache.key_of("model-summary", dict(model_type=self.model_type, config=self.config_dict,
                                                 remote=self.trust_remote_code, layers=self.num_layers))
        cached = cache.load("model-summary", key)
        if cached is not None:
            return tuple(cached)  # type: ignore[return-value]
        summary = self._count_on_meta()
        cache.store("model-summary", key, list(summary))
        return summary

    def _count_on_meta(self) -> tuple[int, int, int, str]:
        import torch
        from transformers import AutoModelForCausalLM

        from autotune.parallel import find_decoder_blocks

        period = self.layer_period
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                self.hf_config(num_layers=period), trust_remote_code=self.trust_remote_code
            )
        blocks = find_decoder_blocks(model)
        per_block = [sum(p.numel() for p in block.parameters()) for block in blocks.layers]
        total = sum(p.numel() for p in model.parameters())
        all_blocks = sum(per_block[i % period] for i in range(self.num_layers))
        return total - sum(per_block), all_blocks, max(per_block), blocks.class_name

    @property
    def root_parameters(self) -> int:
        """Parameters outside the decoder blocks: embeddings, final norm, LM head (once if tied)."""
        return self._meta_summary[0]

    @property
    def block_parameters(self) -> int:
        """Parameters of the largest decoder block (all blocks are alike in most models; where
        dense and MoE layers alternate, the largest sets the all-gather buffers)."""
        return self._meta_summary[2]

    @property
    def num_parameters(self) -> int:
        """Exact parameter count."""
        return self.root_parameters + self._meta_summary[1]

    @property
    def block_class(self) -> str:
        """The decoder block class FSDP wraps one by one, e.g. LlamaDecoderLayer."""
        return self._meta_summary[3]

    def to_dict(self) -> dict[str, Any]:
        return dict(name=self.name, model_type=self.model_type, config=self.config_dict,
                    default_seq_len=self.default_seq_len, source=self.source,
                    trust_remote_code=self.trust_remote_code)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelSpec":
        return cls(name=data["name"], model_type=data["model_type"], config_dict=data["config"],
                   default_seq_len=data["default_seq_len"], source=data["source"],
                   trust_remote_code=data.get("trust_remote_code", False))


def resolve_model(name_or_path: str, *, trust_remote_code: bool = False) -> ModelSpec:
    """A catalog name, or a local config.json / model folder. Never downloads."""
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
        data = json.loads(path.read_text())
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
    try:
        from transformers import AutoConfig

        AutoConfig.for_model(model_type)
    except (ValueError, KeyError):
        if not trust_remote_code:
            raise UsageError(f"model_type {model_type!r} in {str(path)!r} is unknown to the "
                             "installed transformers: upgrade transformers") from None
    if "num_hidden_layers" not in data:
        raise UsageError(f"{str(path)!r} has no num_hidden_layers: not a decoder-only config "
                         "autotune can tune")
    layers_value = data["num_hidden_layers"]
    if not isinstance(layers_value, int) or isinstance(layers_value, bool) or layers_value < 1:
        raise UsageError(f"{str(path)!r}: num_hidden_layers must be a positive integer, got {layers_value!r}")
    max_pos = data.get("max_position_embeddings") or 4096
    if not isinstance(max_pos, int) or isinstance(max_pos, bool) or max_pos < 1:
        raise UsageError(f"{str(path)!r}: max_position_embeddings must be a positive integer, got {max_pos!r}")
    spec = ModelSpec(name=data.get("_name_or_path") or path.parent.name or path.stem,
                     model_type=model_type, config_dict=data,
                     default_seq_len=min(4096, int(max_pos)), source=str(path),
                     trust_remote_code=trust_remote_code)
    if not trust_remote_code:
        _check_decoder_only(spec, where=str(path))
    return spec


def _check_decoder_only(spec: ModelSpec, *, where: str) -> None:
    """Refuse, as a usage error naming the field, a config transformers rejects or a model that is
    not a decoder-only causal LM (an encoder such as BERT has a causal-LM head in transformers,
    but FSDP tuning of it is not what autotune predicts)."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    kind = spec.model_type
    if spec.config_dict.get("is_encoder_decoder") or kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES \
            or kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(f"{where!r}: model_type {kind!r} is not a decoder-only causal language model; "
                         "autotune tunes decoder-only LLMs (llama, mistral, qwen2/3, gemma2/3, phi3, ...)")
    try:
        from huggingface_hub.errors import StrictDataclassError  # transformers 5 validates configs with it
    except ImportError:
        StrictDataclassError = ValueError
    try:
        spec.completed_config  # transformers' own validation of every field
    except (ValueError, TypeError, StrictDataclassError) as exc:
        detail = " ".join(str(exc).split())
        raise UsageError(f"{where!r} is not a valid {kind} config: {detail[:300]}; fix that field") from None


def model_flops_per_token(model: ModelSpec, seq_len: int, *, num_parameters: int | None = None) -> float:
    """Training FLOPs per token without recompute: 6N plus attention (PaLM paper, appendix B:
    6N + 12 * L * H * Q * T with H*Q the attention width and T the sequence length).
    `num_parameters` saves the meta build of the model when the caller already knows N."""
    config = model.config_dict
    num_layers = config["num_hidden_layers"]
    hidden = config["hidden_size"]
    n = model.num_parameters if num_parameters is None else num_parameters
    return 6 * n + 12 * num_layers * hidden * seq_len
