"""Lightning with FSDP2: `ModelParallelStrategy` and a LightningModule whose `configure_model`
calls autotune's own `parallelize` (copied into the file, as in the torchrun script), so what
Lightning runs is what autotune traced and measured. Lightning's FSDP1 `FSDPStrategy` is the
`lightning-fsdp1` format (flat parameters: a different memory layout from what was tuned).
"""

from __future__ import annotations

import dataclasses

from autotune.results.export._base import Export, Mapper, Tuned, build_export, fabric_nodes_note, map_attention
from autotune.results.export._fsdp2 import build_model_source, map_parallelize_knobs, tuned_and_wrapping


def _lightning_version() -> str:
    try:
        from importlib import metadata

        return metadata.version("lightning")
    except Exception:  # metadata.PackageNotFoundError: the version is only a label here
        return "2.x"


def export_lightning(t: Tuned) -> Export:
    m = Mapper()
    map_parallelize_knobs(m, precision_also="; Trainer(precision='32-true')", tensor_parallel=False)  # parallelize() in configure_model()
    m.mapped("micro_batch_size", "DataLoader(batch_size=TUNED.micro_batch_size)")
    m.mapped("grad_accum_steps", "Trainer(accumulate_grad_batches=GRAD_ACCUM_STEPS)")
    m.mapped("wrap", "parallelize(): fully_shard per block, then the root (configure_model)")
    m.mapped("world_size", f"ModelParallelStrategy(data_parallel_size={t.gpus}, tensor_parallel_size=1); "
                           f"Trainer(devices={t.gpus_per_node}, num_nodes={t.nodes})")
    m.mapped("shard_group_size", "configure_model(): Lightning's data-parallel mesh, or for HSDP the 2-D "
                                 "(replicate, shard) mesh of ParallelDims.of(TUNED, world).build_mesh(), as the fsdp2 "
                                 "script builds it")
    m.mapped("state_dict_type", f"ModelParallelStrategy(save_distributed_checkpoint={t.state_dict_type == 'sharded'})")
    m.mapped("optimizer_impl", f"configure_optimizers: make_optimizer(impl={t.optimizer_impl!r})")
    map_attention(m, t, "build_model(): config._attn_implementation")
    if t.precision == "fp16":
        m.warn("fp16: Lightning's ModelParallelStrategy runs no sharded grad scaler here, so the loss is not "
               "scaled as in the tuned run (torch's ShardedGradScaler): prefer bf16, or scale the loss yourself")
    return build_export(fmt="lightning", filename="lightning_fsdp2.py", tuned=t, mapper=m, body=_script(t),
                        expresses=("op_level_ac", "hsdp", "bf16_pure"),
                        target=f"Lightning {_lightning_version()} ModelParallelStrategy (FSDP2 fully_shard)")


