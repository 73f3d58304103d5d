"""Token-budget batches (issue 58): packed micro-batches of whole documents, an assumption of the problem.

`--token-budget` makes every micro-batch one padding-free row of documents drawn from a length
distribution (`--doc-lengths`: a file of lengths or a histogram; DEFAULT_LENGTHS when none is given),
as TRL's padding-free batches (`per_device_train_batch_size` rows of `max_length` flattened into one)
and verl's dynamic batching (`max_token_len` per GPU) give them. The budget is the micro-batch times
`--seq-len`: seq_len is the longest document (longer ones are cut to it, as `max_length` cuts them), and
the tune searches the micro-batch, so it searches the budget in steps of seq_len.

What each figure assumes:
- Memory: the traced peak of a micro-batch filled to the budget (`worst_case_documents`: documents drawn
  from the distribution, the last one cut so that the row holds exactly the budget). Attention runs each
  document on its own (`varlen_attention`: SDPA per document, causal, as a varlen flash kernel attends
  within each document), so no block-diagonal mask of budget x budget is built. Which split fills the
  budget changes the peak little (tests/test_token_budget.py traces two splits).
- Throughput: documents are never split across micro-batches (greedy, in arrival order; TRL's bfd and
  verl's dynamic batching fill at least as well), so a micro-batch holds `PackingStats.tokens` tokens in
  expectation, not the budget; attention's work follows the sum of squared document lengths
  (`PackingStats.squares`), the rest the tokens. Both from `stats`, a seeded simulation of the packing.
- The global batch: the accumulation that hits --global-tokens in expectation; a step's tokens then
  vary by `PackingStats.tokens_std` x sqrt(micro-batches per step), stated with it.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.util.errors import UsageError

FLAG = "--token-budget"
LENGTHS_FLAG = "--doc-lengths"
STEP = "packed"
"""The training step of a packed problem (config.stack_step): training.packed_batch, varlen_attention."""
ATTENTION = "autotune_varlen"
"""The attention implementation a packed step's model runs (registered with transformers by training)."""

DEFAULT_LENGTHS = "loguniform:64:8192"
"""Document lengths when --doc-lengths is not given: log-uniform from 64 to 8,192 tokens (an assumption,
not data: short chat turns to long documents in equal measure per octave; give a file for yours)."""
SAMPLES = 4_000
"""Micro-batches the packing simulation draws (`stats`): the expected fill within about 0.1%."""
SEED = 0


@dataclass(frozen=True)
class DocumentLengths:
    """A document length distribution: `lengths` drawn with `weights` (a histogram), or log-uniform."""

    lengths: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    loguniform: tuple[int, int] = ()
    source: str = DEFAULT_LENGTHS

    def sampler(self, rng: random.Random):
        if self.loguniform:
            low, high = self.loguniform
            return lambda: int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))
        cumulative, total = [], 0.0
        for weight in self.weights:
            total += weight
            cumulative.append(total)
        return lambda: self.lengths[min(bisect.bisect_left(cumulative, rng.random() * total), len(self.lengths) - 1)]

    def to_dict(self) -> dict[str, Any]:
        if self.loguniform:
            return {"loguniform": list(self.loguniform), "source": self.source}
        return {"lengths": list(self.lengths), "weights": list(self.weights), "source": self.source}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DocumentLengths":
        if data.get("loguniform"):
            return cls(loguniform=tuple(data["loguniform"]), source=data.get("source", DEFAULT_LENGTHS))
        return cls(lengths=tuple(data["lengths"]), weights=tuple(data["weights"]), source=data.get("source", ""))

    def describe(self) -> str:
        if self.loguniform:
            return f"document lengths log-uniform from {self.loguniform[0]:,} to {self.loguniform[1]:,} tokens " \
                   f"(the default assumption; {LENGTHS_FLAG} FILE for yours)"
        mean = sum(l * w for l, w in zip(self.lengths, self.weights)) / sum(self.weights)
        return f"document lengths from {self.source} ({len(self.lengths):,} distinct, mean {mean:,.0f} tokens)"


