"""Context parallelism on CPUs (autotune/parallel/context.py): a CP2 step's tensor peak on 2 real gloo
ranks against the same step traced under FakeTensorMode with the fake process group, and against the
step without CP in one process.

    python benchmarks/bench_context_parallel.py [--seq 256,1024] [--layers 4] [--hidden 256]

A llama of `--layers` layers (4 heads, 2 k/v heads), micro-batch 1, float32, forward and backward under
torch's MemTracker (parameters and gradients counted). Printed per sequence length: the peak without CP,
each CP rank's measured peak, the trace's (rank 0's), their difference, and the CP step's wall time."""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

CP = 2


def _config(args, seq: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=seq)


def _peak(model, step) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        step()
    return sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())


def _step(model, input_ids, mesh) -> None:
    labels = F.pad(input_ids[:, 1:], (0, 1), value=-100)
    if mesh is None:
        logits = model(input_ids=input_ids).logits
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
        return
    from autotune.parallel.context import context_parallel_step, use_causal_sdpa

    use_causal_sdpa(model)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).repeat(input_ids.shape[0], 1)
    input_ids = input_ids.clone()
    buffers = [input_ids, labels, positions]
    with context_parallel_step(mesh, buffers, [1, 1, 1], no_restore_buffers=set(buffers)):
        logits = model(input_ids=input_ids, position_ids=positions, use_cache=False).logits
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum").backward()


def _launch(index: int, args, seq: int, folder: Path, port: int) -> None:
    torch.set_num_threads(1)
    input_ids = torch.randint(0, 1024, (1, seq))
    if index == CP:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=CP)
        mesh = init_device_mesh("cpu", (CP,))
        with FakeTensorMode() as mode:
            model = LlamaForCausalLM(_config(args, seq))
            fake_ids = mode.from_tensor(input_ids)
            result = {"peak": _peak(model, lambda: _step(model, fake_ids, mesh))}
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=index, world_size=CP)
        mesh = init_device_mesh("cpu", (CP,))
        model = LlamaForCausalLM(_config(args, seq))
        start = time.perf_counter()
        result = {"peak": _peak(model, lambda: _step(model, input_ids, mesh)), "seconds": time.perf_counter() - start}
    torch.save(result, folder / f"{index}.pt")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="256,1024")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    print(f"{'seq':>6} {'no CP':>12} {'CP2 rank 0':>12} {'CP2 rank 1':>12} {'CP2 trace':>12} {'diff':>7} {'CP2 step':>9}")
    for seq in map(int, args.seq.split(",")):
        model = LlamaForCausalLM(_config(args, seq))
        whole = _peak(model, lambda: _step(model, torch.randint(0, 1024, (1, seq)), None))
        with tempfile.TemporaryDirectory() as folder, socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            sock.close()
            torch.multiprocessing.spawn(_launch, args=(args, seq, Path(folder), port), nprocs=CP + 1)
            ranks = [torch.load(Path(folder) / f"{r}.pt") for r in range(CP)]
            trace = torch.load(Path(folder) / f"{CP}.pt")["peak"]
        measured = max(rank["peak"] for rank in ranks)
        print(f"{seq:>6} {whole:>12,} {ranks[0]['peak']:>12,} {ranks[1]['peak']:>12,} {trace:>12,} "
              f"{(trace - measured) / measured:>+7.2%} {ranks[0]['seconds']:>8.2f}s")


if __name__ == "__main__":
    main()
