"""A runtime's end as one table: the steps of shutting it down, in order, run by one
loop. A step that fails is counted under its component and the next one runs: an
error of ours never reaches the user's code, and the late steps (the summary, the
providers' shutdown) still get their turn."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from otel_training.runtime.process_events import ending_exception


def shutdown_steps(rt: Any, final: bool, left: Callable[..., float]) -> list[tuple[str, Callable[[], Any]]]:
    """(component, step) in the order they run; ``left(share)``: seconds of the budget left,
    times ``share``. ``final``: at exit or on SIGTERM (the providers shut down too)."""
    guard = rt.guard
    hardware = rt.hardware

    def end_open_step() -> None:
        if rt.tracker.step is not None:
            rt.tracker.finish_step(ending_exception(final))

    def hand_on_held() -> None:
        rt.tracker.close()  # steps the assembler still holds
        rt.measures.close()  # a FLOP count still open (the run ended inside it)

    def stop_profiling() -> None:
        if rt.profiling is not None:
            rt.profiling.stop()  # a capture still recording ends with the run

    def read_profiles() -> None:
        if rt.profiling is not None:
            rt.profiling.join(left(0.3))

    def stop_pipeline() -> None:
        rt.pipeline.stop(left(0.4))
        try:
            rt.timer.close()
        except Exception as exc:
            rt.on_error("device_timing", exc)

    def stop_sampling() -> None:
        if hardware is not None:
            hardware.stop_sampling(min(1.0, left(0.25)))

    def last_export() -> None:
        # Leave a quarter of the budget for giving up cleanly and shutting down. The
        # hardware gauges still report here: this last export carries the samples since
        # the one before (all of them, in a run shorter than the export interval), the
        # sampler's last one included.
        if guard is not None and not guard.silenced:
            if not guard.flush(left(0.75)) and final:
                guard.abort()  # interrupts the exporters' retry backoff
                guard.flush(min(0.2, left(0.3)))  # lets the aborted exports count
                rt.telemetry.drop_spans(guard.discard_pending())

    def stop_hardware() -> None:
        if hardware is not None:
            hardware.shutdown(0.0)  # stopped above; the gauges report nothing from now

    def shutdown_providers() -> None:
        if final and guard is not None and not guard.silenced:
            guard.shutdown_providers(max(0.05, left()))

    return [
        ("shutdown", rt.goodput.end),
        ("shutdown", end_open_step),
        ("shutdown", hand_on_held),
        ("profile", stop_profiling),
        ("shutdown", stop_pipeline),
        ("profile", read_profiles),
        ("shutdown", rt.goodput.finish),  # before the last export: it carries the shut-down time
        ("hardware", stop_sampling),
        ("shutdown", last_export),
        ("hardware", stop_hardware),
        ("summary", rt.report),  # the run-end table, the summary and trace files
        ("shutdown", shutdown_providers),
    ]


def run_steps(steps: list[tuple[str, Callable[[], Any]]], on_error: Callable[[str, BaseException], None]) -> None:
    for component, step in steps:
        try:
            step()
        except Exception as exc:  # our bug: counted, and the next step runs
            on_error(component, exc)
