"""Fault injection: an exception inside any of our wrappers is
contained and counted, never seen by the training loop; the user's own exceptions go
through our wrappers unchanged and mark the step span as an error."""

from __future__ import annotations

import inspect
import sys
import traceback

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from opentelemetry.trace import StatusCode
from torch.utils.data import DataLoader, Dataset

import otel_training
from tests.conftest import make_dataset, make_model

# The hook entry points -- (module, function) of ours that torch, the user or the SDK
# calls -- and the tracker method each calls into. A fault is planted in that method
# for calls from that entry point only; tests/test_reliability_faults.py checks the
# table covers every pair a real loop exercises.
ENTRY_POINTS = [
    ("otel_training.record.torch_hooks", "_loader_iter", "loader_iter_begin"),
    ("otel_training.record.torch_hooks", "_loader_iter", "on_training_thread"),
    ("otel_training.record.torch_hooks", "_loader_iter", "now"),
    ("otel_training.record.torch_hooks", "_loader_iter", "loader_opened"),
    ("otel_training.record.torch_hooks", "loader_next", "loader_next_begin"),
    ("otel_training.record.torch_hooks", "loader_next", "loader_next_end"),
    ("otel_training.record.torch_hooks", "loader_next", "loader_stopped"),
    ("otel_training.record.foreign_loaders", "_iter", "on_training_thread"),  # a Grain pipeline
    ("otel_training.record.foreign_loaders", "_iter", "loader_iter_begin"),
    ("otel_training.record.foreign_loaders", "_iter", "now"),
    ("otel_training.record.foreign_loaders", "next", "on_training_thread"),
    ("otel_training.record.foreign_loaders", "next", "loader_next_begin"),
    ("otel_training.record.foreign_loaders", "next", "loader_next_end"),
    ("otel_training.record.foreign_loaders", "next", "loader_stopped"),
    ("otel_training.record.torch_hooks", "_optimizer_pre", "optimizer_pre"),
    ("otel_training.record.torch_hooks", "_optimizer_post", "optimizer_post"),
    ("otel_training.record.torch_hooks", "_optimizer_init", "optimizer_created"),
    ("otel_training.record.torch_hooks", "<lambda>", "begin_phase"),  # LR schedulers, .item()
    ("otel_training.record.torch_hooks", "backward_begin", "backward_begin"),
    ("otel_training.record.torch_hooks", "backward_end", "end_phase"),
    ("otel_training.record.grad_sync", "grad_ready", "now"),  # DDP's gradient sync
    ("otel_training.record.grad_sync", "backward_ended", "waited"),
    ("otel_training.record.grad_sync", "_fsdp_collective", "now"),  # FSDP2's collectives
    ("otel_training.record.grad_sync", "_fsdp_collective", "waited"),
    ("otel_training.record.torch_hooks", "wrapper", "end_phase"),
    ("otel_training.record.module_hooks", "_discover", "on_training_thread"),
    ("otel_training.record.module_hooks", "_discover", "in_backward"),
    ("otel_training.record.module_hooks", "_begin", "forward_begin"),
    ("otel_training.record.module_hooks", "_end", "end_phase"),
    ("otel_training.api", "__enter__", "on_training_thread"),
    ("otel_training.api", "__enter__", "start_step"),
    ("otel_training.api", "__enter__", "begin_phase"),
    ("otel_training.api", "__exit__", "finish_step"),
    ("otel_training.api", "__exit__", "end_phase"),
    ("otel_training.api", "__enter__", "begin_between"),  # phase() with no step open
    ("otel_training.api", "__exit__", "end_between"),
    ("otel_training.export.progress", "open_phase_seconds", "open_phase_start"),
    ("otel_training.runtime.shutdown", "hand_on_held", "close"),
]
_OURS = tuple(  # the recorder's own parts, calling each other
    f"otel_training.record.{m}"
    for m in ("tracker", "phase_stack", "loader_steps", "forward_steps", "optimizer_steps", "named_between", "repeats")
)


