"""``otel-training agent``: hardware gauges without training instrumentation.

Sets up a MeterProvider with the OTLP metric exporter (standard ``OTEL_*`` variables
apply: ``OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT``/``PROTOCOL``/``HEADERS``/``TIMEOUT``,
``OTEL_METRIC_EXPORT_INTERVAL``, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``),
samples host and GPU hardware every ``--interval`` seconds and runs until SIGINT or
SIGTERM (or ``--duration`` seconds), then flushes within
``OTEL_TRAINING_SHUTDOWN_TIMEOUT``. Training processes started with otel-training on
the same host share its per-host lock, so host and GPU series are never duplicated.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid

from otel_training.config import ConfigError, load_config

PROG = "otel-training agent"
DEFAULT_PROTOCOL = "grpc"  # as the otel-training distro
DEFAULT_EXPORT_INTERVAL_MS = 5000.0  # as the otel-training distro

_logger = logging.getLogger("otel_training.cli.agent")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Export host and GPU hardware gauges over OTLP until interrupted (SIGINT/SIGTERM)."
    )
    parser.add_argument(
        "--interval",
        type=_positive,
        metavar="S",
        help="seconds between hardware samples (default: OTEL_TRAINING_HARDWARE_INTERVAL, else 1)",
    )
    parser.add_argument(
        "--duration", type=_positive, metavar="S", help="stop after S seconds (default: run until interrupted)"
    )
    return parser


def _resource(environ=os.environ):
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create()  # detectors, OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
    attrs = resource.attributes
    defaults = {}
    if not environ.get("OTEL_SERVICE_NAME") and str(attrs.get("service.name", "")).startswith("unknown_service"):
        defaults["service.name"] = "otel-training-agent"
    if not attrs.get("host.name"):
        defaults["host.name"] = socket.gethostname()
    if not attrs.get("service.instance.id"):
        defaults["service.instance.id"] = str(uuid.uuid4())
    return resource.merge(Resource(defaults)) if defaults else resource


def _exporter(environ=os.environ):
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or DEFAULT_PROTOCOL
    ).strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (  # type: ignore[assignment]
            OTLPMetricExporter,
        )
    else:
        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not valid: use grpc or http/protobuf")
    return OTLPMetricExporter()


def build_meter_provider(resource=None, environ=os.environ):
    """A MeterProvider exporting over OTLP as the ``OTEL_*`` variables say."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    interval = None if environ.get("OTEL_METRIC_EXPORT_INTERVAL") else DEFAULT_EXPORT_INTERVAL_MS
    reader = PeriodicExportingMetricReader(_exporter(environ), export_interval_millis=interval)
    # shutdown_on_exit=False: main() shuts down itself, within a bounded time
    return MeterProvider(resource=resource or _resource(environ), metric_readers=[reader], shutdown_on_exit=False)


def main(argv: list[str] | None = None) -> int:
    """Run the agent; ``argv`` are the arguments after ``agent``. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["agent"]:
        argv = argv[1:]
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else 2
    try:
        config = load_config()
        resource = _resource()
        provider = build_meter_provider(resource)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    config = dataclasses.replace(config, hardware=True, hardware_interval=(args.interval or config.hardware_interval))
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from otel_training.hardware import start_hardware_metrics

    host_name = str(resource.attributes.get("host.name") or socket.gethostname())
    stop = threading.Event()
    restore = _install_signal_handlers(stop)
    hardware = start_hardware_metrics(provider, config, host_name=host_name)
    _logger.info("sampling hardware every %g s on %s; stop with Ctrl-C or SIGTERM", config.hardware_interval, host_name)
    try:
        stop.wait(args.duration)
    finally:
        started = time.monotonic()
        budget = config.shutdown_timeout
        hardware.shutdown(min(1.0, budget / 2))
        _shutdown_provider(provider, max(0.1, budget - (time.monotonic() - started)))
        restore()
    return 0


def _install_signal_handlers(stop: threading.Event):
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # signals are delivered to the main thread only
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, lambda signum, frame: stop.set())

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def _shutdown_provider(provider, timeout: float) -> None:
    """Flush and stop, giving up after ``timeout`` s (an unreachable Collector retries)."""
    done = threading.Thread(
        target=_quiet_shutdown, args=(provider, timeout), name="otel-training-agent-shutdown", daemon=True
    )
    done.start()
    done.join(timeout)
    if done.is_alive():
        _logger.warning("metric export did not finish within %.1f s; exiting anyway", timeout)


def _quiet_shutdown(provider, timeout: float) -> None:
    try:
        provider.shutdown(timeout_millis=timeout * 1000)
    except Exception:
        _logger.warning("metric provider shutdown failed", exc_info=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
