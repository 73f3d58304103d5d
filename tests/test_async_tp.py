"""Async tensor parallelism (--async-tp): what may combine with it, the symmetric-memory workspace it adds, and the
step time it saves, against torch's own code and torchtitan's published async-TP runs.

Async TP cannot run here (torch's fused all-gather/matmul ops have CUDA kernels only): the cpu backend refuses it,
and its memory and time are checked another way, as each test says."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autotune.backends.analytic import tensor_parallel_work
from autotune.drivers.cli import EXIT_USAGE, main
from autotune.estimate import costmodel
from autotune.estimate.runtime_memory import async_tp_workspace_bytes
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec

WORKSPACE_CHECK = r"""
import json, sys
import torch, torch.distributed as dist
import torch.distributed._symmetric_memory as symm
from torch.testing._internal.distributed.fake_pg import FakeStore

mb, seq, hidden, ffn, tp = json.loads(sys.argv[1])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
group = dist.group.WORLD.group_name
asked = []


class Asked(Exception):
    pass


def workspace(group_name, min_size):  # torch's request, recorded before anything is allocated
    asked.append(min_size)
    raise Asked


symm.get_symm_mem_workspace = workspace
bf16 = dict(dtype=torch.bfloat16)
# The rowwise linears (o, down) under sequence parallelism: partial outputs reduce-scattered on the sequence dim.
for width in (hidden, ffn):
    try:
        symm._fused_matmul_reduce_scatter_impl(torch.ops.aten.mm.out, torch.randn(mb, seq, width // tp, **bf16),
                                               torch.randn(width // tp, hidden, **bf16), {}, None, "sum", 1, group)
    except Asked:
        pass
# The colwise linears (q/k/v, gate/up): the sequence shard all-gathered into the matmuls.
for width in (3 * hidden, 2 * ffn):
    try:
        symm._fused_all_gather_matmul_impl(torch.ops.aten.mm.out, torch.randn(mb, seq // tp, hidden, **bf16),
                                           [torch.randn(hidden, width // tp, **bf16)], None, [{}], [None], 1, group,
                                           True)
    except Asked:
        pass
print(json.dumps(asked))
"""


def test_the_workspace_is_the_largest_request_torch_makes():
    """async_tp_workspace_bytes against torch's own fused ops (torch.distributed._symmetric_memory), each asking
    get_symm_mem_workspace for its size on a fake process group of tp ranks: the workspace grows to the largest."""
    mb, seq, hidden, ffn, tp = 2, 64, 32, 88, 4
    done = subprocess.run([sys.executable, "-c", WORKSPACE_CHECK, json.dumps([mb, seq, hidden, ffn, tp])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    asked = json.loads(done.stdout)
    assert len(asked) == 4
    assert max(asked) == async_tp_workspace_bytes(tokens_per_microbatch=mb * seq, hidden_size=hidden,
                                                  tensor_parallel=tp, activation_bytes=2)


@pytest.mark.parametrize("argv, message", [
    (["--async-tp"], "--async-tp without --tp"),
    (["--async-tp", "--tp", "2"], "--async-tp without compiled blocks"),
])
def test_async_tp_needs_tensor_parallelism_and_compiled_blocks(argv, message, capsys):
    assert main(["trial", "--model", "tiny-llama", "--gpus", "4", "--backend", "analytic", *argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("autotune: error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err


def test_the_cpu_backend_refuses_async_tp_before_launching(capsys):
    main(["trial", "--model", "tiny-llama", "--gpus", "2", "--backend", "cpu", "--tp", "2", "--compile", "blocks",
          "--ac", "op", "--async-tp", "--seq-len", "64"])
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "error" and "CUDA kernels only" in result["message"]


def _spec(model: str, **train) -> TrialSpec:
    return TrialSpec(model=resolve_model(model), cluster=Cluster(num_gpus=64, num_nodes=8, gpu_memory_bytes=400 * 2**30),
                     seq_len=8192, train=TrainConfig(**train))


def test_the_exchanges_are_the_synchronous_bytes_one_by_one():
    """tp_exchanges lists the collectives tp_all_reduce_bytes counts as all-reduces (each a reduce-scatter and an
    all-gather of the same tensor): as a trial passes them (float8's one-byte gathers), and with recomputed blocks."""
    for float8 in ("none", "tensorwise"):
        work = tensor_parallel_work(_spec("llama3.1-8b", micro_batch_size=2, tensor_parallel=8, compile="blocks",
                                          activation_checkpointing="op", float8=float8, async_tensor_parallel=True))
        moved = sum(count * nbytes for count, nbytes, _ in work["tp_overlap"])
        assert moved == pytest.approx(2 * work["tp_all_reduce_bytes"], rel=1e-12)
    sizes = dict(tokens_per_microbatch=4096, hidden_size=512, activation_bytes=2, num_blocks=6, tensor_parallel=4,
                 checkpointed_blocks=3, num_microbatches=2)
    exchanges = costmodel.tp_exchanges(**sizes, q_width=512, kv_width=128, mlp_in_width=2 * 1536, ffn=1536)
    assert sum(c * b for c, b, _ in exchanges) == pytest.approx(2 * costmodel.tp_all_reduce_bytes(**sizes))


def test_the_estimated_gain_follows_torchtitans_published_8b_pair():
    """torchtitan's async-TP benchmark (benchmarks/results/published_mesh_runs.json, B-8b-bf16 and its async twin:
    Llama 3.1 8B, FSDP x TP8 on 64 H100s, local batch 12, compiled, op-level checkpointing): 4,378 -> 4,809.4
    tokens/s per GPU, +9.9%. The simulator's estimate of the same two trials (one trace: async TP allocates what the
    synchronous graph does) gains within 5 points of that; none of its constants was fitted to these rows."""
    from autotune.backends.sim import SimBackend

    sim = SimBackend(device_kind="cuda")
    train = dict(micro_batch_size=12, activation_checkpointing="op", tensor_parallel=8, compile="blocks")
    sync = sim.evaluate(_spec("llama3.1-8b", **train))
    both = sim.evaluate(_spec("llama3.1-8b", **train, async_tensor_parallel=True))
    gain = both.tokens_per_sec.value / sync.tokens_per_sec.value - 1
    assert abs(gain - (4809.4 / 4378 - 1)) <= 0.05, gain
    # The one memory difference: the workspace, outside the traced tensors.
    assert both.extras["tensor_peak_bytes"] == sync.extras["tensor_peak_bytes"]
    assert both.peak_memory.value - sync.peak_memory.value == async_tp_workspace_bytes(
        tokens_per_microbatch=12 * 8192, hidden_size=4096, tensor_parallel=8, activation_bytes=2)
    assert "async TP" in both.tokens_per_sec.basis and costmodel.async_tp_exposed_seconds.__name__ in \
        both.tokens_per_sec.basis


class _SplitFasterFormula:
    """A test double for the controller's path only (not a cost model): states and activations split by tp, every
    doubling of tp 20% faster, compiled blocks 10% faster, async TP 10% more; counts its evaluations."""

    name, memory_source, throughput_source = "split-faster-formula", "estimated", "estimated"
    applies_cpu_offload = True

    def __init__(self, *, applies_async_tp: bool = True) -> None:
        self.applies_async_tp = applies_async_tp
        self.calls: list[TrainConfig] = []

    def evaluate(self, spec):
        from autotune.backends.base import Figure, TrialResult

        train = spec.train
        self.calls.append(train)
        tp = train.tensor_parallel
        peak = int((20 + train.micro_batch_size * 4) * 2**30 / tp)
        tps = (train.micro_batch_size * 1000 * 1.2 ** (tp.bit_length() - 1) * (1.1 if train.compile != "none" else 1.0)
               * (1.1 if train.async_tensor_parallel else 1.0))
        return TrialResult(status="ok" if peak <= spec.limit_bytes else "oom",
                           peak_memory=Figure(peak, "estimated", "formula"),
                           tokens_per_sec=Figure(tps, "estimated", "formula"))

    def close(self):
        pass


@pytest.mark.parametrize("space_on, backend_runs_it", [(True, True), (False, True), (True, False)])
def test_the_search_tries_async_tp_on_compiled_tensor_parallel_winners(space_on, backend_runs_it):
    """Where a compiled tensor-parallel configuration fits, the search tries it with async TP (and, faster in the
    formula, it wins); not where the search space leaves it out, nor on a backend that cannot run it (cpu trials)."""
    from autotune.problem.catalog.gpus import GPUS
    from autotune.search.controller import Controller
    from autotune.search.records import TuneRequest
    from autotune.search.space import SearchSpace

    backend = _SplitFasterFormula(applies_async_tp=backend_runs_it)
    cluster = Cluster(num_gpus=8, gpu=GPUS["h100-80gb"], gpu_memory_bytes=80 * 2**30)
    space = SearchSpace(offload=False, compile="explore", float8="none", context_parallel=False,
                        async_tensor_parallel=space_on)
    request = TuneRequest(model=resolve_model("tiny-llama"), cluster=cluster, seq_len=256, target_tokens=64 * 1024,
                          headroom=0.0, space=space)
    winner = Controller(request, backend).tune().winner.train
    tried = [t for t in backend.calls if t.async_tensor_parallel]
    assert winner.tensor_parallel > 1 and winner.compile == "blocks"
    if space_on and backend_runs_it:
        assert tried and all(t.tensor_parallel > 1 and t.compile == "blocks" for t in tried)
        assert winner.async_tensor_parallel
    else:
        assert not tried and not winner.async_tensor_parallel


@pytest.mark.parametrize("train", [
    dict(micro_batch_size=2, activation_checkpointing="op", tensor_parallel=2, compile="blocks",
         async_tensor_parallel=True),
    dict(micro_batch_size=1, activation_checkpointing="full", context_parallel=2),
    dict(micro_batch_size=1, activation_checkpointing="full", pipeline_parallel=2, pipeline_schedule="GPipe"),
])
def test_the_trial_command_that_decides_a_close_call_runs_the_same_mesh(train, capsys):
    """why_winner.decide_with's `autotune trial` commands, parsed by the CLI itself (the analytic backend for the
    cuda one named): the configuration it evaluates is the step's, tensor, context and pipeline parallelism and
    async TP included."""
    import shlex

    from autotune.backends.base import TrialResult
    from autotune.problem.catalog.gpus import GPUS
    from autotune.results.result import _trial_command
    from autotune.search.records import Step, TuneRequest

    cluster = Cluster(num_gpus=4, gpu=GPUS["h100-80gb"])
    request = TuneRequest(model=resolve_model("tiny-llama"), cluster=cluster, seq_len=256, target_tokens=4096)
    config = TrainConfig(**train)
    step = Step(step=3, stage="explore", train=config,
                batch=request.global_batch(config.micro_batch_size, ranks_per_batch=config.ranks_per_batch),
                result=TrialResult(status="ok"), fits=True, reason="", backend="sim")
    argv = shlex.split(_trial_command(request, step))[1:]
    argv[argv.index("--backend") + 1] = "analytic"
    assert main(argv) == 0
    assert TrainConfig.from_dict(json.loads(capsys.readouterr().out)["config"]) == config