def _plant(tracker, fires) -> None:
    """Wrap every tracker method: ``fires(module, caller, method)`` says whether a call
    from that frame raises ``Injected`` (else it runs as usual)."""
    for method in [n for n, f in inspect.getmembers(type(tracker), inspect.isfunction) if not n.startswith("__")]:
        original = getattr(tracker, method)

        def planted(*args, _original=original, _method=method, **kwargs):
            frame = sys._getframe(1)
            if fires(frame.f_globals.get("__name__", ""), frame.f_code.co_name, _method):
                raise Injected(f"planted in Tracker.{_method}")
            return _original(*args, **kwargs)

        setattr(tracker, method, planted)


@pytest.fixture(autouse=True)
def _state_machine_every_call(monkeypatch):
    """Faults are planted on the tracker's methods, which the repeat mode's repeated
    pieces do not call (record/repeats.py): the mode is off here (tests/test_repeats.py
    has its own fault cases)."""
    monkeypatch.setattr("otel_training.record.repeats.LEARN_AFTER", 0)
    monkeypatch.setattr("otel_training.record.tracker.LEARN_AFTER", 0)


class Injected(RuntimeError):
    """A bug of ours, planted."""


class UserError(Exception):
    """The user's own failure."""


def _grain_batches():
    """A finite Grain pipeline of (x, y) batches (torchtitan's loader library)."""
    import grain.python as grain

    g = torch.Generator().manual_seed(1)
    rows = [(torch.randn(8, generator=g).numpy(), int(i % 2)) for i in range(16)]
    return grain.MapDataset.source(rows).to_iter_dataset().batch(
        8, batch_fn=lambda b: (torch.as_tensor(np.stack([r[0] for r in b])), torch.tensor([r[1] for r in b])))


