"""Fault injection (issue 6, item 5): an exception inside any of our wrappers is
contained and counted, never seen by the training loop; the user's own exceptions go
through our wrappers unchanged and mark the step span as an error."""

from __future__ import annotations

import inspect
import sys
import traceback

import pytest
import torch
import torch.nn.functional as F
from opentelemetry.trace import StatusCode
from torch.utils.data import DataLoader, Dataset

import otel_training
from otel_training.tracker import Tracker
from tests.conftest import make_dataset, make_model

# Every method of the tracker (the hooks' only entry into our state machine).
TRACKER_METHODS = sorted(
    name for name, fn in vars(Tracker).items()
    if inspect.isfunction(fn) and not name.startswith("__"))


class Injected(RuntimeError):
    """A bug of ours, planted."""


class UserError(Exception):
    """The user's own failure."""


def training_loop():
    """Everything our hooks wrap: DataLoader, forward, backward, optimizer, LR
    scheduler, device-to-host reads, the manual API. Returns losses and weights."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    loader = DataLoader(make_dataset(32), batch_size=8)
    losses = []
    for _ in range(2):
        for x, y in loader:
            with otel_training.phase("augment"):
                x = x * 1.0
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            _ = out.detach().cpu().tolist()
    with otel_training.step():
        torch.autograd.backward(model(torch.randn(2, 8)).sum())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def reference():
    return training_loop()


def _same(result, reference) -> None:
    losses, params = result
    assert losses == reference[0]
    assert all(torch.equal(a, b) for a, b in zip(params, reference[1]))


@pytest.mark.parametrize("method", TRACKER_METHODS)
def test_a_fault_in_any_tracker_method_is_contained_and_counted(instrumented, reference, method):
    tel = instrumented()
    calls = []

    def broken(*args, **kwargs):
        calls.append(method)
        raise Injected(f"planted in Tracker.{method}")

    setattr(tel.tracker, method, broken)
    _same(training_loop(), reference)  # no exception reached the loop; same numbers
    errors = tel.runtime.telemetry.errors
    if calls:  # called directly by a hook, or by a tracker method a hook called
        assert sum(errors.values()) >= 1, f"{len(calls)} faults in {method}, none counted: {dict(errors)}"
    tel.uninstrument()


def test_a_fault_in_the_pipeline_is_contained_and_counted(instrumented, reference):
    tel = instrumented()

    def broken(step):
        raise Injected("planted in Pipeline.process")

    tel.runtime.pipeline.process = broken
    _same(training_loop(), reference)
    tel.flush()
    assert tel.runtime.telemetry.errors["pipeline"] >= 1


@pytest.mark.parametrize("where", ["add", "flush"])
def test_a_fault_in_the_shape_lane_is_contained_and_counted(instrumented, reference, where):
    """Untraced steps go by shape (``Shapes.add``, then ``Shapes.flush``): a bug
    in either never reaches the loop; one in ``add`` loses no step (it goes the
    per-step way), one in ``flush`` is counted and does not stall flushes."""
    tel = instrumented(trace_every_n=0, trace_slow_factor=0)  # only the first step is traced
    shapes = tel.runtime.pipeline._shapes
    assert shapes is not None
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise Injected(f"planted in Shapes.{where}")

    setattr(shapes, where, broken)
    _same(training_loop(), reference)
    tel.flush()
    assert calls and tel.runtime.telemetry.errors["pipeline"] >= 1
    if where == "flush":  # what it could not add is counted as dropped, and flushes still end
        assert tel.runtime.telemetry.steps_dropped >= 1
    else:
        train = tel.runtime.summary_dict()["modes"]["train"]
        assert train["steps"] == 9  # 2 epochs of 4 steps, and the manual one
        assert {p["name"] for p in train["phases"]} >= {"dataloader_next", "forward", "augment"}


def test_a_fault_while_building_spans_is_contained(instrumented, reference, monkeypatch):
    tel = instrumented()

    def broken(*args, **kwargs):
        raise Injected("planted in emit_step_spans")

    monkeypatch.setattr("otel_training.pipeline.emit_step_spans", broken)
    _same(training_loop(), reference)
    tel.flush()
    assert tel.runtime.telemetry.errors["pipeline"] >= 1


def test_faults_are_summarised_at_run_end(instrumented):
    tel = instrumented()
    setattr(tel.tracker, "loader_next_end", lambda *a, **k: (_ for _ in ()).throw(Injected("x")))
    training_loop()
    tel.uninstrument()
    summary = tel.runtime.summary_dict()
    assert summary["telemetry"]["errors"] >= 1


# --- the user's exceptions pass through unchanged ------------------------------------

class FailingDataset(Dataset):
    def __init__(self, planted, at: int) -> None:
        self.inner, self.planted, self.at = make_dataset(32), planted, at

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i):
        if i == self.at:
            raise self.planted
        return self.inner[i]


class FailingModule(torch.nn.Module):
    def __init__(self, planted, at_call: int) -> None:
        super().__init__()
        self.inner, self.planted, self.at_call, self.calls = make_model(), planted, at_call, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at_call:
            raise self.planted
        return self.inner(x)


class FailingBackward(torch.autograd.Function):
    planted = None

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise FailingBackward.planted


class FailingSGD(torch.optim.SGD):
    planted, at = None, 0

    def step(self, closure=None):
        FailingSGD.at -= 1
        if FailingSGD.at == 0:
            raise FailingSGD.planted
        return super().step(closure)


class FailingScheduler(torch.optim.lr_scheduler.StepLR):
    planted, at = None, 0

    def step(self, epoch=None):
        FailingScheduler.at -= 1
        if FailingScheduler.at == 0:
            raise FailingScheduler.planted
        return super().step(epoch)


def _user_loop(where: str, planted: BaseException) -> None:
    torch.manual_seed(0)
    model = FailingModule(planted, at_call=3 if where == "forward" else -1)
    FailingSGD.planted, FailingSGD.at = planted, (3 if where == "optimizer" else -1)
    opt = FailingSGD(model.parameters(), lr=0.1)
    FailingScheduler.planted, FailingScheduler.at = planted, (3 if where == "scheduler" else -1)
    FailingScheduler(opt, step_size=2)  # the constructor steps once
    sched = FailingScheduler(opt, step_size=2)
    FailingBackward.planted = planted
    dataset = FailingDataset(planted, at=16 if where == "dataset" else -1)
    for step, (x, y) in enumerate(DataLoader(dataset, batch_size=8)):
        out = model(x)
        if where == "backward" and step == 2:
            out = FailingBackward.apply(out)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        loss.item()


WHERE = ["dataset", "forward", "backward", "optimizer", "scheduler"]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("with_our_faults", [False, True], ids=["clean", "our-faults-too"])
def test_user_exceptions_propagate_unchanged(instrumented, where, with_our_faults):
    tel = instrumented()
    if with_our_faults:  # our own bugs must not mask or replace the user's exception
        for method in ("end_phase", "loader_next_end", "forward_begin", "begin_phase"):
            setattr(tel.tracker, method, lambda *a, **k: (_ for _ in ()).throw(Injected("ours")))
    planted = UserError(f"user failure in {where}")
    with pytest.raises(UserError) as info:
        _user_loop(where, planted)
    assert info.value is planted  # the very object the user raised
    assert info.value.__cause__ is None and info.value.__context__ is None
    # The innermost frame is the user's raise, not one of our wrappers.
    innermost = traceback.extract_tb(info.value.__traceback__)[-1]
    assert "otel_training" not in innermost.filename
    assert innermost.line == "raise self.planted" or innermost.line.startswith("raise ")


def _failed_steps(tel) -> list:
    return [s for s in tel.steps() if s.root.status.status_code is StatusCode.ERROR]


def _assert_marked(step) -> None:
    root = step.root
    assert root.attributes.get("training.trace.reason") in ("error", "first")  # step 0 is both
    events = [e for e in root.events if e.name == "exception"]
    assert events and events[0].attributes["exception.type"].endswith("UserError")
    assert "user failure" in events[0].attributes["exception.message"]


@pytest.mark.parametrize("where", [w for w in WHERE if w != "optimizer"])
def test_user_exceptions_mark_the_step_span_as_an_error(instrumented, where):
    tel = instrumented()
    with pytest.raises(UserError):
        _user_loop(where, UserError(f"user failure in {where}"))
    tel.uninstrument()
    failed = _failed_steps(tel)
    assert len(failed) == 1, [s.root.status.status_code for s in tel.steps()]
    _assert_marked(failed[0])


def test_an_uncaught_optimizer_exception_marks_the_step_at_exit(instrumented, monkeypatch):
    """No hook sees an exception leave ``Optimizer.step`` (torch's step hooks only run
    around a step that returns); the step is marked when the uncaught exception ends
    the process (Python leaves it in ``sys.last_value``), by the exit-time shutdown."""
    tel = instrumented()
    planted = UserError("user failure in optimizer")
    with pytest.raises(UserError):
        _user_loop("optimizer", planted)
    monkeypatch.setattr(sys, "last_value", planted, raising=False)
    monkeypatch.setattr(sys, "last_exc", planted, raising=False)
    tel.runtime.shutdown(final=True)  # what atexit runs
    failed = _failed_steps(tel)
    assert len(failed) == 1
    _assert_marked(failed[0])


def test_torch_errors_through_our_wrappers_are_torch_errors(instrumented):
    def reads():
        t = torch.ones(3)
        out = []
        for call in (t.item, lambda: torch.autograd.backward(t)):
            try:
                call()
            except RuntimeError as exc:
                out.append((type(exc), str(exc)))
        return out

    plain = reads()
    instrumented()
    assert reads() == plain and len(plain) == 2


def test_keyboard_interrupt_in_forward_is_not_swallowed(instrumented):
    tel = instrumented()
    model = FailingModule(KeyboardInterrupt(), at_call=1)
    with pytest.raises(KeyboardInterrupt):
        for x, _ in DataLoader(make_dataset(16), batch_size=8):
            model(x)
    tel.uninstrument()
