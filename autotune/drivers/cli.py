"""The command line: `autotune [tune] ...`, `plan`, `trial`, `export`, `report`, `sweep`, `regress`, `agent`.

Each command is a thin wrapper over library functions; shared options are defined once;
errors are turned into one line and an exit code in one place (`main`).

Exit codes: 0 done, 2 bad input, 3 nothing fits, 4 a regression (regress), 5 storage unreachable
(after waiting through an outage), 1 internal error,
130 interrupted (Ctrl-C), 143 terminated (SIGTERM); after either, finished trials are kept and a
rerun resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from autotune.problem import knobs as knob_registry
from autotune.drivers.api import (check_backend_traces, check_hardware, check_multi_node, check_out_file,
                          check_precision_runs, check_wrappable, choose_backend, make_backend, parse_formats,
                          resolve_finetuning, resolve_problem, resolve_stack, resolve_workload, run_tune,
                          write_formats)
from autotune.util.errors import AutotuneError, NothingFits, StorageUnavailable, UsageError
from autotune.util.interrupts import raised_where_safe
from autotune.problem.catalog.attention import ATTENTION_IMPLEMENTATIONS
from autotune.problem.config import PEFT_METHODS, STACKS, check_float8_library
from autotune.problem.options import (BACKENDS, COMPILE_SEARCH, FLOAT8_SEARCH, SEQ_LEN_STEP, WORKLOADS, TuneOptions, duration, fraction, number,
                              positive_int, routing_skew, token_budget, doc_lengths, usage_error)

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_NOTHING_FITS, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports it
EXIT_STORAGE = 5  # the storage stayed unreachable through the outage wait


class Terminated(KeyboardInterrupt):
    """SIGTERM (what Slurm, systemd and `kill` send): unwinds exactly like Ctrl-C, so finished trials
    are kept, trial workers are stopped and temporary folders removed on the way out."""


COMMANDS = ("tune", "plan", "trial", "export", "report", "agent", "sweep", "regress", "calibrate", "models", "gpus")


class _Parser(argparse.ArgumentParser):
    """argparse, but bad arguments are one line and exit 2 like every other usage error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise usage_error(message, self.prog)


# -- shared options ---------------------------------------------------------------------------------
def _add_problem_options(parser: argparse.ArgumentParser, *, model_required: bool, seq_len_max: bool = False) -> None:
    group = parser.add_argument_group("model and cluster")
    _add_model_options(group, required=model_required)
    group.add_argument("--gpus", type=positive_int, help="total GPUs (ranks) of the job")
    group.add_argument("--nodes", type=positive_int, default=None,
                       help="nodes (default: --gpus / --gpus-per-node; one node up to that many GPUs)")
    group.add_argument("--gpus-per-node", type=positive_int, default=None,
                       help="GPUs per node (default 8, or --gpus / --nodes where --nodes is given)")
    group.add_argument("--gpu-type", help="GPU catalog entry (h100-80gb, a100-40gb, ...); default: the "
                                          "one detected here, else h100-80gb")
    group.add_argument("--gpu-memory", help="override the memory per GPU, e.g. 40GiB; on the cpu backend "
                                            "the per-rank capacity")
    group.add_argument("--host-memory", help="host memory per node, e.g. 1TiB (checked for CPU offload)")
    _add_seq_len(group, seq_len_max=seq_len_max)
    group.add_argument("--hardware", metavar="PROFILE",
                       help="hardware profile the sim backend estimates step time on: a JSON file from "
                            "`autotune calibrate` or a catalog GPU name (default: the GPU's shipped profile)")
    group.add_argument("--backend", default="auto", choices=BACKENDS,
                       help="how trials run: sim (fake-tensor trace: memory predicted, time estimated), "
                            "analytic (closed form, estimated), cpu (real gloo trials), cuda (real "
                            "GPU trials); auto = cuda when the GPUs are here, else sim")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--workload", choices=WORKLOADS, default=None,
                          help="sft (default): the GPUs only train; grpo: TRL GRPO with vLLM colocated on every "
                               "GPU: training gets what vLLM leaves, and the weight sync to vLLM is part of the peak")
    workload.add_argument("--vllm-gpu-memory-utilization", type=number, default=None,
                          help="grpo: fraction of each GPU's memory vLLM takes, in (0, 1); default: the tune "
                               "chooses the smallest share in steps of 0.05 that holds vLLM's estimated need (bf16 "
                               "weights, KV cache for the per-GPU generation batch, overheads), the rest to training")
    workload.add_argument("--max-completion-length", type=positive_int, default=None,
                          help="grpo: longest completion vLLM generates (default 512, TRL's); the prompt gets the "
                               "rest of --seq-len (prompt + completion)")
    workload.add_argument("--num-generations", type=positive_int, default=None,
                          help="grpo: completions per prompt, at least 2 (default 8, TRL's, where it divides the "
                               "tuned global batch)")
    workload.add_argument("--stack", choices=tuple(STACKS), default=None,
                          help="whose training step the memory is predicted for (default fsdp2: autotune's own "
                               "loop). accelerate, hf-trainer: Accelerate's FSDP2 plugin (autocast, fp32 outputs, "
                               "its mixed-precision policy); trl: SFTTrainer's fused LM head on it; trl-padding-free: "
                               "the same on padding-free batches (TRL's default bfd packing); torchtitan, "
                               "litgpt: their own model and step where the package is importable (llama; "
                               "torchtitan also qwen3); llama-cookbook: not traced (docs/STACKS.md)")
    workload.add_argument("--token-budget", type=token_budget, default=None, metavar="TOKENS",
                          help="packed batches: each micro-batch one padding-free row of whole documents of up to "
                               "TOKENS tokens (a multiple of --seq-len, the longest document), as TRL's padding-free "
                               "and verl's dynamic batches; tune: 'search' or the most to search up to (docs/KNOBS.md)")
    workload.add_argument("--doc-lengths", type=doc_lengths, default=None, metavar="FILE",
                          help="packed batches' document lengths: a file of lengths, a JSON histogram "
                               "{\"length\": count} or loguniform:LOW:HIGH (default loguniform:64:8192, an assumption)")
    workload.add_argument("--routing-skew", type=routing_skew, default=None, metavar="PROFILE",
                          help="MoE models: how the router spreads tokens over the experts, an assumption of the "
                               "problem: balanced (default), zipf:S (expert e's share ~ 1/(e+1)^S), capacity:C "
                               "(the hottest expert-parallel rank receives C x its balanced share) or a file of "
                               "measured per-expert token counts; with --ep the binding rank is traced "
                               "(docs/KNOBS.md)")
    tuning = parser.add_argument_group("fine-tuning")
    tuning.add_argument("--peft", choices=PEFT_METHODS, default=None,
                        help="none (default): every parameter trains; lora: peft LoRA adapters on a frozen base "
                             "(base weights in the compute dtype, sharded, no gradients or optimizer state); "
                             "qlora: the same on a base quantized to 4-bit NF4 by bitsandbytes (FSDP-QLoRA's layout)")
    tuning.add_argument("--lora-rank", type=positive_int, default=None, help="lora: adapter rank r (default 16)")
    tuning.add_argument("--lora-alpha", type=number, default=None, help="lora: scaling alpha (default 32)")
    tuning.add_argument("--lora-dropout", type=number, default=None, help="lora: adapter dropout (default 0.05)")
    tuning.add_argument("--lora-targets", default=None,
                        help="lora: comma-separated module names, or all-linear (default: every linear layer but "
                             "the output head, the attention and MLP projections, as TRL's examples)")
    real = parser.add_argument_group("real trials (cpu, cuda backends)")
    real.add_argument("--timeout", type=duration, default=600.0,
                      help="kill a trial after this long (default 600s)")
    real.add_argument("--rdzv-endpoint", help="multi-node trials: HOST:PORT every node reaches "
                                              "(torchrun's c10d rendezvous)")
    real.add_argument("--shared-dir", help="multi-node trials: a folder every node sees; run `autotune agent "
                                           "--shared-dir DIR` on each other node (docs/REAL_TRIALS.md)")
    real.add_argument("--node-rank", help=argparse.SUPPRESS)  # gone: refused with what to do instead


