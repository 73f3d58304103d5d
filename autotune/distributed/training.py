"""Build a model and run training steps: the code every trial runs, real or traced.

The simulator calls these under FakeTensorMode with a fake process group; the real trial
worker calls them on real devices. Keeping one copy is what makes the prediction exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autotune.problem.catalog.models import ModelSpec
from autotune.problem.config import MASTER_DTYPE_NAMES, PARAM_DTYPE_NAMES, QLORA_QUANTIZATION, TRL_STEPS, FineTuning
from autotune.util.errors import UsageError
from autotune.problem.packing import STEP as PACKED_STEP


def build_model(model: ModelSpec, *, num_layers: int | None = None, seed: int = 0, precision: str = "bf16",
                finetuning: FineTuning | None = None, step: str = "autotune", seq_len: int | None = None) -> nn.Module:
    """The transformers causal LM from its config, on the current default device (use
    `torch.device('meta')` to build without memory), with its parameters in the dtypes `precision`
    trains them in (fp32 master weights, FSDP casting for compute; bf16 throughout for
    bf16-pure) and, for a LoRA fine-tune, wrapped by peft (`apply_finetuning`). TRL's steps
    (config.TRL_STEPS) add TRL's fused LM head, after peft, as SFTTrainer does; 'torchtitan' builds
    torchtitan's own model instead (titan.build_titan_model; its RoPE cache sized to `seq_len`)."""
    if step == "torchtitan":
        from autotune.distributed.titan import build_titan_model

        torch.manual_seed(seed)
        return build_titan_model(model, num_layers=num_layers, precision=precision, seq_len=seq_len)
    if step == "litgpt":
        from autotune.distributed.litgpt_step import build_litgpt_model

        if finetuning is not None and finetuning.lora:
            raise UsageError("--stack litgpt: LoRA (finetune_lora) is not built on LitGPT's model here")
        torch.manual_seed(seed)
        return build_litgpt_model(model, num_layers=num_layers, precision=precision, seq_len=seq_len)
    from autotune.problem.catalog.models import causal_lm_from_config

    torch.manual_seed(seed)
    net = causal_lm_from_config(
        model.hf_config(num_layers=num_layers),
        dtype=getattr(torch, MASTER_DTYPE_NAMES[precision]),
        trust_remote_code=model.trust_remote_code,
    )
    if finetuning is not None and finetuning.qlora:
        quantize_base(net, precision=precision)
    if finetuning is not None and finetuning.lora:
        net = apply_finetuning(net, finetuning, precision=precision)
    if step in TRL_STEPS:
        add_trl_fused_lm_head(net)
    if step == PACKED_STEP:
        use_varlen_attention(net)
    return net


