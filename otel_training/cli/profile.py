"""``otel-training profile PID [--steps N]``: a few steps of a running, instrumented job
recorded with torch.profiler (docs/profiles.md).

The job listens while ``OTEL_TRAINING_PROFILE`` keeps ``demand`` on (``auto`` does):
this command leaves a request beside its ``<pid>.listening`` file and waits for the
answer, which names the Chrome trace file and the top operators. The job's steps and
exit are unchanged, but for the recorded steps' cost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid

from otel_training.aggregate.run_sections import Profile
from otel_training.diagnosis.profiles_text import profile_lines
from otel_training.runtime.profiling import MAX_DEMAND_STEPS, demand_dir


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's: alive, but not ours to ask)
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="otel-training profile",
        description="Record a few steps of a running, instrumented job with torch.profiler; print the trace file "
        "and the top operators (docs/profiles.md).",
    )
    p.add_argument("pid", type=int, metavar="PID", help="the training process (its rank's process under torchrun)")
    p.add_argument("--steps", type=int, default=2, help=f"steps to record (1 to {MAX_DEMAND_STEPS}; default 2)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the answer (default 120)")
    p.add_argument("--json", action="store_true", help="print the profile as the summary file's JSON")
    args = p.parse_args(argv)
    if not 1 <= args.steps <= MAX_DEMAND_STEPS:
        p.error(f"--steps must be from 1 to {MAX_DEMAND_STEPS}")
    folder = demand_dir()
    listening = os.path.join(folder, f"{args.pid}.listening")
    if not _alive(args.pid):
        print(f"otel-training profile: no process {args.pid}", file=sys.stderr)
        return 1
    if not os.path.exists(listening):
        print(
            f"otel-training profile: process {args.pid} is not listening: it is not instrumented by "
            "otel-training, OTEL_TRAINING_PROFILE leaves out demand, or it runs as another user or in another "
            f"container (it would have {listening})",
            file=sys.stderr,
        )
        return 1
    ident = uuid.uuid4().hex[:16]
    request = os.path.join(folder, f"{args.pid}.request")
    result = os.path.join(folder, f"{args.pid}.{ident}.result.json")
    with open(request + f".{ident}.tmp", "w", encoding="utf-8") as fh:
        json.dump({"id": ident, "steps": args.steps}, fh)
    os.replace(request + f".{ident}.tmp", request)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if os.path.exists(result):
            break
        if not _alive(args.pid):
            print(f"otel-training profile: process {args.pid} ended before its profile was read", file=sys.stderr)
            return 1
        time.sleep(0.2)
    else:
        try:
            os.remove(request)
        except OSError:
            pass
        print(
            f"otel-training profile: no answer from {args.pid} within {args.timeout:g} s (is it taking steps?)",
            file=sys.stderr,
        )
        return 1
    with open(result, encoding="utf-8") as fh:
        doc = json.load(fh)
    os.remove(result)
    if "trigger" not in doc:
        print(f"otel-training profile: {doc.get('error', 'no profile')}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    profile = Profile.from_dict(doc)
    print("\n".join(profile_lines([(None, profile)], indent="  ")))
    return 0 if profile.error is None else 1
