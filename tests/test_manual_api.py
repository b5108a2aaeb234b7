"""The manual API: ``step()`` and ``phase(name)`` for custom loops."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader

import otel_training
from otel_training import runtime
from tests.conftest import assert_close, make_dataset, make_model, span_duration, spin, train_step


def test_step_and_phase_as_context_managers_with_nesting(instrumented):
    tel = instrumented()
    planted = []
    for _ in range(3):
        with otel_training.step():
            with otel_training.phase("prepare"):
                a = spin(0.02)
                with otel_training.phase("augment"):
                    b = spin(0.04)
            c = spin(0.04)
        planted.append((a, b, c))
    steps = tel.steps()
    assert [s.index for s in steps] == [0, 1, 2]
    for s, (a, b, c) in zip(steps, planted):
        assert s.tree() == ("step", (("prepare", (("augment", ()),)),))
        assert s.mode == "eval"
        assert_close(s.total("prepare"), a + b, what="prepare")
        assert_close(s.total("augment"), b, what="augment")
        assert_close(s.attributes["training.untracked.duration"], c, what="untracked")
    assert set(tel.phase_totals("step")) == {"prepare", "untracked"}
    assert set(tel.phase_totals("prepare")) == {"augment"}


def test_step_and_phase_as_decorators(instrumented):
    tel = instrumented()
    calls = []

    @otel_training.phase("load")
    def load(i):
        slept.append(spin(0.03))
        return i

    @otel_training.step()
    def one_step(i):
        calls.append(load(i))

    slept = []
    for i in range(3):
        one_step(i)
    assert calls == [0, 1, 2]
    steps = tel.steps()
    assert len(steps) == 3
    for s, p in zip(steps, slept):
        assert s.tree() == ("step", (("load", ()),))
        assert_close(s.total("load"), p, what="load")


def test_recursive_decorated_phase_nests(instrumented):
    tel = instrumented()

    @otel_training.phase("walk")
    def walk(n):
        spin(0.005)
        if n:
            walk(n - 1)

    with otel_training.step():
        walk(2)
    (s,) = tel.steps()
    assert s.tree() == ("step", (("walk", (("walk", (("walk", ()),)),)),))


def test_decorated_phase_called_from_another_thread_meanwhile(instrumented):
    """One decorator object, two threads: each call keeps its own state."""
    tel = instrumented()

    @otel_training.phase("work")
    def work(spawn):
        if spawn:  # another thread calls the same decorated function meanwhile
            t = threading.Thread(target=work, args=(False,))
            t.start()
            t.join()
        spin(0.01)

    with otel_training.step():
        work(True)
        spin(0.1)  # after the phase: untracked
    (s,) = tel.steps()
    assert s.top_level() == ["work"]
    assert span_duration(s.named("work")[0]) < 0.07
    assert s.attributes["training.untracked.duration"] >= 0.1


def test_auto_phases_inside_manual_steps(instrumented):
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = make_dataset(12, delay=0.01)
    it = iter(DataLoader(dataset, batch_size=4))
    waited = []  # what each next() really took, by the script's clock
    for _ in range(3):
        with otel_training.step():
            t0 = time.perf_counter()
            batch = next(it)  # a wait inside a manual step: dataloader_next, no boundary
            waited.append(time.perf_counter() - t0)
            with otel_training.phase("train"):
                train_step(model, opt, batch)
    steps = tel.steps()
    assert [s.index for s in steps] == [0, 1, 2]
    for i, s in enumerate(steps):
        assert s.mode == "train"
        assert s.attributes["training.batch_size"] == 4
        assert s.tree() == ("step", (
            ("dataloader_next", ()),
            ("train", (("forward", ()), ("backward", ()), ("optimizer_step", ()), ("from_device", ()))),
        ))
        # at least the planted sleeps (less 10%), at most the whole next() around them
        slept, got = sum(dataset.slept[4 * i:4 * i + 4]), s.total("dataloader_next")
        assert slept * 0.9 <= got <= waited[i], (got, slept, waited[i])


def test_manual_step_inside_a_dataloader_loop(instrumented):
    """``for batch in loader: with step():`` -- the manual step takes over; the
    DataLoader's own step boundaries leave no stray (wait-only) steps behind."""
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for batch in DataLoader(make_dataset(12), batch_size=4):
            with otel_training.step():
                train_step(model, opt, batch)
    tel.uninstrument()
    steps = tel.steps()
    assert [s.index for s in steps] == list(range(6))
    for s in steps:
        assert s.top_level() == ["train_batch", "from_device"], s


def test_manual_step_marks_errors_and_lets_them_through(instrumented):
    tel = instrumented()
    boom = KeyError("boom")
    with pytest.raises(KeyError) as info:
        with otel_training.step():
            with otel_training.phase("inner"):
                raise boom
    assert info.value is boom
    with otel_training.step():
        pass
    steps = tel.steps()
    assert len(steps) == 2
    failed, ok = steps
    assert failed.root.status.status_code.name == "ERROR"
    assert [e.name for e in failed.root.events] == ["exception"]
    assert failed.root.events[0].attributes["exception.type"] == "KeyError"
    assert failed.attributes["training.trace.reason"] == "first"
    assert failed.named("inner")
    assert ok.root.status.status_code.name == "UNSET"


def test_phase_outside_any_step_is_named_time_between_steps(instrumented):
    tel = instrumented()
    with otel_training.phase("setup"):
        spin(0.001)
    with otel_training.step():
        pass
    setup, step = sorted(tel.steps(), key=lambda t: t.root.name)
    assert step.root.name == "step" and step.top_level() == []  # not the step's
    assert setup.root.name == "setup" and setup.root.parent is None  # a span of its own
    assert setup.root.attributes["training.mode"] == "between_steps"


def test_no_ops_when_not_instrumented():
    assert runtime.current() is None
    ran = []

    @otel_training.step()
    def f():
        with otel_training.phase("p"):
            ran.append(1)

    f()
    with otel_training.step(), otel_training.phase("q"):
        ran.append(2)
    assert ran == [1, 2]
    err = ValueError("mine")
    with pytest.raises(ValueError) as info:
        with otel_training.step(), otel_training.phase("r"):
            raise err
    assert info.value is err
    with pytest.raises(ValueError):
        otel_training.phase("")


def test_api_after_uninstrument_is_a_no_op(instrumented):
    tel = instrumented()
    with otel_training.step():
        pass
    tel.uninstrument()
    assert runtime.current() is None
    with otel_training.step(), otel_training.phase("late"):
        pass
    assert len(tel.steps()) == 1


def test_global_step_needs_a_callable_and_is_a_no_op_uninstrumented():
    with pytest.raises(TypeError, match="lambda: iter_num"):
        otel_training.global_step(5)
    otel_training.global_step(lambda: 5)  # nothing instrumented: nothing happens
