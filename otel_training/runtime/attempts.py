"""A restarted run's attempts: the restart time, and the progress a resume lost.

``torchrun --max-restarts`` restarts every rank of a failed run as a new process with
the same ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT`` one higher; a
scheduler's requeue may rerun a job with the same ``OTEL_TRAINING_RUN_ID``. Each such
process keeps its attempt's record in one small JSON file per run and rank under
``OTEL_TRAINING_ATTEMPTS_DIR``, rewritten every ``WRITE_EVERY_S`` seconds once steps
are taken, and at exit (SIGTERM included). The next attempt reads it at start:

- restart time: from the previous attempt's end (its last record) to this process's
  start;
- lost progress: where the framework tells its global step (HF Trainer, Lightning:
  record/global_step.py), the train time the previous attempt spent on the steps after
  the one this attempt resumed from, which this attempt does again.

A run id we made up (no torchrun, no ``OTEL_TRAINING_RUN_ID``) names one process
only: no file is kept for it. A run's folder untouched for ``KEEP_S`` (7 days) is
removed when a later run starts in the same folder (``torchrun --standalone`` makes a
new run id each time).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_training import semconv as sc

WRITE_EVERY_S = 10.0  # a killed attempt's record is at most this old
_MAX_ATTEMPTS = 100  # earlier attempts kept in a file (the oldest dropped)
KEEP_S = 7 * 86_400.0  # a run's folder with nothing written for this long is removed
RESTART, LOST = sc.ACTIVITY_RESTART, "lost_progress"  # the run's own activities (the run view)


def default_dir() -> str:
    """The node's temporary directory, one folder per user."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"otel-training-attempts-{uid}")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:120] or "_"