def _script(t: Tuned) -> str:
    accelerator = "auto"
    return f'''"""The tuned FSDP2 configuration in Lightning: ModelParallelStrategy, and a LightningModule
whose configure_model() applies autotune's parallelize() (below, copied from autotune).

Run: python lightning_fsdp2.py --steps 10            (Lightning starts one process per device)
     python lightning_fsdp2.py --steps 2 --devices 2 --accelerator cpu   (on CPUs)
{fabric_nodes_note(t)}
Use your own model and data: keep configure_model(), configure_optimizers() and make_trainer().
--report prints, from the live model after training, what FSDP2 applied.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

{tuned_and_wrapping(dataclasses.replace(t, tensor_parallel=1, context_parallel=1))}
# ---- Lightning ---------------------------------------------------------------------------


{build_model_source(t)}
class TunedModule(pl.LightningModule):
    """A causal LM trained with the tuned FSDP2 configuration."""

    def __init__(self) -> None:
        super().__init__()
        self.model = build_model()

    def configure_model(self) -> None:
        # Lightning's FSDP2 hook: the same wrapping autotune traced and ran.
        if not getattr(self, "_parallelized", False):
            mesh = self.device_mesh["data_parallel"]
            dims = ParallelDims.of(TUNED, mesh.size())
            if dims.hsdp or dims.ep > 1:  # Lightning's mesh is 1-D; HSDP needs 2-D, expert parallelism its sub-meshes
                mesh = dims.build_mesh(mesh.device_type)
            parallelize(self.model, mesh, TUNED, allow_offload=mesh.device_type == "cuda")
            self._parallelized = True

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        # Activation offload (GPUs only: on CPUs the host is the device) around forward; Lightning runs backward.
        offload = TUNED.activation_offload and self.device.type == "cuda"
        with OffloadedActivations() if offload else contextlib.nullcontext():
            loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.model, impl=TUNED.optimizer_impl)


class RandomTokens(IterableDataset):
    """Seeded random token rows of SEQ_LEN: replace with your data."""

    def __iter__(self):
        generator = torch.Generator().manual_seed(int(os.environ.get("RANK", 0)))
        while True:
            yield torch.randint(0, MODEL_CONFIG["vocab_size"], (SEQ_LEN,), generator=generator)


def make_strategy() -> ModelParallelStrategy:
    # Data parallelism over every rank (the FSDP2 mesh autotune used), no tensor parallelism.
    return ModelParallelStrategy(data_parallel_size=WORLD_SIZE, tensor_parallel_size=1,
                                 save_distributed_checkpoint={t.state_dict_type == "sharded"!r})


def make_trainer(*, devices: int = {t.gpus_per_node}, num_nodes: int = {t.nodes}, accelerator: str = {accelerator!r},
                 **overrides) -> pl.Trainer:
    global WORLD_SIZE
    WORLD_SIZE = devices * num_nodes
    return pl.Trainer(strategy=make_strategy(), devices=devices, num_nodes=num_nodes, accelerator=accelerator,
                      accumulate_grad_batches=GRAD_ACCUM_STEPS,
                      precision="32-true",  # FSDP2's MixedPrecisionPolicy casts; Lightning must not autocast
                      **overrides)


def applied(module: TunedModule) -> dict:
    """What FSDP2 applied, read from the live model (for --report)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    layers = find_decoder_blocks(module.model).layers
    state = layers[0]._get_fsdp_state()
    policy = state._mp_policy
    optimizer = module.trainer.optimizers[0]
    return dict(
        fsdp_blocks=sum(isinstance(b, FSDPModule) for b in layers), blocks=len(layers),
        root_is_fsdp=isinstance(module.model, FSDPModule),
        checkpointed=[isinstance(b, CheckpointWrapper) for b in layers],
        param_dtype=str(policy.param_dtype).removeprefix("torch."),
        reduce_dtype=str(policy.reduce_dtype).removeprefix("torch."),
        reshard_after_forward=state._fsdp_param_group.post_forward_mesh_info is not None,  # None: kept gathered
        mesh_size=state._fsdp_param_group.mesh_info.mesh.size(),
        mesh_shape=list(state._fsdp_param_group.mesh_info.mesh.shape),
        optimizer=type(optimizer).__name__,
        optimizer_impl="fused" if optimizer.defaults.get("fused") else
        "foreach" if optimizer.defaults.get("foreach") else "for-loop",
        loss=float(module.trainer.callback_metrics["loss"]),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train with the FSDP2 configuration autotune found, in Lightning.")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to run")
    parser.add_argument("--devices", type=int, default={t.gpus_per_node})
    parser.add_argument("--num-nodes", type=int, default={t.nodes})
    parser.add_argument("--accelerator", default={accelerator!r})
    parser.add_argument("--report", help="write what FSDP2 applied (JSON) to this file, from rank 0")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    trainer = make_trainer(devices=args.devices, num_nodes=args.num_nodes, accelerator=args.accelerator,
                           max_steps=args.steps, logger=False, enable_checkpointing=False,
                           enable_progress_bar=False, enable_model_summary=False)
    module = TunedModule()
    trainer.fit(module, DataLoader(RandomTokens(), batch_size=TUNED.micro_batch_size))
    if args.report and trainer.global_rank == 0:
        report = dict(applied(module), accumulate_grad_batches=trainer.accumulate_grad_batches,
                      micro_batch_size=TUNED.micro_batch_size, global_step=trainer.global_step,
                      world_size=trainer.world_size)
        with open(args.report, "w") as handle:
            json.dump(report, handle)


if __name__ == "__main__":
    main()
'''
