"""The tune of a MoE model under balanced routing and under a stated routing skew (issue 58).

    python benchmarks/bench_moe_skew.py [--model mixtral-8x7b] [--gpus 64] [--gpu-type h100-80gb]
                                        [--skew zipf:1.2] [--global-tokens 2Mi] [--compile none]
                                        [--json out.json]

Two tunes on the simulator (the search `autotune tune --backend sim` runs: Controller.tune, 8 GPUs a
node, the model's default sequence length, the default headroom), one under balanced routing and one
under the skew, each with a simulator of its own; then the balanced winner predicted again under the
skew (the rank whose experts receive the most tokens traced: autotune/problem/routing.py). Printed: every
trial, each winner, and whether the balanced winner still fits under the skew, and the skewed tune's
note (which rank binds, the expert-parallel configurations tried on their binding rank).

The defaults are a problem whose balanced winner uses expert parallelism: eager (`--compile none`;
expert parallelism is not compiled here, and with compile explored the compiled winner, without
expert parallelism, wins either way) at 2Mi tokens a step. Where the balanced winner is over the
limit under the skew, the skewed tune must choose another configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GIB = 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mixtral-8x7b")
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--gpu-type", default="h100-80gb")
    parser.add_argument("--skew", default="zipf:1.2")
    parser.add_argument("--global-tokens", default="2Mi")
    parser.add_argument("--compile", default="none", help="the search's torch.compile mode, as tune's --compile")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from autotune.backends.sim import SimBackend
    from autotune.problem.catalog.gpus import GPUS
    from autotune.problem.catalog.models import resolve_model
    from autotune.problem.config import Cluster
    from autotune.search.controller import Controller
    from autotune.search.records import TuneRequest
    from autotune.problem.routing import parse_routing_skew, tune_note
    from autotune.search.space import SearchSpace
    from autotune.util.units import parse_count

    model = resolve_model(args.model)
    cluster = Cluster(num_gpus=args.gpus, num_nodes=max(1, args.gpus // 8), gpu=GPUS[args.gpu_type])
    skew = parse_routing_skew(args.skew)
    rows = {}
    outcomes = {}
    # A simulator of its own for each tune and for the re-evaluation, as separate `autotune tune` and
    # `autotune trial` commands have: a prediction's runtime terms can depend on which traces a
    # backend already holds (a micro-batch traced or extrapolated), whatever the routing.
    for name, routing in (("balanced", parse_routing_skew("balanced")), (args.skew, skew)):
        request = TuneRequest(model=model, cluster=cluster, seq_len=model.default_seq_len,
                              target_tokens=parse_count(args.global_tokens, what="--global-tokens"),
                              routing_skew=routing, space=dataclasses.replace(SearchSpace(), compile=args.compile))
        with SimBackend(device_kind="cuda") as sim:
            began = time.monotonic()
            outcome = Controller(request, sim).tune()
        winner = outcome.winner
        for step in outcome.steps:
            print(f"  {name} #{step.step} {step.train.label()}: {step.result.status} "
                  f"{(step.result.peak_bytes or 0) / GIB:.2f} GiB {step.result.throughput or 0:,.0f} tokens/s",
                  flush=True)
        outcomes[name] = (request, outcome)
        rows[name] = dict(winner=winner.train.label(), expert_parallel=winner.train.expert_parallel,
                          peak_gib=winner.result.peak_bytes / GIB, limit_gib=request.memory_limit_bytes / GIB,
                          tokens_per_sec=winner.result.throughput, trials=len(outcome.steps),
                          binding=routing.binding(model.num_experts, winner.train.expert_parallel)["note"],
                          tune_seconds=time.monotonic() - began)
        print(f"{name:>12}: winner {rows[name]['winner']}  peak {rows[name]['peak_gib']:.2f} GiB of "
              f"{rows[name]['limit_gib']:.2f}  {rows[name]['tokens_per_sec'] or 0:,.0f} tokens/s  "
              f"({rows[name]['trials']} trials, {rows[name]['tune_seconds']:.0f} s)", flush=True)
    skewed_request, skewed_outcome = outcomes[args.skew]
    balanced_winner = outcomes["balanced"][1].winner
    with SimBackend(device_kind="cuda") as sim:
        again = sim.evaluate(skewed_request.spec(balanced_winner.train))
    fits = again.ok
    rows["balanced winner under the skew"] = dict(
        winner=balanced_winner.train.label(), peak_gib=(again.peak_bytes or 0) / GIB, fits=fits,
        tensor_peak_bytes=again.extras.get("tensor_peak_bytes"),
        binding=skew.binding(model.num_experts, balanced_winner.train.expert_parallel)["note"])
    print(f"the balanced winner {balanced_winner.train.label()} under {args.skew}: predicted "
          f"{(again.peak_bytes or 0) / GIB:.2f} GiB per GPU on the binding rank: "
          f"{'fits' if fits else 'does NOT fit'} ({again.status})")
    tried = [(s.train.label(short=True), s.result.peak_bytes, s.fits, s.result.throughput) for s in skewed_outcome.steps
             if s.train.expert_parallel > 1 and s.result.status in ("ok", "oom")]
    note = tune_note(skew, model.num_experts, skewed_outcome.winner.train.expert_parallel, tried)
    rows["note"] = note
    print(f"the skewed tune's note: {note}")
    differs = balanced_winner.train != skewed_outcome.winner.train
    print(f"winners differ: {differs}; the balanced winner fits under the skew: {fits}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
