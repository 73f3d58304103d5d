"""How the router's choices reach memory (issue 32).

Transformers 5 runs a block's experts with its `grouped_mm` implementation by default: the
tokens x top-k routed rows are gathered into one buffer, sorted by expert and multiplied with
per-expert offsets. Every buffer is tokens x top-k rows whatever the router chooses, so the
memory of a step does not depend on the routing, and the simulator's fake router output (whose
values are arbitrary) traces what any real router gives. Checked here on real tensors, with
torch's own MemTracker: a router that sends every token to one expert and a random one that
spreads them give the same tensor peak, byte for byte.
"""

from __future__ import annotations

import torch

from autotune.problem.catalog.models import resolve_model


def _step_peak_and_load(skewed: bool) -> tuple[int, list[int]]:
    """Tensor peak of a forward and backward of tiny-mixtral on real CPU tensors, and how many
    routed rows each expert received."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(resolve_model("tiny-mixtral").hf_config(), dtype=torch.float32)
    assert model.config._experts_implementation == "grouped_mm"
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert routers and len(experts) == len(routers)
    load = [0] * model.config.num_local_experts

    def skew(module, inputs, output):
        logits, scores, chosen = output  # the router's logits, weights and experts per token
        return logits, scores, torch.zeros_like(chosen)  # every token to expert 0

    def received(module, args):  # what the experts were given, counted where they receive it
        hidden_states, top_k_index, top_k_weights = args
        for expert in top_k_index.flatten().tolist():
            load[expert] += 1
    for router, block_experts in zip(routers, experts):
        if skewed:
            router.register_forward_hook(skew)
        block_experts.register_forward_pre_hook(received)
    tokens = torch.randint(0, model.config.vocab_size, (2, 128))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(input_ids=tokens, labels=tokens).loss.backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"], load


def test_a_skewed_and_a_spread_router_give_the_same_peak():
    skewed_peak, skewed_load = _step_peak_and_load(skewed=True)
    spread_peak, spread_load = _step_peak_and_load(skewed=False)
    assert skewed_load[1] == 0 and skewed_load[0] > 0  # every routed row on expert 0
    assert min(spread_load) > 0.2 * sum(spread_load)  # both experts busy
    assert sum(skewed_load) == sum(spread_load)  # tokens x top-k rows either way
    assert skewed_peak == spread_peak


def test_the_trace_counts_the_experts_matmul_flops():
    """torch has no FLOP formula for grouped matmuls, which transformers' experts run: the trace adds
    one. Routing every token to a second expert adds exactly one expert's forward and backward per
    token and layer, 6 x tokens x its parameters (3 x hidden x intermediate), counted from the config."""
    import dataclasses

    from autotune.backends.sim import SimBackend
    from autotune.problem.config import Cluster, TrainConfig, TrialSpec

    top1 = resolve_model("tiny-mixtral")
    top2 = dataclasses.replace(top1, name="tiny-mixtral-top2", config_dict={**top1.config_dict, "num_experts_per_tok": 2})
    flops = []
    with SimBackend(device_kind="cpu") as sim:
        for model in (top1, top2):
            spec = TrialSpec(model=model, cluster=Cluster(num_gpus=2), seq_len=128, train=TrainConfig(micro_batch_size=1))
            flops.append(sim.evaluate(spec).extras["op_work"]["matmul_flops"])
    config = top1.config_dict
    tokens, expert = 128, 3 * config["hidden_size"] * config["intermediate_size"]
    assert flops[1] - flops[0] == 6 * tokens * expert * config["num_hidden_layers"]
