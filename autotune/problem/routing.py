"""MoE routing skew (issue 58): a stated assumption of the problem, like seq_len, not a tuned knob.

`--routing-skew` says how the router spreads tokens over the experts: `balanced` (the default, what
every planner assumes), `zipf:S` (expert e receives a share proportional to 1 / (e + 1) ** S: expert 0
hottest), `capacity:C` (the hottest expert-parallel rank receives C times its balanced share, the
other ranks share the rest evenly; C is capped at the degree: everything on one rank) or a file of
measured per-expert token counts (one number per expert, separated by spaces, commas or new lines,
or a JSON list: e.g. a router's histogram summed over a few batches). One profile for every MoE layer.

Experts sit on expert-parallel ranks as `parallel.apply_ep` places them: rank r of a group of N holds
the contiguous experts r * E / N ... (r + 1) * E / N - 1. Every rank routes its own tokens x top-k
rows by the same profile, so the rank whose experts have the largest share receives the most rows
from every peer: it binds (`binding_rank`). `RoutingSkew.expert_rows` is the one place the profile
becomes whole rows; the simulator's fake all-to-all sizes (`split_sizes`: the binding rank's) and a
real trial's forced router (`forced_expert_ids`) both come from it (parallel.ExpertDispatch).
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.util.errors import UsageError

FLAG = "--routing-skew"
KINDS = ("balanced", "zipf", "capacity", "histogram")


def _largest_remainder(total: int, shares: list[float]) -> list[int]:
    """`total` whole rows split in proportion to `shares` (largest remainder; ties to the lower index)."""
    weight = sum(shares)
    exact = [total * s / weight for s in shares] if weight > 0 else [total / len(shares)] * len(shares)
    rows = [math.floor(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - rows[i]), i))
    for i in order[:max(0, total - sum(rows))]:
        rows[i] += 1
    for i in reversed(order):  # floating point over a whole row: taken back where the remainder was least
        if sum(rows) <= total:
            break
        if rows[i]:
            rows[i] -= 1
    return rows


@dataclass(frozen=True)
class RoutingSkew:
    kind: str = "balanced"
    value: float = 0.0
    """zipf: the exponent S; capacity: the factor C."""
    counts: tuple[float, ...] = ()
    """histogram: the measured tokens per expert."""
    source: str = ""
    """histogram: the file the counts were read from (for the label)."""

    @property
    def balanced(self) -> bool:
        return self.kind == "balanced"

    # -- the profile ---------------------------------------------------------------------------
    def check_experts(self, experts: int | None, model_name: str = "the model") -> None:
        """A skew is stated for a MoE model only; a histogram names every expert of it."""
        if self.balanced:
            return
        if not experts:
            raise UsageError(f"{FLAG} {self.label()}: {model_name} has no routed experts (a MoE model only)")
        if self.kind == "histogram" and len(self.counts) != experts:
            raise UsageError(f"{FLAG} {self.source}: {len(self.counts)} counts for the {experts} experts of "
                             f"{model_name}: give one count per expert")

    def rank_shares(self, experts: int, ranks: int) -> list[float]:
        """The fraction of every rank's routed rows sent to each expert-parallel rank."""
        per = experts // ranks
        if self.kind == "capacity":
            hot = min(self.value, ranks) / ranks
            return [hot] + [(1.0 - hot) / (ranks - 1)] * (ranks - 1) if ranks > 1 else [1.0]
        shares = self.expert_shares(experts)
        return [sum(shares[r * per:(r + 1) * per]) for r in range(ranks)]

    def expert_shares(self, experts: int) -> list[float]:
        """Each expert's fraction of the routed rows (capacity: even within a rank's experts, rank_shares)."""
        if self.kind == "zipf":
            weights = [1.0 / (e + 1) ** self.value for e in range(experts)]
        elif self.kind == "histogram":
            weights = [float(c) for c in self.counts]
        else:
            weights = [1.0] * experts
        total = sum(weights)
        return [w / total for w in weights]

    def expert_rows(self, rows: int, experts: int, ranks: int) -> list[int]:
        """`rows` routed rows of one rank (tokens x top-k) as whole rows per expert: first per
        expert-parallel rank (rank_shares), then within a rank's experts by their shares."""
        per = experts // ranks
        within = self.expert_shares(experts) if self.kind != "capacity" else [1.0] * experts
        out: list[int] = []
        for r, rank_rows in enumerate(_largest_remainder(rows, self.rank_shares(experts, ranks))):
            out += _largest_remainder(rank_rows, within[r * per:(r + 1) * per])
        return out

    def rank_rows(self, rows: int, experts: int, ranks: int) -> list[int]:
        """Rows each expert-parallel rank receives from one rank sending `rows`."""
        per = experts // ranks
        by_expert = self.expert_rows(rows, experts, ranks)
        return [sum(by_expert[r * per:(r + 1) * per]) for r in range(ranks)]

    def binding_rank(self, experts: int, ranks: int) -> int:
        """The expert-parallel rank whose experts receive the most rows (the lowest on ties)."""
        shares = self.rank_shares(experts, ranks)
        return max(range(ranks), key=lambda r: (shares[r], -r))

    def split_sizes(self, rows: int, experts: int, ranks: int) -> tuple[list[int], list[int]]:
        """The binding rank's all-to-all sizes: the rows it sends to each peer, and receives from each
        (every peer sends it its share of the same number of rows)."""
        send = self.rank_rows(rows, experts, ranks)
        return send, [send[self.binding_rank(experts, ranks)]] * ranks

    def forced_expert_ids(self, tokens: int, top_k: int, experts: int, ranks: int) -> list[list[int]]:
        """A router's top-k choices, per token, that route exactly `expert_rows`: the expert ids in
        order, dealt to the tokens column by column (token t takes ids t, tokens + t, ...)."""
        return [list(choice) for choice in _forced_expert_ids(self, tokens, top_k, experts, ranks)]

    # -- words ---------------------------------------------------------------------------------
    def label(self) -> str:
        if self.kind == "balanced":
            return "balanced"
        if self.kind == "histogram":
            return f"histogram {self.source}"
        return f"{self.kind}:{self.value:g}"

    def describe(self) -> str:
        """The assumption in a sentence (best.json, the console, the report)."""
        if self.kind == "balanced":
            return "balanced routing assumed: every expert receives an equal share of the routed tokens"
        if self.kind == "zipf":
            return (f"routing skew zipf:{self.value:g} assumed: expert e receives a share proportional to "
                    f"1/(e+1)^{self.value:g}, expert 0 hottest, the same in every MoE layer")
        if self.kind == "capacity":
            return (f"routing skew capacity:{self.value:g} assumed: the hottest expert-parallel rank receives "
                    f"{self.value:g}x its balanced share of the routed tokens, the other ranks the rest evenly")
        return (f"routing skew from the measured histogram {self.source} assumed ({len(self.counts)} experts' "
                "token counts), the same in every MoE layer")

    def binding(self, experts: int, ranks: int) -> dict[str, Any]:
        """Which expert-parallel rank binds under the profile, and how much it receives."""
        if self.balanced or ranks <= 1:
            why = ("balanced routing" if self.balanced else
                   "no expert parallelism: each rank runs every expert on its own tokens, and routing does not "
                   "change memory (tests/test_moe_routing.py)")
            return {"binding_rank": None, "note": f"no rank binds by routing ({why})"}
        rank = self.binding_rank(experts, ranks)
        share = self.rank_shares(experts, ranks)[rank]
        per = experts // ranks
        first, last = rank * per, (rank + 1) * per - 1
        held = f"expert {first}" if first == last else f"experts {first}-{last}"
        return {"binding_rank": rank, "experts": [first, last], "load_vs_balanced": round(share * ranks, 4),
                "note": f"expert-parallel rank {rank} of each group of {ranks} ({held}) binds: it receives "
                        f"{share * ranks:.2f}x its balanced share of the routed tokens, traced at that size"}

    def key(self) -> tuple:
        """What changes a trace (part of the simulator's trace key)."""
        return () if self.balanced else (self.kind, self.value, self.counts)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"kind": self.kind}
        if self.kind in ("zipf", "capacity"):
            data["value"] = self.value
        if self.kind == "histogram":
            data.update(counts=list(self.counts), source=self.source)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "RoutingSkew":
        data = data or {}
        return cls(kind=data.get("kind", "balanced"), value=float(data.get("value", 0.0)),
                   counts=tuple(data.get("counts", ())), source=data.get("source", ""))


