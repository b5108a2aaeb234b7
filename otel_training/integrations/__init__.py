"""Framework integrations: PyTorch Lightning and the Hugging Face ``Trainer``.

The instrumentor calls ``enable(config, runtime)``; for each name in
``config.integrations`` a ``wrapt`` post-import hook patches the framework when it
is imported (at once if it already is). Nothing here imports a framework itself.
Each integration drives steps from the framework's loop (``start_step(driver=...)``)
and times every overridden callback hook as a user phase named
``callback.<CallbackClass>.<hook>`` (see docs/telemetry.md).
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any

import wrapt

from otel_training.handles import Undo
from otel_training.integrations._bridge import Bridge

# integration name -> (module under otel_training.integrations, framework modules to hook)
INTEGRATIONS: dict[str, tuple] = {
    "lightning": ("lightning", ("lightning.pytorch", "pytorch_lightning")),
    "transformers": ("transformers", ("transformers.trainer", "accelerate.data_loader")),
}

_lock = threading.Lock()
_registered: set = set()  # (integration, framework module) with a post-import hook
_active: dict[str, Any] = {}  # integration name -> its Integration object


def _provider(runtime_or_provider: Any) -> Callable[[], Any]:
    if callable(runtime_or_provider) and not hasattr(runtime_or_provider, "tracker"):
        return runtime_or_provider
    return lambda: runtime_or_provider


def enable(config: Any, runtime_or_provider: Any) -> Undo:
    """Arm the integrations named in ``config.integrations``; the handle disables them.

    ``runtime_or_provider`` is the Runtime (with ``.tracker`` and ``.on_error``), or a
    callable returning the Runtime or Tracker in use (None while off).
    """
    names = tuple(getattr(config, "integrations", ()) or ())
    provider = _provider(runtime_or_provider)
    with _lock:
        for name in names:
            if name not in INTEGRATIONS or name in _active:
                continue
            mod_name, targets = INTEGRATIONS[name]
            try:
                module = importlib.import_module(f"otel_training.integrations.{mod_name}")
                integ = module.Integration(Bridge(provider, driver=name))
            except Exception as exc:  # the others still load; the torch hooks still time steps
                unavailable(name, exc)
                continue
            _active[name] = integ
            for target in targets:
                if (name, target) in _registered:
                    if target in sys.modules:  # hook already fired in an earlier enable()
                        _patch(name, sys.modules[target])
                    continue
                _registered.add((name, target))
                wrapt.register_post_import_hook(_hook(name), target)
    # wrapt cannot unregister a post-import hook: once disabled, it does nothing.
    return Undo(disable, "integrations")


def _hook(name: str) -> Callable[[Any], None]:
    def on_import(module: Any) -> None:
        _patch(name, module)

    return on_import


def _patch(name: str, module: Any) -> None:
    integ = _active.get(name)
    if integ is None:
        return  # disabled since the hook was registered
    try:
        integ.patch(module)
    except Exception as exc:  # never break the user's import
        unavailable(name, exc)  # the one line; counted without a second
        integ.bridge.error(exc, said=True)


def unavailable(name: str, exc: BaseException) -> None:
    """The one line (``runtime.notice.not_instrumenting``) for an integration that failed to load."""
    from otel_training.runtime.notice import INTEGRATIONS_FIX, described, not_instrumenting

    not_instrumenting(f"the {name} integration failed to load ({described(exc)})", INTEGRATIONS_FIX)


def disable() -> None:
    """Undo every patch; post-import hooks stay registered but do nothing."""
    with _lock:
        for integ in list(_active.values()):
            try:
                integ.unpatch()
            except Exception as exc:  # pragma: no cover
                integ.bridge.error(exc)
        _active.clear()
