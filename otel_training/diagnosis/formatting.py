"""Numbers and tables as we print them: shares, milliseconds, SI units, byte sizes."""

from __future__ import annotations

BAR = 20


def share_pct(x: float | None, sign: bool = False) -> str:
    """``12.3%`` (``sign``: ``+12.3%``); ``-`` for none."""
    if x is None:
        return "-"
    return f"{100 * x:+.1f}%" if sign else f"{100 * x:.1f}%"


def ms(x: float | None, unit: bool = False) -> str:
    """Seconds as milliseconds, ``12.3`` (``unit``: ``1,234.5 ms``); ``-`` for none."""
    if x is None:
        return "-"
    return f"{1e3 * x:,.1f} ms" if unit else f"{1e3 * x:.1f}"


def table(headers: list[str], rows: list[list[str]], right: set, indent: str = "  ") -> list[str]:
    """Aligned columns, headers first; the columns in ``right`` right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def fmt(cells):
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return (indent + "  ".join(out)).rstrip()

    return [fmt(headers)] + [fmt(r) for r in rows]


def bar(share: float) -> str:
    """``#####...............``: a share as a bar ``BAR`` characters wide."""
    n = max(0, min(BAR, int(round(share * BAR))))
    return "#" * n + "." * (BAR - n)


def si(x: float, unit: str) -> str:
    """``1.51 GFLOP``, ``989 TFLOP/s``."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def byte_size(n: float | None) -> str:
    """``12.3 GiB``; ``-`` for none."""
    if n is None:
        return "-"
    for factor, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n:.0f} B"
