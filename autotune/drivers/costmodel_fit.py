"""The step-time model's free constants fitted to published FSDP runs, and checked held out.

A tool, not part of the model: `costmodel.py` ships the constants this fit gives; the runs are
data (autotune/estimate/data/published_runs.json: each row's source table, date or commit, hardware,
stack, model, knobs and measured tokens/s per GPU); benchmarks/bench_costmodel.py --published
prints the fit and both checks:

- leave-one-source-out (the headline): every row of a source (one table: a cluster, a software
  stack, a date) held out together, the constants refitted on the other sources: what a user of
  a cluster the fit never saw gets;
- leave-one-row-out: each row held out alone, its siblings of the same source still fitted.

The free constants are the matmul efficiency per GPU family and the micro-batch tokens and hidden
size of half efficiency (the inter-node bandwidth was a fifth until 2026-11-25: it is now modelled,
costmodel.inter_node_ring_gbps). Each source weighs once in the fit (SOURCE_BALANCED). A held-out
row whose GPU family no fitted row has falls back to the data-sheet default efficiency. Attention
(at the published speed of the row's flash kernel) and the memory-bound ops (the row's stack's bytes at
the HBM data sheet) are costed from facts, not fitted (SOURCE_FACTS; costmodel.ATTENTION_KERNEL_TFLOPS,
costmodel.MEMORY_BYTES_PER_TOKEN). Rows with
torch.compile or Float8 are recorded apart (excluded_published_runs) and never fitted.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from autotune.estimate import costmodel
from autotune.problem.config import Cluster, TrainConfig, TrialSpec

PUBLISHED_RUNS_FILE = Path(__file__).resolve().parents[1] / "estimate" / "data" / "published_runs.json"


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    """A public, measured FSDP training throughput the cost model's constants are checked against."""

    model: str
    """Catalog name with the same shapes."""
    gpu: str
    num_gpus: int
    num_nodes: int
    seq_len: int
    micro_batch_size: int
    activation_checkpointing: str
    """The nearest autotune mode (in FLOPs) to what the run used; `note` says what it used."""
    tokens_per_sec_per_gpu: float
    source: str
    """The source table's citation: rows of one source share a cluster, a stack and a date."""
    note: str = ""
    shard_group_size: int = 0
    """GPUs each parameter is sharded over: 0 for all of them (FSDP), a node's 8 for HSDP."""
    reduce_bytes: int = 4
    """Bytes per gradient element reduced: 4 (fp32, FSDP2's and torchtitan's default), 2 where the
    run reduced in bf16 (fms-fsdp's MixedPrecision(reduce_dtype=torch.bfloat16))."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (gradient accumulation)."""
    reshard_after_forward: bool = True
    """False where the run kept gathered parameters from forward to backward (FSDP1's SHARD_GRAD_OP)."""
    compile: str = "none"
    """torch.compile as the run used it ("none": eager; "blocks": per-block compile)."""
    float8: bool = False
    """Float8 linear layers (torchao): not in the eager fit unless the cost model models them."""
    excluded: str = ""
    """Why the row is kept out of the eager fit and its checks (compile, float8), or "" for none."""
    memory_gib: float | None = None
    """The source's memory figure, where it gives one (GiB); `memory_means` says what it measures."""
    memory_means: str = ""
    peak_tflops: float | None = None
    """The GPUs' dense bf16 peak where the source says its GPUs are not the catalog part (None: the
    catalog's data sheet): torchtitan's H100s are HBM2e parts at a 500 W power limit."""
    hbm_gbps: float | None = None
    """The GPUs' HBM bandwidth where the source states another than the catalog part's (GB/s)."""
    kernels: str = "eager"
    """The stack's memory-bound kernels (costmodel.MEMORY_BYTES_PER_TOKEN): "eager", or a fused block."""
    attention_kernel: str = "flash2"
    """The attention kernel the run used (costmodel.ATTENTION_KERNEL_TFLOPS)."""
    fused_norm: bool = False
    """Whether the run's RMSNorm was one fused kernel keeping only its 16-bit input for backward (torchtitan's
    `norm_type = "fused_rmsnorm"`, a Triton kernel), where transformers' RMSNorm, which the closed form
    counts, keeps an fp32 copy of its input and the normalised output: the memory check names it."""


