"""Decoder families whose configs spell their sizes their own way (issue 25), and clean refusals.

GPT-2, BLOOM, GPT-J, CodeGen, GPTBigCode and MPT store the depth as `n_layer` / `n_layers` and
transformers reads it through the config class's `attribute_map`; OPT names its MLP width
`ffn_dim`, GPT-2 derives it (`n_inner` None: 4 x hidden), Falcon calls it `ffn_hidden_size`.
Every figure here is compared with transformers' own: the model it builds from the same
config.json (parameters counted on the meta device), or its documented defaults. Fast: configs
and meta-device builds only; the real-vs-simulated comparison is in tests/test_model_families.py
and benchmarks/bench_families.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from autotune.problem.catalog.models import canonical_config, resolve_model
from autotune.problem.catalog.shrink import shrunk_config
from autotune.drivers.cli import EXIT_USAGE, main
from autotune.util.errors import UsageError

# family -> (config class, fields as the family spells them). Tiny, transformers-written configs.
SPELLED_THEIR_OWN_WAY = {
    "gpt2": ("GPT2Config", dict(n_layer=3, n_embd=64, n_head=4, n_positions=256, vocab_size=512,
                                bos_token_id=1, eos_token_id=2)),
    "opt": ("OPTConfig", dict(num_hidden_layers=3, hidden_size=64, ffn_dim=128, num_attention_heads=4,
                              max_position_embeddings=256, word_embed_proj_dim=64, vocab_size=512,
                              pad_token_id=1, bos_token_id=2, eos_token_id=2)),
    "bloom": ("BloomConfig", dict(n_layer=3, hidden_size=64, n_head=4, vocab_size=512)),
    "falcon": ("FalconConfig", dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=512,
                                    ffn_hidden_size=192, bos_token_id=1, eos_token_id=2)),
    "gptj": ("GPTJConfig", dict(n_layer=3, n_embd=64, n_head=4, rotary_dim=8, n_positions=256, vocab_size=512,
                                bos_token_id=1, eos_token_id=2)),
    "gpt_bigcode": ("GPTBigCodeConfig", dict(n_layer=3, n_embd=64, n_head=4, n_positions=256, vocab_size=512,
                                             bos_token_id=1, eos_token_id=2)),
    "mpt": ("MptConfig", dict(n_layers=3, d_model=64, n_heads=4, max_seq_len=256, vocab_size=512)),
}


def _save(folder, family: str) -> str:
    class_name, fields = SPELLED_THEIR_OWN_WAY[family]
    config_class = getattr(transformers, class_name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    path = folder / family
    config_class(**fields).save_pretrained(path)
    return str(path)


def _built_by_transformers(path: str) -> torch.nn.Module:
    """The model plain transformers builds from the saved config.json, on the meta device."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


@pytest.mark.parametrize("family", list(SPELLED_THEIR_OWN_WAY))
def test_a_config_spelled_its_own_way_resolves_with_transformers_parameter_count(tmp_path, family):
    path = _save(tmp_path, family)
    stored = json.loads((tmp_path / family / "config.json").read_text())
    model = resolve_model(path)
    hf = AutoConfig.from_pretrained(path)  # transformers' own accessors (attribute_map)
    net = _built_by_transformers(path)
    assert model.num_parameters == sum(p.numel() for p in net.parameters())
    assert model.num_layers == hf.num_hidden_layers == 3
    assert model.hidden_size == hf.hidden_size == 64
    assert model.vocab_size == hf.vocab_size == net.get_output_embeddings().weight.shape[0]
    assert model.num_attention_heads == hf.num_attention_heads == 4
    # The config autotune carries uses the canonical names, which transformers accepts back.
    assert "num_hidden_layers" in model.config_dict
    assert not {"n_layer", "n_layers"} & set(model.config_dict), sorted(stored)


def test_mlp_width_is_measured_whatever_the_family_calls_it(tmp_path):
    """Against each family's documented MLP width: GPT-2's n_inner None means 4 x n_embd, OPT's
    ffn_dim, Falcon's ffn_hidden_size, BLOOM's fixed 4 x hidden."""
    widths = {family: resolve_model(_save(tmp_path, family)).mlp_width for family in ("gpt2", "opt", "falcon", "bloom")}
    assert widths == {"gpt2": 4 * 64, "opt": 128, "falcon": 192, "bloom": 4 * 64}


