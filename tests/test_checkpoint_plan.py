"""Checkpoint advice: a 70B full state dict gathered on 8 x 80 GB GPUs does not fit, so the
sharded form is recommended and set in the exports; training checkpoints are always sharded (DCP), a
full state dict is advised for the final export where rank 0's host holds it."""

from __future__ import annotations

import json
import runpy
import shlex

import jsonschema
import pytest
import yaml

from autotune.problem.catalog.gpus import GPUS
from autotune.problem.catalog.models import MODELS
from autotune.estimate.checkpoint_plan import ASSUMED_HOST_BYTES, OPTIMIZER_BYTES, PARAM_BYTES, plan_checkpoint
from autotune.results.export import export_result
from autotune.results.result import SCHEMA_PATH

GiB = 2**30
LLAMA_70B_PARAMETERS = 68_976_648_192  # meta-device count of the catalog's llama-70b, as best.json records it
TINY_LLAMA_PARAMETERS = 7_260_416


def make_result(model: str, parameters: int, *, gpus: int, breakdown: dict | None, cpu_offload: bool,
                host_memory_bytes: int | None = None, host_per_node: int | None = None) -> dict:
    """A best.json document as the result builder writes it (validated against the schema)."""
    entry, gpu = MODELS[model], GPUS["h100-80gb"]
    result = {
        "schema_version": 1, "run_id": f"test-{model}", "study": "test",
        "model": {"name": model, "parameters": parameters, "model_type": entry.model_type,
                  "num_layers": entry.config["num_hidden_layers"], "hidden_size": entry.config["hidden_size"],
                  "vocab_size": entry.config["vocab_size"], "config": dict(entry.config)},
        "gpus": gpus, "nodes": 1, "gpu": {"type": gpu.name, "memory_bytes": gpu.memory_bytes},
        "host_memory_bytes": host_memory_bytes, "seq_len": entry.default_seq_len, "micro_batch_size": 1,
        "grad_accum_steps": 4, "global_tokens": gpus * 4 * entry.default_seq_len,
        "global_tokens_target": gpus * 4 * entry.default_seq_len, "precision": "bf16",
        "fsdp": {"param_dtype": "bfloat16", "reduce_dtype": "float32", "activation_checkpointing": "full",
                 "cpu_offload": cpu_offload, "reshard_after_forward": True, "wrap": "LlamaDecoderLayer"},
        "peak_memory_bytes": sum((breakdown or {}).values()) or None, "memory_source": "estimated",
        "memory_breakdown": breakdown or {}, "memory_limit_bytes": int(gpu.memory_bytes * 0.9),
        "host_memory_per_node_bytes": host_per_node, "tokens_per_sec": 1000.0, "throughput_source": "estimated",
        "decision_path": [], "backend": "analytic",
        "provenance": {"tool": "autotune 0.1.0", "torch": "2.13.0", "transformers": "5.23.0",
                       "time": "2026-01-01T00:00:00+00:00"},
    }
    result["checkpoint"] = plan_checkpoint(result)
    jsonschema.validate(result, json.loads(SCHEMA_PATH.read_text()))
    return result


# The analytic backend's breakdown of its llama-70b winner on 8 x h100-80gb (full AC, CPU offload).
OFFLOAD_70B = {"parameters": 2_759_901_184, "gradients": 524_288_000, "optimizer_state": 0,
               "activations": 22_803_382_272, "communication_buffers": 5_133_926_400, "other": 428_023_808,
               "runtime_overhead": 3_488_263_045}


@pytest.fixture(scope="module")
def llama_70b() -> dict:
    return make_result("llama-70b", LLAMA_70B_PARAMETERS, gpus=8, breakdown=OFFLOAD_70B, cpu_offload=True,
                       host_memory_bytes=2 * 2**40, host_per_node=1_129_396_174_848)


