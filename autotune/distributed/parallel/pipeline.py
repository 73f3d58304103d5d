"""Pipeline parallelism (--pp): the decoder blocks split into contiguous stages, each rank of a pp group
holding one stage (two under Interleaved1F1B), torch.distributed.pipelining's schedule running the
micro-batches through them, FSDP2 sharding each stage over the rank's data mesh. After torchtitan's
distributed/pipeline_parallel.py (`pipeline_llm`): the model is split into model parts, each part is
parallelized like a whole model (activation checkpointing, then fully_shard bottom-up, the part its
root), a PipelineStage wraps each part, and one schedule runs this rank's stages.

What differs from torchtitan: its model parts are deep copies of the whole model with the other layers
deleted; here a stage is a `PipelineStageModule` that holds the HF causal LM's own submodules (the
embeddings on the first stage, a slice of `model.layers`, `rotary_emb` on every stage, the final norm
and the head on the last) and calls them as the base model's forward does (causal attention without a
mask: SDPA's is_causal, as context parallelism's step runs it). The loss is the model's own
(`loss_function`, the shifted cross-entropy `model(input_ids, labels=...).loss` computes), on the last
stage's logits. Stage metadata (shapes, dtypes) is given to every PipelineStage up front (torch's
STATIC inference mode): no shape-inference forward and no metadata sent between ranks, and the
simulator, whose fake process group moves no data, reaches the same mode and allocates the same
buffers (autotune/backends/sim/_pipeline.py).

FSDP inside a stage (torch's PipelineStage.backward_maybe_with_nosync / perform_reduce_grad, which
torchtitan relies on too): for every micro-batch but the last, the stage's FSDP root is told
`set_requires_gradient_sync(False)` and `set_reshard_after_backward(False)` (gradients accumulate
unsharded, parameters stay gathered through backward), then after the last backward the gradients are
reduce-scattered once and the parameters resharded; the gradients are divided by the number of
micro-batches (`scale_grads`), as the unpipelined step divides each micro-batch's loss. Resharding
after forward follows the configuration's knob (torchtitan's default under PP is False: every
micro-batch's forward would all-gather again).

The pipeline's micro-batches are the configuration's gradient-accumulation steps: one optimizer step
is one schedule step over grad_accum_steps micro-batches of micro_batch_size sequences.

With tensor parallelism (PP x TP, torchtitan's FSDP x TP x PP: the mesh (pp, dp_shard, tp), parallel/dims.py),
each stage is split over its tp mesh after the pipeline split and before checkpointing and FSDP
(tensor.apply_tp_stage: apply_tp's layout on the stage's blocks, the first stage's embeddings, the last stage's
final norm and head). Between stages the hidden states are each tp rank's sequence shard as a plain tensor
(rows x seq / tp x hidden, torchtitan's stages pass the same): PipelineStageModule hands on `to_local()` of its
output and re-marks its input as the sequence shard (DTensor Shard(1)), and the stages' metadata declares those
per-rank shapes (Pipeline._metas), so the point-to-point sends carry 1/tp of the activations.

With context parallelism (PP x CP, torchtitan's FSDP x CP x PP: the mesh (pp, dp_shard, cp[, tp]), FSDP over the
flattened dp_shard x cp ranks), CP's context is opened around the schedule's whole step, as torchtitan opens its
train context around its pipeline schedule's step: torch's load balancer slices the step's tokens, shifted labels
and positions in place (context.context_parallel_step, which the unpipelined CP step uses too), every stage reads
its rank's positions, the last stage's loss is its slice's share (stage_loss), and the hidden states between
stages are each rank's slice (seq / (cp x tp) tokens).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import torch
from torch import nn

from autotune.problem.catalog.blocks import Blocks
from autotune.problem.config import TrainConfig
from autotune.problem.knobs import COMPILE_BACKEND, PIPELINE_VIRTUAL_STAGES, split_stages, why_no_pipeline_parallel
from autotune.distributed.parallel.checkpointing import apply_ac
from autotune.distributed.parallel.compile import apply_compile
from autotune.distributed.parallel.context import use_causal_sdpa
from autotune.distributed.parallel.dims import context_mesh, pipeline_mesh, tensor_mesh
from autotune.distributed.parallel.float8 import apply_float8
from autotune.distributed.parallel.fsdp import PARAM_DTYPES, apply_fsdp
from autotune.distributed.parallel.tensor import apply_tp_stage

_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")
def why_no_pipeline_stages(config: dict, *, seq_len: int = 0) -> str:
    """'' where a model of this config (a dict: a transformers config's to_dict(), with its model_type) splits
    into PipelineStageModules, else why not (one clause): knobs.why_no_pipeline_parallel's model clauses,
    which the configuration's checks give before anything is built."""
    return why_no_pipeline_parallel(num_layers=1, degree=1, schedule="1F1B", config=config, seq_len=seq_len)




def stages_of_rank(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stage indices pipeline rank `pp_rank` holds: one per rank, or, under a multi-stage schedule,
    PIPELINE_VIRTUAL_STAGES of them round-robin (rank r: r, r + pp, ...), as torchtitan's `stage_ids_this_rank`
    assigns them for its 'loop' style schedules (Interleaved1F1B)."""
    return [pp_rank + v * pp for v in range(PIPELINE_VIRTUAL_STAGES[schedule])]


def _base_model(causal_lm: nn.Module) -> nn.Module:
    kind = getattr(causal_lm.config, "model_type", None)
    # seq_len 1: a sliding window is checked against the sequence at the first step (Pipeline.schedule).
    why = why_no_pipeline_stages(causal_lm.config.to_dict(), seq_len=1)
    if why:
        raise ValueError(f"{type(causal_lm).__name__} cannot be split into pipeline stages: {why}")
    base = getattr(causal_lm, "model", None)
    missing = [name for name in _PARTS if base is None or getattr(base, name, None) is None]
    if missing or getattr(causal_lm, "lm_head", None) is None:
        raise ValueError(f"{type(causal_lm).__name__} ({kind}) cannot be split into pipeline stages: its base model "
                         f"lacks {missing or ['lm_head']}")
    params = inspect.signature(type(base.layers[0]).forward).parameters
    needed = [name for name, p in params.items() if name not in ("self", "hidden_states", "attention_mask",
                                                                   "position_ids", "position_embeddings")
              and p.default is inspect.Parameter.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if needed or "position_embeddings" not in params:
        raise ValueError(f"{type(causal_lm).__name__} ({kind}) cannot be split into pipeline stages: its decoder "
                         f"layers take {needed or 'no position_embeddings'}")
    return base


class PipelineStageModule(nn.Module):
    """One stage of an HF causal LM: the embeddings (first stage), decoder blocks [start, end), the rotary
    embedding (every stage: it holds only inv_freq), the final norm and the head (last stage). Its forward
    takes token ids (first stage) or hidden states and returns hidden states, or the logits (last stage).

    Under tensor parallelism (`tp_mesh`, set by apply_pp once apply_tp_stage has split the stage) the hidden
    states crossing between stages are this tp rank's sequence shard as a plain tensor (rows x seq / tp x
    hidden), as torchtitan's stages pass them: a stage taking hidden states marks its input as that shard
    (DTensor Shard(1), what the blocks' sequence-parallel norms read), and one passing them on hands over its
    local shard (`to_local`, torch's `use_local_output`); the last stage's head gathers the sequence and
    returns every rank the whole logits (apply_tp's layout)."""

    def __init__(self, causal_lm: nn.Module, start: int, end: int, *, first: bool, last: bool) -> None:
        super().__init__()
        base = _base_model(causal_lm)
        self.start, self.end = start, end
        self.embed_tokens = base.embed_tokens if first else None
        self.layers = nn.ModuleList(base.layers[start:end])
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm if last else None
        self.lm_head = causal_lm.lm_head if last else None
        self.tp_mesh = None
        self.position_ids: torch.Tensor | None = None
        """Under context parallelism, this rank's positions (1 x seq / cp: the slices torch's load balancer gave it),
        set by Pipeline for each step; else the stage counts them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            hidden = self.embed_tokens(x)
        elif self.tp_mesh is not None:  # the previous stage's sequence shard
            from torch.distributed.tensor import DTensor, Shard

            hidden = DTensor.from_local(x, self.tp_mesh, [Shard(1)], run_check=False)
        else:
            hidden = x
        position_ids = self.position_ids
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=None, position_ids=position_ids,
                           position_embeddings=position_embeddings)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.lm_head is not None:
            hidden = self.lm_head(hidden)
        elif self.tp_mesh is not None:  # this rank's sequence shard goes to the next stage
            hidden = hidden.to_local()
        return hidden


def stage_loss(causal_lm: nn.Module, *, context_parallel: int = 1) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The last stage's loss: the model's own (training.micro_batch_loss's `model(input_ids, labels).loss`),
    on the stage's logits with the micro-batch's tokens as labels (shifted inside). Under context parallelism the
    target is this rank's slice of labels shifted before slicing (Pipeline.__call__), and the loss is the slice's
    summed token losses over the micro-batch's count / cp, as context.sequence_shards has it: the cp ranks'
    gradients then average (FSDP over dp_shard x cp) to the micro-batch's mean loss's."""
    loss_function, vocab_size = causal_lm.loss_function, causal_lm.config.vocab_size

    def loss_fn(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return loss_function(logits=logits, labels=tokens, vocab_size=vocab_size)

    def sliced_loss_fn(logits: torch.Tensor, shifted: torch.Tensor) -> torch.Tensor:
        rows, local = shifted.shape
        return loss_function(logits=logits, labels=None, shift_labels=shifted, vocab_size=vocab_size,
                             num_items_in_batch=rows * (local * context_parallel - 1) / context_parallel)

    return loss_fn if context_parallel == 1 else sliced_loss_fn


class Pipeline:
    """This rank's stages and the schedule that runs them; training.train_step calls it with a step's
    micro-batches (`model.pipeline`). The PipelineStages and the schedule are made at the first step, when the
    micro-batches' shape is known (their metadata given up front: STATIC inference), and again only when the
    number of micro-batches changes."""

    def __init__(self, modules: list[tuple[int, PipelineStageModule]], *, num_stages: int, schedule: str, group,
                 device: torch.device, loss_fn, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                 config: dict | None = None, tensor_parallel: int = 1, cp_mesh=None) -> None:
        self.modules = modules
        self.num_stages = num_stages
        self.schedule_name = schedule
        self.group = group
        self.device = device
        self.loss_fn = loss_fn
        self.hidden_size, self.vocab_size, self.dtype = hidden_size, vocab_size, dtype
        self._schedule = None
        self._key: tuple | None = None
        self._config = config or {}
        self.cp_mesh = cp_mesh
        self.context_parallel = cp_mesh.size() if cp_mesh is not None else 1
        # The hidden states between stages are each rank's sequence shard: its cp slice, split over its tp ranks.
        self.sequence_shards = self.context_parallel * tensor_parallel

    @property
    def has_first(self) -> bool:
        return any(index == 0 for index, _ in self.modules)

    @property
    def has_last(self) -> bool:
        return any(index == self.num_stages - 1 for index, _ in self.modules)

    def _metas(self, index: int, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Example input and output of stage `index` (meta tensors: only shapes, strides and dtypes are read).
        Every output requires grad: the grad-recv buffer of a non-last stage is made from its output's meta. Under
        tensor and context parallelism the hidden states between stages are this rank's sequence shard (seq / (cp
        x tp) tokens); the first stage's tokens and the last stage's logits are its cp slice (seq / cp: the head
        gathers the slice over the tp ranks)."""
        sliced = seq // self.context_parallel
        hidden = torch.empty(rows, seq // self.sequence_shards, self.hidden_size, dtype=self.dtype, device="meta",
                             requires_grad=True)
        inputs = torch.empty(rows, sliced, dtype=torch.long, device="meta") if index == 0 else hidden
        outputs = (torch.empty(rows, sliced, self.vocab_size, dtype=self.dtype, device="meta", requires_grad=True)
                   if index == self.num_stages - 1 else hidden)
        return inputs, outputs

    def schedule(self, n_microbatches: int, rows: int, seq: int):
        key = (n_microbatches, rows, seq)
        if self._key == key:
            return self._schedule
        why = why_no_pipeline_stages(self._config, seq_len=seq) if self._config else ""
        if why:
            raise ValueError(f"pipeline stages of {seq}-token sequences: {why}")
        # CP's load balancer cuts 2 x cp chunks; each rank's slice (two of them) then splits over its tp ranks.
        if seq % self.sequence_shards or (self.context_parallel > 1 and seq % (2 * self.context_parallel)):
            raise ValueError(f"pipeline stages of {seq}-token sequences: the context- and tensor-parallel degrees "
                             f"({self.context_parallel} x {self.sequence_shards // self.context_parallel}) do not "
                             "divide them into the equal sequence shards the stages pass on")
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        stages = []
        for index, module in self.modules:
            inputs, outputs = self._metas(index, rows, seq)
            stages.append(PipelineStage(module, index, self.num_stages, self.device, input_args=(inputs,),
                                        output_args=(outputs,), group=self.group))
        if self.schedule_name == "Interleaved1F1B":
            self._schedule = ScheduleInterleaved1F1B(stages, n_microbatches=n_microbatches, loss_fn=self.loss_fn)
        else:
            single = Schedule1F1B if self.schedule_name == "1F1B" else ScheduleGPipe
            (stage,) = stages
            self._schedule = single(stage, n_microbatches=n_microbatches, loss_fn=self.loss_fn)
        self._key = key
        return self._schedule

    def __call__(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """One schedule step over `micro_batches` (each rows x seq token ids; every rank passes the same ones,
        the first stage feeds them, the last takes them as labels). Returns the mean loss over the micro-batches
        on a rank holding the last stage, 0 elsewhere (detached)."""
        rows, seq = micro_batches[0].shape
        schedule = self.schedule(len(micro_batches), rows, seq)
        tokens = torch.cat(micro_batches) if len(micro_batches) > 1 else micro_batches[0]
        losses: list[torch.Tensor] = []
        with self._sequence_slices(tokens) as (tokens, target):
            args = (tokens,) if self.has_first else ()
            # return_outputs=False, as torchtitan's trainer steps its schedule: the last stage would otherwise keep
            # every micro-batch's logits (output_chunks) to the end of the step and concatenate them, for nobody.
            schedule.step(*args, target=target if self.has_last else None, losses=losses if self.has_last else None,
                          return_outputs=False)
        if not losses:
            return torch.zeros((), device=tokens.device)
        return torch.stack([loss.detach() for loss in losses]).mean()

    @contextlib.contextmanager
    def _sequence_slices(self, tokens: torch.Tensor):
        """(tokens, target) for the schedule: as they are without context parallelism; with it, within CP's
        context for the whole schedule step (the ring runs in every stage's forward and backward), this rank's
        load-balanced slices of the tokens, of the labels shifted before slicing, and of the positions, which
        each stage reads (context.context_parallel_step slices them in place, as torchtitan's train context
        slices its inputs, labels and rotary table around its pipeline schedule's step)."""
        if self.cp_mesh is None:
            yield tokens, tokens
            return
        import torch.nn.functional as F

        from autotune.distributed.parallel.context import context_parallel_step

        labels = F.pad(tokens[:, 1:], (0, 1), value=-100)
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        buffers = [tokens, labels, positions]
        with context_parallel_step(self.cp_mesh, buffers, [1, 1, 1], no_restore_buffers=set(buffers)):
            for _, module in self.modules:
                module.position_ids = positions
            try:
                yield tokens, labels
            finally:
                for _, module in self.modules:
                    module.position_ids = None


def apply_pp(model: nn.Module, mesh, train: TrainConfig, *, allow_offload: bool = True,
             compile_backend: str = COMPILE_BACKEND, step: str = "autotune") -> Blocks:
    """Split `model` (an HF causal LM, on meta or fake tensors) into this rank's stages, in place: the stages
    become `model.pipeline_stages`, the base model and head are dropped from `model` (what this rank does not
    hold is never materialised), activation checkpointing and FSDP2 are applied to each stage over the data
    mesh (the stage its FSDP root), and `model.pipeline` (Pipeline) runs the schedule. Returns the blocks of
    this rank's first stage (callers read their class). Under tensor parallelism each stage is first split over
    the tp mesh (apply_tp_stage: its blocks, and the embeddings, final norm and head it holds). Each stage goes
    through parallelize's steps in parallelize's order, as torchtitan parallelizes each model part: float8
    converts its blocks' linears, TP splits them, then checkpointing, compile (`compile_backend`, as parallelize's)
    and FSDP."""
    base = _base_model(model)
    pp_mesh = pipeline_mesh(mesh)
    tp = train.tensor_parallel
    tp_mesh = tensor_mesh(mesh) if tp > 1 else None
    cp_mesh = context_mesh(mesh) if train.context_parallel > 1 else None
    if cp_mesh is not None:
        use_causal_sdpa(model)  # the ring's attention: SDPA with is_causal and no mask (context.py)
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    virtual = PIPELINE_VIRTUAL_STAGES[train.pipeline_schedule]
    num_stages = pp * virtual
    bounds = split_stages(len(base.layers), num_stages)
    modules = []
    for index in stages_of_rank(pp_rank, pp, train.pipeline_schedule):
        start, end = bounds[index]
        modules.append((index, PipelineStageModule(model, start, end, first=index == 0, last=index == num_stages - 1)))
    config = model.config
    loss_fn = stage_loss(model, context_parallel=train.context_parallel)
    model.model = None
    model.lm_head = None
    model.pipeline_stages = nn.ModuleList(module for _, module in modules)
    blocks = []
    for _, module in modules:
        stage_blocks = Blocks(parent=module, attr="layers", class_name=type(module.layers[0]).__name__)
        apply_float8(stage_blocks, train.float8)  # before TP splits the converted linears, as parallelize
        if tp_mesh is not None:
            apply_tp_stage(model, stage_blocks, tp_mesh, tp, embeddings=module.embed_tokens,
                           final_norm=module.norm, head=module.lm_head, float8=train.float8)
            module.tp_mesh = tp_mesh
        apply_ac(stage_blocks, train.activation_checkpointing)
        apply_compile(stage_blocks, train.compile, backend=compile_backend)
        apply_fsdp(module, stage_blocks, mesh, train, allow_offload=allow_offload, step=step)
        blocks.append(stage_blocks)
    if mesh.device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(mesh.device_type)
    model.pipeline = Pipeline(modules, num_stages=num_stages, schedule=train.pipeline_schedule,
                              group=pp_mesh.get_group(), device=device, loss_fn=loss_fn,
                              hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                              dtype=PARAM_DTYPES[train.precision], config=config.to_dict(), tensor_parallel=tp,
                              cp_mesh=cp_mesh)
    return blocks[0]