def test_canonical_config_renames_stored_aliases_only():
    data = {"model_type": "gpt2", "n_layer": 3, "n_embd": 64, "n_head": 4, "n_positions": 256, "n_inner": None}
    out = canonical_config("gpt2", data)
    assert out == {"model_type": "gpt2", "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
                   "max_position_embeddings": 256, "n_inner": None}
    # transformers accepts the canonical names back and stores them its own way
    config = AutoConfig.for_model("gpt2", **{k: v for k, v in out.items() if k != "model_type"})
    assert (config.n_layer, config.n_embd, config.n_head, config.n_positions) == (3, 64, 4, 256)
    # a family that stores the canonical name is left alone
    llama = {"num_hidden_layers": 2, "hidden_size": 64}
    assert canonical_config("llama", llama) == llama


@pytest.mark.parametrize("family", ["gpt2", "opt", "bloom", "falcon", "llama", "mixtral", "gpt_neox"])
def test_shrunk_default_configs_resolve_and_count_like_transformers(tmp_path, family):
    """The generic shrinker (the benchmark's family matrix) writes configs transformers builds, and
    autotune counts them as transformers does."""
    config = shrunk_config(family, num_layers=3)
    assert config.num_hidden_layers == 3 and config.hidden_size == 64 and config.vocab_size == 512
    path = tmp_path / family
    config.save_pretrained(path)
    model = resolve_model(str(path))
    assert model.num_parameters == sum(p.numel() for p in _built_by_transformers(str(path)).parameters())


def _write(tmp_path, config) -> str:
    config.save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def _trial(path: str, capsys) -> tuple[int, str]:
    code = main(["trial", "--model", path, "--gpus", "2", "--seq-len", "64", "--backend", "sim"])
    return code, capsys.readouterr().err


def test_pad_token_outside_the_vocabulary_is_a_one_line_usage_error(tmp_path, capsys):
    """transformers only warns about it, then fails building the embedding (an AssertionError)."""
    path = _write(tmp_path, transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                                     num_attention_heads=4, vocab_size=512, pad_token_id=600))
    code, err = _trial(path, capsys)
    assert code == EXIT_USAGE, err
    assert err.count("\n") == 1 and "Traceback" not in err and "internal error" not in err, err
    assert "pad_token_id" in err and "512" in err, err


def test_heads_that_do_not_divide_the_width_name_the_family_fields(tmp_path, capsys):
    path = _write(tmp_path, transformers.GPT2Config(n_layer=2, n_embd=64, n_head=5, vocab_size=512, n_positions=256,
                                                    bos_token_id=1, eos_token_id=2))
    code, err = _trial(path, capsys)
    assert code == EXIT_USAGE, err
    assert err.count("\n") == 1 and "n_embd" in err and "n_head" in err, err


@pytest.mark.parametrize("config_class, fields, reason", [
    ("BertConfig", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                        vocab_size=512), "not a decoder-only causal language model"),
    ("BartConfig", dict(encoder_layers=2, decoder_layers=2, d_model=64, encoder_attention_heads=4,
                        decoder_attention_heads=4, vocab_size=512), "encoder-decoder"),
])
def test_encoders_and_encoder_decoders_are_refused_in_one_line(tmp_path, capsys, config_class, fields, reason):
    path = _write(tmp_path, getattr(transformers, config_class)(**fields))
    with pytest.raises(UsageError, match=reason):
        resolve_model(path)
    code, err = _trial(path, capsys)
    assert code == EXIT_USAGE and err.count("\n") == 1 and reason in err, err


