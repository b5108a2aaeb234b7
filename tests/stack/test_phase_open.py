"""``training.phase.open.duration``, the signal of the TrainingStalled alert: it grows
while the training thread hangs inside a phase and is 0 once training has finished
but the process lives on (a notebook, a final upload) -- the case the alert used to
fire on for an hour. A real torch loop under the real instrumentation and SDK."""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import make_model, train_step

torch = pytest.importorskip("torch")

NAME = "training.phase.open.duration"


def _value(tel) -> float:
    """The gauge's value; 0 while it has no point (no step has begun yet)."""
    points = tel.points(NAME)
    assert len(points) <= 1, points
    return points[0].value if points else 0.0


def test_a_process_that_never_steps_exports_no_point(instrumented):
    """A torchrun launcher, a process that never trains: no point without a rank."""
    tel = instrumented()
    assert tel.points(NAME) == []


def _blocking_loader(release: threading.Event, block_at: int, n: int = 8):
    from torch.utils.data import DataLoader, Dataset

    class Blocking(Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            if i == block_at:
                release.wait(30)  # a hung read: the DataLoader wait never returns
            return torch.ones(8), torch.tensor(i % 2)

    return DataLoader(Blocking(), batch_size=1)


@pytest.mark.parametrize("block_in", ["dataloader_next", "backward"])
def test_grows_while_hung_in_a_phase_and_is_zero_after_training(instrumented, block_in):
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    release = threading.Event()
    loader = _blocking_loader(release, block_at=3 if block_in == "dataloader_next" else -1)
    hung = threading.Event()

    def hang_in_backward(grad):
        hung.set()
        release.wait(30)  # a collective waiting for a dead peer
        return grad

    def train():
        for i, batch in enumerate(loader):
            if block_in == "backward" and i == 3:
                x, y = batch
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.register_hook(hang_in_backward)
                opt.zero_grad()
                loss.backward()
                opt.step()
            else:
                train_step(model, opt, batch)

    # torch's autograd hooks and the DataLoader run on this thread: the training thread.
    thread = threading.Thread(target=train, name="training")
    thread.start()
    try:
        if block_in == "backward":
            assert hung.wait(30)
        deadline = time.monotonic() + 30
        while _value(tel) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.1)
        first = _value(tel)
        assert first >= 0.6, f"no open phase seen while hung in {block_in}: {first}"
        time.sleep(0.5)
        assert _value(tel) >= first + 0.4  # it keeps growing while the thread is stuck
    finally:
        release.set()
        thread.join(30)
    assert not thread.is_alive()
    # Training is over and the process (this one) lives on: no open phase.
    assert _value(tel) == 0.0
    time.sleep(0.3)
    assert _value(tel) == 0.0
    assert len(tel.points("training.steps")) >= 1  # it did complete steps before
