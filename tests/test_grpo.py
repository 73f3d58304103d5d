"""TRL GRPO with vLLM colocated (`--workload grpo`): vLLM's share comes off the memory limit, the
weight sync to vLLM is traced and part of the peak, and the trl export is a GRPOConfig that TRL's
own parser accepts with the tuned values."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml

from autotune.backends.sim import SimBackend
from autotune.problem.catalog.models import resolve_model
from autotune.drivers.cli import EXIT_USAGE, main
from autotune.problem.config import Cluster, TrainConfig, TrialSpec, Workload
from autotune.search.records import TuneRequest
from autotune.results.export import export_result

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "schemas" / "result.schema.json").read_text())
GRPO = Workload(kind="grpo", vllm_gpu_memory_utilization=0.3)


def _spec(model, *, gpus: int = 2, seq_len: int = 64, workload: Workload = GRPO, **train) -> TrialSpec:
    model = resolve_model(model) if isinstance(model, str) else model
    return TrialSpec(model=model, cluster=Cluster(num_gpus=gpus), seq_len=seq_len, train=TrainConfig(**train),
                     workload=workload)


def _tune(tmp_path: Path, *args: str) -> dict:
    runs = tmp_path / "runs"
    assert main(["--runs-dir", str(runs), *args]) == 0
    (best,) = runs.glob("*/best.json")
    return json.loads(best.read_text())


@pytest.fixture(scope="module")
def grpo_result(tmp_path_factory) -> dict:
    """best.json of a simulated GRPO tune of the smallest model."""
    return _tune(tmp_path_factory.mktemp("grpo"), "--model", "micro-llama", "--gpus", "2", "--global-tokens", "16K",
                 "--backend", "sim", "--workload", "grpo", "--vllm-gpu-memory-utilization", "0.4")


# -- the limit -------------------------------------------------------------------------------------
def test_grpo_limit_is_smaller_by_vllms_share_of_total_memory():
    model = resolve_model("tiny-llama")
    cluster = Cluster(num_gpus=8, gpu_memory_bytes=80 * 2**30)
    sft = TuneRequest(model=model, cluster=cluster, seq_len=256, target_tokens=1 << 20, headroom=0.1)
    grpo = dataclasses.replace(sft, workload=GRPO)
    # vLLM takes 0.3 of the 80 GiB (vLLM's gpu_memory_utilization is of total memory), then 10% headroom.
    assert grpo.memory_limit_bytes == int((80 * 2**30 - int(0.3 * 80 * 2**30)) * 0.9)
    assert sft.memory_limit_bytes - grpo.memory_limit_bytes == pytest.approx(0.3 * 80 * 2**30 * 0.9, abs=2)
    assert grpo.spec(TrainConfig()).limit_bytes == grpo.memory_limit_bytes
    assert grpo.spec(TrainConfig()).workload == GRPO


def test_grpo_tune_records_the_workload_and_the_smaller_limit(tmp_path):
    common = ["--model", "tiny-llama", "--gpus", "2", "--global-tokens", "64K", "--backend", "analytic"]
    sft = _tune(tmp_path / "sft", *common)
    grpo = _tune(tmp_path / "grpo", *common, "--workload", "grpo", "--vllm-gpu-memory-utilization", "0.3")
    jsonschema.validate(grpo, SCHEMA)
    capacity = grpo["gpu"]["memory_bytes"]
    assert sft["workload"] == {"kind": "sft", "vllm_gpu_memory_utilization": None}
    assert grpo["workload"]["kind"] == "grpo" and grpo["workload"]["vllm_gpu_memory_utilization"] == 0.3
    assert grpo["workload"]["vllm_share"]["chosen_by"] == "user"
    assert grpo["workload"]["vllm_memory_bytes"] == int(capacity * 0.3)
    assert grpo["study"] != sft["study"]  # a GRPO problem never resumes the SFT study's trials


def test_bad_utilisation_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "autotune", "--model", "tiny-llama", "--gpus", "2",
                           "--global-tokens", "64K", "--workload", "grpo", "--vllm-gpu-memory-utilization", "1.5",
                           "--runs-dir", str(tmp_path / "runs")], capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_USAGE
    assert done.stderr.count("\n") == 1 and "--vllm-gpu-memory-utilization 1.5" in done.stderr
    assert not (tmp_path / "runs").exists()


# -- the weight sync -----------------------------------------------------------------------------
def _full_parameter_bytes(model_name: str) -> list[int]:
    """fp32 bytes of every parameter in named_parameters() order, from the real model built on the
    meta device (what TRL walks when it syncs weights)."""
    from transformers import AutoModelForCausalLM

    spec = resolve_model(model_name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)
    return [p.numel() * 4 for _, p in model.named_parameters()]


def test_sync_peak_holds_two_consecutive_full_parameters_over_the_sharded_state(cpu_sim):
    gpus = 2
    result = cpu_sim.evaluate(_spec("tiny-llama", gpus=gpus, activation_checkpointing="full"))
    assert result.status == "ok", result.message
    sync = result.extras["weight_sync"]
    full = _full_parameter_bytes("tiny-llama")
    # Counted independently: each rank keeps its fp32 shard and AdamW's two fp32 moments (12 B per
    # parameter / ranks); TRL's loop holds the previous full parameter while gathering the next.
    resident = 12 * sum(full) // 4 // gpus
    pair = max(a + b for a, b in zip([0, *full], full))
    assert sync["peak_bytes"] >= max(full)
    assert resident + pair <= sync["peak_bytes"] <= (resident + pair) * 1.01
    assert sync["source"] == "predicted" and "full_tensor()" in sync["how"]
    # The step itself is what an SFT prediction of the same configuration traces.
    sft = cpu_sim.evaluate(_spec("tiny-llama", gpus=gpus, activation_checkpointing="full", workload=Workload()))
    assert "weight_sync" not in sft.extras
    assert sync["training_peak_bytes"] == sft.extras["tensor_peak_bytes"]
    assert result.extras["tensor_peak_bytes"] == max(sync["peak_bytes"], sync["training_peak_bytes"])
    assert "weight sync to vLLM" in result.message


def test_sync_peak_is_extrapolated_exactly_in_depth(cpu_sim, cpu_sim_whole):
    # The largest gather (a 32000 x 64 embedding) does not grow with depth; what is resident does.
    base = resolve_model("micro-llama")
    deep = dataclasses.replace(base, config_dict={**base.config_dict, "num_hidden_layers": 8, "vocab_size": 32000})
    spec = _spec(deep, gpus=8, seq_len=16, activation_checkpointing="full")
    shallow = cpu_sim.evaluate(spec)
    assert shallow.extras["traced_layers"] == [3, 4]
    full = cpu_sim_whole.evaluate(spec)
    assert shallow.extras["weight_sync"] == full.extras["weight_sync"]
    assert shallow.extras["tensor_peak_bytes"] == full.extras["tensor_peak_bytes"]


def test_the_larger_of_step_and_sync_is_named_as_the_peak():
    from autotune.backends.sim._backend import _weight_sync

    step_site, sync_site = ("bw", "post_bw", "root", 8), ("sync", "model.embed_tokens.weight", "root", 3)
    sites = {step_site: {"ACT": 100}, sync_site: {"UNSHARDED_PARAM": 150}}
    sync = _weight_sync(sites, peak_key=sync_site)
    assert sync["dominates"] and sync["peak_bytes"] == 150 and sync["training_peak_bytes"] == 100
    assert sync["basis"].startswith("the weight sync to vLLM dominates")
    sites[step_site] = {"ACT": 200}
    assert not _weight_sync(sites, peak_key=step_site)["dominates"]


def test_sim_cache_never_answers_grpo_with_an_sft_prediction(tmp_path, monkeypatch):
    monkeypatch.delenv("AUTOTUNE_CACHE", raising=False)
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    sim = SimBackend(device_kind="cpu")
    try:
        sft = _spec("micro-llama", workload=Workload())
        limit = dict(memory_limit_bytes=2**30)
        sim.evaluate(dataclasses.replace(sft, **limit))
        grpo = sim.evaluate(dataclasses.replace(sft, workload=GRPO, **limit))
        again = sim.evaluate(dataclasses.replace(sft, workload=GRPO, **limit))
    finally:
        sim.close()
    assert "cache" not in grpo.extras and "weight_sync" in grpo.extras
    assert again.extras["cache"].startswith("hit") and again.extras["weight_sync"] == grpo.extras["weight_sync"]


# -- best.json and the TRL export ------------------------------------------------------------------
def test_simulated_grpo_result_records_the_sync(grpo_result):
    jsonschema.validate(grpo_result, SCHEMA)
    workload = grpo_result["workload"]
    assert workload["vllm_gpu_memory_utilization"] == 0.4 and workload["vllm_mode"] == "colocate"
    assert workload["weight_sync"]["source"] == "predicted"
    assert grpo_result["peak_memory_bytes"] <= grpo_result["memory_limit_bytes"]
    assert "weight sync to vLLM" in grpo_result["memory_basis"]


def _grpo_args(path: Path):
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install trl)")
    from transformers import HfArgumentParser

    fields = yaml.safe_load(path.read_text())
    fields["use_cpu"] = True  # no GPU here; bf16 on CPU needs it
    (args,) = HfArgumentParser(trl.GRPOConfig).parse_dict(fields)  # unknown keys raise
    return args, fields


def test_trl_export_is_a_grpo_config_with_the_tuned_values(grpo_result, tmp_path):
    result = copy.deepcopy(grpo_result)
    result["fsdp"].update(activation_checkpointing="full", cpu_offload=True, reshard_after_forward=False)
    exported = export_result(result, "trl")
    assert exported.filename == "trl_grpo.yaml" and "GRPOConfig" in exported.target
    path = tmp_path / exported.filename
    path.write_text(exported.text)
    args, fields = _grpo_args(path)
    assert args.use_vllm is True and args.vllm_mode == "colocate"
    assert args.vllm_gpu_memory_utilization == result["workload"]["vllm_gpu_memory_utilization"]
    assert args.per_device_train_batch_size == result["micro_batch_size"]
    assert args.gradient_accumulation_steps == result["grad_accum_steps"]
    assert args.bf16 == (result["precision"] == "bf16") and args.optim == "adamw_torch_fused"
    assert args.beta == 0.0 and args.vllm_enable_sleep_mode is False  # what the prediction assumed
    assert args.vllm_max_model_length == result["seq_len"]
    assert args.max_completion_length == result["workload"]["max_completion_length"] < result["seq_len"]
    assert (result["micro_batch_size"] * result["gpus"] * result["grad_accum_steps"]) % args.num_generations == 0
    plugin = args.fsdp_plugin_args
    assert plugin["fsdp_version"] == 2 and plugin["reshard_after_forward"] is False
    assert plugin["activation_checkpointing"] is True and args.gradient_checkpointing is False
    assert args.fsdp_config["cpu_offload"] is True
    # TRL's parser is strict: a key GRPOConfig lacks is refused (so the keys above are all real).
    with pytest.raises(ValueError):
        from transformers import HfArgumentParser
        import trl

        HfArgumentParser(trl.GRPOConfig).parse_dict({**fields, "vllm_colocate_share": 0.4})
    assert any("reference model" in w for w in exported.warnings)
    assert any("KV cache" in w for w in exported.warnings)


def test_other_formats_say_they_run_without_vllm_and_sft_keeps_sftconfig(grpo_result):
    accelerate = export_result(grpo_result, "accelerate")
    assert any("without vLLM" in w for w in accelerate.warnings)
    assert "Workload: TRL GRPO" in accelerate.text
    sft = copy.deepcopy(grpo_result)
    sft["workload"] = {"kind": "sft", "vllm_gpu_memory_utilization": None}
    assert export_result(sft, "trl").filename == "trl_sft.yaml"
    del sft["workload"]  # a result written before the workload existed is an SFT one
    assert export_result(sft, "trl").filename == "trl_sft.yaml"


def test_grpo_every_k_uses_fsdps_checkpointing_because_trl_drops_every_n_layers(grpo_result, tmp_path):
    """every:K for GRPO: TRL 1.16's GRPOTrainer wraps its no-grad log-probability forward in
    trl.models.utils.disable_gradient_checkpointing, which turns the model's checkpointing back on
    without every_n_layers. Shown here with TRL's own context manager on a model set up as the
    Trainer sets it up; the export therefore uses FSDP's checkpointing of every block (which TRL
    does not touch) and says why, instead of the model-level route the SFT export takes."""
    trl_utils = pytest.importorskip("trl.models.utils", reason="trl is not installed")
    from autotune.problem.knobs import Checkpointing
    from autotune.distributed.training import build_model

    result = copy.deepcopy(grpo_result)
    result["fsdp"]["activation_checkpointing"] = "every:2"
    exported = export_result(result, "trl")
    path = tmp_path / exported.filename
    path.write_text(exported.text)
    args, _ = _grpo_args(path)

    def checkpointed(model) -> list[int]:
        return [i for i, layer in enumerate(model.model.layers) if layer.gradient_checkpointing]

    # The model-level route (what the SFT export writes): the tuned blocks until TRL's first
    # generation step, then every block.
    with torch.device("meta"):
        model = build_model(resolve_model("micro-llama"))
    kwargs = {"every_n_layers": 2, "use_reentrant": False}
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=2)
    tuned = Checkpointing.parse("every:2").blocks(len(model.model.layers))
    assert set(checkpointed(model)) == tuned
    with trl_utils.disable_gradient_checkpointing(model, kwargs):  # as GRPOTrainer passes its args' kwargs
        pass
    assert checkpointed(model) == list(range(len(model.model.layers))) != sorted(tuned)
    # The export: no model-level checkpointing for TRL to re-enable; FSDP's own, every block, warned.
    assert args.gradient_checkpointing is False and args.activation_checkpointing is False
    assert args.fsdp_plugin_args["activation_checkpointing"] is True
    warning = next(w for w in exported.warnings if w.startswith("activation_checkpointing: approximated"))
    assert "disable_gradient_checkpointing" in warning and "every_n_layers" in warning
    sft = copy.deepcopy(result)
    sft["workload"] = {"kind": "sft", "vllm_gpu_memory_utilization": None}
    assert "every_n_layers=2" in {m.knob: m.key for m in export_result(sft, "trl").mappings}["activation_checkpointing"]


# -- vLLM's share: its need, estimated, and the share a tune chooses --------------------------------
def test_kv_bytes_per_token_is_what_the_models_own_cache_holds():
    """Against transformers' own KV cache: a real forward with use_cache of a GQA model whose head_dim
    is not hidden/heads (llama3-8b's 8 KV heads of 128 on a narrow hidden size), in bf16 as vLLM keeps it."""
    from transformers import AutoModelForCausalLM

    from autotune.problem.catalog.models import ModelSpec
    from autotune.estimate.vllm_share import kv_bytes_per_token

    base = resolve_model("micro-llama")
    config = {**base.config_dict, "hidden_size": 64, "num_attention_heads": 32, "num_key_value_heads": 8,
              "head_dim": 128, "num_hidden_layers": 3}
    spec = dataclasses.replace(base, config_dict=config)
    assert isinstance(spec, ModelSpec)
    model = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.bfloat16)
    tokens = 5
    with torch.no_grad():
        cache = model(torch.zeros(1, tokens, dtype=torch.long), use_cache=True).past_key_values
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert kv_bytes_per_token(spec) == held // tokens
    # Llama 3 8B: 128 KiB a token in bf16, the figure vLLM's and NVIDIA's sizing guides publish.
    assert kv_bytes_per_token(resolve_model("llama3-8b")) == 128 * 1024