def _loguniform(text: str) -> DocumentLengths:
    parts = text.split(":")
    try:
        low, high = int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        low = high = 0
    if len(parts) != 3 or not 0 < low <= high:
        raise UsageError(f"{text!r}: write loguniform:LOW:HIGH with 0 < LOW <= HIGH tokens")
    return DocumentLengths(loguniform=(low, high), source=text)


def read_document_lengths(text: str) -> DocumentLengths:
    """--doc-lengths: `loguniform:LOW:HIGH`, or a file: one length per document (numbers separated by
    spaces, commas or new lines, or a JSON list), or a JSON histogram {"length": count, ...}."""
    text = str(text).strip()
    if text.startswith("loguniform:"):
        return _loguniform(text)
    path = Path(text)
    try:
        raw = path.read_text()
    except OSError as exc:
        raise UsageError(f"{text!r}: cannot read it ({exc.strerror or exc}); give a file of document "
                         "lengths or loguniform:LOW:HIGH") from None
    try:
        data = json.loads(raw)
    except ValueError:
        data = raw.replace(",", " ").split()
    pairs: dict[int, float] = {}
    try:
        items = data.items() if isinstance(data, dict) else ((value, 1) for value in data)
        for length, count in items:
            value, count = float(length), float(count)
            if value < 1 or count < 0 or value != int(value):
                raise ValueError
            pairs[int(value)] = pairs.get(int(value), 0.0) + count
    except (TypeError, ValueError):
        raise UsageError(f"{text!r}: not a list of positive whole token counts or a JSON histogram "
                         '{"length": count}') from None
    if not pairs or sum(pairs.values()) <= 0:
        raise UsageError(f"{text!r}: no document lengths in it")
    ordered = sorted(pairs)
    return DocumentLengths(lengths=tuple(ordered), weights=tuple(pairs[k] for k in ordered), source=text)


