"""What a CPU trial's step costs, and what the two speed-ups of issue 35 each save.

    python benchmarks/bench_cpu_trial.py [--repeats 3]

Each figure is measured here, one thread (as trial ranks run), median of `--repeats`, each in a
fresh process so that the bf16 kernels are registered or not:

1. one bf16 matrix product (256 x 256 @ 256 x 8000, tiny-llama's output layer): torch's kernel
   against autotune's fp32-computed bf16 kernel (autotune/backends/real/_cpu_bf16.py);
2. bf16 flash attention forward and backward at tiny-llama's heads (2 x 256 tokens), both ways;
3. a bf16 forward and backward of tiny-llama (seq 256, micro-batch 1), both ways;
4. the same step of gemma3_text-shaped tiny model (20 blocks) under torch's MemTracker and under
   CapacityTracker (autotune/backends/real/_capacity.py), with the fast kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_PROBE = r"""
import json, sys, time, torch
torch.set_num_threads(1)
fast, what = sys.argv[1] == "fast", sys.argv[2]
if fast:
    from autotune.backends.real._cpu_bf16 import compute_bf16_kernels_in_fp32
    compute_bf16_kernels_in_fp32()
from autotune.problem.catalog.models import resolve_model
from autotune.distributed.training import build_model

def timed(fn, n=3):
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return min(times)

if what == "mm":
    a, b = torch.randn(256, 256, dtype=torch.bfloat16), torch.randn(256, 8000, dtype=torch.bfloat16)
    print(json.dumps(timed(lambda: a @ b)))
elif what == "attention":  # tiny-llama's heads as its model passes them: a transposed [batch, seq, heads, dim]
    q, k, v = (torch.randn(2, 256, 4, 64, dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for _ in range(3))
    print(json.dumps(timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward())))
elif what == "step":
    model = build_model(resolve_model("tiny-llama"), seed=0).to(torch.bfloat16)
    ids = torch.randint(0, 8000, (1, 256))
    print(json.dumps(timed(lambda: model(input_ids=ids, labels=ids).loss.backward())))
else:  # tracker: MemTracker or CapacityTracker around a 20-block model's step
    from torch.distributed._tools.mem_tracker import MemTracker
    from autotune.backends.real._capacity import CapacityTracker
    from transformers import AutoModelForCausalLM, Gemma3TextConfig  # the family test's gemma3_text
    config = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                              vocab_size=512, max_position_embeddings=256, num_hidden_layers=20, head_dim=16,
                              sliding_window=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    ids = torch.randint(0, 512, (2, 64))
    tracker = MemTracker() if what == "memtracker" else CapacityTracker(capacity_bytes=None)
    def step():
        tracker.reset_mod_stats()
        model(input_ids=ids, labels=ids).loss.backward()
    with tracker:
        tracker.track_external(model)
        print(json.dumps(timed(step, n=2)))
"""


def measure(mode: str, what: str, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        done = subprocess.run([sys.executable, "-c", _PROBE, mode, what], capture_output=True, text=True, check=True)
        samples.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    import torch

    from autotune.backends.real._cpu_bf16 import native_bf16_matmul

    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, native bf16 GEMM: {native_bf16_matmul()}")
    rows = [("bf16 product 256x256 @ 256x8000", "mm"), ("bf16 flash attention fwd+bwd, 2x256 tok", "attention"),
            ("tiny-llama bf16 fwd+bwd, seq 256", "step")]
    for label, what in rows:
        slow, fast = measure("torch", what, args.repeats), measure("fast", what, args.repeats)
        print(f"{label:40s} torch's kernel {slow * 1e3:9.1f} ms   fp32-computed {fast * 1e3:9.1f} ms   "
              f"ratio {slow / fast:5.1f}x  (measured, median of {args.repeats})")
    theirs, mine = measure("fast", "memtracker", args.repeats), measure("fast", "capacity", args.repeats)
    print(f"{'20-block model fwd+bwd under a tracker':40s} MemTracker {theirs * 1e3:13.1f} ms   CapacityTracker "
          f"{mine * 1e3:8.1f} ms   ratio {theirs / mine:5.1f}x  (measured, median of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
