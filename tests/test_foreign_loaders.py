"""Loaders that are not torch DataLoaders: Grain (torchtitan's loader), on real Grain
pipelines. Their ``next()`` is a ``dataloader_next`` wait of the step that uses the
batch, exactly as a DataLoader's (docs/steps.md); the iterator stays Grain's for
everything else (state, checkpoints, ``close()``)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

grain = pytest.importorskip("grain.python", reason="grain is not installed")
from grain import experimental as grain_experimental  # noqa: E402

from tests.conftest import make_model  # noqa: E402

SLOW_S = 0.02  # a slow map stage per batch (tokenization), on Grain's prefetch thread


def _pipeline(n: int = 64, batch: int = 4, slow_s: float = SLOW_S, repeat: bool = True):
    """torchtitan's GrainDataLoader shape: an IterDataset, batched by a collator, then
    prefetched on a thread (ThreadPrefetchIterDataset)."""
    rows = grain.MapDataset.source([torch.randn(8).numpy() for _ in range(n)])
    if repeat:
        rows = rows.repeat()
    ds = rows.to_iter_dataset()

    def slow(x):
        time.sleep(slow_s / batch)
        return x

    ds = ds.map(slow).batch(batch, drop_remainder=True, batch_fn=lambda rows: torch.as_tensor(np.stack(rows)))
    return grain_experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=2)


def _train(model, opt, it, steps: int) -> list:
    """torchtitan's loop: next(data_iterator) at the top of each step; the waits measured."""
    waits = []
    for _ in range(steps):
        t0 = time.perf_counter()
        x = next(it)
        waits.append(time.perf_counter() - t0)
        loss = model(x).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return waits


def test_a_grain_iterators_wait_is_dataloader_next_of_the_step_using_the_batch(instrumented):
    tel = instrumented()
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    it = iter(_pipeline())  # made before training, as GrainDataLoader.__init__ does
    waits = _train(model, opt, it, 8)
    tel.uninstrument()
    steps = tel.steps()
    assert [s.mode for s in steps] == ["train"] * 8
    measured = [sum((p.end_time - p.start_time) / 1e9 for p in s.named("dataloader_next")) for s in steps]
    assert all(len(s.named("dataloader_next")) == 1 for s in steps)
    # each step's wait is the one the loop measured around next(), within 10% (+0.5 ms)
    for got, want in zip(measured[1:], waits[1:]):
        assert got == pytest.approx(want, rel=0.10, abs=5e-4)
    assert [s.attributes.get("training.batch_size") for s in steps] == [4] * 8
    summary = tel.runtime.summary_dict()
    assert summary["modes"]["train"]["samples"] == 32
    assert summary["loaders"] == ["grain"]
    # data-bound: the verdict's fixes are Grain's, not a DataLoader's
    from otel_training.aggregate.run_model import Run
    from otel_training.diagnosis.verdict import diagnose

    finding = diagnose(Run.from_dict(summary))[0]
    assert finding.kind == "data_loading", finding
    assert any("ReadOptions" in a for a in finding.advice)
    assert not any("DataLoader" in a or "persistent_workers" in a for a in finding.advice), finding.advice


def _one_step(model, opt, x) -> None:
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_the_timed_iterator_is_still_grains(instrumented):
    """The iterator the loop holds is timed, and stays Grain's: isinstance holds,
    state and checkpoint restore and close pass through."""
    from grain._src.python.dataset.dataset import DatasetIterator

    tel = instrumented()
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    it = iter(_pipeline(slow_s=0.0))
    assert isinstance(it, DatasetIterator) and iter(it) is it
    first = next(it)
    _one_step(model, opt, first)
    state = it.get_state()
    second = next(it)
    _one_step(model, opt, second)
    it.set_state(state)  # a checkpoint restored
    again = next(it)
    _one_step(model, opt, again)
    it.close()
    tel.uninstrument()
    assert torch.equal(again, second) and not torch.equal(first, second)
    assert [len(s.named("dataloader_next")) for s in tel.steps()] == [1, 1, 1]
    plain = iter(_pipeline(slow_s=0.0))  # after uninstrument: Grain's own iterator, untimed
    assert type(plain).__name__ == "ThreadPrefetchDatasetIterator"


def test_an_iterator_made_on_another_thread_is_left_alone(instrumented):
    """Grain's own threads and a data service make iterators too: only one made on the
    training thread is timed."""
    tel = instrumented()
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    made = []
    t = threading.Thread(target=lambda: made.append(iter(_pipeline(slow_s=0.0))))
    t.start()
    t.join()
    mine = iter(_pipeline(slow_s=0.0))
    for _ in range(2):
        _one_step(model, opt, next(made[0]))
    for _ in range(2):
        _one_step(model, opt, next(mine))
    tel.uninstrument()
    assert [len(s.named("dataloader_next")) for s in tel.steps()] == [0, 0, 1, 1]


def test_a_finite_grain_loop_ends_like_a_dataloader_loop(instrumented):
    """The end of a finite pipeline (StopIteration) is no step; the time after the
    loop until the next one lies between steps (coverage), as for a DataLoader."""
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _epoch in range(2):
        for x in _pipeline(n=12, slow_s=0.0, repeat=False):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        time.sleep(0.05)  # epoch-end work: between steps
    tel.uninstrument()
    assert [s.mode for s in tel.steps()] == ["train"] * 6
    coverage = tel.runtime.summary_dict()["coverage"]
    assert coverage["outside_s"] == pytest.approx(0.05, abs=0.02)


def test_the_legacy_grain_dataloader_is_timed_too(instrumented):
    """``grain.python.DataLoader`` (a data source, an IndexSampler, operations) iterates
    a pipeline of its own through the same place: one ``dataloader_next`` per step."""

    class Source:
        def __len__(self):
            return 24

        def __getitem__(self, i):
            return np.full(8, i, dtype=np.float32)

    loader = grain.DataLoader(
        data_source=Source(),
        sampler=grain.IndexSampler(24, shard_options=grain.NoSharding(), shuffle=False, num_epochs=1, seed=0),
        operations=[grain.Batch(4)], worker_count=0)
    tel = instrumented()
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in loader:
        _one_step(model, opt, torch.as_tensor(x))
    tel.uninstrument()
    steps = tel.steps()
    assert [len(s.named("dataloader_next")) for s in steps] == [1] * 6
    assert [s.attributes.get("training.batch_size") for s in steps] == [4] * 6