def apply_finetuning(net: nn.Module, finetuning: FineTuning, *, precision: str) -> nn.Module:
    """LoRA with the real peft library, before FSDP2 wraps the model (as TRL, Accelerate and the
    FSDP-QLoRA recipes order it). The frozen base weights are stored in the compute dtype (what
    `torch_dtype=bfloat16` loading gives TRL and peft users: no fp32 copy of weights that never
    change); the adapters keep the master dtype, so they train in fp32 under mixed precision. FSDP2
    shards both; only the adapters get gradients and AdamW state."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=finetuning.rank, lora_alpha=finetuning.alpha, lora_dropout=finetuning.dropout,
                        target_modules=finetuning.target_modules, task_type="CAUSAL_LM")
    net = get_peft_model(net, config)
    compute = getattr(torch, PARAM_DTYPE_NAMES[precision])
    for param in net.parameters():
        if not param.requires_grad:
            param.data = param.data.to(compute)
    return net


def fused_expert_targets(model: ModelSpec, finetuning: FineTuning) -> list[str]:
    """The parameters that `finetuning`'s targets reach in `model` as parameters, not linear layers
    (an MoE's fused experts and router: gate_up_proj, down_proj, gate.weight), as peft resolves
    them on a meta build of one layer period: peft adapts them directly (its ParamWrapper), which
    takes no dropout. Empty for a dense model."""
    import dataclasses

    with torch.device("meta"):
        net = build_model(model, num_layers=model.layer_period, finetuning=dataclasses.replace(finetuning, dropout=0.0))
    return sorted(net.peft_config["default"].target_parameters or ())


QUANT_STATE_BUFFERS = ("absmax", "code", "offset", "nested_absmax", "nested_code")
"""A 4-bit linear's quantization statistics, registered as its (unsharded) buffers: each rank holds
every layer's, as under FSDP-QLoRA, and memory trackers count them."""


def quantize_base(net: nn.Module, *, precision: str) -> None:
    """QLoRA: every linear layer but the output head becomes a bitsandbytes `Linear4bit` whose
    weight is bnb's own 4-bit quantization of it (QLORA_QUANTIZATION, codes stored in the compute
    dtype), in place, before peft adds the adapters (what transformers' `load_in_4bit` does at
    load). Quantized on the current device by bnb's ops: on meta and under fake tensors their
    shape functions give the layout, so traces and real trials hold the same tensors."""
    import bitsandbytes as bnb

    storage = getattr(torch, PARAM_DTYPE_NAMES[precision])
    if "dynamic" not in bnb.functional.name2qmap:  # bnb's cached double-quantization table, built on the host
        with torch.device("cpu"):
            bnb.functional.name2qmap["dynamic"] = bnb.functional.create_dynamic_map()
    head = net.get_output_embeddings()
    for parent in list(net.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child is head:
                continue
            quantized = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=storage, quant_storage=storage,
                                          quant_type=QLORA_QUANTIZATION["quant_type"],
                                          compress_statistics=QLORA_QUANTIZATION["compress_statistics"],
                                          device="meta")
            packed, state = bnb.functional.quantize_4bit(child.weight.data.to(storage), quant_storage=storage,
                                                         **QLORA_QUANTIZATION)
            quantized.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, quant_storage=storage,
                                                 bnb_quantized=True, module=quantized, **QLORA_QUANTIZATION)
            quantized.quant_state = state
            if child.bias is not None:
                quantized.bias = nn.Parameter(child.bias.data.to(storage), requires_grad=False)
            _register_quant_state(quantized)
            setattr(parent, name, quantized)


def _register_quant_state(module: nn.Module) -> None:
    """The quantization statistics as non-persistent buffers (QUANT_STATE_BUFFERS), read back into
    the module's QuantState before each forward (`to_empty` and `.to` replace buffers)."""
    state = module.weight.quant_state
    # The nested code is bnb's one cached table; on a GPU each layer gets its own copy (`.to(device)`).
    state.state2.code = state.state2.code.clone()
    for name, tensor in zip(QUANT_STATE_BUFFERS, _quant_state_tensors(state)):
        module.register_buffer(f"quant_{name}", tensor, persistent=False)
    module.register_forward_pre_hook(_rebind_quant_state)


def _quant_state_tensors(state) -> tuple[torch.Tensor, ...]:
    """A QuantState's tensors in QUANT_STATE_BUFFERS' order."""
    return state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code


def quant_state_bytes(net: nn.Module) -> int:
    """The quantization statistics' storage (QLoRA; 0 without 4-bit layers)."""
    names = {f"quant_{name}" for name in QUANT_STATE_BUFFERS}
    return sum(b.nbytes for name, b in net.named_buffers() if name.rsplit(".", 1)[-1] in names)


def _rebind_quant_state(module: nn.Module, _args) -> None:
    state = module.quant_state
    state.absmax, state.code, state.offset = module.quant_absmax, module.quant_code, module.quant_offset
    state.state2.absmax, state.state2.code = module.quant_nested_absmax, module.quant_nested_code


def requantize_base(net: nn.Module, *, seed: int) -> None:
    """A real trial's 4-bit layers after `to_empty`: each weight quantized by bnb from a freshly
    initialised one (normal, std 0.02, as HF initialises linears), the local shard of the packed
    codes copied into FSDP2's shard and the statistics into the buffers. Every rank draws the same
    weights."""
    import bitsandbytes as bnb
    from torch.distributed.tensor import DTensor, distribute_tensor

    generator = torch.Generator(device="cpu").manual_seed(seed)
    for module in net.modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        local = module.weight.to_local() if isinstance(module.weight, DTensor) else module.weight.data
        full = torch.empty(module.out_features, module.in_features).normal_(0, 0.02, generator=generator)
        packed, state = bnb.functional.quantize_4bit(full.to(local.device, module.compute_dtype),
                                                     quant_storage=local.dtype, **QLORA_QUANTIZATION)
        if isinstance(module.weight, DTensor):
            packed = distribute_tensor(packed, module.weight.device_mesh, module.weight.placements,
                                       src_data_rank=None).to_local()
        with torch.no_grad():
            local.copy_(packed)
            for name, tensor in zip(QUANT_STATE_BUFFERS, _quant_state_tensors(state)):
                getattr(module, f"quant_{name}").copy_(tensor)


