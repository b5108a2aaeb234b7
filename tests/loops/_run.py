"""Run one loop-shape script under ``opentelemetry-instrument``, exporting to a real
OTLP/gRPC receiver on loopback, and collect what came out: exit status, stdout,
stderr, the script's ``TRUTH`` line, the run-end summary JSON and the spans.

Also a command line, to look at scripts by hand:

    .venv/bin/python -m tests.loops._run nanogpt_accum [--plain]
    .venv/bin/python -m tests.loops._run --table [NAME ...]     # truth vs. summary, all scripts
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from tests.otlp_receiver import OTLPReceiver, attributes
from tests.scripts.harness import BIN, ROOT, otel_env

HERE = Path(__file__).resolve().parent
STEP_DETECTION_LINE = "otel-training: step detection"
TIMEOUT_S = 240.0


# Settings a script runs with besides the suite's own: ordinary_epochs is read as a user
# reads a run, from the run-end table and verdict on stderr.
SCRIPT_ENV: Dict[str, Dict[str, str]] = {"ordinary_epochs": {"OTEL_TRAINING_SUMMARY": "true"}}


def script_path(name: str) -> Path:
    return HERE / f"{name}.py"


@dataclass
class LoopRun:
    name: str
    returncode: Optional[int] = None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    truth: Optional[dict] = None
    summary: Optional[dict] = None
    summary_error: Optional[str] = None
    roots: List[dict] = field(default_factory=list)  # attributes of every root "step" span
    # every span as (name, span_id, parent_span_id, start_ns, end_ns, attributes)
    spans: List[tuple] = field(default_factory=list)
    # the last exported points of each hardware gauge ("hw.", "process.gpu.", "system.")
    gauges: Dict[str, List[tuple]] = field(default_factory=dict)  # name -> [(attributes, value)]
    # the last exported points of every counter and gauge: name -> [(attributes, value)]
    points: Dict[str, List[tuple]] = field(default_factory=dict)
    error: Optional[str] = None  # the runner itself failed (timeout, ...)

    def stderr_tail(self, n: int = 3000) -> str:
        return self.stderr[-n:]

    def step_detection_lines(self) -> List[str]:
        return [ln for ln in self.stderr.splitlines() if ln.startswith(STEP_DETECTION_LINE)]


def parse_truth(stdout: str) -> Optional[dict]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("TRUTH ")]
    return json.loads(lines[-1][len("TRUTH "):]) if lines else None


_SESSION: Dict[str, Path] = {}
_SESSION_LOCK = threading.Lock()


def _session_dir() -> Path:
    """A folder shared by the scripts of this test session: ``loop.lock`` and ``pids/``."""
    with _SESSION_LOCK:
        if "dir" not in _SESSION:
            d = Path(tempfile.mkdtemp(prefix="otel-training-loops-"))
            (d / "pids").mkdir()
            _SESSION["dir"] = d
        return _SESSION["dir"]


def _resume_stopped(session: Path) -> None:
    """SIGCONT every registered script, unless one is timing its loop (it resumes them
    itself): a script that died in its loop must not leave the others stopped."""
    fd = os.open(session / "loop.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return
    try:
        for f in (session / "pids").iterdir():
            try:
                os.kill(int(f.name), signal.SIGCONT)
            except (OSError, ValueError):
                pass
    finally:
        os.close(fd)


def cleanup() -> None:
    """Remove the session folder (once every script has exited)."""
    with _SESSION_LOCK:
        d = _SESSION.pop("dir", None)
    if d is not None:
        shutil.rmtree(d, ignore_errors=True)


def run_loop(name: str, extra_env: Optional[Dict[str, str]] = None, timeout: float = TIMEOUT_S) -> LoopRun:
    """Run ``tests/loops/<name>.py`` instrumented; never raises for a failing script.

    Scripts running at the same time take turns to time their loops, each alone on the
    machine (see ``_truth.py``: ``LOOPS_LOOP_LOCK``, ``LOOPS_PIDS_DIR``)."""
    out = LoopRun(name)
    session = _session_dir()
    with tempfile.TemporaryDirectory(prefix=f"loops-{name}-") as tmp, OTLPReceiver() as receiver:
        summary_file = Path(tmp) / "summary.json"
        env = otel_env(
            receiver.endpoint, Path(tmp),
            OTEL_SERVICE_NAME=f"loops-{name}",
            OTEL_EXPORTER_OTLP_INSECURE="true",
            OTEL_TRAINING_SUMMARY_FILE=str(summary_file),
            OTEL_TRAINING_HARDWARE="false",
            OTEL_TRAINING_INTEGRATIONS="all",
            OTEL_TRAINING_TRACE_EVERY_N="1",
            OTEL_TRAINING_TRACE_MAX_PER_SECOND="100000",
            OTEL_TRAINING_SHUTDOWN_TIMEOUT="20",
            # Export at exit rather than during the loop: an exporter thread serializing
            # spans mid-loop competes with the training thread for the GIL and a core,
            # which is noise on top of the planted delays on a 2-core machine.
            OTEL_BSP_MAX_QUEUE_SIZE="100000",
            OTEL_BSP_MAX_EXPORT_BATCH_SIZE="100000",
            OTEL_BSP_SCHEDULE_DELAY="600000",
            OTEL_METRIC_EXPORT_INTERVAL="600000",
            HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore",
            LOOPS_LOOP_LOCK=str(session / "loop.lock"), LOOPS_PIDS_DIR=str(session / "pids"),
        )
        env.update(SCRIPT_ENV.get(name, {}))
        env.update(extra_env or {})
        cmd = [str(BIN / "opentelemetry-instrument"), sys.executable, str(script_path(name))]
        t0 = time.monotonic()
        # Start (and register) only while no script times its loop: the one that does
        # has stopped the others it knew of, and a new one must not run beside it.
        lock_fd = os.open(session / "loop.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_SH)
            proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
            pid_file = session / "pids" / str(proc.pid)
            pid_file.touch()
        finally:
            os.close(lock_fd)
        try:
            out.stdout, out.stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out.stdout, out.stderr = proc.communicate()
            out.error = f"{name} did not exit within {timeout:.0f} s; stderr tail:\n{out.stderr[-3000:]}"
        finally:
            pid_file.unlink()
            _resume_stopped(session)
        if out.error:
            out.wall_s = time.monotonic() - t0
            return out
        out.wall_s = time.monotonic() - t0
        out.returncode = proc.returncode
        out.truth = parse_truth(out.stdout)
        try:
            out.summary = json.loads(summary_file.read_text())
        except (OSError, ValueError) as exc:
            out.summary_error = f"{type(exc).__name__}: {exc}"
        # Spans are flushed at shutdown, before the process exits; a short grace anyway.
        receiver.wait_for(lambda rx: False, timeout=0.3)
        out.roots = [attributes(span.attributes) for _, span in receiver.spans()
                     if span.name == "step" and not span.parent_span_id]
        out.spans = [(sp.name, sp.span_id, sp.parent_span_id, sp.start_time_unix_nano, sp.end_time_unix_nano,
                      attributes(sp.attributes)) for _, sp in receiver.spans()]
        for _, metric in receiver.metrics():
            kind = "gauge" if metric.HasField("gauge") else "sum" if metric.HasField("sum") else None
            if kind is not None:
                out.points[metric.name] = [(attributes(pt.attributes), getattr(pt, pt.WhichOneof("value")))
                                           for pt in getattr(metric, kind).data_points]
            if metric.name.startswith(("hw.", "process.gpu.", "system.")) and metric.HasField("gauge"):
                out.gauges[metric.name] = [(attributes(pt.attributes), getattr(pt, pt.WhichOneof("value")))
                                           for pt in metric.gauge.data_points]
    return out


def compare(r: LoopRun) -> List[str]:
    """One script's TRUTH against what otel-training reported, as short lines."""
    if r.error or r.truth is None or r.summary is None:
        return [f"{r.name}: rc={r.returncode} error={r.error or r.summary_error or 'no TRUTH'}"]
    t, s = r.truth, r.summary
    modes = s.get("modes", {})
    steps = {m: modes.get(m, {}).get("steps", 0) for m in ("train", "eval")}
    roots: Dict[str, int] = {}
    for a in r.roots:
        roots[str(a.get("training.mode"))] = roots.get(str(a.get("training.mode")), 0) + 1
    lines = [f"{r.name}: rc={r.returncode} wall={r.wall_s:.1f}s steps train {steps['train']}/{t['train_steps']} "
             f"eval {steps['eval']}/{t['eval_steps']} (got/truth); spans {roots}; microbatches "
             f"{modes.get('train', {}).get('microbatches', '-')}/{t['microbatches']}; skipped "
             f"{modes.get('train', {}).get('skipped_updates', '-')}/{t['skipped_updates']}"]
    in_steps = sum(m.get("step_time_s", 0.0) for m in modes.values())
    outside = t.get("planted_outside_s", 0.0) + t.get("outside_after_last_step_s", 0.0)
    named = sum(n["total_s"] for n in (t.get("named") or {}).values())
    loop_s = t["loop_wall_s"] - outside - named
    lines.append(f"    coverage {in_steps / loop_s:.1%} of the {loop_s:.2f} s loop"
                 + (f" ({t['loop_wall_s']:.2f} s less {outside:.3f} s between steps"
                    + (f" and {named:.3f} s named" if named else "") + ")" if outside or named else "")
                 + f"; summary coverage={s.get('coverage', '-')}; self_check={s.get('self_check', '-')}")
    if t.get("planted_outside_s"):
        got, want = s.get("coverage", {}).get("outside_s", 0.0), t["planted_outside_s"]
        lines.append(f"    between steps: {got * 1e3:.2f} ms, planted {want * 1e3:.2f} ({(got / want - 1) * 100:+.1f}%; "
                     f"{t.get('outside_loop_ends', 0)} loop ends)")
    got_named = {n["name"]: n for n in s.get("coverage", {}).get("named") or ()}
    for name, want in sorted((t.get("named") or {}).items()):
        g = got_named.get(name, {"count": 0, "total_s": 0.0})
        lines.append(f"    named {name}: {g['count']}x {g['total_s'] * 1e3:.1f} ms, the script {want['count']}x "
                     f"{want['total_s'] * 1e3:.1f} ms")
    for mode, delays in sorted(t["planted"].items()):
        m = modes.get(mode)
        for name, want in sorted(delays.items()):
            got = (sum(p["total_s"] for p in m["phases"] if p["name"] == name) / m["steps"]) if m else 0.0
            lines.append(f"    {mode} {name}: {got * 1e3:.2f} ms/step, planted {want * 1e3:.2f} "
                         f"({(got / want - 1) * 100:+.1f}%)")
    return lines


