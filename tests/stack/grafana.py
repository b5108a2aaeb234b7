"""Grafana 12's interval rules for Prometheus queries, so the stack tests can run each
dashboard query exactly as Grafana would send it: the step, ``$__interval``,
``$__rate_interval`` and ``$__range``, for a time range and a panel width.

Transcribed from Grafana's sources:

- frontend (``PanelQueryRunner`` / scenes ``SceneQueryRunner``): ``interval =
  rangeutil.calculateInterval(range, maxDataPoints, panel.interval or ds.interval)``,
  i.e. ``max(roundInterval(range / maxDataPoints), intervalToMs(lowLimit))`` with the
  frontend's ``roundInterval`` (``<`` bounds) and ``intervalToMs`` (one number and
  unit: ``1m30s`` is 1 minute); the Prometheus data source's ``interval`` is its
  ``jsonData.timeInterval`` (default 15s). ``maxDataPoints`` is the panel's, or its
  width in pixels. ``round_interval_frontend``, ``interval_to_ms``, ``seconds_to_hms``
  and ``calculate_interval`` are checked against ``@grafana/data``'s own rangeutil
  (tests/stack/test_grafana_npm.py); the backend half is not on npm (Go).
- backend (``pkg/promlib/models/query.go``): ``minInterval = gtime.GetIntervalFrom(
  timeInterval, target.interval, intervalMs)`` (the frontend interval when the target
  sets no min step); step = ``max(Calculate(range, minInterval, maxDataPoints),
  CalculateSafeInterval(range, 11000))`` where ``Calculate`` returns ``minInterval`` when
  ``range / maxDataPoints`` is below it and ``gtime.RoundInterval`` of it otherwise
  (``<=`` bounds); ``$__rate_interval = max(interval + scrape, 4 * scrape)`` with
  ``interval`` the frontend interval and ``scrape`` the target's min step or else the
  data source's ``timeInterval`` (15s when unset), written as Go's
  ``time.Duration.String()`` (``1m0s``); ``$__interval`` is the step in Grafana's
  ``FormatInterval`` (``2m``); ``$__range`` the range in whole seconds (``3600s``).
- the range query's start and end are aligned down to a multiple of the step.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Tuple

SAFE_RESOLUTION = 11000
DEFAULT_SCRAPE = "15s"
GRID_COLUMNS = 24

# (upper bound in ms, rounded value in ms): Grafana's roundInterval table.
_ROUND = [
    (10, 1), (15, 10), (35, 20), (75, 50), (150, 100), (350, 200), (750, 500),
    (1500, 1000), (3500, 2000), (7500, 5000), (12500, 10000), (17500, 15000),
    (25000, 20000), (45000, 30000), (90000, 60000), (210000, 120000),
    (450000, 300000), (750000, 600000), (1050000, 900000), (1500000, 1200000),
    (2700000, 1800000), (5400000, 3600000), (9000000, 7200000), (16200000, 10800000),
    (32400000, 21600000), (86400000, 43200000), (604800000, 86400000),
    (1814400000, 604800000), (3628800000, 2592000000),
]
_YEAR_MS = 31536000000


def round_interval_frontend(ms: float) -> int:
    """``rangeutil.roundInterval`` (packages/grafana-data): strict ``<`` bounds."""
    for bound, value in _ROUND:
        if ms < bound:
            return value
    return _YEAR_MS


def round_interval_backend(ms: float) -> int:
    """``gtime.RoundInterval`` (grafana-plugin-sdk-go): ``<=`` bounds (the last one ``<``),
    and 1 d up to a week; an interval up to 15 ms is 10 ms (promlib's own wrapper)."""
    if ms <= 15:
        return 10
    for bound, value in _ROUND[1:-1]:
        if ms <= bound:
            return value
    if ms < _ROUND[-1][0]:
        return _ROUND[-1][1]
    return _YEAR_MS


_UNITS_MS = {"ms": 1, "s": 1000, "m": 60000, "h": 3600000, "d": 86400000, "w": 604800000, "y": _YEAR_MS}


def parse_ms(text: str) -> int:
    """A Grafana interval string (``15s``, ``1m``, ``500ms``, a bare number of seconds) as the
    backend (Go) reads its usual forms; the frontend reads it with ``interval_to_ms``."""
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        return int(text) * 1000
    total = 0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|[smhdwy])", text):
        total += float(number) * _UNITS_MS[unit]
    if not total and text not in ("0", "0s"):
        raise ValueError(f"not an interval: {text!r}")
    return int(total)


_FRONTEND_UNIT_S = {"y": 31536000, "M": 2592000, "w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1,
                    "ms": 1e-3}
_JS_DECIMAL = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*", re.ASCII)


