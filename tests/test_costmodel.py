"""The step-time model against things it was not derived from: independent FLOP counts, real CPU
trials on a calibrated profile, and published runs held out of the fit (leave-one-out)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.estimate import costmodel as cm
from autotune.estimate import hardware
from autotune.problem.catalog.gpus import GPUS
from autotune.problem.config import Cluster, TrainConfig, TrialSpec
from tests.benchmarks import load_benchmark
from tests.shared_runs import register

H100 = GPUS["h100-80gb"]
ROOT = Path(__file__).resolve().parents[1]


def _bench():
    return load_benchmark("bench_costmodel")


def test_multi_node_rings_are_slower_and_say_so():
    work = cm.StepWork(flops_per_gpu=1e12, tokens_per_step=16 * 4096, allgather_bytes_per_gpu=1e10)
    one = cm.estimate_step_time(work, Cluster(num_gpus=16, num_nodes=1, gpu=H100))
    two = cm.estimate_step_time(work, Cluster(num_gpus=16, num_nodes=2, gpu=H100))
    assert two.comm_s > one.comm_s
    assert "2 nodes" in two.basis


def test_single_gpu_has_no_collective_time():
    step = cm.estimate_step_time(cm.StepWork(flops_per_gpu=1e12, tokens_per_step=4096,
                                             allgather_bytes_per_gpu=1e10), Cluster(num_gpus=1, gpu=H100))
    assert step.comm_s == 0.0


def test_traced_matmul_flops_match_an_independent_count():
    """The trace's matmul FLOPs (torch's formulas at every dispatched op) against 6 x tokens x the
    parameters of the model's nn.Linear layers, counted on a meta-device build, plus 2 x tokens
    x the block linears again for each block full checkpointing recomputes, less each block's
    last matmul (mlp.down_proj): torch.utils.checkpoint stops recomputing once every saved tensor
    backward needs is back (early stop, on by default), and down_proj's output is not one."""
    import torch
    from torch import nn

    from autotune.backends.sim import SimBackend
    from autotune.problem.catalog.models import resolve_model
    from autotune.distributed.training import build_model

    model = resolve_model("micro-llama")
    with torch.device("meta"):
        net = build_model(model)
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    head = net.get_output_embeddings()
    block_linear = sum(m.weight.numel() for m in linears if m is not head)
    down = sum(m.weight.numel() for name, m in net.named_modules() if name.endswith("mlp.down_proj"))
    head_params = head.weight.numel()
    backend = SimBackend(device_kind="cpu", extrapolate=False)
    for ac, recompute in (("none", 0), ("full", 1)):
        spec = TrialSpec(model=model, cluster=Cluster(num_gpus=2), seq_len=64,
                         train=TrainConfig(micro_batch_size=2, activation_checkpointing=ac))
        result = backend.evaluate(spec)
        work = result.extras["op_work"]
        tokens = 2 * 64
        expected = 6 * tokens * (block_linear + head_params) + recompute * 2 * tokens * (block_linear - down)
        assert work["matmul_flops"] == pytest.approx(expected, rel=1e-6), ac
        assert work["matmul_flops"] + work["attention_flops"] == pytest.approx(result.extras["flops_per_gpu_per_step"])


def test_op_level_recompute_flops_match_the_trace_and_a_count_of_the_recomputed_linears():
    """Op-level checkpointing recomputes only the matmuls its policy did not save: `alt-mm` the
    2nd, 4th and 6th of each block (k_proj, o_proj, up_proj, counted by module name on a meta
    build), `mm` none. The trace's matmul FLOPs (torch's formulas at every dispatched op) and the
    closed form's step work (analytic.step_work) must both add exactly that to no checkpointing."""
    import torch
    from torch import nn

    from autotune.backends.analytic import step_work
    from autotune.backends.sim import SimBackend
    from autotune.problem.catalog.models import resolve_model
    from autotune.distributed.training import build_model

    model = resolve_model("micro-llama")
    with torch.device("meta"):
        net = build_model(model)
    recomputed = sum(m.weight.numel() for name, m in net.named_modules()
                     if isinstance(m, nn.Linear) and name.endswith(("self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj")))
    tokens = 2 * 64
    backend = SimBackend(device_kind="cpu", extrapolate=False)
    traced, closed = {}, {}
    for ac in ("none", "op", "op:mm"):
        spec = TrialSpec(model=model, cluster=Cluster(num_gpus=2), seq_len=64,
                         train=TrainConfig(micro_batch_size=2, activation_checkpointing=ac))
        traced[ac] = backend.evaluate(spec).extras["op_work"]["matmul_flops"]
        closed[ac] = step_work(spec).flops_per_gpu
    assert traced["op"] - traced["none"] == pytest.approx(2 * tokens * recomputed, rel=1e-6)
    assert traced["op:mm"] == pytest.approx(traced["none"], rel=1e-6)
    assert closed["op"] - closed["none"] == pytest.approx(2 * tokens * recomputed, rel=1e-6)
    assert closed["op:mm"] == pytest.approx(closed["none"], rel=1e-6)


def test_published_runs_name_their_sources():
    """The published runs are data (autotune/estimate/data/published_runs.json, shipped as package data):
    every row cites a source table that says when, on what hardware and with what stack, where
    (url) and who published it."""
    import json

    from autotune.drivers.costmodel_fit import PUBLISHED_RUNS_FILE, published_runs

    data = json.loads(PUBLISHED_RUNS_FILE.read_text())
    assert {row["source"] for row in data["runs"] + data["excluded_runs"]} == set(data["sources"])
    for source in data["sources"].values():
        assert all(source.get(field) for field in ("citation", "date", "stack", "hardware", "url", "publisher")), source
    assert [run.source for run in published_runs()] == \
        [data["sources"][row["source"]]["citation"] for row in data["runs"]]
    # A measurement is recorded once, under the table (date, stack) that measured it: llm-foundry's
    # 2023-10 A100 80GB table kept two MPT 70B rows from its May 2023 (torch 1.13) table, which are
    # recorded under that source only.
    measured = [(r.model, r.gpu, r.num_gpus, r.seq_len, r.micro_batch_size, r.grad_accum,
                 r.activation_checkpointing, r.tokens_per_sec_per_gpu) for r in published_runs()]
    assert len(set(measured)) == len(measured)


