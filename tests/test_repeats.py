"""Repeated pieces (record/repeats.py): a repeated piece recorded by its clock readings
gives the pipeline exactly what the state machine gives it.

Each loop runs twice in one process on the same synthetic clock (every read advances
it by a random amount, the same sequence both times): once with the repeat mode off, once
with it learning after two pieces. Every finished step record must be the same --
phases, marks, times, samples, tokens, micro-batches, errors -- whether a piece was
recorded call by call, from the template, or replayed when it stopped repeating.
The loops are written in the shape of the scripts they name.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from otel_training.record import repeats
from tests.conftest import Instrumented


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000_000
        self.rng = random.Random(7)

    def __call__(self) -> int:
        self.now += self.rng.randrange(1_000, 2_000_000)
        return self.now


class _Records:
    """A pipeline consumer keeping every step record, as a comparable tuple."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def add(self, batch) -> None:
        for r in batch:
            self.rows.append((r.number, r.epoch, r.mode, r.layout.keys, r.phase_ns, r.untracked_ns, r.times,
                              r.batch_size, r.microbatches, r.skipped, type(r.error).__name__, r.tokens))


def _record(loop, learn_after: int, monkeypatch) -> tuple[list, int]:
    monkeypatch.setattr(repeats, "LEARN_AFTER", learn_after)
    monkeypatch.setattr("otel_training.record.tracker.LEARN_AFTER", learn_after)
    torch.manual_seed(0)
    records = _Records()
    with Instrumented(memory=False) as tel:
        tel.tracker.use_clock(_Clock())  # the same readings in both runs
        pipeline = tel.runtime.pipeline
        pipeline.consumers = (*pipeline.consumers, records)
        loop()
        tel.tracker.finish_step()
        tel.flush()
        pieces = tel.tracker.repeats.pieces
    return records.rows, pieces


def _same_with_and_without(loop, monkeypatch) -> int:
    off, none = _record(loop, 0, monkeypatch)
    on, pieces = _record(loop, 2, monkeypatch)
    assert none == 0
    assert len(on) == len(off) > 0
    for a, b in zip(off, on):
        assert a == b
    return pieces


def _data(n: int, width: int = 8, classes: int = 3, tokens: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    if tokens:
        return TensorDataset(torch.randint(0, 50, (n, 12), generator=g), torch.randint(0, 50, (n, 12), generator=g))
    return TensorDataset(torch.randn(n, width, generator=g), torch.randint(0, classes, (n,), generator=g))


def mnist_loop() -> None:
    """pytorch/examples mnist/main.py: train() logs ``loss.item()`` every
    ``log_interval`` batches, test() runs under no_grad over a second loader,
    StepLR steps once an epoch."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3), nn.LogSoftmax(dim=1))
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    train_loader = DataLoader(_data(320), batch_size=8, shuffle=True)
    test_loader = DataLoader(_data(64), batch_size=16)
    for _epoch in range(2):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            if batch_idx % 10 == 0:
                loss.item()
        model.eval()
        test_loss = 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
        scheduler.step()


def accumulation_loop() -> None:
    """transformers examples run_glue_no_trainer.py: the loss divided by
    ``gradient_accumulation_steps``, an update, scheduler step and zero_grad every
    fourth batch, ``loss.detach().float()`` summed for the epoch log."""
    model = nn.Sequential(nn.Embedding(50, 16), nn.Flatten(), nn.Linear(16 * 12, 50))
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    loader = DataLoader(_data(256, tokens=True), batch_size=8)
    total_loss = 0.0
    for step, (input_ids, labels) in enumerate(loader):
        outputs = model(input_ids)
        loss = loss_fn(outputs, labels[:, 0]) / 4
        total_loss += loss.detach().float()
        loss.backward()
        if step % 4 == 0 or step == len(loader) - 1:
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()


def interrupted_loop() -> None:
    """A loop that changes under way: an eval pass every 25 batches inside the
    epoch (makemore's periodic evaluation), a batch that raises and is skipped
    (a bad sample caught by the script), a ``break`` and a new epoch."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(_data(480), batch_size=8)
    for epoch in range(2):
        for i, (x, y) in enumerate(loader):
            if i == 33:
                try:
                    model(x[:, :3])  # the wrong width: raises inside the forward
                except RuntimeError:
                    continue
            logits = model(x)
            loss = loss_fn(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if i % 25 == 0:
                model.eval()
                with torch.no_grad():
                    loss_fn(model(x), y).item()
                model.train()
            if epoch == 0 and i == 45:
                break


def two_loader_loop() -> None:
    """DANN (domain adaptation): a source and a target batch per step from two
    loaders, ``zip``-ped, one model, one optimizer."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    source = DataLoader(_data(320), batch_size=8)
    target = DataLoader(_data(320), batch_size=8)
    for (xs, ys), (xt, _) in zip(source, target):
        optimizer.zero_grad()
        loss = loss_fn(model(xs), ys) + model(xt).pow(2).mean()
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize("loop", [mnist_loop, accumulation_loop, interrupted_loop, two_loader_loop],
                         ids=lambda f: f.__name__)
def test_repeated_pieces_give_the_same_records(loop, monkeypatch):
    _same_with_and_without(loop, monkeypatch)


def test_a_repeating_loop_is_recorded_from_its_template(monkeypatch):
    # Most of mnist's training pieces repeat the last one; the logging batch, the
    # test loop and the new epoch each leave the repeat mode and it is learned again.
    assert _same_with_and_without(mnist_loop, monkeypatch) > 40
    assert _same_with_and_without(interrupted_loop, monkeypatch) > 20


def _mnist_losses() -> list:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for data, target in DataLoader(_data(320), batch_size=8):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_a_fault_in_a_repeated_piece_is_contained(monkeypatch):
    # Our bug at a repeated piece's boundary (the assembler's check raises once) never reaches
    # the loop: the same losses, and the steps after it are recorded.
    monkeypatch.setattr(repeats, "LEARN_AFTER", 2)
    monkeypatch.setattr("otel_training.record.tracker.LEARN_AFTER", 2)
    torch.manual_seed(0)
    reference = _mnist_losses()
    records = _Records()
    with Instrumented(memory=False) as tel:
        pipeline = tel.runtime.pipeline
        pipeline.consumers = (*pipeline.consumers, records)
        assembler = tel.tracker.assembler
        idle, calls = assembler.idle, []

        def planted():
            calls.append(1)
            if len(calls) == 10:
                raise RuntimeError("planted in the repeated boundary")
            return idle()

        assembler.idle = planted
        torch.manual_seed(0)
        losses = _mnist_losses()
        tel.flush()
        pieces = tel.tracker.repeats.pieces
    assert len(calls) > 10  # the fault fired, while repeating
    assert losses == reference
    assert pieces > 20
    assert len(records.rows) >= 38  # 40 batches: the one the fault hit may be lost