@functools.cache
def _published_data() -> dict:
    return json.loads(PUBLISHED_RUNS_FILE.read_text())


@functools.cache
def published_runs() -> tuple[PublishedRun, ...]:
    """The rows of PUBLISHED_RUNS_FILE that the eager fit uses ("runs"), in its order, each citing
    its source in full."""
    data = _published_data()
    sources = data["sources"]
    return tuple(PublishedRun(**_with_source_facts(row, sources[row["source"]])) for row in data["runs"])


@functools.cache
def excluded_published_runs() -> tuple[PublishedRun, ...]:
    """The recorded rows kept out of the eager fit ("excluded_runs": compiled or float8 runs, which
    the step-time model does not cost), each with its reason in `excluded`."""
    data = _published_data()
    sources = data["sources"]
    return tuple(PublishedRun(**_with_source_facts(row, sources[row["source"]]))
                 for row in data.get("excluded_runs", ()))


SOURCE_FACTS = ("peak_tflops", "hbm_gbps", "kernels", "attention_kernel")
"""Facts a source states for all its rows that the estimate reads: its GPUs' peak and HBM bandwidth where
they are not the catalog part's, its stack's memory-bound kernels (eager or fused) and its attention kernel
(docs/COSTMODEL.md, "Memory-bound work, attention and hardware facts")."""


def _with_source_facts(row: dict, source: dict) -> dict:
    """A row's fields with its source's citation and the facts the source states for every row; a fact
    the row states itself wins (llm-foundry's 2024-01 H100 table ran two attention kernels)."""
    facts = {k: source[k] for k in SOURCE_FACTS if source.get(k) is not None}
    return {**facts, **row, "source": source["citation"]}


def source_citation(key: str) -> str:
    """The citation of the source PUBLISHED_RUNS_FILE names `key` (what a row's `source` holds)."""
    return _published_data()["sources"][key]["citation"]


def source_publishers() -> dict[str, str]:
    """Each source's citation -> who published it (several tables of one publisher are separate
    sources: other clusters, stacks or dates)."""
    return {src["citation"]: src.get("publisher", src["citation"]) for src in _published_data()["sources"].values()}


@functools.lru_cache(maxsize=None)
def published_model(name: str):
    """The ModelSpec of a row's model: a catalog name, or a shape PUBLISHED_RUNS_FILE defines under
    "models" (architectures the catalog does not carry: MPT, TinyLlama), built the same way."""
    from autotune.problem.catalog.models import ModelSpec, canonical_config, resolve_model

    models = _published_data().get("models", {})
    if name not in models:
        return resolve_model(name)
    entry = models[name]
    return ModelSpec(name=name, model_type=entry["model_type"],
                     config_dict=canonical_config(entry["model_type"], dict(entry["config"])),
                     default_seq_len=entry["default_seq_len"], source=entry["source"])


def gpu_family(gpu: str) -> str:
    """The GPUs that share one fitted matmul efficiency (an A100's, a Hopper's)."""
    return "a100" if gpu.startswith("a100") else "hopper" if gpu.startswith(("h100", "h200")) else gpu


def published_spec(run: PublishedRun) -> TrialSpec:
    """The autotune configuration nearest to `run` (its model, cluster and knobs)."""
    return _published_work(run)[0]


@functools.lru_cache(maxsize=None)
def _published_work(run: PublishedRun):
    """The run's spec and step work (FLOPs, bytes): they do not depend on the fitted constants."""
    from autotune.backends.analytic import step_work
    from autotune.problem.catalog.gpus import GPUS

    gpu = GPUS[run.gpu]
    if run.peak_tflops:
        gpu = replace(gpu, peak_tflops=run.peak_tflops)
    if run.hbm_gbps:
        gpu = replace(gpu, hbm_gbps=run.hbm_gbps)
    model = published_model(run.model)
    if model.default_attention == "eager":  # MPT: every published run ran a flash kernel (run.attention_kernel)
        model = model.with_attention("flash_attention_2")
    spec = TrialSpec(model=model, seq_len=run.seq_len,
                     cluster=Cluster(num_gpus=run.num_gpus, num_nodes=run.num_nodes, gpu=gpu),
                     train=TrainConfig(micro_batch_size=run.micro_batch_size,
                                       activation_checkpointing=run.activation_checkpointing,
                                       shard_group_size=run.shard_group_size,
                                       reshard_after_forward=run.reshard_after_forward),
                     grad_accum_steps=run.grad_accum)
    return spec, step_work(spec, reduce_bytes=run.reduce_bytes, kernels=run.kernels,
                           attention_kernel=run.attention_kernel)


