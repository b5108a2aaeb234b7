"""Before ``opentelemetry-instrument`` loads us: the one line that says why this process
will not be instrumented (runtime/notice.py), instead of the loader's silence.

``opentelemetry-instrument`` skips an instrumentor whose ``instruments`` requirement is
not met (torch missing or older than our floor) or whose import fails, and says so in
its own logger, at DEBUG or as a traceback. ``check`` runs first, from the
``opentelemetry_pre_instrument`` entry point, and prints instead, on stderr::

    otel-training: not instrumenting: <cause>; <fix>

It uses the loader's own dependency check, so the two always agree, and holds back
the loader's record of skipping us until ``release`` (``opentelemetry_post_instrument``).
A deliberate off (``OTEL_TRAINING_ENABLED=false``, ``training`` or ``*`` in
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS``) stays quiet, and so do processes that run
no training of their own (a held spawn child, the multiprocessing helpers, a rank other
than 0). Only the standard library is imported at module level: this runs in every
process started under ``opentelemetry-instrument``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from otel_training.package import TORCH_FLOOR, _instruments

ENTRY_POINT = "training"  # our name in the opentelemetry_instrumentor group
SUPPORTED = f"torch >= {TORCH_FLOOR}"
_LOAD_LOGGER = "opentelemetry.instrumentation.auto_instrumentation._load"


def deliberately_off(environ: Mapping[str, str] = os.environ) -> bool:
    """The user turned us off: nothing to say."""
    if environ.get("OTEL_TRAINING_ENABLED", "").strip().lower() in ("0", "false", "no", "off"):
        return True
    disabled = {x.strip() for x in environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "").split(",")}
    return bool({ENTRY_POINT, "*"} & disabled)


def _speaks(environ: Mapping[str, str]) -> bool:
    """Whether this process is the one to tell: not a spawned child still held (its
    parent already said it), not a multiprocessing helper, not a rank other than 0."""
    from otel_training.runtime import processes

    if processes.multiprocessing_role() is not None:
        return False
    return environ.get("RANK", "0").strip() in ("", "0")


def torch_problem() -> tuple[str, str] | None:
    """(cause, fix) when the installed torch is outside the supported range, else None."""
    from importlib import metadata

    try:
        found = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "torch is not installed", f"install {SUPPORTED} in this environment"
    try:
        from opentelemetry.instrumentation.dependencies import get_dependency_conflicts

        supported = get_dependency_conflicts(list(_instruments)) is None
    except Exception:  # an instrumentation package without this helper: compare ourselves
        supported = _at_least(found, TORCH_FLOOR)
    if supported:
        return None
    return (
        f"torch {found} is outside the supported range ({SUPPORTED})",
        f"upgrade torch (pip install 'torch>={TORCH_FLOOR}'), or run without opentelemetry-instrument",
    )


def _at_least(found: str, floor: str) -> bool:
    def release(v: str) -> tuple[int, ...]:
        parts = []
        for p in v.split("+")[0].split("."):
            digits = "".join(c for c in p if c.isdigit()) if p[:1].isdigit() else ""
            if not digits:
                break
            parts.append(int(digits))
        return tuple(parts)

    return release(found) >= release(floor)


class _HideOurSkip(logging.Filter):
    """Drops the loader's own record of skipping or failing to import our entry point:
    our line has said it already."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        return not (
            message.startswith(f"{ENTRY_POINT} ")
            or f" {ENTRY_POINT} failed" in message
            or message == f"Skipping instrumentation {ENTRY_POINT}"
            or message.startswith(f"Skipping instrumentation {ENTRY_POINT}:")
        )


_filter: _HideOurSkip | None = None


def check(environ: Mapping[str, str] = os.environ) -> None:
    """``opentelemetry_pre_instrument``: say why the instrumentor will not run, if it
    will not. Never raises: this runs inside ``sitecustomize``."""
    global _filter
    try:
        if deliberately_off(environ) or not _speaks(environ):
            return
        from otel_training.runtime.notice import described, not_instrumenting

        problem = torch_problem()
        if problem is None:
            try:
                import otel_training.instrumentor  # noqa: F401  what the loader is about to load
            except Exception as exc:
                problem = (f"it cannot be imported ({described(exc)})", "reinstall otel-training")
        if problem is None:
            return
        not_instrumenting(*problem)
        _filter = _HideOurSkip()
        logging.getLogger(_LOAD_LOGGER).addFilter(_filter)
    except Exception:  # pragma: no cover - telling must never break the user's start-up
        pass


def release() -> None:
    """``opentelemetry_post_instrument``: stop hiding the loader's records."""
    global _filter
    if _filter is not None:
        logging.getLogger(_LOAD_LOGGER).removeFilter(_filter)
        _filter = None
