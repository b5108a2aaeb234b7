"""Distro and configurator for ``opentelemetry-instrument``.

The distro only ``setdefault``s environment variables, so anything the user set
wins: OTLP exporters for traces and metrics, a metric export interval suited to
training dashboards, and resource attributes (``service.instance.id`` per process,
``training.run.id``). With ``opentelemetry-distro`` also installed, choose ours
with ``OTEL_PYTHON_DISTRO=otel_training`` and
``OTEL_PYTHON_CONFIGURATOR=otel_training``.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import uuid
from collections.abc import MutableMapping
from typing import Any
from urllib.parse import urlparse

from opentelemetry.instrumentation.distro import BaseDistro  # type: ignore[attr-defined]

from otel_training.runtime import processes
from otel_training.semconv import ATTR_HOST_NAME, ATTR_RUN_ID

METRIC_EXPORT_INTERVAL_MS = "5000"  # 5 s: dashboards see a step-time change quickly
# What this distro generated, as "<pid> key=value,...": a child process that inherits
# it (torchrun workers, multiprocessing spawn children) gets its own service.instance.id,
# and the torchrun run id in place of one its launcher made up.
_GENERATED = "_OTEL_TRAINING_GENERATED_RESOURCE"

# No exporter timeout is set here: the Python OTLP exporters read OTEL_EXPORTER_OTLP_TIMEOUT
# in seconds where the specification says milliseconds, so any value we chose would
# mean 1000x something else on an SDK that follows the specification. Exit is bounded
# by OTEL_TRAINING_SHUTDOWN_TIMEOUT instead (see docs/reliability.md).


def apply_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    from otel_training.export.identity import run_id

    environ.setdefault("OTEL_TRACES_EXPORTER", "otlp")
    environ.setdefault("OTEL_METRICS_EXPORTER", "otlp")
    environ.setdefault("OTEL_LOGS_EXPORTER", "none")
    environ.setdefault("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    environ.setdefault("OTEL_METRIC_EXPORT_INTERVAL", METRIC_EXPORT_INTERVAL_MS)
    # Exemplars link histogram buckets to the traces of sampled steps.
    environ.setdefault("OTEL_METRICS_EXEMPLAR_FILTER", "trace_based")
    # Our hardware gauges cover the system-metrics instrumentation's host set under the
    # same semantic-convention names (system.cpu.utilization, ...) with other labels:
    # both at once would give clashing series, so it is off unless asked for.
    environ.setdefault("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "system_metrics")
    # torch.profiler's Kineto logs every start and stop of a profile (docs/profiles.md) to
    # stderr, and a failed GPU query on a machine without one; its level is read when
    # torch loads, so it is set here, before the script imports torch. 6: none.
    if environ.get("OTEL_TRAINING_PROFILE", "").strip().lower() != "off":
        environ.setdefault("KINETO_LOG_LEVEL", "6")
    original = environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    attrs = _drop_inherited(original, environ)
    present = {kv.split("=", 1)[0].strip() for kv in attrs.split(",") if "=" in kv}
    extra = []
    if "service.instance.id" not in present:
        extra.append(f"service.instance.id={uuid.uuid4()}")
    if ATTR_HOST_NAME not in present:
        extra.append(f"{ATTR_HOST_NAME}={socket.gethostname()}")
    if ATTR_RUN_ID not in present:
        extra.append(f"{ATTR_RUN_ID}={run_id()}")
    if extra:
        attrs = ",".join(([attrs] if attrs.strip() else []) + extra)
        mine = [kv for kv in extra if not kv.startswith(ATTR_HOST_NAME + "=")]
        environ[_GENERATED] = f"{os.getpid()} " + ",".join(mine)
    if attrs != original:
        environ["OTEL_RESOURCE_ATTRIBUTES"] = attrs


def _drop_inherited(attrs: str, environ: MutableMapping[str, str]) -> str:
    """Remove resource attributes a parent process's distro generated that must not be
    shared: its ``service.instance.id`` (one per process), and its ``training.run.id``
    when torchrun names the run. Values the user set are never touched."""
    pid, _, generated = environ.get(_GENERATED, "").partition(" ")
    if not generated or pid == str(os.getpid()):
        return attrs
    drop = set()
    for kv in generated.split(","):
        key, _, value = kv.partition("=")
        if key == "service.instance.id":
            drop.add((key, value))
        elif key == ATTR_RUN_ID and environ.get("TORCHELASTIC_RUN_ID", value) != value:
            drop.add((key, value))
    kept = [kv for kv in attrs.split(",") if (kv.split("=", 1)[0].strip(), kv.split("=", 1)[-1].strip()) not in drop]
    return ",".join(kept)


def _prepare_process(environ: MutableMapping[str, str] = os.environ) -> None:
    """Under ``opentelemetry-instrument`` every Python process runs this, helpers included.

    The multiprocessing forkserver and resource tracker export nothing; and a malformed
    ``OTEL_TRAINING_*`` value stops the run with one line, before anything starts.
    """
    if processes.multiprocessing_role() == processes.ROLE_HELPER:
        for var in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_LOGS_EXPORTER"):
            environ[var] = "none"
        return
    from otel_training.config import ConfigError, load_config

    try:
        load_config(environ)
    except ConfigError as exc:
        stop_on_config_error(exc)
    check_endpoints(environ)


_HOST_PORT = re.compile(r"(?:[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}")


def endpoint_problem(value: str, protocol: str) -> str | None:
    """Why an OTLP endpoint cannot work (None if it can): a URL with an http(s) scheme,
    a host and a valid port -- or, for gRPC, also a bare ``host:port``."""
    v = value.strip()
    if not v or any(c.isspace() for c in v):
        return "blank" if not v else "contains spaces"
    try:
        parsed = urlparse(v)
        _ = parsed.port  # raises ValueError for a port out of range
    except ValueError:
        return "bad port"
    if "://" in v:
        if parsed.scheme not in ("http", "https"):
            return f"scheme {parsed.scheme!r}"
        return None if parsed.hostname else "no host"
    if protocol == "grpc" and _HOST_PORT.fullmatch(v):
        return None
    return "not a URL"


def check_endpoints(environ: MutableMapping[str, str] = os.environ) -> None:
    """A malformed OTLP endpoint: one line that names it, then export nothing for the
    signals it serves (instead of an error from the exporter at every export); training
    and the run-end summary are unaffected."""
    protocol = environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc").strip()
    for var, signals in (
        ("OTEL_EXPORTER_OTLP_ENDPOINT", ("TRACES", "METRICS")),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", ("TRACES",)),
        ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", ("METRICS",)),
    ):
        value = environ.get(var)
        if value is None:
            continue
        used = [
            sig
            for sig in signals
            if environ.get(f"OTEL_{sig}_EXPORTER", "otlp").strip() == "otlp"
            and (var != "OTEL_EXPORTER_OTLP_ENDPOINT" or f"OTEL_EXPORTER_OTLP_{sig}_ENDPOINT" not in environ)
        ]
        if not used:
            continue
        proto = environ.get(f"OTEL_EXPORTER_OTLP_{used[0]}_PROTOCOL", protocol).strip()
        if endpoint_problem(value, proto) is None:
            continue
        example = "http://localhost:4317" if proto == "grpc" else "http://localhost:4318"
        what = " and ".join(sig.lower() for sig in used)
        print(
            f"otel-training: {var}={value!r} is not valid: use a URL such as {example} "
            f"({what} will not be exported; training continues)",
            file=sys.stderr,
            flush=True,
        )
        for sig in used:
            environ[f"OTEL_{sig}_EXPORTER"] = "none"


def _in_sitecustomize() -> bool:
    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "sitecustomize":
            return True
        frame = frame.f_back
    return False


def stop_on_config_error(exc: BaseException) -> None:
    """Print the one line that names the variable and what it accepts, then stop (status 2).

    Under ``opentelemetry-instrument`` this runs inside ``sitecustomize``, where
    ``SystemExit`` makes Python report a fatal error with a traceback: leave with
    ``os._exit`` there (nothing has started yet); elsewhere raise ``SystemExit``.
    """
    print(f"otel-training: {exc}", file=sys.stderr, flush=True)
    if _in_sitecustomize():
        try:
            sys.stdout.flush()
        finally:
            os._exit(2)
    raise SystemExit(2) from None


class TrainingDistro(BaseDistro):
    """``opentelemetry_distro`` entry point: sensible defaults for training jobs.

    In a multiprocessing ``spawn`` child it holds everything (see
    ``otel_training.runtime.processes``): a DataLoader worker then sets up nothing at all,
    another spawned process (a ``torch.multiprocessing.spawn`` rank) is set up as
    usual once its process object arrives. A helper (forkserver, resource tracker)
    holds for good.
    """

    def _configure(self, **kwargs):
        if processes.hold(self):
            if processes.state() == processes.HELPER:
                _prepare_process()  # exporters off, for a configurator that is not ours
            return
        _prepare_process()
        apply_defaults()

    def load_instrumentor(self, entry_point, **kwargs):
        if processes.holding():
            processes.hold_instrumentor(entry_point, kwargs)  # not even imported
            return
        super().load_instrumentor(entry_point, **kwargs)


def _sdk_configurator():
    """The SDK's standard configurator class, imported when first needed: the SDK's
    import is what a held child must not pay."""
    from otel_training.export.sdk import standard_configurator

    return standard_configurator()


class TrainingConfigurator:
    """``opentelemetry_configurator`` entry point: the SDK's standard set-up
    (``_OTelSDKConfigurator``), held in a spawned child until it is known to be no
    DataLoader worker."""

    def configure(self, **kwargs):
        if processes.holding():
            processes.hold_configurator(self, kwargs)
            return
        _sdk_configurator()().configure(**kwargs)


def configure_sdk() -> None:
    """Set up the SDK as ``opentelemetry-instrument`` would (used by ``instrument()``)."""
    apply_defaults()
    check_endpoints()
    _sdk_configurator()().configure()
