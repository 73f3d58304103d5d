"""The per-rank entry point torchrun runs: `-m autotune.backends.real.worker --job J --out D`.

One launch evaluates trials one after another on one process group (persistent mode). The
launcher and the ranks talk through the out folder:

    D/queue/<n>.json                 the launcher: the n-th trial of this launch (index, spec)
    D/queue/stop                     the launcher: no more trials, exit
    D/started/<index>                rank 0 began trial <index> (starts its timeout)
    D/results/<index>.json           rank 0: every rank's figures for a finished trial
    D/failures/<index>.rank<r>.json  rank r raised in trial <index> (type, message, time)

Between trials every rank polls the queue, outside any collective. A rank that raises (out of
memory included) writes its failure file and exits with the exception: torchrun then stops
the other ranks, wherever they wait, and the launcher sends the trials after it to a fresh
launch. No rank is ever left waiting in a collective. Ranks also exit when the launching
process is gone, mid-trial too: the kernel kills them with torchrun (PR_SET_PDEATHSIG, which the
launcher also sets on torchrun), and a watchdog thread ends a rank whose launcher has gone, so
a controller killed with SIGKILL leaves no worker holding devices.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

from autotune.util.files import write_json

SETUP = "setup"  # the trial index used for failures outside any trial
_QUEUE_POLL_S = 0.02
_PARENT_CHECK_S = 2.0
_WATCHDOG_S = 1.0


# How an out-of-memory reads when it is not a torch.OutOfMemoryError: NCCL's "Cuda failure 'out
# of memory'" (DistBackendError), cuBLAS/cuDNN handle or workspace allocation failures, and a
# CUDA runtime error surfacing later as AcceleratorError "CUDA error: out of memory".
_OOM_TEXTS = ("cuda failure 'out of memory'", "cuda error: out of memory", "cudaerrormemoryallocation",
              "cublas_status_alloc_failed", "cudnn_status_alloc_failed", "cuda out of memory",
              "defaultcpuallocator: can't allocate memory")


def out_of_memory_kind(exc: BaseException) -> str | None:
    """'device' or 'host' when `exc` is an out-of-memory, however it surfaced; None otherwise.
    Triton's 'out of resource: shared memory' is a kernel limit, not memory, and is not one."""
    import torch

    text = f"{type(exc).__name__}: {exc}".lower()
    if "defaultcpuallocator" in text or "can't allocate memory" in text:
        return "host"
    if isinstance(exc, torch.OutOfMemoryError) or any(pattern in text for pattern in _OOM_TEXTS):
        return "device"
    return None


def failure_record(exc: BaseException, *, rank: int) -> dict[str, Any]:
    from autotune.backends.real._launcher import node_name

    kind = out_of_memory_kind(exc)
    return dict(rank=rank, node=node_name(), local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                type=type(exc).__name__, message=str(exc)[:4000], time=time.time(),
                oom=kind is not None, oom_kind=kind,
                traceback="".join(traceback.format_exception(exc))[-4000:])