def _add_model_options(group, *, required: bool) -> None:
    """--model and how it is read: every command that takes a model takes these alike."""
    group.add_argument("--model", required=required,
                       help="catalog name (llama-7b, llama3-8b, mistral-7b, qwen2.5-7b, tiny-llama, ...) "
                            "or a path to a Hugging Face config.json or model folder")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="allow a local config that needs custom model code (off by default)")
    group.add_argument("--text-only", action="store_true",
                       help="a multimodal config (Llava, Gemma 3, ...): tune its language model (text_config) "
                            "alone; the run says what it leaves out (the other towers' parameters and their "
                            "estimated memory per GPU, their activations)")
    group.add_argument("--attention", choices=ATTENTION_IMPLEMENTATIONS, default=None,
                       help="the attention your stack runs (transformers' attn_implementation): sdpa (the default "
                            "where the model has it), eager (keeps every layer's seq x seq scores), flash_attention_2 "
                            "(Ampere or newer), flash_attention_3 (Hopper); traced and costed as it runs on the GPU "
                            "(docs/KNOBS.md)")


def _add_seq_len(group, *, seq_len_max: bool) -> None:
    from autotune.drivers.seqlen import seq_len_or_max

    if not seq_len_max:
        group.add_argument("--seq-len", type=positive_int, help="training sequence length (default: the catalog entry's)")
        return
    group.add_argument("--seq-len", type=seq_len_or_max,
                       help="training sequence length (default: the catalog entry's), or 'max': the longest "
                            "that fits with some configuration, with a table of throughput vs length")
    group.add_argument("--seq-len-step", type=positive_int, default=SEQ_LEN_STEP,
                       help=f"--seq-len max: the granularity of the answer (default {SEQ_LEN_STEP})")


