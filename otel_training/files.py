"""Output files we write at exit (the run summary, the trace file): checked at start."""

from __future__ import annotations

import os
import tempfile


def expand(template: str, rank: int | None) -> str:
    """``{rank}`` and ``{pid}`` in a file name; a rank not known is ``unknown-<pid>``,
    never a 0 another process may write too."""
    pid = str(os.getpid())
    return template.replace("{rank}", f"unknown-{pid}" if rank is None else str(rank)).replace("{pid}", pid)


def check_writable(path: str) -> None:
    """Raise ``OSError`` now, not after the run, if ``path`` cannot be written; a
    missing folder is created."""
    if os.path.isdir(path):
        raise IsADirectoryError(21, "Is a directory")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".otel-training-probe-"):
        pass
