"""Where a report's numbers come from: run-end summary files or Prometheus.

Both sources return the same *report* dict: the run-end summary's ``modes`` shape
(aggregated over ranks) plus ``ranks`` (per process, per mode), ``gpus`` (per GPU
utilization) and ``gpu_utilization`` (all GPUs). Failures raise :class:`ReportError`
with a one-line message.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime
from typing import Dict, Iterable, List, Optional, Tuple

from otel_training import semconv as sc

SUMMARY_SCHEMA = "otel-training/summary/v1"


class ReportError(Exception):
    """A problem the user must fix (bad file, unreachable server, unknown run)."""


# ----------------------------------------------------------------------------- merging
def _new_mode() -> dict:
    return {"steps": 0, "samples": 0, "step_time_s": 0.0, "wall_s": 0.0, "throughput_sps": 0.0,
            "_phases": {}, "gpu_idle_s": {}}


def add_rank(modes: Dict[str, dict], mode: str, steps: float, samples: float, step_time: float,
             phases: Iterable[Tuple[str, str, float, float]], idle: Dict[str, float],
             wall: Optional[float] = None) -> dict:
    """Add one rank's numbers for ``mode``; returns that rank's own mode row."""
    agg = modes.setdefault(mode, _new_mode())
    own = {"steps": int(round(steps)), "samples": int(round(samples)), "step_time_s": step_time,
           "step_mean_s": step_time / steps if steps else 0.0, "phases": {}, "phase_mean_s": {}}
    own["throughput_sps"] = samples / (wall or step_time) if samples and (wall or step_time) else 0.0
    agg["steps"] += own["steps"]
    agg["samples"] += own["samples"]
    agg["step_time_s"] += step_time
    agg["wall_s"] = max(agg["wall_s"], wall or step_time)
    agg["throughput_sps"] += own["throughput_sps"]
    for name, parent, total, count in phases:
        t, c = agg["_phases"].get((name, parent), (0.0, 0))
        agg["_phases"][(name, parent)] = (t + total, c + count)
        if parent == sc.SPAN_STEP and step_time:
            own["phases"][name] = total / step_time
            own["phase_mean_s"][name] = total / steps if steps else 0.0
    for name, secs in idle.items():
        agg["gpu_idle_s"][name] = agg["gpu_idle_s"].get(name, 0.0) + secs
    return own


def finish_modes(modes: Dict[str, dict]) -> Dict[str, dict]:
    """Turn accumulated totals into the summary's ``phases`` list with shares."""
    for m in modes.values():
        st, steps = m["step_time_s"], m["steps"]
        m["step_mean_s"] = st / steps if steps else 0.0
        m["phases"] = [
            {"name": n, "parent": p, "total_s": t, "mean_s": t / steps if steps else 0.0,
             "count": int(round(c)), "share": t / st if st else 0.0}
            for (n, p), (t, c) in sorted(m.pop("_phases").items(), key=lambda kv: -kv[1][0])]
        idle = sum(m["gpu_idle_s"].values())
        m["gpu_idle_share"] = idle / st if (st and m["gpu_idle_s"]) else None
    return modes