def published_estimate(run: PublishedRun, fit: dict[str, float]) -> float:
    """The estimated tokens/s per GPU of `run` with the constants `fit`."""
    return _tokens_per_gpu(run, *_published_work(run), fit)


def _tokens_per_gpu(run: PublishedRun, spec, work, fit: dict[str, float]) -> float:
    """The tokens/s per GPU of `work` (the run's step, eager or compiled) with the constants `fit`."""
    step = costmodel.estimate_step_time(
        work, spec.cluster, shard_group_size=run.shard_group_size,
        matmul_top_efficiency=fit.get(gpu_family(run.gpu), costmodel.DEFAULT_MATMUL_EFFICIENCY),
        nic_bus_efficiency=fit.get("nic"), half_efficiency_tokens=fit["half_tokens"],
        half_efficiency_hidden=fit["half_hidden"],
        attention_kernel_speedup=fit.get(kernel_speedup_key(run.attention_kernel), 1.0), describe=False)
    return step.tokens_per_sec / run.num_gpus


def kernel_speedup_key(kernel: str) -> str:
    """The fit's name for an attention kernel's ATTENTION_KERNEL_SPEEDUP. A fit whose rows never ran
    the kernel has none: its estimates take the kernel's published bars as they are (1.0)."""
    return f"attention_{kernel}"


def kernel_speedups(fit: dict[str, float]) -> dict[str, float]:
    """The attention kernels' speedups in `fit`, by kernel name."""
    return {kernel: fit[kernel_speedup_key(kernel)] for kernel in costmodel.ATTENTION_KERNEL_SPEEDUP
            if kernel_speedup_key(kernel) in fit}


FIT_BOUNDS = {"half_tokens": (0.0, 4096.0), "half_hidden": (0.0, 8192.0)}
"""Ranges the shared constants are fitted in; each GPU family's efficiency in (0.2, 1.0)."""
FIT_START = {"half_tokens": 512.0, "half_hidden": 1024.0}
"""A fixed start, not the shipped constants: the fit does not depend on what it checks."""
KERNEL_SPEEDUP_BOUNDS = (0.5, 2.5)
"""The range an attention kernel's ATTENTION_KERNEL_SPEEDUP is fitted in (started at 1.0, its bars)."""


SOURCE_BALANCED = True
"""Weigh each row by 1 / (rows of its source) in the fit, so every source (one table: a cluster, a
stack, a date) counts once: llm-foundry's tables list 8 to 16 configurations each, torchtitan's
H100 tables one, and an unweighted fit would follow whichever stack published the longest table."""


def source_weights(rows) -> list[float]:
    """Each row's weight in the fit: 1 / (rows of its source among `rows`), or 1 with SOURCE_BALANCED off."""
    if not SOURCE_BALANCED:
        return [1.0] * len(rows)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.source] = counts.get(r.source, 0) + 1
    return [1.0 / counts[r.source] for r in rows]


def fit(rows) -> dict[str, float]:
    """Least squares in log error over `rows`, each source weighed once (SOURCE_BALANCED): the
    efficiency per GPU family, the two half-efficiency points and the speedup of each attention
    kernel in costmodel.ATTENTION_KERNEL_SPEEDUP that some row ran, by coordinate descent (a 13-point scan of each
    constant, then golden-section search around the best point; 6 sweeps)."""
    families = sorted({gpu_family(r.gpu) for r in rows})
    kernels = [kernel_speedup_key(k) for k in costmodel.ATTENTION_KERNEL_SPEEDUP
               if any(r.attention_kernel == k for r in rows)]
    bounds = {**{fam: (0.2, 1.0) for fam in families}, **FIT_BOUNDS, **{k: KERNEL_SPEEDUP_BOUNDS for k in kernels}}
    fitted = {**{fam: 0.6 for fam in families}, **FIT_START, **{k: 1.0 for k in kernels}}
    weights = source_weights(rows)

    def loss(params):
        return sum(w * math.log(published_estimate(r, params) / r.tokens_per_sec_per_gpu) ** 2
                   for r, w in zip(rows, weights))

    for _ in range(6):
        for name, (lo, hi) in bounds.items():
            fitted[name] = _line_minimum(lambda value: loss({**fitted, name: value}), lo, hi)
    return fitted


