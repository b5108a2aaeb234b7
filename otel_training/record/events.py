"""What hooks and integrations tell the recorder: one typed interface.

Every hook (record/torch_hooks.py, record/module_hooks.py, the loop wrappers and
foreign loaders), every framework integration and the manual API report training
events through ``TrainingEvents`` -- in the spirit of Lightning's
``Profiler.start/stop``: callers say what happened, the recorder decides what it
means for the step. ``Tracker`` (record/tracker.py) is the one implementation. All
calls come from the training thread (``on_training_thread`` tells which it is);
other threads only read ``step``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from otel_training.record.run_facts import RunFacts
    from otel_training.record.timeline import PhaseRecord, StepTimeline

# Who begins and ends steps (``start_step``'s and ``claim_driver``'s ``driver``).
DRIVER_NONE = "none"  # no step source seen yet: pieces are cut at forwards
DRIVER_DATALOADER = "dataloader"  # a DataLoader's batches
DRIVER_MANUAL = "manual"  # the user's ``step()``
# A framework integration names itself ("lightning", "transformers").


class TrainingEvents(Protocol):
    """The training thread's events, as hooks and integrations report them."""

    @property
    def step(self) -> StepTimeline | None:
        """The piece being recorded, None between steps."""

    @property
    def thread(self) -> int | None:
        """The training thread's ident, once known."""

    @property
    def driver(self) -> str:
        """Who begins and ends steps now (a ``DRIVER_*`` or an integration's name)."""

    @property
    def facts(self) -> RunFacts:
        """What the run already does (loaders' settings, autocast, optimizers)."""

    def on_training_thread(self, bind: bool = False) -> bool:
        """True on the tracked thread; ``bind``: compute may make this thread it."""

    def now(self) -> int:
        """The recorder's clock, host ns."""

    # -- steps ----------------------------------------------------------------------------
    def start_step(self, driver: str = DRIVER_MANUAL, source: Any = None, epoch: int | None = None) -> None:
        """A step (or, for drivers other than the user's, a piece of one) begins now."""

    def finish_step(self, error: BaseException | None = None) -> None:
        """The open step ends now."""

    def discard_step(self) -> None:
        """Drop the open piece: it held no work."""

    def claim_driver(self, driver: str) -> None:
        """``driver`` begins and ends steps from now on."""

    def record_error(self, exc: BaseException) -> None:
        """The open step raised ``exc``."""

    # -- phases ---------------------------------------------------------------------------
    def begin_phase(self, name: str, auto: bool = False) -> bool:
        """Open phase ``name`` (``auto``: from a hook); False when not recording."""

    def end_phase(self, name: str) -> None:
        """Close the innermost open phase ``name``."""

    def end_record(self, rec: PhaseRecord | None) -> None:
        """Close exactly ``rec``."""

    def waited(self, name: str, since: int) -> None:
        """The innermost open phase waited, as phase ``name``, from host ns ``since``
        (measured by a hook, in hindsight) until now."""

    def begin_between(self, name: str) -> PhaseRecord | None:
        """The user's phase ``name`` with no step open: named time between steps."""

    def end_between(self, rec: PhaseRecord, error: BaseException | None = None) -> None:
        """End named time between steps opened by ``begin_between``."""

    # -- data -----------------------------------------------------------------------------
    def loader_iter_begin(self, kind: str = "torch") -> tuple:
        """A loader's loop begins; returns ``(token, ns)`` its first step counts from."""

    def loader_opened(self, loader: Any) -> None:
        """A loader's first loop: its settings, once."""

    def loader_next_begin(self, iterator: Any, started_at: tuple | None = None) -> bool:
        """A loader's ``__next__`` was entered; True if recording (``loader_next_end`` follows)."""

    def loader_next_end(self, batch: Any) -> None:
        """The batch ``loader_next_begin`` waited for arrived."""

    def loader_stopped(self, wrapped: bool = False) -> None:
        """A loader's ``__next__`` raised StopIteration."""

    def loop_ended(self) -> None:
        """A watched wrapper's loop over a loader ended."""

    # -- compute --------------------------------------------------------------------------
    def forward_begin(self, root: Any = None, loss: bool = False) -> None:
        """A root module's forward began (``loss``: it has no parameters)."""

    def forward_inputs(self, root: Any, args: tuple, kwargs: dict | None) -> None:
        """The inputs of a root forward (samples and tokens when no loader drives)."""

    def in_backward(self) -> bool:
        """Whether a backward pass is running."""

    def backward_begin(self) -> bool:
        """A backward pass began; True if recording (``end_phase("backward")`` follows)."""

    def optimizer_created(self, optimizer: Any) -> None:
        """An optimizer was constructed."""

    def closure_step_begin(self) -> None:
        """``optimizer.step(closure)`` is about to run."""

    def optimizer_pre(self, optimizer: Any, frame: Any = None) -> None:
        """An optimizer step begins (torch's global pre-hook)."""

    def optimizer_post(self, optimizer: Any) -> None:
        """That optimizer step ended (torch's global post-hook)."""

    def optimizer_begin(self) -> PhaseRecord | None:
        """An optimizer step with no torch hook (``GradScaler.step``) began: its record."""

    def wrap_closure(self, optimizer: Any, closure: Callable) -> Callable:
        """``closure`` with its forward and backward timed apart from the optimizer's."""