def build_parser() -> argparse.ArgumentParser:
    root = _Parser(prog="autotune", description="Find the fastest FSDP2 configuration that fits, and prove it.")
    root.add_argument("--version", "-V", action="store_true", help="print the version and exit")
    sub = root.add_subparsers(dest="command", parser_class=_Parser)

    tune = sub.add_parser("tune", help="walk the decision graph and write the winner (the default command)")
    _add_problem_options(tune, model_required=True, seq_len_max=True)
    tune.set_defaults(gpus=None)
    run = tune.add_argument_group("run")
    run.add_argument("--global-tokens", required=True,
                     help="target tokens per optimizer step: 4M = 4,000,000; 4Mi = 4,194,304; 4_000_000")
    run.add_argument("--global-tolerance", type=fraction, default=None,
                     help="largest allowed relative deviation from --global-tokens (default 0.01)")
    run.add_argument("--headroom", type=fraction, default=None,
                     help="fraction of GPU memory kept free (default 0.10)")
    run.add_argument("--space", help="search-space TOML (default: search_spaces/default.toml)")
    run.add_argument("--storage", help="Optuna storage URL (default: sqlite in --runs-dir); share one "
                                       "database across a cluster sweep")
    run.add_argument("--study", help="study name (default: derived from the problem, so a rerun resumes)")
    run.add_argument("--runs-dir", default="runs", help="output folder (default: runs)")
    run.add_argument("--out", help="also write the winning configuration JSON here")
    run.add_argument("--export", help="comma-separated export formats to write next to best.json "
                                      "(fsdp2, fsdp1, lightning, lightning-fsdp1, accelerate, hf-trainer, trl, "
                                      "torchtitan, llama-cookbook, litgpt; 'all': all but lightning-fsdp1)")
    run.add_argument("--max-trials", type=positive_int, help="stop after this many new trials")
    run.add_argument("--time-budget", type=duration, help="stop starting trials after this long, e.g. 10m")
    run.add_argument("--precision", choices=knob_registry.PRECISIONS, default=None,
                     help="the numerics of every trial: bf16 (mixed: fp32 master weights; fp16 on GPUs without "
                          "bf16), fp16, fp32 or bf16-pure (everything in bf16, no fp32 copy); default: the search "
                          "space's baseline.precision (bf16)")
    run.add_argument("--compile", choices=COMPILE_SEARCH, default=None,
                     help="torch.compile of the decoder blocks: auto (explore, but not on real CPU trials), none "
                          "(eager), explore (the graph eager, then its best candidates compiled) or blocks (every "
                          "trial compiled); default: the search space's compile.mode (auto). docs/COMPILE.md")
    run.add_argument("--float8", choices=FLOAT8_SEARCH, default=None,
                     help="float8 training of the blocks' linears (torchao; GPUs with float8 only): auto (explore "
                          "where it can be evaluated, else none and the notes say why), none, explore (the graph "
                          "in high precision, then its best fitting candidates with each recipe), tensorwise or "
                          "rowwise (every trial); default: the search space's float8.mode (auto). docs/COMPILE.md")
    run.add_argument("--json", action="store_true", help="print the result JSON on stdout, nothing else")
    run.add_argument("--verbose", action="store_true",
                     help="print the winner's full bases, ranges, checkpoint advice and close-call commands "
                          "(always in best.json and report.html)")

    from autotune.problem.catalog.gpus import DEFAULT_GPU
    from autotune.drivers.plan import GPUS_PER_NODE, PLAN_BACKENDS

    plan = sub.add_parser("plan", help="for a model and a token budget: GPU count and type, time, cost and "
                                       "binding limit of each option (a tune per option)")
    what = plan.add_argument_group("the question")
    _add_model_options(what, required=True)
    what.add_argument("--train-tokens", required=True, help="tokens to train on, e.g. 1T, 300G, 15_000_000_000")
    what.add_argument("--gpus", required=True,
                      help="GPU counts: a list (8,16,32) and/or doubling ranges (8..256 = 8,16,...,256)")
    what.add_argument("--gpu-type", default=DEFAULT_GPU,
                      help=f"comma-separated GPU catalog entries (default {DEFAULT_GPU})")
    what.add_argument("--gpus-per-node", type=positive_int, default=None,
                      help=f"GPUs per node (default {GPUS_PER_NODE})")
    what.add_argument("--global-tokens", required=True, help="target tokens per optimizer step, as in tune: 4Mi")
    what.add_argument("--price", help="price per GPU-hour by type, e.g. h100-80gb=2.49,a100-80gb=1.79; no "
                                      "default prices: cost is shown only where one is given")
    _add_seq_len(what, seq_len_max=True)
    how = plan.add_argument_group("how")
    how.add_argument("--backend", choices=PLAN_BACKENDS, default=PLAN_BACKENDS[0],
                     help="sim (traced memory, estimated throughput; default) or analytic (closed form)")
    how.add_argument("--global-tolerance", type=fraction, default=None, help="as in tune (default 0.01)")
    how.add_argument("--headroom", type=fraction, default=None, help="as in tune (default 0.10)")
    how.add_argument("--space", help="search-space TOML, as in tune")
    how.add_argument("--storage", help="Optuna storage URL (default: sqlite in --runs-dir)")
    how.add_argument("--runs-dir", default="runs", help="output folder: each option's run and plan-<time>/ (default runs)")
    how.add_argument("--jobs", type=positive_int, help="processes (default: one per two free cores on sim)")
    how.add_argument("--compile", choices=COMPILE_SEARCH, default=None,
                     help="as in tune: each option's search explores compiled blocks where tune would (auto, the "
                          "default); none plans eager, at half the traces")
    how.add_argument("--float8", choices=FLOAT8_SEARCH, default=None, help="as in tune (default auto)")
    how.add_argument("--out", help="also write plan.json here")
    how.add_argument("--json", action="store_true", help="print plan.json on stdout, nothing else")
    lost = plan.add_argument_group("expected time to train: what real runs lose beyond the benchmark time "
                                   "(docs/PLAN.md)")
    lost.add_argument("--checkpoint-every", metavar="DURATION",
                      help="training time between checkpoint saves, e.g. 30m, 1h (default: the Young/Daly "
                           "interval from the write time and the failure rate, at most 1h)")
    lost.add_argument("--checkpoint-write-bandwidth", metavar="BYTES",
                      help="checkpoint write bandwidth per node per second, e.g. 2GB (default 1GB)")
    lost.add_argument("--failure-rate", metavar="N",
                      help="job interruptions per million GPU-hours (default 19.7: Llama 3's 419 in 54 days on "
                           "16,384 GPUs)")
    lost.add_argument("--restart-time", metavar="DURATION",
                      help="detection + restart of a failed job, e.g. 10m (default 10m)")
    lost.add_argument("--eval-fraction", metavar="F", help="evaluation as a fraction of training time (default 0.01)")
    lost.add_argument("--startup", metavar="DURATION", help="the first start: scheduling, loading, first steps "
                                                            "(default 1h)")

    trial = sub.add_parser("trial", help="evaluate one configuration and print its result as JSON")
    _add_problem_options(trial, model_required=False)
    knobs = trial.add_argument_group("configuration (or --config)")
    knobs.add_argument("--config", help="a result JSON (best.json) to re-evaluate")
    knobs.add_argument("--grad-accum", type=positive_int, default=1)
    knob_registry.add_arguments(knobs)  # one flag per tuned knob (autotune/problem/knobs.py)
    knobs.add_argument("--headroom", type=fraction, default=None,
                       help="fraction of GPU memory kept free (default 0.10)")

    from autotune.results.export_formats import DESCRIPTIONS

    formats_list = "\n".join(f"  {name:<16} {line}" for name, line in DESCRIPTIONS.items())
    export = sub.add_parser("export", help="write a result in the format of another training stack",
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=f"formats (--format, any case):\n{formats_list}\n\n"
                                   "A format that cannot express this result (torchtitan for a model it does not "
                                   "have) is\nskipped with a warning and the others are written; when none is "
                                   "written, the command\nsays why and exits 2.")
    export.add_argument("result", help="runs/<run-id>/best.json (or the run folder), or a plan.json with --option")
    export.add_argument("--option", help="a plan.json's option to export: <gpu-type>x<gpus>, e.g. h100-80gbx64")
    export.add_argument("--format", required=True,
                        help="comma-separated formats (below), or 'all' (every format but lightning-fsdp1)")
    export.add_argument("--out-dir", help="where to write (default: next to the result)")

    agent = sub.add_parser("agent", help="multi-node trials: run this node's part of the launches of a "
                                         "controller on another node")
    agent.add_argument("--shared-dir", required=True, help="the folder given to the controller's --shared-dir")
    agent.add_argument("--wait", type=duration, default=600.0,
                       help="how long to wait for a controller to start (default 600s)")

    sweep = sub.add_parser("sweep", help="tune a matrix of problems, each once, with any number of workers "
                                         "sharing --storage")
    sweep.add_argument("file", help="the sweep file (TOML: name, [matrix], [options]; see docs/SWEEPS.md)")
    sweep.add_argument("--storage", help="Optuna storage URL every worker reaches (default: sqlite in --runs-dir)")
    sweep.add_argument("--runs-dir", default="runs", help="output folder (default: runs)")
    sweep.add_argument("--name", help="the sweep's name (default: the file's); e.g. nightly-$(date +%%F)")
    sweep.add_argument("--local", type=positive_int, help="start this many workers on this machine")
    sweep.add_argument("--slurm", type=positive_int, metavar="N",
                       help="submit N workers as a Slurm job array (sbatch) and return")
    sweep.add_argument("--sbatch", action="append", default=[], metavar="ARG",
                       help="an sbatch option for --slurm, e.g. --sbatch=--partition=cpu (repeatable)")
    sweep.add_argument("--wait", action="store_true", help="with --slurm: wait until the job array ends")
    sweep.add_argument("--heartbeat", type=float, default=10.0,
                       help="seconds between a worker's heartbeats; the problem of a worker silent for 3 goes "
                            "to another (default 10)")

    calibrate = sub.add_parser("calibrate", help="measure this machine (GEMMs, memory, collectives, AdamW; "
                                                 "on GPUs also runtime memory) into a hardware profile")
    calibrate.add_argument("--backend", choices=("cpu", "cuda"), default="cpu",
                           help="cpu: CPU ranks with gloo (default); cuda: every local GPU with NCCL")
    calibrate.add_argument("--model", default="tiny-llama",
                           help="catalog model whose shapes the GEMMs and FSDP units take (default tiny-llama)")
    calibrate.add_argument("--ranks", type=positive_int, help="ranks (default: 2 on cpu, every GPU on cuda)")
    calibrate.add_argument("--out", help="profile JSON to write (default: hardware-<backend>.json)")

    regress = sub.add_parser("regress", help="compare a sweep's winners with an earlier sweep of the same matrix")
    regress.add_argument("sweep", help="the sweep's name")
    regress.add_argument("--baseline", help="the sweep to compare with (default: the latest earlier one of "
                                            "the same matrix)")
    regress.add_argument("--storage", help="Optuna storage URL (default: sqlite in --runs-dir)")
    regress.add_argument("--runs-dir", default="runs", help="where the default storage is and reports go")
    regress.add_argument("--throughput-drop", type=fraction, default=0.05,
                         help="a throughput drop larger than this fraction is a regression (default 0.05)")
    regress.add_argument("--memory-rise", type=fraction, default=0.05,
                         help="a peak-memory rise larger than this fraction is a regression (default 0.05)")

    report = sub.add_parser("report", help="rebuild runs/<run-id>/report.html from the study")
    report.add_argument("run_dir", help="runs/<run-id>")
    report.add_argument("--storage", help="Optuna storage URL (default: sqlite in the run's parent folder)")

    for name, what in (("models", "models: their shapes, parameter counts and sources"),
                       ("gpus", "GPUs: their data-sheet figures and sources")):
        listing = sub.add_parser(name, help=f"list the catalog's {what}")
        listing.add_argument("--json", action="store_true", help="print the list as JSON (every field)")
    return root


