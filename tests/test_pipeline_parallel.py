"""Pipeline parallelism (--pp, parallel/pipeline.py): the decoder blocks split into stages, torch's schedules
(1F1B, Interleaved1F1B, GPipe) running the accumulation steps as micro-batches, FSDP2 sharding each stage over
its data ranks, run by the training step every trial runs (training.train_step, `model.pipeline`).

The real runs: PP2 on 2 ranks on three families (tiny-llama, tiny-qwen2 fully checkpointed, a shrunk OLMo 2)
under 1F1B, tiny-llama under Interleaved1F1B, tiny-qwen2 under GPipe, and on 4 ranks tiny-llama PP4 (one block
per stage) and PP2 x FSDP2 (Interleaved1F1B), and PP2 x TP2 (tiny-llama under 1F1B, tiny-qwen2 fully
checkpointed under Interleaved1F1B), PP2 x CP2 (tiny-llama under 1F1B), and tiny-llama PP2 under 1F1B with compiled
blocks (inductor in the real run, the simulator's AOT-autograd graphs run op by op), in the session's shared launch (tests/shared_runs.py), against the
simulator, which traces every pipeline rank (backends/sim/_pipeline.py): the worst rank's peak is the
prediction, and each rank's is compared with the real ranks of its pp block. The numbers: the pipelined step on
2 gloo ranks (and PP2 x TP2 on 4) computes the loss and gradients of the same model and batch in one process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from autotune.problem.config import Cluster, TrainConfig, TrialSpec
from autotune.util.errors import UsageError
from autotune.distributed.parallel import ParallelDims, split_stages
from autotune.distributed.parallel.pipeline import stages_of_rank
from tests.benchmarks import load_benchmark
from tests.shared_runs import register
from tests.test_sim_accuracy import assert_tensor_peaks_agree, predict_cpu_runs
from tests.test_tensor_parallel import shrunk_or_catalog_model

SEQ = 64
ACCUM = 4  # the pipeline's micro-batches
# (model, ranks, pipeline parallel, schedule, micro-batch, checkpointing[, tensor parallel[, context parallel[, compile]]])
MATRIX = [
    ("tiny-llama", 2, 2, "1F1B", 2, "none"),
    ("tiny-qwen2", 2, 2, "1F1B", 2, "full"),
    ("olmo2", 2, 2, "1F1B", 2, "none"),  # a shrunk OLMo 2: q/k norms over the whole projection, no catalog entry
    ("tiny-llama", 2, 2, "Interleaved1F1B", 2, "none"),
    ("tiny-qwen2", 2, 2, "GPipe", 2, "none"),
    ("tiny-llama", 4, 4, "1F1B", 2, "none"),
    ("tiny-llama", 4, 2, "Interleaved1F1B", 2, "none"),  # PP2 x FSDP2: each stage sharded over 2 ranks
    ("tiny-llama", 4, 2, "1F1B", 2, "none", 2),  # PP2 x TP2: each stage's blocks split over 2 ranks
    ("tiny-qwen2", 4, 2, "Interleaved1F1B", 2, "full", 2),  # PP2 x TP2, grouped-query attention, 2 stages a rank
    ("tiny-llama", 4, 2, "1F1B", 2, "none", 1, 2),  # PP2 x CP2: each stage's ranks hold slices of every sequence
    ("tiny-llama", 2, 2, "1F1B", 2, "none", 1, 1, "blocks"),  # each stage's blocks compiled (inductor, in real runs)
]


def _spec(row, folder) -> TrialSpec:
    name, ranks, pp, schedule, mb, ac, *split = row
    tp, cp, compiled = (*split, *(1, 1, "none")[len(split):])
    return TrialSpec(model=shrunk_or_catalog_model(name, folder), cluster=Cluster(num_gpus=ranks), seq_len=SEQ,
                     train=TrainConfig(pipeline_parallel=pp, pipeline_schedule=schedule, micro_batch_size=mb,
                                       activation_checkpointing=ac, tensor_parallel=tp, context_parallel=cp,
                                       compile=compiled),
                     grad_accum_steps=ACCUM)


register("pipeline-parallel", __name__, lambda folder: [_spec(row, folder) for row in MATRIX])


@pytest.fixture(scope="module")
def measured_and_predicted(gloo_runs):
    specs, measured = gloo_runs.run("pipeline-parallel")
    return specs, measured, predict_cpu_runs(specs)


@pytest.mark.parametrize("index", range(len(MATRIX)), ids=["-".join(map(str, row)) for row in MATRIX])
def test_pipeline_peak_matches_a_real_gloo_run(measured_and_predicted, index):
    """The prediction is the worst traced pipeline rank's peak, the real figure the highest rank's; and every
    pipeline rank's traced peak matches the real ranks of its pp block (measured: within 8 bytes).

    Under PP x TP a block's tp ranks do the same work, and the trace matches them as exactly, with one exception
    seen only under load (the suite's shared launch, not in a run of its own): now and then the first stage's tp
    ranks measure one to three micro-batches' sequence shards more than the trace, one rank (30-96 KiB of 52-57
    MB) or, once in CI, both (80,384 bytes of 52 MB, 1929d9a's CI run; the cause, a real-run timing effect, not
    identified). So there no rank of the first stage measures less than the trace, and none exceeds it by more
    than one shard per micro-batch; the later stages' tp ranks match the trace exactly."""
    specs, measured, predicted = measured_and_predicted
    spec, real, sim = specs[index], measured[index], predicted[index]
    assert_tensor_peaks_agree(spec, real, sim)
    per_rank = real.extras["per_rank_tensor_peak_bytes"]
    block = spec.cluster.num_gpus // spec.train.pipeline_parallel
    traced = sim.extras["per_pipeline_rank_tensor_peak_bytes"]
    assert sorted(int(k) for k in traced) == list(range(spec.train.pipeline_parallel))  # every rank, at pp <= 4
    tp = spec.train.tensor_parallel
    shard = spec.train.micro_batch_size * (SEQ // tp) * spec.model.config_dict["hidden_size"] * 2  # bf16
    for pp_rank, peak in traced.items():
        reals = per_rank[int(pp_rank) * block:(int(pp_rank) + 1) * block]
        if tp > 1 and int(pp_rank) == 0:
            assert peak <= min(reals) * (1 + 1e-4), (pp_rank, peak, per_rank)
            assert max(reals) - peak <= ACCUM * shard + 8, (pp_rank, peak, per_rank)
            continue
        for real_peak in reals:
            assert abs(peak - real_peak) <= 1e-4 * real_peak, (pp_rank, peak, per_rank)
    assert real.extras["per_pipeline_rank_tensor_peak_bytes"] == [
        max(per_rank[k * block:(k + 1) * block]) for k in range(spec.train.pipeline_parallel)]
    assert sim.extras["extrapolated"] is False


# --- the numbers: the pipelined step computes the whole batch's loss and gradients -------------------------

_SAME_NUMBERS = """
import json, sys
import torch, torch.distributed as dist
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import TrainConfig
from autotune.distributed.parallel import ParallelDims, parallelize
from autotune.distributed.training import build_model, micro_batch_loss, train_step

rank, world = int(sys.argv[1]), int(sys.argv[3])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=world)
meshes = {}  # by (tp, cp): every rank builds the same ones in the same order
ACCUM = 4


class Grads:  # train_step's optimizer: keeps the gradients (gathered whole) instead of stepping
    def step(self):
        self.grads = {name: p.grad.full_tensor() for name, p in parallel.named_parameters()}

    def zero_grad(self, set_to_none=True):
        pass


def whole_name(name, starts):
    # pipeline_stages.<i>.layers.<j>.x -> model.layers.<start + j>.x; the stage's embeddings, norm -> model.<...>
    _, i, rest = name.replace("_checkpoint_wrapped_module.", "").split(".", 2)
    if rest.startswith("layers."):
        _, j, tail = rest.split(".", 2)
        return f"model.layers.{starts[int(i)] + int(j)}.{tail}"
    return rest if rest.startswith("lm_head") else "model." + rest


figures = {}
for case in sys.argv[4:]:  # MODEL:SCHEDULE:TPxCP
    name, schedule, degrees = case.split(":")
    tp, cp = map(int, degrees.split("x"))
    if (tp, cp) not in meshes:
        meshes[tp, cp] = ParallelDims.of(TrainConfig(pipeline_parallel=2, tensor_parallel=tp, context_parallel=cp),
                                         world).build_mesh("cpu")
    mesh = meshes[tp, cp]
    train = TrainConfig(precision="fp32", pipeline_parallel=2, pipeline_schedule=schedule, tensor_parallel=tp,
                        context_parallel=cp)
    spec = resolve_model(name)
    torch.manual_seed(0)
    whole = build_model(spec, precision="fp32")
    parallel = build_model(spec, precision="fp32")
    parallel.load_state_dict(whole.state_dict())
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, spec.config_dict["vocab_size"], (2, 64), generator=gen) for _ in range(ACCUM)]
    expected = 0.0
    for tokens in batches:
        loss = micro_batch_loss(whole, tokens) / ACCUM
        loss.backward()
        expected += loss.item()
    parallelize(parallel, mesh, train, allow_offload=False)
    starts = [module.start for _, module in parallel.pipeline.modules]
    optimizer = Grads()
    got = train_step(parallel, optimizer, iter([t.clone() for t in batches]), grad_accum_steps=ACCUM)
    reference = dict(whole.named_parameters())
    worst, seen = 0.0, []
    for key, grad in optimizer.grads.items():
        ref = reference[whole_name(key, starts)].grad
        seen.append(whole_name(key, starts))
        worst = max(worst, float((grad - ref).abs().max() / ref.abs().max()))
    figures[case] = {"expected": expected, "got": got.item(), "worst_grad": worst, "params": seen,
                     "last": parallel.pipeline.has_last, "all": sorted(reference)}
print(json.dumps(figures))
dist.destroy_process_group()
"""


def test_the_pipelined_step_computes_the_whole_batchs_loss_and_gradients(tmp_path):
    """Two gloo ranks, one pipeline of 4 micro-batches: parallelize() and train_step() as a trial runs them, in
    fp32, against the same weights and tokens in one process without stages (each micro-batch's loss / 4,
    backpropagated): the last stage's mean loss is the same, and every gradient of every stage (gathered whole)
    is equal up to float32 reduction order; together the ranks hold every parameter once. tiny-llama under
    1F1B (one stage per rank), tiny-qwen2 (grouped-query attention) under Interleaved1F1B (two per rank)."""
    _assert_the_same_numbers(_run_the_same_numbers(tmp_path, ["tiny-llama:1F1B:1x1", "tiny-qwen2:Interleaved1F1B:1x1"],
                                                   world=2))


@pytest.fixture(scope="module")
def four_ranks_same_numbers(tmp_path_factory):
    """The 4-rank cases below in one set of gloo processes (each process's start, importing torch and
    transformers, costs more than its cases' steps)."""
    return _run_the_same_numbers(tmp_path_factory.mktemp("four-ranks"),
                                 ["tiny-llama:1F1B:2x1", "tiny-qwen2:Interleaved1F1B:1x2"], world=4)


def test_the_pipelined_step_with_tensor_parallel_stages_computes_the_same_numbers(four_ranks_same_numbers):
    """PP2 x TP2 on 4 gloo ranks (tiny-llama, 1F1B): each stage's blocks split over 2 ranks, the stages passing
    sequence shards; the loss and every gradient (gathered whole over the tp ranks) as the unsplit model's."""
    _assert_the_same_numbers(four_ranks_same_numbers, only="tiny-llama:1F1B:2x1")


def test_the_pipelined_step_with_context_parallel_stages_computes_the_same_numbers(four_ranks_same_numbers):
    """PP2 x CP2 on 4 gloo ranks (tiny-qwen2, grouped-query attention, Interleaved1F1B): each stage's ranks hold
    load-balanced slices of every sequence, the ring attention running inside the schedule's step, the stages
    passing each rank's slice; the cp ranks' losses average to the unsplit model's, and every gradient (gathered
    whole over the cp ranks, which FSDP shards over) is the unsplit model's."""
    _assert_the_same_numbers(four_ranks_same_numbers, only="tiny-qwen2:Interleaved1F1B:1x2")


def _run_the_same_numbers(folder, cases: list[str], *, world: int) -> list[dict]:
    """Each rank's figures for `cases` (MODEL:SCHEDULE:TPxCP), run in one set of `world` gloo processes."""
    procs = [subprocess.Popen([sys.executable, "-c", _SAME_NUMBERS, str(rank), str(folder / "store"), str(world),
                               *cases], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    outs = [proc.communicate(timeout=300) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), "".join(err[-3000:] for _, err in outs)
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def _assert_the_same_numbers(ranks: list[dict], *, only: str | None = None) -> None:
    block = len(ranks) // 2  # the ranks of each pipeline rank's block: its cp x tp ranks
    for case in [only] if only else ranks[0]:
        tp, cp = map(int, case.rsplit(":", 1)[1].split("x"))
        firsts, lasts = [r[case] for r in ranks[:block]], [r[case] for r in ranks[block:]]
        assert all(last["last"] for last in lasts) and not any(first["last"] for first in firsts)
        for group in range(0, block, cp * tp):  # every tp rank of the last stage computes its cp slice's loss,
            slices = lasts[group:group + cp * tp]  # whose mean over the cp slices is the whole batch's
            got = sum(last["got"] for last in slices) / len(slices)
            assert abs(got - slices[0]["expected"]) <= 1e-5 * abs(slices[0]["expected"]), (case, slices)
        for figures in firsts + lasts:
            assert figures["worst_grad"] <= 1e-4, (case, figures)
        for first, last in zip(firsts, lasts):  # every parameter, on one pipeline rank
            assert sorted(first["params"] + last["params"]) == first["all"]


# --- how stages split, and what is refused ---------------------------------------------------------------


def test_split_stages_balances_blocks_with_the_embeddings_and_head_counted_as_one_block_each():
    assert split_stages(4, 2) == [(0, 2), (2, 4)]  # 1 + 2 and 2 + 1
    assert split_stages(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # every stage at least one block
    assert split_stages(6, 2) == [(0, 3), (3, 6)]
    # 126 blocks (llama3.1-405b) on 8 stages: 128 units, 16 each, the ends one block fewer.
    bounds = split_stages(126, 8)
    assert [b - a for a, b in bounds] == [15, 16, 16, 16, 16, 16, 16, 15]
    # Of the balanced splits, the earlier stages (more micro-batches in flight under 1F1B) hold fewer blocks.
    assert split_stages(32, 4) == [(0, 6), (6, 15), (15, 24), (24, 32)]
    with pytest.raises(ValueError, match="at least as many"):
        split_stages(3, 4)


def test_interleaved_stages_go_round_robin():
    assert stages_of_rank(0, 4, "Interleaved1F1B") == [0, 4]
    assert stages_of_rank(3, 4, "Interleaved1F1B") == [3, 7]
    assert stages_of_rank(1, 4, "1F1B") == [1]


def test_parallel_dims_put_the_pipeline_outermost():
    dims = ParallelDims.of(TrainConfig(pipeline_parallel=2), 8)
    assert (dims.pp, dims.dp_shard, dims.data_ranks, dims.world_size) == (2, 4, 4, 8)
    assert [dims.pipeline_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [dims.data_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]  # a pipeline's stages share a batch
    assert ParallelDims.of(TrainConfig(), 8).data_rank(5) == 5
    with pytest.raises(ValueError, match="does not divide"):
        ParallelDims.of(TrainConfig(pipeline_parallel=3), 8)


def test_parallel_dims_put_tensor_parallelism_innermost_under_a_pipeline():
    """torchtitan's (pp, dp_shard, tp): 8 ranks as PP2 x FSDP2 x TP2, a tp pair sharing a batch."""
    dims = ParallelDims.of(TrainConfig(pipeline_parallel=2, tensor_parallel=2), 8)
    assert (dims.pp, dims.dp_shard, dims.tp, dims.data_ranks, dims.world_size) == (2, 2, 2, 2, 8)
    assert [dims.pipeline_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [dims.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_parallel_dims_put_context_parallelism_between_the_data_ranks_and_tensor_parallelism_under_a_pipeline():
    """torchtitan's (pp, dp_shard, cp, tp): 16 ranks as PP2 x FSDP2 x CP2 x TP2, a cp x tp group of 4 neighbouring
    ranks sharing a batch; FSDP shards over dp_shard x cp (4 ranks of each pp block), the mesh's flattened data
    dimension."""
    dims = ParallelDims.of(TrainConfig(pipeline_parallel=2, tensor_parallel=2, context_parallel=2), 16)
    assert (dims.pp, dims.dp_shard, dims.cp, dims.tp, dims.data_ranks, dims.world_size) == (2, 2, 2, 2, 2, 16)
    assert [dims.pipeline_rank(r) for r in range(16)] == [0] * 8 + [1] * 8
    assert [dims.data_rank(r) for r in range(16)] == [0, 0, 0, 0, 1, 1, 1, 1] * 2
    with pytest.raises(ValueError, match="not built"):
        ParallelDims.of(TrainConfig(pipeline_parallel=2, shard_group_size=2), 8)


def test_a_pipeline_with_tensor_parallelism_needs_a_sequence_its_tp_ranks_split_evenly():
    """The stages pass each tp rank's sequence shard, declared up front: equal shards only."""
    from autotune.problem.catalog.models import resolve_model

    def spec(seq: int) -> TrialSpec:
        return TrialSpec(model=resolve_model("tiny-llama"), cluster=Cluster(num_gpus=8), seq_len=seq,
                         train=TrainConfig(pipeline_parallel=2, tensor_parallel=4), grad_accum_steps=ACCUM)

    assert spec(64).train.tensor_parallel == 4
    with pytest.raises(UsageError, match="--pp 2 with --tp 4: .*sequence length 66"):
        spec(66)


def test_parallelize_refuses_a_model_the_stage_module_cannot_split():
    """GPT-2's base model is wte/wpe/h/ln_f: no embed_tokens, no rotary embedding, blocks that take no position
    embeddings. Refused by name, before any mesh is read."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from autotune.distributed.parallel import parallelize

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, tie_word_embeddings=False))
    with pytest.raises(UsageError, match="--pp 2: .*'gpt2'"):
        parallelize(model, None, TrainConfig(pipeline_parallel=2))


def test_the_configuration_refuses_a_family_the_stage_module_cannot_split():
    from autotune.problem.catalog.models import resolve_model

    with pytest.raises(UsageError, match="cannot be split into pipeline stages: .*'gemma2'"):
        TrialSpec(model=resolve_model("gemma2-9b"), cluster=Cluster(num_gpus=2), seq_len=SEQ,
                  train=TrainConfig(pipeline_parallel=2), grad_accum_steps=ACCUM)


def test_fp16_is_refused_under_a_pipeline():
    """The schedule runs each micro-batch's backward itself: fp16's loss scaling would never be applied."""
    from autotune.problem.catalog.models import resolve_model

    with pytest.raises(UsageError, match="fp16"):
        TrialSpec(model=resolve_model("tiny-llama"), cluster=Cluster(num_gpus=2), seq_len=SEQ,
                  train=TrainConfig(pipeline_parallel=2, precision="fp16"), grad_accum_steps=ACCUM)


def test_the_stage_module_refuses_a_tied_embedding():
    from transformers import LlamaConfig, LlamaForCausalLM

    from autotune.distributed.parallel import parallelize

    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, tie_word_embeddings=True))
    with pytest.raises(UsageError, match="tied"):
        parallelize(model, None, TrainConfig(pipeline_parallel=2))


def test_a_big_model_traces_only_the_ranks_that_could_peak_highest():
    """llama3.1-405b on 8 ranks: the first, the last, and of the middle ranks only one holding more blocks than
    the middle ranks before it (a later rank never has more micro-batches in flight)."""
    from autotune.backends.sim._pipeline import ranks_to_trace

    assert ranks_to_trace(126, 8, "1F1B") == [0, 1, 7]
    assert ranks_to_trace(4, 4, "1F1B") == [0, 1, 2, 3]
    assert torch.distributed.is_available()


def test_the_measured_throughput_counts_one_batch_per_pipeline(measured_and_predicted):
    """A pipeline's stages share one batch: the job's tokens per step are the data ranks' (GPUs / (pp x cp x tp)),
    each micro-batch x sequence x accumulation, counted once however many stages and slices each batch passes
    through."""
    specs, measured, _ = measured_and_predicted
    for spec, real in zip(specs, measured):
        train = spec.train
        data_ranks = spec.cluster.num_gpus // (train.pipeline_parallel * train.context_parallel * train.tensor_parallel)
        tokens_per_step = spec.train.micro_batch_size * spec.seq_len * spec.grad_accum_steps * data_ranks
        assert real.throughput * real.extras["step_seconds"] == pytest.approx(tokens_per_step, rel=1e-9)


# --- depth extrapolation of a pipeline rank (backends/sim/_pipeline.trace_pipeline_rank_extrapolated) ---------------

# One of the benchmark's nine rows: llama, 32 blocks, pp 2, 1F1B, full checkpointing (its period), a GPU run's trace,
# a 16k sequence and llama3.1-8b's vocabulary (the last stage's logits live through the step's end, whose run of ops
# grows with the depth: extrapolated 85% over its whole trace before _extrapolate._from_both_ends; about a minute of
# traces on a 2-core VM). test_the_simulator_extrapolates_deep_pipeline_ranks_to_the_peaks_of_whole_traces below
# checks a CPU run's trace (llama, no checkpointing) through SimBackend. qwen2, Interleaved1F1B and pp 4 (2-5 minutes
# a row) are in the benchmark only: `python benchmarks/bench_pipeline_extrapolation.py` runs all nine.
SUITE_ROWS = [("llama", 32, 2, "1F1B", "full", False, 16384, 128256)]


@pytest.mark.parametrize("row", SUITE_ROWS, ids=["-".join(map(str, row)) for row in SUITE_ROWS])
def test_a_pipeline_ranks_depth_extrapolated_peak_is_its_whole_traces_byte_for_byte(tmp_path, row):
    """Every pipeline rank traced on two shallow copies (each of its deep enough stages one period apart, the
    embeddings on the first stage, the norm and head on the last, the schedule and its 4 micro-batches as the full
    model's) and extrapolated per site, against the same rank traced whole: the same tensor peak to the byte and
    the same categories at it, under 1F1B and Interleaved1F1B at pp 2 and 4, with and without full activation
    checkpointing, for a GPU run's trace and a CPU run's (gloo's reduce-scatter copy)."""
    bench = load_benchmark("bench_pipeline_extrapolation")
    assert row in bench.ROWS
    for rank, extrapolated, whole in bench.compare(row, tmp_path):
        assert extrapolated["tensor_peak_bytes"] == whole["tensor_peak_bytes"], (rank, extrapolated["extrapolated"])
        assert extrapolated["categories"] == whole["categories"], rank
        assert extrapolated["stages"] == whole["stages"]
        assert (extrapolated["block_params"], extrapolated["root_params"]) == (whole["block_params"],
                                                                               whole["root_params"])
        # The shallow copies peak lower: the extrapolation, not a copy of the whole model, found the peak.
        assert max(extrapolated["extrapolated"]["traced_peaks"]) < whole["tensor_peak_bytes"]


def test_shallow_pipeline_layouts_keep_each_stage_mod_the_period_and_fall_back_where_too_shallow():
    from autotune.backends.sim._pipeline import shallow_layouts

    # llama3-70b (80 blocks) on pp 8 under 1F1B: stages of 4, 11 x 6, 10 blocks; 11 traced as 3 and 4.
    assert [b - a for a, b in split_stages(80, 8)] == [4, 11, 11, 11, 11, 11, 11, 10]
    first, second, x, full = shallow_layouts(80, 8, "1F1B", 1, 1)
    assert full == [11] and (first[1], second[1], x) == (3, 4, 8)
    assert first[:1] + first[2:] == second[:1] + second[2:] == [1] * 7  # other ranks' stages: never built here
    assert shallow_layouts(80, 8, "1F1B", 0, 1) is None  # 4 blocks: traced whole (3 and 4 would be the whole)
    # every:2 checkpointing (period 2): the same count mod 2, at least 4 blocks, two periods dropped at least.
    first, second, x, full = shallow_layouts(80, 8, "1F1B", 1, 2)
    assert (full[0] - first[1]) == 2 * x and first[1] >= 4 and second[1] == first[1] + 2 and first[1] % 2 == full[0] % 2
    # Interleaved1F1B, 42 blocks on 8 stages (1, 6, 6, 6, 6, 6, 6, 5): rank 0's one-block stage stays whole.
    first, second, x, full = shallow_layouts(42, 4, "Interleaved1F1B", 0, 1)
    assert full == [1, 6] and (first[0], second[0]) == (1, 1) and (first[4], second[4]) == (3, 4) and x == 3
    # Too shallow to gain anything: traced whole.
    assert shallow_layouts(4, 2, "1F1B", 0, 1) is None


def test_the_simulator_extrapolates_deep_pipeline_ranks_to_the_peaks_of_whole_traces(tmp_path, monkeypatch):
    """SimBackend's default (extrapolate=True) on a 16-block model at pp 2 (stages of 8 blocks, traced as 3 and 4):
    every rank extrapolated, the per-rank peaks and the prediction those of SimBackend(extrapolate=False), which
    traces every rank whole; the notes say per rank which it was."""
    from autotune.backends.sim import SimBackend
    from autotune.problem.catalog.models import resolve_model
    from autotune.problem.catalog.shrink import shrunk_config

    monkeypatch.setenv("AUTOTUNE_CACHE", "off")
    shrunk_config("llama", num_layers=16).save_pretrained(tmp_path / "llama")
    spec = TrialSpec(model=resolve_model(str(tmp_path / "llama")), cluster=Cluster(num_gpus=2), seq_len=32,
                     train=TrainConfig(pipeline_parallel=2, micro_batch_size=1), grad_accum_steps=4)
    results = {}
    for extrapolate in (True, False):
        with SimBackend(device_kind="cpu", screen=False, extrapolate=extrapolate) as sim:
            results[extrapolate] = sim.evaluate(spec)
    on, off = results[True], results[False]
    assert on.status == off.status == "ok"
    assert on.extras["per_pipeline_rank_tensor_peak_bytes"] == off.extras["per_pipeline_rank_tensor_peak_bytes"]
    assert on.peak_bytes == off.peak_bytes
    assert [how["traced_stage_blocks"] for how in on.extras["pipeline_ranks_extrapolated"].values()] == [[[3], [4]]] * 2
    assert all(how.startswith("traced whole") for how in off.extras["pipeline_ranks_extrapolated"].values())