# ----------------------------------------------------------------------- summary files
def read_summary(path: str) -> dict:
    """One validated run-end summary file."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise ReportError(f"summary file {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"cannot read summary file {path!r}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"summary file {path!r} is not valid JSON (line {exc.lineno}: "
                          f"{exc.msg})") from None
    if not isinstance(data, dict) or data.get("schema") != SUMMARY_SCHEMA:
        raise ReportError(f"{path!r} is not an otel-training run summary (expected schema "
                          f"{SUMMARY_SCHEMA!r}; write one with OTEL_TRAINING_SUMMARY_FILE)")
    modes = data.get("modes")
    try:
        for m in modes.values():
            for key in ("steps", "step_time_s"):
                float(m[key])
            for p in m.get("phases") or []:
                p["name"], float(p["total_s"])
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ReportError(f"summary file {path!r} is malformed (missing or bad field "
                          f"{exc})") from None
    return data


def load_summaries(paths: List[str]) -> dict:
    """Merge one summary file per rank into a report."""
    files = [(p, read_summary(p)) for p in paths]
    seen = {}
    for path, s in files:
        key = (s.get("run_id"), s.get("rank"), s.get("pid"), s.get("host"))
        if key in seen:
            raise ReportError(f"{path!r} and {seen[key]!r} are the same process's summary")
        seen[key] = path
    runs = sorted({str(s.get("run_id")) for _, s in files})
    modes: Dict[str, dict] = {}
    ranks: Dict[str, List[dict]] = {}
    tel = {"spans_dropped": 0, "steps_dropped": 0, "export_failures": 0, "errors": 0}
    coverage: List[dict] = []
    checks: List[dict] = []
    for path, s in sorted(files, key=lambda f: (f[1].get("rank") or 0, f[0])):
        who = {"rank": s.get("rank"), "host": s.get("host")}
        if s.get("coverage"):
            coverage.append({**who, **s["coverage"]})
        checks.extend({**who, **f} for f in s.get("self_check") or ())
        for mode, m in (s.get("modes") or {}).items():
            if not m.get("steps"):
                continue
            phases = [(p["name"], p.get("parent", sc.SPAN_STEP), float(p["total_s"]),
                       float(p.get("count") or 0)) for p in m.get("phases") or []]
            own = add_rank(modes, mode, float(m["steps"]), float(m.get("samples") or 0),
                           float(m["step_time_s"]), phases, dict(m.get("gpu_idle_s") or {}),
                           wall=float(m.get("wall_s") or 0) or None)
            own.update(rank=s.get("rank"), host=s.get("host"), pid=s.get("pid"), file=path,
                       step_p50_s=m.get("step_p50_s"), step_p90_s=m.get("step_p90_s"),
                       step_max_s=m.get("step_max_s"))
            ranks.setdefault(mode, []).append(own)
        for k in tel:
            tel[k] += int((s.get("telemetry") or {}).get(k) or 0)
    first = files[0][1]
    for mode, rows in ranks.items():
        modes[mode]["step_max_s"] = max((r["step_max_s"] or 0.0) for r in rows)
        if len(rows) == 1:
            modes[mode].update(step_p50_s=rows[0]["step_p50_s"], step_p90_s=rows[0]["step_p90_s"])
    return {
        "source": "summary", "files": [p for p, _ in files],
        "service": first.get("service"), "run": ", ".join(runs),
        "timing": first.get("timing"), "world_size": first.get("world_size"),
        "range": {"start": min(s.get("started_at") or 0 for _, s in files),
                  "end": max(s.get("ended_at") or 0 for _, s in files)},
        "modes": finish_modes(modes), "ranks": ranks, "gpus": [], "gpu_utilization": None,
        "telemetry": tel, "coverage": coverage, "self_check": checks,
    }


# --------------------------------------------------------------------------- Prometheus
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d|w)$")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``90s``, ``15m``, ``2h``, ``1d`` → seconds."""
    m = _DURATION.match(text.strip())
    if not m or float(m.group(1)) <= 0:
        raise ReportError(f"{text!r} is not a duration: use e.g. 30m, 2h, 1d")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def parse_time(text: str) -> float:
    """Unix seconds or ISO 8601 (``2025-01-31T12:00:00Z``) → unix seconds."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ReportError(f"{text!r} is not a time: use unix seconds or ISO 8601") from None
    if dt.tzinfo is None:
        dt = dt.astimezone()
    return dt.timestamp()


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def run_matchers(run: str) -> List[str]:
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

    def query(self, promql: str, at: float) -> List[dict]:
        """``/api/v1/query`` → list of ``{"metric": labels, "value": float}``."""
        data = urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}"}).encode()
        req = urllib.request.Request(self.url + "/api/v1/query", data=data, method="POST",
                                     headers={"Content-Type": "application/x-www-form-urlencoded"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
            err = _api_error(body)
            if err:
                raise ReportError(f"Prometheus at {self.url} rejected the query: {err}") from None
            raise ReportError(f"Prometheus at {self.url} answered HTTP {exc.code} "
                              f"(is this a Prometheus server?)") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ReportError(f"cannot reach Prometheus at {self.url}: {reason}") from None
        try:
            doc = json.loads(body)
            if doc.get("status") != "success":
                raise ReportError(f"Prometheus at {self.url} rejected the query: "
                                  f"{doc.get('error', 'unknown error')}")
            result = doc["data"]["result"]
            if doc["data"]["resultType"] != "vector":
                raise ValueError(doc["data"]["resultType"])
            return [{"metric": r["metric"], "value": float(r["value"][1])} for r in result]
        except ReportError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ReportError(f"{self.url} did not answer like the Prometheus HTTP API "
                              f"(/api/v1/query)") from None


def _api_error(body: bytes) -> Optional[str]:
    try:
        doc = json.loads(body)
        return f"{doc.get('errorType', 'error')}: {doc['error']}"
    except Exception:
        return None


_RANK_LABELS = ("instance", "host_name", "training_rank")


def _series(labels: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in labels.items() if k != "__name__"))


def _key(labels: dict, names: Tuple[str, ...]) -> tuple:
    return tuple(labels.get(n, "") for n in names)


class PrometheusReport:
    """Collects a report for one run over ``[start, end]`` from Prometheus."""

    def __init__(self, prom: Prometheus, start: float, end: float) -> None:
        if end <= start:
            raise ReportError("the time range is empty: --start must be before --end")
        self.prom, self.start, self.end = prom, start, end
        self.window = max(1, int(math.ceil(end - start)))

    def _deltas(self, metric: str, sel: str, by: Tuple[str, ...]) -> Dict[tuple, float]:
        """Per-series counter increase over the range (a series born inside the range
        counts from 0), summed by ``by`` labels."""
        q = f"last_over_time({metric}{{{sel}}}[{self.window}s])"
        end = self.prom.query(q, self.end)
        before = {_series(r["metric"]): r["value"] for r in self.prom.query(q, self.start)}
        out: Dict[tuple, float] = {}
        for r in end:
            delta = r["value"] - before.get(_series(r["metric"]), 0.0)
            if delta < 0:  # reset (should not happen: one series per process)
                delta = r["value"]
            k = _key(r["metric"], by)
            out[k] = out.get(k, 0.0) + delta
        return out

    def runs(self) -> List[dict]:
        q = (f"count by (job, training_run_id) (last_over_time("
             f"training_step_duration_seconds_count[{self.window}s]))")
        return [r["metric"] for r in self.prom.query(q, self.end)]

    def resolve(self, run: Optional[str]) -> str:
        """The label selector body for ``run`` (or the only run in range)."""
        if run:
            for sel in run_matchers(run):
                q = f"count(last_over_time(training_step_duration_seconds_count{{{sel}}}[{self.window}s]))"
                if self.prom.query(q, self.end):
                    return sel
            raise ReportError(f"no otel-training steps for run {run!r} in Prometheus at "
                              f"{self.prom.url} in {_fmt_range(self.start, self.end)}"
                              + _known(self.runs()))
        found = self.runs()
        if not found:
            raise ReportError(f"no otel-training steps in Prometheus at {self.prom.url} in "
                              f"{_fmt_range(self.start, self.end)}")
        if len(found) > 1:
            raise ReportError("several runs in range, pick one with --run" + _known(found))
        labels = found[0]
        keys = [k for k in ("training_run_id", "job") if labels.get(k)]
        return ",".join(f"{k}={_quote(labels[k])}" for k in keys)

    def collect(self, run: Optional[str]) -> dict:
        sel = self.resolve(run)
        rk = _RANK_LABELS
        mk = ("training_mode",)
        st = self._deltas("training_step_duration_seconds_sum", sel, rk + mk)
        sn = self._deltas("training_step_duration_seconds_count", sel, rk + mk)
        smp = self._deltas("training_samples_total", sel, rk + mk)
        pby = rk + mk + ("training_phase", "training_phase_parent")
        ps = self._deltas("training_phase_duration_seconds_sum", sel, pby)
        pc = self._deltas("training_phase_duration_seconds_count", sel, pby)
        idle = self._deltas("training_gpu_idle_seconds_total", sel, rk + mk + ("training_phase",))
        modes: Dict[str, dict] = {}
        ranks: Dict[str, List[dict]] = {}
        for key in sorted(sn, key=lambda k: (_rank_sort(k[2]), k[0])):
            inst, host, rank_label, mode = key
            if sn[key] <= 0 or not mode:
                continue
            phases = [(k[4], k[5] or sc.SPAN_STEP, v, pc.get(k, 0.0))
                      for k, v in ps.items() if k[:4] == key]
            idles = {k[4]: v for k, v in idle.items() if k[:4] == key}
            own = add_rank(modes, mode, sn[key], smp.get(key, 0.0), st.get(key, 0.0), phases, idles)
            own.update(rank=int(rank_label) if rank_label.isdigit() else None, host=host,
                       instance=inst)
            ranks.setdefault(mode, []).append(own)
        for rows in ranks.values():
            if len(rows) == 1 and rows[0]["rank"] is None:
                rows[0]["rank"] = 0
        gpus = self._gpus(sel)
        hosts = sorted({r["host"] for rows in ranks.values() for r in rows if r.get("host")})
        if not gpus and hosts:  # sampled by a process outside the run (otel-training agent)
            gpus = self._gpus("host_name=~" + _quote("|".join(re.escape(h) for h in hosts)))
        utils = [g["mean"] for g in gpus]
        tel = {}
        for name, metric in (("spans_dropped", "training_telemetry_spans_dropped_total"),
                             ("steps_dropped", "training_telemetry_steps_dropped_total"),
                             ("export_failures", "training_telemetry_export_failures_total"),
                             ("errors", "training_telemetry_errors_total")):
            tel[name] = int(round(sum(self._deltas(metric, sel, ()).values())))
        return {
            "source": "prometheus", "prometheus": self.prom.url, "selector": "{" + sel + "}",
            "run": run or sel, "range": {"start": self.start, "end": self.end},
            "modes": finish_modes(modes), "ranks": ranks, "gpus": gpus,
            "gpu_utilization": ({"mean": sum(utils) / len(utils),
                                 "min": min(g["min"] for g in gpus)} if gpus else None),
            "telemetry": tel,
        }

    def _gpus(self, sel: str) -> List[dict]:
        """Per GPU (host, hw_id): mean and min of ``hw_gpu_utilization_ratio``."""
        by = ("host_name", "hw_id", "gpu_index", "hw_model")
        agg = {}
        for fn in ("avg", "min"):
            q = (f"{fn} by ({', '.join(by)}) ({fn}_over_time("
                 f"hw_gpu_utilization_ratio{{{sel}}}[{self.window}s]))")
            for r in self.prom.query(q, self.end):
                k = _key(r["metric"], by)
                agg.setdefault(k, {})[fn] = r["value"]
        out = [{"host": k[0], "gpu": k[1], "index": k[2], "model": k[3],
                "mean": v.get("avg", 0.0), "min": v.get("min", v.get("avg", 0.0))}
               for k, v in agg.items()]
        return sorted(out, key=lambda g: (g["host"], _rank_sort(g["index"]), g["gpu"]))


def _rank_sort(label: str) -> tuple:
    return (0, int(label), "") if label.isdigit() else (1, 0, label)


def _known(runs: List[dict]) -> str:
    if not runs:
        return ""
    items = [", ".join(f"{k}={v}" for k, v in sorted(r.items())) for r in runs[:8]]
    more = f" (+{len(runs) - 8} more)" if len(runs) > 8 else ""
    return "; runs in range: " + " | ".join(items) + more


def _fmt_range(start: float, end: float) -> str:
    fmt = "%Y-%m-%d %H:%M:%S"
    return f"{time.strftime(fmt, time.localtime(start))} .. {time.strftime(fmt, time.localtime(end))}"
