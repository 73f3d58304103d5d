"""Context parallelism (--cp, parallel/context.py): torch's ring attention for the CPU flash kernel, run by
the training step every trial runs (training.train_step under parallelize's FSDP over dp_shard x cp).

The real runs: CP2 on 2 ranks (tiny-llama, eager and with compiled blocks; tiny-qwen2, grouped-query attention,
fully checkpointed), FSDP x CP2 on 4 ranks (tiny-llama) and CP2 x TP2, in the session's shared launch (tests/shared_runs.py), against the
simulator's trace of the same step. The numbers: the CP2 step on 2 gloo ranks computes the loss and
gradients of the same model and batch in one process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec
from autotune.problem.knobs import why_no_context_parallel
from autotune.distributed.parallel.context import use_causal_sdpa
from tests.shared_runs import register
from tests.test_sim_accuracy import assert_tensor_peaks_agree, predict_cpu_runs
from tests.test_tensor_parallel import shrunk_or_catalog_model

SEQ = 64
# (model, ranks, context parallel, micro-batch, checkpointing[, tensor parallel[, compile, seq]]): CP alone on 2 ranks,
# FSDP x CP on 4, and CP x TP2 (sequence parallelism) on 4, three families; CP2 with compiled blocks at a sequence
# whose activations the compiled blocks' partitioner changes (seq 512: 2.8 MB under eager's peak).
MATRIX = [
    ("tiny-llama", 2, 2, 2, "none"),
    ("tiny-qwen2", 2, 2, 2, "full"),
    ("olmo2", 2, 2, 2, "none"),  # a shrunk OLMo 2: q/k norms over the whole projection, no catalog entry
    ("tiny-llama", 4, 2, 2, "none"),
    ("tiny-llama", 4, 2, 2, "none", 2),
    ("tiny-qwen2", 4, 2, 2, "full", 2),
    ("granite", 4, 2, 2, "none", 2),  # a shrunk Granite (transformers' own config)
    ("tiny-llama", 2, 2, 2, "none", 1, "blocks", 512),  # the ring inside each compiled block (inductor, in real runs)
]


def _spec(row, folder) -> TrialSpec:
    name, ranks, cp, mb, ac, *rest = row
    tp, compiled, seq = (*rest, *(1, "none", SEQ)[len(rest):])
    return TrialSpec(model=shrunk_or_catalog_model(name, folder), cluster=Cluster(num_gpus=ranks), seq_len=seq,
                     train=TrainConfig(context_parallel=cp, tensor_parallel=tp, micro_batch_size=mb,
                                       activation_checkpointing=ac, compile=compiled), grad_accum_steps=1)


register("context-parallel", __name__, lambda folder: [_spec(row, folder) for row in MATRIX])


@pytest.fixture(scope="module")
def measured_and_predicted(gloo_runs):
    specs, measured = gloo_runs.run("context-parallel")
    return specs, measured, predict_cpu_runs(specs)


@pytest.mark.parametrize("index", range(len(MATRIX)), ids=["-".join(map(str, row)) for row in MATRIX])
def test_context_parallel_peak_matches_a_real_gloo_run(measured_and_predicted, index):
    """The trace is rank 0's, the real figure the highest rank's. The ranks of a group hold the same shards'
    sizes and slices of one batch, but the ring's later steps differ by rank (torch's _partial_update keeps
    half of one rank's queries and half of another's keys and values): rank 0, whose slice holds the first
    and the last chunk, peaks highest (the shrunk OLMo 2's rank 1 1.1% lower, the others within bytes)."""
    specs, measured, predicted = measured_and_predicted
    real = measured[index]
    if real.status == "error" and "SIGABRT" in (real.message or "") and "_ring_backward" in (real.message or ""):
        # Seen once (fresh-clone suite, 2026-11-29): a native abort inside torch's ring backward under MemTracker
        # on one rank, the worker's earlier trials in the same shared launch; not reproduced, cause unknown.
        pytest.xfail("a gloo rank aborted natively in torch's ring attention backward (not a wrong prediction): "
                     + real.message.splitlines()[0])
    assert_tensor_peaks_agree(specs[index], real, predicted[index])
    peaks = measured[index].extras["per_rank_tensor_peak_bytes"]
    assert peaks[0] == max(peaks), peaks


# --- the numbers: the CP step computes the whole batch's loss and gradients ------------------------------

_SAME_NUMBERS = """
import json, sys
import torch, torch.distributed as dist
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import TrainConfig
from autotune.distributed.parallel import ParallelDims, parallelize
from autotune.distributed.training import build_model, micro_batch_loss, train_step

rank, world, tp = int(sys.argv[1]), int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=world)
train = TrainConfig(precision="fp32", context_parallel=2, tensor_parallel=tp, loss_parallel=tp > 1)
mesh = ParallelDims.of(train, world).build_mesh("cpu")


class Grads:  # train_step's optimizer: keeps the gradients (gathered whole) instead of stepping
    def step(self):
        self.grads = {name: p.grad.full_tensor() for name, p in parallel.named_parameters()}

    def zero_grad(self, set_to_none=True):
        pass


figures = {}
for name in sys.argv[5:]:
    spec = resolve_model(name)
    torch.manual_seed(0)
    whole = build_model(spec, precision="fp32")
    parallel = build_model(spec, precision="fp32")
    parallel.load_state_dict(whole.state_dict())
    tokens = torch.randint(0, spec.config_dict["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(1))
    expected = micro_batch_loss(whole, tokens)
    expected.backward()
    parallelize(parallel, mesh, train, allow_offload=False)
    optimizer = Grads()
    got = train_step(parallel, optimizer, iter([tokens.clone()]), grad_accum_steps=1)
    dist.all_reduce(got)  # each rank's loss is its slice's mean: the ranks' mean is the batch's (tp ranks hold the same)
    worst = 0.0
    for key, grad in optimizer.grads.items():
        reference = dict(whole.named_parameters())[key.replace("_checkpoint_wrapped_module.", "")].grad
        worst = max(worst, float((grad - reference).abs().max() / reference.abs().max()))
    figures[name] = {"expected": expected.item(), "got": got.item() / world, "worst_grad": worst}
if rank == 0:
    print(json.dumps(figures))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("world, tp, models", [(2, 1, ["tiny-llama", "tiny-qwen2"]), (4, 2, ["tiny-qwen2"])],
                         ids=["cp2", "cp2-tp2"])
def test_the_context_parallel_step_computes_the_whole_batchs_loss_and_gradients(tmp_path, world, tp, models):
    """Two gloo ranks, one CP group (and four: CP2 x TP2 with sequence and loss parallelism): parallelize() and
    train_step() as a trial runs them, in fp32, against the same weights and tokens in one process unsplit: one
    loss, and every gradient (gathered whole) equal up to float32 reduction order. tiny-qwen2's attention is
    grouped-query (2 query heads per k/v)."""
    procs = [subprocess.Popen([sys.executable, "-c", _SAME_NUMBERS, str(rank), str(tmp_path / "store"), str(world),
                               str(tp), *models],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    outs = [proc.communicate(timeout=300) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outs[0][1][-3000:] + outs[1][1][-3000:]
    for name, figures in json.loads(outs[0][0].strip().splitlines()[-1]).items():
        assert abs(figures["got"] - figures["expected"]) <= 1e-5 * abs(figures["expected"]), (name, figures)
        assert figures["worst_grad"] <= 1e-4, (name, figures)


# --- what may use it ------------------------------------------------------------------------------------


def _llama(**changes) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, **changes)


def _why(config, seq_len: int = SEQ) -> str:
    return why_no_context_parallel(config.to_dict(), seq_len=seq_len, degree=2)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_ring_bytes_are_what_torchs_ring_receives(monkeypatch, cp):
    """costmodel.cp_ring_bytes against the collectives torch's ring itself issues for one causal GQA attention,
    forward and backward, on the fake process group (rank 0 of cp; every rank moves the same): the key/value
    all-gathers (cp - 1 shards of each arrive) and the gradients passed round the ring (whole buffers, fp32)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as ft_c
    import torch.nn.functional as F

    from autotune.backends.sim._fakepg import fake_mesh, release_fake_group
    from autotune.distributed.parallel import ParallelDims
    from autotune.distributed.parallel.context import context_parallel_step
    from autotune.distributed.parallel.dims import context_mesh
    from autotune.estimate import costmodel

    received: list[int] = []
    gather, permute = ft_c.all_gather_single, ft_c.permute_tensor

    def counted_gather(tensor, *args, group=None, **kwargs):
        received.append(tensor.numel() * tensor.element_size() * (dist.get_world_size(group) - 1))
        return gather(tensor, *args, group=group, **kwargs)

    def counted_permute(tensor, *args, **kwargs):
        received.append(tensor.numel() * tensor.element_size())
        return permute(tensor, *args, **kwargs)

    monkeypatch.setattr(ft_c, "all_gather_single", counted_gather)
    monkeypatch.setattr(ft_c, "permute_tensor", counted_permute)
    batch, heads, kv_heads, seq, head_dim = 2, 8, 2, 128, 16
    try:
        mesh = context_mesh(fake_mesh(ParallelDims(dp_replicate=1, dp_shard=1, cp=cp)))
        q = torch.randn(batch, heads, seq, head_dim, dtype=torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, seq, head_dim, dtype=torch.bfloat16) for _ in range(2))
        with context_parallel_step(mesh, [q, k, v], [2, 2, 2], no_restore_buffers={q, k, v}):
            for t in (q, k, v):
                t.requires_grad_()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            forward = sum(received)
            out.float().sum().backward()
    finally:
        release_fake_group()
    count = dict(tokens_per_microbatch=batch * seq, kv_width=kv_heads * head_dim, activation_bytes=2,
                 context_parallel=cp)
    assert forward > 0 and sum(received) == costmodel.cp_ring_bytes(**count, num_blocks=1)
    # A checkpointed block's recompute gathers the keys and values once more, as the forward did.
    assert costmodel.cp_ring_bytes(**count, num_blocks=1, checkpointed_blocks=1) == sum(received) + forward


