"""Counts in words: every count we print agrees with its noun (``1 gap``, ``2 gaps``)."""

from __future__ import annotations


def plural(n: float, word: str, many: str | None = None) -> str:
    """``n`` and ``word``, its plural (``many``, else ``word + "s"``) unless ``n`` is 1."""
    count = f"{n:,}" if isinstance(n, int) else f"{n:,.0f}"
    return f"{count} {word if count == '1' else (many or word + 's')}"
