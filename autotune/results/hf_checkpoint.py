"""A Hugging Face checkpoint of any size, trained sharded: what the exported train_fsdp2.py imports.

`sharded_model` builds the model on the meta device, applies `parallel.parallelize` (the wrapping
real trials apply) and allocates only this rank's shards; `load_hf_checkpoint` then fills them from
a `save_pretrained` folder (safetensors, one file or several): torch.distributed.checkpoint's
HuggingFaceStorageReader reads each rank's slice of each tensor from the files, so no rank ever
holds a whole model. `save_hf_checkpoint` writes it back the same way (HuggingFaceStorageWriter:
every rank writes its own shards, then they are consolidated into safetensors files with an
index) beside the config: a folder `AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from autotune.problem.catalog.models import ModelSpec
from autotune.problem.config import TrainConfig
from autotune.util.errors import UsageError

MAX_FILE_BYTES = 5 * 2**30
"""Tensors per safetensors file when saving, at most (a tensor larger than this gets a file of its own)."""


def sharded_model(spec: ModelSpec, mesh, train: TrainConfig, *, device: torch.device,
                  checkpoint: str | None, seed: int = 0) -> nn.Module:
    """The model wrapped as tuned, holding this rank's shards only: loaded from `checkpoint` (a
    save_pretrained folder), or randomly initialised (the model's own init) when it is None. Built
    as a real trial builds it (backends.real._trial.build_sharded)."""
    from autotune.backends.real._trial import build_sharded

    load = (lambda model: load_hf_checkpoint(model, checkpoint)) if checkpoint is not None else None
    model, _ = build_sharded(spec, train, mesh=mesh, device=device, seed=seed, load=load)
    return model


def load_hf_checkpoint(model: nn.Module, folder: str | os.PathLike) -> None:
    """Fill the sharded model's parameters and persistent buffers from a save_pretrained folder,
    each rank reading its own slices (cast to the model's dtypes)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    folder = str(folder)
    if not any(name.endswith(".safetensors") for name in os.listdir(folder)):
        raise UsageError(f"{folder!r} has no .safetensors files: give a folder that save_pretrained wrote")
    saved = HuggingFaceStorageReader(folder).read_metadata().state_dict_metadata  # the files' headers only
    state = _saved_tensors(model, get_model_state_dict(model))
    missing = [name for name in state if name not in saved]
    if missing:
        raise UsageError(f"{folder!r} lacks {len(missing)} of the model's tensors (first: {missing[0]}): "
                         "not a checkpoint of this model, or one whose tensor names transformers converts on load")
    for name, tensor in state.items():
        if tuple(saved[name].size) != tuple(tensor.shape):
            raise UsageError(f"{folder!r}: {name} has shape {tuple(saved[name].size)}, the model "
                             f"{tuple(tensor.shape)}: not a checkpoint of this model")
    dcp.load(state, storage_reader=HuggingFaceStorageReader(folder))  # in place: the tensors are the shards


def save_hf_checkpoint(model: nn.Module, folder: str | os.PathLike, *, copy_from: str | None = None) -> None:
    """Write the model's weights as a save_pretrained folder: safetensors (in the dtype they train
    in), model.safetensors.index.json and config.json; tokenizer and generation files are copied from
    `copy_from` (the folder the weights came from). Every rank writes its own shards first (nothing is
    gathered on any device); rank 0 then consolidates them, so the folder must be one every node sees."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    folder = Path(folder)
    state = _saved_tensors(model, get_model_state_dict(model))
    writer = HuggingFaceStorageWriter(str(folder), fqn_to_index_mapping=_file_index(state), save_distributed=True,
                                      enable_consolidation=True)
    dcp.save(state, storage_writer=writer)
    if dist.get_rank() == 0:
        shutil.rmtree(folder / "sharded")  # the per-rank files, consolidated above
        config = getattr(model, "config", None)
        if config is not None:
            config.save_pretrained(folder)
        if copy_from is not None and Path(copy_from).resolve() != folder.resolve():
            for source in Path(copy_from).iterdir():
                if source.is_file() and source.name != "config.json" and not source.name.startswith("model"):
                    shutil.copy2(source, folder / source.name)
    dist.barrier()  # no rank reads the folder before it is complete


def _saved_tensors(model: nn.Module, state: dict) -> dict:
    """The state dict as save_pretrained writes it: a tied output embedding is the input one's
    tensor, saved (and loaded) once under the input embedding's name."""
    if not hasattr(model, "get_output_embeddings"):
        return state
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if output is None or inputs is None or output.weight is not inputs.weight:
        return state
    tied = {f"{name}.weight" for name, module in model.named_modules() if module is output}
    return {name: tensor for name, tensor in state.items() if name not in tied}


def _file_index(state: dict) -> dict[str, int]:
    """Each tensor's safetensors file (1, 2, ...), in order, MAX_FILE_BYTES to a file."""
    index, used, files = 1, 0, {}
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()  # a DTensor's numel is the whole tensor's
        if used and used + size > MAX_FILE_BYTES:
            index, used = index + 1, 0
        files[name] = index
        used += size
    return files