def test_why_no_context_parallel():
    assert _why(_llama()) == ""
    assert "sequence length 62" in _why(_llama(), 62)  # 2 | 62, but 2 x 2 does not
    assert "attention dropout" in _why(_llama(attention_dropout=0.1))
    assert "sliding window" in _why(MistralConfig(sliding_window=32))
    assert _why(MistralConfig(sliding_window=4096)) == ""  # the window holds it all
    assert _why(Qwen2Config()) == ""  # a sliding_window its layer_types do not use
    assert "soft-caps" in _why(Gemma2Config())
    assert "layer types ['sliding_attention']" in _why(Gemma2Config(attn_logit_softcapping=None, sliding_window=32))


@pytest.mark.parametrize("step", ["trl", "torchtitan", "litgpt"])
def test_parallelize_refuses_cp_for_a_step_whose_loss_it_does_not_split(step):
    """Their losses take the tokens whole (or their models build their own attention): refused before
    anything is built, not run without the ring."""
    from autotune.util.errors import UsageError
    from autotune.distributed.parallel import parallelize

    with pytest.raises(UsageError, match=f"not '{step}'"):
        parallelize(None, None, TrainConfig(context_parallel=2), step=step)


def test_causal_sdpa_refuses_a_padding_mask():
    """A padded batch needs a mask the ring cannot apply: refused, not ignored."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(_llama())
    use_causal_sdpa(model)
    input_ids = torch.randint(0, 256, (2, SEQ))
    model(input_ids=input_ids)  # no mask: runs
    with pytest.raises(ValueError, match="padding mask"):
        model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))


def test_a_cp_trial_through_the_cli(capsys):
    from autotune.drivers.cli import main

    code = main(["trial", "--model", "tiny-llama", "--gpus", "2", "--seq-len", str(SEQ), "--cp", "2",
                 "--backend", "sim"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["config"]["context_parallel"] == 2


def test_past_the_context_wall_the_tune_splits_the_sequence(tmp_path):
    """llama3.1-8b at 128k tokens on 8 x h100-80gb: one sequence per GPU does not fit, checkpointed, offloaded or
    tensor-parallel with the head whole (the logits and checkpointed inputs grow with the tokens each GPU holds);
    only tp 8 with loss parallelism (the logits an eighth) does among those; a context-parallel group holding a
    slice of each sequence does too (alone, or with tensor parallelism within it), and wins, the batch shared by its
    GPUs."""
    import autotune

    result = autotune.tune("llama3.1-8b", gpus=8, gpu_type="h100-80gb", global_tokens="4Mi", seq_len=131072,
                           backend="sim", runs_dir=str(tmp_path / "runs"))
    import csv

    split = result["parallelism"]
    assert split["context_parallel"] > 1
    assert split["data_parallel_ranks"] == 8 // (split["context_parallel"] * split["tensor_parallel"])
    # No range: no published run of the winner's mesh is held out, and the label names each of its splits.
    assert result["tokens_per_sec_range"] is None
    assert ("tensor" in result["tokens_per_sec_range_from"]) is (split["tensor_parallel"] > 1)
    assert "context" in result["tokens_per_sec_range_from"]
    assert result["global_tokens"] == 4 * 2**20
    (trials,) = (tmp_path / "runs").glob("*/trials.csv")
    rows = list(csv.DictReader(trials.open()))
    assert any(row["cpu_offload"] == "True" for row in rows) and any(row["tensor_parallel"] != "1" for row in rows)
    assert all(row["status"] == "oom" for row in rows
               if row["context_parallel"] == "1" and not (row["tensor_parallel"] == "8" and row["loss_parallel"] == "True"))
