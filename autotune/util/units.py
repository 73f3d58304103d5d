"""Parsing of human-sized numbers: token counts and byte sizes."""

from __future__ import annotations

import re

from autotune.util.errors import UsageError

_DECIMAL = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_BINARY = {"KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
_NUMBER = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?)?\s*$", re.IGNORECASE)


def parse_count(text: str | int, *, what: str = "value") -> int:
    """'4M' -> 4_000_000, '4Mi' -> 4_194_304, '4_000_000' -> 4_000_000, '1.5K' -> 1500.

    Decimal suffixes K/M/G/T are powers of 1000, binary Ki/Mi/Gi/Ti powers of 1024.
    The result must be a whole number.
    """
    if isinstance(text, int):
        return text
    cleaned = str(text).replace("_", "").replace(",", "")
    match = _NUMBER.match(cleaned)
    if not match:
        raise UsageError(
            f"cannot parse {what} {text!r}: use an integer with an optional suffix, "
            "e.g. 4M (4,000,000), 4Mi (4,194,304) or 4_000_000"
        )
    number, suffix = match.group(1), (match.group(2) or "").upper()
    scale = _BINARY.get(suffix) or _DECIMAL[suffix]
    # Exact arithmetic: '1.5K' is 1500, '0.3' is not an integer.
    whole, _, frac = number.partition(".")
    numerator = int(whole + frac) * scale
    denominator = 10 ** len(frac)
    if numerator % denominator:
        raise UsageError(f"{what} {text!r} is not a whole number")
    return numerator // denominator


def parse_bytes(text: str | int, *, what: str = "memory") -> int:
    """Byte sizes: '80GiB', '80GB', '80G' (decimal), '80Gi' (binary), or a plain integer."""
    if isinstance(text, int):
        return text
    cleaned = str(text).strip()
    if cleaned.upper().endswith("B"):
        cleaned = cleaned[:-1]
    try:
        return parse_count(cleaned, what=what)
    except UsageError:
        raise UsageError(f"cannot parse {what} {text!r}: use a size such as 40GiB, 80GB or 512MiB") from None


def format_bytes(num_bytes: float | None) -> str:
    """Binary units, scaled to the size: 36.64 GiB, 2.31 MiB, 812 B."""
    if num_bytes is None:
        return "-"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def format_count(value: float | None) -> str:
    """Decimal units for counts: 6.74 B, 7.26 M, 950."""
    if value is None:
        return "-"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f}"
