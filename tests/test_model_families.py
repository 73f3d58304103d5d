"""Every current Hugging Face decoder family plans and its prediction matches a real run.

The configs are written by transformers itself (each family's own config class, `save_pretrained`),
as a user's `config.json` would be, and read back through `resolve_model` like `--model PATH`. Each
model is deep enough that the simulator traces two shallow copies and extrapolates in depth
(respecting the family's layer pattern: Gemma 2 alternates sliding and full attention, Gemma 3
repeats five sliding layers and one full, Qwen3-MoE mixes dense and MoE layers); the session's
shared torchrun launch of the real cpu backend (2 gloo ranks, tests/shared_runs.py) runs one of each
kind (REAL_FAMILIES) at full depth; benchmarks/bench_families.py runs every family for real.
"""

from __future__ import annotations

import pytest
import transformers

from autotune.backends.sim import SimBackend
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec
from tests.shared_runs import register

SEQ_LEN = 64
_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# family -> (config class name, fields beyond _TINY). Depths make every copy extrapolate.
FAMILIES = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=8)),
    "mistral": ("MistralConfig", dict(num_hidden_layers=6, sliding_window=32)),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=6)),
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=6, head_dim=16)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=8, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, decoder_sparse_step=2)),
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=6, num_local_experts=4, num_experts_per_tok=2)),
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=8, head_dim=16, sliding_window=32)),
    "gemma3_text": ("Gemma3TextConfig", dict(num_hidden_layers=20, head_dim=16, sliding_window=32)),
    "phi3": ("Phi3Config", dict(num_hidden_layers=6)),
    "gpt_neox": ("GPTNeoXConfig", dict(num_hidden_layers=6)),
    "olmo2": ("Olmo2Config", dict(num_hidden_layers=6)),
    "gpt_oss": ("GptOssConfig", dict(num_hidden_layers=8, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=32)),
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=14)),  # no RoPE every 4th layer
    # Families that spell their sizes their own way (issue 25): GPT-2's n_inner, OPT's ffn_dim,
    # Falcon's ffn_hidden_size; BLOOM and MPT derive the MLP width and have no position table.
    "gpt2": ("GPT2Config", dict(num_hidden_layers=6, n_inner=128)),
    "opt": ("OPTConfig", dict(num_hidden_layers=6, ffn_dim=128, word_embed_proj_dim=64)),
    "bloom": ("BloomConfig", dict(num_hidden_layers=6)),
    "falcon": ("FalconConfig", dict(num_hidden_layers=6, ffn_hidden_size=128)),
    "gptj": ("GPTJConfig", dict(num_hidden_layers=6, n_inner=128, rotary_dim=8)),
    "gpt_bigcode": ("GPTBigCodeConfig", dict(num_hidden_layers=6, n_inner=128)),
    "mpt": ("MptConfig", dict(num_hidden_layers=6)),
    # A state-space model (issue 25): no attention, a selective scan; its init copies whole tensors
    # into FSDP2's shards (A_log), which real trials once failed on.
    "mamba": ("MambaConfig", dict(num_hidden_layers=5)),
}
# Run for real in the suite: one family per way the prediction could go wrong (every:2 checkpointing;
# alternating sliding and full attention with soft-capping; dense and MoE layers mixed; experts with
# attention sinks; GPT-2's Conv1D and n_* names; OPT's ffn_dim and offset positions; BLOOM's ALiBi
# with no position table; Falcon's ffn_hidden_size; Mamba's selective scan, no attention). The others are llama-like variants of these: the
# whole matrix (every family transformers builds, docs/MODEL_COVERAGE.md) is
# benchmarks/bench_families.py, and the simulator-only tests below still cover every family here.
REAL_FAMILIES = ("llama", "gemma2", "qwen3_moe", "gpt_oss", "gpt2", "opt", "bloom", "falcon", "mamba")
# Families without a field of that name: the _TINY fields they do not have are left out.
_NO_MLP_OR_KV_FIELD = {"gpt2", "opt", "bloom", "falcon", "gptj", "gpt_bigcode", "mpt", "mamba"}
_NO_POSITIONS_FIELD = {"bloom", "mpt", "mamba"}
_NO_HEADS_FIELD = {"mamba"}


