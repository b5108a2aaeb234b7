"""Replay a recorded run at another metric export interval.

The recorded OTLP export requests of a run are kept as they came, cumulative values
and all; only their timestamps change, so that each process's exports, recorded every
``OTEL_METRIC_EXPORT_INTERVAL`` (0.5 s), come ``interval`` seconds apart, in their
order and with the phase between processes scaled. An export's lateness (how much
longer than the interval its gap was: the export's own time, a busy machine) is kept
in seconds, not scaled: the SDK's periodic reader waits the interval after each export,
so a run exporting every 30 s is late by the same fraction of a second a run exporting
every 0.5 s is. That is what Prometheus would hold had the same run exported every
``interval`` seconds, slowed down. Each replay gets its own
``service.name``, ``host.name``, ``training.run.id`` and instance ids (suffixed with
``tag``), so several replays share one Prometheus without mixing.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, List, Tuple

RENAMED = ("service.name", "host.name", "training.run.id", "service.instance.id")


def _points(metric) -> Iterable:
    kind = metric.WhichOneof("data")
    if kind is None:
        return ()
    return getattr(metric, kind).data_points


def _instance(rm) -> str:
    for kv in rm.resource.attributes:
        if kv.key == "service.instance.id":
            return kv.value.string_value
    return ""


def _rename(attributes, tag: str) -> None:
    for kv in attributes:
        if kv.key in RENAMED and kv.value.WhichOneof("value") == "string_value":
            kv.value.string_value = f"{kv.value.string_value}-{tag}"


def _time_ns(rm) -> int:
    for sm in rm.scope_metrics:
        for metric in sm.metrics:
            for p in _points(metric):
                return p.time_unix_nano
    return 0


def _trains(rm) -> bool:
    return any(m.name == "training.steps" for sm in rm.scope_metrics for m in sm.metrics)


def _stamps(requests: List) -> dict:
    by_instance = defaultdict(list)
    for request in requests:
        for rm in request.resource_metrics:
            by_instance[_instance(rm)].append(_time_ns(rm))
    return by_instance


def _native_ns(by_instance: dict) -> int:
    """The recorded export interval: the median gap between a process's exports."""
    gaps = []
    for stamps in by_instance.values():
        stamps = sorted(stamps)
        gaps += [b - a for a, b in zip(stamps, stamps[1:]) if b > a]
    return sorted(gaps)[len(gaps) // 2]


def most_late_s(requests: List) -> float:
    """The recording's largest lateness: how much longer than the recorded export
    interval any one process's gap between two exports was, in seconds (the run's own
    clock; a replay keeps it, see ``restamp``)."""
    by_instance = _stamps(requests)
    native_ns = _native_ns(by_instance)
    late = [b - a - native_ns for stamps in by_instance.values()
            for a, b in zip(sorted(set(stamps)), sorted(set(stamps))[1:])]
    return max([0, *late]) / 1e9


def restamp(requests: List, interval_s: float, end_s: float, tag: str,
            regular: bool = False, earliest_s: float = float("-inf")) -> Tuple[List, float, float]:
    """Copies of ``requests`` stretched in time so that each process exports every
    ``interval_s`` seconds (its recorded exports keep their order, their lateness in
    seconds, and their phase relative to the other processes, scaled), renamed with ``tag``. The last export that
    counted training steps lands at ``end_s``; exports before training began or after it
    ended (a launcher's start-up, or outliving its ranks) are dropped, and so are those that
    would land before ``earliest_s`` (a long run stretched to a long interval: its start is
    left out, its cumulative points keep their start times). Returns (requests, first, last)
    in seconds."""
    by_instance = _stamps(requests)
    native_ns = _native_ns(by_instance)
    factor = interval_s * 1e9 / native_ns  # output seconds per recorded nanosecond, x1e9
    # Each process's k-th export: its first, then per recorded gap one recorded interval
    # plus the gap's lateness, shrunk by ``factor`` here so that it comes out in seconds
    # as recorded (``regular``: no lateness, for a synthetic producer whose timing is not
    # under test).
    slot = {}
    for instance, stamps in by_instance.items():
        stamps = sorted(set(stamps))
        t = float(stamps[0])
        slot[(instance, stamps[0])] = t
        for a, b in zip(stamps, stamps[1:]):
            t += native_ns + (0.0 if regular else (b - a - native_ns) / factor)
            slot[(instance, b)] = t

    def when(rm) -> float:
        t = _time_ns(rm)
        return slot.get((_instance(rm), t), float(t))

    trains = [when(rm) for request in requests for rm in request.resource_metrics if _trains(rm)]
    ref_ns = max(trains)
    from_ns = min(trains) - 2 * native_ns  # the hardware sampler's start-up before training: left out
    first, last = float("inf"), float("-inf")
    out = []
    for request in requests:
        copy = type(request)()
        copy.CopyFrom(request)
        keep = []
        for rm in copy.resource_metrics:
            if not from_ns <= when(rm) <= ref_ns:
                continue
            t = end_s - (ref_ns - when(rm)) * factor / 1e9
            if t < earliest_s:
                continue
            first, last = min(first, t), max(last, t)
            t_ns = int(t * 1e9)
            _rename(rm.resource.attributes, tag)
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    for p in _points(metric):
                        if p.start_time_unix_nano:
                            p.start_time_unix_nano = t_ns - int((p.time_unix_nano - p.start_time_unix_nano) * factor)
                        p.time_unix_nano = t_ns
                        _rename(p.attributes, tag)
                        for ex in getattr(p, "exemplars", ()):
                            ex.time_unix_nano = t_ns
            keep.append(rm)
        if keep:
            del copy.resource_metrics[:]
            copy.resource_metrics.extend(keep)
            out.append(copy)
    return out, first, last
