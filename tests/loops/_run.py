"""Run one loop-shape script under ``opentelemetry-instrument``, exporting to a real
OTLP/gRPC receiver on loopback, and collect what came out: exit status, stdout,
stderr, the script's ``TRUTH`` line, the run-end summary JSON and the spans.

Also a command line, to look at one script by hand:

    .venv/bin/python -m tests.loops._run nanogpt_accum [--plain]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from tests.otlp_receiver import OTLPReceiver, attributes
from tests.scripts.harness import BIN, ROOT, otel_env, run

HERE = Path(__file__).resolve().parent
STEP_DETECTION_LINE = "otel-training: step detection"
TIMEOUT_S = 240.0


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
    error: Optional[str] = None  # the runner itself failed (timeout, ...)

    def stderr_tail(self, n: int = 3000) -> str:
        return self.stderr[-n:]

    def step_detection_lines(self) -> List[str]:
        return [ln for ln in self.stderr.splitlines() if ln.startswith(STEP_DETECTION_LINE)]


def parse_truth(stdout: str) -> Optional[dict]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("TRUTH ")]
    return json.loads(lines[-1][len("TRUTH "):]) if lines else None


LOOP_LOCK = Path(tempfile.gettempdir()) / f"otel-training-loops-{os.getuid()}.lock"


def run_loop(name: str, extra_env: Optional[Dict[str, str]] = None, timeout: float = TIMEOUT_S) -> LoopRun:
    """Run ``tests/loops/<name>.py`` instrumented; never raises for a failing script.
    Scripts run at the same time take turns for their timed loops (``LOOPS_LOOP_LOCK``)."""
    out = LoopRun(name)
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
            LOOPS_LOOP_LOCK=str(LOOP_LOCK),
            **(extra_env or {}),
        )
        cmd = [str(BIN / "opentelemetry-instrument"), sys.executable, str(script_path(name))]
        t0 = time.monotonic()
        try:
            r = run(cmd, env, timeout=timeout)
        except AssertionError as exc:  # timeout: harness.Run kills the process
            out.error = str(exc)[-3000:]
            out.wall_s = time.monotonic() - t0
            return out
        out.wall_s = time.monotonic() - t0
        out.returncode = r.proc.returncode
        out.stdout, out.stderr = r.stdout, r.stderr
        out.truth = parse_truth(out.stdout)
        try:
            out.summary = json.loads(summary_file.read_text())
        except (OSError, ValueError) as exc:
            out.summary_error = f"{type(exc).__name__}: {exc}"
        # Spans are flushed at shutdown, before the process exits; a short grace anyway.
        receiver.wait_for(lambda rx: False, timeout=0.3)
        out.roots = [attributes(span.attributes) for _, span in receiver.spans()
                     if span.name == "step" and not span.parent_span_id]
    return out


def main(argv: List[str]) -> int:
    import subprocess

    name = argv[0]
    if "--plain" in argv:
        return subprocess.call([sys.executable, str(script_path(name))], cwd=ROOT)
    r = run_loop(name)
    print(f"rc={r.returncode} wall={r.wall_s:.1f}s error={r.error}")
    print("TRUTH", json.dumps(r.truth, indent=1))
    if r.summary:
        s = {k: v for k, v in r.summary.items() if k in ("coverage", "self_check")}
        s["modes"] = {m: {k: v for k, v in d.items() if k != "phases"} | {"phases": [
            (p["name"], p["parent"], round(p["total_s"], 4), p["count"]) for p in d["phases"]]}
            for m, d in r.summary["modes"].items()}
        print("SUMMARY", json.dumps(s, indent=1))
    else:
        print("no summary:", r.summary_error)
    by_mode: Dict[str, int] = {}
    for a in r.roots:
        by_mode[a.get("training.mode")] = by_mode.get(a.get("training.mode"), 0) + 1
    print("ROOT SPANS", by_mode)
    print("STDERR tail:\n" + r.stderr_tail(2000))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