def _line_minimum(f, lo: float, hi: float) -> float:
    """Where `f` is least on [lo, hi]: the best of 13 evenly spaced points, then 24 golden-section
    steps between its neighbours (the better of that point and the section's middle)."""
    grid = [lo + (hi - lo) * i / 12 for i in range(13)]
    best = min(range(13), key=lambda i: f(grid[i]))
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, 12)]
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(24):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return min((grid[best], (a + b) / 2), key=f)


def held_out_by_source(rows) -> dict[str, tuple[dict[str, float], dict[int, float]]]:
    """Leave-one-source-out: for each source (in the rows' order), the constants fitted on the
    other sources' rows and the estimates of its own rows (tokens/s per GPU, by row index)."""
    return held_out_by(rows, lambda r: r.source)


def held_out_by_publisher(rows) -> dict[str, tuple[dict[str, float], dict[int, float]]]:
    """Leave-one-publisher-out: every table of one publisher (one software stack, often one
    cluster) held out together; otherwise as held_out_by_source."""
    publishers = source_publishers()
    return held_out_by(rows, lambda r: publishers[r.source])


def held_out_by(rows, key) -> dict[str, tuple[dict[str, float], dict[int, float]]]:
    """For each value of `key(row)` (in the rows' order): the constants fitted on the rows with
    another value, and the estimates of the rows with this one (tokens/s per GPU, by row index)."""
    out = {}
    for group in dict.fromkeys(key(r) for r in rows):
        fitted = fit([r for r in rows if key(r) != group])
        out[group] = fitted, {i: published_estimate(r, fitted) for i, r in enumerate(rows) if key(r) == group}
    return out


def compiled_work(run: PublishedRun):
    """The run's step work costed compiled (costmodel.compiled_work): the blocks' memory-bound bytes of the
    run's own stack (`kernels`) less the fused level's, for every block forward and backward and each
    checkpointed block's recompute."""
    spec, work = _published_work(run)
    if run.kernels != "eager":  # a stack whose blocks are fused already: compile has nothing to fuse
        return spec, work
    from autotune.backends.analytic import fused_bytes_saved

    return spec, costmodel.compiled_work(work, fused_bytes_saved=fused_bytes_saved(spec))


def compiled_estimate(run: PublishedRun, fit: dict[str, float]) -> float:
    """A compiled (not float8) row's estimate as the tool makes it: the configuration's step with its blocks'
    memory-bound ops fused (compiled_work), with the eager constants `fit` (docs/COMPILE.md)."""
    if run.float8 or run.compile == "none":
        raise ValueError("compiled_estimate: a compiled row without float8")
    return _tokens_per_gpu(run, *compiled_work(run), fit)


AWS_SAGEMAKER_CITATION = (
    "AWS Machine Learning Blog, 'Efficient Pre-training of Llama 3-like model architectures using torchtitan on "
    "Amazon SageMaker' (with Meta, 2024-10), https://aws.amazon.com/blogs/machine-learning/efficient-pre-training-"
    "of-llama-3-like-model-architectures-using-torchtitan-on-amazon-sagemaker/: 'LLama3 8B pre-training on 4 x "
    "p5.48xlarge instances (32 NVIDIA H100 GPUs) | Baseline | Default Configuration | 6475' and "
    "'torch.compile | compile = true | 7166 | 10.67%' (Throughput (Tokens per Second)); the default configuration "
    "is torchtitan's train_configs/llama3_8b.toml of the time (batch_size 1, seq_len 8192, "
    "data_parallel_shard_degree -1: FSDP2 over all 32, activation_checkpoint selective 'op')")
