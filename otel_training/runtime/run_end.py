"""The run summary at the run's end: one :class:`~otel_training.aggregate.run_model.Run`
made of each part's own section."""

from __future__ import annotations

import time
from typing import Any

from otel_training.aggregate.run_model import Run, Telemetry


def run_model(runtime: Any) -> Run:
    """``runtime``'s run summary (a ``runtime.active.Runtime``), now."""
    summary, coverage, series = runtime.pipeline.summary, runtime.pipeline.coverage, runtime.pipeline.timeseries
    timing, modes = summary.section()
    info = summary.info
    return Run(
        service=info["service"],
        run_id=info["run_id"],
        host=info["host"],
        rank=info["rank"],
        world_size=info["world_size"],
        pid=info["pid"],
        timing=timing,
        started_at=summary.started_at,
        ended_at=time.time(),
        modes=modes,
        telemetry=Telemetry(**runtime.telemetry.as_dict()),
        step_boundary=runtime.config.step_boundary,
        loaders=tuple(sorted(runtime.tracker.loaders)),  # which advice fits a data-bound run
        coverage=coverage.section(runtime._started_ns),
        self_check=runtime.goodput.self_check(coverage, runtime.tracker),
        memory=runtime.measures.memory(),
        run=runtime.measures.facts(),
        job=runtime.goodput.job(summary),
        timeseries=series.section() if series is not None else None,
        profiles=runtime.profiling.section() if runtime.profiling is not None else None,
    )
