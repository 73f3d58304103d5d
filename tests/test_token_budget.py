"""Token-budget batches (--token-budget, autotune/problem/packing.py): packed rows of whole documents.

Checked against what does not share the code under test: the packing's expected fill and sum of squared
lengths against counts made by hand for fixed lengths; the per-document attention against transformers'
own SDPA attention over the block-diagonal mask it derives from position_ids; the simulator's tensor peak
against real gloo trials of the same packed micro-batches (two families, three budgets each, in the
session's shared launch). On a GPU a packed row runs a varlen flash kernel: one launch where the CPU trial
and the trace run SDPA once per document, keeping the same output and log-sum-exp per token; the kernels'
own workspaces are not compared here (no GPU)."""

from __future__ import annotations

import json

import pytest

from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec
from autotune.util.errors import UsageError
from autotune.problem.packing import DocumentLengths, Packing, read_document_lengths, resolve_packing
from tests.shared_runs import register
from tests.test_sim_accuracy import assert_tensor_peaks_agree, predict_cpu_runs

SHORT = Packing(DocumentLengths(loguniform=(8, 64), source="loguniform:8:64"))
"""Documents of 8-64 tokens: several per row at the tiny models' seq_len 64."""
MATRIX = [(family, mb, ac) for family in ("tiny-llama", "tiny-qwen2") for mb, ac in ((1, "none"), (2, "full"), (4, "none"))]
"""(family, micro-batch, checkpointing): budgets of 64, 128 and 256 tokens at seq_len 64."""


def _spec(family: str, mb: int, ac: str) -> TrialSpec:
    return TrialSpec(model=resolve_model(family), cluster=Cluster(num_gpus=2), seq_len=64, packing=SHORT,
                     train=TrainConfig(micro_batch_size=mb, activation_checkpointing=ac))


register("token-budget", __name__, lambda folder: [_spec(*row) for row in MATRIX])