def test_published_runs_leave_one_source_out():
    """The check of the throughput constants: every row of a source (one table: a cluster, a stack,
    a date) predicted with the constants refitted on the other sources only, so no sibling of the
    held-out rows shares its efficiency in the fit. Targets: median |error| <= 5% (issue 29's), worst <= 25%,
    >= 97% of the same-model same-hardware pairs of one table in the published order (2026-11-27,
    third session: 128 rows, 12 sources from 5 publishers: 5.5%, 22.9%, 99%, 161 of 164; 2026-11-28
    with llm-foundry's Triton attention at a fitted speedup over its published bars
    (costmodel.ATTENTION_KERNEL_SPEEDUP): 4.0%, 24.8%, 98%, 160 of 164, the worst and the pairs lost
    to MPT 30B at seq 8192, which every llm-foundry table measured 20-30% slower than at 4096; with
    llm-foundry's May 2023 A100 80GB table (torch 1.13, 31 rows: median 3.3%) added and its 2024-01
    MPT 7B / 70B H100 rows costed with the FlashAttention-2 their sweep ran; the 97 rows there
    before: 7.0%. Before (99 rows, 11 sources, collectives across whole nodes on all of a node's
    NICs): 6.6%, 22.7%, 99%, 104 of 105; attention at the published flash kernels' speeds and the
    memory-bound ops at the HBM data sheet: 7.9%, 22.7%; 2026-11-26, one efficiency for every FLOP: 8.4%, 23.3%; 2026-11-25 at
    989 TFLOP/s: 8.6%, 24.1%). The shipped constants are the fit on all rows. (Leave-one-row-out,
    weaker since a row's siblings stay in the fit, is `bench_costmodel.py --published --by-row`: one
    fit per row, too slow for a test.)"""
    from autotune.drivers.costmodel_fit import published_runs

    rows = published_runs()
    scores = _bench().run_published_by_source()
    assert len(rows) >= 40 and scores["sources"] >= 8 and scores["publishers"] >= 4
    assert len(scores["errors"]) == len(rows)
    assert sum(len(errors) for errors in scores["by_source"].values()) == len(rows)
    assert scores["median_abs_error"] <= 0.05, scores["by_source"]
    assert scores["worst_abs_error"] <= 0.25, [(r.model, r.num_gpus, r.gpu, e) for r, e in
                                               zip(rows, scores["errors"]) if abs(e) > 0.25]
    # (No coverage target: the printed range is now itself a quantile of held-out errors, by publisher:
    # tests/test_validation.py::test_published_runs_leave_one_publisher_out.)
    assert scores["same_source_pairs"] >= 50
    assert scores["pairs_in_order"] >= 0.97 * scores["same_source_pairs"], scores["out_of_order"]
    fit = scores["fit"]
    assert fit["a100"] == pytest.approx(cm.MATMUL_EFFICIENCY["a100-80gb"], abs=0.01)
    assert fit["hopper"] == pytest.approx(cm.MATMUL_EFFICIENCY["h100-80gb"], abs=0.01)
    assert fit["half_tokens"] == pytest.approx(cm.HALF_EFFICIENCY_TOKENS, rel=0.03)
    assert fit["half_hidden"] == pytest.approx(cm.HALF_EFFICIENCY_HIDDEN, rel=0.03)
    assert fit["attention_triton"] == pytest.approx(cm.ATTENTION_KERNEL_SPEEDUP["triton"], rel=0.03)
    # The Triton kernel's speedup is the kernel's, not one table's: refitted without each of the four
    # llm-foundry tables that ran it (two stacks, three GPUs, 2023-05 to 2024-01), it stays within 4% of
    # the fit on all rows (1.33-1.41 against 1.37).
    triton = [f["attention_triton"] / fit["attention_triton"] for f in scores["held_out_fits"].values()]
    assert len(triton) == scores["sources"] and all(abs(t - 1) < 0.04 for t in triton), triton


def test_a_fit_whose_rows_never_ran_a_kernel_takes_its_published_bars():
    """costmodel.ATTENTION_KERNEL_SPEEDUP is fitted only where some row ran the kernel: constants fitted
    without llm-foundry (the leave-one-publisher-out check) cost its Triton rows at the FlashAttention-2
    paper's bars, and on a 32k-token sequence, mostly attention, the fitted speedup moves the estimate."""
    from autotune.drivers.costmodel_fit import fit, published_estimate, published_runs

    rows = published_runs()
    fitted = fit([r for r in rows if r.attention_kernel != "triton"])
    assert "attention_triton" not in fitted
    long_row = next(r for r in rows if r.attention_kernel == "triton" and r.seq_len >= 32768)
    bars = published_estimate(long_row, fitted)
    sped = published_estimate(long_row, {**fitted, "attention_triton": cm.ATTENTION_KERNEL_SPEEDUP["triton"]})
    assert sped > 1.15 * bars, (bars, sped)


def test_published_runs_that_trained_are_predicted_to_fit_or_named():
    """Every published row trained on its GPUs, so the closed form (the memory screen before the
    simulator's trace) must put it within the GPU's memory, or name why not (2026-11-27: 122 of 128
    within it; llm-foundry's five MPT 7B rows at micro-batch 6 without checkpointing over it by the
    closed form's Llama block, 76-92% without its SwiGLU and fp32-norm terms; torchtitan's Llama 2 13B
    at micro-batch 2 without checkpointing on 64 A100s at 103%, 88% without the fp32 norm input its
    preset's fused RMSNorm does not keep: train_configs/llama2_13b.toml at the table's commit)."""
    scores = _bench().run_published_fits()
    assert scores["fit"] + scores["explained"] + scores["unexplained"] == scores["rows"] >= 40
    assert scores["fit"] >= 0.9 * scores["rows"]
    assert scores["unexplained"] == 0


def test_published_rows_on_other_parts_are_costed_at_the_peak_their_source_states():
    """torchtitan ran its H100 tables on 96 GB HBM2e parts at a 500 W limit and says their peak is
    "between SXM and NVL" (989 and 835 dense bf16 TFLOP/s): those rows carry a peak in that range and
    are estimated on it, not on the catalog's 700 W SXM part; no other source states another part."""
    from dataclasses import replace

    from autotune.drivers.costmodel_fit import published_estimate, published_runs, source_citation

    rows = [r for r in published_runs() if r.peak_tflops]
    assert rows and all(r.gpu == "h100-80gb" and 835 <= r.peak_tflops <= 989 for r in rows)
    assert {r.source for r in rows} == {source_citation("torchtitan-h100-8"), source_citation("torchtitan-h100-128")}
    constants = {"hopper": 0.5, "half_tokens": 1000.0, "half_hidden": 800.0}
    run = rows[0]
    ratio = published_estimate(run, constants) / published_estimate(replace(run, peak_tflops=None), constants)
    assert ratio == pytest.approx(run.peak_tflops / 989, rel=0.02)  # compute-bound: throughput scales with peak