_VALUE_OPTIONS = ("--global-tokens", "--gpus", "--nodes", "--seq-len", "--micro-batch", "--grad-accum",
                  "--max-trials", "--gpu-memory", "--host-memory", "--headroom", "--global-tolerance",
                  "--vllm-gpu-memory-utilization", "--max-completion-length", "--num-generations")


def _attach_negative_values(argv: list[str]) -> list[str]:
    """`--global-tokens -4M` -> `--global-tokens=-4M`: argparse would read -4M as an option and say
    only "expected one argument"; attached, the value reaches its own validation and message."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in _VALUE_OPTIONS and i + 1 < len(argv) and argv[i + 1][:1] == "-" and argv[i + 1][1:2].isdigit():
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    if argv[:1] in (["--version"], ["-V"]):
        import autotune

        print(f"autotune {autotune.__version__}")
        raise SystemExit(EXIT_OK)
    argv = _attach_negative_values(argv)
    # `autotune --model ...` means `autotune tune --model ...`.
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        argv = ["tune", *argv]
    args = build_parser().parse_args(argv)
    if args.command is None:
        build_parser().print_help()
        raise SystemExit(EXIT_OK)
    if args.command in ("tune", "trial"):
        check_multi_node(args)
    return args


# -- commands: each calls the library, prints through `console` and returns the exit code -------------
def cmd_tune(args: argparse.Namespace, console) -> int:
    """The library's run_tune (autotune/drivers/api.py) with the parsed flags."""
    from autotune.results.result import dumps

    try:
        if args.seq_len == "max":
            document = _tune_seq_len_max(args, console)
        else:
            document = run_tune(TuneOptions.from_namespace(args), console)
    except NothingFits as exc:
        console.error_line(str(exc))
        return EXIT_NOTHING_FITS
    if args.json:
        sys.stdout.write(dumps(document))
    return EXIT_OK


