"""The per-step timeline: what the training thread records, cheaply.

A step is a list of *marks* (host timestamps, each with an optional device token
from the DeviceTimer) and a list of phases that start and end at marks. Nothing
here talks to OpenTelemetry: the pipeline turns finished timelines into spans and
metrics off the training thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from otel_training import semconv as sc

if TYPE_CHECKING:
    from otel_training.record.flops import FlopCount
    from otel_training.record.memory import MemoryReading


class PhaseRecord:
    """One phase occurrence: indices into its step's marks."""

    __slots__ = ("name", "parent_name", "start", "end", "auto", "outer")

    def __init__(self, name: str, parent_name: str, start: int, auto: bool, outer: PhaseRecord | None = None):
        self.name = name
        self.parent_name = parent_name  # the enclosing phase's name; "step" for top-level phases
        self.outer = outer  # the enclosing record, None for top-level
        self.start = start
        self.end = -1  # -1 while open
        self.auto = auto  # recorded by a hook (not by the user's phase())

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"PhaseRecord({self.name!r}, parent={self.parent_name!r}, {self.start}->{self.end})"


class StepTimeline:
    """Everything recorded about one step (or one piece of a step, before the
    assembler merges pieces), in host-clock nanoseconds."""

    __slots__ = (
        "index",
        "train_before",
        "epoch",
        "batch_size",
        "marks",
        "tokens",
        "phases",
        "saw_backward",
        "saw_optimizer",
        "saw_forward",
        "train_forward",
        "error",
        "source",
        "backwards",
        "closure_backward",
        "updates",
        "skipped",
        "optimizers",
        "microbatches",
        "manual",
        "token_count",
        "token_masks",
        "flops",
        "memory",
        "layout_id",
    )

    def __init__(self, index: int, epoch: int | None, source: Any = None):
        self.index = index  # -1 until the assembler numbers the finished step (per mode)
        self.train_before = 0  # train steps handed on before this one (set with ``index``)
        self.epoch = epoch
        self.batch_size: int | None = None
        self.marks: list[int] = []  # perf_counter_ns on the training thread
        self.tokens: list[Any] = []  # DeviceTimer tokens, parallel to marks
        self.phases: list[PhaseRecord] = []
        self.saw_backward = False
        self.saw_optimizer = False  # an optimizer step ran (or a GradScaler step skipped it)
        self.saw_forward = False
        self.train_forward = False  # a forward with gradients on and its root in train mode
        self.error: BaseException | None = None
        self.source = source  # id() of the DataLoader iterator that started it, or None
        self.backwards = 0  # backward passes outside optimizer steps, before the first one
        self.closure_backward = False  # an optimizer step's closure ran a backward
        self.updates = 0  # optimizer steps that ran (torch's step hooks)
        self.skipped = 0  # GradScaler steps that skipped their optimizer (inf/NaN)
        self.optimizers: list[int] | None = None  # id()s of the optimizers stepped
        self.microbatches: int | None = None  # set by an integration that knows them
        self.manual = False  # bounded by the user's step() (never merged with others)
        self.token_count: int | None = None  # token ids in the step's batches (record/batches.py)
        self.token_masks: list | None = None  # attention masks (or their device sums), summed later
        self.flops: FlopCount | None = None  # on the step that ends the count (record/flops.py)
        self.memory: MemoryReading | None = None  # taken at the step's end (record/memory.py)
        # The number the pipeline's ``submit`` gave its layout (its phases' names, parents
        # and marks); a step of a layout seen before travels without its phase records.
        self.layout_id: int | None = None

    @property
    def mode(self) -> str:
        return sc.MODE_TRAIN if (self.saw_backward or self.saw_optimizer) else sc.MODE_EVAL

    @property
    def start_ns(self) -> int:
        return self.marks[0]

    @property
    def end_ns(self) -> int:
        return self.marks[-1]

    @property
    def duration_ns(self) -> int:
        return self.marks[-1] - self.marks[0]


def has_work(step: StepTimeline) -> bool:
    """Whether a piece holds more than waits for data."""
    phases = step.phases
    if phases and phases[-1].name != sc.PHASE_DATALOADER_NEXT:
        return True  # the usual case, at once
    for rec in phases:
        if rec.name != sc.PHASE_DATALOADER_NEXT:
            return True
    return False


class BetweenSteps:
    """A user's named phase with no step open (a checkpoint between epochs, a save
    after the last step), with the named phases inside it: named time between steps.
    Handed to the pipeline as a record of its own when its outermost phase ends."""

    __slots__ = ("times", "phases", "error")

    # No step marks: the resolver gives a timeline without two marks no record, so the
    # pipeline tells this apart from a step only on that rare path.
    marks: tuple = ()

    def __init__(self) -> None:
        self.times: list[int] = []  # host ns (perf_counter_ns) the phases start and end at
        self.phases: list[PhaseRecord] = []  # the outermost first; ``outer`` links nesting
        self.error: BaseException | None = None  # raised inside it (the first)