@dataclass(frozen=True)
class Packing:
    """The problem's packed batches: whole documents of `lengths` in each micro-batch of up to the budget."""

    lengths: DocumentLengths = DocumentLengths(loguniform=(64, 8192))

    def to_dict(self) -> dict[str, Any]:
        return {"document_lengths": self.lengths.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "Packing | None":
        if not data:
            return None
        return cls(lengths=DocumentLengths.from_dict(data["document_lengths"]))

    def key(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def describe(self, budget: int, seq_len: int) -> str:
        stats = self.stats(budget, seq_len)
        return (f"packed batches of up to {budget:,} tokens ({budget // seq_len} x --seq-len {seq_len:,}, the longest "
                f"document), {self.lengths.describe()}: {stats.fill:.1%} filled in expectation "
                f"({stats.tokens:,.0f} tokens, {stats.documents:.1f} documents per micro-batch)")

    def worst_case_documents(self, budget: int, seq_len: int, *, seed: int = SEED) -> tuple[int, ...]:
        """Document lengths of a micro-batch filled to exactly `budget` tokens: drawn from the distribution
        (each cut to seq_len), the last cut to fill the row. What the trace and a real trial both run."""
        rng = random.Random(seed)
        draw = self.lengths.sampler(rng)
        documents, left = [], budget
        while left:
            length = min(max(1, draw()), seq_len, left)
            documents.append(length)
            left -= length
        return tuple(documents)

    def stats(self, budget: int, seq_len: int) -> "PackingStats":
        return _stats(self.lengths, budget, seq_len)


@dataclass(frozen=True)
class PackingStats:
    budget: int
    tokens: float
    """Expected tokens per micro-batch (whole documents only)."""
    tokens_std: float
    squares: float
    """Expected sum of squared document lengths per micro-batch (attention's work)."""
    documents: float

    @property
    def fill(self) -> float:
        return self.tokens / self.budget

    def to_dict(self) -> dict[str, Any]:
        return {"expected_tokens_per_micro_batch": round(self.tokens, 1), "fill": round(self.fill, 4),
                "tokens_per_micro_batch_std": round(self.tokens_std, 1),
                "expected_sum_of_squared_lengths": round(self.squares), "documents_per_micro_batch": round(self.documents, 2)}


@functools.lru_cache(maxsize=256)
def _stats(lengths: DocumentLengths, budget: int, seq_len: int) -> PackingStats:
    """Greedy packing in arrival order, documents never split, each cut to seq_len; SAMPLES micro-batches."""
    rng = random.Random(SEED)
    draw = lengths.sampler(rng)
    tokens, squares, counts = [], [], []
    pending = None
    for _ in range(SAMPLES):
        row, square, count = 0, 0, 0
        while True:
            length = pending if pending is not None else min(max(1, draw()), seq_len, budget)
            pending = None
            if row + length > budget:
                pending = length  # opens the next micro-batch
                break
            row, square, count = row + length, square + length * length, count + 1
        tokens.append(row)
        squares.append(square)
        counts.append(count)
    mean = sum(tokens) / SAMPLES
    std = math.sqrt(sum((t - mean) ** 2 for t in tokens) / SAMPLES)
    return PackingStats(budget=budget, tokens=mean, tokens_std=std, squares=sum(squares) / SAMPLES,
                        documents=sum(counts) / SAMPLES)


def packed_seconds_ratio(*, attention_share: float, stats: PackingStats, traced_squares: int) -> float:
    """An expected micro-batch's time over the traced (filled) one's: attention's share of the step scales
    with the sum of squared document lengths, the rest with the tokens (fill)."""
    share = min(max(attention_share, 0.0), 1.0)
    return (1 - share) * stats.fill + share * (stats.squares / max(traced_squares, 1))


def resolve_packing(token_budget: int | str | None, doc_lengths: DocumentLengths | None, *,
                    seq_len: int) -> tuple[Packing | None, int | None]:
    """(the problem's packing or None, the budget in units of seq_len or None where searched) from
    --token-budget (`search`, or a count of tokens: a multiple of --seq-len, the longest document) and
    --doc-lengths (parsed: read_document_lengths)."""
    if token_budget is None:
        if doc_lengths is not None:
            raise UsageError(f"{LENGTHS_FLAG} describes packed batches: give {FLAG} too (search, or a count of tokens)")
        return None, None
    packing = Packing(doc_lengths) if doc_lengths is not None else Packing()
    if token_budget == "search":
        return packing, None
    if token_budget % seq_len:
        below, above = token_budget // seq_len * seq_len, (token_budget // seq_len + 1) * seq_len
        raise UsageError(f"{FLAG} {token_budget:,} is not a multiple of --seq-len {seq_len:,} (the longest document, "
                         f"what packed rows come in): use {', '.join(f'{t:,}' for t in (below, above) if t)}")
    return packing, token_budget // seq_len


def packing_section(spec) -> dict[str, Any]:
    """best.json's and trial's `packing`: the budget, the assumption in words, and what the figures rest on."""
    budget, seq_len = spec.token_budget, spec.seq_len
    stats = spec.packing.stats(budget, seq_len)
    return {"token_budget": budget, "max_document_tokens": seq_len, "document_lengths": spec.packing.lengths.to_dict(),
            "assumption": spec.packing.describe(budget, seq_len), **stats.to_dict(),
            "memory": f"predicted for a micro-batch filled to the budget ({len(spec.documents)} documents drawn from the "
                      "distribution, the last cut to fill it), attention within each document (varlen): no mask",
            "throughput": "estimated at the expected fill, attention at the expected sum of squared document lengths"}


def check_packing_problem(*, stack: str, config: dict[str, Any], model_name: str) -> None:
    """A token budget runs on autotune's own step (fsdp2) for models whose attention is plain causal."""
    if stack != "fsdp2":
        raise UsageError(f"{FLAG} with --stack {stack}: packed token budgets are traced on autotune's own step only "
                         "(--stack fsdp2; --stack trl-padding-free is TRL's own packing)")
    text = config.get("text_config") or config
    if text.get("sliding_window") and text.get("use_sliding_window", True) is not False:
        raise UsageError(f"{FLAG}: {model_name} uses sliding-window attention, which the per-document attention "
                         "here does not apply: tune it without --token-budget")
    for key in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if text.get(key):
            raise UsageError(f"{FLAG}: {model_name} soft-caps attention logits, which the per-document attention "
                             "here does not apply: tune it without --token-budget")