def _config_class(name: str):
    return getattr(transformers, name, None)


def _write_config(family: str, folder) -> str:
    class_name, fields = FAMILIES[family]
    config_class = _config_class(class_name)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    tiny = dict(_TINY)
    if family == "gpt_neox":  # GPT-NeoX names its MLP width differently and has no KV heads
        tiny.pop("num_key_value_heads")
        tiny["intermediate_size"] = 256
    if family in _NO_MLP_OR_KV_FIELD:
        tiny.pop("intermediate_size")
        tiny.pop("num_key_value_heads")
    if family in _NO_POSITIONS_FIELD:
        tiny.pop("max_position_embeddings")
    if family in _NO_HEADS_FIELD:
        tiny.pop("num_attention_heads")
    config = config_class(**tiny, **fields)
    path = folder / family
    config.save_pretrained(path)
    return str(path)


def _spec(path: str, **train) -> TrialSpec:
    return TrialSpec(model=resolve_model(path), cluster=Cluster(num_gpus=2), seq_len=SEQ_LEN,
                     train=TrainConfig(**train))


@pytest.fixture(scope="module")
def saved_configs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("families")
    return {family: _write_config(family, folder) for family in FAMILIES
            if _config_class(FAMILIES[family][0]) is not None}


def test_shallow_copies_keep_every_kind_of_layer(saved_configs):
    """A shallow copy's blocks are the real model's first blocks, per-layer fields cut alike."""
    for family, path in saved_configs.items():
        model = resolve_model(path)
        full = model.hf_config()
        layer_types = getattr(full, "layer_types", None)
        period = model.layer_period
        depth = period + 2
        if depth >= model.num_layers:
            continue
        shallow = model.hf_config(num_layers=depth)  # transformers validates the cut config
        assert shallow.num_hidden_layers == depth
        if layer_types:
            assert list(shallow.layer_types) == list(layer_types[:depth]), family
            assert set(shallow.layer_types) == set(layer_types), family


def test_layer_periods_follow_each_family_pattern(saved_configs):
    periods = {family: resolve_model(path).layer_period for family, path in saved_configs.items()}
    # Counted from transformers' own layer_types / MoE layout of these configs:
    assert periods["gemma2"] == 2            # sliding, full, sliding, full, ...
    assert periods["gemma3_text"] == 6       # five sliding layers, then one full
    assert periods["qwen3_moe"] == 2         # decoder_sparse_step=2: dense, MoE, dense, MoE, ...
    assert periods["llama"] == 1 and periods["qwen2"] == 1


def test_a_copy_that_would_drop_a_kind_of_layer_is_refused(saved_configs):
    model = resolve_model(saved_configs["gemma2"])
    with pytest.raises(ValueError, match="lack"):
        model.hf_config(num_layers=1)


def _family_spec(saved_configs, family: str) -> TrialSpec:
    """The trial each family is predicted and run at (llama with every:2 checkpointing)."""
    return _spec(saved_configs[family], activation_checkpointing="every:2" if family == "llama" else "none",
                 micro_batch_size=2)


def _real_families() -> list[str]:
    return [family for family in REAL_FAMILIES if _config_class(FAMILIES[family][0]) is not None]


def _real_specs(folder) -> list[TrialSpec]:
    """The REAL_FAMILIES' trials, from configs transformers writes into `folder`, for the shared launch."""
    return [_family_spec({family: _write_config(family, folder)}, family) for family in _real_families()]


# Run for real at full depth in the session's shared launch of 2 gloo ranks (tests/shared_runs.py).
register("model-families", __name__, _real_specs)