def _tune_seq_len_max(args: argparse.Namespace, console) -> dict:
    """--seq-len max: bisect the length (each probe a quiet tune), then tune at the answer out loud."""
    from autotune.drivers.seqlen import tune_at_longest

    return tune_at_longest(TuneOptions.from_namespace(args), console)


def cmd_plan(args: argparse.Namespace, console) -> int:
    from autotune.util.files import write_atomic
    from autotune.drivers.plan import (PlanOptions, parse_gpu_counts, parse_gpu_types, parse_prices, parse_train_assumptions,
                               plan_dir, run_plan)
    from autotune.results.result import dumps
    from autotune.util.units import parse_count

    gpu_types = parse_gpu_types(args.gpu_type)
    train_tokens = parse_count(args.train_tokens, what="--train-tokens")
    if train_tokens < 1:
        raise UsageError("--train-tokens must be positive, e.g. 1T")
    parse_count(args.global_tokens, what="--global-tokens")
    check_out_file(args.out)
    assumptions = parse_train_assumptions(
        checkpoint_every=args.checkpoint_every, write_bandwidth=args.checkpoint_write_bandwidth,
        failure_rate=args.failure_rate, restart_time=args.restart_time, eval_fraction=args.eval_fraction,
        startup=args.startup)
    options = PlanOptions(model=args.model, train_tokens=train_tokens, gpus=parse_gpu_counts(args.gpus),
                          gpu_types=gpu_types, global_tokens=args.global_tokens,
                          prices=parse_prices(args.price, gpu_types),
                          seq_len=None if args.seq_len == "max" else args.seq_len, backend=args.backend,
                          gpus_per_node=args.gpus_per_node, headroom=args.headroom,
                          global_tolerance=args.global_tolerance, space=args.space, runs_dir=args.runs_dir,
                          storage=args.storage, trust_remote_code=args.trust_remote_code,
                          text_only=args.text_only, attention=args.attention, jobs=args.jobs, compile=args.compile,
                          float8=args.float8,
                          train_assumptions=assumptions)
    seq_len_max = None
    if args.seq_len == "max":
        from autotune.drivers.plan import plan_max_seq_len

        seq_len_max = lambda model: plan_max_seq_len(options, model, step=args.seq_len_step, log=console.note)  # noqa: E731
    try:
        with console.progress() as live:
            plan = run_plan(options, console.note, seq_len_max=seq_len_max, progress=live)
    except NothingFits as exc:
        console.error_line(str(exc))
        return EXIT_NOTHING_FITS
    folder = plan_dir(args.runs_dir)
    text = dumps(plan)
    write_atomic(folder / "plan.json", text)
    if args.out:
        write_atomic(Path(args.out), text)
    try:
        from autotune.results.report import write_plan_report

        console.note(f"report: {write_plan_report(folder, plan)}")
    except ImportError:
        pass
    if plan.get("sequence_length"):
        console.seq_len_table(plan["sequence_length"])
    ok = [o for o in plan["options"] if o["status"] == "ok"]
    if ok:
        sources = sorted({o["peak_memory_bytes"]["source"] for o in ok})
        console.note(f"figures ({plan['backend']} backend): per-GPU memory {'/'.join(sources)}, tokens/s "
                     f"{ok[0]['tokens_per_sec']['source']} on each GPU type's catalog figures; days, GPU-hours and "
                     f"cost follow from tokens/s; exp: expected days with what runs lose (checkpoints, failures, "
                     f"evaluation, start-up, goodput fitted on published runs); every basis and range is in plan.json")
    console.plan_table(plan)
    console.note(f"planned {len(plan['options'])} options in {plan['wall_s']:.0f} s (measured)")
    console.note(f"wrote {folder / 'plan.json'}" + (f" and {args.out}" if args.out else "") +
                 f"; export an option with: autotune export {folder / 'plan.json'} --option ID --format fsdp2")
    if args.json:
        sys.stdout.write(text)
    if not ok:
        console.error_line("no option has a configuration that fits (each row says which limit binds)")
        return EXIT_NOTHING_FITS
    return EXIT_OK


