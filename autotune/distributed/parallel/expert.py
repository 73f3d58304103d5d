"""Expert parallelism: fused experts split over ranks, tokens exchanged by all-to-all."""

from __future__ import annotations

import torch
from torch import nn

from autotune.problem.catalog.blocks import Blocks, fused_experts
from autotune.distributed.parallel.dims import expert_meshes


def balanced_splits(rows: int, ranks: int) -> list[int]:
    """Rows sent to each of `ranks` peers when routing is balanced: as even as whole rows allow."""
    return [rows // ranks + (peer < rows % ranks) for peer in range(ranks)]


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with its backward (the reverse exchange of the gradients): what
    torch.distributed.nn.functional.all_to_all_single did before its deprecation."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, recv_sizes: list[int], send_sizes: list[int], group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.sizes, ctx.group = (recv_sizes, send_sizes), group
        out = rows.new_empty(sum(recv_sizes), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), recv_sizes, send_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        recv_sizes, send_sizes = ctx.sizes
        return _AllToAll.apply(grad.contiguous(), send_sizes, recv_sizes, ctx.group), None, None, None


class ExpertDispatch:
    """The forward of a fused-experts module under expert parallelism (HF transformers 5.24's
    AllToAllEP, without its tensor-parallel part): each (token, expert) pair is sent by all-to-all
    to the rank holding the expert, the experts' own forward runs on the received rows (top-1, local
    expert ids, unit weights), a second all-to-all brings the outputs back, and the routing weights
    are applied where the tokens live. The split sizes depend on the router's choices: a real run
    reads them back to the host (`.tolist()`); under fake tensors (the simulator) their values
    do not exist, and every rank is assumed to send `balanced_splits` of its rows to each peer and
    to receive as much (balanced routing: docs/KNOBS.md). With a stated routing skew (`routing`, an
    autotune.problem.routing.RoutingSkew set by `set_routing`), fake tensors take the binding rank's sizes
    under it, and real tensors route by it: the router's top-k choices are replaced by the profile's
    (a real trial's forced router), so both come from the same rows per expert."""

    def __init__(self, experts: nn.Module, ep_mesh) -> None:
        self.local_forward = experts.forward
        self.local_experts = experts.num_experts
        self.group, self.ranks = ep_mesh.get_group(), ep_mesh.size()
        self.routing = None

    def split_sizes(self, rows: int, send_counts: torch.Tensor,
                    recv_counts: torch.Tensor) -> tuple[list[int], list[int]]:
        """Rows sent to and received from each peer: read from the counts, or balanced (fake tensors)."""
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(send_counts):
            if self.routing is not None:
                return self.routing.split_sizes(rows, self.local_experts * self.ranks, self.ranks)
            balanced = balanced_splits(rows, self.ranks)
            return balanced, balanced
        send, recv = torch.stack([send_counts.sum(dim=1), recv_counts.sum(dim=1)]).tolist()
        return send, recv

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        from torch._subclasses.fake_tensor import is_fake

        tokens, top_k = top_k_index.shape
        if self.routing is not None and not is_fake(top_k_index):  # a real trial's forced router
            forced = self.routing.forced_expert_ids(tokens, top_k, self.local_experts * self.ranks, self.ranks)
            top_k_index = torch.tensor(forced, dtype=top_k_index.dtype, device=top_k_index.device)
        expert_ids = top_k_index.reshape(-1)
        # Sorted by expert, the rows are grouped by the rank owning it (each owns a contiguous range).
        order = torch.argsort(expert_ids, stable=True)
        send = hidden_states[order // top_k]
        send_counts = torch.zeros(self.ranks * self.local_experts, dtype=torch.long, device=expert_ids.device)
        send_counts = send_counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids)).view(self.ranks, -1)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_sizes, recv_sizes = self.split_sizes(expert_ids.numel(), send_counts, recv_counts)
        received = _AllToAll.apply(send, recv_sizes, send_sizes, self.group)
        local_ids = torch.arange(self.local_experts, device=expert_ids.device).repeat(self.ranks)
        local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1), output_size=sum(recv_sizes)).unsqueeze(-1)
        if received.shape[0]:
            out = self.local_forward(received, local_ids, torch.ones_like(local_ids, dtype=received.dtype))
        else:  # nothing routed here: one row made from the empty input keeps backward's exchange connected
            row = received.sum(dim=0, keepdim=True)
            out = self.local_forward(row, local_ids.new_zeros((1, 1)), row.new_ones((1, 1)))[:0]
        back = _AllToAll.apply(out, send_sizes, recv_sizes, self.group)
        unsorted = torch.empty_like(back)
        unsorted[order] = back
        weighted = unsorted.view(tokens, top_k, -1) * top_k_weights.unsqueeze(-1).to(unsorted.dtype)
        return weighted.sum(dim=1).to(hidden_states.dtype)


def set_routing(model: nn.Module, routing) -> int:
    """Route every expert-parallel dispatch of `model` by `routing` (an autotune.problem.routing.RoutingSkew;
    None or balanced: the router's own choices, balanced under fake tensors). Returns how many."""
    skew = None if routing is None or routing.balanced else routing
    dispatches = [m.__dict__["forward"] for m in model.modules()
                  if isinstance(m.__dict__.get("forward"), ExpertDispatch)]
    for dispatch in dispatches:
        dispatch.routing = skew
    return len(dispatches)


def apply_ep(blocks: Blocks, mesh, degree: int) -> int:
    """Expert parallelism over `degree` ranks (1: nothing): each block's fused experts keep this
    rank's contiguous num_experts / degree of them (plain parameters, sliced on dimension 0) and
    answer through ExpertDispatch. Before FSDP, which then shards the local experts over the
    ranks holding the same ones (apply_fsdp). Returns how many expert modules were split."""
    if degree == 1:
        return 0
    ep_mesh, _ = expert_meshes(mesh)
    rank = ep_mesh.get_local_rank()
    split = 0
    for block in blocks.layers:
        for experts in fused_experts(block):
            if experts.num_experts % degree:
                raise ValueError(f"expert-parallel degree {degree} does not divide the {experts.num_experts} "
                                 f"experts of {type(experts).__name__}")
            local = experts.num_experts // degree
            for name, param in list(experts.named_parameters(recurse=False)):
                piece = param.detach()[rank * local:(rank + 1) * local].clone()
                setattr(experts, name, nn.Parameter(piece, requires_grad=param.requires_grad))
            experts.num_experts = local
            experts.forward = ExpertDispatch(experts, ep_mesh)
            split += 1
    return split