def test_compiled_and_float8_rows_are_recorded_apart_from_the_eager_fit():
    """Rows with torch.compile or Float8 are kept (source, knobs, figure) but never fitted: the
    step-time model costs eager steps (docs/COMPILE.md)."""
    from autotune.drivers.costmodel_fit import excluded_published_runs, published_runs

    assert all(r.compile == "none" and not r.float8 and not r.excluded for r in published_runs())
    excluded = excluded_published_runs()
    assert excluded and all(r.excluded and (r.compile != "none" or r.float8) for r in excluded)
    assert {r.gpu for r in excluded} >= {"h100-80gb", "h200-141gb", "a100-80gb"}


def test_fsdp_step_work_assembles_volumes_and_offload():
    sizes = dict(flops_per_gpu=1e12, model_flops_per_gpu=9e11, tokens_per_gpu_step=1000, num_gpus=4,
                 block_params=100, num_blocks=4, root_params=50, param_bytes=2, num_microbatches=2)
    plain = cm.fsdp_step_work(**sizes)
    assert plain.tokens_per_step == 4000 and plain.num_fsdp_units == 5
    # Counted by hand: per micro-batch each block is gathered in forward and again in backward
    # (resharded after forward), the root once; bf16. Gradients reduce-scattered once, in fp32.
    assert plain.allgather_bytes_per_gpu == (4 * 100 * 2 + 50) * 2 * 2
    assert plain.reduce_scatter_bytes_per_gpu == (4 * 100 + 50) * 4 * 2
    assert plain.backward_allgather_bytes_per_gpu == 4 * 100 * 2 * 2
    assert (plain.host_to_device_bytes, plain.cpu_optimizer_params) == (0.0, 0)
    offload = cm.fsdp_step_work(**sizes, cpu_offload=True)
    assert offload.cpu_optimizer_params == 450 // 4 + 1  # ceil: the first ranks hold the remainder
    assert offload.device_to_host_bytes == 2 * 450 * 4 / 4