BALANCED = RoutingSkew()


@functools.lru_cache(maxsize=64)
def _forced_expert_ids(skew: RoutingSkew, tokens: int, top_k: int, experts: int,
                       ranks: int) -> tuple[tuple[int, ...], ...]:
    """RoutingSkew.forced_expert_ids, made once per shape (every MoE layer of every step asks)."""
    ids = [e for e, n in enumerate(skew.expert_rows(tokens * top_k, experts, ranks)) for _ in range(n)]
    return tuple(tuple(ids[k * tokens + t] for k in range(top_k)) for t in range(tokens))


def tune_note(skew: RoutingSkew, experts: int, winner_expert_parallel: int,
              tried: list[tuple[str, int | None, bool, float | None]]) -> str:
    """A tune's note under a stated skew: the assumption, which rank binds at the winner's degree, and
    the expert-parallel configurations tried, each (label, predicted peak bytes, fits, tokens/s) on
    its binding rank: what the skew did to them."""
    from autotune.util.units import format_bytes

    note = f"{skew.describe()}; the winner: {skew.binding(experts, winner_expert_parallel)['note']}"
    if tried:
        shown = "; ".join(f"{label}: {format_bytes(peak) if peak else '-'}"
                          + (", over the limit" if not fits else f", {speed:,.0f} tokens/s" if speed else "")
                          for label, peak, fits, speed in tried[:6])
        over = sum(not fits for _, _, fits, _ in tried)
        note += (f"; expert-parallel configurations tried, predicted on their binding rank ({over} of {len(tried)} "
                 f"over the limit): {shown}" + (f"; and {len(tried) - 6} more" if len(tried) > 6 else ""))
    return note