@pytest.mark.parametrize("family, name", [("mamba", "A_log"), ("rwkv", "time_decay")])
def test_inits_that_copy_whole_tensors_initialise_each_fsdp2_shard_as_transformers_does(tmp_path, family, name):
    """State-space and RWKV inits copy a whole tensor computed on the spot into a parameter
    (`init.copy_(A_log, torch.log(A))`), which DTensor refuses beside an FSDP2 shard: every real
    trial of mamba, mamba2, bamba, falcon_h1, qwen3_next, rwkv, ... failed before its first step.
    Against transformers' own init of the same config, unsharded: the first rank of two (a fake
    process group, real tensors) holds the first half of that parameter, value for value."""
    from autotune.backends.real._trial import init_weights
    from autotune.backends.sim._fakepg import fake_mesh, release_fake_group
    from autotune.problem.config import TrainConfig
    from autotune.distributed.parallel import ParallelDims, parallelize
    from autotune.distributed.training import build_model

    shrunk_config(family, num_layers=2).save_pretrained(tmp_path / family)
    model = resolve_model(str(tmp_path / family))
    plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / family))  # transformers' init
    expected = dict(plain.named_parameters())
    mesh = fake_mesh(ParallelDims(dp_replicate=1, dp_shard=2))
    try:
        with torch.device("meta"):
            net = build_model(model)
        parallelize(net, mesh, TrainConfig(micro_batch_size=1))
        net.to_empty(device="cpu")
        init_weights(net, seed=0)
    finally:
        release_fake_group()
    checked = 0
    for key, param in net.named_parameters():
        if key.endswith(name):
            want = expected[key]
            assert param.shape == want.shape
            assert torch.equal(param.to_local(), want[: (want.shape[0] + 1) // 2]), key
            checked += 1
    assert checked == 2  # one per block


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_5_text"])
def test_shrunk_configs_run_a_forward_and_backward_in_plain_transformers(family):
    """The shrinker's tiny config is one plain transformers can train: DeepSeek-V2's default leaves
    `num_experts_per_tok` None (topk's k), and Qwen3.5's 32 linear-attention value heads equal its
    default depth, which must not follow the depth down below its 16 key heads."""
    config = shrunk_config(family, num_layers=4)
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(config).train()
    tokens = torch.randint(0, config.vocab_size, (1, 16))
    loss = net(input_ids=tokens, labels=tokens, use_cache=False).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_a_model_that_reads_tensor_values_is_refused_the_simulator_up_front(tmp_path, capsys):
    """jetmoe's router reads a tensor's value in forward: transformers itself cannot run it on fake
    tensors (checked here without autotune), and it trains in plain transformers. A sim tune is
    refused before any trial, in one line that names the module and the real backends (not a
    trial error per configuration, nor a memory limit's "add GPUs")."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    config = shrunk_config("jetmoe", num_layers=2)
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (1, 16))
    net = AutoModelForCausalLM.from_config(config)
    net(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()  # real tensors: fine
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, pytest.raises(DataDependentOutputException):
        AutoModelForCausalLM.from_config(config)(input_ids=mode.from_tensor(tokens), use_cache=False)
    path = _write(tmp_path, config)
    code = main(["--model", path, "--gpus", "2", "--seq-len", "64", "--global-tokens", "1024", "--backend", "sim",
                 "--max-trials", "1", "--runs-dir", str(tmp_path / "runs")])
    printed = capsys.readouterr().err
    assert code == EXIT_USAGE and printed.count("\n") == 1, printed
    assert "JetMoeTopKGating reads a tensor's value" in printed and "--backend cpu or cuda" in printed
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # no trial ran


@pytest.mark.parametrize("family, module, buffer", [("openai-gpt", "modeling_openai.Attention", "bias"),
                                                    ("minimax", "modeling_minimax.MiniMaxLightningAttention",
                                                     "diagonal_decay")])
def test_a_model_whose_float32_buffers_meet_bf16_is_refused_mixed_precision_up_front(tmp_path, capsys, family,
                                                                                      module, buffer):
    """openai-gpt's causal mask and MiniMax's decay factors are float32 buffers its forward multiplies
    bf16 activations by. Plain transformers, with the parameters in bf16 and the buffers as built
    (what FSDP2's mixed precision computes with), fails the same way; built in bf16 throughout, it
    trains. autotune refuses bf16 mixed precision before any trial, naming the module and its
    buffer, and runs the model in bf16-pure."""
    config = shrunk_config(family, num_layers=2)
    config._attn_implementation = "eager"
    tokens = torch.randint(0, config.vocab_size, (1, 16))
    mixed = AutoModelForCausalLM.from_config(config)
    for parameter in mixed.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype|scalar type"):
        mixed(input_ids=tokens, use_cache=False)
    pure = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    pure(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()
    path = _write(tmp_path, config)  # its config.json now says dtype bfloat16, as released checkpoints' do
    assert json.loads((tmp_path / "model" / "config.json").read_text())["dtype"] == "bfloat16"  # as released
    code, printed = _trial(path, capsys)
    assert code == EXIT_USAGE and printed.count("\n") == 1, printed
    assert f"{module} multiplies bf16 activations by its float32 buffers" in printed and buffer in printed
    assert "--precision bf16-pure" in printed
    assert main(["trial", "--model", path, "--gpus", "2", "--seq-len", "64", "--backend", "sim",
                 "--precision", "bf16-pure"]) == 0