def training_loop():
    """Everything our hooks wrap: DataLoader, a Grain pipeline, forward, backward,
    optimizer, LR scheduler, device-to-host reads, the manual API, DDP. Returns losses
    and weights."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    loader = DataLoader(make_dataset(32), batch_size=8)
    losses = []
    for x, y in _grain_batches():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
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
        with otel_training.phase("checkpoint"):  # between epochs: named time between steps
            _ = [p.detach().clone() for p in model.parameters()]
    losses.extend(_ddp_steps(model, opt))
    with otel_training.step():
        torch.autograd.backward(model(torch.randn(2, 8)).sum())
    return losses, [p.detach().clone() for p in model.parameters()]


# FSDP2 on the CPU: the public ``fully_shard`` (torch 2.6 on); before, a CUDA-only prototype.
try:
    from torch.distributed.fsdp import fully_shard as _FULLY_SHARD
except ImportError:
    _FULLY_SHARD = None


def _ddp_steps(model, opt) -> list:
    """Two DDP steps and two FSDP2 steps in a one-process gloo group (the gradient
    sync's hooks)."""
    import tempfile

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    losses = []
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            ddp = DistributedDataParallel(model)
            for x, y in DataLoader(make_dataset(16), batch_size=8):
                loss = F.cross_entropy(ddp(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            if _FULLY_SHARD is None:
                return losses
            torch.manual_seed(0)
            sharded = make_model()
            _FULLY_SHARD(sharded)  # FSDP2: its all-gathers and reduce-scatters
            sharded_opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
            for x, y in DataLoader(make_dataset(16), batch_size=8):
                loss = F.cross_entropy(sharded(x), y)
                sharded_opt.zero_grad()
                loss.backward()
                sharded_opt.step()
                losses.append(loss.item())
        finally:
            dist.destroy_process_group()
    return losses


@pytest.fixture(scope="module")
def reference():
    return training_loop()


def _same(result, reference) -> None:
    losses, params = result
    assert losses == reference[0]
    assert all(torch.equal(a, b) for a, b in zip(params, reference[1]))


def test_the_entry_points_cover_every_call_from_a_hook_into_the_tracker(instrumented):
    tel = instrumented()
    seen = set()

    def record(module, caller, method):
        if not module.startswith(_OURS):  # calls between tracker methods are not entries
            seen.add((module, caller, method))
        return False

    _plant(tel.tracker, record)
    training_loop()
    tel.uninstrument()
    assert seen, "no call reached the tracker"
    assert seen <= set(ENTRY_POINTS), f"entry points without a fault case: {sorted(seen - set(ENTRY_POINTS))}"


@pytest.mark.parametrize("module,caller,method", ENTRY_POINTS, ids=[f"{c}->{m}" for _, c, m in ENTRY_POINTS])
def test_a_fault_behind_any_hook_entry_point_is_contained_and_counted(instrumented, reference, module, caller,
                                                                      method):
    if caller == "_fsdp_collective" and _FULLY_SHARD is None:
        pytest.skip("FSDP2 on the CPU needs torch 2.6 or later (the loop runs no FSDP2 step here)")
    tel = instrumented()
    fired = []

    def fires(mod, who, name):
        if (mod, who, name) == (module, caller, method):
            fired.append(name)
            return True
        return False

    _plant(tel.tracker, fires)
    _same(training_loop(), reference)  # no exception reached the loop; same numbers
    tel.uninstrument()  # (shutdown: the entry point that closes the tracker)
    assert fired, f"the fault planted behind {caller} -> {method} never fired"
    errors = tel.runtime.telemetry.errors
    assert sum(errors.values()) >= 1, f"{len(fired)} faults behind {caller}, none counted: {dict(errors)}"


@pytest.mark.parametrize("consumer", ["summary", "coverage", "spans", "metrics", "memory", "throughput"])
def test_a_fault_in_a_consumer_is_contained_and_the_others_still_get_every_step(instrumented, reference,
                                                                               monkeypatch, consumer):
    """Each consumer takes batches of step records: one that raises loses only its own
    share, counted; the loop never sees it, and the run summary still counts every step."""
    from otel_training.aggregate.coverage import Coverage
    from otel_training.aggregate.memory import MemoryTrend
    from otel_training.aggregate.summary import RunSummary
    from otel_training.export.metrics import StepMetrics
    from otel_training.export.spans import StepSpans
    from otel_training.export.throughput import ThroughputMetrics

    cls = {"summary": RunSummary, "coverage": Coverage, "spans": StepSpans, "metrics": StepMetrics,
           "memory": MemoryTrend, "throughput": ThroughputMetrics}[consumer]
    fired = []

    def broken(self, *args, **kwargs):
        fired.append(1)
        raise Injected(f"planted in {cls.__name__}.add")

    monkeypatch.setattr(cls, "add", broken)
    tel = instrumented()
    _same(training_loop(), reference)
    tel.flush()
    assert fired and tel.runtime.telemetry.errors["pipeline"] >= 1
    if consumer != "summary":
        train = tel.runtime.summary_dict()["modes"]["train"]
        # 2 Grain batches, 2 epochs of 4 steps, 2 DDP steps, 2 FSDP steps (torch 2.6 on) and the manual one
        assert train["steps"] == (15 if _FULLY_SHARD is not None else 13)
        assert {p["name"] for p in train["phases"]} >= {"dataloader_next", "forward", "augment"}
    if consumer != "spans":
        assert tel.spans(), "spans stopped with another consumer's fault"


def test_a_fault_while_resolving_a_step_is_contained_and_counted(instrumented, reference, monkeypatch):
    from otel_training.aggregate.step_record import Resolver

    fired = []

    def broken(self, step):
        fired.append(1)
        raise Injected("planted in Resolver.resolve")

    monkeypatch.setattr(Resolver, "resolve", broken)
    tel = instrumented()
    _same(training_loop(), reference)
    tel.flush()
    assert fired and tel.runtime.telemetry.errors["pipeline"] >= 1


def test_faults_are_summarised_at_run_end(instrumented):
    tel = instrumented()
    _plant(tel.tracker, lambda module, caller, method: method == "loader_next_end")
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
