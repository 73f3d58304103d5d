"""`--stack`: the step each stack runs, predicted and checked against real runs (docs/STACKS.md).

Two checks, independent of each other:
- the simulator's tensor peak for `--stack hf-trainer` and `--stack trl` equals a real 2-rank gloo
  run of the same step (training.prepare_step + micro_batch_loss under autotune's FSDP2 wrapping),
  within 1%, in the session's shared launch (tests/shared_runs.py);
- that step is the stack's own: on one rank without FSDP (Accelerate and TRL refuse FSDP on CPUs),
  the peak of transformers' `Trainer.training_step` and of TRL's `SFTTrainer.training_step`,
  measured with torch's MemTracker (the tracker the cpu backend's peak comes from), equals the
  peak of our step on the same model and batch within 1%.
"""

from __future__ import annotations

import dataclasses

import pytest

from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec
from tests.shared_runs import register
from tests.test_sim_accuracy import assert_tensor_peaks_agree, predict_cpu_runs

# (stack, micro-batch, checkpointing)
MATRIX = [("hf-trainer", 2, "none"), ("trl", 2, "none"), ("trl", 3, "full"), ("trl-padding-free", 2, "none")]


def _spec(stack: str, mb: int, ac: str) -> TrialSpec:
    return TrialSpec(model=resolve_model("tiny-llama"), cluster=Cluster(num_gpus=2), seq_len=256,
                     train=TrainConfig(micro_batch_size=mb, activation_checkpointing=ac), stack=stack)


register("stacks", __name__, lambda folder: [_spec(*row) for row in MATRIX])


@pytest.fixture(scope="module")
def measured_and_predicted(gloo_runs):
    specs, measured = gloo_runs.run("stacks")
    return specs, measured, predict_cpu_runs(specs)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(MATRIX)), ids=["-".join(map(str, row)) for row in MATRIX])
def test_a_stacks_step_matches_a_real_gloo_run(measured_and_predicted, index):
    specs, measured, predicted = measured_and_predicted
    assert_tensor_peaks_agree(specs[index], measured[index], predicted[index])


@pytest.mark.slow
def test_trls_fused_head_changes_the_measured_peak(measured_and_predicted):
    """Measured: on CPUs TRL folds each logits tile with torch ops over fp32 copies of the tile (a
    GPU does it in a Triton kernel, in place), so its CPU step holds more than Accelerate's."""
    specs, measured, _ = measured_and_predicted
    peak = {(s.stack, s.train.micro_batch_size): r.extras["tensor_peak_bytes"] for s, r in zip(specs, measured)}
    assert peak[("trl", 2)] > peak[("hf-trainer", 2)]
    # Padding-free rows of the same tokens: SDPA's block-diagonal mask (measured 241,291,086 B vs 238,828,794 B).
    assert peak[("trl-padding-free", 2)] > peak[("trl", 2)]


def _peak_of(step, model) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        step()
    return max(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())


def _our_step_peak(step: str, tokens) -> int:
    from autotune.distributed.training import build_model, micro_batch_loss, prepare_step

    model = build_model(resolve_model("tiny-llama"), num_layers=1, precision="bf16", step=step)
    prepare_step(model, step=step, precision="bf16", device_type="cpu")
    return _peak_of(lambda: micro_batch_loss(model, tokens, step=step).backward(), model)


@pytest.fixture(scope="module")
def tokens():
    from autotune.backends.real._cpu_bf16 import compute_bf16_kernels_in_fp32
    from autotune.distributed.training import token_batches

    compute_bf16_kernels_in_fp32()  # as CPU trials run bf16 products; the tensors are the same
    return next(token_batches(vocab_size=8000, micro_batch_size=2, seq_len=96, device="cpu"))