def test_vllms_weights_are_the_whole_model_in_bf16():
    need = __import__("autotune.estimate.vllm_share", fromlist=["vllm_need"]).vllm_need(
        resolve_model("tiny-llama"), seq_len=256, sequences=4)
    assert need.weights_bytes == sum(_full_parameter_bytes("tiny-llama")) // 2  # fp32 bytes / 2
    assert need.to_dict()["source"] == "estimated"


def test_unfixed_share_is_the_smallest_that_holds_the_need_and_the_trl_export_writes_it(tmp_path):
    from autotune.util.units import parse_bytes

    result = _tune(tmp_path, "--model", "micro-llama", "--gpus", "2", "--global-tokens", "16Ki", "--backend",
                   "analytic", "--workload", "grpo", "--gpu-memory", "8GiB", "--seq-len", "512",
                   "--max-completion-length", "128")
    jsonschema.validate(result, SCHEMA)
    workload = result["workload"]
    share, record = workload["vllm_gpu_memory_utilization"], workload["vllm_share"]
    capacity, need = parse_bytes("8GiB"), record["need"]
    assert record["chosen_by"] == "autotune" and need["source"] == "estimated"
    assert share * capacity >= need["total_bytes"] > (share - 0.05) * capacity  # the smallest on the grid
    assert record["concurrent_sequences"] == need["sequences"]
    assert any(n.startswith(f"vLLM's share {share:g} (chosen by autotune") for n in result["notes"])
    # TRL generates micro-batch x steps_per_generation sequences a GPU at once (its max_num_seqs); read
    # from TRL's own GRPOConfig parsed from the export: the need held at least that many.
    exported = export_result(result, "trl")
    path = tmp_path / exported.filename
    path.write_text(exported.text)
    args, _ = _grpo_args(path)
    assert args.vllm_gpu_memory_utilization == share and args.max_completion_length == 128
    assert need["sequences"] >= args.per_device_train_batch_size * args.steps_per_generation
    assert need["tokens_per_sequence"] == args.vllm_max_model_length == 512
    assert any("generation throughput is not modelled" in w for w in exported.warnings)


def test_user_num_generations_is_exported_or_refused(grpo_result):
    from autotune.results.export import ExportRefused

    result = copy.deepcopy(grpo_result)
    batch = result["micro_batch_size"] * result["gpus"] * result["grad_accum_steps"]
    result["workload"]["num_generations"] = 2
    assert "num_generations: 2" in export_result(result, "trl").text
    result["workload"]["num_generations"] = batch + 1
    with pytest.raises(ExportRefused, match="does not divide"):
        export_result(result, "trl")