@dataclass(frozen=True)
class BlockCounts:
    """One decoder block's parameters as it trains."""

    trainable: int
    total: int
    frozen_bytes: int = 0
    """Storage of its frozen parameters as FSDP2 shards and gathers them (QLoRA: the packed 4-bit codes)."""
    quant_state_bytes: int = 0
    """QLoRA: its quantization statistics (buffers, on every rank unsharded)."""
    adapted_inputs: tuple[tuple[str, int], ...] = ()
    """LoRA: (name, input width) of each linear layer peft wrapped with an adapter (not the fused
    experts' parameters), in module order: what the adapters save for backward."""


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters of the model as it trains: each block of one layer period (blocks repeat with it)
    and outside the blocks (the root). `block_*` are the largest block's: what one block gathers
    and reduces at once."""

    blocks: tuple[BlockCounts, ...]
    root_trainable: int
    root_total: int
    num_layers: int
    root_frozen_bytes: int = 0

    def _largest(self, field: str) -> int:
        return max(getattr(block, field) for block in self.blocks)

    def _all_blocks(self, field: str) -> int:
        return sum(getattr(self.blocks[i % len(self.blocks)], field) for i in range(self.num_layers))

    @property
    def block_trainable(self) -> int:
        return self._largest("trainable")

    @property
    def block_total(self) -> int:
        return self._largest("total")

    @property
    def block_frozen_bytes(self) -> int:
        return self._largest("frozen_bytes")

    @property
    def adapted_inputs(self) -> tuple[tuple[str, int], ...]:
        """The adapted linears of the block whose adapters read the widest inputs (LoRA)."""
        return max((block.adapted_inputs for block in self.blocks), key=lambda inputs: sum(w for _, w in inputs))

    @property
    def blocks_frozen_bytes(self) -> int:
        """Every block's frozen storage, at full depth."""
        return self._all_blocks("frozen_bytes")

    @property
    def blocks_quant_state_bytes(self) -> int:
        """Every block's quantization statistics, at full depth (QLoRA)."""
        return self._all_blocks("quant_state_bytes")

    @property
    def trainable(self) -> int:
        return self.root_trainable + self._all_blocks("trainable")

    @property
    def total(self) -> int:
        return self.root_total + self._all_blocks("total")


def parameter_counts(model: ModelSpec, finetuning: FineTuning) -> ParameterCounts:
    """Counted block by block on a meta build of one layer period (the shortest copy with every
    kind of layer), so a 70B model costs no more than a small one."""
    from autotune.problem.catalog.blocks import find_decoder_blocks

    key = (model.model_type, repr(sorted(model.config_dict.items())), finetuning.key())
    if key not in _PARAMETER_COUNTS:
        with torch.device("meta"):
            net = build_model(model, num_layers=model.layer_period, finetuning=finetuning)
        blocks = tuple(_counts_of(block, lora=finetuning.lora) for block in find_decoder_blocks(net).layers)
        whole = _counts_of(net, lora=False)  # the blocks' and the root's
        _PARAMETER_COUNTS[key] = ParameterCounts(
            blocks=blocks, root_trainable=whole.trainable - sum(b.trainable for b in blocks),
            root_total=whole.total - sum(b.total for b in blocks), num_layers=model.num_layers,
            root_frozen_bytes=whole.frozen_bytes - sum(b.frozen_bytes for b in blocks))
    return _PARAMETER_COUNTS[key]


def _counts_of(module: nn.Module, *, lora: bool) -> BlockCounts:
    """`module`'s parameters as it trains, and with `lora` the linears peft adapted in it."""
    adapted = ()
    if lora:
        from peft.tuners.lora import LoraLayer, ParamWrapper

        adapted = tuple((name.rsplit(".", 1)[-1], layer.in_features) for name, layer in module.named_modules()
                        if isinstance(layer, LoraLayer) and not isinstance(layer, ParamWrapper))
    return BlockCounts(trainable=sum(p.numel() for p in trainable_parameters(module)),
                       total=sum(map(logical_numel, module.parameters())),
                       frozen_bytes=sum(p.nbytes for p in module.parameters() if not p.requires_grad),
                       quant_state_bytes=quant_state_bytes(module), adapted_inputs=adapted)