def cmd_calibrate(args: argparse.Namespace, console) -> int:
    from autotune.drivers.calibrate import calibrate

    out = args.out or f"hardware-{args.backend}.json"
    check_out_file(out)  # before a minute of measuring, not after
    profile, raw = calibrate(backend=args.backend, model_name=args.model, out=out, world_size=args.ranks)
    console.note(f"measured on {profile.machine.get('cpu') or profile.machine.get('machine')} in "
                 f"{raw['duration_s']:.0f} s; profile {profile.name} written to {out}")
    for name, figure in profile.figures.items():
        console.note(f"  {name:28s} {figure.value:14.6g}  ({figure.source}: {figure.basis})")
    console.note(f"use it with: autotune tune --backend sim --hardware {out} ...")
    return 0


def cmd_trial(args: argparse.Namespace, console) -> int:
    from autotune.problem.config import TrainConfig, TrialSpec, memory_limit_bytes, stack_section
    from autotune.search.records import DEFAULT_HEADROOM
    from autotune.results.result import text_only_note, text_only_section
    from autotune.problem.packing import FLAG as BUDGET_FLAG, DocumentLengths, packing_section, resolve_packing
    from autotune.problem.routing import RoutingSkew, routing_section

    recorded = recorded_finetuning = recorded_stack = None
    if args.config:
        from autotune.results.result import load_result

        document = load_result(args.config)
        args.model = args.model or document["model"]["name"]
        args.gpus = args.gpus or document["gpus"]
        args.nodes = document.get("nodes", args.nodes)
        args.gpu_type = args.gpu_type or document["gpu"]["type"]
        args.seq_len = args.seq_len or document["seq_len"]
        train = TrainConfig.from_result(document)
        grad_accum = document["grad_accum_steps"]
        recorded = document.get("workload")
        recorded_finetuning = document.get("finetuning")
        recorded_stack = (document.get("stack") or {}).get("name")
        args.attention = args.attention or document["model"].get("attention_implementation")  # as tuned
        if args.routing_skew is None and document.get("routing_skew"):  # the assumption the result was tuned under
            args.routing_skew = RoutingSkew.from_dict(document["routing_skew"])
        if args.token_budget is None and document.get("packing"):  # packed batches, as tuned
            args.token_budget = document["packing"]["token_budget"]
            if args.doc_lengths is None:
                args.doc_lengths = DocumentLengths.from_dict(document["packing"]["document_lengths"])
    else:
        train = TrainConfig(**knob_registry.from_args(args))
        grad_accum = args.grad_accum
    workload = resolve_workload(args, recorded)
    finetuning = resolve_finetuning(args, recorded_finetuning)
    stack = resolve_stack(args, recorded_stack)
    model, cluster, seq_len, gpu_note = resolve_problem(args)
    check_hardware(args)
    backend_name, why = choose_backend(args.backend, cluster)
    if train.float8 != "none" and backend_name != "analytic":
        check_float8_library(f"--float8 {train.float8}")  # traced or run: torchao's float8 linears
    check_wrappable(model)  # builds the model on the meta device: after the checks that need no model
    check_precision_runs(model, train.precision, instead="run it in bf16-pure (--precision bf16-pure)")
    from autotune.drivers.api import fit_finetuning

    finetuning, finetuning_note = fit_finetuning(args, finetuning, model)
    for note in (gpu_note, finetuning_note):
        if note:
            console.note(note)
    left_out = text_only_section(model, num_gpus=cluster.num_gpus, precision=train.precision)
    if left_out:
        console.note(text_only_note(left_out))
    if workload.kind == "grpo":  # the share (given, recorded or TRL's) must let vLLM start
        from autotune.estimate.vllm_share import check_completion, choose_share, share_note, vllm_need

        workload, completion = check_completion(workload, seq_len, given=args.max_completion_length is not None)
        need = vllm_need(model, seq_len=seq_len, sequences=train.micro_batch_size * (grad_accum or 1))
        fixed_by = ("--vllm-gpu-memory-utilization" if args.vllm_gpu_memory_utilization is not None else
                    "the result's share" if (recorded or {}).get("vllm_gpu_memory_utilization") else "TRL's default")
        console.note(share_note(workload, choose_share(workload, need, cluster.capacity_bytes, fixed=True,
                                                       completion=completion, fixed_by=fixed_by)[1]))
    if args.token_budget == "search":
        raise UsageError(f"{BUDGET_FLAG} search is for autotune tune: a trial runs one budget, a count of tokens")
    packing, budget_rows = resolve_packing(args.token_budget, args.doc_lengths, seq_len=seq_len)
    if budget_rows is not None:  # the budget is the micro-batch in rows of seq_len, the longest document
        if not args.config and args.micro_batch_size not in (1, budget_rows):  # 1: the flag's default
            raise UsageError(f"{BUDGET_FLAG} {args.token_budget:,} is micro-batch {budget_rows} x --seq-len {seq_len:,}: "
                             f"drop --micro-batch {args.micro_batch_size}")
        train = train.with_(micro_batch_size=budget_rows)
    headroom = DEFAULT_HEADROOM if args.headroom is None else args.headroom
    spec = TrialSpec(model=model, cluster=cluster, seq_len=seq_len, train=train, grad_accum_steps=grad_accum,
                     memory_limit_bytes=memory_limit_bytes(cluster.capacity_bytes, headroom=headroom,
                                                           workload=workload),
                     workload=workload, finetuning=finetuning, stack=stack, routing_skew=args.routing_skew,
                     packing=packing)
    check_backend_traces(model, backend_name)
    console.note(f"backend: {backend_name} ({why})")
    if not spec.routing_skew.balanced:
        section = routing_section(spec.routing_skew, model, train.expert_parallel)
        console.note(f"{section['assumption']}; {section['note']}")
    if packing is not None:
        console.note(packing_section(spec)["assumption"])
    backend = make_backend(backend_name, args)
    try:
        result = backend.evaluate(spec)
    finally:
        backend.close()
    if (trace := result.extras.pop("traceback", None)) and os.environ.get("AUTOTUNE_DEBUG"):
        console.error_line(trace)  # the message has its first line; the whole traceback on request
    out = {"backend": backend_name, "model": model.name, "gpus": cluster.num_gpus, "gpu": cluster.gpu.name,
           "seq_len": seq_len, "config": train.to_dict(), "grad_accum_steps": grad_accum,
           "workload": workload.to_dict(), "finetuning": finetuning.to_dict(),
           "stack": stack_section(stack, train.precision, model.model_type),
           **({"routing_skew": routing_section(spec.routing_skew, model, train.expert_parallel)}
              if not spec.routing_skew.balanced else {}),
           **({"packing": packing_section(spec)} if packing is not None else {}),
           "memory_limit_bytes": spec.limit_bytes, "fits": result.ok, **result.to_dict(),
           **({"text_only": left_out} if left_out else {})}
    sys.stdout.write(json.dumps(out, indent=2, default=str) + "\n")
    return EXIT_OK


