"""How the ranks split (ParallelDims, after torchtitan's) and the device mesh each dimension reads."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.problem.config import TrainConfig


@dataclass(frozen=True)
class ParallelDims:
    """How the ranks split: `dp_replicate` groups of `dp_shard` ranks. Ranks are numbered node by
    node (torchrun), and a mesh is laid out row-major, so a shard group of up to a node's GPUs
    stays within a node: its all-gathers and reduce-scatters never leave it.

    Expert parallelism (`ep` > 1, torchtitan's layout: the EP degree borrowed from dp_shard) splits
    the shard group as (dp_shard / ep, ep): ep neighbouring ranks hold different experts (their
    all-to-alls stay within a node where ep divides it), and the dp_shard / ep ranks that hold the
    same experts shard them with FSDP. Every other parameter is sharded over all dp_shard ranks.

    Tensor parallelism (`tp` > 1) is the mesh's last, fastest dimension, as in torchtitan: tp
    neighbouring ranks (within a node where tp divides it) split each block's weights and share one
    batch; FSDP shards what they hold over the dp_shard ranks, the data mesh.

    Context parallelism (`cp` > 1) sits between them, in torchtitan's order (dp_replicate, dp_shard,
    cp, tp): cp neighbouring ranks share one batch, each holding a slice of every sequence, and split
    no weights, so FSDP shards every parameter over all dp_shard x cp ranks. With tensor parallelism too the mesh
    is (dp_shard, cp, tp): cp groups of tp neighbouring ranks, FSDP sharding what each tp rank holds over the
    flattened dp_shard x cp ranks.

    Pipeline parallelism (`pp` > 1) is the outermost dimension, in torchtitan's order (pp, dp_replicate,
    dp_shard, cp, tp): the world splits into pp blocks of world / pp consecutive ranks, block k holding
    pipeline rank k's stages (parallel/pipeline.py), and FSDP shards each stage over its block, the data
    mesh. Only activations cross between blocks (point-to-point), so stages may span nodes. With tensor and
    context parallelism the mesh is (pp, dp_shard[, cp][, tp]): each pp block's ranks split as without a
    pipeline, cp neighbouring groups each holding a slice of every sequence, tp neighbouring ranks splitting
    each of the stage's blocks, and a stage's output crosses to the next block as each rank's sequence shard
    (1 / (cp x tp) of it)."""

    dp_replicate: int
    dp_shard: int
    ep: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1

    @classmethod
    def of(cls, train: TrainConfig, world_size: int) -> "ParallelDims":
        tp, cp, pp = train.tensor_parallel, train.context_parallel, train.pipeline_parallel
        if world_size % (tp * cp):
            raise ValueError(f"tensor x context-parallel degrees {tp} x {cp} do not divide the world size {world_size}")
        if world_size % (tp * cp * pp):
            raise ValueError(f"the pipeline-parallel degree {pp} (x tensor x context {tp} x {cp}) does not divide the "
                             f"world size {world_size}")
        if pp > 1 and (train.shard_group_size or train.expert_parallel > 1):
            raise ValueError("pipeline parallelism with expert parallelism or HSDP is not built here")
        if tp > 1 and (train.shard_group_size or train.expert_parallel > 1):
            raise ValueError("tensor parallelism with HSDP or expert parallelism is not built here")
        if cp > 1 and (train.shard_group_size or train.expert_parallel > 1):
            raise ValueError("context parallelism with expert parallelism or HSDP is not built here")
        data = world_size // (tp * cp * pp)
        shard = train.shard_group_size or data
        if data % shard:
            raise ValueError(f"shard group size {shard} does not divide the world size {world_size}")
        ep = train.expert_parallel
        if shard % ep:
            raise ValueError(f"expert-parallel degree {ep} does not divide the shard group of {shard} ranks")
        if ep > 1 and shard != world_size:
            raise ValueError("expert parallelism with HSDP is not built here: use a shard group of every rank")
        return cls(dp_replicate=data // shard, dp_shard=shard, ep=ep, tp=tp, cp=cp, pp=pp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def data_ranks(self) -> int:
        """Ranks that each take their own batch: the tensor- or context-parallel ranks of a group share one,
        and so do a pipeline's stages (world / (pp x cp x tp))."""
        return self.dp_replicate * self.dp_shard

    def data_rank(self, rank: int) -> int:
        """Which batch global `rank` takes (0 .. data_ranks - 1): the ranks of one tp/cp group and of one
        pipeline (the same place in each pp block) share it."""
        return (rank % (self.world_size // self.pp)) // (self.cp * self.tp)

    def pipeline_rank(self, rank: int) -> int:
        """Which pp block global `rank` is in: the pipeline rank whose stages it holds."""
        return rank // (self.world_size // self.pp)

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.dp_replicate, self.dp_shard) if self.hsdp else (self.dp_shard,)

    @property
    def dim_names(self) -> tuple[str, ...]:
        return ("dp_replicate", "dp_shard") if self.hsdp else ("dp_shard",)

    def build_mesh(self, device_type: str):
        """The mesh fully_shard takes: a 2-D one shards over its last dimension and replicates over
        the first (HSDP). With expert parallelism, the 1-D dp_shard mesh flattened from the 2-D
        (dp_shard_mod_ep, ep) one that `expert_meshes` reads back; with context parallelism, the 1-D
        dp_shard_cp mesh flattened from the (dp_shard, cp[, tp]) one that `context_mesh` (and `tensor_mesh`)
        read back."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.pp > 1:  # the data mesh of a (pp, [dp_replicate,] dp_shard[, cp][, tp]) mesh (with cp, dp_shard x cp
            # flattened); pipeline_mesh reads pp back, context_mesh cp, tensor_mesh tp (torchtitan's order: pp
            # outermost, tp innermost)
            inner = [(name, size) for name, size in (("cp", self.cp), ("tp", self.tp)) if size > 1]
            root = init_device_mesh(device_type, (self.pp, *self.shape, *(size for _, size in inner)),
                                    mesh_dim_names=("pp", *self.dim_names, *(name for name, _ in inner)))
            if self.cp > 1:
                return root["dp_shard", "cp"]._flatten("dp_shard_cp")
            return root[self.dim_names]
        if self.ep > 1:
            experts = init_device_mesh(device_type, (self.dp_shard // self.ep, self.ep),
                                       mesh_dim_names=("dp_shard_mod_ep", "ep"))
            return experts._flatten("dp_shard")
        if self.cp > 1:  # (dp_shard, cp[, tp]): FSDP over dp_shard x cp flattened, tp innermost
            tp = (self.tp,) if self.tp > 1 else ()
            root = init_device_mesh(device_type, (self.dp_shard, self.cp, *tp),
                                    mesh_dim_names=("dp_shard", "cp", *(("tp",) if tp else ())))
            return root["dp_shard", "cp"]._flatten("dp_shard_cp")
        if self.tp > 1:  # the data mesh of a (dp_shard, tp) mesh; tensor_mesh reads the tp one back
            root = init_device_mesh(device_type, (*self.shape, self.tp), mesh_dim_names=(*self.dim_names, "tp"))
            return root[self.dim_names]
        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.dim_names)


def tensor_mesh(mesh):
    """The tp sub-mesh beside a data mesh `ParallelDims.build_mesh` made with tp > 1."""
    return mesh._get_root_mesh()["tp"]


def pipeline_mesh(mesh):
    """The pp sub-mesh beside a data mesh `ParallelDims.build_mesh` made with pp > 1: this rank's place in
    the pipeline and its peers holding the other stages (the same data rank in every pp block)."""
    return mesh._get_root_mesh()["pp"]


def context_mesh(mesh):
    """The cp sub-mesh of a dp_shard_cp mesh `ParallelDims.build_mesh` made with cp > 1."""
    return mesh._get_root_mesh()["cp"]


def expert_meshes(mesh):
    """(ep, dp_shard_mod_ep) sub-meshes of a mesh `ParallelDims.build_mesh` made with ep > 1: the
    ranks holding different experts, and those holding the same experts (FSDP shards them there)."""
    root = mesh._get_root_mesh()
    return root["ep"], root["dp_shard_mod_ep"]