_PARAMETER_COUNTS: dict[tuple, ParameterCounts] = {}


def logical_numel(param: torch.Tensor) -> int:
    """A parameter's count of weights: a 4-bit one's (QLoRA) is its quantized shape's, not its
    packed storage's."""
    state = getattr(param, "quant_state", None)
    return int(torch.Size(state.shape).numel()) if state is not None else param.numel()


def trainable_parameters(net: nn.Module) -> list[nn.Parameter]:
    """What the optimizer steps: every parameter that takes a gradient (the adapters under LoRA)."""
    return [p for p in net.parameters() if p.requires_grad]


def make_optimizer(model: nn.Module, *, impl: str = "fused", lr: float = 1e-4) -> torch.optim.Optimizer:
    """AdamW as `impl` ('fused', 'foreach' or 'for-loop'), spelled out: torch's own default
    (foreach on CUDA, the loop elsewhere) would make the traced step differ from the run.
    docs/SIMULATOR.md has what each costs in memory."""
    params = trainable_parameters(model)  # frozen weights (LoRA's base) get no AdamW state
    if impl not in ("fused", "foreach", "for-loop"):
        raise ValueError(f"unknown AdamW implementation {impl!r}")
    optimizer = torch.optim.AdamW(params, lr=lr, **({"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}))
    if any(getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False) for m in model.modules()):
        # float8 tensorwise with FSDP2's float8 all-gather: the next step's weight scales in one
        # all-reduce after each optimizer step, as torchtitan does (torchao).
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
    return optimizer


def token_batches(*, vocab_size: int, micro_batch_size: int, seq_len: int, device: torch.device | str,
                  seed: int = 0, documents: tuple[int, ...] = ()) -> Iterator[torch.Tensor | dict]:
    """Seeded random token batches of shape (micro_batch, seq_len), forever; with `documents` (a packed
    step's document lengths, summing to micro_batch x seq_len), each as one packed row (packed_batch)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_len), generator=generator).to(device)
        yield packed_batch(tokens, documents) if documents else tokens


def packed_batch(tokens: torch.Tensor, documents: tuple[int, ...]) -> dict[str, Any]:
    """`tokens` flattened into one padding-free row of documents of the given lengths (autotune/problem/packing.py):
    position_ids restarting at 0 for each document, the label of each document's first token -100 (it is
    not predicted from the previous document), and the lengths themselves for varlen_attention. Shapes
    and indices are known in advance, so fake tensors trace it."""
    row = tokens.reshape(1, -1)
    if sum(documents) != row.shape[1]:
        raise ValueError(f"documents of {sum(documents)} tokens for a row of {row.shape[1]}")
    starts = [0]
    for length in documents[:-1]:
        starts.append(starts[-1] + length)
    positions = torch.cat([torch.arange(length, device=row.device) for length in documents]).unsqueeze(0)
    labels = row.clone()
    labels[0, starts] = -100
    return {"input_ids": row, "labels": labels, "position_ids": positions, "document_lengths": tuple(documents)}


def varlen_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, *, document_lengths: tuple[int, ...] = (), **kwargs):
    """Attention within each document of a packed row, causal: transformers' SDPA attention run on each
    document's slice (what a varlen flash kernel computes in one launch: no block-diagonal mask, each
    document's scores alone). Without `document_lengths`, the whole row as one sequence."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("is_causal", None)
    if not document_lengths:
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)
    outputs = [sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)[0]
               for q, k, v in zip(query.split(document_lengths, dim=2), key.split(document_lengths, dim=2),
                                  value.split(document_lengths, dim=2))]
    return torch.cat(outputs, dim=1), None


def use_varlen_attention(net: nn.Module) -> None:
    """Run `net`'s attention as varlen_attention (registered with transformers under packing.ATTENTION, a
    name transformers builds no mask for)."""
    from transformers import AttentionInterface

    from autotune.problem.packing import ATTENTION

    AttentionInterface.register(ATTENTION, varlen_attention)
    net.set_attn_implementation(ATTENTION)  # as parallel.context.use_causal_sdpa switches a model's attention


MIN_OFFLOAD_BYTES = 1024
"""Saved tensors smaller than this stay on the device (torchtune's OffloadActivations' default):
the copy costs more than the bytes it frees."""


class OffloadedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Activation offload: what forward saves for backward goes to pinned host memory and comes
    back when backward unpacks it, as torch's `save_on_cpu` does, with torchtune's rule of what
    stays: parameters (FSDP2's gathered weights, which backward has again anyway) and tensors under
    MIN_OFFLOAD_BYTES. With checkpointing, the checkpointed blocks' inputs are what is saved, so
    they are what moves. Enter it around forward only.

    `to_host=False` keeps no copy and records only what would move: the simulator's fake tensors
    then see the device side exactly (the tensor freed at pack, a new one at unpack). `host_bytes`
    is the most held on the host at once, with the pinned allocator's rounding of each copy to a
    power of two; the tensors moved accumulate in `moved_bytes` (each way)."""

    def __init__(self, *, to_host: bool = True) -> None:
        self.host_bytes = self.moved_bytes = self._held = 0

        def pack(tensor: torch.Tensor):
            nbytes = tensor.numel() * tensor.element_size()
            if isinstance(tensor, nn.Parameter) or nbytes < MIN_OFFLOAD_BYTES:
                return tensor
            held = 1 << max(0, nbytes - 1).bit_length()  # the pinned host allocator's block
            self._held += held
            self.host_bytes = max(self.host_bytes, self._held)
            self.moved_bytes += nbytes
            copy = None
            if to_host:
                copy = torch.empty(tensor.size(), dtype=tensor.dtype, device="cpu",
                                   pin_memory=torch.cuda.is_available())
                copy.copy_(tensor, non_blocking=True)
            return (tensor.device, tensor.size(), tensor.stride(), tensor.dtype, copy, held)

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, size, stride, dtype, copy, held = packed
            self._held -= held
            if copy is None:
                return torch.empty_strided(size, stride, dtype=dtype, device=device)
            return copy.to(device, non_blocking=True)

        super().__init__(pack, unpack)


TRL_SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")
"""What SFTTrainer asks of its fused LM head (trl 1.16, SFTTrainer.__init__: the loss, and the entropy
and mean-token-accuracy metrics)."""


def add_trl_fused_lm_head(net: nn.Module) -> None:
    """TRL's own fused LM head (trl 1.16, trainer/utils.py `add_fused_lm_head`), added as SFTTrainer
    adds it: to the base model under peft. `model(..., labels=..., fused_lm_head=True)` then returns
    per-token log-probabilities computed in chunks, never the (batch, seq, vocab) logits."""
    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError as exc:  # the stack's own code is what is traced: no copy of ours
        from autotune.util.errors import UsageError

        raise UsageError(f"--stack trl traces TRL's own fused LM head: install trl>=1.16 ({exc})") from None
    add_fused_lm_head(net.get_base_model() if hasattr(net, "get_base_model") else net, outputs=TRL_SFT_OUTPUTS)


def prepare_step(model: nn.Module, *, step: str, precision: str, device_type: str) -> None:
    """What a stack does to the wrapped model before training, after FSDP2 wraps it: for the steps
    that run through Accelerate ('hf', 'trl') under bf16/fp16 mixed precision, Accelerate's
    `prepare_model` (accelerate 1.15, Accelerator.prepare_model, `if self.native_amp`): the forward
    wrapped in `torch.autocast(device_type, dtype)`, then in `convert_outputs_to_fp32` (Accelerate's own
    function: every bf16/fp16 output, the logits included, copied to fp32). The instance's `forward` is
    replaced, so FSDP2's hooks (in `__call__`) run outside both, as under Accelerate: the root's
    post-forward casts the outputs to the plugin's output_dtype after the fp32 copy is made
    (parallel.mixed_precision_policy). 'torchtitan': its trainer's chunked loss set up
    (titan.prepare_titan_step). Other steps are left as built."""
    if step == "torchtitan":
        from autotune.distributed.titan import prepare_titan_step

        prepare_titan_step(model)
        return
    if step == "litgpt":
        from autotune.distributed.litgpt_step import prepare_litgpt_step

        prepare_litgpt_step(model, precision=precision, device_type=device_type)
        return
    if step not in ("hf", *TRL_STEPS) or precision not in ("bf16", "fp16"):
        return
    from types import MethodType

    try:
        from accelerate.utils import convert_outputs_to_fp32
    except ImportError as exc:
        from autotune.util.errors import UsageError

        raise UsageError(f"this stack's step is Accelerate's: install accelerate>=1.10 ({exc})") from None
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    model._original_forward = model.forward
    autocast_forward = torch.autocast(device_type=device_type, dtype=dtype)(model.forward.__func__)
    model.forward = MethodType(autocast_forward, model)
    model.forward = MethodType(convert_outputs_to_fp32(model.forward.__func__), model)


def padding_free_batch(tokens: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """A micro-batch of `tokens` as TRL 1.16's padding-free collator gives it to the model
    (trl/trainer/sft_trainer.py, DataCollatorForLanguageModeling with padding_free=True, which
    SFTTrainer uses whenever packing is 'bfd'), each row packed with two documents (bfd packs several
    short ones into a row of max_length; the memory is the same for any number above one, and one alone
    builds no mask: docs/STACKS.md): the rows concatenated into one row, position_ids restarting at 0
    for each document (int64), the label of each document's first token -100, the documents'
    cumulative lengths (int32) and longest length for varlen kernels, and each token's document index
    (int32). No attention mask: transformers derives the block-diagonal one from position_ids
    (tests/test_stacks.py compares this with the collator's own output). Tensor operations with
    shapes known in advance only, so that fake tensors trace it."""
    rows, seq = tokens.shape
    first = seq - seq // 2  # the two documents' lengths: first and seq - first
    labels = tokens.clone()
    labels[:, 0] = labels[:, first] = -100
    index = torch.arange(rows * seq, device=tokens.device)
    in_row = index % seq
    second = in_row >= first
    starts = (torch.arange(rows, dtype=torch.int32, device=tokens.device) * seq).unsqueeze(1)
    cu_seq_lens = torch.cat([torch.cat([starts, starts + first], dim=1).flatten(),
                             torch.tensor([rows * seq], dtype=torch.int32, device=tokens.device)])
    return {"input_ids": tokens.reshape(1, rows * seq), "labels": labels.reshape(1, rows * seq),
            "position_ids": torch.where(second, in_row - first, in_row).unsqueeze(0),
            "cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": first, "max_length_k": first,
            "seq_idx": (2 * (index // seq) + second).to(torch.int32).unsqueeze(0)}


def micro_batch_loss(model: nn.Module, tokens: torch.Tensor | dict, *, step: str = "autotune") -> torch.Tensor:
    """One micro-batch's forward and loss, as the stack's loop computes it (config.stack_step):
    'autotune' and 'hf' (Trainer.compute_loss: the model's own loss, its outputs dropped before
    backward) take `model(input_ids, labels).loss`; TRL's steps are SFTTrainer.compute_loss (trl 1.16)
    with the fused LM head: minus the sum of the per-token log-probabilities over the label tokens,
    of the rows as they are ('trl') or flattened into one padding-free row ('trl-padding-free');
    'torchtitan' is torchtitan's trainer's forward and chunked loss (titan.titan_loss: the head's
    backward runs chunk by chunk inside it, the decoder's when the returned loss is backpropagated)."""
    if step == "torchtitan":
        from autotune.distributed.titan import titan_loss

        return titan_loss(model, tokens)
    if step == "litgpt":
        from autotune.distributed.litgpt_step import litgpt_loss

        return litgpt_loss(model, tokens)
    if isinstance(tokens, dict):  # the model's own arguments: a packed row (packing.STEP), CP's slices (_micro_batch)
        return model(**tokens).loss
    if step in TRL_STEPS:
        batch = padding_free_batch(tokens) if step == "trl-padding-free" else {"input_ids": tokens, "labels": tokens}
        outputs = model(**batch, fused_lm_head=True, use_cache=False)
        return -outputs.log_probs.sum() / outputs.label_mask.sum().clamp(min=1)
    return model(input_ids=tokens, labels=tokens).loss


@contextlib.contextmanager
def _micro_batch(model: nn.Module, tokens: torch.Tensor | dict):
    """`tokens` as micro_batch_loss takes them: under context parallelism (parallel.apply_cp gave the model
    its `sequence_shards`) the model's arguments for this rank's sequence slices, within CP's context;
    else as they are. Under loss parallelism (parallel.apply_tp set the model's `loss_parallel`) within torch's
    loss_parallel, which forward's cross-entropy on the vocabulary shards and its backward both need."""
    shards = getattr(model, "sequence_shards", None)
    with contextlib.ExitStack() as stack:
        if getattr(model, "loss_parallel", False):
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())
        yield tokens if shards is None else stack.enter_context(shards(tokens))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator[torch.Tensor], *,
               grad_accum_steps: int, scaler=None, defer_grad_sync: bool = False,
               phase_times: list[tuple[float, float]] | None = None, clock=None,
               saved_activations: OffloadedActivations | None = None, step: str = "autotune") -> torch.Tensor:
    """One optimizer step over `grad_accum_steps` micro-batches; returns the mean loss (detached).

    Gradients are reduce-scattered after every micro-batch by default: deferring the sync to
    the last micro-batch (`defer_grad_sync`) saves communication but keeps unsharded gradients
    of every block until then, which defeats full sharding's memory savings. `saved_activations`
    (activation offload) is entered around each forward. `step`: whose forward and loss
    (micro_batch_loss; the model prepared by prepare_step). Under context parallelism each
    micro-batch's forward and backward run within its CP context (_micro_batch). Under pipeline
    parallelism (`model.pipeline`, parallel/pipeline.py) the micro-batches are the schedule's: one call runs
    them all through this rank's stages (the loss returned is the mean over them on the last stage's ranks).
    With `phase_times` and `clock` (a synchronising timer), appends (seconds of the micro-batches,
    seconds of the optimizer step, seconds of the first micro-batch): a short trial runs fewer
    micro-batches than the real job and scales the later ones only. The first differs: under CPU
    offload FSDP2 copies its gradients back without blocking, every later one blocks and adds on
    the host (docs/COSTMODEL.md, "CPU offload while gradients accumulate").
    """
    timing = phase_times is not None and clock is not None
    started = clock() if timing else 0.0
    first_done = started
    total = None
    pipeline = getattr(model, "pipeline", None)
    if pipeline is not None:
        # Pipeline parallelism (parallel/pipeline.py gave the model its `pipeline`): the micro-batches are the
        # schedule's, forward and backward of all of them interleaved across the stages in one call.
        total = pipeline([next(batches) for _ in range(grad_accum_steps)])
        first_done = clock() if timing else 0.0
    for micro_step in range(0 if pipeline is not None else grad_accum_steps):
        is_last = micro_step == grad_accum_steps - 1
        if defer_grad_sync and hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(is_last)
        with _micro_batch(model, next(batches)) as tokens:  # CP: open over forward and backward
            with saved_activations if saved_activations is not None else contextlib.nullcontext():
                loss = micro_batch_loss(model, tokens, step=step) / grad_accum_steps
            (scaler.scale(loss) if scaler is not None else loss).backward()
        value = loss.detach()
        if hasattr(value, "full_tensor"):  # loss parallelism: a replicated DTensor
            value = value.full_tensor()
        total = value if total is None else total + value
        if timing and micro_step == 0 and grad_accum_steps > 1:
            first_done = clock()
    backward_done = clock() if timing else 0.0
    if grad_accum_steps == 1 or pipeline is not None:
        first_done = backward_done
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if timing:
        phase_times.append((backward_done - started, clock() - backward_done, first_done - started))
    return total


def gathered_for_vllm(model: nn.Module, *, device: torch.device | str,
                      before_gather: Callable[[str], None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's full parameters one at a time, as TRL gathers an FSDP2 model for vLLM
    (trl 1.16, trl/generation/vllm_generation.py, `VLLMGeneration._iter_fsdp2_params`):
    `named_parameters()` in order, a host-offloaded shard copied to the device first, then
    `full_tensor()` (an all-gather of the fp32 shard). `before_gather(name)` lets the simulator
    name its sites."""
    for name, param in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")  # the name vLLM expects, as TRL fixes it
        if before_gather is not None:
            before_gather(name)
        if param.device != torch.device(device):
            param = param.to(device)
        param = param.full_tensor()  # rebound as TRL does: the shard's device copy is freed here
        yield name, param


def sync_weights_to_vllm(model: nn.Module, *, device: torch.device | str,
                         load_weights: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None,
                         before_gather: Callable[[str], None] | None = None) -> int:
    """TRL's weight sync in colocate mode (`VLLMGeneration.sync_weights`, run by GRPOTrainer before
    generating whenever the optimizer step changed): each gathered parameter goes to vLLM's
    `load_weights`, which copies it into vLLM's own weights (in vLLM's memory share). As in TRL's
    loop, the loop variable holds the previous full parameter while the next is gathered, so two
    are alive at once. Returns how many parameters were gathered."""
    count = 0
    for name, full in gathered_for_vllm(model, device=device, before_gather=before_gather):
        if load_weights is not None:
            load_weights([(name, full)])
        count += 1
    return count
