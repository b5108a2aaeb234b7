"""Counts in words: every count we print agrees with its noun (``1 gap``, ``2 gaps``)."""

from __future__ import annotations


def plural(n: float, word: str, many: str | None = None) -> str:
    """``n`` and ``word``, its plural (``many``, else ``word + "s"``) unless ``n`` is 1."""
    count = f"{n:,}" if isinstance(n, int) else f"{n:,.0f}"
    return f"{count} {word if count == '1' else (many or word + 's')}"


def timing_words(timing: str | None, device: str | None = None) -> str:
    """How a run's step times were taken, in words (``training.timing`` and the run's
    device): ``off`` on a CPU run is the host clock, with no GPU to time, not a switch."""
    if timing == "events":
        return "GPU timing: CUDA events"
    if timing == "sync":
        return "GPU timing: synchronized"
    if not timing:
        return ""
    if device == "cuda":
        return "host clock timing (GPU timing off)"
    if device in (None, "cpu"):
        return "host clock timing (CPU run: no GPU to time)" if device == "cpu" else "host clock timing"
    return f"host clock timing ({device}: no GPU timing)"
