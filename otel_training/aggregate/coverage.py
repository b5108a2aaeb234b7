"""Coverage: how much of the training loop's wall time lies inside steps (or in
time the user named between steps), and the self-check that says when step
detection is in doubt (docs/steps.md)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from otel_training.aggregate.run_model import CheckFinding, NamedTime
from otel_training.aggregate.run_model import Coverage as CoverageSection
from otel_training.semconv import MODE_TRAIN

if TYPE_CHECKING:
    from otel_training.aggregate.between import BetweenRecord

_GAP_NS = 1_000_000  # gaps shorter than this are counted in the time, not as gaps
# Self-check thresholds (docs/steps.md).
CHECK_COVERAGE = 0.90
CHECK_MICROBATCHES = 512
CHECK_LONGEST_SHARE = 0.5
CHECK_LONGEST_MICROBATCHES = 4
CHECK_ONLY_STEP_MICROBATCHES = 32  # a run of one step holding this many backward passes
_RECENT_GAPS = 1024  # gaps a named phase that held steps can still claim as its own
_MAX_NAMES = 64  # names of named time between steps listed (the rest: "(other)")


class Coverage:
    """The training loop's wall time against the time inside steps, and the steps of
    several micro-batches the self-check looks at. Written by the pipeline thread as
    steps arrive (in time order: the assembler hands them on so); read at the end."""

    __slots__ = (
        "steps",
        "first_start",
        "last_end",
        "outside",
        "gaps",
        "largest_gap",
        "largest_gap_after",
        "longest",
        "longest_index",
        "longest_microbatches",
        "max_microbatches",
        "max_microbatches_index",
        "named_ns",
        "named",
        "_recent",
        "_after",
        "_lock",
    )

    def __init__(self) -> None:
        self.first_start: int | None = None
        self.last_end = 0
        self.outside = 0
        self.gaps = 0
        self.largest_gap = 0
        self.largest_gap_after: int | None = None
        self.steps = 0
        self.longest = 0  # the longest step of several micro-batches
        self.longest_index: int | None = None
        self.longest_microbatches = 0
        self.max_microbatches = 0
        self.max_microbatches_index: int | None = None
        self.named_ns = 0  # loop time in named phases between steps (not in a step)
        self.named: dict[str, list] = {}  # name -> [count, total ns] of named time between steps
        self._recent: deque[list[int]] = deque(maxlen=_RECENT_GAPS)  # [start, end] of the last gaps
        self._after = -1  # the last train step delivered (-1: none yet)
        self._lock = threading.Lock()

    def add(self, records: Sequence) -> None:
        """A batch of finished ``StepRecord``s, in time order (pipeline thread)."""
        with self._lock:
            last_end = self.last_end
            for r in records:  # (one step, inlined: this loop runs for every step)
                host = r.host
                start = host[0]
                if start > last_end:  # after the last train step before it (train numbering)
                    self._gap(start - last_end, r.train_before - 1, start)
                end = host[-1]
                if end > last_end:  # (a step that began inside named time may end before it)
                    last_end = end
                if r.microbatches > 1:
                    self._merged(r.number, r.microbatches, end - start)
            self.last_end = last_end
            self.steps += len(records)
            if records:  # the last train step so far (train numbering), for named time after it
                r = records[-1]
                self._after = r.train_before - (r.mode != MODE_TRAIN)

    def _gap(self, ns: int, after: int, start: int) -> None:
        """``ns`` between step ``after`` and the next (the first step: none)."""
        if self.first_start is None:
            self.first_start = start
            return
        self.outside += ns
        self._recent.append([start - ns, start])
        if ns >= _GAP_NS:
            self.gaps += 1
        if ns > self.largest_gap:
            self.largest_gap, self.largest_gap_after = ns, after

    def add_between(self, record: BetweenRecord) -> None:
        """Named time between steps (an ``aggregate.between.BetweenRecord``), after
        the steps that began before it: accounted for, and listed by name."""
        with self._lock:
            named = self.named
            p = record.phases[0]  # the outermost (the phases nested in it are in its time)
            name = p.name if p.name in named or len(named) < _MAX_NAMES else "(other)"
            slot = named.get(name)
            if slot is None:
                slot = named[name] = [0, 0]
            slot[0] += 1
            slot[1] += p.end - p.start
            if self.first_start is None:
                return  # before the first step: listed, outside the loop
            start, end = max(record.start, self.first_start), record.end
            last_end = self.last_end
            if start < last_end:  # steps ran inside it: the gaps between them are named
                self._claim(start, min(end, last_end))
            if end > last_end:
                if start > last_end:  # the unnamed time before it
                    self._gap(start - last_end, self._after, start)
                    last_end = start
                self.named_ns += end - last_end
                self.last_end = end

    def _claim(self, start: int, end: int) -> None:
        """The recent gaps' time within [start, end] is named, not outside."""
        recent = self._recent
        kept: list[list[int]] = []
        while recent and recent[-1][1] > start:
            a, b = recent.pop()
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                self.outside -= hi - lo
                self.named_ns += hi - lo
                if b > hi:
                    kept.append([hi, b])
                if lo > a:
                    kept.append([a, lo])
            else:
                kept.append([a, b])
        recent.extend(sorted(kept))

    def _merged(self, index: int, micro: int, duration: int) -> None:
        """Step ``index`` held ``micro`` > 1 micro-batches in ``duration`` ns."""
        if duration > self.longest:
            self.longest, self.longest_index, self.longest_microbatches = duration, index, micro
        if micro > self.max_microbatches:
            self.max_microbatches, self.max_microbatches_index = micro, index

    def to_dict(self, started_ns: int | None = None) -> dict:
        """The summary's ``coverage`` as the file's dict."""
        return self.section(started_ns).to_dict()

    def section(self, started_ns: int | None = None) -> CoverageSection:
        """The summary's ``coverage``; ``started_ns``: when instrumentation began."""
        with self._lock:
            return self._section(started_ns)

    def _section(self, started_ns: int | None) -> CoverageSection:
        loop = (self.last_end - self.first_start) if self.first_start is not None else 0
        inside = loop - self.outside - self.named_ns
        accounted = loop - self.outside
        empty = 1.0 if self.first_start is not None else 0.0
        before = None
        if started_ns is not None and self.first_start is not None:
            before = max(0, self.first_start - started_ns) / 1e9
        return CoverageSection(
            loop_s=loop / 1e9,
            in_steps_s=inside / 1e9,
            share=inside / loop if loop > 0 else empty,
            # named time between steps (the user's phase() with no step open) is accounted for
            named_s=self.named_ns / 1e9,
            accounted_share=accounted / loop if loop > 0 else empty,
            named=tuple(
                NamedTime(name=name, count=count, total_s=ns / 1e9)
                for name, (count, ns) in sorted(self.named.items(), key=lambda kv: -kv[1][1])
            ),
            outside_s=self.outside / 1e9,
            gaps=self.gaps,
            largest_gap_s=self.largest_gap / 1e9,
            # the train step the largest gap followed (None: before the first train step)
            largest_gap_after_step=self.largest_gap_after if (self.largest_gap_after or 0) >= 0 else None,
            before_first_step_s=before,
        )

    def self_check(self, accounted_ns: int = 0, unstepped: int | None = None) -> list[dict]:
        """The findings (below) as the file's dicts."""
        return [f.to_dict() for f in self.check(accounted_ns, unstepped)]

    def check(self, accounted_ns: int = 0, unstepped: int | None = None) -> tuple[CheckFinding, ...]:
        """Findings that the step detection is in doubt, each with its cause and fix.

        With the job's accounting (aggregate/job.py): ``accounted_ns``, checkpoint and
        compile time between steps, is no gap; ``unstepped``, the model work seen with
        no step open (record/tracker.py). Time between steps with no model work in it
        is the job's ``other`` activity, with a finding of its own: the check speaks of
        low coverage only where model work ran outside steps."""
        with self._lock:
            return tuple(CheckFinding(**f) for f in self._self_check(accounted_ns, unstepped))

    def _self_check(self, accounted_ns: int = 0, unstepped: int | None = None) -> list[dict]:
        steps = self.steps
        out: list[dict] = []
        if self.first_start is None:
            return out
        loop = self.last_end - self.first_start
        merged = (
            self.max_microbatches >= CHECK_MICROBATCHES
            or (steps == 1 and self.max_microbatches >= CHECK_ONLY_STEP_MICROBATCHES)
            or (
                steps > 1
                and self.longest > CHECK_LONGEST_SHARE * loop
                and self.longest_microbatches >= CHECK_LONGEST_MICROBATCHES
            )
        )
        if merged:
            index = self.max_microbatches_index if self.max_microbatches >= CHECK_MICROBATCHES else self.longest_index
            micro = max(self.max_microbatches, self.longest_microbatches)
            out.append(
                {
                    "kind": "merged_steps",
                    "cause": (
                        f"train step {index} holds {micro} backward passes"
                        + (f" and {self.longest / loop:.0%} of the loop" if loop > 0 else "")
                        + ": an optimizer exists but no optimizer.step() ran between them "
                        "(parameters updated by hand?)"
                    ),
                    "fix": (
                        "set OTEL_TRAINING_STEP_BOUNDARY=backward (one step per backward pass), "
                        "or mark steps with otel_training.step()"
                    ),
                }
            )
        share = (loop - max(0, self.outside - accounted_ns)) / loop if loop > 0 else 1.0
        if share < CHECK_COVERAGE and steps > 1 and unstepped != 0:
            out.append(
                {
                    "kind": "low_coverage",
                    "cause": (
                        f"{1 - share:.0%} of the training loop's {loop / 1e9:.1f} s is outside steps and named phases "
                        f"(largest gap {self.largest_gap / 1e9:.2f} s {gap_place(self.largest_gap_after)}): "
                        + (
                            "work between loops that runs no model forward, or a loop not detected"
                            if unstepped is None
                            else f"model work ran outside steps ({unstepped} forwards or optimizer steps): "
                            "a loop not detected"
                        )
                    ),
                    "fix": (
                        "wrap that work in otel_training.phase(name) (between steps it is named time), "
                        "mark steps with otel_training.step(), or set OTEL_TRAINING_STEP_BOUNDARY"
                    ),
                }
            )
        return out


def gap_place(after: int | None) -> str:
    """Where a gap lies, in train numbering: ``after train step N``."""
    return f"after train step {after}" if after is not None and after >= 0 else "before the first train step"
