"""--attention (autotune/problem/catalog/attention.py): the attention implementation a problem states, traced, run and
costed as it runs, and refused where it cannot run.

Eager attention runs the same ops on a GPU as on the CPU, so a real gloo trial checks its trace (the shared
launch of 2 gloo ranks, tests/shared_runs.py). flash-attn has no CPU build: a flash trial runs, on CPUs as in
the trace, torch SDPA's flash kernel; the gloo run checks that the trace counts what that run keeps, and
what flash-attn itself keeps (output and log-sum-exp, no scores) is checked against eager's trace of the same
model by a count of the score tensors eager keeps and a flash kernel does not."""

from __future__ import annotations

import pytest
import torch
import transformers

from autotune.backends.sim import SimBackend
from autotune.problem.catalog.gpus import GPUS
from autotune.problem.catalog.models import ModelSpec, resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec
from autotune.problem.packing import Packing
from autotune.util.errors import UsageError
from tests.shared_runs import register
from tests.test_sim_accuracy import assert_tensor_peaks_agree, predict_cpu_runs

SEQ_LEN = 128


def gemma2(folder) -> ModelSpec:
    """A tiny Gemma 2 (logit soft-capping, sliding windows: transformers gives it no SDPA attention), its
    config written by transformers as a user's config.json would be."""
    config = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16, num_hidden_layers=4, vocab_size=512,
                                       sliding_window=32, max_position_embeddings=256, pad_token_id=0)
    path = folder / "gemma2"
    config.save_pretrained(path)
    return resolve_model(str(path))


def _spec(model: ModelSpec, attention: str | None, ac: str = "none", *, mb: int = 2, gpu: str = "h100-80gb",
          precision: str = "bf16", **kwargs) -> TrialSpec:
    return TrialSpec(model=model.with_attention(attention), cluster=Cluster(num_gpus=2, gpu=GPUS[gpu]),
                     seq_len=kwargs.pop("seq_len", SEQ_LEN),
                     train=TrainConfig(micro_batch_size=mb, activation_checkpointing=ac, precision=precision,
                                       **kwargs.pop("train", {})), **kwargs)


MATRIX = [("tiny-llama", "eager", "none"), ("tiny-llama", "eager", "full"), ("gemma2", "flash_attention_2", "none")]


def _real_specs(folder) -> list[TrialSpec]:
    models = {"tiny-llama": resolve_model("tiny-llama"), "gemma2": gemma2(folder)}
    return [_spec(models[name], attention, ac) for name, attention, ac in MATRIX]


register("attention", __name__, _real_specs)


@pytest.fixture(scope="module")
def measured_and_predicted(gloo_runs):
    specs, measured = gloo_runs.run("attention")
    return specs, measured, predict_cpu_runs(specs)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(MATRIX)), ids=["-".join(row) for row in MATRIX])
def test_tensor_peak_matches_a_real_gloo_run(measured_and_predicted, index):
    specs, measured, predicted = measured_and_predicted
    assert specs[index].model.attention_implementation == MATRIX[index][1]
    assert_tensor_peaks_agree(specs[index], measured[index], predicted[index])


@pytest.mark.slow
def test_a_flash_runs_note_says_what_ran(measured_and_predicted):
    """flash-attn is not what a CPU trial runs: its result says so, and what ran instead."""
    specs, measured, _ = measured_and_predicted
    flash = next(r for s, r in zip(specs, measured) if s.model.attention_implementation == "flash_attention_2")
    assert "flash_attention_2 run as torch SDPA's flash kernel" in flash.message, flash.message


def _saved_score_bytes(spec: TrialSpec) -> int:
    """What eager attention keeps for backward of every layer's scores, at the least (batch x heads x seq x seq
    each): the fp32 softmax output (its backward's input) and its bf16 cast (the value product's input)."""
    model = spec.model
    return model.num_layers * spec.train.micro_batch_size * model.num_attention_heads * spec.seq_len ** 2 * (4 + 2)


def test_flash_keeps_no_scores_where_eager_keeps_them(tmp_path):
    """Gemma 2 traced with eager attention (its default) and with flash_attention_2, on a GPU: without
    checkpointing every layer's saved tensors are live at the peak, and eager's exceed flash's by at least
    the score tensors counted by hand; the GPU trace of flash is the CPU flash run's (nothing in it is
    CPU-specific) and names the kernel it stood in for."""
    model = gemma2(tmp_path)
    assert model.default_attention == "eager"
    eager, flash = _spec(model, None), _spec(model, "flash_attention_2")
    with SimBackend(device_kind="cuda", screen=False) as gpu, SimBackend(device_kind="cpu", screen=False) as cpu:
        on_gpu = [gpu.evaluate(spec) for spec in (eager, flash)]
        flash_on_cpu = cpu.evaluate(flash)
    eager_peak, flash_peak = (r.extras["tensor_peak_bytes"] for r in on_gpu)
    assert eager_peak - flash_peak >= _saved_score_bytes(flash), (eager_peak, flash_peak)
    assert flash_peak == flash_on_cpu.extras["tensor_peak_bytes"]
    assert "flash_attention_2 traced as torch SDPA's flash kernel" in on_gpu[1].peak_memory.basis


