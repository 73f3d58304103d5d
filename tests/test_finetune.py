"""Fine-tuning (issue 27): LoRA through the real peft library and pure bf16, against real runs.

The session's shared launch of 2 gloo ranks (tests/shared_runs.py) runs every row for real with the
cpu backend (peft wraps the model before FSDP2, as in the simulator); the simulator predicts each
row's CPU run. Tensor peaks must agree within 1%, and the measured peaks must move the way
fine-tuning says they do (independent of the simulator). Trainable-parameter counts are checked
against peft's own count and against a count of the adapters' shapes made from the plain model.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jsonschema
import pytest
import torch

from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, FineTuning, TrainConfig, TrialSpec
from autotune.distributed.training import build_model, parameter_counts
from tests.shared_runs import register
from tests.test_sim_accuracy import assert_tensor_peaks_agree, predict_cpu_runs

ROOT = Path(__file__).resolve().parent.parent

# (model, checkpointing, precision, peft)
MATRIX = [
    ("tiny-llama", "none", "bf16", "none"),
    ("tiny-llama", "none", "bf16", "lora"),
    ("tiny-llama", "full", "bf16", "lora"),
    ("tiny-qwen2", "none", "bf16", "lora"),
    ("tiny-qwen2", "full", "bf16", "lora"),
    ("tiny-llama", "none", "bf16-pure", "none"),
    ("tiny-llama", "none", "bf16-pure", "lora"),
]
HAS_BITSANDBYTES = importlib.util.find_spec("bitsandbytes") is not None
QLORA_ROWS = [("tiny-llama", "none", "bf16", "qlora"), ("tiny-qwen2", "full", "bf16", "qlora")]
if HAS_BITSANDBYTES:  # QLoRA's 4-bit base runs on bitsandbytes' CPU build (the qlora extra)
    MATRIX += QLORA_ROWS
needs_bitsandbytes = pytest.mark.skipif(not HAS_BITSANDBYTES, reason="bitsandbytes is not installed (the qlora extra)")


def _spec(model: str, ac: str, precision: str, peft: str) -> TrialSpec:
    return TrialSpec(model=resolve_model(model), cluster=Cluster(num_gpus=2), seq_len=128,
                     train=TrainConfig(activation_checkpointing=ac, micro_batch_size=2, precision=precision),
                     finetuning=FineTuning(peft=peft))


register("finetune", __name__, lambda folder: [_spec(*row) for row in MATRIX])


@pytest.fixture(scope="module")
def measured_and_predicted(gloo_runs):
    """7 trials on 2 gloo ranks, 9 with QLoRA's, in the session's shared launch (tests/shared_runs.py)."""
    specs, measured = gloo_runs.run("finetune")
    return specs, measured, predict_cpu_runs(specs)


@pytest.mark.slow
def test_tensor_peaks_match_real_gloo_runs(measured_and_predicted):
    for spec, real, sim in zip(*measured_and_predicted):
        assert_tensor_peaks_agree(spec, real, sim)


@pytest.mark.slow
def test_lora_and_pure_bf16_lower_the_measured_peak(measured_and_predicted):
    """Measured, not predicted: LoRA drops the base's AdamW state and fp32 copy (it adds the
    adapters' activations), pure bf16 halves the parameters and AdamW state, and checkpointing
    still saves activations under LoRA. So a test fails if peft's freezing or the dtypes were not
    applied in the real run."""
    _, measured, _ = measured_and_predicted
    peak = {row: result.extras["tensor_peak_bytes"] for row, result in zip(MATRIX, measured)}
    full = peak[("tiny-llama", "none", "bf16", "none")]
    lora = peak[("tiny-llama", "none", "bf16", "lora")]
    base = parameter_counts(resolve_model("tiny-llama"), FineTuning(peft="lora"))
    per_rank_base = (base.total - base.trainable) / 2
    # At least AdamW's two fp32 states of half the base are gone (the rest of the 10 B per base
    # parameter pays for the adapters' inputs and dropout copies, 12 MB here).
    assert full - lora >= 8 * per_rank_base / 2
    assert peak[("tiny-llama", "full", "bf16", "lora")] < lora
    assert peak[("tiny-qwen2", "full", "bf16", "lora")] < peak[("tiny-qwen2", "none", "bf16", "lora")]
    assert peak[("tiny-llama", "none", "bf16-pure", "none")] < full


@needs_bitsandbytes
@pytest.mark.slow
def test_qlora_lowers_the_measured_peak_by_the_4bit_base(measured_and_predicted):
    """Measured: QLoRA's 4-bit base holds under half a byte per quantized weight (plus statistics)
    where LoRA's holds 2: the real peak falls by at least 1 byte per quantized weight on a rank,
    those weights counted from the plain model's linear layers but the head."""
    _, measured, _ = measured_and_predicted
    peak = {row: result.extras["tensor_peak_bytes"] for row, result in zip(MATRIX, measured)}
    with torch.device("meta"):
        plain = build_model(resolve_model("tiny-llama"))
    head = plain.get_output_embeddings()
    quantized = sum(m.weight.numel() for m in plain.modules() if type(m) is torch.nn.Linear and m is not head)
    lora, qlora = peak[("tiny-llama", "none", "bf16", "lora")], peak[("tiny-llama", "none", "bf16", "qlora")]
    assert lora - qlora >= quantized / 2


