"""Loss parallelism (--loss-parallel): the head and the cross-entropy split by vocabulary over the tensor-parallel
GPUs, as torchtitan does under TP. Its memory against a real gloo run, what may combine with it, and the search's use
of it. That the split model computes the whole one's loss and gradients: tests/test_tensor_parallel.py."""

from __future__ import annotations

import json

import pytest

from autotune.drivers.cli import EXIT_USAGE, main
from autotune.problem.catalog.models import resolve_model
from autotune.problem.config import Cluster, TrainConfig, TrialSpec


def test_the_traced_peak_is_a_real_gloo_runs_and_below_the_whole_heads(capsys):
    """tiny-qwen2 (an untied head), TP2 on 2 gloo ranks, seq 256, every block checkpointed: the simulator's tensor
    peak within 0.1% of the real run's (torch MemTracker), and below the same split with the head whole."""
    from autotune.backends.sim import SimBackend

    argv = ["trial", "--model", "tiny-qwen2", "--gpus", "2", "--tp", "2", "--seq-len", "256", "--ac", "full"]
    assert main([*argv, "--loss-parallel", "--backend", "cpu"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["status"] == "ok" and measured["config"]["loss_parallel"] is True
    sim = SimBackend(device_kind="cpu")
    spec = TrialSpec(model=resolve_model("tiny-qwen2"), cluster=Cluster(num_gpus=2), seq_len=256,
                     train=TrainConfig(tensor_parallel=2, loss_parallel=True, activation_checkpointing="full"))
    predicted = sim.evaluate(spec).extras["tensor_peak_bytes"]
    whole = sim.evaluate(spec.with_train(spec.train.with_(loss_parallel=False))).extras["tensor_peak_bytes"]
    assert abs(predicted - measured["extras"]["tensor_peak_bytes"]) <= 0.001 * predicted
    assert predicted < whole


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny-qwen2", "--loss-parallel"], "add --tp 2"),
    (["--model", "qwen2.5-0.5b", "--tp", "2", "--loss-parallel"], "head is tied to its embeddings"),
    (["--model", "tiny-qwen2", "--tp", "2", "--loss-parallel", "--stack", "accelerate"], "--stack fsdp2"),
])
def test_loss_parallelism_needs_a_split_untied_head_in_autotunes_loop(argv, message, capsys):
    assert main(["trial", "--gpus", "4", "--backend", "analytic", *argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("autotune: error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err


@pytest.mark.parametrize("model, split", [("tiny-llama", True), ("qwen2.5-0.5b", False)])
def test_the_search_splits_the_head_of_its_tensor_parallel_meshes_where_it_can(model, split):
    """The search's tensor-parallel candidates carry loss parallelism where the model's head is untied (tiny-llama),
    not where it is tied (qwen2.5-0.5b); the formula backend ignores it (the controller's path is checked)."""
    from autotune.problem.catalog.gpus import GPUS
    from autotune.search.controller import Controller
    from autotune.search.records import TuneRequest
    from autotune.search.space import SearchSpace
    from tests.test_async_tp import _SplitFasterFormula

    backend = _SplitFasterFormula()
    cluster = Cluster(num_gpus=8, gpu=GPUS["h100-80gb"], gpu_memory_bytes=80 * 2**30)
    request = TuneRequest(model=resolve_model(model), cluster=cluster, seq_len=256, target_tokens=64 * 1024,
                          headroom=0.0, space=SearchSpace(offload=False, compile="none", float8="none",
                                                          context_parallel=False))
    winner = Controller(request, backend).tune().winner.train
    split_calls = [t for t in backend.calls if t.tensor_parallel > 1]
    assert winner.tensor_parallel > 1 and split_calls
    assert all(t.loss_parallel is split for t in split_calls) and winner.loss_parallel is split
