"""--text-only: a multimodal config's language model tuned alone (issue 25).

The configs are written by transformers itself (`AutoConfig.for_model(...).save_pretrained`, shrunk
towers), and every count is checked against the whole model transformers builds from them on the
meta device: its language-model submodule (`model.language_model`) and output head, counted here
without autotune. Sim backend and single trials only.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from autotune.problem.catalog.models import resolve_model
from autotune.drivers.cli import EXIT_OK, EXIT_USAGE, main

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=512)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              image_size=56, patch_size=14)
MULTIMODAL = {
    "gemma3": dict(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4),
    "llava": dict(text_config=dict(TEXT, model_type="llama"), vision_config=VISION),
    # Mistral 3 ties its head to the embedding at the top level, its text_config says not: the whole
    # model's tying is the one that trains
    "mistral3": dict(text_config=dict(TEXT, model_type="mistral"), vision_config=dict(VISION, head_dim=16)),
    # Qwen2-VL's language model (qwen2_vl_text) has no causal-LM class: autotune puts the head on it
    "qwen2_vl": dict(text_config=dict(TEXT, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                  mrope_section=[2, 3, 3])),
                     vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2)),
}


def _save(folder, kind: str) -> str:
    AutoConfig.for_model(kind, **MULTIMODAL[kind]).save_pretrained(folder / kind)
    return str(folder / kind)


def _whole_model(path: str):
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path))


def _language_model_and_whole(path: str) -> tuple[int, int]:
    """(parameters of the language model and its head, of the whole model), as transformers builds it."""
    whole = _whole_model(path)
    language = {id(p): p.numel() for part in (whole.model.language_model, whole.lm_head) for p in part.parameters()}
    return sum(language.values()), sum(p.numel() for p in whole.parameters())


@pytest.mark.parametrize("kind", list(MULTIMODAL))
def test_text_only_tunes_transformers_language_model_and_counts_what_it_leaves_out(tmp_path, kind):
    path = _save(tmp_path, kind)
    language, whole = _language_model_and_whole(path)
    model = resolve_model(path, text_only=True)
    assert model.num_parameters == language
    assert model.text_tower_of["left_out_parameters"] == whole - language > 0
    assert model.text_tower_of["parameters"] == whole
    towers = {f"model.{name}" for name, part in _whole_model(path).model.named_children()
              if name != "language_model" and any(True for _ in part.parameters())}
    assert set(model.text_tower_of["left_out_modules"]) == towers  # vision tower, projector (Qwen2-VL: visual)


def test_without_the_flag_a_multimodal_config_is_refused_naming_it(tmp_path, capsys):
    path = _save(tmp_path, "llava")
    code = main(["trial", "--model", path, "--gpus", "2", "--seq-len", "64", "--backend", "sim"])
    printed = capsys.readouterr().err
    assert code == EXIT_USAGE and printed.count("\n") == 1 and "--text-only" in printed, printed


def test_the_flag_on_a_text_model_is_refused(capsys):
    code = main(["trial", "--model", "micro-llama", "--text-only", "--gpus", "2", "--backend", "sim"])
    printed = capsys.readouterr().err
    assert code == EXIT_USAGE and "drop --text-only" in printed, printed


def test_a_text_only_trial_says_what_it_left_out(tmp_path, capsys):
    path = _save(tmp_path, "gemma3")
    language, whole = _language_model_and_whole(path)
    code = main(["trial", "--model", path, "--text-only", "--gpus", "2", "--seq-len", "64", "--backend", "sim"])
    captured = capsys.readouterr()
    assert code == EXIT_OK, captured.err
    left_out = json.loads(captured.out)["text_only"]
    assert left_out["left_out_parameters"] == whole - language
    # fp32 master weight, gradient and AdamW's two states of the left-out parameters, sharded over 2 GPUs
    assert left_out["left_out_state_bytes_per_gpu_estimated"] == (whole - language) * 16 // 2
    assert "--text-only: tuned gemma3's language model alone" in captured.err


def test_a_text_only_tune_records_it_and_never_shares_the_text_models_study(tmp_path, capsys):
    """The language model saved as a config.json of its own (what the refusal used to advise) is the
    same model, but a --text-only study is not resumed by it, nor it by one."""
    from autotune.results.export import write_exports
    from autotune.results.result import load_result

    path = _save(tmp_path, "llava")
    AutoConfig.from_pretrained(path).get_text_config().save_pretrained(tmp_path / "text")
    runs = tmp_path / "runs"
    common = ["--gpus", "2", "--seq-len", "64", "--global-tokens", "256", "--backend", "sim", "--max-trials", "1",
              "--runs-dir", str(runs)]
    assert main(["--model", path, "--text-only", "--out", str(tmp_path / "text-only.json"), *common]) == EXIT_OK
    assert main(["--model", str(tmp_path / "text"), "--out", str(tmp_path / "text.json"), *common]) == EXIT_OK
    capsys.readouterr()
    text_only, text = load_result(tmp_path / "text-only.json"), load_result(tmp_path / "text.json")
    assert text_only["model"]["parameters"] == text["model"]["parameters"]
    assert text_only["study"] != text["study"]
    assert text["text_only"] is None and text_only["text_only"]["of"] == "llava"
    assert any(note.startswith("--text-only:") for note in text_only["notes"])
    exported = write_exports(text_only, ["fsdp2"], tmp_path / "export")
    assert exported and "--text-only" in (tmp_path / "export" / "train_fsdp2.py").read_text()


def test_a_text_tower_transformers_has_no_causal_lm_for_is_refused_in_one_line(tmp_path, capsys):
    """Llama 3.2 Vision's language model (mllama_text_model) is neither a causal LM transformers
    builds nor a text tower autotune puts a head on: refused with the flag and without, saying so."""
    AutoConfig.for_model("mllama").save_pretrained(tmp_path / "mllama")
    for flags in ([], ["--text-only"]):
        code = main(["trial", "--model", str(tmp_path / "mllama"), *flags, "--gpus", "2", "--backend", "sim"])
        printed = capsys.readouterr().err
        assert code == EXIT_USAGE and printed.count("\n") == 1 and "mllama_text_model" in printed, printed
        assert "no causal-LM class" in printed


def test_a_headless_text_tower_trains_with_the_head_its_whole_model_has(tmp_path, capsys):
    """qwen2_vl_text: a sim trial runs (a real one measured within 0.0002% of it: docs/MODEL_COVERAGE.md)."""
    path = _save(tmp_path, "qwen2_vl")
    code = main(["trial", "--model", path, "--text-only", "--gpus", "2", "--seq-len", "64", "--backend", "sim"])
    captured = capsys.readouterr()
    assert code == EXIT_OK and json.loads(captured.out)["status"] == "ok", captured.err