def main(argv: List[str]) -> int:
    """``NAME [--plain]``: one script in detail; ``--table [NAME...]``: a comparison
    table for the given scripts (all of them by default), two at a time."""
    if argv and argv[0] == "--table":
        from concurrent.futures import ThreadPoolExecutor

        names = argv[1:] or sorted(p.stem for p in HERE.glob("*.py") if not p.name.startswith(("_", "test_")))
        with ThreadPoolExecutor(int(os.environ.get("LOOPS_JOBS", "2"))) as pool:
            for r in pool.map(run_loop, names):
                print("\n".join(compare(r)), flush=True)
        cleanup()
        return 0
    name = argv[0]
    if "--plain" in argv:
        return subprocess.call([sys.executable, str(script_path(name))], cwd=ROOT)
    r = run_loop(name)
    cleanup()
    print("\n".join(compare(r)))
    print(f"rc={r.returncode} wall={r.wall_s:.1f}s error={r.error}")
    print("TRUTH", json.dumps(r.truth, indent=1))
    if r.summary:
        s = {k: v for k, v in r.summary.items() if k in ("coverage", "self_check")}
        s["modes"] = {m: {**{k: v for k, v in d.items() if k != "phases"}, "phases": [
            (p["name"], p["parent"], round(p["total_s"], 4), p["count"]) for p in d["phases"]]}
            for m, d in r.summary["modes"].items()}
        print("SUMMARY", json.dumps(s, indent=1))
    else:
        print("no summary:", r.summary_error)
    print("STDERR tail:\n" + r.stderr_tail(2000))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