@needs_bitsandbytes
def test_the_4bit_base_is_what_transformers_loads_for_fsdp_qlora(tmp_path):
    """The layout QLoRA trains on, checked against transformers' own 4-bit loader with the
    BitsAndBytesConfig of HF's FSDP-QLoRA guide (nf4, double quantization, bf16 storage) on a saved
    checkpoint of the same model: every quantized linear's packed weight and quantization statistics
    have the shapes, dtypes and bytes of autotune's meta build; the trainable and total counts are
    peft's own on the real QLoRA model (peft counts a 4-bit weight by its quantized size)."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    spec, qlora = resolve_model("tiny-llama"), FineTuning(peft="qlora", rank=8)
    AutoModelForCausalLM.from_config(spec.hf_config(num_layers=2), dtype=torch.bfloat16).save_pretrained(tmp_path)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, dtype=torch.bfloat16,
                                                  device_map="cpu")

    def layout(net):
        out = {}
        for name, module in net.named_modules():
            if isinstance(module, bnb.nn.Linear4bit):
                state = module.weight.quant_state
                tensors = (module.weight, state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code)
                out[name.removeprefix("base_model.model.").removesuffix(".base_layer")] = [
                    (tuple(t.shape), t.dtype, t.nbytes) for t in tensors] + [(tuple(state.shape), state.blocksize,
                                                                              state.quant_type)]
        return out

    with torch.device("meta"):
        ours = build_model(spec, num_layers=2, finetuning=qlora)
    assert layout(ours) == layout(loaded) and len(layout(ours)) == 14
    real = build_model(spec, finetuning=qlora)
    counts = parameter_counts(spec, qlora)
    assert (counts.trainable, counts.total) == real.get_nb_trainable_parameters()
    assert counts.trainable == parameter_counts(spec, FineTuning(peft="lora", rank=8)).trainable


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_trainable_parameters_match_peft_and_the_adapter_shapes(model):
    """peft's own count on a real build, and r x (in + out) summed over the plain model's linear
    layers except the output head (peft's all-linear), equal what autotune reports."""
    spec, lora = resolve_model(model), FineTuning(peft="lora", rank=8)
    counts = parameter_counts(spec, lora)
    net = build_model(spec, finetuning=lora)
    trainable, total = net.get_nb_trainable_parameters()
    assert (counts.trainable, counts.total) == (trainable, total)
    with torch.device("meta"):
        plain = build_model(spec)
    head = plain.get_output_embeddings()
    adapters = sum(8 * (m.in_features + m.out_features) for m in plain.modules()
                   if isinstance(m, torch.nn.Linear) and m is not head)
    assert counts.trainable == adapters
    assert counts.total == sum(p.numel() for p in plain.parameters()) + adapters
    # The frozen base is stored in the compute dtype, the adapters in fp32 (mixed precision).
    dtypes = {(p.requires_grad, p.dtype) for p in net.parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}


def test_lora_counts_and_estimates_a_model_whose_layers_alternate(tmp_path):
    """Gemma 2's sliding and full attention alternate (layer period 2), so no 1-layer copy has every
    kind of layer: LoRA's counts are peft's own on the full-depth model, and the analytic backend
    estimates the LoRA trial."""
    from autotune.backends.analytic import AnalyticBackend
    from autotune.problem.catalog.shrink import shrunk_config

    shrunk_config("gemma2", num_layers=4).save_pretrained(tmp_path / "gemma2")
    spec, lora = resolve_model(str(tmp_path / "gemma2")), FineTuning(peft="lora", rank=8)
    assert spec.layer_period == 2
    counts = parameter_counts(spec, lora)
    with torch.device("meta"):
        net = build_model(spec, finetuning=lora)
    assert (counts.trainable, counts.total) == net.get_nb_trainable_parameters()
    result = AnalyticBackend().evaluate(TrialSpec(model=spec, cluster=Cluster(num_gpus=2), seq_len=64,
                                                  train=TrainConfig(), finetuning=lora))
    assert result.status == "ok", result.message


def test_lora_on_fused_experts_trains_without_the_dropout_peft_refuses_there(tmp_path, capsys):
    """tiny-mixtral's experts are fused parameters, which the default targets (all-linear) reach and
    peft adapts without dropout: the tune and the trial run with dropout 0 and say so, and peft
    builds the adapters they report; a dropout given there is a one-line usage error."""
    from autotune.drivers.cli import EXIT_OK, EXIT_USAGE, main

    problem = ["--model", "tiny-mixtral", "--gpus", "2", "--seq-len", "128", "--backend", "analytic", "--peft", "lora"]
    out = tmp_path / "best.json"
    runs = ["--runs-dir", str(tmp_path / "runs"), "--out", str(out)]
    assert main([*problem, "--global-tokens", "8Ki", *runs]) == EXIT_OK
    best = json.loads(out.read_text())
    assert best["finetuning"]["dropout"] == 0
    assert any("dropout 0" in note and "fused experts" in note for note in best["notes"])
    with torch.device("meta"):
        build_model(resolve_model("tiny-mixtral"), finetuning=FineTuning.from_dict(best["finetuning"]))
    capsys.readouterr()
    assert main(["trial", *problem]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["finetuning"]["dropout"] == 0
    assert main(["trial", *problem, "--lora-dropout", "0.1"]) == EXIT_USAGE
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("autotune: error: --lora-dropout 0.1:"), error


def test_a_lora_tune_records_what_trained(tmp_path):
    """The main job with --peft lora: best.json says what trained (valid against the schema), the
    study is not the full fine-tune's, and the winner's trial command asks for the same LoRA."""
    from autotune.drivers.cli import EXIT_OK, main

    schema = json.loads((ROOT / "schemas" / "result.schema.json").read_text())
    runs = tmp_path / "runs"
    base = ["--model", "tiny-llama", "--gpus", "2", "--global-tokens", "16Ki", "--seq-len", "256",
            "--backend", "analytic", "--runs-dir", str(runs)]
    assert main([*base, "--peft", "lora", "--lora-rank", "8", "--out", str(tmp_path / "lora.json")]) == EXIT_OK
    assert main([*base, "--out", str(tmp_path / "full.json")]) == EXIT_OK
    lora, full = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("lora", "full"))
    jsonschema.validate(lora, schema)
    counts = parameter_counts(resolve_model("tiny-llama"), FineTuning(peft="lora", rank=8))
    assert lora["finetuning"] == {"peft": "lora", "rank": 8, "alpha": 32, "dropout": 0.05, "targets": "all-linear",
                                  "trainable_parameters": counts.trainable, "total_parameters": counts.total}
    assert full["finetuning"]["peft"] == "none"
    assert lora["study"] != full["study"]
    assert lora["memory_breakdown"]["optimizer_state"] < full["memory_breakdown"]["optimizer_state"] / 10
    for command in (lora.get("why_winner") or {}).get("decide_with", []):
        assert "--peft lora --lora-rank 8" in command


@pytest.mark.parametrize("ac", ["full", "none"])
def test_activation_offload_moves_what_forward_saves(ac):
    """The simulator's offload hooks (training.OffloadedActivations, run under fake tensors on an
    FSDP2 model of 2 ranks) move exactly the bytes a plain bf16 forward of the same model saves for
    backward, counted here by a hook of the test's own (parameters and tensors under 1 KiB stay,
    torchtune's rule); and the device's predicted peak falls."""
    from autotune.backends.sim import SimBackend
    from autotune.problem.knobs import Checkpointing
    from autotune.problem.catalog.blocks import find_decoder_blocks
    from autotune.distributed.parallel import apply_ac
    from autotune.distributed.training import token_batches

    model = resolve_model("tiny-llama")
    results = {}
    with SimBackend(device_kind="cuda", screen=False) as sim:
        for offload in (False, True):
            spec = TrialSpec(model=model, cluster=Cluster(num_gpus=2), seq_len=512,
                             train=TrainConfig(micro_batch_size=2, activation_checkpointing=ac,
                                               activation_offload=offload))
            results[offload] = sim.evaluate(spec)
    net = build_model(model).to(torch.bfloat16)
    apply_ac(find_decoder_blocks(net), Checkpointing.parse(ac))
    saved = []

    def pack(tensor):
        if not isinstance(tensor, torch.nn.Parameter) and tensor.numel() * tensor.element_size() >= 1024:
            saved.append(tensor.numel() * tensor.element_size())
        return tensor

    tokens = next(token_batches(vocab_size=model.vocab_size, micro_batch_size=2, seq_len=512, device="cpu"))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        net(input_ids=tokens, labels=tokens)
    assert results[True].extras["offloaded_activations"]["moved_bytes"] == sum(saved)
    assert results[True].extras["tensor_peak_bytes"] < results[False].extras["tensor_peak_bytes"]
    assert results[True].host_memory_per_node.value > 2 * sum(saved)  # two ranks' pinned copies, and more
    assert "activation offload copies" in results[True].tokens_per_sec.basis


def test_the_cpu_backend_refuses_activation_offload():
    """On CPUs the host is the device: a real cpu trial would measure the configuration without
    offload under its name, so it is refused before launch with what to do instead."""
    from autotune.backends.real import RealBackend

    spec = TrialSpec(model=resolve_model("micro-llama"), cluster=Cluster(num_gpus=2), seq_len=64,
                     train=TrainConfig(activation_offload=True))
    with RealBackend(device="cpu") as real:
        result = real.evaluate(spec)
    assert result.status == "error" and result.extras["refused"]
    assert "activation offload cannot run on the cpu backend" in result.message and "--backend sim" in result.message


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_reduce_scatter_volume_is_what_fsdp2_reduces(peft):
    """The cost model's reduce-scatter bytes per micro-batch against the bytes FSDP2 itself hands
    to reduce-scatter in a real training step (real tensors, autotune's parallelize, a fake process
    group of 2 ranks, every c10d reduce-scatter input counted): LoRA reduces the adapters'
    gradients only, a full fine-tune every parameter's (FSDP2 pads each to the world size: <1%)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autotune.estimate import costmodel
    from autotune.backends.analytic import trainable_split
    from autotune.backends.sim._fakepg import fake_mesh, release_fake_group
    from autotune.distributed.parallel import ParallelDims, parallelize
    from autotune.distributed.training import make_optimizer, token_batches, train_step

    class ReduceScatterBytes(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "reduce_scatter" in func.__name__:
                tensor = args[1]  # (output shard, unsharded input, ...)
                ReduceScatterBytes.total += tensor.numel() * tensor.element_size()
            return func(*args, **(kwargs or {}))

    spec = _spec("tiny-llama", "none", "bf16", peft)
    counts = parameter_counts(spec.model, spec.finetuning)
    mesh = fake_mesh(ParallelDims.of(spec.train, 2))
    try:
        net = build_model(spec.model, finetuning=spec.finetuning)
        parallelize(net, mesh, spec.train)
        optimizer = make_optimizer(net, impl="foreach")
        batches = token_batches(vocab_size=spec.model.vocab_size, micro_batch_size=1, seq_len=32, device="cpu")
        with ReduceScatterBytes():
            train_step(net, optimizer, batches, grad_accum_steps=1)
    finally:
        release_fake_group()
    volume = costmodel.collective_bytes(block_params=counts.block_total, num_blocks=spec.model.num_layers,
                                        root_params=counts.root_total, param_bytes=2,
                                        trainable=trainable_split(spec))
    counted = ReduceScatterBytes.total
    assert counted > 0 and abs(volume.reduce_scatter_bytes - counted) <= 0.01 * counted, (volume, counted)
    assert (trainable_split(spec) is None) is (peft == "none")
    if peft == "lora":  # the adapters only: a small fraction of what a full fine-tune reduces
        assert counted < 0.2 * 4 * counts.total