@pytest.fixture(scope="module")
def predict(saved_configs):
    """The simulator's prediction (two shallow copies, extrapolated) of a family's trial, made once
    per family when first asked for: the full-depth traces and the real gloo runs are both
    compared with it."""
    sim = SimBackend(device_kind="cpu", screen=False)
    made = {}

    def prediction(family: str):
        if family not in made:
            made[family] = sim.evaluate(_family_spec(saved_configs, family))
        return made[family]

    yield prediction
    sim.close()


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "qwen3_moe"])
def test_extrapolation_equals_a_full_depth_trace_for_patterned_layers(saved_configs, predict, family):
    """A count made another way: the whole model traced, against two shallow copies extrapolated."""
    spec = _family_spec(saved_configs, family)
    assert spec.train.activation_checkpointing == "none" and spec.train.micro_batch_size == 2
    extrapolated = predict(family)
    whole = SimBackend(device_kind="cpu", extrapolate=False, screen=False)
    try:
        full = whole.evaluate(spec)
    finally:
        whole.close()
    assert extrapolated.status == full.status == "ok", (extrapolated.message, full.message)
    assert extrapolated.extras["extrapolated"] and not full.extras["extrapolated"]
    assert extrapolated.extras["tensor_peak_bytes"] == full.extras["tensor_peak_bytes"]


@pytest.fixture(scope="module")
def measured_and_predicted(gloo_runs, predict):
    specs, measured = gloo_runs.run("model-families")
    families = _real_families()
    assert [spec.model.name for spec in specs] == families
    return {family: (spec, real, predict(family)) for family, spec, real in zip(families, specs, measured)}


@pytest.mark.slow
@pytest.mark.parametrize("family", REAL_FAMILIES)
def test_family_prediction_matches_a_real_gloo_run(measured_and_predicted, family):
    if family not in measured_and_predicted:
        pytest.skip(f"transformers {transformers.__version__} has no {FAMILIES[family][0]}")
    spec, real, sim = measured_and_predicted[family]
    assert real.status == "ok", real.message
    assert sim.status == "ok", sim.message
    assert sim.extras["extrapolated"], "the depth must force extrapolation"
    real_peak, sim_peak = real.extras["tensor_peak_bytes"], sim.extras["tensor_peak_bytes"]
    assert abs(sim_peak - real_peak) <= 0.01 * real_peak, (
        f"{family}: predicted {sim_peak:,} B, measured {real_peak:,} B")


MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")  # 4 experts each


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_memory_per_gpu_falls_as_gpus_are_added(tmp_path, family):
    """Issue 32: the decision graph's placement for each MoE family (4 experts; two layers, a whole
    period of each pattern, traced whole) on 4, 8 and 16 GPUs. The graph moves the experts off
    dimension 0 exactly from 8 GPUs on (more GPUs than experts, counted from the config), and the
    simulator's per-GPU tensor peak falls with every doubling; FSDP2's default placement, traced
    beside it on 8 and 16 GPUs, holds more (its experts are padding on most ranks)."""
    from autotune.search.controller import Controller
    from autotune.search.records import TuneRequest

    class_name, fields = FAMILIES[family]
    if _config_class(class_name) is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    _config_class(class_name)(**_TINY, **{**fields, "num_hidden_layers": 2}).save_pretrained(tmp_path / family)
    model = resolve_model(str(tmp_path / family))
    peaks, padded = [], []
    with SimBackend(device_kind="cpu", screen=False) as sim:
        for gpus in (4, 8, 16):
            cluster = Cluster(num_gpus=gpus)
            placement, _ = Controller(TuneRequest(model=model, cluster=cluster, seq_len=SEQ_LEN,
                                                  target_tokens=SEQ_LEN * gpus), sim)._placement()
            assert (placement == "largest") == (gpus > 4), (family, gpus)

            def peak(chosen: str) -> int:
                result = sim.evaluate(TrialSpec(model=model, cluster=cluster, seq_len=SEQ_LEN,
                                                train=TrainConfig(micro_batch_size=1, shard_placement=chosen)))
                assert result.status == "ok", result.message
                return result.extras["tensor_peak_bytes"]
            peaks.append(peak(placement))
            if placement != "dim0":
                padded.append(peak("dim0"))
    assert all(b < a for a, b in zip(peaks, peaks[1:])), peaks
    assert all(mine < theirs for mine, theirs in zip(peaks[1:], padded)), (peaks, padded)