class AttemptFile:
    """This rank's record of each attempt of one run (``previous``: the earlier ones,
    read at start, oldest first; empty for a run's first attempt)."""

    def __init__(self, directory: str, run_id: str, rank: int, restart_count: int | None) -> None:
        self.path = Path(directory) / _safe(run_id) / f"rank-{int(rank)}.json"
        self.run_id = run_id
        self.rank = int(rank)
        self.restart_count = restart_count  # torchrun's; None: a run id the user set
        self.previous: list[dict] = []

    @property
    def number(self) -> int:
        """This attempt's number (0: the first)."""
        return len(self.previous)

    def load(self) -> list[dict]:
        """The earlier attempts of this run, where this process restarts it: under
        torchrun, a restart count above 0 and a file whose last attempt had a lower one
        (count 0 is a new run, whatever an older run of the same id left); with a run id
        the user set, any file of that id."""
        self.previous = []
        if self.restart_count == 0:
            return self.previous
        try:
            with open(self.path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError):  # none yet, or unreadable: a first attempt
            return self.previous
        if not isinstance(data, dict):
            return self.previous
        attempts = data.get("attempts")
        if data.get("run_id") != self.run_id or not isinstance(attempts, list) or not attempts:
            return self.previous
        attempts = [a for a in attempts if isinstance(a, dict)]
        if not attempts:
            return self.previous
        last = attempts[-1].get("restart_count")
        if self.restart_count is not None and (not isinstance(last, int) or last >= self.restart_count):
            return self.previous
        self.previous = attempts[-_MAX_ATTEMPTS:]
        return self.previous

    def write(self, record: Mapping[str, Any]) -> None:
        """The file holds the earlier attempts and ``record`` (this one), replaced whole."""
        data = {"run_id": self.run_id, "rank": self.rank, "attempts": [*self.previous, dict(record)]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".attempt-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(data, fh)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


_OURS = re.compile(r"^(rank-\d+\.json|\.attempt-.+)$")  # what a run folder of ours holds


def prune(directory: str | os.PathLike, keep: str | os.PathLike, now: float | None = None) -> int:
    """Remove the run folders under ``directory`` (not ``keep``) whose files were all
    last written more than ``KEEP_S`` ago; how many went. Only what we write there is
    touched (``rank-N.json``, a write's leftover temporary file); nothing raises."""
    cutoff = (time.time() if now is None else now) - KEEP_S
    removed = 0
    try:
        runs = [p for p in Path(directory).iterdir() if p != Path(keep) and p.is_dir() and not p.is_symlink()]
    except OSError:
        return 0
    for run in runs:
        try:
            if run.stat().st_mtime > cutoff:  # (a folder just made, its first file not yet in)
                continue
            files = list(run.iterdir())
            if not all(_OURS.match(f.name) and f.is_file() for f in files):
                continue  # something of someone else's: left alone
            if any(f.stat().st_mtime > cutoff for f in files):
                continue
            for f in files:
                f.unlink()
            run.rmdir()
            removed += 1
        except OSError:  # another run pruning at once, or not ours to remove
            continue
    return removed


def attempt_file(
    directory: str | None, run_id: str, rank: int, environ: Mapping[str, str], child: bool | None = None
) -> AttemptFile | None:
    """The attempt file of this process, or None: attempts not kept
    (``OTEL_TRAINING_ATTEMPTS_DIR=none``), a run id made up for this process, or a
    ``multiprocessing`` child outside torchrun (``mp.spawn``'s ranks share one id and,
    without ``RANK``, one rank number)."""
    if directory == "":
        return None
    if child is None:
        import multiprocessing

        child = multiprocessing.parent_process() is not None
    count = environ.get("TORCHELASTIC_RESTART_COUNT")
    restart: int | None = None
    if count is not None and environ.get("TORCHELASTIC_RUN_ID"):
        try:
            restart = int(count)
        except ValueError:
            return None
    elif not environ.get("OTEL_TRAINING_RUN_ID") or (child and "RANK" not in environ):
        return None
    return AttemptFile(directory or default_dir(), run_id, rank, restart)


def lost_progress(previous: Mapping[str, Any], resumed_at: int | None) -> tuple[int, float]:
    """(steps, train seconds) the ``previous`` attempt spent beyond global step
    ``resumed_at``, where this attempt resumed: the train time since its save at that
    step; all of it if it had resumed there (or before) itself; else its pace times the
    steps. (0, 0.0) where a global step is not known."""
    last = previous.get("global_step")
    if resumed_at is None or not isinstance(last, int) or last <= resumed_at:
        return 0, 0.0
    steps = last - resumed_at
    train = float(previous.get("train_s") or 0.0)
    saved = {s[0]: float(s[1]) for s in previous.get("saves") or () if isinstance(s, list) and len(s) == 2}
    began = previous.get("resumed_at")
    if resumed_at in saved:
        lost = train - saved[resumed_at]
    elif isinstance(began, int) and resumed_at <= began:
        lost = train
    else:
        done = last - (began if isinstance(began, int) else 0)
        lost = train * steps / done if done > 0 else train
    return steps, max(0.0, min(train, lost))


def run_view(attempts: Sequence[Mapping[str, Any]]) -> dict:
    """The run over its attempts (the last is this one): wall time (the attempts and
    the restarts between them) by activity, with the lost progress taken out of
    ``train``, and goodput."""
    activities: dict[str, float] = {}
    wall = restart = lost = 0.0
    for a in attempts:
        acts = a.get("activities") or {}
        for k, v in acts.items():
            activities[k] = activities.get(k, 0.0) + float(v or 0.0)
        own = float(a.get("wall_s") or 0.0)
        tail = own - sum(float(v or 0.0) for v in acts.values())
        if tail > 0:  # a record written before the attempt ended: its end
            activities["shutdown"] = activities.get("shutdown", 0.0) + tail
        wall += own
        restart += float(a.get("restart_s") or 0.0)
        lost += float(a.get("lost_progress_s") or 0.0)
    lost = min(lost, activities.get("train", 0.0))
    activities["train"] = activities.get("train", 0.0) - lost
    activities[LOST] = lost
    activities[RESTART] = restart
    wall += restart
    return {
        "attempts": len(attempts),
        "wall_s": wall,
        "goodput": activities["train"] / wall if wall > 0 else 0.0,
        "activities": activities,
        "restart_s": restart,
        "lost_progress_s": lost,
        "lost_steps": sum(int(a.get("lost_steps") or 0) for a in attempts),
    }