def test_70b_full_state_dict_gathered_on_gpus_does_not_fit_so_sharded_is_recommended(llama_70b):
    plan = llama_70b["checkpoint"]
    resident = sum(OFFLOAD_70B[k] for k in ("parameters", "gradients", "optimizer_state", "runtime_overhead"))
    on_gpu = plan["options"]["full_on_gpu"]
    assert on_gpu["device_bytes"]["value"] == resident + PARAM_BYTES * LLAMA_70B_PARAMETERS  # ~263 GiB
    assert not on_gpu["fits_device"]
    assert plan["recommended"] == "sharded" and plan["state_dict_type"] == "SHARDED_STATE_DICT"
    assert "gathered on the GPUs" in plan["reason"]
    sharded = plan["options"]["sharded"]
    assert sharded["device_bytes"]["value"] == resident and sharded["fits_device"]
    # Rank 0's host holding fp32 model + AdamW state: 12 bytes per parameter on top of the run's own.
    full_host = plan["options"]["full_cpu_offload"]["host_rank0_bytes"]["value"]
    assert full_host == 1_129_396_174_848 + (PARAM_BYTES + OPTIMIZER_BYTES) * LLAMA_70B_PARAMETERS
    assert full_host > 1.5 * 2**40 and sharded["host_rank0_bytes"]["value"] < full_host


def test_every_checkpoint_figure_is_labelled_with_a_basis(llama_70b):
    for option in llama_70b["checkpoint"]["options"].values():
        for key in ("device_bytes", "host_rank0_bytes"):
            assert option[key]["source"] in ("estimated", "predicted")
            assert option[key]["basis"]


def test_exports_set_the_recommended_sharded_state_dict(llama_70b, tmp_path):
    accelerate = yaml.safe_load(export_result(llama_70b, "accelerate").text)
    assert accelerate["fsdp_config"]["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    trainer = yaml.safe_load(export_result(llama_70b, "hf-trainer").text)
    assert trainer["fsdp_config"]["state_dict_type"] == "SHARDED_STATE_DICT"
    lightning = tmp_path / "lightning_fsdp2.py"
    lightning.write_text(export_result(llama_70b, "lightning").text)
    assert runpy.run_path(str(lightning))["make_strategy"]()._save_distributed_checkpoint is True
    lightning_fsdp1 = tmp_path / "lightning_fsdp1.py"
    lightning_fsdp1.write_text(export_result(llama_70b, "lightning-fsdp1").text)
    assert runpy.run_path(str(lightning_fsdp1))["make_strategy"]()._state_dict_type == "sharded"
    words = shlex.split(export_result(llama_70b, "llama-cookbook").text.replace("\\\n", " "), comments=True)
    assert words[words.index("--checkpoint_type") + 1] == "StateDictType.SHARDED_STATE_DICT"


def test_tiny_model_saves_sharded_periodically_and_full_for_the_final_export():
    tiny = make_result("tiny-llama", TINY_LLAMA_PARAMETERS, gpus=2, cpu_offload=False,
                       breakdown={"parameters": 13_000_000, "gradients": 13_000_000, "optimizer_state": 26_000_000,
                                  "activations": 400_000_000, "runtime_overhead": 1_000_000_000})
    plan = tiny["checkpoint"]
    # FSDP2 practice: training checkpoints sharded (DCP) even where a full one fits; full for the final export.
    assert plan["recommended"] == "sharded" and plan["state_dict_type"] == "SHARDED_STATE_DICT"
    assert plan["periodic"]["form"] == "sharded" and plan["final_export"]["form"] == "full"
    assert "full_state_dict=True, cpu_offload=True" in plan["final_export"]["how"]
    assert all(option["fits"] for option in plan["options"].values())
    assert plan["host_capacity_assumed"] and plan["host_capacity_bytes"] == ASSUMED_HOST_BYTES
    assert yaml.safe_load(export_result(tiny, "accelerate").text)["fsdp_config"]["fsdp_state_dict_type"] == \
        "SHARDED_STATE_DICT"


def test_a_small_host_alone_makes_the_sharded_form_recommended():
    small_host = make_result("tiny-llama", TINY_LLAMA_PARAMETERS, gpus=2, cpu_offload=False, breakdown=None,
                             host_memory_bytes=40 * 2**20)
    plan = small_host["checkpoint"]
    assert plan["options"]["full_on_gpu"]["fits_device"]  # the GPUs would cope
    assert not plan["options"]["full_cpu_offload"]["fits_host"]  # 12 B/param (87 MB) > 40 MiB
    assert plan["recommended"] == "sharded" and "host" in plan["reason"]
    # The final export needs the weights alone (4 B/param: 29 MB), which rank 0's 40 MiB host holds.
    assert 4 * TINY_LLAMA_PARAMETERS <= 40 * 2**20 and plan["final_export"]["form"] == "full"
    # Without a breakdown, the resident model state is fp32 params + grads + AdamW over the world size.
    assert plan["options"]["sharded"]["device_bytes"]["value"] == 16 * TINY_LLAMA_PARAMETERS // 2
