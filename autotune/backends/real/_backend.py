"""RealBackend: real FSDP2 training steps launched with torchrun, every figure measured."""

from __future__ import annotations

import json
import platform
import shutil
import statistics
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from autotune.backends.base import Figure, TrialBackend, TrialResult
from autotune.backends.real._launcher import Launch, LaunchOptions, TrialOutcome
from autotune.problem.config import TrialSpec
from autotune.util.errors import UsageError
from autotune.problem.catalog.models import model_flops_per_token

DEVICES = ("cpu", "cuda")
RANK_PROCESS_BYTES = 600 * 2**20
"""Host memory of one CPU trial rank besides its tensors (Python, torch, transformers): an
estimate, above the ~475 MiB peak RSS measured for a micro-llama rank."""
SCREEN_FACTOR = 4


class RealBackend(TrialBackend):
    """Real distributed trials: `device='cuda'` (NCCL, one process per GPU) or `'cpu'` (gloo,
    one process per simulated rank, `spec.limit_bytes` as each rank's capacity).

    `persistent=True` keeps one launch for every trial, across `evaluate` calls, until
    `close()` (a trial that ends the launch is recorded and the rest continue in a fresh one);
    `False` launches once per trial.
    Multi-node (`nnodes` > 1): this process is the job's one controller; `shared_dir` is a folder
    every node sees, where `autotune agent --shared-dir DIR` on each other node picks up the
    launches (multinode.py); `rdzv_endpoint` is the torchrun rendezvous every node reaches.
    """

    memory_source = "measured"
    throughput_source = "measured"

    def __init__(self, *, device: str = "cpu", timeout_s: float = 300.0, persistent: bool = True,
                 warmup_steps: int = 1, timed_steps: int = 2, nnodes: int = 1,
                 rdzv_endpoint: str | None = None, shared_dir: Path | str | None = None,
                 log_dir: Path | str | None = None,
                 startup_timeout_s: float = 180.0, seed: int = 0, host_check: bool = True) -> None:
        if device not in DEVICES:
            raise UsageError(f"real-trial device {device!r} is not one of {', '.join(DEVICES)}")
        if not timeout_s > 0 or not startup_timeout_s > 0:
            raise UsageError(f"--timeout must be a positive number of seconds, got {timeout_s!r}")
        if warmup_steps < 0 or timed_steps < 1:
            raise UsageError(f"a trial needs warm-up steps >= 0 and timed steps >= 1, got {warmup_steps} "
                             f"and {timed_steps}")
        if nnodes < 1:
            raise UsageError(f"--nodes must be at least 1, got {nnodes}")
        if nnodes > 1 and not rdzv_endpoint:
            raise UsageError(f"--nodes {nnodes} needs --rdzv-endpoint HOST:PORT (a host every node reaches)")
        if nnodes > 1 and shared_dir is None:
            raise UsageError(f"--nodes {nnodes} needs --shared-dir DIR, a folder every node sees, and "
                             "`autotune agent --shared-dir DIR` on the other nodes (docs/REAL_TRIALS.md)")
        self.name = device
        self.device = device
        self.applies_cpu_offload = device != "cpu"
        self.applies_async_tp = device != "cpu"
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.persistent = persistent
        self.warmup_steps = warmup_steps
        self.timed_steps = timed_steps
        self.nnodes = nnodes
        self.rdzv_endpoint = rdzv_endpoint
        self.seed = seed
        self.host_check = host_check
        self._session = None
        if nnodes > 1:
            from autotune.backends.real.multinode import ControllerSession

            self._session = ControllerSession(Path(shared_dir))  # type: ignore[arg-type]
            log_dir = self._session.folder
        self._owns_root = log_dir is None
        self.log_dir = Path(tempfile.mkdtemp(prefix="autotune-real-")) if log_dir is None else Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._launches = 0
        self._trials = 0
        self._launch: Launch | None = None
        self._host_need_cache: dict[str, tuple[int | None, str]] = {}

    @property
    def launches(self) -> int:
        """How many torchrun launches this backend has started so far."""
        return self._launches

    def describe(self) -> str:
        mode = "persistent launches" if self.persistent else "one launch per trial"
        where = "GPUs (NCCL)" if self.device == "cuda" else f"CPU ranks (gloo) on {_host_description()}"
        return (f"{self.device}: real FSDP2 steps via torchrun on {where}, {mode}; memory and throughput "
                "measured")

    def evaluate(self, spec: TrialSpec) -> TrialResult:
        return self.evaluate_many([spec])[0]

    def evaluate_many(self, specs: Iterable[TrialSpec]) -> list[TrialResult]:
        """Evaluate specs in order; with `persistent`, in the launch kept from earlier calls."""
        specs = list(specs)
        results: list[TrialResult | None] = [None] * len(specs)
        runnable: list[int] = []
        for index, spec in enumerate(specs):
            self._check_usage(spec)
            refusal = self._refusal(spec)
            if refusal is not None:
                results[index] = refusal
            else:
                runnable.append(index)
        first = self._trials
        self._trials += len(specs)
        for group in self._launch_groups(runnable, specs):
            # Trial numbers count every spec this backend was given (AUTOTUNE_FAULT's trial=N).
            for outcome in self._run([(first + i, specs[i].to_dict()) for i in group], self._options(specs[group[0]])):
                index = outcome.index - first
                results[index] = self._result(outcome, specs[index])
        assert all(result is not None for result in results)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the persistent launch (its ranks exit between trials) and remove temporary logs."""
        if self._launch is not None:
            self._launch.stop()
            self._launch = None
        if self._session is not None:
            self._session.close()  # the agents exit
            self._session = None
        if self._owns_root:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    # -- launching ----------------------------------------------------------------------------

    def _run(self, items: list[tuple[int, dict[str, Any]]], options: LaunchOptions) -> list[TrialOutcome]:
        """Run trials in the live launch when it fits, else in fresh ones, until all are settled."""
        outcomes: list[TrialOutcome] = []
        while items:
            launch = self._launch_for(options)
            finished = launch.run(items)
            if not self.persistent:
                launch.stop()
            outcomes.extend(finished)
            items = items[len(finished):]
        return outcomes

    def _launch_for(self, options: LaunchOptions) -> Launch:
        if self._launch is not None and self._launch.alive and self._launch.options == options:
            return self._launch
        if self._launch is not None:
            self._launch.stop()
        self._launch = Launch(options, self.log_dir / f"launch-{self._launches}", number=self._launches)
        self._launches += 1
        return self._launch

    def _launch_groups(self, indices: list[int], specs: list[TrialSpec]) -> list[list[int]]:
        """Consecutive specs with the same world share a launch (one launch each when not persistent)."""
        groups: list[list[int]] = []
        for index in indices:
            if self.persistent and groups and _world(specs[groups[-1][-1]]) == _world(specs[index]):
                groups[-1].append(index)
            else:
                groups.append([index])
        return groups

    def _options(self, spec: TrialSpec) -> LaunchOptions:
        return LaunchOptions(device=self.device, nproc_per_node=spec.cluster.num_gpus // self.nnodes,
                             nnodes=self.nnodes, rdzv_endpoint=self.rdzv_endpoint,
                             timeout_s=self.timeout_s, startup_timeout_s=self.startup_timeout_s,
                             warmup_steps=self.warmup_steps, timed_steps=self.timed_steps, seed=self.seed)

    def _check_usage(self, spec: TrialSpec) -> None:
        if spec.cluster.num_gpus % self.nnodes:
            raise UsageError(f"--gpus {spec.cluster.num_gpus} is not divisible by --nodes {self.nnodes}")
        if self.device == "cuda":
            import torch

            if spec.cluster.num_nodes != self.nnodes:
                raise UsageError(f"the cluster has {spec.cluster.num_nodes} node(s) and the cuda backend was set "
                                 f"up for {self.nnodes}: give the controller --nodes {spec.cluster.num_nodes}, "
                                 "--rdzv-endpoint HOST:PORT and --shared-dir DIR (docs/REAL_TRIALS.md)")
            visible = torch.cuda.device_count()
            per_node = spec.cluster.num_gpus // self.nnodes
            if visible < per_node:
                raise UsageError(f"--backend cuda needs {per_node} GPUs on this node and {visible} are "
                                 "visible: use --backend sim (predictions) or --backend cpu (tiny models)")

    def _refusal(self, spec: TrialSpec) -> TrialResult | None:
        """A trial whose predicted host need exceeds this machine's free memory is not launched:
        cpu trials (every rank's tensors live on the host) and cuda trials with CPU offload
        (the offloaded states and pinned staging). Launching it would end in the kernel's OOM
        killer, which takes the whole launch down. A cpu trial with CPU offload is not launched
        either: FSDP2's CPUOffloadPolicy pins host memory, which needs an accelerator, so the trial
        would measure the configuration without offload under the offload configuration's name."""
        for knob, why in (("cpu_offload", "CPU offload cannot run on the cpu backend (FSDP2's CPUOffloadPolicy "
                                          "pins host memory, which needs an accelerator)"),
                          ("activation_offload", "activation offload cannot run on the cpu backend (on CPUs the host "
                                                 "is the device: moving saved tensors frees nothing)")):
            if getattr(spec.train, knob) and not self.applies_cpu_offload:
                return TrialResult(
                    status="error", message=(f"refused before launch: {why}: use --backend sim to predict it or "
                                             "--backend cuda to measure it"),
                    extras=dict(tensor_peak_bytes=None, refused=True, unsupported=knob))
        if spec.train.async_tensor_parallel and not self.applies_async_tp:
            return TrialResult(
                status="error", message=("refused before launch: async tensor parallelism cannot run on the cpu "
                                         "backend (torch's fused all-gather/matmul ops over symmetric memory have "
                                         "CUDA kernels only): use --backend sim to predict it or --backend cuda to "
                                         "measure it"),
                extras=dict(tensor_peak_bytes=None, refused=True, unsupported="async_tensor_parallel"))
        if not self.host_check or (self.device == "cuda" and not spec.train.cpu_offload):
            return None
        need, basis = self._host_need(spec)
        available = host_memory_available_bytes()
        if need is None or available is None or need <= available:
            return None
        if self.device == "cuda":
            return TrialResult(
                status="oom", message=(
                    f"host out of memory, refused before launch: CPU offload needs about {need / 2**30:.1f} GiB "
                    f"of host memory per node ({basis}) and this node has {available / 2**30:.1f} GiB available"),
                host_memory_per_node=Figure(need, "estimated", basis),
                extras=dict(tensor_peak_bytes=None, refused=True, host_available_bytes=available, oom_kind="host"))
        return TrialResult(
            status="error", message=(
                f"refused before launch: {spec.cluster.num_gpus} CPU ranks of {spec.model.name} need about "
                f"{need / 2**30:.1f} GiB of host memory ({basis}) and this machine has {available / 2**30:.1f} "
                "GiB available: use --backend sim for models this size, or fewer --gpus"),
            host_memory_per_node=Figure(need, "predicted", basis),
            extras=dict(tensor_peak_bytes=None, refused=True, host_available_bytes=available))

    def _host_need(self, spec: TrialSpec) -> tuple[int | None, str]:
        key = json.dumps(spec.to_dict(), sort_keys=True)
        if key not in self._host_need_cache:
            self._host_need_cache[key] = (predicted_offload_host_need(spec) if self.device == "cuda"
                                          else predicted_host_need(spec))
        return self._host_need_cache[key]

    # -- results ------------------------------------------------------------------------------

    def _result(self, outcome: TrialOutcome, spec: TrialSpec) -> TrialResult:
        extras: dict[str, Any] = dict(launch=outcome.launch, tensor_peak_bytes=None, rss_peak_bytes=None,
                                      mfu=None, loss=None)
        if self.device == "cpu" and self.host_check:
            extras["host_check"] = self._host_need(spec)[1]
        if outcome.status != "ok":
            extras["failed_rank"] = outcome.failed_rank
            return TrialResult(status=outcome.status, message=outcome.message, extras=extras,  # type: ignore[arg-type]
                               duration_s=outcome.duration_s)
        return self._measured_result(outcome, spec, extras)

    def _measured_result(self, outcome: TrialOutcome, spec: TrialSpec, extras: dict[str, Any]) -> TrialResult:
        figures = outcome.figures or {}
        ranks = figures["ranks"]
        world = figures["world_size"]
        on_cuda = self.device == "cuda"
        where = (f"{world} NCCL ranks on {figures['device']}" if on_cuda
                 else f"{world} gloo ranks on {figures['device']}")
        worst = max(ranks, key=lambda r: r["tensor_peak_bytes"])
        timed_steps = len(worst["step_times"])
        run_accum, full_accum = worst["grad_accum"], spec.grad_accum_steps
        # Seconds per optimizer step of the real job, per rank: the micro-batches run scaled to
        # the job's accumulation, plus the optimizer step (timed apart), slowest rank.
        slowest_s = max(_step_seconds(r, full_accum=full_accum) for r in ranks)
        # Each rank reports its batch's tokens; a tensor- or context-parallel group, or a pipeline's stages, share one.
        tokens_per_step = sum(r["tokens_per_micro_batch"] for r in ranks) * full_accum / spec.train.ranks_per_batch
        tokens_per_sec = tokens_per_step / slowest_s if slowest_s > 0 else None
        losses = [r["losses"][-1] for r in ranks]
        pp = spec.train.pipeline_parallel
        if pp > 1:  # the loss is on the last stage's ranks (the last pp block; 0 reported elsewhere)
            losses = losses[-(world // pp):]
        rss_by_node: dict[str, int] = {}
        for r in ranks:
            rss_by_node[r["node"]] = rss_by_node.get(r["node"], 0) + int(r["rss_peak_bytes"] or 0)
        notes = sorted({note for r in ranks for note in r["notes"]})
        timing = f"the slowest rank's {timed_steps} timed steps"
        if run_accum < full_accum:
            timing = (f"the slowest rank's {timed_steps} timed steps of {run_accum} micro-batches, the "
                      f"later micro-batches' time scaled to {full_accum - 1} after the first, plus the "
                      "optimizer step (timed apart)")
            notes.append(f"ran {run_accum} of {full_accum} micro-batches per step (a short trial); the step "
                         f"time counts the first micro-batch as measured and {full_accum - 1} more at the "
                         "measured time of the later ones")
        extras.update(
            tensor_peak_bytes=int(worst["tensor_peak_bytes"]),
            rss_peak_bytes=max(int(r["rss_peak_bytes"] or 0) for r in ranks),
            loss=statistics.fmean(losses),
            per_rank_tensor_peak_bytes=[int(r["tensor_peak_bytes"]) for r in ranks],
            step_times_s=[r["step_times"] for r in ranks], step_seconds=slowest_s,
            optimizer_step_s=max(statistics.fmean(r.get("optimizer_step_s") or [0.0]) for r in ranks),
            warmup_steps=self.warmup_steps, timed_steps=timed_steps, grad_accum_run=run_accum,
            world_size=world)
        if pp > 1:  # pipeline rank k (ranks k x world/pp ..): its stages' worst rank (parallel/pipeline.py)
            block = world // pp
            extras["per_pipeline_rank_tensor_peak_bytes"] = [
                max(int(r["tensor_peak_bytes"]) for r in ranks[k * block:(k + 1) * block]) for k in range(pp)]
        if spec.train.compile != "none":
            extras["compiled_graphs"] = min(int(r.get("compiled_graphs", 0)) for r in ranks)
            first = max((r.get("warmup_times") or [0.0])[0] for r in ranks)
            if first:  # the first warm-up step compiles every block: its time past a steady step's
                extras["compile_s"] = dict(
                    value=max(first - slowest_s, 0.0), source="measured",
                    basis=f"the slowest rank's first (warm-up) step, {first:.1f} s, less a timed step, "
                          f"{slowest_s:.1f} s: dynamo and inductor compiling every block (once per trial; "
                          "inductor's cache makes later processes faster)")
        if spec.train.float8 != "none":
            extras["float8_linears"] = min(int(r.get("float8_linears", 0)) for r in ranks)
        if on_cuda:
            peak = self._cuda_peak(ranks, where, extras)
            if tokens_per_sec is not None:
                from autotune.estimate.costmodel import compute_peak_tflops

                # The peak the estimate's MFU uses too: fp32 runs on the CUDA cores (TF32 off).
                flops = model_flops_per_token(spec.model, spec.seq_len) * tokens_per_sec
                peak_tflops = compute_peak_tflops(spec.cluster.gpu, spec.train.precision)
                extras["mfu"] = flops / (world * peak_tflops * 1e12)
                extras["mfu_basis"] = (f"PaLM 6N+12LHQT FLOPs per token over {spec.cluster.gpu.name} "
                                       f"nominal dense peak, {peak_tflops:g} TFLOP/s (catalog)")
        else:
            peak = Figure(extras["tensor_peak_bytes"], "measured",
                          f"tensor-level peak (torch MemTracker), max over {where}")
        status, message = "ok", "; ".join(notes)
        if not all(r["finite"] for r in ranks):
            status, message = "error", f"non-finite loss {losses} (diverged in {timed_steps + self.warmup_steps} steps)"
        elif on_cuda and peak.value > spec.limit_bytes:
            # The allocator was capped; only memory outside it (kernels loaded during the trial)
            # can take the device-level peak over the limit.
            status, message = "oom", (f"device-level peak {peak.value:,} bytes is over the usable limit "
                                      f"{spec.limit_bytes:,} bytes per GPU")
        return TrialResult(
            status=status, peak_memory=peak, memory_breakdown=dict(worst["breakdown"]),
            tokens_per_sec=Figure(tokens_per_sec, "measured", f"global tokens per optimizer step over {timing}, {where}"),
            host_memory_per_node=Figure(max(rss_by_node.values()), "measured",
                                        "peak RSS summed over a node's ranks"),
            message=message, extras=extras, duration_s=outcome.duration_s)

    @staticmethod
    def _cuda_peak(ranks: list[dict[str, Any]], where: str, extras: dict[str, Any]) -> Figure:
        """The device-level peak (what the prediction's total is): the allocator's reserved peak
        plus what the process holds outside it (context, NCCL), worst rank. Allocated and
        reserved peaks are kept for their own comparisons."""
        worst = max(ranks, key=lambda r: r["device_peak_bytes"])
        extras.update(
            allocated_peak_bytes=max(int(r["tensor_peak_bytes"]) for r in ranks),
            reserved_peak_bytes=max(int(r["reserved_peak_bytes"]) for r in ranks),
            outside_allocator_bytes=max(int(r["outside_allocator_bytes"]) for r in ranks),
            device_peak_bytes=int(worst["device_peak_bytes"]),
            allocator_persistent_bytes=max(int(r.get("allocator_persistent_bytes") or 0) for r in ranks),
            memory_fraction=worst["memory_fraction"],
            alloc_conf=(worst.get("runtime") or {}).get("alloc_conf", ""),
            device_capacity_bytes=min(int(r["device_capacity_bytes"]) for r in ranks))
        return Figure(int(worst["device_peak_bytes"]), "measured",
                      "torch.cuda.max_memory_reserved + memory outside the allocator ((total - free) - "
                      f"reserved, from cudaMemGetInfo), max over {where}")

def predicted_host_need(spec: TrialSpec) -> tuple[int | None, str]:
    """Host bytes a cpu trial of `spec` needs: the simulator's per-rank tensor peak plus a
    per-process allowance, times the ranks. (None, why) when the simulator cannot say.

    A trace costs seconds even for a tiny model, so the closed-form estimate screens first: a
    trial it puts under 1/SCREEN_FACTOR of the free memory is not traced."""
    from autotune.backends.analytic import AnalyticBackend

    ranks = spec.cluster.num_gpus
    estimate = AnalyticBackend().evaluate(spec).extras.get("tensor_peak_bytes")
    available = host_memory_available_bytes()
    if estimate is not None and available is not None:
        need = ranks * (int(estimate) + RANK_PROCESS_BYTES)
        if need * SCREEN_FACTOR < available:
            return need, (f"estimated (closed form) {need / 2**30:.2f} GiB for {ranks} ranks, under "
                          f"1/{SCREEN_FACTOR} of the {available / 2**30:.1f} GiB available: not traced")
    try:
        from autotune.backends.sim import SimBackend
    except ImportError as exc:
        return None, f"host check skipped: simulator unavailable ({exc})"
    result = SimBackend(device_kind="cpu").evaluate(spec)
    per_rank = result.extras.get("tensor_peak_bytes")
    if per_rank is None:
        return None, f"host check skipped: the simulator gave no tensor peak ({result.status}: {result.message})"
    return ranks * (int(per_rank) + RANK_PROCESS_BYTES), (
        f"simulated tensor peak {int(per_rank) / 2**30:.2f} GiB per rank plus an estimated "
        f"{RANK_PROCESS_BYTES / 2**30:.2f} GiB per process, x {ranks} ranks")


def predicted_offload_host_need(spec: TrialSpec) -> tuple[int | None, str]:
    """Host bytes per node a cuda trial with CPU offload needs, from the simulator's offload model."""
    try:
        from autotune.backends.sim import SimBackend
    except ImportError as exc:
        return None, f"host check skipped: simulator unavailable ({exc})"
    figure = SimBackend(device_kind="cuda").evaluate(spec).host_memory_per_node
    if figure is None or figure.value is None:
        return None, "host check skipped: the simulator gave no host figure"
    return int(figure.value), f"{figure.source}: {figure.basis}"


def _step_seconds(rank: dict[str, Any], *, full_accum: int) -> float:
    """Mean seconds per optimizer step of the real job on one rank: the first micro-batch as timed,
    each later one of the job at the timed later ones' mean (under CPU offload they copy gradients
    back blocking and the first does not), plus the optimizer step."""
    micro, optimizer = rank.get("micro_batches_s") or [], rank.get("optimizer_step_s") or []
    if not micro:  # no phase timing: the whole measured step
        return statistics.fmean(rank["step_times"])
    run, first = rank["grad_accum"], rank.get("first_micro_batch_s") or []
    if run > 1 and first:
        later = (statistics.fmean(micro) - statistics.fmean(first)) / (run - 1)
        return statistics.fmean(first) + later * (full_accum - 1) + statistics.fmean(optimizer)
    return statistics.fmean(micro) * full_accum / run + statistics.fmean(optimizer)


def _world(spec: TrialSpec) -> tuple[int, int]:
    return spec.cluster.num_gpus, spec.cluster.num_nodes


def _host_description() -> str:
    import os

    return f"host {platform.machine()}, {os.cpu_count()} cores"


def host_memory_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable from /proc/meminfo (what can still be used without swapping), or None.
    Here, not in _capacity beside the ranks' RSS readers: _capacity brings torch and MemTracker
    (dynamo, inductor), which a process that only launches trials does not need."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
