"""The export formats' one-line descriptions, apart from the exporters (which import torch), so
that the CLI can list them in `autotune export --help` without loading them."""

DESCRIPTIONS: dict[str, str] = {
    "fsdp2": "train_fsdp2.py: torchrun script training a Hugging Face checkpoint with autotune's FSDP2 code",
    "fsdp1": "fsdp1_kwargs.py: FullyShardedDataParallel (FSDP1) keyword arguments and wrap(model)",
    "lightning": "lightning_fsdp2.py: Lightning script (ModelParallelStrategy, autotune's parallelize)",
    "lightning-fsdp1": "lightning_fsdp1.py: Lightning FSDPStrategy (FSDP1); written only when named",
    "accelerate": "accelerate_fsdp2.yaml: accelerate launch config (FSDP2)",
    "hf-trainer": "hf_trainer_args.yaml: transformers TrainingArguments (fsdp_config)",
    "trl": "trl_sft.yaml (trl_grpo.yaml for a GRPO result): TRL SFTConfig / GRPOConfig",
    "torchtitan": "torchtitan.sh: torchtitan train command (only for a model torchtitan has)",
    "llama-cookbook": "llama_cookbook.sh: llama-cookbook finetuning command (FSDP1)",
    "litgpt": "litgpt.yaml: LitGPT finetune_full / pretrain config",
}
"""One line per format of autotune.results.export.FORMATS: the file it writes and what it is."""
