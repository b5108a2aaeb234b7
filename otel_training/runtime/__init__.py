"""The runtime: one ``Runtime`` per process wires config, tracker, hooks, pipeline and
hardware together (``active.py``); ``current()`` finds it.

- ``active.py``: ``Runtime`` (construction, install, uninstall, end of run), ``current()``;
- ``process_events.py``: fork, spawn, SIGTERM and the main thread's end;
- ``measures.py``: throughput, FLOPs and memory per step, wired into each stage;
- ``processes.py``: which process this is; holds a spawned child's set-up;
- ``notice.py``: the one line that says why this process is not instrumented.

``Runtime`` and ``current`` are imported when first used: the distro and the
pre-instrument check import ``processes`` in every process (DataLoader workers
included), and ``active`` pulls in the pipeline, torch and the SDK.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from otel_training.runtime.active import Runtime, current

__all__ = ["Runtime", "current"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from otel_training.runtime import active

        value = getattr(active, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