def routing_section(skew: RoutingSkew, model, expert_parallel: int) -> dict[str, Any]:
    """best.json's `routing_skew` (and `autotune trial`'s): the assumption, named, and which
    expert-parallel rank binds under it at the configuration's degree (`model`: a ModelSpec)."""
    experts = model.num_experts if not skew.balanced else 0
    return {**skew.to_dict(), "assumption": skew.describe(), "expert_parallel": expert_parallel,
            **skew.binding(experts, expert_parallel)}


def parse_routing_skew(text: Any) -> RoutingSkew:
    """`--routing-skew`'s value: balanced, zipf:S (S > 0), capacity:C (C >= 1) or a histogram file.
    A RoutingSkew passes through. A bad value is a one-line UsageError naming the flag."""
    try:
        return read_routing_skew(text)
    except UsageError:
        raise
    except ValueError as exc:
        raise UsageError(f"{FLAG} {exc}") from None


def read_routing_skew(text: Any) -> RoutingSkew:
    """parse_routing_skew's work; a bad value is a ValueError without the flag (options.routing_skew
    gives it to argparse, which names the flag)."""
    if isinstance(text, RoutingSkew):
        return text
    if text is None:
        return BALANCED
    value = str(text).strip()
    if value in ("", "balanced"):
        return BALANCED
    match = re.fullmatch(r"(zipf|capacity):(.*)", value)
    if match:
        kind, number = match.groups()
        try:
            parsed = float(number)
        except ValueError:
            raise ValueError(f"{value!r}: {number!r} is not a number (e.g. {kind}:1.2)") from None
        if not math.isfinite(parsed) or (kind == "zipf" and parsed <= 0) or (kind == "capacity" and parsed < 1):
            need = "a positive exponent, e.g. zipf:1.2" if kind == "zipf" else (
                "a factor of at least 1 (the hottest rank's load over its balanced share), e.g. capacity:1.5")
            raise ValueError(f"{value!r}: {kind} needs {need}")
        return RoutingSkew(kind=kind, value=parsed)
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"{value!r} is not balanced, zipf:S, capacity:C or a readable histogram file "
                         "of per-expert token counts")
    try:
        body = path.read_text()
        numbers = json.loads(body) if body.lstrip().startswith("[") else re.split(r"[\s,]+", body.strip())
        counts = tuple(float(n) for n in numbers)
    except (OSError, ValueError, TypeError):
        raise ValueError(f"{value!r}: expected per-expert token counts (numbers separated by spaces, "
                         "commas or new lines, or a JSON list)") from None
    if len(counts) < 2 or any(not math.isfinite(c) or c < 0 for c in counts) or not sum(counts):
        raise ValueError(f"{value!r}: expected a non-negative token count for each of at least 2 experts, "
                         "not all zero")
    return RoutingSkew(kind="histogram", counts=tuple(int(c) if c == int(c) else c for c in counts), source=value)
