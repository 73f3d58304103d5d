"""Model and GPU catalogs, configuration parsing, the search-space file."""

import json
import re

import pytest

from autotune.problem.catalog.gpus import GPUS, resolve_gpu
from autotune.problem.catalog.models import MODELS, resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec, parse_ac
from autotune.util.errors import UnsupportedModelError, UsageError
from autotune.search.space import DEFAULT_SPACE, SearchSpace, load_space

# Published parameter counts (model cards): the catalog shapes must reproduce them.
PUBLISHED = {"llama-7b": 6.74e9, "llama-13b": 13.0e9, "llama-70b": 69.0e9, "llama3-8b": 8.03e9,
             "llama3-70b": 70.6e9, "mistral-7b": 7.24e9, "qwen2.5-7b": 7.62e9,
             "llama3.1-8b": 8.03e9, "llama3.1-70b": 70.6e9, "qwen2.5-32b": 32.5e9, "qwen2.5-72b": 72.7e9,
             "qwen3-8b": 8.2e9, "qwen3-32b": 32.8e9, "mixtral-8x7b": 46.7e9, "gemma2-9b": 9.24e9,
             "gemma2-27b": 27.2e9,
             # Code Llama 34B model card: 33.7B (the shape fms-fsdp trains as llama2_34b)
             "codellama-34b": 33.7e9,
             # model cards: Qwen2.5-1.5B 1.54B, Llama 3.2 1B 1.23B (tied embeddings counted once)
             "qwen2.5-1.5b": 1.54e9, "llama3.2-1b": 1.24e9,
             "qwen3-30b-a3b": 30.5e9,
             "llama3.1-405b": 405.9e9}  # the Hub's meta-llama/Llama-3.1-405B page: 406B (safetensors, 405.9B)  # Qwen3-30B-A3B model card: 30.5B in total, 3.3B activated


@pytest.mark.parametrize("name", list(MODELS))
def test_every_catalog_entry_builds_and_wraps(name):
    model = resolve_model(name)
    assert model.num_parameters > 0
    assert model.block_class.endswith("DecoderLayer")
    assert model.default_seq_len <= model.max_positions
    if name in PUBLISHED:
        assert model.num_parameters == pytest.approx(PUBLISHED[name], rel=0.01)


# Active parameters as their makers publish them: Mistral AI, "Mixtral of experts" (2023-12-11):
# "46.7B total parameters but only uses 12.9B parameters per token"; Qwen3-30B-A3B's model card:
# "30.5B in total and 3.3B activated" (both rounded to 0.1 B: within 2% here).
PUBLISHED_ACTIVE = {"mixtral-8x7b": (46.7e9, 12.9e9), "qwen3-30b-a3b": (30.5e9, 3.3e9)}


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE))
def test_moe_active_parameters_are_the_published_ones(name):
    """Counted from the meta build's fused experts and the config's routing, against the makers'
    own figures; MFU counts 6 x the active parameters per token, so a MoE model's MFU stays a
    fraction of the GPU's peak (the analytic estimate on 64 H100s, where 6 x all parameters read
    over 100% for mixtral)."""
    from autotune.backends.analytic import AnalyticBackend

    model = resolve_model(name)
    total, active = PUBLISHED_ACTIVE[name]
    assert model.num_parameters == pytest.approx(total, rel=0.02)
    assert model.active_parameters == pytest.approx(active, rel=0.02)
    spec = TrialSpec(model=model, cluster=Cluster(num_gpus=64, num_nodes=8, gpu=resolve_gpu("h100-80gb")),
                     seq_len=4096, train=TrainConfig(micro_batch_size=1, activation_checkpointing=parse_ac("full"),
                                                     shard_placement="largest"))
    with AnalyticBackend() as analytic:
        mfu = analytic.evaluate(spec).extras["mfu"]
    assert 0 < mfu < 0.7


def test_unknown_model_suggests_close_names():
    with pytest.raises(UsageError, match="did you mean llama-7b"):
        resolve_model("llama-7")


def test_model_from_config_path(tmp_path):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100,
              "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_folder = resolve_model(str(tmp_path))
    from_file = resolve_model(str(tmp_path / "config.json"))
    assert from_folder.num_parameters == from_file.num_parameters > 0
    assert from_folder.default_seq_len == 256


