"""Which process this is, and holding the set-up of spawned children until we know.

Under ``opentelemetry-instrument`` every Python process runs ``sitecustomize``:
multiprocessing ``spawn`` children (DataLoader workers, ranks started by
``torch.multiprocessing.spawn``) and helpers (the forkserver, the resource tracker)
included. A spawned child only learns what it runs once its process object arrives
from the parent, after ``sitecustomize``. So in a spawned child the distro *holds*
everything: no defaults applied, no SDK configured, no instrumentor loaded (not even
imported), no thread started. When the process object arrives
(``multiprocessing.process.BaseProcess._bootstrap``, patched once and put back at once):

* a DataLoader worker (target ``torch.utils.data._utils.worker._worker_loop``): the
  held set-up is dropped; the worker runs as if uninstrumented;
* anything else (a ``torch.multiprocessing.spawn`` rank, a ``ProcessPoolExecutor``
  worker, ...): the held set-up runs then, in the order ``opentelemetry-instrument``
  would have run it (distro, configurator, instrumentors), before the target starts.

A helper process holds for good: it runs no user code of its own.

Only the standard library is imported here (the runtime package's ``__init__`` imports
nothing until used): this module runs in every child.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

ROLE_SPAWN = "spawn"  # a multiprocessing "spawn" child: a DataLoader worker or a rank
ROLE_HELPER = "helper"  # the forkserver or the resource tracker: never instrumented

_logger = logging.getLogger("otel_training")
_LOAD_LOGGER = "opentelemetry.instrumentation.auto_instrumentation._load"

# Hold states.
_NONE = None  # nothing held: set up as usual
HELD = "held"  # spawned child, process object not arrived yet
WORKER = "worker"  # a DataLoader worker: held set-up dropped, nothing runs
RELEASED = "released"  # another spawned process: the held set-up ran
HELPER = "helper"  # forkserver / resource tracker: held for good

_state: str | None = _NONE
_distro: Any = None
_configurators: list[tuple[Any, dict]] = []
_instrumentors: list[tuple[Any, dict]] = []
_original_bootstrap: Any = None


def _argv(argv: Sequence[str] | None) -> list[str]:
    if argv is None:
        argv = getattr(sys, "orig_argv", None) or sys.argv
    return list(argv)


def multiprocessing_role(argv: Sequence[str] | None = None) -> str | None:
    """What multiprocessing started this interpreter as, from its command line.

    ``spawn`` children run ``-c 'from multiprocessing.spawn import spawn_main; ...'
    --multiprocessing-fork``; the forkserver and the resource tracker run
    ``-c 'from multiprocessing.forkserver import main; ...'`` /
    ``'from multiprocessing.resource_tracker import main; ...'``. Each runs
    ``sitecustomize`` (so ``opentelemetry-instrument``) again.
    """
    argv = _argv(argv)
    code = ""
    if "-c" in argv:
        i = argv.index("-c")
        code = argv[i + 1] if i + 1 < len(argv) else ""
    if "multiprocessing.spawn" in code or "--multiprocessing-fork" in argv:
        return ROLE_SPAWN
    if code.lstrip().startswith("from multiprocessing."):
        return ROLE_HELPER
    return None


def is_spawn_child(argv: Sequence[str] | None = None) -> bool:
    """Started by multiprocessing's ``spawn`` (its command line always ends with
    ``--multiprocessing-fork``): the process object will arrive."""
    return "--multiprocessing-fork" in _argv(argv)


def is_dataloader_worker(process: Any) -> bool:
    """``process`` runs torch's DataLoader worker loop."""
    target = getattr(process, "_target", None)
    return getattr(target, "__name__", None) == "_worker_loop" and str(
        getattr(target, "__module__", "") or ""
    ).startswith("torch.utils.data")


# -- holding -------------------------------------------------------------------------------


def state() -> str | None:
    return _state


def holding() -> bool:
    """Set-up is held: the configurator and the instrumentors must only record."""
    return _state in (HELD, HELPER)


def released() -> bool:
    """A spawned child that is no DataLoader worker, set up once its process object arrived."""
    return _state == RELEASED


def hold(distro: Any) -> bool:
    """Called by the distro first thing under ``opentelemetry-instrument``: in a
    spawned child, hold the set-up until the process object arrives; in a helper,
    for good. True if held (the distro then does nothing more now)."""
    global _state, _distro
    if _state is not _NONE:
        return holding()
    if is_spawn_child():
        try:
            _patch_bootstrap()
        except Exception as exc:  # cannot tell a worker from a rank: set up as before
            _logger.debug("otel-training: cannot watch the process object: %r", exc)
            return False
        _state, _distro = HELD, distro
        return True
    if multiprocessing_role() == ROLE_HELPER:
        _state, _distro = HELPER, distro
        return True
    return False