AWS_SAGEMAKER_PUBLISHER = "AWS (SageMaker blog, torchtitan)"
_AWS_RUN = dict(model="llama3-8b", gpu="h100-80gb", num_gpus=32, num_nodes=4, seq_len=8192, micro_batch_size=1,
                activation_checkpointing="op", source=AWS_SAGEMAKER_CITATION,
                note="p5.48xlarge: H100 SXM 80GB, 3,200 Gb/s EFA per node (400 Gb/s per GPU)")
COMPILE_PAIRS_OUTSIDE_THE_FILE = (
    # (publisher, eager row, compiled row): pairs whose eager row is not among the eager fit's rows
    # (autotune/estimate/data/published_runs.json's "runs"), written here with the figures the source states.
    (AWS_SAGEMAKER_PUBLISHER, PublishedRun(**_AWS_RUN, tokens_per_sec_per_gpu=6475),
     PublishedRun(**_AWS_RUN, tokens_per_sec_per_gpu=7166, compile="blocks", excluded="torch.compile")),
)
"""Published compiled/eager pairs beyond the file's: the AWS SageMaker blog's (torchtitan on 32 H100s)."""


@dataclass(frozen=True)
class CompilePair:
    """A published eager run and the same publisher's compiled run of the same model, GPUs, sequence and
    micro-batch: the compiled/eager ratio the compile estimate is checked against."""

    publisher: str
    eager: PublishedRun
    compiled: PublishedRun

    @property
    def published_ratio(self) -> float:
        return self.compiled.tokens_per_sec_per_gpu / self.eager.tokens_per_sec_per_gpu

    @property
    def compile_only(self) -> bool:
        """Whether compile is all that differs (fms-fsdp's compiled 34B and 70B rows also moved from full to
        selective checkpointing: their ratio is of both changes)."""
        return self.eager.activation_checkpointing == self.compiled.activation_checkpointing


@functools.cache
def compile_pairs() -> tuple[CompilePair, ...]:
    """Every published compiled/eager pair (no float8): each compiled row of the file's excluded_runs with the
    eager row of the same publisher, model, GPU, GPU count, sequence and micro-batch (checkpointing may
    differ: CompilePair.compile_only), then COMPILE_PAIRS_OUTSIDE_THE_FILE."""
    publishers = source_publishers()

    def key(run):
        return (publishers[run.source], run.model, run.gpu, run.num_gpus, run.seq_len, run.micro_batch_size)

    eager = {key(run): run for run in published_runs()}
    pairs = [CompilePair(publishers[run.source], eager[key(run)], run) for run in excluded_published_runs()
             if run.compile != "none" and not run.float8 and key(run) in eager]
    pairs += [CompilePair(publisher, e, c) for publisher, e, c in COMPILE_PAIRS_OUTSIDE_THE_FILE]
    return tuple(pairs)


def compile_ratio_estimates(held_out: dict[str, tuple[dict[str, float], dict]] | None = None,
                            all_rows_fit: dict[str, float] | None = None) -> list[tuple[CompilePair, float]]:
    """(pair, estimated compiled/eager ratio) for every compile_pairs() pair, both sides estimated with the eager
    constants fitted without the pair's publisher (`held_out`: held_out_by_publisher of the published rows, where
    computed; a publisher with no eager row in the fit takes `all_rows_fit`, the fit on every row)."""
    rows = list(published_runs())
    held_out = held_out_by_publisher(rows) if held_out is None else held_out
    out = []
    for pair in compile_pairs():
        if pair.publisher in held_out:
            fitted = held_out[pair.publisher][0]
        else:
            all_rows_fit = fit(rows) if all_rows_fit is None else all_rows_fit
            fitted = all_rows_fit
        out.append((pair, compiled_estimate(pair.compiled, fitted) / published_estimate(pair.eager, fitted)))
    return out


def held_out_by_row(rows) -> list[tuple[dict[str, float], float]]:
    """Leave-one-row-out: for each row, the constants fitted on every other row and its estimate."""
    out = []
    for i, run in enumerate(rows):
        fitted = fit(rows[:i] + rows[i + 1:])
        out.append((fitted, published_estimate(run, fitted)))
    return out
