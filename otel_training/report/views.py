"""A report's sections (report/sources.py, report/prometheus.py) as the run model's
types, for what diagnosis/ reads: the modes, each rank's numbers, jobs, memory,
coverage, the run facts and the run over time."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from otel_training.aggregate.run_model import Coverage, Creep, Job, Memory, Mode, RunFacts, Series, Telemetry
from otel_training.diagnosis.evidence import Evidence, RankJob, RankMemory, RankSeries, RankTimes


def mode(report: Mapping[str, Any], name: str) -> Mode:
    """One of the report's modes (aggregated over ranks), in the summary's vocabulary."""
    m = report["modes"][name]
    return Mode.from_dict({**m, "samples_per_s": m.get("throughput_sps")}, f"modes.{name}")


def modes(report: Mapping[str, Any]) -> dict[str, Mode]:
    """The report's modes."""
    return {name: mode(report, name) for name in report.get("modes") or {}}


def jobs(report: Mapping[str, Any]) -> list[RankJob]:
    """Each rank's job section."""
    return [
        RankJob(rank=j.get("rank"), host=j.get("host"), job=Job.from_dict(j, "job")) for j in report.get("job") or ()
    ]


def coverage(report: Mapping[str, Any]) -> list[tuple[int | None, Coverage]]:
    """Each rank's coverage, by rank."""
    return [(c.get("rank"), Coverage.from_dict(c, "coverage")) for c in report.get("coverage") or ()]


def facts(report: Mapping[str, Any]) -> RunFacts | None:
    """What the run already does (the lowest rank's ``run`` section), where known."""
    run = report.get("run_facts")
    return RunFacts.from_dict(run, "run_facts") if isinstance(run, dict) else None


def memory(report: Mapping[str, Any]) -> list[RankMemory]:
    """Each rank's memory (Prometheus gives its byte counts as numbers, not integers)."""
    out = []
    for m in report.get("memory") or ():
        creep = m.get("creep")
        section = Memory(
            kind=m.get("kind"),
            device=m.get("device"),
            first_bytes=m.get("first_bytes"),
            last_bytes=m.get("last_bytes"),
            peak_allocated_bytes=m.get("peak_allocated_bytes"),
            peak_reserved_bytes=m.get("peak_reserved_bytes"),
            alloc_retries=m.get("alloc_retries"),
            ooms=m.get("ooms"),
            creep=Creep.from_dict(creep, "memory.creep") if creep else None,
        )
        out.append(RankMemory(rank=m.get("rank"), memory=section))
    return out


def _series(cols: Mapping[str, Any]) -> Series:
    """A rank's windows, as far as the verdict reads them (Prometheus's have no width)."""
    wait = cols.get("wait_s")
    return Series(
        width=int(cols.get("width") or 0),
        steps=tuple(cols.get("steps") or ()),
        step_s=tuple(cols.get("step_s") or ()),
        wait_s=tuple(wait) if wait is not None else None,
    )


def evidence(report: Mapping[str, Any], wanted: str | None) -> Evidence:
    """What the verdict reads of ``report``, for the ``wanted`` mode alone (none: no mode has steps)."""
    gpu = report.get("gpu_utilization") or {}
    return Evidence(
        modes={wanted: mode(report, wanted)} if wanted else {},
        telemetry=Telemetry.from_dict(report.get("telemetry") or {}, "telemetry"),
        facts=facts(report),
        loaders=tuple(report.get("loaders") or ()),
        gpu_mean=gpu.get("mean"),
        ranks=tuple(RankTimes.from_dict(r, "ranks") for r in (report["ranks"].get(wanted) or [])) if wanted else (),
        memory=tuple(memory(report)),
        timeseries=tuple(
            RankSeries(
                rank=r.get("rank"),
                host=r.get("host"),
                modes={k: _series(v) for k, v in (r.get("modes") or {}).items() if isinstance(v, dict)},
            )
            for r in report.get("timeseries") or ()
            if isinstance(r, dict)
        ),
    )
