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

    def absorb(self, piece: StepTimeline) -> StepTimeline:
        """Append ``piece`` (later in time) to this step; returns it (the assembler merges pieces)."""
        # A piece cut at a forward (no source) after work on a DataLoader's batch, in one
        # step: the same batch's iteration goes on (a GAN's generator update after the
        # discriminator's); its forward inputs (the generated batch) are no new data.
        fed = self.source is not None and piece.source is None and (self.saw_forward or self.saw_backward)
        marks, tokens = self.marks, self.tokens
        pm, pt = piece.marks, piece.tokens
        # Consecutive pieces share the instant (and device token) one ended and the next began.
        skip = 1 if (pm and marks and pm[0] == marks[-1] and (not tokens or not pt or pt[0] is tokens[-1])) else 0
        offset = len(marks) - skip
        if tokens or pt:
            # A piece recorded before device timing started has marks but no tokens (the
            # timer starts when a piece begins): None tokens keep the merged lists aligned.
            if len(tokens) < len(marks):
                tokens.extend([None] * (len(marks) - len(tokens)))
            tokens.extend((pt[skip:] if skip else pt) if pt else [None] * (len(pm) - skip))
        marks.extend(pm[skip:] if skip else pm)
        if offset:
            for rec in piece.phases:
                rec.start += offset
                if rec.end >= 0:
                    rec.end += offset
        self.phases.extend(piece.phases)
        if not self.saw_optimizer:  # micro-batches count up to the first update
            self.backwards += piece.backwards
            self.closure_backward = self.closure_backward or piece.closure_backward
        self.saw_forward = self.saw_forward or piece.saw_forward
        self.train_forward = self.train_forward or piece.train_forward
        self.saw_backward = self.saw_backward or piece.saw_backward
        self.saw_optimizer = self.saw_optimizer or piece.saw_optimizer
        self.updates += piece.updates
        self.skipped += piece.skipped
        if piece.optimizers:
            if self.optimizers is None:
                self.optimizers = list(piece.optimizers)
            else:
                self.optimizers.extend(i for i in piece.optimizers if i not in self.optimizers)
        if piece.microbatches is not None:
            self.microbatches = (self.microbatches or 0) + piece.microbatches
        if not fed:  # samples and tokens count the data a step consumed, once
            if piece.batch_size is not None:
                self.batch_size = (self.batch_size or 0) + piece.batch_size
            if piece.token_count is not None:
                self.token_count = (self.token_count or 0) + piece.token_count
            if piece.token_masks is not None:
                self.token_masks = (
                    piece.token_masks if self.token_masks is None else self.token_masks + piece.token_masks
                )
        if piece.flops is not None:
            self.flops = piece.flops
        if piece.memory is not None:  # the latest reading: the step's end
            self.memory = piece.memory
        if self.error is None:
            self.error = piece.error
        return self

    # -- what the recorder's parts write (the open piece's marks and phases: PhaseStack) --
    def forward_ran(self) -> None:
        """A root forward ran in this piece."""
        self.saw_forward = True

    def trained_forward(self) -> None:
        """A forward with gradients on and its root in train mode ran."""
        self.train_forward = True

    def backward_ran(self, in_optimizer_step: bool) -> None:
        """A backward pass began: inside an optimizer step it is the step's closure's;
        before the first update it is one more micro-batch."""
        self.saw_backward = True
        if in_optimizer_step:
            self.closure_backward = True
        elif not self.saw_optimizer:
            self.backwards += 1

    def optimizer_began(self) -> None:
        """An optimizer step began (or a GradScaler step that may skip it)."""
        self.saw_optimizer = True

    def optimizer_stepped(self, optimizer_id: int, several: bool) -> None:
        """An optimizer's step ran; ``several``: other optimizers exist, so which ones
        stepped is kept."""
        self.updates += 1
        if several:
            ids = self.optimizers
            if ids is None:
                self.optimizers = [optimizer_id]
            elif optimizer_id not in ids:
                ids.append(optimizer_id)

    def update_skipped(self) -> None:
        """A GradScaler step skipped its optimizer (inf/NaN gradients)."""
        self.skipped += 1

    def count_samples(self, samples: int | None, add: bool = False) -> None:
        """The batch's samples (``add``: to those counted already)."""
        self.batch_size = ((self.batch_size or 0) + samples) if add and samples is not None else samples

    def count_tokens(self, tokens: int | None, add: bool = False) -> None:
        """The batch's token ids (``add``: to those counted already)."""
        self.token_count = ((self.token_count or 0) + tokens) if add and tokens is not None else tokens

    def add_token_mask(self, mask: Any) -> None:
        """An attention mask (or its device sum) whose tokens are summed later."""
        if self.token_masks is None:
            self.token_masks = [mask]
        else:
            self.token_masks.append(mask)

    def take_batch(self, batch_size: int | None, token_count: int | None, token_masks: list | None) -> None:
        """Samples and tokens as another record counted them."""
        self.batch_size, self.token_count, self.token_masks = batch_size, token_count, token_masks

    def count_microbatches(self, microbatches: int | None) -> None:
        """The framework's own count of the step's micro-batches."""
        self.microbatches = microbatches

    def carry_flops(self, flops: FlopCount) -> None:
        """The FLOP count this step ends (record/flops.py)."""
        self.flops = flops

    def read_memory(self, reading: MemoryReading | None) -> None:
        """The memory reading taken at the piece's end."""
        self.memory = reading

    def mark_manual(self, manual: bool) -> None:
        """Bounded by the user's step() (never merged with other pieces)."""
        self.manual = manual

    def restart(self) -> None:
        """Back to the first mark, batch unread (the repeat mode's replay records it again)."""
        del self.marks[1:]
        self.batch_size = self.token_count = self.token_masks = None

    def number(self, index: int, train_before: int) -> None:
        """The assembler numbers the finished step (per mode)."""
        self.index = index
        self.train_before = train_before

    def continue_as(self, source: Any, epoch: int | None) -> None:
        """A merged step carries its last piece's iterator and epoch."""
        self.source, self.epoch = source, epoch

    def shed(self, layout_id: int | None, drop_phases: bool) -> None:
        """Queued and only read from now on (aggregate/step_record.py ``SentLayouts``):
        the marks become a tuple of ints, which the collector untracks at its first
        pass instead of promoting; empty lists give way to the empty tuple, and the
        optimizers' ids (the assembler's, done with) go (docs/performance.md).
        ``drop_phases``: the layout was sent before, its number stands for them."""
        self.marks = tuple(self.marks)  # type: ignore[assignment]
        if not self.tokens:
            self.tokens = ()  # type: ignore[assignment]
        self.optimizers = None
        self.layout_id = layout_id
        if drop_phases:
            self.phases = ()  # type: ignore[assignment]

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

    def time(self, now: int) -> int:
        """A phase starts or ends at host ns ``now``: its index in ``times``."""
        times = self.times
        times.append(now)
        return len(times) - 1

    def add_phase(self, rec: PhaseRecord) -> None:
        self.phases.append(rec)

    def fail(self, error: BaseException) -> None:
        """``error`` was raised inside it (the first one wins)."""
        if self.error is None:
            self.error = error