# -- the packing's arithmetic -----------------------------------------------------------------------
def test_fixed_lengths_pack_as_counted_by_hand(tmp_path):
    """Documents of 100 tokens in a budget of 1,024: ten whole ones fit (the eleventh would overflow),
    every micro-batch alike: 1,000 tokens, 10 x 100^2 squared, no spread."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("100\n" * 50)
    stats = Packing(read_document_lengths(str(lengths))).stats(1024, 512)
    assert (stats.tokens, stats.squares, stats.documents, stats.tokens_std) == (1000, 10 * 100 ** 2, 10, 0)


def test_documents_longer_than_seq_len_are_cut_to_it(tmp_path):
    """A histogram of one length, 3,000, at seq_len 1,024: every document cut to 1,024, two per budget of 2,048."""
    histogram = tmp_path / "histogram.json"
    histogram.write_text(json.dumps({"3000": 5}))
    stats = Packing(read_document_lengths(str(histogram))).stats(2048, 1024)
    assert (stats.tokens, stats.squares) == (2048, 2 * 1024 ** 2)


def test_worst_case_row_fills_the_budget_with_documents_of_the_distribution():
    documents = SHORT.worst_case_documents(256, 64)
    assert sum(documents) == 256 and len(documents) > 2
    assert all(1 <= d <= 64 for d in documents)


def test_the_forms_of_doc_lengths(tmp_path):
    listed = tmp_path / "a.txt"
    listed.write_text("10, 20\n20")
    as_json = tmp_path / "b.json"
    as_json.write_text("[10, 20, 20]")
    histogram = tmp_path / "c.json"
    histogram.write_text('{"20": 2, "10": 1}')
    read = [read_document_lengths(str(p)) for p in (listed, as_json, histogram)]
    assert {(r.lengths, r.weights) for r in read} == {((10, 20), (1.0, 2.0))}
    for bad in ("0 5", "abc", "[]", '{"10": -1}', "10.5"):
        (tmp_path / "bad.txt").write_text(bad)
        with pytest.raises(UsageError):
            read_document_lengths(str(tmp_path / "bad.txt"))


def test_a_budget_is_whole_rows_of_seq_len():
    assert resolve_packing(4096, None, seq_len=1024)[1] == 4
    with pytest.raises(UsageError, match="use 3,072, 4,096"):
        resolve_packing(4000, None, seq_len=1024)
    with pytest.raises(UsageError, match="give --token-budget too"):
        resolve_packing(None, DocumentLengths(loguniform=(1, 2)), seq_len=1024)


def test_models_the_per_document_attention_does_not_cover_are_refused():
    with pytest.raises(UsageError, match="sliding-window"):
        TrialSpec(model=_mistral(), cluster=Cluster(num_gpus=2), seq_len=64, train=TrainConfig(), packing=SHORT)
    with pytest.raises(UsageError, match="--stack fsdp2"):
        TrialSpec(model=resolve_model("tiny-llama"), cluster=Cluster(num_gpus=2), seq_len=64, train=TrainConfig(),
                  packing=SHORT, stack="trl")


def _mistral():
    import tempfile

    from autotune.problem.catalog.shrink import shrunk_config

    folder = tempfile.mkdtemp()
    config = shrunk_config("mistral")
    config.sliding_window = 32
    config.save_pretrained(folder)
    return resolve_model(folder)


# -- the attention: per document, as transformers' own block-diagonal mask ---------------------------
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen2"])
def test_per_document_attention_equals_the_block_diagonal_mask(family):
    """The packed step's loss and gradients against transformers' SDPA attention on the same packed row,
    whose block-diagonal mask transformers derives from the restarting position_ids itself."""
    import torch

    from autotune.distributed.training import build_model, packed_batch

    model = resolve_model(family)
    torch.manual_seed(0)
    packed = build_model(model, step="packed", precision="fp32")
    reference = build_model(model, precision="fp32")
    reference.load_state_dict(packed.state_dict())
    documents = SHORT.worst_case_documents(128, 64)
    batch = packed_batch(torch.randint(0, 200, (2, 64)), documents)
    ours = packed(**batch).loss
    theirs = reference(input_ids=batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"]).loss
    ours.backward()
    theirs.backward()
    assert len(documents) > 2
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    for a, b in zip(packed.parameters(), reference.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5), family
    # Not a row of independent sequences: the same tokens without the document boundaries differ.
    whole = reference(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    assert abs(whole.item() - theirs.item()) > 1e-4


# -- memory: the trace against real gloo trials ------------------------------------------------------
@pytest.fixture(scope="module")
def measured_and_predicted(gloo_runs):
    specs, measured = gloo_runs.run("token-budget")
    return specs, measured, predict_cpu_runs(specs)


@pytest.mark.parametrize("index", range(len(MATRIX)), ids=[f"{f}-mb{m}-{a}" for f, m, a in MATRIX])
def test_packed_peak_matches_real_gloo_trials(measured_and_predicted, index):
    specs, measured, predicted = measured_and_predicted
    assert specs[index].step == "packed" and len(specs[index].documents) > 1
    assert_tensor_peaks_agree(specs[index], measured[index], predicted[index])


# -- the tune: the largest budget that fits -----------------------------------------------------------
def test_the_tune_picks_the_largest_budget_that_fits(tmp_path):
    """llama3-8b on 8 x H100 at seq 8,192 with a file of lengths: the winner's budget fits and one more
    row of seq_len, with the winner's other knobs, is predicted over the limit."""
    import autotune
    from autotune.backends.sim import SimBackend

    lengths = tmp_path / "lengths.txt"
    lengths.write_text(" ".join(str(n) for n in (300, 900, 2500, 7000, 12000) * 20))
    result = autotune.tune("llama3-8b", gpus=8, gpu_type="h100-80gb", global_tokens="4M", seq_len=8192,
                           backend="sim", token_budget="search", doc_lengths=str(lengths), compile="none",
                           float8="none", runs_dir=str(tmp_path / "runs"), max_trials=10)
    packing = result["packing"]
    assert packing["token_budget"] == result["micro_batch_size"] * 8192
    assert packing["document_lengths"]["source"] == str(lengths)
    assert 0 < packing["fill"] < 1 and packing["global_tokens_spread"] > 0
    from autotune.problem.catalog.gpus import GPUS
    from autotune.search.records import DEFAULT_HEADROOM
    from autotune.problem.config import Workload, memory_limit_bytes

    train = TrainConfig.from_result(result)
    cluster = Cluster(num_gpus=8, gpu=GPUS["h100-80gb"])
    limit = memory_limit_bytes(cluster.capacity_bytes, headroom=DEFAULT_HEADROOM, workload=Workload())
    packing_of = Packing(read_document_lengths(str(lengths)))
    with SimBackend() as sim:
        def evaluate(mb):
            return sim.evaluate(TrialSpec(model=resolve_model("llama3-8b"), cluster=cluster, seq_len=8192,
                                          train=train.with_(micro_batch_size=mb), grad_accum_steps=result["grad_accum_steps"],
                                          memory_limit_bytes=limit, packing=packing_of))
        assert evaluate(train.micro_batch_size).ok
        assert evaluate(train.micro_batch_size + 1).status == "oom"


def test_the_command_line_refuses_bad_budgets_with_exit_2(tmp_path, capsys):
    from autotune.drivers.cli import EXIT_USAGE, main

    base = ["trial", "--model", "tiny-llama", "--gpus", "2", "--backend", "analytic", "--seq-len", "64"]
    assert main([*base, "--token-budget", "100"]) == EXIT_USAGE
    assert "not a multiple of --seq-len 64" in capsys.readouterr().err
    assert main([*base, "--token-budget", "search"]) == EXIT_USAGE
    assert main([*base, "--token-budget", "128", "--doc-lengths", str(tmp_path / "missing.txt")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "cannot read it" in err and "Traceback" not in err