def test_bad_config_paths(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        resolve_model(str(tmp_path / "missing" / "config.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UsageError, match="cannot read"):
        resolve_model(str(tmp_path / "bad.json"))
    (tmp_path / "custom.json").write_text(json.dumps({"model_type": "llama", "auto_map": {"AutoModel": "x.Y"},
                                                      "num_hidden_layers": 2}))
    with pytest.raises(UsageError, match="--trust-remote-code"):
        resolve_model(str(tmp_path / "custom.json"))


def test_model_without_repeated_blocks_names_supported_families(tmp_path):
    # An encoder-decoder's largest ModuleList still exists, but a config whose model has none fails:
    # use a transformers model with no ModuleList of blocks at all.
    from torch import nn

    from autotune.problem.catalog.blocks import find_decoder_blocks

    with pytest.raises(UnsupportedModelError, match="supported families: llama"):
        find_decoder_blocks(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))


DATA_SHEETS = {
    # name: (memory GB, dense 16-bit tensor TFLOP/s (the sheets print 2x "with sparsity"), memory GB/s,
    #        fp32 TFLOP/s, dense float8 TFLOP/s or None, source). Typed from the vendors' published sheets,
    #        not from the catalog: the figures every estimate divides by.
    "h100-80gb": (80, 989, 3350, 67, 1979, "NVIDIA H100 Tensor Core GPU data sheet, SXM5: BF16 1,979 TFLOPS "
                                           "with sparsity, FP8 3,958 with sparsity, HBM3 3.35 TB/s, FP32 67"),
    "h200-141gb": (141, 989, 4800, 67, 1979, "NVIDIA H200 Tensor Core GPU data sheet, SXM: BF16 1,979 TFLOPS "
                                             "with sparsity, FP8 3,958, HBM3e 4.8 TB/s, FP32 67"),
    "a100-80gb": (80, 312, 2039, 19.5, None, "NVIDIA A100 Tensor Core GPU data sheet, 80GB SXM: BF16 312 TFLOPS "
                                             "(624 with sparsity), HBM2e 2,039 GB/s, FP32 19.5"),
    "a100-40gb": (40, 312, 1555, 19.5, None, "NVIDIA A100 Tensor Core GPU data sheet, 40GB SXM: BF16 312 TFLOPS, "
                                             "HBM2 1,555 GB/s, FP32 19.5"),
    "l40s-48gb": (48, 362, 864, 91.6, 733, "NVIDIA L40S data sheet: BF16 362.05 TFLOPS (733 with sparsity), "
                                           "FP8 733 (1,466 with sparsity), GDDR6 864 GB/s, FP32 91.6"),
    "rtx4090-24gb": (24, 165.2, 1008, 82.6, 330.3, "NVIDIA Ada Lovelace architecture whitepaper, RTX 4090: peak "
                                                   "BF16 tensor with FP32 accumulate 165.2 TFLOPS, FP8 330.3, "
                                                   "GDDR6X 1,008 GB/s, FP32 82.6"),
    "v100-32gb": (32, 125, 900, 15.7, None, "NVIDIA V100 Tensor Core GPU data sheet, SXM2: tensor 125 TFLOPS "
                                            "(fp16), HBM2 900 GB/s, FP32 15.7"),
}


def test_gpu_catalog():
    """The data-sheet figures behind every estimate, against the vendors' published numbers written above
    (each within 1%; memory as nvidia-smi reports it: 93-100% of the sheet's GiB). The A10G has no NVIDIA
    data sheet of its own (AWS publishes its g5 figures): its memory and bandwidth are held to the A10's
    sheet (24 GB GDDR6, 600 GB/s) and its 16-bit peak below the A10's 125 TFLOPS."""
    for name, (memory_gb, tflops, gbps, fp32, float8, source) in DATA_SHEETS.items():
        gpu = GPUS[name]
        assert 0.93 <= gpu.memory_bytes / (memory_gb * 2**30) <= 1.0, (name, source)
        assert gpu.peak_tflops == pytest.approx(tflops, rel=0.01), (name, source)
        assert gpu.hbm_gbps == pytest.approx(gbps, rel=0.01), (name, source)
        assert gpu.fp32_tflops == pytest.approx(fp32, rel=0.01), (name, source)
        assert (gpu.float8_tflops or None) == (pytest.approx(float8, rel=0.01) if float8 else None), (name, source)
    a10g = GPUS["a10g-24gb"]
    assert 0.93 <= a10g.memory_bytes / (24 * 2**30) <= 1.0 and a10g.hbm_gbps == 600 and a10g.peak_tflops < 125
    assert not GPUS["v100-32gb"].supports_bf16
    with pytest.raises(UsageError, match="did you mean h100-80gb"):
        resolve_gpu("h100-80")


@pytest.mark.parametrize("text, expected", [("none", "none"), ("full", "full"), ("every:2", "every:2"),
                                            ("every-3", "every:3"), ("every:1", "full"), ("FULL", "full"),
                                            ("op", "op"), ("op:alt-mm", "op"), ("op:mm", "op:mm")])
def test_parse_ac(text, expected):
    assert str(parse_ac(text)) == expected
    assert parse_ac(str(parse_ac(text))) == parse_ac(text)  # the string form reads back as the same value


@pytest.mark.parametrize("text", ["some", "every:0", "every:x", "every", "op:all"])
def test_parse_ac_refuses(text):
    with pytest.raises(UsageError):
        parse_ac(text)


def test_cluster_validation():
    with pytest.raises(UsageError, match="not divisible"):
        Cluster(num_gpus=6, num_nodes=4)
    with pytest.raises(UsageError, match="positive"):
        Cluster(num_gpus=0)
    assert Cluster(num_gpus=16, num_nodes=2).gpus_per_node == 8


def test_trial_spec_round_trips():
    spec = TrialSpec(model=resolve_model("tiny-qwen2"), cluster=Cluster(num_gpus=2, gpu=GPUS["a100-40gb"]),
                     seq_len=128, train=TrainConfig(activation_checkpointing="every:2", micro_batch_size=3),
                     grad_accum_steps=5, memory_limit_bytes=10**9)
    again = TrialSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again.train == spec.train and again.cluster == spec.cluster and again.model == spec.model
    assert again.grad_accum_steps == 5 and again.limit_bytes == 10**9


def test_default_space_file_matches_built_in_defaults():
    loaded = load_space(DEFAULT_SPACE)
    assert {k: v for k, v in loaded.to_dict().items() if k != "source"} == \
        {k: v for k, v in SearchSpace().to_dict().items() if k != "source"}


@pytest.mark.parametrize("text, message", [
    ("[micro_batch]\nmax = 0\n", "micro_batch.max must be >= 1"),
    ("[micro_batch]\nmax = true\n", "micro_batch.max must be int"),
    ("[checkpointing]\nlighter_every = [1]\n", "checkpointing.lighter_every"),
    ("[offload]\nenable = true\n", "unknown key offload.enable"),
    ("[tuning]\n", "unknown section"),
    ("[baseline]\nprecision = \"int8\"\n", "baseline.precision"),
    ("[baseline\n", "not valid TOML"),
])
def test_malformed_space_says_which_key(tmp_path, text, message):
    path = tmp_path / "space.toml"
    path.write_text(text)
    with pytest.raises(UsageError, match=message):
        load_space(path)


def test_shard_placement_is_one_name_per_configuration_and_refused_with_a_reshard_group():
    """`largest` where no parameter's first dimension is smaller than the shard group moves nothing:
    it is the default configuration and is named so. FSDP2 reshards after forward to a smaller
    group only by splitting dimension 0, so `largest` with --reshard-group is refused in one line."""
    def spec(model: str, gpus: int, nodes: int = 1, **train) -> TrialSpec:
        return TrialSpec(model=resolve_model(model), cluster=Cluster(num_gpus=gpus, num_nodes=nodes), seq_len=64,
                         train=TrainConfig(shard_placement="largest", **train))

    assert spec("tiny-llama", 8).train.shard_placement == "dim0"  # dense: nothing smaller than 8
    assert spec("tiny-mixtral", 2).train.shard_placement == "dim0"  # 2 experts on 2 GPUs: even
    assert spec("tiny-mixtral", 4).train.shard_placement == "largest"
    with pytest.raises(UsageError, match="--reshard-group 4 with --shard-placement largest"):
        spec("tiny-mixtral", 8, nodes=2, reshard_group_size=4)
    assert spec("tiny-llama", 8, nodes=2, reshard_group_size=4).train.reshard_group_size == 4


def test_expert_parallel_degrees_that_cannot_apply_are_refused_in_one_line():
    """--ep needs fused experts, a degree dividing them and the GPUs, and none of the knobs it is
    not built with here (HSDP, a reshard group, compiled blocks)."""
    mixtral, cluster = resolve_model("tiny-mixtral"), Cluster(num_gpus=4)
    assert mixtral.num_experts == 2 and resolve_model("tiny-llama").num_experts == 0
    TrialSpec(model=mixtral, cluster=cluster, seq_len=128, train=TrainConfig(expert_parallel=2))
    cases = [(mixtral, dict(expert_parallel=4), "must divide both the 2 experts"),
             (resolve_model("tiny-llama"), dict(expert_parallel=2), "has no fused experts"),
             (mixtral, dict(expert_parallel=2, shard_group_size=2), "--hsdp 2"),
             (mixtral, dict(expert_parallel=2, compile="blocks"), ".tolist()")]
    for model, knobs, said in cases:
        with pytest.raises(UsageError, match=re.escape(said)) as caught:
            TrialSpec(model=model, cluster=cluster, seq_len=128, train=TrainConfig(**knobs))
        assert "\n" not in str(caught.value)