def test_a_fresh_host_copy_above_the_mmap_threshold_faults_every_page_every_time():
    """What costmodel.HOST_MMAP_THRESHOLD_BYTES encodes, counted by the kernel (minor page faults,
    not timed): a fresh tensor of at least the threshold is a new mapping each time, so copying into
    it faults in every page, however often the same size was allocated and freed before (as FSDP2's
    CPU offload copies a gradient back every accumulating micro-batch). Under the threshold glibc's
    heap may hand the pages back mapped or trim them: 0-80% of a 16 MiB copy's pages faulted here
    from run to run, which the model leaves to the fitted per-element cost."""
    import resource

    import torch

    source = torch.ones(cm.HOST_MMAP_THRESHOLD_BYTES)  # 4 x the threshold in bytes: a slice of it for each copy
    nbytes = 2 * cm.HOST_MMAP_THRESHOLD_BYTES
    for _ in range(5):
        torch.empty(nbytes // 4).copy_(source[: nbytes // 4])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.empty(nbytes // 4).copy_(source[: nbytes // 4])
    faulted = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
    assert faulted >= 0.9 * nbytes / 4096  # 4 KiB pages: transparent huge pages would fault fewer


def test_offload_accumulation_holds_on_hosts_and_models_left_out_of_its_fit():
    """CPU offload while gradients accumulate (costmodel.offload_accumulate_seconds, FSDP2's blocking
    copy back and host add in every micro-batch after the first) against the 9 recorded one-GPU
    offload trials: what each measured beyond its GPU work and its optimizer step, predicted with
    the per-element constant refitted without the trial's host machine or without its model (the
    fresh-page cost is measured on a host, not fitted). 2026-11-28: every held-out trial within 10%,
    each refit 1.55-1.59 ns against the shipped 1.56. Fitted with both constants free, the
    fresh-page cost comes out 0.52 ns per byte on the GPUs' hosts, against 0.51 measured on this VM by
    calibrate.bench_fresh_pages: an independent agreement. Then the whole step, as the default
    estimate (the roofline) gives it: within 22% for every trial (was +35% to +166%
    over before the term)."""
    report = _bench().run_offload_recorded()
    assert len(report["rows"]) == 9 and len(report["held_out"]) >= 5
    for held_out, fold in report["held_out"].items():
        assert all(abs(e) <= 0.15 for e in fold["errors"]), (held_out, fold)
        assert fold["a"] == pytest.approx(cm.OFFLOAD_ACCUMULATE_NS_PER_PARAM, rel=0.05), held_out
    assert report["fit"]["free_b"] == pytest.approx(cm.FRESH_PAGE_NS_PER_BYTE, rel=0.25)
    within = 0.22  # this check's own bound (the old printed GPU range, kept as a fixed target)
    assert all(abs(e) <= within for e in report["after"]), report["after"]
    assert all(e > within for e in report["before"])  # what the trials caught before the term


@pytest.mark.parametrize("offload", [False, True])
def test_the_mfu_reported_is_that_of_the_throughput_reported(offload):
    """A compiled configuration's MFU is counted from its own estimated tokens/s (model FLOPs per
    token x tokens/s over the GPUs' bf16 peak, counted here), not the eager step's it was derived
    from (the winner line printed eager's MFU beside compiled float8's tokens/s until 2026-11-28).
    With CPU offload, compiling speeds only the GPU's part: the host's optimizer step and blocking
    gradient copies stay in the compiled step (costmodel.host_offload_seconds)."""
    from autotune.backends.analytic import AnalyticBackend
    from autotune.backends.sim import SimBackend
    from autotune.problem.catalog.models import model_flops_per_token, resolve_model
    from autotune.drivers.constants import published_compile_ratios

    model = resolve_model("llama3.2-1b")
    cluster = Cluster(num_gpus=8, gpu=GPUS["h100-80gb"])

    def spec(compile_mode: str) -> TrialSpec:
        return TrialSpec(model=model, cluster=cluster, seq_len=2048, grad_accum_steps=4,
                         train=TrainConfig(micro_batch_size=2, compile=compile_mode, cpu_offload=offload,
                                           activation_checkpointing="full" if offload else "none"))

    for backend in (SimBackend(device_kind="cuda"), AnalyticBackend()):
        eager, compiled = backend.evaluate(spec("none")), backend.evaluate(spec("blocks"))
        tokens = compiled.tokens_per_sec.value
        mfu = compiled.extras.get("mfu", compiled.extras.get("mfu_estimated"))
        assert mfu == pytest.approx(model_flops_per_token(model, 2048) * tokens / (8 * 989e12), rel=1e-6)
        speedup = tokens / eager.tokens_per_sec.value
        ratio = compiled.extras["compile_speedup"]["ratio"]
        assert ratio == pytest.approx(speedup, rel=0.01), type(backend).__name__  # the gain reported is over eager
        if offload:
            # The host's offload work is in the compiled step as in eager's: the gain is the GPU part's only.
            step = compiled.extras["step_time"]
            host = cm.host_offload_seconds(step)
            assert 0 < host < step["seconds"] and 1.0 < ratio < (step["seconds"] - host) / (step["seconds"] / ratio - host)
            assert 1.0 < speedup < 1.10, type(backend).__name__
        else:
            # Within the published compiled/eager pairs' range (autotune.drivers.constants), or 1 where host-bound.
            published = published_compile_ratios()
            assert min(published) <= speedup <= max(published) or speedup == pytest.approx(1.0), speedup


def test_hsdp_moves_the_gather_traffic_onto_the_node_links():
    """On 8 nodes, sharding within a node leaves only the gradient shards' all-reduce on the
    inter-node links, each ring on one GPU's NIC; groups of whole nodes keep all their traffic
    inter-node; one group of every GPU is plain FSDP."""

    cluster = Cluster(num_gpus=64, num_nodes=8)
    work = cm.fsdp_step_work(flops_per_gpu=1e15, model_flops_per_gpu=1e15, tokens_per_gpu_step=4096,
                                    num_gpus=64, block_params=800_000_000, num_blocks=80,
                                    root_params=2_000_000_000, param_bytes=2)
    node = cm.estimate_step_time(work, cluster, shard_group_size=8)
    intra, inter = cm.hsdp_comm_seconds(work, cluster, shard_group_size=8)
    assert intra > 0 and inter > 0 and node.comm_s == pytest.approx(intra + inter)
    # Across nodes only each GPU's 1/8 gradient shard, all-reduced over the 8 replicas (2 x 7/8 of
    # it), through that GPU's own NIC: bytes counted here, not by the module.
    nic_gbps = cluster.gpu.inter_node_gbps * cm.NIC_BUS_EFFICIENCY
    assert inter == pytest.approx(2 * 7 / 8 * work.reduce_scatter_bytes_per_gpu / 8 / (nic_gbps * 1e9))
    assert cm.hsdp_comm_seconds(work, cluster, shard_group_size=32)[0] == 0.0
    single = Cluster(num_gpus=8)
    assert cm.estimate_step_time(work, single, shard_group_size=8).comm_s == \
        cm.estimate_step_time(work, single).comm_s  # one group of every GPU is plain FSDP


def test_full_sharding_across_nodes_keeps_the_published_flat_scaling():
    """llm-foundry's MPT 13B at micro-batch 2 without checkpointing ran at 4,792, 4,767, 4,811 and
    4,800 tokens/s/GPU on 8, 16, 32 and 64 H100s (published, within 1%): full sharding across nodes
    was as fast as within one. A ring over whole nodes crosses them on every NIC of a node (NCCL runs
    a channel per NIC); at one NIC per GPU the estimates fell 17-21% from 8 to 16-64 GPUs."""
    from autotune.drivers.costmodel_fit import published_estimate, published_runs

    rows = [r for r in published_runs() if r.model == "mpt-13b" and r.gpu == "h100-80gb"
            and r.micro_batch_size == 2 and r.activation_checkpointing == "none"]
    assert sorted(r.num_gpus for r in rows) == [8, 16, 32, 64]
    assert max(r.tokens_per_sec_per_gpu for r in rows) / min(r.tokens_per_sec_per_gpu for r in rows) < 1.01
    shipped = {"hopper": cm.MATMUL_EFFICIENCY["h100-80gb"], "half_tokens": cm.HALF_EFFICIENCY_TOKENS,
               "half_hidden": cm.HALF_EFFICIENCY_HIDDEN}
    estimates = [published_estimate(r, shipped) for r in rows]
    assert max(estimates) / min(estimates) < 1.03, estimates


def test_shipped_profiles_cover_the_catalog_with_sources():
    for gpu in GPUS.values():
        profile = hardware.shipped_profile(gpu)
        assert not profile.calibrated and profile.device == "cuda"
        for name in hardware.REQUIRED:
            figure = profile.figures[name]
            assert figure.source in ("data sheet", "published run", "measured") and figure.basis, (gpu.name, name)
            if figure.source == "measured":  # by autotune, on GPU hosts the basis names: not this machine
                assert "H100" in figure.basis or "H200" in figure.basis, (gpu.name, name, figure.basis)
        again = hardware.HardwareProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
        assert again.figures == profile.figures


@pytest.mark.parametrize("content, message", [
    ("not json", "not readable JSON"),
    ('{"schema": "other"}', "not an autotune hardware profile"),
    ('{"schema": "autotune-hardware/1", "device": "cpu", "figures": {}}', "missing figures"),
])
def test_a_bad_profile_is_a_one_line_usage_error(tmp_path, content, message):
    path = tmp_path / "profile.json"
    path.write_text(content)
    # Refused before the model is built: the process never imported transformers.
    script = ("import sys; from autotune.drivers.cli import main; code = main(sys.argv[1:]); "
              "print('transformers' in sys.modules); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", script, "trial", "--model", "micro-llama", "--gpus", "2",
                           "--backend", "sim", "--hardware", str(path)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stdout.split() == ["False"], proc.stdout
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in proc.stderr


def calibrate_with_the_command(out: Path, backend: str) -> "hardware.HardwareProfile":
    """`autotune calibrate` in its own process, as users run it: its ranks are started with
    multiprocessing's spawn, whose resource tracker would otherwise outlive the call as a child
    of the test process (and read as a leaked trial process to tests/test_real.py's check)."""
    proc = subprocess.run([sys.executable, "-m", "autotune", "calibrate", "--backend", backend, "--model",
                           "tiny-llama", "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return hardware.load_profile(str(out))


# The cheap version of benchmarks/bench_costmodel.py --grid: 4 configurations of tiny-llama whose
# step times spread over 8x, run for real in the session's shared launch (tests/shared_runs.py), 2
# timed steps each (the ranking target itself is the benchmark's, with its repeats: see below).
GRID_CONFIGS = [dict(micro_batch_size=mb, activation_checkpointing=ac)
                for mb, ac in ((1, "full"), (2, "none"), (4, "full"), (8, "none"))]
register("cost-grid", __name__, lambda folder: _bench().grid_specs(GRID_CONFIGS), timed_steps=2)


@pytest.mark.slow
def test_cpu_estimates_rank_real_trials_on_a_calibrated_profile(tmp_path, gloo_runs):
    """Calibrate this machine, then estimate the grid's configurations on the profile and rank
    them against their real runs (measured tokens/s, 2 gloo ranks).

    Slow (about 2 minutes of CPU on a 2-core VM): the grid's 4 real trials (2 timed steps each: a
    launch of their own, tests/shared_runs.py), then a calibration of this machine (about 1 minute):
    both are what the test checks against."""
    bench = _bench()
    specs, results = gloo_runs.run("cost-grid")
    profile = calibrate_with_the_command(tmp_path / "cpu.json", "cpu")
    assert profile.calibrated and all(f.source == "measured" for f in profile.figures.values())
    assert profile["host_op_us"] > 0 and "dispatched ops" in profile.figures["host_op_us"].basis
    # The host's first touch of fresh pages (CPU offload's large gradient shards): a page fault costs
    # the kernel more than copying its 4 KiB does (0.1-0.2 ns per byte on this VM), so well above 0.
    assert profile["fresh_page_ns_per_byte"] > 0.05
    # Each configuration traced once, estimated on the profile and (printed only) without host_op_us.
    estimated, estimated_without_host = bench.estimate_sim_on(
        specs, [hardware.load_profile(str(tmp_path / "cpu.json")), bench.with_host_op(profile, None)])
    assert all(r.status == "ok" for r in results), [r.message for r in results]
    measured = [r.tokens_per_sec.value for r in results]
    scores = bench.grid_scores(estimated, measured)
    without_host = bench.grid_scores(estimated_without_host, measured)
    print(scores, "\nwithout host_op_us:", without_host)
    # A functional test: the estimates exist for every configuration. The ranking is not asserted here:
    # calibration and trials run minutes apart beside the other xdist worker's launches, and on this
    # shared 2-core VM two suite runs an hour apart, with no change to what this test reaches, gave tau
    # >= 0.6 and 0.2 (2026-11-25): a timing figure. The ranking target is asserted on stored trials
    # instead (tests/test_validation.py::test_recorded_gpu_trials_hold_their_ranges: Kendall tau over
    # the recorded H100 trials); benchmarks/bench_costmodel.py --grid prints this grid's.
    assert all(e > 0 for e in estimated) and len(estimated) == len(measured) == len(GRID_CONFIGS)


def test_calibrate_times_attention_in_the_layout_the_model_passes(monkeypatch):
    """calibrate's SDPA benchmark must run the memory layout a trial's model gives SDPA: torch's CPU
    flash backward takes twice as long on transposed views of [batch, seq, heads, head_dim] as on
    contiguous tensors, and timing the contiguous ones made every CPU estimate's attention ~2x fast
    (docs/COSTMODEL.md, "The missing cost, found"). The model's own call, captured in a forward of
    autotune's tiny-llama, is the reference."""
    import torch
    import torch.nn.functional as F

    from autotune.drivers import calibrate
    from autotune.problem.catalog.models import resolve_model
    from autotune.distributed.training import build_model

    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append([t.stride() for t in (q, k, v)])
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    spec = resolve_model("tiny-llama")
    model = build_model(spec, num_layers=1)
    batch, seq = 2, 64
    with torch.no_grad():
        model(input_ids=torch.randint(0, spec.config_dict["vocab_size"], (batch, seq)))
    assert seen, "the model's attention did not call SDPA"
    heads = spec.config_dict["num_attention_heads"]
    bench = calibrate.attention_inputs(batch, seq, heads, spec.config_dict["hidden_size"] // heads,
                                       device="cpu", dtype=torch.float32)
    assert [t.stride() for t in bench] == seen[0]


def test_calibration_pieces_the_cuda_path_uses_run_on_cpu(monkeypatch):
    """What `calibrate --backend cuda` runs besides the memory counters, run here on CPU: the
    short FSDP2 steps (real training steps of the model, wrapped as trials wrap it) and the
    compute benchmarks at a sequence longer than every token count (one attention batch size
    per token count: the fit still needs two)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autotune.drivers import calibrate
    from autotune.problem.catalog.models import resolve_model

    model = resolve_model("micro-llama")
    compute = calibrate.bench_compute(model, device=torch.device("cpu"), dtype=torch.float32, seq_len=256,
                                      token_counts=(32, 64))
    assert len(compute["attention"]["points"]) >= 2 and compute["attention"]["flops_per_s"] > 0
    from autotune.backends.sim._fakepg import release_fake_group

    release_fake_group()  # another test's simulator may hold the process's (fake) default group
    # monkeypatch: a MASTER_PORT left in this process's environment would reach later tests'
    # launchers (Lightning takes it, and its rank 0 then fails to listen: address in use).
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(calibrate._free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        calibrate.short_fsdp_steps(model, device=torch.device("cpu"), mesh=init_device_mesh("cpu", (1,)), seq_len=32)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_calibrate_counts_each_memory_ops_bytes_as_the_trace_counts_them(dtype):
    """The memory-bound rate a profile holds is bytes over time, and the estimate divides the trace's
    bytes by it: both must count an op alike. Counted here by a dispatch mode with the trace's own op
    classifier and byte count around each op calibrate times. calibrate counted an fp32 -> bf16 cast
    as 12 bytes per element where the trace counts 6 (4 read, 2 written), which doubled the casts'
    measured bandwidth and pulled the fitted one up (2026-11-28), and timed fp32 -> fp32 "casts",
    which do nothing, as moving bytes."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from autotune.drivers import calibrate
    from autotune.backends.sim._trace import _op_kind, _tensor_bytes

    class MemoryBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if _op_kind(func) == "memory":
                self.bytes += _tensor_bytes(args) + _tensor_bytes(out if isinstance(out, (list, tuple)) else [out])
            return out

    ops = calibrate.memory_ops(64, 96, device=torch.device("cpu"), dtype=getattr(torch, dtype))
    assert len(ops) == (2 if dtype == "bfloat16" else 1)
    for counted, op in ops:
        with MemoryBytes() as mode:
            op()
        assert mode.bytes == counted


def test_float8_gemm_benchmark_runs_on_cpu_and_names_its_figures(tmp_path):
    """calibrate's float8 GEMMs (`torch._scaled_mm`, tensorwise and rowwise, bf16 beside them) run
    on a GPU with float8 tensor cores only; their code runs here on CPU, where torch has the same
    op, and the profile gets one figure per recipe and per token count, leaving the profile's own
    name alone (an H200 calibration once took a figure's name as its own)."""
    import torch

    from autotune.drivers import calibrate
    from autotune.problem.catalog.models import resolve_model

    model = resolve_model("micro-llama")
    bench = calibrate.bench_float8_gemms(model, device=torch.device("cpu"), token_counts=(32, 64))
    assert bench["shapes"] == [[model.hidden_size, model.hidden_size], [model.hidden_size, model.mlp_width],
                               [model.mlp_width, model.hidden_size]]
    for kind in ("bf16", "tensorwise", "rowwise"):
        assert len(bench[kind]["points"]) == 6 and bench[kind]["flops_per_s"] > 0
    recorded = json.loads((ROOT / "benchmarks" / "results" / "h200_calibrated_llama3.2-1b.json").read_text())
    raw = dict(job=dict(backend="cpu", model="micro-llama", seq_len=64, optimizer_impl="foreach"), world_size=1, float8_gemms=bench,
               compute_bf16=_raw_compute(recorded, ""), compute_fp32=_raw_compute(recorded, "_fp32"),
               adamw=dict(params_per_s=1e9, params=1000, seconds=1e-6))
    profile = calibrate.profile_from_measurements(raw)
    assert profile.name.startswith("cpu-")
    for figure in ("float8_matmul_tflops", "float8_rowwise_matmul_tflops"):
        assert profile.figures[figure].source == "measured" and "torch._scaled_mm" in profile.figures[figure].basis
    for figure in ("float8_matmul_tflops@32", "float8_rowwise_matmul_tflops@64"):
        assert profile.figures[figure].value > 0 and "float8 GEMM rate at" in profile.figures[figure].basis


def _raw_compute(profile: dict, suffix: str) -> dict:
    """calibrate's raw compute block rebuilt from a recorded profile's fitted figures (one point each)."""
    f = profile["figures"]
    fit = lambda rate: dict(points=[(1.0, 1.0)], flops_per_s=rate * 1e12, fixed_s=0.0, flops_per_s_by_tokens={})
    return dict(gemm=fit(f[f"matmul_tflops{suffix}"]["value"]), attention=fit(f[f"attention_tflops{suffix}"]["value"]),
                memory=dict(points=[], bytes_per_s=f["memory_gbps"]["value"] * 1e9, fixed_s=0.0))


def test_float8_gemm_rate_assumed_against_a_real_h200():
    """The float8 estimate takes the converted linears' GEMMs to run at BF16_GEMM_FRACTION of the float8
    data-sheet peak (an assumption from bf16 H100 GEMMs). A real H200 timed `torch._scaled_mm` at three
    models' block shapes (benchmarks/results/float8_gemms_h200.json: llama3.2-1b, qwen2.5-1.5b, mistral-7b;
    calibrate's bench_float8_gemms, 2026-11-27). At the shapes of the published float8 runs the estimate is
    checked on (Llama 3 8B: hidden 4096, MLP 14336, as mistral-7b's) the assumed tensorwise rate must be within
    10% of every measured rate at 2,048 tokens and more; at the smaller models' shapes it over-states the rate
    (by up to 25%, docs/COMPILE.md), and float8 must still beat bf16 there by 1.3x, as the estimate says."""
    from autotune.estimate import costmodel as cm

    h200 = GPUS["h200-141gb"]
    assumed = h200.float8_tflops * cm.BF16_GEMM_FRACTION
    recorded = json.loads((ROOT / "benchmarks" / "results" / "float8_gemms_h200.json").read_text())
    assert set(recorded) == {"llama3.2-1b", "qwen2.5-1.5b", "mistral-7b"}
    for model, bench in recorded.items():
        for tokens, rate in bench["tensorwise"]["flops_per_s_by_tokens"].items():
            if int(tokens) >= 2048:
                if model == "mistral-7b":
                    assert abs(assumed / (rate / 1e12) - 1) <= 0.10, (model, tokens, rate / 1e12, assumed)
                assert rate > 1.3 * bench["bf16"]["flops_per_s_by_tokens"][tokens], (model, tokens)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (calibrate --backend cuda)")
def test_cuda_calibration_measures_runtime_memory_terms(tmp_path):
    profile = calibrate_with_the_command(tmp_path / "gpu.json", "cuda")
    for name in ("cuda_context_bytes", "nccl_communicator_bytes", "cublas_workspace_bytes", "reserved_over_allocated"):
        assert profile.figures[name].source == "measured"
    assert 100 * 2**20 < profile["cuda_context_bytes"] < 4 * 2**30
    assert profile["reserved_over_allocated"] >= 1.0
    assert profile["host_link_gbps"] > 1.0
    # CPU offload's accumulating micro-batch as FSDP2 runs it (a blocking copy to pageable memory and
    # the host add): 1.5 ns per element on the recorded H100 and H200 hosts (costmodel), fitted there.
    assert 0.2 < profile["offload_accumulate_ns_per_param"] < 20
    assert profile.figures["fresh_page_ns_per_byte"].source == "measured"


def test_a_close_call_between_estimates_names_the_real_trials_that_decide(tmp_path):
    """tune on a cpu profile: the winner's estimate carries its range, and where the runner-up
    falls inside it best.json says so and names the two real cpu trials."""
    import glob

    figures = {name: {"value": value, "source": "data sheet", "basis": "test profile"} for name, value in dict(
        matmul_tflops=0.1, matmul_op_us=10, attention_tflops=0.05, attention_op_us=10, memory_gbps=20,
        memory_op_us=5, intra_node_gbps=0.5, intra_node_latency_us=100, inter_node_gbps=0.5,
        inter_node_latency_us=100, comm_overlap=0, host_link_gbps=0, cpu_adam_params_per_s=1e8,
        optimizer_gbps=3, tracked_op_us=300).items()}
    profile = tmp_path / "cpu.json"
    profile.write_text(json.dumps({"schema": "autotune-hardware/1", "name": "test-cpu", "device": "cpu",
                                   "figures": figures}))
    proc = subprocess.run([sys.executable, "-m", "autotune", "tune", "--model", "micro-llama", "--gpus", "2",
                           "--backend", "sim", "--hardware", str(profile), "--global-tokens", "1024",
                           "--gpu-memory", "2GiB", "--runs-dir", str(tmp_path / "runs")],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr
    best = json.loads(Path(glob.glob(str(tmp_path / "runs" / "*" / "best.json"))[0]).read_text())
    assert best["throughput_source"] == "estimated" and "profile test-cpu" in best["throughput_basis"]
    why = best["why_winner"]
    # The range is a CPU estimate's: it names the held-out rows it comes from (autotune.estimate.heldout), not a
    # figure this test could rebuild from the value it checks.
    assert why["range_tokens_per_sec"] and "72 held-out rows" in best["tokens_per_sec_range_from"]
    assert "CPU grid" in best["tokens_per_sec_range_from"]
    assert why["close_call"]  # micro-llama: the last configurations differ by a few percent
    assert len(why["decide_with"]) == 2 and all("--backend cpu" in c for c in why["decide_with"])
    assert "not settled" in why["sentence"] and "not settled" in proc.stdout


def test_per_op_model_runs_hsdp_collectives_within_the_group():
    """The per-operation model under HSDP and plain FSDP on 2 nodes of 8 against a count of the bytes
    each link carries: sharding within a node moves the gathers onto the node's links and leaves the
    replica all-reduce on each GPU's NIC; plain FSDP's ring crosses the nodes on all of their NICs;
    a group of every GPU is plain FSDP."""
    profile = hardware.shipped_profile(GPUS["h100-80gb"])
    ops = cm.OpWork(matmul_flops=1e14, matmul_ops=500, memory_bytes=1e10, memory_ops=1000, dispatched_ops=3000)
    common = dict(profile=profile, num_gpus=16, num_nodes=2, num_blocks=32, block_params=200_000_000,
                  root_params=500_000_000, param_bytes=2, tokens_per_step=16 * 4096)
    fsdp = cm.estimate_op_step_time(ops, **common)
    node = cm.estimate_op_step_time(ops, **common, shard_group_size=8)
    assert cm.estimate_op_step_time(ops, **common, shard_group_size=16).comm_s == fsdp.comm_s
    assert profile["intra_node_gbps"] > 3 * profile["inter_node_gbps"]
    # The bytes each rank moves: gathers over the node (7/8 of each unit) plus the replica all-reduce
    # of its 1/8 gradient shard across 2 nodes (2 x 1/2 of it), at least what bandwidth alone costs.
    params = 32 * 200_000_000 + 500_000_000
    gathered = (32 * 200_000_000 * 2 + 500_000_000) * 2 * 7 / 8
    scattered = params * 4 * 7 / 8
    allreduced = 2 * params * 4 / 8 / 2
    floor = (gathered + scattered) / (profile["intra_node_gbps"] * 1e9) + allreduced / (profile["inter_node_gbps"] * 1e9)
    assert floor <= node.comm_s < floor * 1.05
    # Plain FSDP over the 2 whole nodes: one ring of 16, crossing the nodes on all 8 NICs of each
    # (NCCL's channel per NIC), so at 8 NICs' rate where the node's links are faster than that.
    ring_gbps = min(8 * profile["inter_node_gbps"], profile["intra_node_gbps"])
    fsdp_floor = (gathered + scattered) * (15 / 16) / (7 / 8) / (ring_gbps * 1e9)
    assert fsdp_floor <= fsdp.comm_s < fsdp_floor * 1.05


def test_calibrated_host_op_count_matches_the_trace_count(monkeypatch):
    """`host_op_us`'s divisor (calibrate.bench_host_overhead's count of the ops a real FSDP2
    forward + backward dispatches) against the simulator's independent count of the same step
    (the trace's `dispatched_ops`, fake tensors). The host time itself is compared with the real
    step's wall time in `bench_costmodel.py --host-time`, not here: two timings of a 10 ms step
    taken a second apart on a shared 2-core machine inverted twice in CI (2026-11-26)."""
    # monkeypatch: a MASTER_PORT left in this process's environment would reach later tests'
    # launchers (Lightning takes it, and its rank 0 then fails to listen: address in use).
    from autotune.drivers import calibrate

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(calibrate._free_port()))
    figures = _bench().measure_host_time(repeats=1)
    print(f"ops: calibrate {figures['calibrated_ops']}, trace {figures['traced_ops']:.0f}")
    assert figures["calibrated_ops"] > 100
    assert 0.9 <= figures["calibrated_ops"] / figures["traced_ops"] <= 1.1, figures


def test_profiles_written_before_host_time_still_load_and_estimate(tmp_path):
    """An H100 profile as calibrated before `host_op_us` existed (the real one, that figure taken
    out of the file) loads and estimates with no host term; with the figure, a launch-bound GPU
    micro-batch takes the host's time, not the device's plus the host's (the host runs ahead of
    the device), and a CPU adds the two."""
    from dataclasses import replace

    document = json.loads((ROOT / "benchmarks" / "results" / "h100_calibrated_qwen2.5-0.5b.json").read_text())
    document["figures"].pop("host_op_us", None)
    (tmp_path / "old.json").write_text(json.dumps(document))
    old = hardware.load_profile(str(tmp_path / "old.json"))
    assert "host_op_us" not in old.figures
    ops = cm.OpWork(matmul_flops=1e12, matmul_ops=200, memory_bytes=1e9, memory_ops=2000, dispatched_ops=6000)
    sizes = dict(num_gpus=1, num_blocks=24, block_params=15_000_000, root_params=136_000_000, param_bytes=2,
                 tokens_per_step=2048)
    before = cm.estimate_op_step_time(ops, profile=old, **sizes)
    assert before.host_s == 0 and not before.host_bound
    shipped = hardware.shipped_profile(H100).figures["host_op_us"]
    # The shipped figure is what its basis says: the median of the recorded GPU calibrations.
    recorded = sorted(json.loads(path.read_text())["figures"]["host_op_us"]["value"]
                      for path in (ROOT / "benchmarks" / "results").glob("h100_calibrated_*.json"))
    assert len(recorded) == 4 and shipped.source in hardware.SOURCES and "median" in shipped.basis
    assert shipped.value == pytest.approx((recorded[1] + recorded[2]) / 2, abs=0.5)
    after = cm.estimate_op_step_time(ops, profile=replace(old, figures={**old.figures, "host_op_us": shipped}), **sizes)
    assert after.host_s == pytest.approx(6000 * shipped.value * 1e-6)
    assert after.compute_s == pytest.approx(max(before.compute_s, after.host_s))
    assert after.seconds >= before.seconds
    cpu = replace(old, device="cpu", figures={**old.figures, "host_op_us": shipped})
    on_cpu = cm.estimate_op_step_time(ops, profile=cpu, **sizes)
    assert on_cpu.compute_s == pytest.approx(on_cpu.device_s + on_cpu.host_s)


def test_default_gpu_estimate_is_host_bound_where_real_h100_trials_were():
    """Small models at small micro-batches wait on the host's dispatch of every op, not the GPU:
    real cuda trials of qwen2.5-0.5b on an H100 (benchmarks/results, measured by
    benchmarks/gpu_check.py) ran at 10-47k tokens/s where the roofline alone says 105-114k. The
    default estimate (no --hardware) must say host-bound, come within 20% of each measurement, and
    rank the micro-batches as measured. The host figure is the median of calibrate's
    own measurements, not of these trials."""
    from autotune.backends.sim import SimBackend
    from autotune.problem.catalog.models import resolve_model

    recorded = json.loads((ROOT / "benchmarks" / "results" / "gpu_check_h100_qwen2.5-0.5b_seq1024_knobs.json")
                          .read_text())
    measured = {row["label"]: row["measured_tokens_per_sec"] for row in recorded["rows"]}
    sim = SimBackend(device_kind="cuda")
    estimates = {}
    for mb in (2, 4, 8):
        spec = TrialSpec(model=resolve_model("qwen2.5-0.5b"), cluster=Cluster(num_gpus=1, gpu=H100), seq_len=1024,
                         train=TrainConfig(micro_batch_size=mb), grad_accum_steps=2)
        result = sim.evaluate(spec)
        figure = result.tokens_per_sec
        real = measured[f"bf16 mb{mb}"]
        assert result.extras["step_time"]["host_bound"] and "host-bound" in figure.basis
        # Within 20% (13%, 16%, -1% on 2026-11-28). Not "inside the printed range": that range is now
        # the quantile of these very trials' errors (autotune.estimate.heldout), so it would check itself.
        assert result.extras["tokens_per_sec_range"] and abs(figure.value / real - 1) <= 0.20, (mb, figure.value, real)
        estimates[mb] = figure.value
    assert sorted(estimates, key=estimates.get) == sorted(estimates, key=lambda mb: measured[f"bf16 mb{mb}"])


def test_fp32_steps_run_at_the_fp32_rate_real_h100s_measured():
    """fp32 matmuls run on the CUDA cores: torch's default float32 matmul precision keeps TF32 off. On real
    H100s `autotune calibrate --backend cuda` measured fp32 GEMMs at 50-52 TFLOP/s against 617-661 in bf16
    (benchmarks/results/h100_calibrated_*.json and calibrate_h100_*.json), measurements the catalog's
    data-sheet peaks were not taken from. The shipped H100 profile's fp32 rate must be within 25% of each
    (it was the bf16 rate, 12x over, until the catalog had an fp32 peak), and the closed form's bf16/fp32
    throughput ratio for compute-bound steps within 25% of the measured GEMM ratio."""
    from autotune.backends.analytic import AnalyticBackend
    from autotune.problem.catalog.models import resolve_model

    measured = []
    for path in sorted((ROOT / "benchmarks" / "results").glob("*h100_*.json")):
        figures = json.loads(path.read_text()).get("figures", {})
        if "matmul_tflops_fp32" in figures:
            measured.append((figures["matmul_tflops"]["value"], figures["matmul_tflops_fp32"]["value"]))
    assert len(measured) >= 4
    shipped = hardware.shipped_profile(H100)
    for bf16_rate, fp32_rate in measured:
        assert abs(shipped["matmul_tflops_fp32"] / fp32_rate - 1) <= 0.25, (shipped["matmul_tflops_fp32"], fp32_rate)
    backend = AnalyticBackend()
    for mb, seq in ((1, 2048), (4, 4096), (8, 1024)):
        rates = {}
        for precision in ("bf16", "fp32"):
            spec = TrialSpec(model=resolve_model("llama-7b"), cluster=Cluster(num_gpus=8, gpu=H100), seq_len=seq,
                             train=TrainConfig(micro_batch_size=mb, activation_checkpointing="full",
                                               precision=precision))
            result = backend.evaluate(spec)
            rates[precision] = result.tokens_per_sec
        assert "in fp32, on CUDA cores" in rates["fp32"].basis
        ratio = rates["bf16"].value / rates["fp32"].value
        for bf16_rate, fp32_rate in measured:
            assert abs(ratio / (bf16_rate / fp32_rate) - 1) <= 0.25, (mb, seq, ratio, bf16_rate / fp32_rate)


def test_large_memory_ops_are_the_loss_over_the_vocabulary(cpu_sim):
    """The trace's `memory_bytes_large` (ops of at least LARGE_MEMORY_OP_BYTES, costed at the
    main-memory bandwidth calibrate measures) against a count from the model's shapes: on
    tiny-llama (hidden 256) only the vocabulary-wide logits are that large, so the bytes are
    activation-sized (exactly twice at twice the micro-batch) and hold at least the loss's
    log-softmax, forward (read + write, 2x the fp32 logits) and backward (3x)."""
    from autotune.problem.catalog.models import resolve_model

    model = resolve_model("tiny-llama")
    large = {}
    for mb in (4, 8):
        spec = TrialSpec(model=model, cluster=Cluster(num_gpus=2), seq_len=256, train=TrainConfig(micro_batch_size=mb))
        work = cpu_sim.evaluate(spec).extras["op_work"]
        logits_fp32 = mb * 256 * int(model.config_dict["vocab_size"]) * 4
        assert logits_fp32 >= cm.LARGE_MEMORY_OP_BYTES
        assert 5 * logits_fp32 <= work["memory_bytes_large"] < work["memory_bytes"]
        large[mb] = work["memory_bytes_large"]
    assert large[8] == pytest.approx(2 * large[4], rel=1e-3)
