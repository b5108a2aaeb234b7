"""``otel-training report --prometheus``: a run's numbers from Prometheus (the
contract's metric names, docs/telemetry.md), merged per rank like summary files."""

from __future__ import annotations

import json
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import replace

from otel_training import semconv as sc
from otel_training.aggregate.run_model import Flops, Job, Memory, Telemetry
from otel_training.diagnosis.goodput_text import SYMBOLS
from otel_training.report.model import (
    SOURCE_PROMETHEUS,
    Gpu,
    GpuUtilization,
    Ranked,
    RankRow,
    Report,
    TimeRange,
    Who,
)
from otel_training.report.sources import ModeTotals, ReportError


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def run_matchers(run: str) -> list[str]:
    """Candidate label matchers for ``--run``: explicit ``label=value,...`` pairs (or a
    ``{...}`` selector body) are used as given; a bare name is tried as
    ``training_run_id``, then as ``job``."""
    run = run.strip()
    if run.startswith("{") and run.endswith("}"):
        return [run[1:-1]]
    if "=" in run:
        parts = []
        for item in run.split(","):
            k, _, v = item.partition("=")
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k.strip()):
                raise ReportError(f"--run {run!r}: {k.strip()!r} is not a label name")
            parts.append(f"{k.strip()}={_quote(v.strip().strip(chr(34)))}")
        return [",".join(parts)]
    return [f"training_run_id={_quote(run)}", f"job={_quote(run)}"]


