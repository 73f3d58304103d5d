"""`--attention`: the attention implementation of the user's stack (transformers' `attn_implementation`),
a fact of the problem like `--stack`, not a searched knob (issue 56). One place states what each is, what
the simulator traces for it, how the cost model prices it, and which problems may state it.

* `sdpa`: torch's scaled_dot_product_attention, transformers' default where the model has it. Traced as
  torch runs it; a GPU trace takes the kernel CUDA's SDPA would pick (backends/sim/_gpu_kernels.py).
* `eager`: transformers' own matmul-softmax-dropout-matmul. The same ops on a GPU as on the CPU, so a
  CPU trace and a CPU trial count what a GPU run keeps: the seq x seq scores, the softmax output (and
  the dropout mask) of every layer. Costed from what it runs: its two products at the matmul rate, the
  score tensors' traffic as memory-bound bytes (EAGER_SCORE_BYTES on the closed form's path).
* `flash_attention_2` / `flash_attention_3`: the flash-attn package's kernels (FA3: Hopper only). They
  keep the output and the log-sum-exp, apply dropout, sliding windows and logit soft-capping inside the
  kernel and build no mask. flash-attn has no CPU build, so they are traced and run on CPUs as
  FUSED_ATTENTION: transformers' SDPA attention, causal, without a mask, so torch takes its own flash
  kernel (FlashAttention-2's algorithm), which keeps the same two tensors. Sliding windows and
  soft-capping are not applied there (the tensors kept are the same; the windowed FLOPs are counted
  whole, an over-estimate of a windowed layer's time). Costed at FlashAttention-2's published speed
  (costmodel.ATTENTION_KERNEL_TFLOPS): FA3's own forward-plus-backward rate is not in that table, so
  an FA3 run is estimated as fast as FA2, a lower bound on its speed, and the result says so.
"""

from __future__ import annotations

from typing import Any

from autotune.util.errors import UsageError

ATTENTION_IMPLEMENTATIONS: tuple[str, ...] = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
FLASH = ("flash_attention_2", "flash_attention_3")

FUSED_ATTENTION = "autotune_fused"
"""The name FLASH implementations are registered under with transformers for the trace and CPU runs (not
'flash...': transformers reads such a name as a request for the flash-attn package or a hub kernel)."""

FLASH_MAX_HEAD_DIM = 256
"""flash-attn 2.x and 3.x take head dims up to 256 (its README, 'FlashAttention-2 ... all head dimensions
up to 256')."""
FLASH_MIN_SM = {"flash_attention_2": (8, 0), "flash_attention_3": (9, 0)}
FLASH_MAX_SM = {"flash_attention_2": (12, 1), "flash_attention_3": (9, 0)}
"""Compute capabilities each kernel builds for: FA2 Ampere, Ada and Hopper (its README: 'Ampere, Ada, or
Hopper GPUs'; Blackwell consumer parts since 2.7), FA3 Hopper only (its README: 'H100 / H800 GPU')."""


def check_attention(attention: str | None, *, model: Any, gpu: Any, precision: str, own_attention: bool,
                    packed: bool) -> None:
    """Refuse, in one line naming the user's flags, an attention implementation the problem cannot run:
    `model` a catalog.ModelSpec, `gpu` a catalog GPUSpec, `own_attention` whether the user's stack trains its
    own model with its own attention (config.OWN_ATTENTION_STACKS)."""
    if attention is None:
        return
    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise UsageError(f"--attention {attention!r} is not one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
    flag = f"--attention {attention}"
    if own_attention and attention != "sdpa":  # whether or not the stack's own model is traced here
        raise UsageError(f"{flag}: this stack's own model runs its own SDPA attention, not transformers' "
                         f"{attention}; leave --attention out or use --attention sdpa")
    if packed and attention == "eager":
        raise UsageError(f"{flag} with --token-budget: packed rows are attended one document at a time "
                         "(a varlen flash kernel), which eager attention does not do; use flash_attention_2 or sdpa")
    if attention == "sdpa" and model.default_attention == "eager":
        raise UsageError(f"{flag}: transformers has no SDPA attention for {model.model_type} (it needs eager or "
                         "a flash kernel, e.g. for logit soft-capping); use --attention eager or flash_attention_2")
    if attention in FLASH:
        if precision == "fp32":
            raise UsageError(f"{flag} with --precision fp32: flash kernels run fp16/bf16 only; "
                             "use --precision bf16 or --attention sdpa")
        if model.head_dim > FLASH_MAX_HEAD_DIM:
            raise UsageError(f"{flag}: head dim {model.head_dim} is over flash-attn's {FLASH_MAX_HEAD_DIM}; "
                             "use --attention sdpa")
        from autotune.problem.catalog.gpus import GPU_SM

        sm = GPU_SM.get(gpu.name)
        if sm is not None and not FLASH_MIN_SM[attention] <= sm <= FLASH_MAX_SM[attention]:
            need = "Hopper (SM 9.0)" if attention == "flash_attention_3" else "SM 8.0 or newer (Ampere)"
            raise UsageError(f"{flag}: {gpu.name} is SM {sm[0]}.{sm[1]}, and {attention} runs on {need} only; "
                             "use --attention sdpa")


def traced_name(attention: str) -> str:
    """The name a model built here is given as its attention implementation: FLASH as FUSED_ATTENTION."""
    if attention in FLASH:
        register_fused_attention()
        return FUSED_ATTENTION
    return attention


def fused_attention(module, query, key, value, attention_mask, **kwargs):
    """A flash kernel's attention as traced and run here: transformers' SDPA attention, causal, with no
    mask (so torch takes its flash kernel where it can), the kernel-side options left out (module doc)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for applied_in_kernel in ("is_causal", "softcap", "sliding_window"):
        kwargs.pop(applied_in_kernel, None)
    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """flash kernels build no mask (transformers' own flash mask function returns None without padding)."""
    return None


def register_fused_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(FUSED_ATTENTION, fused_attention)
    AttentionMaskInterface.register(FUSED_ATTENTION, _no_mask)


def kernel_note(attention: str, *, run: bool = False) -> str:
    """What a result says of how its attention was traced (or, `run`, run in a CPU trial) and costed, or ''
    for sdpa and eager."""
    if attention not in FLASH:
        return ""
    note = (f"{attention} {'run' if run else 'traced'} as torch SDPA's flash kernel (causal, no mask): the output "
            "and log-sum-exp kept, as flash-attn keeps them; sliding windows and soft-capping, applied inside flash-attn's kernel, "
            f"not applied {'here' if run else 'in the trace'}")
    if attention == "flash_attention_3":
        note += "; estimated at FlashAttention-2's published speed (FA3's is not in the cost model: a lower bound)"
    return note