def test_flash_with_attention_dropout_keeps_what_sdpas_fused_kernel_keeps():
    """Attention dropout 0.1 on an H100: flash-attn applies it inside its kernel, as CUDA's SDPA picks its flash
    kernel for this call; the two GPU traces are the same, and both below the CPU's math kernel's."""
    base = resolve_model("tiny-llama")
    model = ModelSpec(name="tiny-llama-dropout", model_type=base.model_type,
                      config_dict={**base.config_dict, "attention_dropout": 0.1}, default_seq_len=base.default_seq_len,
                      source="tiny-llama with attention dropout 0.1")
    with SimBackend(device_kind="cuda", screen=False) as gpu, SimBackend(device_kind="cpu", screen=False) as cpu:
        sdpa, flash = (gpu.evaluate(_spec(model, a)).extras["tensor_peak_bytes"] for a in (None, "flash_attention_2"))
        math = cpu.evaluate(_spec(model, None)).extras["tensor_peak_bytes"]
    assert sdpa == flash < math


def test_eager_score_bytes_hold_on_another_model():
    """costmodel.EAGER_SCORE_BYTES was counted on micro-llama (head dim 16); recounted here on tiny-qwen2 (head
    dim 64, q/k/v biases) the same way, eager less SDPA at two depths and two lengths: within 3%."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autotune.backends.sim._trace import _op_kind, _tensor_bytes
    from autotune.estimate.costmodel import EAGER_SCORE_BYTES
    from autotune.problem.catalog.models import causal_lm_from_config

    class MemoryBytes(TorchDispatchMode):
        bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if _op_kind(func) == "memory":
                self.bytes += _tensor_bytes(args) + _tensor_bytes(out if isinstance(out, (list, tuple)) else [out])
            return out

    def moved(attention: str, seq: int, layers: int, backward: bool) -> int:
        config = resolve_model("tiny-qwen2").with_attention(attention).hf_config()
        config.num_hidden_layers = layers
        torch.manual_seed(0)
        net = causal_lm_from_config(config, dtype=torch.bfloat16)
        tokens = torch.randint(0, config.vocab_size, (1, seq))
        with MemoryBytes() as mode:
            loss = net(tokens, labels=tokens).loss
            if backward:
                loss.backward()
        return mode.bytes

    heads = resolve_model("tiny-qwen2").num_attention_heads
    for backward, expected in ((True, EAGER_SCORE_BYTES[0]), (False, EAGER_SCORE_BYTES[1])):
        per_score = []
        for seq in (256, 512):
            extra = {layers: moved("eager", seq, layers, backward) - moved("sdpa", seq, layers, backward)
                     for layers in (1, 2)}
            per_score.append((extra[2] - extra[1]) / (heads * seq * seq))
        # a x seq^2 + b x seq per head and layer: a from the two lengths
        a = 2 * per_score[1] - per_score[0]
        assert abs(a - expected) <= 0.03 * expected, (backward, per_score, a)


def test_closed_form_prices_eager_attention_as_the_trace_does():
    """The analytic backend's eager attention (the score products at the matmul rate, EAGER_SCORE_BYTES at the
    HBM rate) against the simulator's, which costs the ops eager attention dispatches in its trace: a model
    where attention is most of the step (seq 4096), within 5%; and eager slower than SDPA in both."""
    from autotune.backends.analytic import AnalyticBackend

    model = resolve_model("qwen2.5-0.5b")
    specs = {a: TrialSpec(model=model.with_attention(a), cluster=Cluster(num_gpus=8), seq_len=4096,
                          train=TrainConfig(micro_batch_size=2, activation_checkpointing="full"))
             for a in ("sdpa", "eager")}
    with SimBackend(device_kind="cuda", screen=False) as sim:
        traced = {a: sim.evaluate(s).tokens_per_sec.value for a, s in specs.items()}
    closed = {a: AnalyticBackend().evaluate(s).tokens_per_sec.value for a, s in specs.items()}
    assert abs(closed["eager"] / traced["eager"] - 1) <= 0.05, (closed, traced)
    assert traced["eager"] < 0.9 * traced["sdpa"] and closed["eager"] < 0.9 * closed["sdpa"]


@pytest.mark.parametrize("attention, change, fragment", [
    ("flash_attention_2", dict(precision="fp32"), "flash kernels run fp16/bf16 only"),
    ("flash_attention_2", dict(gpu="v100-32gb"), "v100-32gb is SM 7.0"),
    ("flash_attention_3", dict(gpu="a100-80gb"), "runs on Hopper (SM 9.0) only"),
    ("eager", dict(stack="torchtitan"), "own SDPA attention"),
    ("eager", dict(packing=Packing()), "--token-budget"),
    ("eager", dict(train=dict(context_parallel=2)), "--cp 2 with --attention eager"),
    ("bogus", {}, "is not one of sdpa, eager, flash_attention_2, flash_attention_3"),
])
def test_what_cannot_run_is_refused_in_one_line(attention, change, fragment):
    with pytest.raises(UsageError) as caught:
        _spec(resolve_model("tiny-llama"), attention, **change)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def test_sdpa_is_refused_where_transformers_has_none_and_head_dims_past_flash(tmp_path):
    with pytest.raises(UsageError, match="no SDPA attention for gemma2"):
        _spec(gemma2(tmp_path), "sdpa")
    base = resolve_model("tiny-llama")
    wide = ModelSpec(name="wide-heads", model_type=base.model_type,
                     config_dict={**base.config_dict, "head_dim": 512}, default_seq_len=128, source="test")
    with pytest.raises(UsageError, match="head dim 512 is over flash-attn's 256"):
        _spec(wide, "flash_attention_2")


def test_the_default_stated_is_the_default_kept():
    """--attention naming the model's default changes nothing (the keys its traces are cached under included);
    another is recorded, and read back."""
    model = resolve_model("tiny-llama")
    assert model.with_attention("sdpa") is model and "attention" not in model.to_dict()
    eager = model.with_attention("eager")
    assert eager.to_dict()["attention"] == "eager" and ModelSpec.from_dict(eager.to_dict()) == eager
    assert eager.hf_config()._attn_implementation == "eager"


def test_cli_takes_attention_and_refuses_what_cannot_run(tmp_path):
    import subprocess
    import sys

    def trial(*flags):
        return subprocess.run([sys.executable, "-m", "autotune", "trial", "--model", "micro-llama", "--gpus", "2",
                               "--seq-len", "64", "--backend", "sim", "--micro-batch", "1", *flags],
                              capture_output=True, text=True, timeout=600, cwd=tmp_path)

    refused = trial("--gpu-type", "a100-80gb", "--attention", "flash_attention_3")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "--attention flash_attention_3: a100-80gb is SM 8.0" in refused.stderr
    ran = trial("--gpu-type", "h100-80gb", "--attention", "eager")
    assert ran.returncode == 0, ran.stderr


def test_a_study_of_one_attention_never_resumes_another():
    """The study name hashes what changes a trial's outcome: the attention stated too (a tune with eager
    attention resumed a default one's trials before it did); the default stated keeps the default's name."""
    from autotune.search.records import TuneRequest
    from autotune.search.store import study_name

    model = resolve_model("tiny-llama")
    names = {a: study_name(TuneRequest(model=model.with_attention(a), cluster=Cluster(num_gpus=2), seq_len=256,
                                       target_tokens=4096), "sim")
             for a in (None, "sdpa", "eager", "flash_attention_2")}
    assert names[None] == names["sdpa"] and len(set(names.values())) == 3


@pytest.mark.parametrize("ac", ["none", "every:2"])
def test_closed_form_counts_what_eager_attention_keeps_as_the_trace_does(ac):
    """The analytic backend's eager memory (analytic.eager_score_memory: the fp32 softmax and its cast saved per
    block, the softmax's fp32 gradient held in backward) against the trace's, on a model it was not read from
    (qwen2.5-0.5b; read from llama-7b's): what eager adds over SDPA within 5%, the peak within 3%."""
    from autotune.backends.analytic import AnalyticBackend

    model = resolve_model("qwen2.5-0.5b")
    specs = {a: TrialSpec(model=model.with_attention(a), cluster=Cluster(num_gpus=8), seq_len=2048,
                          train=TrainConfig(micro_batch_size=2, activation_checkpointing=ac)) for a in ("sdpa", "eager")}
    with SimBackend(device_kind="cuda", screen=False) as sim:
        traced = {a: sim.evaluate(s).extras["tensor_peak_bytes"] for a, s in specs.items()}
    closed = {a: AnalyticBackend().evaluate(s).extras["tensor_peak_bytes"] for a, s in specs.items()}
    added_traced, added_closed = traced["eager"] - traced["sdpa"], closed["eager"] - closed["sdpa"]
    assert added_traced > 0.3 * traced["sdpa"]  # the scores matter here
    assert abs(added_closed / added_traced - 1) <= 0.05, (added_closed, added_traced)
    assert abs(closed["eager"] / traced["eager"] - 1) <= 0.03, (closed, traced)
