"""Every dashboard query holds at every supported metric export interval.

The recorded real runs (and the synthetic supplement, for the series a healthy CPU run
cannot have) are replayed as if exported every 1, 5, 15, 30 and 60 seconds
(tests/stack/replay.py), all into one real Prometheus; the recording rules are
evaluated over that whole history by ``promtool tsdb create-blocks-from rules`` every
15 s, as prometheus.yml evaluates them. Then each query of each panel runs exactly as
Grafana would send it (tests/stack/grafana.py: the step, ``$__interval`` and
``$__rate_interval`` from the data source's ``timeInterval`` and the panel's width) for
the last 5 minutes, hour and day, and must return data at every step where the replayed
run had been exporting for two intervals (a rate needs two samples) and stepping within
the query's rate window -- no blank panel, no gaps.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

import pytest
import yaml

from tests.stack import grafana, replay
from tests.stack import promql as q
from tests.stack.prom_translate import Translator, promoted_attributes, translate
from tests.stack.promserver import PROM_DIR, ROOT, Prometheus, stack_config

pytestmark = pytest.mark.slow

INTERVALS = [1, 5, 15, 30, 60]  # OTEL_METRIC_EXPORT_INTERVAL, seconds
RANGES = {"5m": 300, "1h": 3600, "24h": 86400}
RULE_EVAL_S = 15  # prometheus.yml's evaluation_interval
BLOCK_S = 7200  # Prometheus's (and promtool's) TSDB block length
REPLAY_MAX_S = BLOCK_S - 300  # the longest replay: inside one block, with room for the rules' start
SYNTHETIC_ONLY = {"training_gpu_idle_seconds_total", "training_telemetry_export_failures_total",
                  "training_telemetry_spans_dropped_total", "training_telemetry_steps_dropped_total",
                  "training_tokens_total", "training_memory_allocated_bytes", "training_memory_peak_allocated_bytes",
                  "training_memory_peak_reserved_bytes", "training_memory_alloc_retries_total",
                  "training_memory_ooms_total"}
DATASOURCES = ROOT / "grafana" / "provisioning" / "datasources" / "datasources.yaml"


def _time_interval() -> str:
    ds = next(d for d in yaml.safe_load(DATASOURCES.read_text())["datasources"] if d["type"] == "prometheus")
    return ds.get("jsonData", {}).get("timeInterval", "")


RECORDED = {r["record"]: r["expr"] for r in q.rules() if "record" in r}


def _rule_windows(expr: str) -> list:
    """The range windows (seconds) of the recording rules a query reads; empty for a
    query on raw series."""
    found = set()
    for sel in q.selectors(expr):
        rule = RECORDED.get(q.metric_name(sel))
        if rule is not None:
            found |= {grafana.parse_ms(w) / 1000 for w in re.findall(r"\[(\d+[smh])\]", rule)}
    return sorted(found)


def _source_names(expr: str) -> set:
    """Metric names a query reads, recorded series resolved to the series they come from."""
    names = set()
    for sel in q.selectors(expr):
        name = q.metric_name(sel)
        names |= _source_names(RECORDED[name]) if name in RECORDED else {name}
    return names


def _source(expr: str) -> str:
    return "synthetic" if _source_names(expr) & SYNTHETIC_ONLY else "real"


@dataclass
class Replay:
    tr: Translator
    first: float
    last: float
    job: str
    host: str
    run: str

    def window(self, names: set, run: str = "") -> tuple:
        """When every metric in ``names`` was live (of one run, if given): from its first
        sample to its last -- for a counter, to its last increase (once the steps stop, a
        rate is 0 and a mean step time 0/0: no step, nothing to show)."""
        lo, hi = self.first, self.last
        for name in names:
            first, last = [], []
            for points in self._series(name, run):
                stamps = sorted(points)
                first.append(stamps[0])
                if name.endswith(COUNTERS):
                    rises = [b for a, b in zip(stamps, stamps[1:]) if points[b] > points[a]]
                    if rises:
                        last.append(rises[-1])
                else:
                    last.append(stamps[-1])
            if not first or not last:
                return None
            lo, hi = max(lo, min(first) / 1000), min(hi, max(last) / 1000)
        return lo, hi

    def exported(self, names: set, run: str, t: float, warm: float, slack: float) -> bool:
        """Some process exported every metric in ``names`` around ``t``: a series (one per
        process) began at least ``warm`` s before it and ended at most ``slack`` s before.
        The host and GPU gauges come from one process a host, the holder of the sampling
        lock; when it exits before the others, another takes over from its next sample
        (docs/hardware.md): the stretch between the two is a role changing hands, not an
        export lost."""
        for name in names:
            spans = [(min(points) / 1000, max(points) / 1000) for points in self._series(name, run) if points]
            if not any(a + warm <= t <= b + slack for a, b in spans):
                return False
        return True

    def stalled(self, names: set, run: str, t: float, windows: list) -> bool:
        """The replayed run did not step where a query at ``t`` looks: for some counter in
        ``names`` that moves with the steps, the first of the query's rate ``windows``
        (seconds; the ``$__rate_interval`` one, then its ``or ...[5m]`` fallback) that
        holds two samples of any series holds no increase in any. The recording is a real
        run exporting every 0.1 s; a stall of a few tenths of a second there (start-up, a
        loaded machine) becomes minutes of no steps once replayed at 30 or 60 s: nothing to
        show, as a real run that stopped stepping shows nothing. Counters of rare events
        (``EVENTS``: OOMs, allocator retries, export failures) never excuse: their 0
        increase is data. A window with fewer than two samples never counts as a stall (a
        rate window too short for the interval is what this test is for)."""
        for name in names:
            if not name.endswith(COUNTERS) or name in EVENTS:
                continue
            series = self._series(name, run)
            for window in windows:
                seen = [[points[s] for s in sorted(points) if t - window < s / 1000 <= t] for points in series]
                seen = [values for values in seen if len(values) >= 2]
                if seen:
                    if not any(values[-1] > values[0] for values in seen):
                        return True
                    break
        return False

    def _series(self, name: str, run: str) -> list:
        """The samples ({ms: value}) of each series of ``name`` (of one run, if given)."""
        return [points for fam in self.tr.families.values() for key, points in fam.samples.items()
                if key[0] == name and not (run and dict(key[1:]).get("training_run_id") != run)]


# counters that stay flat in a healthy run: their increase is 0, not absent
EVENTS = {"training_memory_ooms_total", "training_memory_alloc_retries_total",
          "training_telemetry_export_failures_total", "training_telemetry_spans_dropped_total",
          "training_telemetry_steps_dropped_total"}
COUNTERS = ("_total", "_sum", "_count", "_bucket")


@pytest.fixture(scope="module")
def replayed(prom_bin, run_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("intervals")
    prom = Prometheus(prom_bin, work)
    promote = promoted_attributes(str(PROM_DIR / "prometheus.yml"))
    # The replays end just before the last 2-hour boundary, and all of them (at most
    # 100 minutes long) lie inside that 2-hour TSDB block: promtool's rule backfill cuts
    # its evaluations at block boundaries, which left recorded series short near one.
    # Queries run at an explicit "now" (end + 15 s), as Grafana would at that moment.
    end = math.floor(time.time() / BLOCK_S) * BLOCK_S - 60
    replays = {}
    for interval in INTERVALS:
        for source, requests in (("real", run_data.real_requests), ("synthetic", run_data.synthetic_requests)):
            # The synthetic producer's export timing is not under test: four exporters and
            # a receiver share one process, and under load an export came late enough to
            # leave a replayed rate window with one sample (a blank step, once in CI).
            # A run that took longer (a loaded machine: 141 exports, 2.4 hours at 60 s) is
            # replayed from as far back as the block allows.
            copies, first, last = replay.restamp(requests, interval, end, f"e{interval}",
                                                 regular=source == "synthetic", earliest_s=end - REPLAY_MAX_S)
            tr = translate(copies, promote)
            prom.load(tr.openmetrics(), f"{source}-e{interval}")
            labels = dict(sorted(tr.families["training_steps_total"].samples)[0][1:])
            replays[(source, interval)] = Replay(tr, first, last, labels["job"], labels["host_name"],
                                                 labels["training_run_id"])
    assert end - min(r.first for r in replays.values()) < BLOCK_S - 120, "replays longer than a block"
    config = stack_config()
    config["rule_files"] = []  # the recording rules are backfilled below, over the history
    prom.start(config)
    try:
        start = max(min(r.first for r in replays.values()) - 60, end + 60 - BLOCK_S)
        blocks = work / "rule-blocks"
        proc = subprocess.run(
            [str(prom_bin / "promtool"), "tsdb", "create-blocks-from", "rules", "--quiet",
             f"--start={int(start)}", f"--end={end + 10}", f"--url={prom.url}",
             f"--output-dir={blocks}", f"--eval-interval={RULE_EVAL_S}s",
             str(PROM_DIR / "rules" / "training-recording.yml")],
            capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    finally:
        prom.stop()
    for block in blocks.iterdir():
        shutil.move(str(block), str(prom.data / block.name))
    prom.start(config)
    try:
        yield prom, replays, end + 15  # "now": the moment the dashboard is looked at
    finally:
        prom.stop()


def _has_value(series: dict) -> dict:
    return {float(t): v for t, v in series.get("values", []) if math.isfinite(float(v))}


TARGETS = [(name, dash, panel, target) for name, dash in q.dashboards().items()
           for panel, target in q.panel_queries(dash)]


@pytest.mark.parametrize("name, dash, panel, target", TARGETS,
                         ids=[f"{n}:{p['title']}:{t['refId']}" for n, _, p, t in TARGETS])
def test_query_returns_data_at_every_export_interval(replayed, name, dash, panel, target):
    prom, replays, now = replayed
    time_interval = _time_interval()
    source = _source(target["expr"])
    repeat = q.repeat_variable(dash, panel)
    names = _source_names(target["expr"])
    problems = []
    checked = set()
    windows = {}
    for interval in INTERVALS:
        rp = replays[(source, interval)]
        values = {"job": rp.job, "host_name": rp.host, "training_run_id": q.ALL, "training_rank": q.ALL,
                  "gpu_index": q.ALL}
        if repeat:
            values[repeat] = rp.run  # one copy of the repeated panel: one run
        window = rp.window(names, rp.run if repeat == "training_run_id" else "")
        windows[interval] = (round(window[0] - now), round(window[1] - now)) if window else None
        assert window, f"{names} not in the replayed {source} run"
        for range_name, range_s in RANGES.items():
            plan = grafana.plan(range_s, now, panel.get("maxDataPoints") or grafana.panel_width_px(panel),
                                time_interval, panel.get("interval"), target.get("interval"))
            expr = q.substitute(grafana.interpolate(target["expr"], plan), values)
            where = f"export every {interval}s, last {range_name} (step {plan.step:g}s, " \
                    f"$__rate_interval {plan.rate_interval})"
            # Data is due at every step (Grafana aligns steps, and the end, down to a
            # multiple of the step) once the run has been exporting for two intervals,
            # plus two rule evaluations for recorded series, until its last export.
            warm = 2 * interval + 2 * RULE_EVAL_S
            due_from = window[0] + warm
            run = rp.run if repeat == "training_run_id" else ""
            if target.get("instant"):
                # Looked at while the run trains: "now" is its last step (or the end).
                # Where the host's sampling changed hands there (its holder exited, another
                # process took over from its next sample), a person looking one export
                # earlier sees the table: the latest such moment is the one checked.
                at, plan = min(now, window[1]), None
                while at >= due_from:
                    p = grafana.plan(range_s, at, panel.get("maxDataPoints") or grafana.panel_width_px(panel),
                                     time_interval, panel.get("interval"), target.get("interval"))
                    if p.end >= due_from and rp.exported(names, run, p.end, warm, interval):
                        plan = p
                        break
                    at -= interval
                if plan is None:
                    continue  # the run was never exported long enough by one process
                expr = q.substitute(grafana.interpolate(target["expr"], plan), values)
                result = prom.query(expr, plan.end)
                if not any(math.isfinite(float(s["value"][1])) for s in result):
                    problems.append(f"{where}: no data")
                checked.add((interval, range_name))
                continue
            # A recorded series holds the value of the rule's last evaluation, up to one
            # evaluation interval before the step, over the rule's own window.
            rules = _rule_windows(target["expr"])
            lag = RULE_EVAL_S if rules else 0
            rate_windows = rules or [grafana.parse_ms(plan.rate_interval) / 1000] + ([300.0] if "[5m]" in expr else [])
            exporting = [t for t in _steps(plan) if max(due_from, plan.start) <= t <= window[1]
                         and rp.exported(names, run, t, warm, interval)]
            due = [t for t in exporting if not rp.stalled(names, run, t - lag, rate_windows)]
            # a stall is a moment of the run, not most of it: a ``stalled`` that excused
            # most steps would leave this test checking nothing
            assert len(due) >= len(exporting) / 2, f"{where}: {len(exporting) - len(due)} of " \
                f"{len(exporting)} steps in a stall of the recorded run"
            if not due:
                continue  # the run lies between two steps of this range: nothing to show
            result = prom.query_range(expr, plan.start, plan.end, plan.step)
            seen = set()
            for series in result:
                seen |= set(_has_value(series))
            if not seen:
                problems.append(f"{where}: no data")
                continue
            missing = [t for t in due if t not in seen]
            if missing:
                problems.append(f"{where}: {len(missing)} of {len(due)} steps blank "
                                f"(first at {missing[0] - window[0]:.0f}s into the run, "
                                f"{window[1] - missing[0]:.0f}s before its last step; blank at "
                                f"{[round(t - window[1]) for t in missing][:12]} from its last step)")
            checked.add((interval, range_name))
    assert not problems, f"{target['expr']}\n" + "\n".join(problems)
    # not vacuous: at every interval, data was due in at least one of the ranges
    assert {i for i, _ in checked} == set(INTERVALS), (checked, windows)


def _steps(plan: grafana.Query) -> list:
    n = int(round((plan.end - plan.start) / plan.step))
    return [round(plan.start + i * plan.step, 3) for i in range(n + 1)]


def test_the_replays_hold_the_runs_exports(replayed, run_data):
    """The replays are what runs exporting at each interval leave in Prometheus: every
    process's samples come ``interval`` apart (late by at most what the recorded run's
    exports were, by its own clock), and both concurrent runs are there."""
    prom, replays, now = replayed
    late = replay.most_late_s(run_data.real_requests)
    for interval in INTERVALS:
        rp = replays[("real", interval)]
        raw = prom.query(f'training_steps_total{{job="{rp.job}", training_mode="train"}}[1d]', now)
        assert len({s["metric"]["training_run_id"] for s in raw}) == 2, interval
        for series in raw:
            stamps = [float(t) for t, _ in series["values"]]
            gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
            assert len(stamps) >= 20, (interval, len(stamps))
            assert abs(gaps[len(gaps) // 2] - interval) < 0.1 * interval, (interval, gaps[len(gaps) // 2])
            assert gaps[-1] < interval + late + 0.01, (interval, gaps[-1], late)  # no export lost
