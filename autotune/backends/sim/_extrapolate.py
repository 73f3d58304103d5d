"""From shallow traces to the full model: exact affine extrapolation per site and category.

At a fixed site (see `_trace`), every extra *period* of blocks (k blocks for 'every:k'
checkpointing, else 1) adds the same bytes of each category: its sharded parameters, optimizer
state, gradients and saved activations. So memory at a site is affine in the number of periods.
It is also affine in the micro-batch size: activations scale with it, model states do not.
Two depths (d1, d1 + k) and two micro-batch sizes (2, 3) pin down this bilinear form exactly;
(micro-batch 1 runs a slightly different sequence of ops, some shape checks short-cut, so it
is traced, never used to extrapolate);
the peak of the full model is the largest extrapolated site, not the extrapolated peak of the
shallow copies (whose peak may sit elsewhere). Depths are chosen with d1 = L (mod k), so the
top blocks have the same checkpointing pattern as the full model's, and d1 >= 2k so that the
bottom and top k blocks are distinct (the first and last blocks behave differently: nothing to
prefetch below the first, nothing gathered before the last).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # _trace imports torch; this module is used before any trace is needed
    from autotune.backends.sim._trace import SiteKey, StepTrace

__all__ = ["Extrapolated", "shallow_depths", "extrapolate", "extrapolate_pipeline_sites"]


def shallow_depths(num_layers: int, period: int) -> tuple[int, int] | None:
    """(d1, d2) to trace for a model of `num_layers` blocks, or None: trace it whole.

    d1 is the smallest depth >= period + 2 congruent to `num_layers` mod period: every named
    block position (b0..b(period), t0..t(period), see `_trace`) then exists, and a block named
    from one end is never the other end's special block."""
    d1 = period + 2
    d1 += (num_layers - d1) % period
    d2 = d1 + period
    return (d1, d2) if d2 < num_layers else None


@dataclass(frozen=True)
class Extrapolated:
    sites: dict[SiteKey, dict[str, int]]
    flops: float
    dropped_sites: int
    """Sites seen in some shallow traces only, left out: the optimizer's steps of the deeper
    copy's extra blocks (which repeat the steps of blocks both copies have)."""
    op_work: dict[str, float] | None = None
    """`StepTrace.op_work` of the full model, extrapolated like the FLOPs (every block adds the
    same ops)."""
    offloaded: dict[str, int] | None = None
    """`StepTrace.offloaded` of the full model (every block offloads the same tensors)."""


def _affine(v11: int, v21: int, v12: int, v22: int, x: int, y: int) -> int:
    """Bilinear in x (periods beyond d1) and y (micro-batch beyond 1), integer-exact."""
    return v11 + x * (v21 - v11) + y * (v12 - v11) + x * y * (v22 - v21 - v12 + v11)