def test_the_hf_step_is_trainers_own_training_step(tokens, tmp_path):
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    from autotune.distributed.training import build_model

    model = build_model(resolve_model("tiny-llama"), num_layers=1, precision="bf16")
    args = TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True, report_to=[])
    trainer = Trainer(model=model, args=args)
    prepared = trainer.accelerator.prepare_model(model)  # autocast + convert_outputs_to_fp32, as in train()
    assert trainer.accelerator.native_amp
    trainer.current_gradient_accumulation_steps = 1  # what train() sets before its first step
    theirs = _peak_of(lambda: trainer.training_step(prepared, {"input_ids": tokens, "labels": tokens}), prepared)
    ours = _our_step_peak("hf", tokens)
    assert ours == pytest.approx(theirs, rel=0.01), (ours, theirs)


def tiny_tokenizer():
    """A word-level tokenizer with pad and eos tokens: all SFTTrainer needs of one here."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                   pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module")
def sft_trainer(tokens, tmp_path_factory):
    """TRL's own SFTTrainer on tiny-llama with one block, as the trl export configures it: packing
    with TRL's default strategy (bfd), which makes its collator padding-free; and its model prepared
    by Accelerate as train() prepares it."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from autotune.distributed.training import build_model

    tokenizer = tiny_tokenizer()
    model = build_model(resolve_model("tiny-llama"), num_layers=1, precision="bf16")  # SFTTrainer adds its head
    seq = tokens.shape[1]
    args = SFTConfig(output_dir=str(tmp_path_factory.mktemp("sft")), bf16=True, use_cpu=True, report_to=[],
                     max_length=seq, packing=True)
    data = Dataset.from_dict({"input_ids": [list(range(3, 3 + seq))] * 2})
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.prepared = trainer.accelerator.prepare_model(trainer.model)
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _trl_peak(trainer, inputs: dict) -> int:
    """The peak of one SFTTrainer.training_step on `inputs` (from no gradients, as the first step)."""
    try:
        return _peak_of(lambda: trainer.training_step(trainer.prepared, dict(inputs)), trainer.prepared)
    finally:
        trainer.prepared.zero_grad(set_to_none=True)


def test_the_trl_step_is_sft_trainers_own_training_step(sft_trainer, tokens):
    """Rows of one sequence each (the `trl` step: what packing_strategy 'wrapped' gives the model)."""
    import torch

    inputs = {"input_ids": tokens, "labels": tokens, "attention_mask": torch.ones_like(tokens)}
    theirs = _trl_peak(sft_trainer, inputs)
    ours = _our_step_peak("trl", tokens)
    assert ours == pytest.approx(theirs, rel=0.01), (ours, theirs)


