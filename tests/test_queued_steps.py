"""Steps waiting for the pipeline hold little memory, and each is still resolved with
its own phases.

A step of a layout the pipeline has already been sent gives its phase records up
before it is queued (``SentLayouts``): queued for 500 ms, they would be promoted by the
garbage collector and bring full collections of the whole process (docs/performance.md).
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import otel_training
from otel_training import semconv as sc
from otel_training.aggregate import pipeline as pipeline_mod
from otel_training.aggregate import step_record as record_mod
from otel_training.aggregate.sampling import TailCapture
from otel_training.record.step_assembly import StepAssembler
from otel_training.record.timeline import PhaseRecord
from otel_training.record.tracker import Tracker
from otel_training.timing.device import DeviceTimer

EPOCHS, TRAIN_BATCHES, TEST_BATCHES, LOG_EVERY = 2, 20, 4, 5


def _mnist_loop() -> None:
    """pytorch/examples' mnist loop, small: a train epoch logging every few batches
    (``loss.item()``), then a test epoch under ``no_grad``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(TensorDataset(torch.randn(4 * TRAIN_BATCHES, 8), torch.randint(0, 2, (4 * TRAIN_BATCHES,))),
                       batch_size=4)
    test = DataLoader(TensorDataset(torch.randn(4 * TEST_BATCHES, 8), torch.randint(0, 2, (4 * TEST_BATCHES,))),
                      batch_size=4)
    for _ in range(EPOCHS):
        model.train()
        for batch_idx, (data, target) in enumerate(train):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(data), target)
            loss.backward()
            opt.step()
            if batch_idx % LOG_EVERY == 0:
                with otel_training.phase("log"):
                    loss.item()
        model.eval()
        with torch.no_grad():
            for data, target in test:
                model(data).argmax(dim=1).eq(target).sum().item()


def _live_phase_records() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is PhaseRecord)


def test_queued_steps_hold_phase_records_only_for_new_layouts(instrumented, monkeypatch):
    monkeypatch.setattr(pipeline_mod, "_POLL_S", 3600.0)  # nothing drains before the flush
    before = _live_phase_records()
    tel = instrumented()
    _mnist_loop()
    steps = EPOCHS * (TRAIN_BATCHES + TEST_BATCHES)
    # Each step has 5-8 records; queued as they were, the steps would hold ~300.
    held = _live_phase_records() - before
    assert held < 60, f"{held} phase records alive for {steps} queued steps"

    tel.flush()
    counts = {(p.attributes["training.phase"], p.attributes["training.phase.parent"], p.attributes["training.mode"]):
              p.data.count for p in tel.points("training.phase.duration")}
    train, evals, logs = EPOCHS * TRAIN_BATCHES, EPOCHS * TEST_BATCHES, EPOCHS * TRAIN_BATCHES // LOG_EVERY
    for phase, parent in ((sc.PHASE_DATALOADER_NEXT, sc.SPAN_STEP), (sc.PHASE_TRAIN_BATCH, sc.SPAN_STEP),
                          (sc.PHASE_FORWARD, sc.PHASE_TRAIN_BATCH), (sc.PHASE_BACKWARD, sc.PHASE_TRAIN_BATCH),
                          (sc.PHASE_OPTIMIZER_STEP, sc.PHASE_TRAIN_BATCH)):
        assert counts[(phase, parent, sc.MODE_TRAIN)] == train, phase
    assert counts[("log", sc.SPAN_STEP, sc.MODE_TRAIN)] == logs
    assert counts[(sc.PHASE_FORWARD, sc.PHASE_EVAL_BATCH, sc.MODE_EVAL)] == evals

    # Every step got its own layout, not a neighbour's: the steps that logged are
    # exactly the train steps of every LOG_EVERY-th batch.
    traced = [t for t in tel.steps() if t.mode == sc.MODE_TRAIN]
    assert len(traced) == train
    logged = [i for i, t in enumerate(traced) if any(s.name == "log" for s in t.children())]
    assert logged == [i for i in range(train) if (i % TRAIN_BATCHES) % LOG_EVERY == 0]


def test_a_queued_step_leaves_the_collector_one_object(instrumented, monkeypatch):
    """What a queued step keeps alive for the collector to promote: the step itself
    (its marks go as a tuple of ints, which the collector untracks; no empty lists)."""
    monkeypatch.setattr(pipeline_mod, "_POLL_S", 3600.0)  # nothing drains before the flush
    tel = instrumented()
    _mnist_loop()  # the layouts and series of this loop are made
    gc.collect()
    before = len(gc.get_objects())
    _mnist_loop()
    gc.collect()
    steps = EPOCHS * (TRAIN_BATCHES + TEST_BATCHES)
    per_step = (len(gc.get_objects()) - before) / steps
    assert per_step < 1.5, f"{per_step:.2f} tracked objects alive per queued step"
    tel.flush()
    assert tel.runtime.summary_dict()["modes"]["train"]["steps"] == 2 * EPOCHS * TRAIN_BATCHES


def _steps(n: int) -> list:
    """``n`` steps of one layout, recorded by a tracker through the manual API."""
    steps: list = []
    tracker = Tracker(StepAssembler(steps.append), DeviceTimer())
    for _ in range(n):
        tracker.start_step()
        tracker.begin_phase("load")
        tracker.end_phase("load")
        tracker.begin_phase("compute")
        tracker.end_phase("compute")
        tracker.finish_step()
    return steps


def test_a_layout_that_could_not_be_made_is_never_resolved_empty(monkeypatch):
    """Our bug making a layout loses that layout's steps, counted by the pipeline:
    never steps resolved as if they had no phases."""
    shed = record_mod.SentLayouts().shed
    resolver = record_mod.Resolver(DeviceTimer(), TailCapture(0.0, 0, 1.0))
    made = record_mod.Layout

    def failing_once(mode, records):
        monkeypatch.setattr(record_mod, "Layout", made)
        raise RuntimeError("a bug making the layout")

    monkeypatch.setattr(record_mod, "Layout", failing_once)
    first, second, third = _steps(3)
    for step in (first, second, third):
        shed(step)
    assert not second.phases and not third.phases  # travelling without their records
    with pytest.raises(RuntimeError, match="a bug"):
        resolver.resolve(first)
    for step in (second, third):
        with pytest.raises(LookupError):
            resolver.resolve(step)


def test_steps_of_a_known_layout_resolve_as_with_their_phases():
    shed = record_mod.SentLayouts().shed
    with_phases = record_mod.Resolver(DeviceTimer(), TailCapture(0.0, 0, 1.0))
    shed_resolver = record_mod.Resolver(DeviceTimer(), TailCapture(0.0, 0, 1.0))
    steps = _steps(4)
    expected = [with_phases.resolve(s) for s in steps]
    for step in steps:
        shed(step)
    got = [shed_resolver.resolve(s) for s in steps]
    assert [len(s.phases) for s in steps[1:]] == [0, 0, 0]
    assert [(r.layout.keys, r.phase_ns, r.untracked_ns) for r in got] == \
        [(r.layout.keys, r.phase_ns, r.untracked_ns) for r in expected]
    assert expected[0].layout.keys == (("load", sc.SPAN_STEP), ("compute", sc.SPAN_STEP))