def extrapolate(traces: dict[tuple[int, int], StepTrace], *, num_layers: int, micro_batch_size: int,
                period: int) -> Extrapolated:
    """Combine traces keyed (depth, micro_batch) into the full model at `micro_batch_size`.

    `traces` holds two depths d1 < d2 = d1 + period and either the target micro-batch alone or
    two consecutive micro-batches m and m + 1 (then the micro-batch is extrapolated too).
    """
    depths = sorted({d for d, _ in traces})
    mbs = sorted({m for _, m in traces})
    if len(depths) != 2 or depths[1] - depths[0] != period or (num_layers - depths[0]) % period:
        raise ValueError(f"extrapolation needs depths d1 and d1+{period} congruent to {num_layers} "
                         f"mod {period}, got {depths}")
    d1, d2 = depths
    if mbs == [micro_batch_size]:
        m1 = m2 = micro_batch_size
    elif len(mbs) == 2 and mbs[1] == mbs[0] + 1:
        m1, m2 = mbs
    else:
        raise ValueError(f"extrapolation needs micro-batch {micro_batch_size} or two consecutive ones, got {mbs}")
    x = (num_layers - d1) // period
    y = micro_batch_size - m1 if m2 != m1 else 0
    corners = [traces[d1, m1], traces[d2, m1], traces[d1, m2], traces[d2, m2]]
    common = set(corners[0].sites)
    for trace in corners[1:]:
        common &= set(trace.sites)
    every = set().union(*(t.sites for t in corners))
    sites = {}
    for key in common:  # tens of thousands of sites per call: no generator per category
        s11, s21, s12, s22 = (t.sites[key] for t in corners)
        sites[key] = {cat: _affine(s11.get(cat, 0), s21.get(cat, 0), s12.get(cat, 0), s22.get(cat, 0), x, y)
                      for cat in s11.keys() | s21.keys() | s12.keys() | s22.keys()}
    flops = _affine(*(int(t.flops) for t in corners), x, y)
    kinds = set().union(*(t.op_work for t in corners))
    op_work = {k: float(_affine(*(int(t.op_work.get(k, 0)) for t in corners), x, y)) for k in kinds}
    moved = set().union(*(t.offloaded for t in corners))
    offloaded = {k: _affine(*(int(t.offloaded.get(k, 0)) for t in corners), x, y) for k in moved}
    return Extrapolated(sites=sites, flops=float(flops), dropped_sites=len(every - common), op_work=op_work,
                        offloaded=offloaded)


def extrapolate_pipeline_sites(first: dict, second: dict, periods: int) -> tuple[dict, int]:
    """A pipeline rank's sites (_pipeline's shallow traces: every stage of the rank one period deeper in
    `second` than in `first`) extrapolated `periods` periods beyond `first`, per site and category, as
    `extrapolate` does in the depth (one micro-batch size: the pipeline's is traced as asked). Returns the
    sites both traces have, and how many sites only one has (left out: the optimizer's steps of the deeper
    copy's extra blocks, which repeat those of blocks both copies have). The sites keep `first`'s order (the
    order the step reaches them): of sites that tie at the peak, the first is the one a whole trace reports.

    The ops after one anchor are matched counting from the nearer end of their run (_from_both_ends): a run whose
    length grows with the depth (the step's end, after the top block's last post-backward hook, runs ops per
    parameter before the last stage frees its logits) would otherwise match an op of the deeper copy with a later
    one of the shallower, and extrapolate the memory freed between them as if each period added it."""
    first, second = _from_both_ends(first), _from_both_ends(second)
    sites = {}
    for key, a in first.items():
        b = second.get(key)
        if b is None:
            continue
        sites[key] = {cat: _affine(a.get(cat, 0), b.get(cat, 0), 0, 0, periods, 0) for cat in a.keys() | b.keys()}
    return sites, len(first.keys() ^ second.keys())


def _from_both_ends(sites: dict) -> dict:
    """`sites` (keys: phase, the anchor's hook, unit and count, the op's ordinal since the anchor, a tag) keyed by
    the ordinal's place from the nearer end of its anchor's run of ops: ("head", ordinal) in the first half, ("tail",
    ordinals before the run's last) in the second, as the optimizer's ops already are (their keys, led by "opt",
    are kept). Runs of the same length in both copies match as before, op for op; in a run one copy has longer (ops
    repeated per block) both ends still match the same ops, and the extra middle ones, which repeat, are dropped.
    The order is kept."""
    last: dict[tuple, int] = {}
    for key in sites:
        if key[0] != "opt":
            last[key[:-2]] = max(last.get(key[:-2], 0), key[-2])
    keyed = {}
    for key, cats in sites.items():
        if key[0] == "opt":
            keyed[key] = cats
            continue
        run, ordinal, tag = key[:-2], key[-2], key[-1]
        count = last[run]
        keyed[(*run, "head", ordinal, tag) if ordinal <= count // 2 else (*run, "tail", count - ordinal, tag)] = cats
    return keyed