class Prometheus:
    """A minimal Prometheus HTTP API client (instant queries via urllib)."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        if not re.match(r"^https?://", url):
            raise ReportError(f"--prometheus {url!r} is not an http(s) URL")
        self.url = url.rstrip("/")
        self.timeout = timeout

    def query(self, promql: str, at: float) -> list[dict]:
        """``/api/v1/query`` → list of ``{"metric": labels, "value": float}``."""
        return self._api("/api/v1/query", {"query": promql, "time": f"{at:.3f}"}, "vector", _instant)

    def query_range(self, promql: str, start: float, end: float, step: float) -> list[dict]:
        """``/api/v1/query_range`` → ``{"metric": labels, "values": [(t, float), ...]}``."""
        params = {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        return self._api("/api/v1/query_range", params, "matrix", _range)

    def _api(self, path: str, params: dict, kind: str, convert) -> list[dict]:
        req = urllib.request.Request(
            self.url + path,
            data=urllib.parse.urlencode(params).encode(),
            method="POST",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
            err = _api_error(body)
            if err:
                raise ReportError(f"Prometheus at {self.url} rejected the query: {err}") from None
            raise ReportError(
                f"Prometheus at {self.url} answered HTTP {exc.code} (is this a Prometheus server?)"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ReportError(f"cannot reach Prometheus at {self.url}: {reason}") from None
        try:
            doc = json.loads(body)
            if doc.get("status") != "success":
                raise ReportError(f"Prometheus at {self.url} rejected the query: {doc.get('error', 'unknown error')}")
            if doc["data"]["resultType"] != kind:
                raise ValueError(doc["data"]["resultType"])
            return [convert(r) for r in doc["data"]["result"]]
        except ReportError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ReportError(f"{self.url} did not answer like the Prometheus HTTP API ({path})") from None


def _instant(r: dict) -> dict:
    return {"metric": r["metric"], "value": float(r["value"][1])}


def _range(r: dict) -> dict:
    return {"metric": r["metric"], "values": [(float(t), float(v)) for t, v in r["values"]]}


def _api_error(body: bytes) -> str | None:
    try:
        doc = json.loads(body)
        return f"{doc.get('errorType', 'error')}: {doc['error']}"
    except Exception:
        return None


RANK_LABELS = ("instance", "host_name", "training_rank")  # the labels of one process


def _series(labels: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in labels.items() if k != "__name__"))


def _key(labels: dict, names: tuple[str, ...]) -> tuple:
    return tuple(labels.get(n, "") for n in names)


class PrometheusReport:
    """Collects a report for one run over ``[start, end]`` from Prometheus."""

    def __init__(self, prom: Prometheus, start: float, end: float) -> None:
        if end <= start:
            raise ReportError("the time range is empty: --start must be before --end")
        self.prom, self.start, self.end = prom, start, end
        self.window = max(1, int(math.ceil(end - start)))

    def _deltas(self, metric: str, sel: str, by: tuple[str, ...]) -> dict[tuple, float]:
        """Per-series counter increase over the range (a series born inside the range
        counts from 0), summed by ``by`` labels."""
        q = f"last_over_time({metric}{{{sel}}}[{self.window}s])"
        end = self.prom.query(q, self.end)
        before = {_series(r["metric"]): r["value"] for r in self.prom.query(q, self.start)}
        out: dict[tuple, float] = {}
        for r in end:
            delta = r["value"] - before.get(_series(r["metric"]), 0.0)
            if delta < 0:  # reset (should not happen: one series per process)
                delta = r["value"]
            k = _key(r["metric"], by)
            out[k] = out.get(k, 0.0) + delta
        return out

    def runs(self) -> list[dict]:
        q = f"count by (job, training_run_id) (last_over_time(training_step_duration_seconds_count[{self.window}s]))"
        return [r["metric"] for r in self.prom.query(q, self.end)]

    def resolve(self, run: str | None) -> str:
        """The label selector body for ``run`` (or the only run in range)."""
        if run:
            for sel in run_matchers(run):
                q = f"count(last_over_time(training_step_duration_seconds_count{{{sel}}}[{self.window}s]))"
                if self.prom.query(q, self.end):
                    return sel
            raise ReportError(
                f"no otel-training steps for run {run!r} in Prometheus at "
                f"{self.prom.url} in {_fmt_range(self.start, self.end)}" + _known(self.runs())
            )
        found = self.runs()
        if not found:
            raise ReportError(
                f"no otel-training steps in Prometheus at {self.prom.url} in {_fmt_range(self.start, self.end)}"
            )
        if len(found) > 1:
            raise ReportError("several runs in range, pick one with --run" + _known(found))
        labels = found[0]
        keys = [k for k in ("training_run_id", "job") if labels.get(k)]
        return ",".join(f"{k}={_quote(labels[k])}" for k in keys)

    def collect(self, run: str | None) -> Report:
        sel = self.resolve(run)
        rk = RANK_LABELS
        mk = ("training_mode",)
        st = self._deltas("training_step_duration_seconds_sum", sel, rk + mk)
        sn = self._deltas("training_step_duration_seconds_count", sel, rk + mk)
        smp = self._deltas("training_samples_total", sel, rk + mk)
        pby = rk + mk + ("training_phase", "training_phase_parent")
        ps = self._deltas("training_phase_duration_seconds_sum", sel, pby)
        pc = self._deltas("training_phase_duration_seconds_count", sel, pby)
        idle = self._deltas("training_gpu_idle_seconds_total", sel, rk + mk + ("training_phase",))
        tok = self._deltas("training_tokens_total", sel, rk + mk)
        flo = self._deltas("training_flops_total", sel, rk + mk)
        mfu = self._over_time("avg", "training_mfu_ratio", sel, rk + mk)
        modes: dict[str, ModeTotals] = {}
        ranks: dict[str, list[RankRow]] = {}
        for key in sorted(sn, key=lambda k: (_rank_sort(k[2]), k[0])):
            inst, host, rank_label, mode = key
            if sn[key] <= 0 or not mode:
                continue
            phases = [(k[4], k[5] or sc.SPAN_STEP, v, pc.get(k, 0.0)) for k, v in ps.items() if k[:4] == key]
            idles = {k[4]: v for k, v in idle.items() if k[:4] == key}
            flops = None
            if flo.get(key) and st.get(key):
                flops = Flops(per_step=flo[key] / sn[key], flop_s=flo[key] / st[key], mfu=mfu.get(key))
            own = modes.setdefault(mode, ModeTotals()).add_rank(
                sn[key],
                smp.get(key, 0.0),
                st.get(key, 0.0),
                phases,
                idles,
                None,
                tok.get(key, 0.0),
                flops,
                rank=int(rank_label) if rank_label.isdigit() else None,
                host=host,
                instance=inst,
            )
            ranks.setdefault(mode, []).append(own)
        for mode, rows in ranks.items():
            if len(rows) == 1 and rows[0].rank is None:
                ranks[mode] = [replace(rows[0], rank=0)]
        gpus = self._gpus(sel)
        hosts = sorted({r.host for rows in ranks.values() for r in rows if r.host})
        if not gpus and hosts:  # sampled by a process outside the run (otel-training agent)
            gpus = self._gpus("host_name=~" + _quote("|".join(re.escape(h) for h in hosts)))
        utils = [g.mean for g in gpus]
        tel = {}
        for name, metric in (
            ("spans_dropped", "training_telemetry_spans_dropped_total"),
            ("steps_dropped", "training_telemetry_steps_dropped_total"),
            ("export_failures", "training_telemetry_export_failures_total"),
            ("errors", "training_telemetry_errors_total"),
        ):
            tel[name] = int(round(sum(self._deltas(metric, sel, ()).values())))
        return Report(
            source=SOURCE_PROMETHEUS,
            prometheus=self.prom.url,
            selector="{" + sel + "}",
            run=run or sel,
            range=TimeRange(start=self.start, end=self.end),
            modes={mode: totals.finish() for mode, totals in modes.items()},
            ranks={mode: tuple(rows) for mode, rows in ranks.items()},
            gpus=tuple(gpus),
            gpu_utilization=GpuUtilization(mean=sum(utils) / len(utils), min=min(g.min for g in gpus))
            if gpus
            else None,
            telemetry=Telemetry(**tel),
            memory=tuple(self._memory(sel)),
            # per process, the wall time by activity over the range (diagnosis/goodput_text.py)
            job=tuple(
                jobs_from_deltas(
                    self._deltas("training_job_time_seconds_total", sel, RANK_LABELS + ("training_activity",))
                )
            ),
        )

    def _over_time(self, fn: str, metric: str, sel: str, by: tuple[str, ...]) -> dict[tuple, float]:
        """``fn`` (avg, max, min, last) of a gauge over the range, per ``by`` labels."""
        q = f"{fn if fn != 'last' else 'max'} by ({', '.join(by)}) ({fn}_over_time({metric}{{{sel}}}[{self.window}s]))"
        return {_key(r["metric"], by): r["value"] for r in self.prom.query(q, self.end)}

    def _memory(self, sel: str) -> list[Ranked]:
        """Per process: the highest per-step peaks and the last step-end memory."""
        rk = RANK_LABELS
        peak = self._over_time("max", "training_memory_peak_allocated_bytes", sel, rk)
        reserved = self._over_time("max", "training_memory_peak_reserved_bytes", sel, rk)
        allocated = self._over_time("last", "training_memory_allocated_bytes", sel, rk)
        rss_last = self._over_time("last", "training_memory_rss_bytes", sel, rk)
        out = []
        for key in sorted(set(peak) | set(allocated) | set(rss_last), key=lambda k: (_rank_sort(k[2]), k[0])):
            who = Who(int(key[2]) if key[2].isdigit() else None, key[1], key[0])
            if key in peak or key in allocated:
                memory = Memory(
                    kind="cuda",
                    peak_allocated_bytes=_bytes(peak.get(key)),
                    last_bytes=_bytes(allocated.get(key)),
                    peak_reserved_bytes=_bytes(reserved.get(key)),
                )
            else:
                memory = Memory(kind="cpu", last_bytes=_bytes(rss_last[key]))
            out.append(Ranked(who, memory))
        return out

    def _gpus(self, sel: str) -> list[Gpu]:
        """Per GPU (host, hw_id): mean and min of ``hw_gpu_utilization_ratio``."""
        by = ("host_name", "hw_id", "gpu_index", "hw_model")
        agg: dict = {}
        for fn in ("avg", "min"):
            q = f"{fn} by ({', '.join(by)}) ({fn}_over_time(hw_gpu_utilization_ratio{{{sel}}}[{self.window}s]))"
            for r in self.prom.query(q, self.end):
                k = _key(r["metric"], by)
                agg.setdefault(k, {})[fn] = r["value"]
        out = [
            Gpu(
                host=k[0], gpu=k[1], index=k[2], model=k[3], mean=v.get("avg", 0.0), min=v.get("min", v.get("avg", 0.0))
            )
            for k, v in agg.items()
        ]
        return sorted(out, key=lambda g: (g.host, _rank_sort(g.index), g.gpu))


def _bytes(value: float | None) -> int | None:
    """A byte count Prometheus gives as a number."""
    return None if value is None else int(round(value))


def jobs_from_deltas(deltas: dict[tuple, float]) -> list[Ranked]:
    """Per process, a ``job`` section from Prometheus: ``deltas`` are the increases of
    ``training_job_time_seconds_total`` over the range by (instance, host, rank,
    activity); a process that began in the range counts its start-up (its series begin
    with it). Wall time is what the range accounted: the sum of its activities."""
    by_process: dict[tuple, dict[str, float]] = {}
    for (instance, host, rank, activity), seconds in deltas.items():
        if activity and seconds > 0:
            by_process.setdefault((instance, host, rank), {})[activity] = seconds
    out = []
    for (instance, host, rank), act in sorted(by_process.items(), key=lambda kv: (kv[0][2].zfill(6), kv[0][0])):
        wall = sum(act.values())
        named = sorted((k for k in act if k not in SYMBOLS), key=lambda k: -act[k])
        activities = {k: act.get(k, 0.0) for k in SYMBOLS} | {k: act[k] for k in named}
        job = Job(
            wall_s=wall,
            goodput=act.get("train", 0.0) / wall if wall > 0 else 0.0,
            activities=activities,
            named=tuple(named),
        )
        out.append(Ranked(Who(int(rank) if rank.isdigit() else None, host, instance), job))
    return out


def _rank_sort(label: str) -> tuple:
    return (0, int(label), "") if label.isdigit() else (1, 0, label)


def _known(runs: list[dict]) -> str:
    if not runs:
        return ""
    items = [", ".join(f"{k}={v}" for k, v in sorted(r.items())) for r in runs[:8]]
    more = f" (+{len(runs) - 8} more)" if len(runs) > 8 else ""
    return "; runs in range: " + " | ".join(items) + more


def _fmt_range(start: float, end: float) -> str:
    fmt = "%Y-%m-%d %H:%M:%S"
    return f"{time.strftime(fmt, time.localtime(start))} .. {time.strftime(fmt, time.localtime(end))}"
