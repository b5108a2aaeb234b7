"""Never a silent no-op: the one line that says why this process is not instrumented.

Printed on stderr, once per process::

    otel-training: not instrumenting: <cause>; <fix>

by the pre-instrument check (preflight.py), the instrumentor when setting up fails,
the manual API, and a framework integration that fails to load. Only the standard
library is imported here.
"""

from __future__ import annotations

import sys

INTEGRATIONS_FIX = "steps are still timed by the torch hooks; OTEL_TRAINING_INTEGRATIONS chooses which to load"

_said = False


def not_instrumenting(cause: str, fix: str) -> None:
    """Print the one line (once per process)."""
    global _said
    if _said:
        return
    _said = True
    try:
        print(f"otel-training: not instrumenting: {cause}; {fix}", file=sys.stderr, flush=True)
    except Exception:  # a closed stderr: nothing left to tell
        pass


def described(exc: BaseException) -> str:
    """``Type: first line of the message``, for the one line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