def describe_device(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU (host {platform.machine()}, {os.cpu_count()} cores)"


@record
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one rank of a real autotune trial launch")
    parser.add_argument("--job", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    faulthandler.enable()  # a hard crash still leaves a stack in this rank's stderr
    from autotune.backends.real._launcher import LAUNCHER_PID_ENV, die_with_parent

    die_with_parent()  # torchrun's agent killed (its controller was): this rank goes too
    job = json.loads(args.job.read_text())
    rank = int(os.environ["RANK"])
    index: int | str = SETUP
    try:
        import torch.distributed as dist

        # The process that started this node's torchrun: the controller, or a node's agent.
        launcher_pid = int(os.environ[LAUNCHER_PID_ENV]) if os.environ.get(LAUNCHER_PID_ENV) else None
        if launcher_pid is not None:
            _exit_when_gone(launcher_pid)  # before set-up: the rendezvous can wait on a dead agent
        device, mesh, faults, runtime = _setup(job)
        for item in _queued_trials(args.out / "queue", launcher_pid=launcher_pid):
            index = item["index"]
            _run_one(item, job=job, out=args.out, rank=rank, device=device, mesh=mesh, faults=faults,
                     runtime=runtime)
        index = SETUP
        dist.destroy_process_group()
    except BaseException as exc:
        write_json(args.out / "failures" / f"{index}.rank{rank}.json", failure_record(exc, rank=rank))
        raise


def _queued_trials(queue: Path, *, launcher_pid: int | None) -> Iterator[dict[str, Any]]:
    """The launch's trials in order, as the launcher queues them; ends on `stop` or when the
    launching process (if known here) has gone."""
    number = 0
    last_check = time.monotonic()
    while True:
        item = queue / f"{number}.json"
        if item.exists():
            yield json.loads(item.read_text())
            number += 1
            continue
        if (queue / "stop").exists():
            return
        if time.monotonic() - last_check > _PARENT_CHECK_S:
            last_check = time.monotonic()
            if launcher_pid is not None and not _alive(launcher_pid):
                return
        time.sleep(_QUEUE_POLL_S)


def _exit_when_gone(pid: int) -> None:
    """Watch the launching process from a daemon thread, during trials too, and end this rank
    at once when it is gone. The parent-death signal covers most of it; this covers a rank
    that was still importing torch when its torchrun died, and any launcher it cannot reach."""
    import threading

    def watch() -> None:
        while _alive(pid):
            time.sleep(_WATCHDOG_S)
        print(f"autotune worker: the launching process {pid} is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="autotune-launcher-watchdog", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _setup(job: dict[str, Any]):
    import torch
    import torch.distributed as dist
    from autotune.backends.real._faults import FAULT_ENV, parse_faults

    if job["device"] == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    faults = parse_faults(os.environ.get(FAULT_ENV))
    timeout = timedelta(seconds=float(job["collective_timeout_s"]))
    runtime: dict[str, Any] = {}
    if device.type == "cuda":
        # device_id makes NCCL create its communicator now, not inside the first trial, so its
        # memory is in place before any trial and counted once (outside the allocator).
        dist.init_process_group(backend, timeout=timeout, device_id=device)
        _warm_collectives(device)
        from autotune.estimate.runtime_memory import measure_outside_allocator

        runtime = dict(after_setup=measure_outside_allocator(device),
                       alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    else:
        from autotune.backends.real._cpu_bf16 import compute_bf16_kernels_in_fp32

        compute_bf16_kernels_in_fp32()  # bf16 GEMMs and attention at fp32 speed where the CPU has no bf16 units
        dist.init_process_group(backend, timeout=timeout)
    return device, _Meshes(device.type), faults, runtime


class _Meshes:
    """The launch's device meshes, one per ParallelDims, built when a trial first needs it: every
    rank runs the same trials in the same order, so every rank creates the same groups."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._built: dict[Any, Any] = {}

    def for_spec(self, spec):
        from autotune.distributed.parallel import ParallelDims

        dims = ParallelDims.of(spec.train, spec.cluster.num_gpus)
        if dims not in self._built:
            self._built[dims] = dims.build_mesh(self.device_type)
        return self._built[dims]


def _warm_collectives(device) -> None:
    """Run FSDP2's collectives once (all-gather, reduce-scatter) so NCCL sets up their channels
    before the first trial; the tensors are freed and the allocator's cache emptied after."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    shard = torch.ones(1024, device=device)
    full = torch.empty(1024 * world, device=device)
    dist.all_gather_into_tensor(full, shard)
    dist.reduce_scatter_tensor(shard, full)
    dist.barrier(device_ids=[device.index])
    torch.cuda.synchronize(device)
    del shard, full
    torch.cuda.empty_cache()


def _run_one(item: dict[str, Any], *, job: dict[str, Any], out: Path, rank: int, device, mesh,
             faults, runtime: dict[str, Any]) -> None:
    import torch.distributed as dist

    from autotune.backends.real._trial import run_trial
    from autotune.problem.config import TrialSpec

    index = item["index"]
    spec = TrialSpec.from_dict(item["spec"])
    world_size = dist.get_world_size()
    assert spec.cluster.num_gpus == world_size, (spec.cluster.num_gpus, world_size)
    if rank == 0:
        write_json(out / "started" / str(index), time.time())
    figures = run_trial(spec, mesh=mesh.for_spec(spec), device=device, rank=rank, warmup_steps=job["warmup_steps"],
                        timed_steps=job["timed_steps"], seed=job["seed"], faults=faults,
                        trial_index=index)
    from autotune.backends.real._launcher import node_name

    figures["node"] = node_name()
    if runtime:
        figures["runtime"] = runtime
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        write_json(out / "results" / f"{index}.json",
                   dict(index=index, world_size=world_size, backend=dist.get_backend(),
                        device=describe_device(device), ranks=gathered))


if __name__ == "__main__":
    main()