def interval_to_ms(text: str) -> float:
    """``rangeutil.intervalToMs``: a bare non-zero number is seconds (its integer part);
    otherwise only the leading ``<number><unit>`` counts (``1m30s`` is 60000, ``1.5m`` is
    60000: the count is the integer part), ``M`` is 30 days; ``0`` and a string with no
    unit raise. Decimal strings only (JavaScript's hex or binary literals are not)."""
    if _JS_DECIMAL.fullmatch(text) and float(text):  # JavaScript's `if (Number(str))`
        whole = re.match(r"\s*([+-]?\d+)", text, re.ASCII)  # parseInt(str, 10): NaN for ".5"
        return 1000 * int(whole.group(1)) if whole else math.nan
    match = re.match(r"(-?\d+(?:\.\d+)?)(ms|[Mwdhmsy])", text, re.ASCII)
    if not match:
        raise ValueError(f"Invalid interval string: {text!r}")
    return _FRONTEND_UNIT_S[match.group(2)] * 1000 * int(float(match.group(1)))


def seconds_to_hms(seconds: float) -> str:
    """``rangeutil.secondsToHms``: the largest whole unit, from years down to ms."""
    rest = seconds
    for unit, size in (("y", 31536000), ("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count = math.floor(rest / size)  # JavaScript's % is math.fmod
        if count:
            return f"{count}{unit}"
        rest = math.fmod(rest, size)
    milliseconds = math.floor(seconds * 1000)
    return f"{milliseconds}ms" if milliseconds else "less than a millisecond"


def calculate_interval(range_ms: float, resolution: float, low_limit: Optional[str] = None) -> Tuple[float, str]:
    """``rangeutil.calculateInterval``: (intervalMs, interval) for a range over
    ``resolution`` points, at least ``low_limit`` (1 ms when unset or empty)."""
    low_ms = interval_to_ms(low_limit) if low_limit else 1
    interval_ms = round_interval_frontend(range_ms / resolution)
    if low_ms > interval_ms:
        interval_ms = low_ms
    return interval_ms, seconds_to_hms(interval_ms / 1000)


def go_duration(ms: int) -> str:
    """Go's ``time.Duration.String()`` for a whole number of milliseconds."""
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3600000)
    minutes, rest = divmod(rest, 60000)
    seconds = rest / 1000
    sec = f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{sec}"
    if minutes:
        return f"{minutes}m{sec}"
    return sec


def format_interval(ms: int) -> str:
    """Grafana's ``gtime.FormatInterval``: the largest whole unit (``2m``, ``15s``)."""
    for unit, size in (("y", _YEAR_MS), ("d", 86400000), ("h", 3600000), ("m", 60000), ("s", 1000)):
        if ms >= size:
            return f"{ms // size}{unit}"
    return f"{ms}ms" if ms >= 1 else "1ms"


@dataclass(frozen=True)
class Query:
    """One panel query as Grafana's Prometheus data source runs it."""

    start: float  # seconds, aligned to the step
    end: float
    step_ms: int
    interval_ms: int  # the frontend's $__interval before the backend's step logic
    rate_interval: str  # $__rate_interval as substituted
    interval: str  # $__interval as substituted
    range: str  # $__range as substituted

    @property
    def step(self) -> float:
        return self.step_ms / 1000


def plan(range_s: float, end: float, max_data_points: int, time_interval: Optional[str],
         panel_interval: Optional[str] = None, target_interval: Optional[str] = None) -> Query:
    """The step and built-in variables Grafana uses for a query over ``[end - range_s,
    end]`` from a panel with ``max_data_points`` (its width in pixels unless set)."""
    range_ms = range_s * 1000
    # frontend
    interval_ms, _ = calculate_interval(range_ms, max_data_points, panel_interval or time_interval or DEFAULT_SCRAPE)
    # backend
    min_ms = parse_ms(target_interval) if target_interval else interval_ms
    raw = range_ms / max_data_points
    calculated = min_ms if raw < min_ms else round_interval_backend(raw)
    safe = round_interval_backend(range_ms / SAFE_RESOLUTION)
    step_ms = int(max(calculated, safe))
    scrape_ms = parse_ms(target_interval or time_interval or DEFAULT_SCRAPE)
    rate_ms = int(max(interval_ms + scrape_ms, 4 * scrape_ms))
    step_s = step_ms / 1000
    start = math.floor((end - range_s) / step_s) * step_s
    aligned_end = math.floor(end / step_s) * step_s
    return Query(start, aligned_end, step_ms, int(interval_ms), go_duration(rate_ms),
                 format_interval(step_ms), f"{int(round(range_s))}s")


def panel_width_px(panel: dict, screen_px: int = 1920) -> int:
    """A panel's width in pixels on a ``screen_px`` wide dashboard: Grafana's default
    maxDataPoints (each of the 24 grid columns is an equal share, less the margins)."""
    return max(1, int(panel["gridPos"]["w"] / GRID_COLUMNS * screen_px) - 16)


def interpolate(expr: str, query: Query) -> str:
    """Replace the built-in variables in ``expr`` as the Prometheus backend does."""
    for name, value in (("__rate_interval", query.rate_interval), ("__interval", query.interval),
                        ("__range", query.range)):
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    return expr
