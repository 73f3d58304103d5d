"""The records of a tuning run: what was asked (TuneRequest), each step taken (Step) and the
outcome. The controller produces them; the store and the result document read them, without
importing the controller.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from autotune.backends.base import TrialResult
from autotune.problem.batch import DEFAULT_TOLERANCE, GlobalBatch, plan_global_batch, within_tolerance
from autotune.problem.catalog.models import ModelSpec
from autotune.problem import knobs
from autotune.problem.config import Cluster, FineTuning, TrainConfig, TrialSpec, Workload, memory_limit_bytes
from autotune.problem.packing import Packing
from autotune.problem.routing import RoutingSkew
from autotune.search.space import SearchSpace

DEFAULT_HEADROOM = 0.10
"""Fraction of GPU memory kept free: allocator fragmentation spikes, NCCL growth, a longer batch."""


@dataclass(frozen=True, kw_only=True)
class TuneRequest:
    model: ModelSpec
    cluster: Cluster
    seq_len: int
    target_tokens: int
    tolerance: float = DEFAULT_TOLERANCE
    headroom: float = DEFAULT_HEADROOM
    space: SearchSpace = field(default_factory=SearchSpace)
    max_trials: int | None = None
    time_budget_s: float | None = None
    workload: Workload = field(default_factory=Workload)
    finetuning: FineTuning = field(default_factory=FineTuning)
    stack: str = "fsdp2"
    """Whose training step is predicted (config.STACKS)."""
    vllm_share: dict | None = field(default=None, compare=False)
    """grpo: how vLLM's share was fixed or chosen and its estimated need (vllm_share.choose_share)."""
    routing_skew: RoutingSkew = field(default_factory=RoutingSkew)
    """A MoE model's routing assumption (autotune/problem/routing.py): every trial is predicted under it."""
    packing: Packing | None = None
    """Token-budget batches (autotune/problem/packing.py): the micro-batch searched is the budget in units of seq_len."""

    @property
    def memory_limit_bytes(self) -> int:
        return memory_limit_bytes(self.cluster.capacity_bytes, headroom=self.headroom, workload=self.workload)

    def describe_limit(self) -> str:
        """How the limit was reached from the capacity, for messages."""
        from autotune.util.units import format_bytes

        capacity = self.cluster.capacity_bytes
        vllm = self.workload.vllm_bytes(capacity)
        share = (f" less vLLM's {self.workload.vllm_gpu_memory_utilization:g} ({format_bytes(vllm)})"
                 if vllm else "")
        return (f"{format_bytes(self.memory_limit_bytes)} per GPU ({format_bytes(capacity)}{share}, "
                f"less {self.headroom:.0%} headroom)")

    @property
    def max_micro_batch(self) -> int:
        """Beyond this, even one accumulation step overshoots the global batch."""
        return self.max_micro_batch_at(1)

    def max_micro_batch_at(self, ranks_per_batch: int) -> int:
        """max_micro_batch where each group of `ranks_per_batch` GPUs (tensor- or context-parallel) takes one batch."""
        per_rank_sequences = self.target_tokens // (self.cluster.num_gpus // ranks_per_batch * self.seq_len)
        return max(1, min(self.space.max_micro_batch, per_rank_sequences))

    def global_batch(self, micro_batch_size: int, *, ranks_per_batch: int = 1) -> GlobalBatch:
        """The accumulation that hits the target: each data rank (a tensor- or context-parallel group of
        `ranks_per_batch` GPUs shares one batch) takes `micro_batch_size` sequences per micro-step."""
        packed = None
        if self.packing is not None:
            stats = self.packing.stats(micro_batch_size * self.seq_len, self.seq_len)
            packed = (stats.tokens, stats.tokens_std)
        return plan_global_batch(target_tokens=self.target_tokens, num_gpus=self.cluster.num_gpus // ranks_per_batch,
                                 seq_len=self.seq_len, micro_batch_size=micro_batch_size, packed=packed)

    def spec(self, train: TrainConfig) -> TrialSpec:
        return TrialSpec(model=self.model, cluster=self.cluster, seq_len=self.seq_len, train=train,
                         grad_accum_steps=self.global_batch(train.micro_batch_size,
                                                           ranks_per_batch=train.ranks_per_batch).grad_accum_steps,
                         memory_limit_bytes=self.memory_limit_bytes, workload=self.workload,
                         finetuning=self.finetuning, stack=self.stack, routing_skew=self.routing_skew,
                         packing=self.packing)


