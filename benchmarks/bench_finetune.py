"""Per-GPU memory of full, LoRA, QLoRA and pure-bf16 fine-tuning (issue 27), predicted by the simulator.

    python benchmarks/bench_finetune.py [--models llama3.1-8b,llama3.1-70b] [--seq-lens 8192,32768]
                                        [--modes full,lora,qlora,bf16-pure,lora+bf16-pure]
                                        [--gpus 8] [--json out.json]

Each row is one configuration traced with the real model under fake tensors and a fake process
group (8 ranks on one node of H100 80GB; the limit is autotune's default, 10% headroom): micro-batch 1, every block checkpointed, 4 accumulation
steps, autotune's own FSDP2 loop. Columns: the predicted tensor peak plus the estimated runtime
terms (`predicted+estimated`), and the trace's breakdown at the peak (parameters, gradients,
AdamW state, activations). Modes:

* full: bf16 mixed precision, fp32 master weights, every parameter trains;
* lora: peft LoRA r=16, alpha 32, dropout 0.05 on every linear layer but the head (TRL's examples);
  the frozen base in bf16, the adapters in fp32;
* qlora: the same LoRA on a base quantized by bitsandbytes to 4-bit NF4 (blocks of 64, double
  quantization, codes stored in bf16: HF's FSDP-QLoRA BitsAndBytesConfig), traced with bnb's own ops
  (needs bitsandbytes; docs/FINETUNING.md);
* bf16-pure: every parameter trains, parameters, gradients and AdamW state in bf16;
* lora+bf16-pure: the adapters in bf16 too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GIB = 2**30
MODES = {"full": ("bf16", "none"), "lora": ("bf16", "lora"), "qlora": ("bf16", "qlora"), "bf16-pure": ("bf16-pure", "none"),
         "lora+bf16-pure": ("bf16-pure", "lora")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama3.1-8b,llama3.1-70b")
    parser.add_argument("--seq-lens", default="8192,32768")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()

    from autotune.backends.sim import SimBackend
    from autotune.problem.catalog.models import resolve_model
    from autotune.problem.config import Cluster, FineTuning, TrainConfig, TrialSpec
    from autotune.distributed.training import parameter_counts

    rows = []
    from autotune.problem.config import Workload, memory_limit_bytes

    limit = memory_limit_bytes(Cluster(num_gpus=args.gpus).capacity_bytes, headroom=0.10, workload=Workload())
    print(f"| model | seq | mode | trainable | peak/GPU (P+E) | params | grads | AdamW | activations "
          f"| fits {limit / GIB:.2f} GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with SimBackend(device_kind="cuda", screen=False) as sim:
        for name in args.models.split(","):
            model = resolve_model(name)
            for seq in map(int, args.seq_lens.split(",")):
                for mode in args.modes.split(","):
                    precision, peft = MODES[mode]
                    finetuning = FineTuning(peft=peft)
                    spec = TrialSpec(model=model, cluster=Cluster(num_gpus=args.gpus), seq_len=seq,
                                     grad_accum_steps=4, finetuning=finetuning,
                                     train=TrainConfig(micro_batch_size=1, activation_checkpointing="full",
                                                       precision=precision))
                    started = time.perf_counter()
                    result = sim.evaluate(spec)
                    b = result.memory_breakdown
                    counts = parameter_counts(model, finetuning)
                    row = dict(model=name, seq_len=seq, mode=mode, trainable=counts.trainable, total=counts.total,
                               status=result.status, peak_bytes=result.peak_bytes,
                               tensor_peak_bytes=result.extras.get("tensor_peak_bytes"), breakdown=b,
                               seconds=round(time.perf_counter() - started, 1))
                    rows.append(row)
                    fits = bool(result.peak_bytes) and result.peak_bytes <= limit
                    print(f"| {name} | {seq} | {mode} | {counts.trainable / 1e6:,.1f}M | "
                          f"{(result.peak_bytes or 0) / GIB:.1f} GiB | {b.get('parameters', 0) / GIB:.1f} | "
                          f"{b.get('gradients', 0) / GIB:.2f} | {b.get('optimizer_state', 0) / GIB:.2f} | "
                          f"{b.get('activations', 0) / GIB:.1f} | {'yes' if fits else 'no'} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