def hold_configurator(configurator: Any, kwargs: dict) -> None:
    _configurators.append((configurator, dict(kwargs)))


def hold_instrumentor(entry_point: Any, kwargs: dict) -> None:
    _instrumentors.append((entry_point, dict(kwargs)))


def reset() -> None:
    """Forget everything held and put ``_bootstrap`` back (tests)."""
    global _state, _distro
    _unpatch_bootstrap()
    _state, _distro = _NONE, None
    _configurators.clear()
    _instrumentors.clear()


# -- the process object arrives -----------------------------------------------------------


def _patch_bootstrap() -> None:
    global _original_bootstrap
    from multiprocessing import process

    if _original_bootstrap is not None:
        return
    original = process.BaseProcess.__dict__["_bootstrap"]

    def _bootstrap(self, *args, **kwargs):
        try:
            decide(self)
        except Exception as exc:  # never stand between the child and its target
            _logger.debug("otel-training: set-up in the spawned child failed: %r", exc)
        return original(self, *args, **kwargs)

    _bootstrap._otel_training_original = original  # type: ignore[attr-defined]
    _original_bootstrap = original
    process.BaseProcess._bootstrap = _bootstrap  # type: ignore[attr-defined]


def _unpatch_bootstrap() -> None:
    global _original_bootstrap
    original, _original_bootstrap = _original_bootstrap, None
    if original is None:
        return
    from multiprocessing import process

    current = process.BaseProcess.__dict__.get("_bootstrap")
    if getattr(current, "_otel_training_original", None) is original:
        process.BaseProcess._bootstrap = original  # type: ignore[attr-defined]


def decide(process: Any) -> None:
    """The process object arrived: a DataLoader worker stays off, anything else is
    set up now (what ``opentelemetry-instrument`` held). ``_bootstrap`` is put back
    first: the patch lives for one call."""
    global _state
    _unpatch_bootstrap()
    if _state != HELD:
        return
    if is_dataloader_worker(process):
        _state = WORKER
        _drop()
        _silence_foreign_sdk()
        return
    _state = RELEASED
    _release()


def _drop() -> None:
    global _distro
    _distro = None
    _configurators.clear()
    _instrumentors.clear()


def _release() -> None:
    """Run what was held, as ``opentelemetry-instrument``'s ``initialize()`` would
    have: the distro, the configurator(s), the instrumentors; each failure logged
    (as there), none raised."""
    global _distro
    distro, configurators, instrumentors = _distro, list(_configurators), list(_instrumentors)
    _drop()
    log = logging.getLogger(_LOAD_LOGGER)
    if distro is not None:
        try:
            distro.configure()
        except Exception:
            log.exception("Failed to auto initialize OpenTelemetry")
            return
    for configurator, kwargs in configurators:
        try:
            configurator.configure(**kwargs)
        except Exception:
            log.exception("Configuration of %s failed", type(configurator).__name__)
            return
    for entry_point, kwargs in instrumentors:
        try:
            distro.load_instrumentor(entry_point, **kwargs)
        except ImportError:
            log.exception("Importing of %s failed, skipping it", getattr(entry_point, "name", entry_point))
        except Exception:
            log.exception("Instrumenting of %s failed", getattr(entry_point, "name", entry_point))


def _silence_foreign_sdk() -> None:
    """A DataLoader worker whose SDK another configurator set up while ours held
    (``OTEL_PYTHON_CONFIGURATOR`` unset with a second distro installed): stop its export
    threads here, as ``disable_in_child`` does. Nothing to do (and nothing imported)
    when the SDK was never loaded."""
    if "opentelemetry.sdk.trace" not in sys.modules and "opentelemetry.sdk.metrics" not in sys.modules:
        return
    try:
        from opentelemetry import metrics, trace

        from otel_training.export.guard import ExportGuard
        from otel_training.export.selftelemetry import SelfTelemetry

        ExportGuard(SelfTelemetry()).attach(trace.get_tracer_provider(), metrics.get_meter_provider()).silence(0.5)
    except Exception as exc:  # pragma: no cover - best effort
        _logger.debug("otel-training: cannot silence the SDK in a worker: %r", exc)