def cmd_export(args: argparse.Namespace, console) -> int:
    from autotune.drivers.plan import find_option, is_plan
    from autotune.results.result import load_result

    document = load_result(args.result)
    if is_plan(document):
        if not args.option:
            raise UsageError(f"{args.result} is a plan: choose an option with --option, one of "
                             f"{', '.join(o['id'] for o in document['options'])}")
        document = find_option(document, args.option)
    elif args.option:
        raise UsageError(f"--option is for a plan.json; {args.result} is one run's result")
    formats = parse_formats(args.format)
    source = Path(args.result)
    out_dir = Path(args.out_dir) if args.out_dir else (source if source.is_dir() else source.parent)
    write_formats(document, formats, out_dir, console)
    return EXIT_OK


def cmd_report(args: argparse.Namespace, console) -> int:
    from autotune.results.report import write_report
    from autotune.results.result import load_result
    from autotune.search.store import STUDY_DB, TrialStore

    run_dir = Path(args.run_dir)
    document = load_result(run_dir / "best.json")
    storage = args.storage or f"sqlite:///{(run_dir.parent / STUDY_DB).resolve()}"
    if not args.storage and not (run_dir.parent / STUDY_DB).exists():
        raise UsageError(f"no study database next to {str(run_dir)!r}: pass --storage URL")
    records = TrialStore(storage, document["study"]).trials(run_id=document.get("run_id"))
    if not records:
        raise UsageError(f"study {document['study']!r} has no trials of run {document.get('run_id')!r}: "
                         "check --storage")
    path = write_report(run_dir, document, records)
    console.note(f"report: {path}")
    return EXIT_OK


def cmd_sweep(args: argparse.Namespace, console) -> int:
    """Work on a sweep until every problem is finished (or start --local workers that do)."""
    from autotune.util.secrets import mask
    from autotune.results.run_folder import ensure_writable
    from autotune.search.store import default_storage
    from autotune.drivers.sweep import SweepQueue, load_sweep, run_worker, sweep_results

    sweep = load_sweep(Path(args.file), name=args.name)
    if not args.heartbeat > 0:
        raise UsageError(f"--heartbeat must be a positive number of seconds, got {args.heartbeat}")
    runs_dir = ensure_writable(Path(args.runs_dir))
    storage = args.storage or default_storage(runs_dir)
    console.note(f"sweep {sweep.name}: {len(sweep.problems)} problems on {mask(storage)}")
    if args.local and args.slurm:
        raise UsageError("--local and --slurm both start workers: choose one")
    code = EXIT_OK
    if args.slurm:
        from autotune.drivers.sweep import submit_to_slurm

        job, script = submit_to_slurm(sweep, sweep_file=Path(args.file), storage_url=storage, runs_dir=runs_dir,
                                      workers=args.slurm, heartbeat_s=args.heartbeat, sbatch_args=args.sbatch,
                                      wait=args.wait)
        console.note(f"submitted Slurm job array {job}: {args.slurm} workers ({script})")
        if not args.wait:
            return EXIT_OK
    elif args.local:
        code = _local_workers(args, args.local, console)
    # Opened after workers elsewhere (they create it together), before this process works on it.
    queue = SweepQueue(storage, sweep, heartbeat_s=args.heartbeat)
    if not (args.slurm or args.local):  # this process is the worker
        counts = run_worker(queue, storage_url=storage, runs_dir=runs_dir, log=console.note)
        console.note(f"this worker: {', '.join(f'{n} {state}' for state, n in sorted(counts.items())) or 'nothing left'}")
    results = sweep_results(queue.study)
    done = sum(r["state"] == "done" for r in results.values())
    console.note(f"sweep {sweep.name}: {len(results)} of {len(sweep.problems)} problems finished, {done} with a winner")
    return code


