"""The memory-tuning decision graph, walked over a trial backend.

    1 baseline       bf16 mixed precision (fp16 on GPUs without bf16), micro-batch 1
    2 checkpointing  out of memory?  checkpoint every decoder block
    3 offload        still out of memory?  activation offload (saved tensors to pinned host
                     memory), then CPU offload of parameters, then both
    4 grow           while it fits: double the micro-batch, then bisect (refine)
    5 align          the largest fitting micro-batch whose global batch is within tolerance
    6 explore        beyond the graph: lighter checkpointing, checkpointing with larger
                     micro-batches, no resharding -- these can beat the graph's first fit;
                     with compile "explore", the best fitting candidates with compiled blocks,
                     the fastest of them grown in micro-batch (compiled may save less);
                     with float8 "explore" (GPUs with float8), the best with each float8 recipe
    7 sample         only under --time-budget, while it lasts: an Optuna sampler (TPE, seeded)
                     draws from every knob's domain (autotune.problem.knobs), the simulator first as
                     the free oracle; configurations tried already are never repeated
    8 confirm        real backends re-run the winner once more

Every step is recorded with its reason. Where trials are real, the simulator predicts each
configuration first and those predicted not to fit are recorded as `pruned`, never launched.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable

from autotune.problem import knobs
from autotune.backends.analytic import screen_margin
from autotune.backends.base import TrialBackend, TrialResult
from autotune.problem.batch import within_tolerance
from autotune.problem.config import TrainConfig, problem_shape, stack_step
from autotune.util.cache import code_digest
from autotune.util.errors import UsageError
from autotune.problem.knobs import Checkpointing
from autotune.search.records import Step, TuneOutcome, TuneRequest, config_key, eligible, why_nothing_fits

EXPLORE_MARGIN = 0.03
"""Where throughput is only estimated, an exploration candidate whose closed-form estimate is
this far below the best so far is not evaluated: it cannot win (estimates agree within ~1%)."""

SATURATION_GAIN = 0.02
"""Exploration stops doubling a micro-batch once a doubling gains less than this in tokens/sec
while still below the best configuration found: throughput saturates with the micro-batch."""


COMBINED_CANDIDATES = 3
"""How many combinations of splits (tp x pp, tp x cp, cp x pp, tp x cp x pp) the search traces of each kind (the
closed form's first: _explore_combined): a pipeline candidate on a 70B model costs about a CPU-minute to trace
(docs/PIPELINE.md), and up to 12 pairs (more triples) are allowed."""

COMPILE_CANDIDATES = 2
"""With compile "explore": how many of the fastest fitting eager configurations are tried compiled."""

FLOAT8_CANDIDATES = 3
"""With float8 "explore": how many of the fitting high-precision configurations are tried with each float8
recipe, compiled ones first (_explore_float8)."""

ASYNC_TP_CANDIDATES = 2
"""Compiled tensor-parallel configurations (the fastest fitting) tried with async TP."""

def _layout(train: TrainConfig) -> tuple[int, ...]:
    """How a configuration splits the model and the batch over the GPUs: its mesh, not its step's knobs."""
    return (train.tensor_parallel, train.context_parallel, train.pipeline_parallel, train.expert_parallel,
            train.shard_group_size)


SAMPLER_SEED = 0
"""The sampler beyond the graph is seeded: the same problem samples the same configurations."""

SAMPLER_STARTUP = 8
"""TPE's random draws before it models where the fast configurations are."""

SAMPLER_REPEATS = 20
"""Consecutive proposals of configurations already tried after which the sampler is helped to an
untried one (drawn at random, seeded): TPE converges and would keep proposing its favourite."""

SAMPLER_SLACK = 0.02
"""Sampling stops this fraction of --time-budget early, besides the longest draw's time (the sampler's ask and
tell, the prediction, the trial) and, where a confirmation follows, the longest trial's: a hiccup longer than
any draw before it is what this covers."""


class BudgetExhausted(Exception):
    """--max-trials or --time-budget reached: stop trying, choose among what was measured."""


class Controller:
    def __init__(self, request: TuneRequest, backend: TrialBackend, *,
                 predictor: TrialBackend | None = None,
                 estimator: TrialBackend | None = None,
                 finished: dict[str, dict] | None = None,
                 on_step: Callable[[Step], None] | None = None,
                 on_start: Callable[[str, TrainConfig, str], None] | None = None) -> None:
        self.request = request
        self.backend = backend
        self.predictor = predictor
        # Only where the backend's own throughput is an estimate may a cheaper estimate skip work.
        self.estimator = estimator if backend.throughput_source == "estimated" else None
        self.finished = finished or {}
        self.on_step = on_step or (lambda step: None)
        self.on_start = on_start or (lambda stage, train, reason: None)
        self.steps: list[Step] = []
        self.notes: list[str] = [self.request.vllm_share["note"]] if self.request.vllm_share else []
        self._started = time.monotonic()
        self._evaluated = 0
        self._longest_trial_s = 0.0
        self.sampling: dict | None = None
        """What the sampler beyond the graph did (None: it did not run)."""
        self.compile_search, self.float8_search = self._searched_compile_and_float8()
        """The search space's compile and float8 modes, `auto` resolved for this run."""
        self.shape = problem_shape(request.model, request.cluster, request.seq_len, packed=request.packing is not None,
                                   step=stack_step(request.stack, request.space.precision, request.model.model_type))
        """What every candidate is checked against before it is tried (knobs.check_combination)."""

    # -- one trial -------------------------------------------------------------------------------
    def run(self, stage: str, train: TrainConfig, reason: str, *, reuse: bool = True) -> Step:
        """Evaluate `train` and record the step. With `reuse` (all but the confirmation), a
        configuration already evaluated in this run, or finished in the study, is not run again.
        A candidate the problem cannot hold (knobs.check_combination) is skipped with the reason in
        the notes, never an error for the whole run: only the baseline, which the user's own flags and
        search space make, is refused as their error."""
        try:
            spec = self.request.spec(train)
        except UsageError as exc:
            if stage == "baseline":
                raise
            return self._skip(stage, train, reason, str(exc))
        train = spec.train  # its one name (e.g. a placement that moves nothing is dim0)
        known = self._find(train) if reuse else None
        if known is not None:
            return known
        request = self.request
        batch = request.global_batch(train.micro_batch_size, ranks_per_batch=train.ranks_per_batch)
        key = config_key(train, grad_accum_steps=batch.grad_accum_steps, backend=self.backend.name)
        cached = self.finished.get(key) if reuse else None
        if cached is not None and self.backend.memory_source != "measured" and cached.get("made_by") != code_digest():
            # A prediction or estimate from other code (another autotune, torch or transformers) is made again:
            # a fixed closed form must not hand back the old answer. A measurement stays one.
            cached = None
        predicted: TrialResult | None = None
        reused_from = None
        if cached is not None:
            result = TrialResult.from_dict(cached["result"])
            predicted = TrialResult.from_dict(cached["predicted"]) if cached.get("predicted") else None
            reused_from = cached.get("number")
        else:
            self._check_budget()
            self.on_start(stage, train, reason)
            try:
                if self.predictor is not None:
                    predicted = self.predictor.evaluate(spec)
                if predicted is not None and predicted.status == "oom":
                    result = TrialResult(status="pruned", peak_memory=predicted.peak_memory,
                                         memory_breakdown=predicted.memory_breakdown,
                                         message=f"not launched: {predicted.message or 'predicted out of memory'}")
                else:
                    began = time.monotonic()
                    result = self.backend.evaluate(spec)
                    self._longest_trial_s = max(self._longest_trial_s, time.monotonic() - began)
            except UsageError as exc:  # a backend refusing what the search chose: skipped, not the user's error
                if stage == "baseline":
                    raise
                return self._skip(stage, train, reason, str(exc))
            self._evaluated += 1
        peak = result.peak_bytes
        fits = result.ok and (peak is None or peak <= request.memory_limit_bytes)
        if result.ok and not fits:
            result.message = (result.message + "; " if result.message else "") + "peak over the headroom limit"
        step = Step(step=len(self.steps) + 1, stage=stage, train=train, batch=batch, result=result,
                    fits=fits, reason=reason, backend=self.backend.name, predicted=predicted,
                    reused_from=reused_from)
        self.steps.append(step)
        self.on_step(step)
        return step

    def _skip(self, stage: str, train: TrainConfig, reason: str, why: str) -> Step:
        """A candidate that cannot be built: noted once, not recorded as a trial, and treated by the
        caller as not fitting (a bug in a generator below, where it happens: they propose only what
        check_combination accepts)."""
        note = f"skipped {train.label()} ({stage}: {reason}): cannot be built: {why}"
        if note not in self.notes:
            self.notes.append(note)
        return Step(step=0, stage=stage, train=train, batch=self.request.global_batch(train.micro_batch_size, ranks_per_batch=train.ranks_per_batch),
                    result=TrialResult(status="error", message=f"not built: {why}"), fits=False, reason=reason,
                    backend=self.backend.name)

    def _buildable(self, train: TrainConfig) -> bool:
        """Whether `train` makes a trial: check_combination's checks and the batch's (a pipeline schedule's
        micro-batches are the accumulation steps: TrialSpec checks them)."""
        if knobs.why_not_buildable(train.knob_values(), self.shape):
            return False
        try:
            self.request.spec(train)
        except UsageError:
            return False
        return True

    def _with_runnable_schedule(self, train: TrainConfig) -> TrainConfig:
        """`train` under the first pipeline schedule (knobs.PIPELINE_SCHEDULES' order) that runs its accumulation
        steps: 1F1B needs one micro-batch per stage, which a batch at FSDP's walls may not have."""
        if train.pipeline_parallel == 1 or self._buildable(train):
            return train
        for schedule in knobs.PIPELINE_SCHEDULES:
            if self._buildable(candidate := train.with_(pipeline_schedule=schedule)):
                return candidate
        return train

    def _could_win(self, train: TrainConfig) -> bool:
        """False if the estimator puts `train` clearly below the best so far (then noted)."""
        if (slower := self._screened_out(train)) is None:
            return True
        self._note_screened([train], [slower])
        return False

    def _screened_out(self, train: TrainConfig, estimated: TrialResult | None = None
                      ) -> tuple[float, float, Step] | None:
        """_slower_than_best for a candidate not yet run that can be built, else None (an unbuildable candidate:
        run() skips it with the reason in the notes)."""
        if self._find(train) or not self._buildable(train):
            return None
        return self._slower_than_best(train, estimated)

    def _note_screened(self, trains: list[TrainConfig], slower: list[tuple[float, float, Step]]) -> None:
        """One note for candidates the estimator put below the same best (alternatives of one knob, in one line)."""
        (first, *rest), best = trains, slower[0][2]
        shared = set(first.label().split())  # the rest by what differs from the first
        labels = ", ".join([first.label(), *(" ".join(w for w in t.label().split() if w not in shared) for t in rest)])
        figures = [f"{estimate:,.0f}" for estimate, _, _ in slower]
        figures = " and ".join([", ".join(figures[:-1]), figures[-1]] if len(figures) > 1 else figures)
        gaps = [estimate / reference - 1 for estimate, reference, _ in slower]
        gap = (f"{gaps[0]:+.1%}" if f"{max(gaps):+.1%}" == f"{min(gaps):+.1%}"
               else f"{max(gaps):+.1%} to {min(gaps):+.1%}")
        self.notes.append(f"not explored: {labels} (estimated {figures} tokens/s, {gap} vs the best "
                          f"{best.train.label()} estimated the same way)")

    def _note_screened_together(self, screened: list[tuple[TrainConfig, tuple[float, float, Step]]]) -> None:
        """_note_screened for alternatives screened out in one loop: one note for those of one micro-batch judged
        against the same best (a candidate that ran in between may have become the best)."""
        groups: dict[tuple, list] = {}
        for train, slower in screened:
            groups.setdefault((train.micro_batch_size, id(slower[2])), []).append((train, slower))
        for same in groups.values():
            self._note_screened([train for train, _ in same], [slower for _, slower in same])

    def _slower_than_best(self, train: TrainConfig, estimated: TrialResult | None = None
                          ) -> tuple[float, float, Step] | None:
        """(the estimate of `train`, the estimate of the best's configuration, the best) where the
        estimator puts `train` more than EXPLORE_MARGIN below the best so far, else None. Both are
        estimated the same way (the closed form), so a bias between it and the backend cancels: a
        candidate is judged by its estimate relative to the best's. `estimated`: `train`'s estimate,
        when the caller has it already."""
        best = self._choose()
        if self.estimator is None or best is None or not best.result.throughput:
            return None
        estimate = (estimated or self.estimator.evaluate(self.request.spec(train))).throughput
        reference = self.estimator.evaluate(self.request.spec(best.train)).throughput
        if estimate is None or not reference or estimate >= reference * (1 - EXPLORE_MARGIN):
            return None
        return estimate, reference, best

    def _find(self, train: TrainConfig) -> Step | None:
        return next((s for s in self.steps if s.train == train and s.stage != "confirm"), None)

    def _check_budget(self) -> None:
        request = self.request
        if request.max_trials is not None and self._evaluated >= request.max_trials:
            raise BudgetExhausted(f"--max-trials {request.max_trials} reached")
        if request.time_budget_s is not None and time.monotonic() - self._started >= request.time_budget_s:
            raise BudgetExhausted(f"--time-budget {request.time_budget_s:g}s reached")

    # -- the graph -------------------------------------------------------------------------------
    def tune(self) -> TuneOutcome:
        try:
            self._walk()
            self._sample()
        except BudgetExhausted as exc:
            self.notes.append(f"stopped early: {exc}; the winner is the best of what was evaluated")
        winner = self._choose()
        if winner is not None and self.backend.memory_source == "measured":
            try:
                confirmation = self.run("confirm", winner.train,
                                        f"confirm the winner (step {winner.step}) with a final real trial",
                                        reuse=False)
                if confirmation.fits:
                    winner = confirmation
                else:
                    self.notes.append(f"confirmation trial did not reproduce the fit "
                                      f"({confirmation.result.status}); winner kept from step {winner.step}")
            except BudgetExhausted as exc:
                self.notes.append(f"winner not confirmed: {exc}")
        return TuneOutcome(steps=self.steps, winner=winner, notes=self.notes, sampling=self.sampling)

    def _walk(self) -> None:
        space, cluster = self.request.space, self.request.cluster
        precision = space.precision
        if precision == "bf16" and not cluster.gpu.supports_bf16:
            precision = "fp16"
            self.notes.append(f"{cluster.gpu.name} has no bf16: fp16 with a sharded grad scaler instead")
        placement, why_placement = self._placement()
        base = TrainConfig(precision=precision, reshard_after_forward=space.reshard_after_forward,
                           optimizer_impl=space.optimizer_impl, shard_placement=placement,
                           compile="blocks" if self.compile_search == "blocks" else "none",
                           float8=self.float8_search if self.float8_search in knobs.FLOAT8_RECIPES else "none")
        numerics = f"{precision} mixed precision" if precision in ("bf16", "fp16") else precision
        if not self._aligned_sizes(1):
            # The batch wall: with FSDP alone every GPU takes a whole sequence per micro-step, and one
            # micro-step of one sequence each already overshoots the global batch.
            batch = self.request.global_batch(1)
            self.notes.append(f"FSDP alone cannot hit the global batch: one sequence per GPU is {batch.global_tokens:,} "
                              f"tokens per step, {batch.deviation:+.0%} off the target; tensor, context and pipeline "
                              "parallelism let several GPUs share one sequence")
            if self._explore_meshes(start=base.with_(
                    activation_checkpointing="full" if space.checkpointing else "none")):
                self._explore_the_step()
            else:
                self.notes.append("no tensor-, context- or pipeline-parallel degree the model and the cluster allow "
                                  "fits either")
            return
        step = self.run("baseline", base, f"start of the graph: {numerics}, micro-batch 1{why_placement}")
        if not step.fits and space.checkpointing:
            step = self.run("checkpointing", base.with_(activation_checkpointing="full"),
                            f"baseline {self._why(step)}: checkpoint every decoder block")
        if not step.fits and space.offload and not self._searches_offload:
            self.notes.append("CPU offload not tried: real CPU trials cannot apply it (FSDP2's CPUOffloadPolicy "
                              "pins host memory, which needs an accelerator); --backend sim predicts it")
        checkpointed = base.with_(activation_checkpointing="full" if space.checkpointing else "none")
        if not step.fits and self._searches_offload and space.offload_activations:
            step = self.run("act-offload", checkpointed.with_(activation_offload=True),
                            f"checkpointing every block {self._why(step)}: offload what forward saves (the "
                            "blocks' inputs) to pinned host memory; parameters stay on the GPU")
        if not step.fits and self._searches_offload:
            step = self.run("offload", checkpointed.with_(cpu_offload=True),
                            f"{step.train.label()} {self._why(step)}: offload parameters, gradients and "
                            "optimizer state to the CPU")
        if not step.fits and self._searches_offload and space.offload_activations:
            step = self.run("offload", checkpointed.with_(cpu_offload=True, activation_offload=True),
                            f"{self._why(step)} with parameters offloaded: offload the saved activations too")
        if not step.fits and self._explore_meshes(start=checkpointed):
            self._explore_the_step()  # the memory wall: FSDP alone holds nothing, a mesh does
            return
        if not step.fits:
            self.notes.append(why_nothing_fits(step, self.request))
            return
        largest = self._grow(step.train, stage="grow")
        self._align(largest)
        self._explore(step.train, largest)

    def _placement(self) -> tuple[str, str]:
        """The shard placement of every trial, and what the baseline's reason says of it. `auto`
        moves parameters off dimension 0 exactly where dim-0 shards would be mostly padding: a
        parameter's first dimension (the experts of a fused MoE weight) smaller than the shard group."""
        chosen, shard = self.request.space.shard_placement, self.request.cluster.num_gpus
        if chosen != "auto":
            return chosen, ""
        moved = knobs.shapes_moved_by_placement(self.request.model.block_param_shapes, shard)
        if not moved:
            stuck = sorted(shape for shape in self.request.model.block_param_shapes if shape[0] < shard)
            if stuck:  # smaller than the group, and no other dimension divides evenly: dim 0, padded
                self.notes.append(
                    f"parameters of shape {list(stuck[0])} have a first dimension smaller than the {shard} GPUs and no "
                    f"dimension {shard} divides: they stay on dimension 0, mostly padding on most GPUs; a GPU count "
                    "that divides one of their dimensions shards them evenly")
            return "dim0", ""
        small = min(shape[0] for shape in moved)
        return "largest", (f"; parameters with a first dimension of {small} on {shard} GPUs would be sharded mostly "
                           "into padding on dimension 0: shard them on their largest evenly divisible dimension "
                           "(--shard-placement largest, as torchtitan shards experts)")

    @property
    def _searches_offload(self) -> bool:
        return self.request.space.offload and self.backend.applies_cpu_offload

    @staticmethod
    def _why(step: Step) -> str:
        return {"oom": "is out of memory", "pruned": "is predicted out of memory",
                "error": "failed", "timeout": "timed out"}.get(step.result.status, "does not fit")

    def _grow(self, mode: TrainConfig, *, stage: str, until_saturated: bool = False) -> TrainConfig:
        """Double the micro-batch while it fits, then bisect. Returns the largest fitting config.

        until_saturated (exploration): also stop once doubling no longer pays and the branch is
        still slower than the best configuration so far."""
        limit = self.request.max_micro_batch_at(mode.ranks_per_batch)
        last_fit, first_fail = mode, None
        evaluated = self._find(mode)
        last_tps = evaluated.result.throughput if evaluated else None
        size = mode.micro_batch_size
        while size < limit:
            size = min(size * 2, limit)
            step = self.run(stage, mode.with_(micro_batch_size=size),
                            f"micro-batch {last_fit.micro_batch_size} fits: try {size}")
            best = self._choose()
            if not step.fits:
                first_fail = size
                # The failed size's throughput (where the backend still gives one) bounds the branch.
                bound = step.result.throughput
                if until_saturated and bound and best is not None and bound < (best.result.throughput or 0):
                    self.notes.append(f"not bisecting {mode.activation_checkpointing} checkpointing below "
                                      f"micro-batch {size}: even {size} would be slower than the best "
                                      f"({best.train.label()})")
                    return last_fit
                break
            last_fit = step.train
            tps = step.result.throughput
            if (until_saturated and tps and last_tps and best is not None and tps < best.result.throughput
                    and tps < last_tps * (1 + SATURATION_GAIN)):
                self.notes.append(f"stopped growing {mode.activation_checkpointing} checkpointing at micro-batch "
                                  f"{size}: doubling gained {tps / last_tps - 1:+.1%} tokens/s, still below "
                                  f"the best ({best.train.label()})")
                return last_fit
            last_tps = tps
        if first_fail is not None and self.request.space.refine:
            low, high = last_fit.micro_batch_size, first_fail
            while high - low > 1:
                middle = (low + high) // 2
                step = self.run("refine" if stage == "grow" else stage, mode.with_(micro_batch_size=middle),
                                f"bisect between {low} (fits) and {high} (does not)")
                if step.fits:
                    low, last_fit = middle, step.train
                else:
                    high = middle
        return last_fit

    def _aligned_sizes(self, upto: int, ranks_per_batch: int = 1) -> list[int]:
        """Micro-batches <= upto whose global batch is within tolerance, largest first. Token-budget batches
        hit the target in expectation only (their spread is stated): every budget is taken."""
        if self.request.packing is not None:
            return list(range(upto, 0, -1))
        return [m for m in range(upto, 0, -1) if within_tolerance(
            self.request.global_batch(m, ranks_per_batch=ranks_per_batch), self.request.tolerance)]

    def _align(self, largest: TrainConfig) -> None:
        aligned = self._aligned_sizes(largest.micro_batch_size, largest.ranks_per_batch)
        if aligned and aligned[0] != largest.micro_batch_size:
            m = aligned[0]
            self.run("align", largest.with_(micro_batch_size=m),
                     f"micro-batch {largest.micro_batch_size} misses the global batch by "
                     f"{self.request.global_batch(largest.micro_batch_size, ranks_per_batch=largest.ranks_per_batch).deviation:+.2%}: "
                     f"{m} is the largest within {self.request.tolerance:.1%}")

    def _checkpointing_modes(self) -> list[str]:
        """Every checkpointing mode the search space allows, least recompute first: none, one block in k (largest
        k first), the op-level policies, full. A mode that checkpoints the same blocks as none or full, or as an
        earlier one, is left out (every:1 is full)."""
        space, layers = self.request.space, self.request.model.num_layers

        def what(mode: str) -> tuple:
            ac = Checkpointing.parse(mode)  # op-level differs from full in what it saves, not in blocks
            return ac.policy, ac.blocks(layers)

        every = [f"every:{k}" for k in sorted(space.lighter_every, reverse=True)]
        op_level = [str(Checkpointing(mode="op", policy=policy)) for policy in space.op_level]
        seen, distinct = {what("none"), what("full")}, []
        for mode in [*every, *op_level]:
            if what(mode) not in seen:
                seen.add(what(mode))
                distinct.append(mode)
        return ["none", *distinct, "full"]

    def _explore(self, mode: TrainConfig, largest: TrainConfig) -> None:
        self._explore_checkpointing(mode, largest)
        self._explore_hsdp()
        self._explore_expert_parallel()
        self._explore_split("tensor_parallel")
        self._explore_split("pipeline_parallel")
        self._explore_tensor_pipeline()
        best = self._choose()
        if best is not None and best.train.activation_checkpointing.mode != "none":
            # Context parallelism trades ring sends for activation memory: beyond the walls it is worth a trial
            # only where the best so far pays for its activations with recompute.
            self._explore_split("context_parallel")
            self._explore_tensor_context()
            self._explore_context_pipeline()
            self._explore_tensor_context_pipeline()
        self._explore_the_step()

    def _explore_the_step(self) -> None:
        """What changes the step of the best layouts found, not their layout: resharding, compiled blocks, float8,
        async TP. Beyond the graph, and at FSDP's walls after the meshes (a mesh winner is compiled as any other)."""
        self._explore_no_reshard()
        self._explore_reshard_to_a_node()
        self._explore_compile()
        self._explore_float8()
        self._explore_async_tp()

    def _explore_checkpointing(self, mode: TrainConfig, largest: TrainConfig) -> None:
        """Lighter checkpointing than the graph's `mode` at its `largest` micro-batch, or checkpointing for a
        larger micro-batch than the graph's no-checkpointing limit."""
        space = self.request.space
        ceiling = self.request.max_micro_batch_at(largest.ranks_per_batch)
        modes = self._checkpointing_modes()  # least recompute first
        if mode.activation_checkpointing.mode == "full" and not mode.cpu_offload:
            for ac in (m for m in modes if m.startswith("every:")):
                if not self._could_win(largest.with_(activation_checkpointing=ac)):
                    continue
                step = self.run("explore", largest.with_(activation_checkpointing=ac),
                                f"if memory allows, checkpoint only one block in {ac.split(':')[1]}: less "
                                "recompute than checkpointing all of them")
                if step.fits:
                    break
            for ac in (m for m in modes if m.startswith("op")):
                if self._could_win(largest.with_(activation_checkpointing=ac)):
                    self.run("explore", largest.with_(activation_checkpointing=ac),
                             f"op-level checkpointing ({ac}) of every block: saves matmul outputs, so backward "
                             "recomputes less than full checkpointing")
        if (mode.activation_checkpointing.mode == "none" and space.checkpointing
                and space.explore_checkpointed_larger_micro_batch and largest.micro_batch_size < ceiling):
            # Least recompute first; a mode that keeps less may still hold a micro-batch the ones before it do not.
            reached, holds = largest.micro_batch_size, "no checkpointing"
            screened: list[tuple[TrainConfig, tuple]] = []
            for ac in modes[1:]:
                if reached >= ceiling:
                    break
                bigger = min(ceiling, reached * 2)
                candidate = largest.with_(activation_checkpointing=ac, micro_batch_size=bigger)
                if (slower := self._screened_out(candidate)) is not None:
                    screened.append((candidate, slower))
                    continue
                step = self.run("explore", candidate, f"checkpointing ({ac}) may allow micro-batch {bigger}, beyond the "
                                                      f"{reached} {holds} holds")
                if not step.fits:
                    continue
                grown, best = self._grow_branch(step.train), self._choose()
                over = [s.result.throughput for s in self.steps if not s.fits and s.train.micro_batch_size >
                        grown.micro_batch_size and s.train == grown.with_(micro_batch_size=s.train.micro_batch_size)]
                if not any(rate is None or best is None or rate >= (best.result.throughput or 0) for rate in over):
                    break  # stopped gaining, or even its first size over memory was slower than the best: more recompute pays less
                reached, holds = max(reached, grown.micro_batch_size), "lighter checkpointing"
            self._note_screened_together(screened)

    def _explore_no_reshard(self) -> None:
        """No resharding after forward on the best configuration, and on the layout (mesh splits) the closed form
        says gains most by it, whose all-gathers may weigh more than the best's: llama3-70b on 1024 GPUs wins with
        tp 4 x cp 2 x pp 2 kept gathered over the best resharding layout, tp 4 x cp 2 x pp 4."""
        best = self._choose()
        if best is None or not self.request.space.explore_no_reshard:
            return
        candidates = [best.train.with_(reshard_after_forward=False)] if best.train.reshard_after_forward else []
        if self.estimator is not None:
            fastest: dict[tuple[int, ...], Step] = {}  # each other layout's fastest resharding configuration
            for step in eligible(self.steps, self.request.tolerance):
                layout = _layout(step.train)
                if (step.train.reshard_after_forward and layout != _layout(best.train)
                        and (step.result.throughput or 0) > (fastest[layout].result.throughput or 0
                                                             if layout in fastest else -1)):
                    fastest[layout] = step

            def estimated(train: TrainConfig) -> float:  # 0 where the closed form says it does not fit
                result = self.estimator.evaluate(self.request.spec(train))
                fits = result.ok and (result.peak_bytes or 0) <= self.request.memory_limit_bytes
                return (result.throughput or 0.0) if fits else 0.0

            kept = [s.train.with_(reshard_after_forward=False) for s in fastest.values()]
            kept = [train for train in kept if self._buildable(train) and not self._find(train)]
            rate, runner_up = max(((estimated(train), train) for train in kept), key=lambda pair: pair[0],
                                  default=(0.0, None))
            if rate > 0:
                candidates.append(runner_up)
        for train in candidates:
            if self._could_win(train):
                self.run("explore", train, "keep gathered parameters after forward (no reshard): saves an all-gather "
                                           "per block in backward if memory allows")

    def _searched_compile_and_float8(self) -> tuple[str, str]:
        """The compile and float8 modes of this run: the search space's, with `auto` (the default)
        resolved to `explore` where the run can evaluate the knob and it can pay (a GPU's estimate,
        a GPU with float8, torchao installed), else `none`, the reason in the run's notes."""
        from autotune.problem.config import OWN_STEPS, stack_step

        space, request = self.request.space, self.request
        gpu, backend = request.cluster.gpu, self.backend.name
        own_step = stack_step(request.stack, space.precision, request.model.model_type)
        own_step = own_step if own_step in OWN_STEPS else None
        compile_mode, float8_mode = space.compile, space.float8
        why_not = ""
        if compile_mode == "auto":
            why_not = (f"--stack {own_step}: its own step is traced eager only here" if own_step
                       else "real CPU trials: inductor compiles every trial's blocks on the CPU (30-40 s a trial), "
                            "and CPU step times say nothing about compiled GPU throughput" if backend == "cpu"
                       else "")
            compile_mode = "none" if why_not else "explore"
        elif compile_mode == "none" and backend != "cpu":
            why_not = "--compile none"
        if why_not:
            gain = ""
            if backend != "cpu":  # the gain the closed form estimates at the default knobs, compiled (an estimate)
                try:
                    from autotune.backends.analytic import AnalyticBackend

                    spec = request.spec(TrainConfig(compile="blocks"))
                    ratio = (AnalyticBackend().evaluate(spec).extras.get("compile_speedup") or {}).get("ratio")
                    gain = (f": estimated {ratio - 1:+.0%} tokens/s for this model and cluster at "
                            f"{spec.train.label()}, its blocks' memory-bound ops fused "
                            "(costmodel.compiled_throughput; an estimate, not a measurement)") if ratio else ""
                except Exception:  # a note, never a failure of the run
                    gain = ""
            self.notes.append(f"not explored: torch.compile of the blocks ({why_not}; --compile explore traces it)"
                              + gain)
        if float8_mode == "auto":
            import importlib.util

            why_not = (f"{gpu.name} has no float8 tensor cores" if not gpu.has_float8
                       else f"--stack {own_step}: its own step is traced in high precision only here" if own_step
                       else f"--peft {request.finetuning.peft}: float8 would convert the frozen base linears too"
                       if request.finetuning.lora
                       else "real CPU trials: this CPU has no float8 units" if backend == "cpu"
                       else "the closed form (--backend analytic) does not cost float8" if backend == "analytic"
                       else "torchao, the float8 extra, is not installed (pip install 'autotune[float8]')"
                       if importlib.util.find_spec("torchao") is None else "")
            float8_mode = "none" if why_not else "explore"
            if why_not:
                self.notes.append(f"float8 not explored: {why_not}")
        elif float8_mode == "none" and gpu.has_float8 and backend != "cpu":
            self.notes.append(f"not explored: float8 training (--float8 explore: {gpu.name} has "
                              f"{gpu.float8_tflops:g} float8 TFLOP/s against {gpu.peak_tflops:g} bf16; +24-28% "
                              "tokens/s over compiled bf16 in torchtitan's and torchao's published Llama 3 8B H100 "
                              "runs, tensorwise, not estimated for this model)")
        elif float8_mode == "explore" and not gpu.has_float8:
            self.notes.append(f"float8 not explored: {gpu.name} has no float8 tensor cores")
            float8_mode = "none"
        return compile_mode, float8_mode

    def _explore_compile(self) -> None:
        """Compiled blocks (search compile "explore") on the fastest fitting eager configurations within
        the global batch's tolerance, then on the fastest eager ones that ran out of memory by a traced
        peak: compiled, the partitioner may recompute what eager saves (13 GiB less on llama-7b at
        micro-batch 2 without checkpointing, docs/COMPILE.md), so a lighter configuration can fit. Each
        is evaluated like any trial: predicted first where trials are real (pruned if predicted not to
        fit), its memory traced compiled."""
        if self.compile_search != "explore":
            return
        tolerance = self.request.tolerance

        def fastest_first(steps) -> list[Step]:
            return sorted((s for s in steps if s.train.compile == "none" and s.stage != "confirm"
                           and s.train.expert_parallel == 1),  # compile refuses expert parallelism's all-to-all
                          key=lambda s: s.result.throughput or 0.0, reverse=True)

        def traced_over_the_limit(step: Step) -> bool:  # not a closed-form estimate far over it, not an error
            peak = step.result.peak_memory
            return (not step.fits and step.result.status in ("ok", "oom", "pruned") and peak is not None
                    and "predicted" in peak.source and within_tolerance(step.batch, tolerance))

        fitting = fastest_first(eligible(self.steps, tolerance))
        over = fastest_first(s for s in self.steps if traced_over_the_limit(s))
        for candidates, why in ((fitting, "fits eager"), (over, "over the limit eager")):
            tried = 0
            for step in candidates:
                if tried == COMPILE_CANDIDATES:
                    break
                train, instead = self._compiled(step.train)
                if (train is None or self._find(train)  # e.g. a split compile is not built with
                        or (instead and self._estimated_far_over(train))  # its checkpointing changed: may not fit
                        or ((why != "fits eager" or instead) and not self._could_win(train))):
                    continue
                tried += 1
                self.run("explore", train, f"compile each decoder block of {step.train.label()} (step {step.step}, "
                                           f"{why}): the same configuration with torch.compile{instead}")
        self._grow_compiled()

    def _estimated_far_over(self, train: TrainConfig) -> bool:
        """Whether the estimator puts `train` far over the memory limit (_far_over_the_limit, then noted): a
        candidate whose checkpointing the search changed (a compiled tensor-parallel block checkpointed by op
        instead of whole) would otherwise take a candidate's place only to run out of memory."""
        return self.estimator is not None and self._far_over_the_limit(
            self.estimator.evaluate(self.request.spec(train)).peak_bytes or 0, compiled=train.compile != "none",
            what=train.label())

    def _far_over_the_limit(self, peak: int, *, compiled: bool, what: str) -> bool:
        """Whether an estimated `peak` is far over the memory limit (beyond what a compiled block's partitioner could
        save: screen_margin); then `what` is noted as not traced (a trace is minutes on a large model, and cannot
        fit)."""
        limit = self.request.memory_limit_bytes
        if peak <= limit * screen_margin(compiled):
            return False
        self.notes.append(f"not traced: {what} (estimated {peak / 2**30:.1f} GiB a GPU, far over the "
                          f"{limit / 2**30:.1f} GiB limit)")
        return True

    def _compiled(self, train: TrainConfig) -> tuple[TrainConfig | None, str]:
        """`train` with compiled blocks, and what was changed besides (for the reason); None where it does not
        build. torch cannot compile a tensor-parallel block checkpointed whole (knobs.check_combination): there the
        space's op-level checkpointing takes the whole-block one's place, as torchtitan's compiled TP recipes run."""
        compiled = train.with_(compile="blocks")
        if self._buildable(compiled):
            return compiled, ""
        if train.tensor_parallel > 1 and train.activation_checkpointing.mode in ("full", "every"):
            for policy in self.request.space.op_level:
                op = compiled.with_(activation_checkpointing=str(Checkpointing(mode="op", policy=policy)))
                if self._buildable(op):
                    return op, (f", op-level checkpointing ({op.activation_checkpointing}) in place of "
                                f"{train.activation_checkpointing}: torch cannot compile a tensor-parallel block "
                                "checkpointed whole")
        return None, ""

    def _grow_compiled(self) -> None:
        """Grow the fastest fitting compiled configuration's micro-batch as the graph grows eager's:
        compiled blocks may save less for backward than eager ones (the partitioner recomputes cheap
        ops), so the micro-batch eager stopped at can leave room compiled. Stops once a doubling no
        longer pays and the branch is still slower than the best."""
        compiled = [s for s in eligible(self.steps, self.request.tolerance)
                    if s.train.compile == "blocks" and s.train.float8 == "none" and s.stage != "confirm"]
        # The graph's resharding first (it grows eager that way too): no reshard keeps a gathered block
        # per block, memory a larger micro-batch would use; it is tried on the grown best after.
        resharding = [s for s in compiled if s.train.reshard_after_forward == self.request.space.reshard_after_forward]
        if not compiled:
            return
        fastest = max(resharding or compiled, key=lambda s: s.result.throughput or 0.0)
        if fastest.train.micro_batch_size < self.request.max_micro_batch:
            self._grow_branch(fastest.train)
            self._explore_no_reshard()

    def _grow_branch(self, train: TrainConfig) -> TrainConfig:
        """An exploration branch that fits at `train`: grow its micro-batch while doubling pays, then
        align the largest to the global batch if the branch could win. Returns the largest that fits."""
        largest = self._find(self._grow(train, stage="explore", until_saturated=True))
        best = self._choose()
        # A smaller micro-batch is slower still: align only a branch that could win.
        if best is None or (largest.result.throughput or 0) >= (best.result.throughput or 0):
            self._align(largest.train)
        return largest.train

    def _explore_float8(self) -> None:
        """float8 training (each recipe) on the fastest fitting high-precision configurations within the
        global batch's tolerance, compiled ones first (search float8 "explore", on a GPU with float8 only): eager,
        each linear's casts are separate kernels that cost about what the float8 matmuls save (torchtitan and
        torchao run float8 compiled), so an eager base would take a compiled one's place only to lose. Each is
        evaluated like any trial: predicted first where trials are real."""
        if self.float8_search != "explore":
            return
        fitting = sorted((s for s in eligible(self.steps, self.request.tolerance)
                          if s.train.float8 == "none" and s.stage != "confirm"),
                         key=lambda s: (s.train.compile != "none", s.result.throughput or 0.0), reverse=True)
        bases: list[TrainConfig] = []
        for step in fitting:
            if len(bases) == FLOAT8_CANDIDATES:
                break
            if step.train not in bases and any(self._buildable(step.train.with_(float8=recipe))
                                               for recipe in knobs.FLOAT8_RECIPES[1:]):
                bases.append(step.train)
        for base in bases:
            for recipe in knobs.FLOAT8_RECIPES[1:]:
                if not self._buildable(base.with_(float8=recipe)):  # a split float8 is not built with
                    continue
                self.run("explore", base.with_(float8=recipe),
                         f"float8 {recipe} on {base.label()} (fits in high precision): its block linears' "
                         "matmuls at the float8 rate")

    def _explore_async_tp(self) -> None:
        """Async TP on the fastest fitting compiled tensor-parallel configurations within the global batch's
        tolerance (float8 ones included), where trials can run it: the same configuration with its tensor-parallel
        collectives under the matmuls beside them, and a symmetric-memory workspace more."""
        if not (self.request.space.async_tensor_parallel and self.backend.applies_async_tp):
            return
        fitting = sorted((s for s in eligible(self.steps, self.request.tolerance)
                          if s.train.tensor_parallel > 1 and s.train.compile != "none"
                          and not s.train.async_tensor_parallel and s.stage != "confirm"),
                         key=lambda s: s.result.throughput or 0.0, reverse=True)
        tried = 0
        for step in fitting:
            if tried == ASYNC_TP_CANDIDATES:
                break
            train = step.train.with_(async_tensor_parallel=True)
            if self._find(train) or not self._buildable(train):
                continue
            tried += 1
            self.run("explore", train, f"async TP on {step.train.label()} (step {step.step}, fits): its tensor-parallel "
                                       "all-gathers and reduce-scatters overlapped with the matmuls they feed")

    def _explore_reshard_to_a_node(self) -> None:
        """On several nodes, when parameters are sharded across nodes: reshard each block after
        forward to a node's GPUs only (FSDP2's reshard_after_forward=N), so backward's all-gather
        stays on the node's links, for 1/N of the block kept between forward and backward."""
        cluster, best = self.request.cluster, self._choose()
        if (best is None or not self.request.space.explore_no_reshard or cluster.num_nodes < 2
                or not best.train.reshard_after_forward or best.train.reshard_group_size
                or best.train.shard_placement != "dim0"):  # FSDP2 reshards to a group on dimension 0 only
            return
        shard = best.train.shard_group_size or cluster.num_gpus
        group = cluster.gpus_per_node
        if group < 2 or shard <= group or shard % group:  # one GPU a node: a node's group is no resharding
            return
        train = best.train.with_(reshard_group_size=group)
        if self._buildable(train) and self._could_win(train):
            self.run("explore", train,
                     f"reshard after forward to a node's {group} GPUs: backward's all-gather stays within a node "
                     f"(not across {shard // group} nodes), each block keeping 1/{group} of its parameters")

    def _explore_hsdp(self) -> None:
        """On several nodes: shard within groups of a node (then 2, 3, ... nodes dividing the node count) and replicate across
        them, smallest group first: the all-gathers and reduce-scatters stay on the fastest links,
        and only a gradient all-reduce of each shard crosses groups. A smaller group holds a larger
        shard per GPU, so the first group that fits is the one to grow."""
        cluster, best = self.request.cluster, self._choose()
        if not self.request.space.hsdp or cluster.num_nodes < 2 or best is None:
            return
        for group in knobs.hsdp_group_sizes(self.shape):
            train = best.train.with_(shard_group_size=group)
            if self._buildable(train) and self._could_win(train):
                where = ("all-gathers and reduce-scatters stay within a node" if group == cluster.gpus_per_node
                         else f"all-gathers and reduce-scatters span {group // cluster.gpus_per_node} nodes, "
                              f"not {cluster.num_nodes}")
                step = self.run("explore", train,
                                f"HSDP: shard within groups of {group} GPUs, replicate across "
                                f"{cluster.num_gpus // group} groups: {where}, plus one all-reduce of each "
                                "gradient shard across groups")
                if step.fits:
                    self._align(self._grow(step.train, stage="explore", until_saturated=True))
                    return

    def _expert_parallel_degrees(self, train: TrainConfig) -> tuple[int, ...]:
        """Expert-parallel degrees above 1 that apply to `train`: a MoE model, degrees dividing its
        experts and the GPUs, up to a node's GPUs (the all-to-all stays on the node's links), with
        knobs expert parallelism is built with here: what knobs.check_combination accepts."""
        model, cluster = self.request.model, self.request.cluster
        if not self.request.space.expert_parallel or not model.num_experts:
            return ()
        return tuple(degree for degree in (2 ** k for k in range(1, cluster.gpus_per_node.bit_length()))
                     if self._buildable(train.with_(expert_parallel=degree)))

    def _explore_expert_parallel(self) -> None:
        """A MoE model: split each block's experts over 2, 4, ... GPUs of a node (--ep), smallest
        first. Each GPU then gathers its own experts only (1/ep of them), over the ep-times
        smaller group holding the same ones, and sends its tokens x top-k rows to the experts'
        GPUs by all-to-all (balanced routing assumed: docs/KNOBS.md). The fastest that fits is grown."""
        best = self._choose()
        if best is None:
            return
        fitting = []
        for degree in self._expert_parallel_degrees(best.train):
            train = best.train.with_(expert_parallel=degree)
            if not self._could_win(train):
                continue
            step = self.run("explore", train,
                            f"expert parallelism over {degree} GPUs: each holds {self.request.model.num_experts // degree}"
                            f" of the {self.request.model.num_experts} experts of every MoE block and gathers only "
                            "those; tokens reach their experts by all-to-all")
            if step.fits:
                fitting.append(step)
        if fitting:
            fastest = max(fitting, key=lambda s: s.result.throughput or 0.0)
            self._align(self._grow(fastest.train, stage="explore", until_saturated=True))

    def _explore_meshes(self, *, start: TrainConfig | None = None) -> bool:
        """Tensor, context, then pipeline parallelism (_explore_split), then the splits together (_explore_combined):
        tensor parallelism within pipelines and within context-parallel groups, pipelines over context-parallel
        groups, and all three; True where any fits."""
        found = [self._explore_split(knob, start=start) for knob in self._SPLITS]
        found.append(self._explore_tensor_pipeline(start=start))
        found.append(self._explore_tensor_context(start=start))
        found.append(self._explore_context_pipeline(start=start))
        found.append(self._explore_tensor_context_pipeline(start=start))
        return any(found)

    def _explore_tensor_pipeline(self, *, start: TrainConfig | None = None) -> bool:
        """FSDP x TP x PP (torchtitan's mesh for its 405B recipes, Llama 3's): pipeline stages over tensor-parallel
        groups (_explore_combined). True where one fits."""
        return self._explore_combined(("tensor_parallel", "pipeline_parallel"), start=start)

    def _explore_tensor_context(self, *, start: TrainConfig | None = None) -> bool:
        """FSDP x CP x TP (torchtitan's mesh order: cp groups of tp groups, within a node): each sequence split
        over the context-parallel ranks, each block's linears over the tensor-parallel ones, for sequences whose
        activations neither split holds alone within a node (_explore_combined). True where one fits."""
        return self._explore_combined(("tensor_parallel", "context_parallel"), start=start)

    def _explore_context_pipeline(self, *, start: TrainConfig | None = None) -> bool:
        """FSDP x CP x PP (torchtitan's order: pipeline stages over context-parallel groups, the ring running in
        every stage): long sequences on a model whose blocks and activations a node's context-parallel groups cannot
        hold together, the stages holding a share of the blocks each (_explore_combined). True where one fits."""
        return self._explore_combined(("context_parallel", "pipeline_parallel"), start=start)

    def _explore_tensor_context_pipeline(self, *, start: TrainConfig | None = None) -> bool:
        """FSDP x TP x CP x PP (torchtitan's full mesh, pp, dp_shard, cp, tp; Llama 3's long-context stage): tensor-
        parallel groups within context-parallel groups of a node, pipeline stages over them, where the three are
        searched: for sequences and models that no pair of splits holds (_explore_combined). True where one fits."""
        return self._explore_combined(("tensor_parallel", "context_parallel", "pipeline_parallel"), start=start)

    _COMBINED = {  # each combination's description, by its splits from the innermost; _COMBINED_SHORT its label
        ("tensor_parallel", "pipeline_parallel"):
            "tensor parallelism over {a} GPUs of a node within pipeline parallelism over {b} stages ({group} GPUs "
            "share a batch, each holding 1/{a} of 1/{b} of the decoder blocks)",
        ("tensor_parallel", "context_parallel"):
            "tensor parallelism over {a} GPUs within context parallelism over {b} such groups of a node ({group} GPUs "
            "share a batch, each holding 1/{a} of every block's linears and 1/{b} of every sequence)",
        ("context_parallel", "pipeline_parallel"):
            "context parallelism over {a} GPUs of a node within pipeline parallelism over {b} stages ({group} GPUs "
            "share a batch, each holding 1/{a} of every sequence and 1/{b} of the decoder blocks)",
        ("tensor_parallel", "context_parallel", "pipeline_parallel"):
            "tensor parallelism over {a} GPUs within context parallelism over {b} such groups of a node, within "
            "pipeline parallelism over {c} stages ({group} GPUs share a batch, each holding 1/{a} of every block's "
            "linears, 1/{b} of every sequence and 1/{c} of the decoder blocks)",
    }
    _COMBINED_SHORT = {("tensor_parallel", "pipeline_parallel"): "tp {a} x pp {b}",
                       ("tensor_parallel", "context_parallel"): "tp {a} x cp {b}",
                       ("context_parallel", "pipeline_parallel"): "cp {a} x pp {b}",
                       ("tensor_parallel", "context_parallel", "pipeline_parallel"): "tp {a} x cp {b} x pp {c}"}

    def _explore_combined(self, splits: tuple[str, ...], *, start: TrainConfig | None = None) -> bool:
        """Two or three splits together (`splits` from the innermost: tensor parallelism within pipelines or
        context-parallel groups, context parallelism within pipelines, or all three), where the space searches each
        (_explore_split tries each alone). Of every combination of degrees the model and the cluster allow, at most
        COMBINED_CANDIDATES are traced: those the closed form (the estimator) puts first, the fastest of those it says
        fit and keep the global batch, then the least memory of the rest (without an estimator, for each degree of
        the outermost split the widest inner split the cluster allows with it). Each is tried as _try_mesh says (at
        FSDP's walls, where its GPUs share each sequence, or where the estimate allows it to win); the fastest that
        fits is grown. True where one fits."""
        space = self.request.space
        degrees = [self._SPLIT_DEGREES[knob](self.shape)[1:] if getattr(space, knob) else () for knob in splits]
        base = self._mesh_base(start)
        if not all(degrees) or base is None:
            return False
        inner, outer = splits[:-1], splits[-1]
        combined = [self._with_runnable_schedule(base.with_(**dict(zip(splits, chosen))))
                    for chosen in itertools.product(*(reversed(d) for d in degrees[:-1]), degrees[-1])]
        combined = [train for train in combined if self._buildable(train)]

        def width(train: TrainConfig) -> int:  # GPUs of a node the inner splits share a sequence over
            return math.prod(getattr(train, knob) for knob in inner)

        peaks: dict[TrainConfig, int] = {}
        if self.estimator is not None:
            def rank(train: TrainConfig) -> tuple:
                estimate = self.estimator.evaluate(self.request.spec(self._with_loss_parallel(train)))
                batch = self.request.global_batch(1, ranks_per_batch=train.ranks_per_batch)
                peak = peaks[train] = estimate.peak_bytes or 0
                held = (estimate.ok and peak <= self.request.memory_limit_bytes
                        and within_tolerance(batch, self.request.tolerance))
                return (0, -(estimate.throughput or 0.0)) if held else (1, peak)
            combined.sort(key=rank)
        else:  # the widest inner split the cluster allows with each outer degree
            widest: dict[int, int] = {}
            for train in combined:
                widest[getattr(train, outer)] = max(widest.get(getattr(train, outer), 0), width(train))
            combined = [train for train in combined if width(train) == widest[getattr(train, outer)]]
        fitting, screened = [], []
        for train in combined[:COMBINED_CANDIDATES]:
            named = dict(zip("abc", (getattr(train, knob) for knob in splits)))
            short = self._COMBINED_SHORT[splits].format(**named)
            if self._far_over_the_limit(peaks.get(train, 0), compiled=train.compile != "none", what=short):
                continue
            what = self._COMBINED[splits].format(**named, group=train.ranks_per_batch)
            step = self._try_mesh(train, what, short, screened)
            if step is not None and step.fits:
                fitting.append(step)
        self._note_screened_together(screened)
        return self._grow_fastest(fitting)

    def _mesh_base(self, start: TrainConfig | None) -> TrainConfig | None:
        """What a mesh is split from: `start` (where the graph stopped), else the best so far or the first trial,
        without offload, compile, float8, HSDP, expert or other splits, at micro-batch 1 (grown after: a group of
        GPUs takes each batch)."""
        best = self._choose()
        base = start or (best.train if best is not None else self.steps[0].train if self.steps else None)
        if base is None:
            return None
        return base.with_(cpu_offload=False, activation_offload=False, compile="none", float8="none",
                          shard_group_size=0, reshard_group_size=0, expert_parallel=1, shard_placement="dim0",
                          tensor_parallel=1, async_tensor_parallel=False, loss_parallel=False, context_parallel=1,
                          pipeline_parallel=1, micro_batch_size=1)

    def _try_mesh(self, train: TrainConfig, what: str, short: str, screened: list) -> Step | None:
        """Run the mesh `train` (`what` it is, in the reason; `short`, in a retry's) where FSDP is at its walls (nothing
        fits or keeps the global batch, or only CPU offload holds the model: then the mesh is traced, not judged by two
        estimates of unlike costs) or the estimate allows it to win, again with every block checkpointed where it
        does not fit. None where it is not run; one the estimate screens out is added to `screened` (the caller
        notes the degrees it tried together)."""
        train = self._with_loss_parallel(train)
        best = self._choose()
        wall = best is None or best.train.cpu_offload
        if not wall:
            train, estimated = self._at_estimated_checkpointing(train)
            if (slower := self._screened_out(train, estimated)) is not None:
                screened.append((train, slower))
                return None
        why = ("FSDP alone holds no configuration of this problem" if best is None else
               f"FSDP holds this problem only with CPU offload ({best.train.label()})" if wall else
               "the estimate allows a mesh to win" if self.estimator is not None else
               "no estimator to screen meshes with")
        step = self.run("explore", train, f"{why}: {what}")
        if not step.fits and train.activation_checkpointing.mode != "full" and self.request.space.checkpointing:
            step = self.run("explore", train.with_(activation_checkpointing="full"),
                            f"{short} {self._why(step)}: checkpoint every block too")
        return step

    def _at_estimated_checkpointing(self, train: TrainConfig) -> tuple[TrainConfig, TrialResult | None]:
        """The mesh `train` at the checkpointing the estimator puts fastest among those it says fit (`train`'s own
        included), and that estimate (None where none fits or there is no estimator). A mesh's split shrinks each
        GPU's activations, so the checkpointing FSDP needed is often more than the mesh does: judged at FSDP's, a
        mesh that wins with lighter checkpointing would be screened out."""
        if self.estimator is None or not self.request.space.checkpointing:
            return train, None
        fastest, fastest_estimate = train, None
        for mode in self._checkpointing_modes():
            candidate = train.with_(activation_checkpointing=mode)
            if not self._buildable(candidate):
                continue
            estimate = self.estimator.evaluate(self.request.spec(candidate))
            if (estimate.ok and (estimate.peak_bytes or 0) <= self.request.memory_limit_bytes and estimate.throughput
                    and (fastest_estimate is None or estimate.throughput > fastest_estimate.throughput)):
                fastest, fastest_estimate = candidate, estimate
        return fastest, fastest_estimate

    def _with_loss_parallel(self, train: TrainConfig) -> TrainConfig:
        """A tensor-parallel mesh with loss parallelism where it applies and the space allows it (torchtitan's
        default: the head and its logits split by vocabulary, less memory and head compute for a small reduction
        in the loss), as it is."""
        if train.tensor_parallel == 1 or train.loss_parallel or not self.request.space.loss_parallel:
            return train
        split = train.with_(loss_parallel=True)
        return split if self._buildable(split) else train

    def _grow_fastest(self, fitting: list[Step]) -> bool:
        """Grow (and align) the fastest of the mesh trials that fit, and try lighter checkpointing on it; True where
        there is one."""
        if not fitting:
            return False
        fastest = max(fitting, key=lambda s: s.result.throughput or 0.0)
        largest = self._grow(fastest.train, stage="explore", until_saturated=True)
        self._align(largest)
        self._explore_checkpointing(fastest.train, largest)
        return True

    _SPLITS = {
        "tensor_parallel": ("tensor parallelism", "{n} GPUs of a node", "each holds and computes 1/{n} of every "
                                                                      "block's linears"),
        "context_parallel": ("context parallelism", "{n} GPUs of a node", "each holds 1/{n} of every sequence, "
                                                                        "attention as a ring"),
        "pipeline_parallel": ("pipeline parallelism", "{n} stages", "each holds 1/{n} of the decoder blocks, the "
                                                                    "micro-batches flowing stage to stage"),
    }
    _SPLIT_DEGREES = {"tensor_parallel": knobs.tensor_parallel_degrees,
                      "context_parallel": knobs.context_parallel_degrees,
                      "pipeline_parallel": knobs.pipeline_parallel_degrees}

    def _explore_split(self, knob: str, *, start: TrainConfig | None = None) -> bool:
        """Split over 2, 4 or 8 GPUs of a node (--tp: each block's linears, as the model's transformers plan says;
        --cp: each sequence, ring attention), smallest degree first, where FSDP alone cannot hold the problem
        (`start`: nothing fitted; or no configuration hits the global batch, each GPU needing a whole sequence)
        or where the estimate says a mesh may win. A degree that does not fit is tried again with every block
        checkpointed; the fastest that fits is grown. True where one fits."""
        base = self._mesh_base(start)
        searched = getattr(self.request.space, knob)
        degrees = self._SPLIT_DEGREES[knob](self.shape)[1:] if searched else ()
        if base is None or not degrees:
            return False
        name, where, what = self._SPLITS[knob]
        fitting, screened = [], []
        for degree in degrees:
            train = self._with_runnable_schedule(base.with_(**{knob: degree}))
            over = where.format(n=degree)
            step = self._try_mesh(train, f"{name} over {over} ({what.format(n=degree)}; {degree} GPUs share a batch)",
                                  f"{name} over {over}", screened)
            if step is not None and step.fits:
                fitting.append(step)
        self._note_screened_together(screened)
        return self._grow_fastest(fitting)

    # -- beyond the graph: sampling under --time-budget ----------------------------------------------
    def _sample_domains(self) -> dict[str, tuple]:
        request, space, cluster = self.request, self.request.space, self.request.cluster
        base = self.steps[0].train
        groups = knobs.hsdp_group_sizes(self.shape) if space.hsdp else ()

        def degrees(knob: str) -> tuple[int, ...]:  # HSDP is built without the meshes: drawn apart
            return self._SPLIT_DEGREES[knob](self.shape) if getattr(space, knob) and not groups else (1,)

        tensor, context, pipeline = degrees("tensor_parallel"), degrees("context_parallel"), degrees("pipeline_parallel")
        compile_modes = ("none", "blocks") if self.compile_search == "explore" else (base.compile,)
        split = len(tensor) > 1
        # Micro-batches that keep the global batch with some group of GPUs sharing each batch: a draw whose own
        # group misses it is worth 0 to the sampler (_sample_value).
        groups_of = {tp * cp * pp for tp in tensor for cp in context for pp in pipeline}
        micro_batches = sorted({size for ranks in groups_of if cluster.num_gpus % ranks == 0
                                for size in self._aligned_sizes(request.max_micro_batch_at(ranks), ranks)})
        ctx = knobs.SampleContext(
            precision=base.precision, micro_batches=tuple(micro_batches),
            num_layers=request.model.num_layers, checkpointing=space.checkpointing, op_level=space.checkpointing,
            offload=self._searches_offload,
            activation_offload=self._searches_offload and space.offload_activations,
            reshard=(True, False) if space.explore_no_reshard else (base.reshard_after_forward,),
            placements=(base.shard_placement,),
            compile_modes=compile_modes,
            float8_recipes=(knobs.FLOAT8_RECIPES if self.float8_search == "explore" and cluster.gpu.has_float8
                            else (base.float8,)),
            hsdp_groups=tuple(groups),
            tensor_parallel=tensor, context_parallel=context,
            async_tensor_parallel=((False, True) if split and "blocks" in compile_modes and space.async_tensor_parallel
                                   and self.backend.applies_async_tp else (False,)),
            loss_parallel=(False, True) if split and space.loss_parallel else (False,),
            pipeline_parallel=pipeline,
            pipeline_schedules=knobs.PIPELINE_SCHEDULES if space.pipeline_parallel and not groups else ("1F1B",),
            expert_parallel=(1, *self._expert_parallel_degrees(base)) if not groups else (1,),
            reshard_groups=(cluster.gpus_per_node,) if (space.explore_no_reshard and cluster.num_nodes > 1
                                                        and cluster.gpus_per_node > 1
                                                        and base.shard_placement == "dim0") else ())
        return knobs.sample_domains(ctx)

    def _sample_value(self, step: Step) -> float:
        """What the sampler maximises: tokens/s of a configuration that fits the global batch, else 0."""
        if not step.fits or not within_tolerance(step.batch, self.request.tolerance):
            return 0.0
        return float(step.result.throughput or 0.0)

    def _time_left(self) -> float:
        return self.request.time_budget_s - (time.monotonic() - self._started)

    def _sample(self) -> None:
        """While --time-budget lasts, after the graph's winner: draw configurations from every knob's
        domain with a seeded TPE sampler. A real trial is launched only for a configuration the
        simulator predicts to fit (the others are counted, not recorded); on estimated backends a
        configuration the closed form puts clearly below the best is not traced either."""
        if self.request.time_budget_s is None or self._choose() is None:
            return
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        domains = self._sample_domains()
        names = list(domains)
        encode = {name: {knobs.BY_NAME[name].to_json(v): v for v in values} for name, values in domains.items()}
        distributions = {name: optuna.distributions.CategoricalDistribution(list(encode[name]))
                         for name in names}
        size = math.prod(len(v) for v in domains.values())
        sampler = optuna.samplers.TPESampler(seed=SAMPLER_SEED, n_startup_trials=SAMPLER_STARTUP)
        study = optuna.create_study(direction="maximize", sampler=sampler)

        def params(train: TrainConfig) -> dict | None:
            values = {n: knobs.BY_NAME[n].to_json(getattr(train, n)) for n in names}
            return values if all(v in encode[n] for n, v in values.items()) else None

        # What the graph evaluated teaches the sampler first; those configurations are never repeated.
        tried: dict[TrainConfig, float] = {}
        for step in self.steps:
            if step.stage != "confirm" and (p := params(step.train)) is not None:
                value = self._sample_value(step)
                tried[step.train] = max(tried.get(step.train, 0.0), value)
                study.add_trial(optuna.trial.create_trial(params=p, distributions=distributions, value=value))
        stats = {"sampler": "optuna TPESampler", "seed": SAMPLER_SEED, "space_size": size,
                 "from_graph": len(tried), "sampled": 0, "predicted_not_to_fit": 0, "estimated_not_to_fit": 0,
                 "estimated_slower": 0, "not_buildable": 0, "off_the_batch": 0,
                 "stopped": "", "source": "knob domains in autotune/problem/knobs.py"}
        self.sampling = stats
        rng = random.Random(SAMPLER_SEED)
        repeats = 0
        reserve = 1 if self.backend.memory_source == "measured" else 0  # the confirmation trial's time
        longest_draw = 0.0  # the longest draw so far: the sampler's ask and tell, a prediction, the trial if any
        try:
            while True:
                if len(tried) >= size:
                    stats["stopped"] = f"space exhausted: all {size} configurations tried"
                    break
                # Never start a draw that cannot finish in time (nor one that leaves none to confirm): on a loaded
                # machine the sampler's own work between trials can outlast a fast trial.
                margin = (max(longest_draw, self._longest_trial_s) + self._longest_trial_s * reserve
                          + SAMPLER_SLACK * self.request.time_budget_s)
                if self._time_left() <= margin:
                    stats["stopped"] = (f"--time-budget {self.request.time_budget_s:g}s spent" +
                                        (" (the longest trial's time kept for the confirmation)" if reserve else ""))
                    break
                if repeats >= SAMPLER_REPEATS:  # help a converged sampler to an untried configuration
                    untried = self._untried(domains, tried, rng)
                    study.enqueue_trial({n: knobs.BY_NAME[n].to_json(getattr(untried, n)) for n in names})
                    repeats = 0
                began = time.monotonic()
                try:
                    trial = study.ask(distributions)
                    train = TrainConfig(**{n: encode[n][trial.params[n]] for n in names})
                    if train in tried:
                        study.tell(trial, tried[train])
                        repeats += 1
                        continue
                    repeats = 0
                    value = self._sample_one(train, stats)
                    tried[train] = value
                    study.tell(trial, value)
                finally:  # a repeat's draw counts too: its ask and tell are the sampler's own work
                    longest_draw = max(longest_draw, time.monotonic() - began)
        except BudgetExhausted as exc:  # --max-trials: the confirmation says what it could not do
            stats["stopped"] = str(exc)
        self.notes.append(f"sampled beyond the graph ({stats['sampler']}, seed {SAMPLER_SEED}, {size:,} "
                          f"configurations in the knob space): {stats['sampled']} trials, "
                          f"{stats['predicted_not_to_fit']} predicted not to fit (not launched), "
                          f"{stats['estimated_not_to_fit']} estimated far over the memory limit and "
                          f"{stats['estimated_slower']} estimated slower than the best (neither traced), "
                          f"{stats['not_buildable']} combining knobs the problem cannot hold and "
                          f"{stats['off_the_batch']} missing the global batch (neither tried); "
                          f"stopped: {stats['stopped']}")

    def _untried(self, domains: dict[str, tuple], tried: dict, rng: random.Random) -> TrainConfig:
        """A configuration not tried yet, at random (the space is small enough to draw until one is new)."""
        names = list(domains)
        while True:
            train = TrainConfig(**{n: rng.choice(domains[n]) for n in names})
            if train not in tried:
                return train

    def _sample_one(self, train: TrainConfig, stats: dict) -> float:
        """Evaluate one sampled configuration, the free oracle first; returns the sampler's value. A
        draw that combines knobs the problem cannot hold (each domain is valid alone: e.g. HSDP with
        expert parallelism) is counted, not tried."""
        if not self._buildable(train):
            stats["not_buildable"] += 1
            return 0.0
        batch = self.request.global_batch(train.micro_batch_size, ranks_per_batch=train.ranks_per_batch)
        if self.request.packing is None and not within_tolerance(batch, self.request.tolerance):
            stats["off_the_batch"] += 1  # its micro-batch keeps the batch with another group of GPUs, not this one
            return 0.0
        spec = self.request.spec(train)
        if self.predictor is not None:  # real trials: the simulator predicts first, for free
            predicted = self.predictor.evaluate(spec)
            if predicted.status == "oom":
                stats["predicted_not_to_fit"] += 1
                return 0.0
        best = self._choose()
        if self.estimator is not None and best is not None and best.result.throughput:
            closed_form = self.estimator.evaluate(spec)
            margin = screen_margin(train.compile != "none")
            if (closed_form.peak_bytes or 0) > self.request.memory_limit_bytes * margin:
                stats["estimated_not_to_fit"] += 1  # not traced: far over the limit even allowing the bias
                return 0.0
            if (slower := self._slower_than_best(train, closed_form)) is not None:
                estimate, reference, best = slower
                stats["estimated_slower"] += 1
                return estimate * best.result.throughput / reference  # on the backend's scale
        step = self.run("sample", train, f"drawn by the sampler beyond the graph (TPE, seed {SAMPLER_SEED}): "
                                         "a configuration the graph did not try")
        stats["sampled"] += 1
        return self._sample_value(step)

    def _choose(self) -> Step | None:
        candidates = eligible(self.steps, self.request.tolerance)
        if not candidates:
            return None
        # Fastest first; among equals (or without a throughput figure) the smaller peak.
        return max(candidates, key=lambda s: (s.result.throughput or 0.0, -(s.result.peak_bytes or 0)))