def test_the_padding_free_step_is_sft_trainers_own_on_its_collators_batch(sft_trainer, tokens):
    """`trl-padding-free`: packing (bfd) turns SFTTrainer's collator padding-free; the batch it makes of
    the same rows (two documents each) equals training.padding_free_batch's, and the peak of TRL's own
    training_step on it equals our step's: measured 94,043,320 B vs 94,041,780 B (ours also counts the
    labels it builds, 1,536 B), against 93,617,764 B for the rows as they are (the trl step): SDPA's
    block-diagonal mask in every block (the shared launch's runs show the same difference on 2 ranks)."""
    import torch

    from autotune.distributed.training import padding_free_batch

    assert sft_trainer.padding_free and sft_trainer.data_collator.padding_free
    seq = tokens.shape[1]
    batch = sft_trainer.data_collator([{"input_ids": row.tolist(), "seq_lengths": [seq - seq // 2, seq // 2]}
                                       for row in tokens])
    ours = padding_free_batch(tokens)
    assert set(batch) == set(ours)
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == ours[key].dtype and torch.equal(value, ours[key]), key
        else:
            assert value == ours[key], key
    theirs = _trl_peak(sft_trainer, batch)
    ours = _our_step_peak("trl-padding-free", tokens)
    assert ours == pytest.approx(theirs, rel=0.01), (ours, theirs)


def test_the_stack_is_part_of_what_a_trial_is():
    """Serialised with the spec (trial workers get it) and checked: a bad name is a one-line error."""
    from autotune.problem.config import TrialSpec as Spec
    from autotune.util.errors import UsageError

    spec = _spec("trl", 2, "none")
    assert Spec.from_dict(spec.to_dict()).stack == "trl"
    assert Spec.from_dict({k: v for k, v in spec.to_dict().items() if k != "stack"}).stack == "fsdp2"
    assert dataclasses.replace(spec, stack="accelerate").step == "hf"
    assert dataclasses.replace(spec, stack="accelerate", train=TrainConfig(precision="fp32")).step == "autotune"
    with pytest.raises(UsageError, match="--stack 'deepspeed' is not one of"):
        dataclasses.replace(spec, stack="deepspeed")


@pytest.mark.parametrize("stack", ["torchtitan", "litgpt"])
def test_an_own_step_study_does_not_resume_one_run_without_the_stacks_step(monkeypatch, stack):
    """Whether torchtitan (LitGPT) is importable decides the step a `--stack torchtitan` (`litgpt`) trial ran
    (its own, or autotune's on the Hugging Face model): studies of the two never share trials. The step is
    looked up as the tune looks it up (config.stack_step), once with the stack's package hidden."""
    import importlib.machinery
    import importlib.util

    from autotune.problem import config
    from autotune.search.records import TuneRequest
    from autotune.search.store import study_name

    request = TuneRequest(model=resolve_model("tiny-llama"), cluster=Cluster(num_gpus=2), seq_len=256,
                          target_tokens=4096, stack=stack)
    find_spec = importlib.util.find_spec
    steps, names = [], []
    for importable in (True, False):  # as where the stack is installed, and where it is not
        spec = importlib.machinery.ModuleSpec(stack, None) if importable else None
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, spec=spec: spec if name == stack else find_spec(name, *a))
        steps.append(config.stack_step(stack, "bf16", "llama"))
        names.append(study_name(request, "sim"))
    assert steps == [stack, "autotune"]
    assert names[0] != names[1]
    plain = study_name(dataclasses.replace(request, stack="fsdp2"), "sim")
    assert plain not in names


def test_a_bad_stack_is_one_line_exit_2_from_the_cli_and_the_same_error_from_the_library(capsys):
    from autotune.drivers.cli import main
    from autotune.util.errors import UsageError
    from autotune.problem.options import tune_options

    assert main(["trial", "--model", "tiny-llama", "--gpus", "2", "--backend", "analytic", "--stack", "deepspeed"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--stack" in err[0] and "'deepspeed'" in err[0], err
    with pytest.raises(UsageError, match="--stack.*'deepspeed'"):
        tune_options(model="tiny-llama", stack="deepspeed")
    assert tune_options(model="tiny-llama", stack="trl").stack == "trl"


def test_the_trial_command_predicts_the_stacks_step_and_says_which(capsys):
    """The analytic backend's closed form knows TRL's head: for llama3-8b (128,256-entry vocabulary) far
    less than autotune's loop's full logits at the same knobs; torchtitan's own model is not traced
    where torchtitan is not importable (this environment: it has its own), and the note says why."""
    import json

    from autotune.drivers.cli import main
    from autotune.problem.config import OWN_STEPS

    if any(own.importable() for own in OWN_STEPS.values()):
        pytest.skip("torchtitan or litgpt is importable here: its own step is predicted (tests below)")

    peaks = {}
    for stack in ("fsdp2", "trl", "litgpt", "torchtitan"):
        assert main(["trial", "--model", "llama3-8b", "--gpus", "8", "--gpu-type", "h100-80gb", "--backend", "analytic",
                     "--micro-batch", "2", "--ac", "full", "--stack", stack]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["stack"]["name"] == stack
        peaks[stack] = out["extras"]["tensor_peak_bytes"]
    assert peaks["trl"] < peaks["fsdp2"] == peaks["torchtitan"] == peaks["litgpt"]
    assert out["stack"]["step"] == "autotune"
    assert "not traced (torchtitan is not importable here)" in out["stack"]["predicted_for"]


def _torchtitan_bench():
    from tests.benchmarks import load_benchmark

    return load_benchmark("bench_torchtitan_step")


@pytest.mark.slow  # real gloo ranks (forked, not torchrun): 15 s of CPU, 55 s wall at load 14 on the 2-core VM
def test_torchtitans_own_step_matches_a_real_gloo_run_of_it(tmp_path, monkeypatch):
    """--stack torchtitan traces torchtitan 0.3's own llama3 model, FSDP units and chunked loss (autotune/distributed/titan.py):
    its predicted tensor peak against a real 2-rank gloo run of the same step in torchtitan's own environment
    (.venv-torchtitan, the cpu backend's run_trial on two forked ranks), tiny-llama at micro-batch 2, seq 256.
    Measured 105,758,868 B, predicted 105,758,864 B (benchmarks/bench_torchtitan_step.py has the other cases)."""
    from tests.test_export import _torchtitan_python

    bench = _torchtitan_bench()
    monkeypatch.setenv("AUTOTUNE_TORCHTITAN_PYTHON", _torchtitan_python())  # skipped where it is missing
    (row,) = bench.run_both([(2, "none")], tmp_path / "titan-path", "torchtitan")
    assert row["step"] == "torchtitan"  # both sides ran torchtitan's step, not autotune's on the HF model
    measured, predicted = row["measured_bytes"], row["predicted_bytes"]
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


def test_the_uncounted_flex_block_mask_is_as_small_as_said():
    """What the torchtitan step does not trace (its attention runs through SDPA): FlexAttention's BlockMask,
    sized by torch's own create_block_mask (causal, one head, as torchtitan builds it) against
    titan.flex_block_mask_bytes, which docs/STACKS.md quotes."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from autotune.distributed.titan import flex_block_mask_bytes

    for batch, seq in ((2, 8192), (1, 1024)):
        mask = create_block_mask(lambda b, h, q, kv: q >= kv, B=batch, H=None, Q_LEN=seq, KV_LEN=seq, device="cpu")
        made = sum(t.numel() * t.element_size() for t in mask.as_tuple() if isinstance(t, torch.Tensor))
        assert made == flex_block_mask_bytes(batch, seq)
    assert flex_block_mask_bytes(2, 8192) == 133_120


TITAN_BUILD = r"""
import json, sys, torch
from autotune.problem.catalog.models import resolve_model
from autotune.distributed.titan import build_titan_model
from torchtitan.models.llama3 import model_registry as llama3
from torchtitan.models.qwen3 import model_registry as qwen3
theirs = {"llama3-8b": llama3("8B"), "qwen3-8b": qwen3("8B")}
for name in json.loads(sys.argv[1]):
    with torch.device("meta"):
        ours = build_titan_model(resolve_model(name), seq_len=8192)
        own = theirs[name].model.build()
    count = lambda m: sum(p.numel() for p in m.parameters())
    print("BUILT " + json.dumps({"name": name, "ours": count(ours), "theirs": count(own), "class": type(ours).__name__,
                                 "own_class": type(own).__name__, "blocks": len(ours.layers)}), flush=True)
"""


def test_torchtitans_model_is_built_with_the_tuned_models_shapes():
    """titan.build_titan_model, run in torchtitan's own environment: for llama3-8b and qwen3-8b (dense), the
    same class and parameter count as torchtitan 0.3's own registry flavor (8B) and as transformers' count of
    the Hugging Face model (catalog num_parameters, computed here from transformers)."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from tests.test_export import _torchtitan_python

    names = ["llama3-8b", "qwen3-8b"]
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([_torchtitan_python(), "-c", TITAN_BUILD, json.dumps(names)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=str(root)), cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = {row["name"]: row for row in (json.loads(line[6:]) for line in proc.stdout.splitlines()
                                          if line.startswith("BUILT "))}
    for name in names:
        row = built[name]
        assert row["class"] == row["own_class"] and row["blocks"] == resolve_model(name).num_layers
        assert row["ours"] == row["theirs"] == resolve_model(name).num_parameters, row


@pytest.mark.slow  # real gloo ranks (forked, not torchrun): about 15 s of CPU, 29 s wall at load 4 on the 2-core VM
def test_litgpts_own_step_matches_a_real_gloo_run_of_it(tmp_path, monkeypatch):
    """--stack litgpt traces LitGPT 0.5's own GPT, a FSDP2 unit per Block, Fabric's bf16-mixed (parameters fp32,
    gathered and reduced in bf16, the forward under autocast) and pretrain's chunked_cross_entropy
    (autotune/distributed/litgpt_step.py): its predicted tensor peak against a real 2-rank gloo run of the same step in
    LitGPT's own environment (.venv-litgpt), tiny-llama at micro-batch 2, seq 256. The prediction runs here
    with LitGPT's `litgpt` package on the path (it imports beside this environment's lightning and torch).
    Measured 98,679,952 B, predicted 98,679,950 B (benchmarks/bench_torchtitan_step.py --stack litgpt has
    bf16-true and checkpointing too, each 2 bytes apart)."""
    from tests.test_export import _litgpt_python

    bench = _torchtitan_bench()
    monkeypatch.setenv("AUTOTUNE_LITGPT_PYTHON", _litgpt_python())  # skipped where it is missing
    (row,) = bench.run_both([(2, "none", "bf16")], tmp_path / "litgpt-path", "litgpt")
    assert row["step"] == "litgpt"  # both sides ran LitGPT's step, not autotune's on the HF model
    measured, predicted = row["measured_bytes"], row["predicted_bytes"]
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


LITGPT_BUILD = r"""
import json, sys, torch
from autotune.problem.catalog.models import resolve_model
from autotune.distributed.litgpt_step import build_litgpt_model
from litgpt import Config
from litgpt.model import GPT
with torch.device("meta"):
    ours = build_litgpt_model(resolve_model("llama3-8b"), seq_len=8192, precision="bf16-pure")
    own = GPT(Config.from_name("Llama-3-8B"))
count = lambda m: sum(p.numel() for p in m.parameters())
shapes = lambda m: sorted((n, tuple(p.shape)) for n, p in m.named_parameters() if not n.startswith(("lm_head", "transformer.wte")))
print("BUILT " + json.dumps({"ours": count(ours), "theirs": count(own), "class": type(ours).__name__,
                             "same_block_shapes": shapes(ours) == shapes(own), "blocks": len(ours.transformer.h),
                             "dtypes": sorted({str(p.dtype) for p in ours.parameters()}),
                             "rope": [ours.cos.dtype.__repr__(), ours.cos.shape[0]]}), flush=True)
"""


def test_litgpts_model_is_built_with_the_tuned_models_shapes():
    """litgpt_step.build_litgpt_model, run in LitGPT's own environment: for llama3-8b, the same class and the
    same parameter shapes in every block as LitGPT 0.5's own `Llama-3-8B` config, and as many parameters as
    transformers counts for the Hugging Face model (catalog num_parameters; LitGPT's own config pads its
    vocabulary to the same 128,256 rows); bf16-true: every parameter and the RoPE cache in bf16."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from tests.test_export import _litgpt_python

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([_litgpt_python(), "-c", LITGPT_BUILD], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(root)), cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(line[6:]) for line in proc.stdout.splitlines() if line.startswith("BUILT ")]
    assert row["class"] == "GPT" and row["same_block_shapes"] and row["blocks"] == resolve_model("llama3-8b").num_layers
    assert row["ours"] == row["theirs"] == resolve_model("llama3-8b").num_parameters, row
    assert row["dtypes"] == ["torch.bfloat16"] and row["rope"] == ["torch.bfloat16", 8192], row