@dataclass(kw_only=True)
class Step:
    """One evaluated configuration and why the controller tried it."""

    step: int
    stage: str
    train: TrainConfig
    batch: GlobalBatch
    result: TrialResult
    fits: bool
    reason: str
    backend: str
    predicted: TrialResult | None = None
    reused_from: int | None = None

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured tensor-level peak, where a trial has both."""
        if self.predicted is None or self.result.status != "ok" or self.result.peak_memory is None:
            return None
        if self.result.peak_memory.source != "measured":
            return None
        measured = self.result.extras.get("tensor_peak_bytes")
        predicted = self.predicted.extras.get("tensor_peak_bytes")
        if not measured or predicted is None:
            return None
        return (predicted - measured) / measured

    @property
    def device_total_error(self) -> float | None:
        """(predicted total - measured device-level peak) / measured, for real cuda trials."""
        if self.prediction_error is None or self.predicted.peak_memory is None:
            return None
        measured = self.result.extras.get("device_peak_bytes")
        return (self.predicted.peak_memory.value - measured) / measured if measured else None


def eligible(steps: list[Step], tolerance: float) -> list[Step]:
    """The steps that could win: they fit, with the global batch within `tolerance` of the target."""
    return [s for s in steps if s.fits and within_tolerance(s.batch, tolerance)]


def why_lost(step: Step, winner: Step | None, request: TuneRequest,
             runnable: list[Step] | None = None) -> tuple[str, str] | None:
    """Why a trial that ran to its figures did not win: one word for the console's table and the
    sentence for trials.csv and report.html. None for the winner, and for trials whose status
    already says it (oom, pruned, error)."""
    from autotune.util.units import format_bytes

    result = step.result
    if winner is None or step is winner or not result.ok:
        return None
    if not step.fits:
        peak = result.peak_memory
        return "headroom", (f"peak {format_bytes(peak.value)} ({peak.source}) is over the memory limit of "
                            f"{request.describe_limit()}")
    if not within_tolerance(step.batch, request.tolerance):
        return "batch", (f"global batch {step.batch.global_tokens:,} tokens is {step.batch.deviation:+.1%} off the "
                         f"target {step.batch.target_tokens:,}, beyond the {request.tolerance:.1%} tolerance")
    if runnable is not None and step not in runnable:
        return "stack", f"needs a knob --stack {request.stack}'s file cannot set (the run's notes say which)"
    if step.train == winner.train:
        return "same", f"the winner's configuration; trial {winner.step} ({winner.stage}) is the one that counts"

    def figure(s: Step) -> str:
        tps = s.result.tokens_per_sec
        return f"{tps.value:,.0f} tokens/s ({tps.source})" if tps and tps.value else "no throughput figure"

    return "slower", f"{figure(step)} against the winner's {figure(winner)} (trial {winner.step})"


def prediction_summary(steps: list[Step]) -> dict | None:
    """How far the simulator's tensor peaks were from the measured ones over a run."""
    errors = [s.prediction_error for s in steps if s.prediction_error is not None]
    if not errors:
        return None
    ordered = sorted(abs(e) for e in errors)
    summary = {"trials": len(errors), "median_abs": ordered[len(ordered) // 2], "max_abs": ordered[-1],
               "what": "relative error of the predicted tensor-level peak against the measured one",
               "device_total": None}
    # Real cuda trials: the predicted total (tensor peak + runtime terms) against the
    # device-level peak (reserved + outside the allocator), the quantity that prunes trials.
    totals = sorted(abs(e) for e in (s.device_total_error for s in steps) if e is not None)
    if totals:
        summary["device_total"] = {"trials": len(totals), "median_abs": totals[len(totals) // 2],
                                   "max_abs": totals[-1], "what": "relative error of the predicted total "
                                   "against the device-level peak (max_memory_reserved + memory outside the allocator)"}
    return summary


def config_key(train: TrainConfig, *, grad_accum_steps: int, backend: str) -> str:
    """Identity of a trial in the study, for resuming."""
    return json.dumps({**knobs.identity(train.knob_values()), "grad_accum_steps": grad_accum_steps, "backend": backend},
                      sort_keys=True)


def at_batch_wall(steps: list[Step] | tuple[Step, ...]) -> bool:
    """Whether a search without a winner was stopped by the global batch, not memory: some configuration fit (none
    keeping the batch within tolerance, or it would have won)."""
    return any(s.fits for s in steps)


def why_nothing_fits(last: Step, request: TuneRequest, steps: list[Step] | tuple[Step, ...] = ()) -> str:
    """Which limit the last, most memory-saving configuration hit, and what to do about it; where some of `steps`
    fit in memory but none keeps the global batch (the batch wall: each data rank needs a whole sequence), that."""
    from autotune.util.units import format_bytes

    if at_batch_wall(steps):
        fitting = [s for s in steps if s.fits]
        closest = min(fitting, key=lambda s: abs(s.batch.deviation))
        pipelines = ("" if request.space.pipeline_parallel or not request.space.tensor_parallel else
                     ", or let pipeline stages share each sequence too (explore.pipeline_parallel = true in a --space "
                     "file: docs/PIPELINE.md)")
        return (f"no configuration keeps the global batch: {len(fitting)} fit in memory, but the closest, "
                f"{closest.train.label()}, takes {closest.batch.global_tokens:,} tokens a step "
                f"({closest.batch.deviation:+.0%} off {request.target_tokens:,}, tolerance {request.tolerance:.1%}): "
                f"raise --global-tokens or use fewer GPUs{pipelines}")
    message = last.result.message or ""
    if last.result.status == "error":  # not a memory limit: more GPUs would not help
        return (f"no configuration could be evaluated: the last trial ({last.train.label()}) failed: {message}; "
                "every trial is in the run folder")
    if last.train.cpu_offload and "host memory" in message:
        return (f"no configuration fits: CPU offload fits the GPUs but not the host ({message}); add GPUs or "
                "nodes (less host memory per node), or pass the nodes' real --host-memory if it is larger")
    lower = "lower --headroom" + (" or --vllm-gpu-memory-utilization" if request.workload.kind == "grpo" else "")
    return (f"no configuration fits within {request.describe_limit()}, even at micro-batch 1 with every memory "
            f"saving allowed: add GPUs, lower --seq-len, or {lower}")


@dataclass
class TuneOutcome:
    steps: list[Step]
    winner: Step | None
    notes: list[str]
    sampling: dict | None = None
    """What the sampler beyond the graph did under --time-budget (None: it did not run)."""