def _local_workers(args: argparse.Namespace, count: int, console) -> int:
    """`count` worker processes of this sweep on this machine; a signal to this one reaches them."""
    import subprocess

    argv = [sys.executable, "-m", "autotune", "sweep", args.file, "--runs-dir", args.runs_dir,
            "--heartbeat", str(args.heartbeat)]
    for flag, value in (("--storage", args.storage), ("--name", args.name)):
        if value:
            argv += [flag, value]
    workers = [subprocess.Popen(argv) for _ in range(count)]
    try:
        codes = [worker.wait() for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.terminate()
        for worker in workers:
            worker.wait()
    failed = [code for code in codes if code != EXIT_OK]
    if failed:
        console.error_line(f"{len(failed)} of {count} workers failed (exit codes {failed})")
        return max(failed)
    return EXIT_OK


def cmd_regress(args: argparse.Namespace, console) -> int:
    from autotune.drivers.regress import EXIT_REGRESSION, regress
    from autotune.search.store import default_storage

    runs_dir = Path(args.runs_dir)
    storage = args.storage or default_storage(runs_dir)
    findings, paths, baseline = regress(storage, args.sweep, baseline=args.baseline, out_dir=runs_dir / "regress",
                                        throughput_drop=args.throughput_drop, memory_rise=args.memory_rise)
    regressions = [f for f in findings if f.regression]
    for finding in findings:
        console.note(f"{'REGRESSION ' if finding.regression else ''}{finding.problem}: {finding.kind}: {finding.detail}")
    console.note(f"{args.sweep} against {baseline}: {len(regressions) or 'no'} regression(s); "
                 f"{paths['html']}, {paths['json']}")
    return EXIT_REGRESSION if regressions else EXIT_OK


def cmd_catalog(args: argparse.Namespace, console) -> int:
    """`autotune models`, `autotune gpus`: the catalog, a table in 80 columns or JSON."""
    from autotune.problem.catalog.listing import gpu_rows, model_rows

    rows = model_rows() if args.command == "models" else gpu_rows()
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    elif args.command == "models":
        console.models_table(rows)
    else:
        console.gpus_table(rows)
    return EXIT_OK


def cmd_agent(args: argparse.Namespace, console) -> int:
    """This node's part of a multi-node job: the controller's launches, nothing else."""
    from autotune.backends.real.multinode import run_agent

    return run_agent(Path(args.shared_dir), wait_s=args.wait, log=console.error_line)


def main(argv: list[str] | None = None) -> int:
    from autotune.results.console import Console

    argv = list(sys.argv[1:] if argv is None else argv)
    console = Console(quiet="--json" in argv, verbose="--verbose" in argv, progress_lines=True,
                      notes_to_stderr=bool(argv) and argv[0] in ("trial", "export"))
    # Ctrl-C and SIGTERM unwind through the same except clause, raised only where that is safe
    # (autotune/util/interrupts.py: never inside torch, an import or a storage call).
    try:
        with raised_where_safe({signal.SIGINT: KeyboardInterrupt, signal.SIGTERM: Terminated}, entry=main.__code__):
            return _main(argv, console)
    except KeyboardInterrupt as exc:  # held until the command had finished
        return _interrupted(console, exc)


def run() -> None:
    """The `autotune` program (console script and `python -m autotune`): main(), then a quick exit
    (autotune.util.quick_exit: the exit handlers run, the interpreter's teardown is skipped)."""
    from autotune.util.quick_exit import quick_exit

    quick_exit(main(), internal_error_code=EXIT_INTERNAL)


def _interrupted(console, exc: KeyboardInterrupt) -> int:
    how = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
    console.error_line(f"{how}: every finished trial is in the study; rerun the same command to resume")
    return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED


def _main(argv: list[str], console) -> int:
    try:
        args = parse_args(argv)
        handler = {"tune": cmd_tune, "plan": cmd_plan, "trial": cmd_trial, "export": cmd_export, "report": cmd_report,
                   "agent": cmd_agent, "sweep": cmd_sweep, "regress": cmd_regress,
                   "calibrate": cmd_calibrate, "models": cmd_catalog, "gpus": cmd_catalog}[args.command]
        return handler(args, console)
    except UsageError as exc:
        console.error_line(f"error: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        return _interrupted(console, exc)
    except StorageUnavailable as exc:
        console.error_line(f"error: {exc}")
        return EXIT_STORAGE
    except AutotuneError as exc:
        console.error_line(f"error: {exc}")
        return EXIT_INTERNAL
    except Exception as exc:  # noqa: BLE001 - one line for the user, the traceback on request
        if os.environ.get("AUTOTUNE_DEBUG"):
            raise
        console.error_line(f"internal error: {exc.__class__.__name__}: {exc} (set AUTOTUNE_DEBUG=1 for the traceback)")
        return EXIT_INTERNAL
