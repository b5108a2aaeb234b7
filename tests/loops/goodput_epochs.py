# Shape: pytorch/examples imagenet/main.py as a whole job: start-up, then train, validate, torch.save, upload per epoch.
"""The whole job, second by second (save_checkpoint() with ``torch.save`` onto a slow
network filesystem; the epoch's metrics uploaded by a blocking call; no otel-training
import): a plain script a new user runs under
``opentelemetry-instrument`` as it is. 0.8 s of start-up work after the imports, 3
epochs of 40 train steps, an eval loop after each, a ``torch.save`` checkpoint per
epoch onto a filesystem whose writes are slow (the file object's ``write`` sleeps in
proportion to the bytes: the time is inside ``torch.save``), and a blocking 0.4 s
metrics upload after each checkpoint.

Besides the loop suite's truth, the script keeps the job's own clock in TRUTH
``notes.job``: the process's start (the kernel's start time of this process, read
from ``/proc``: the launcher and the imports count in start-up), the start and end of
each train and eval loop, of each ``torch.save`` call, and its own end. From them, by
the activities' definitions: ``startup`` (process start to the first train loop),
``train`` and ``eval`` (the loops), ``checkpoint`` (the saves), ``shutdown`` (after
the last eval loop, less the checkpoint after it), ``other`` (the rest between: the
uploads between epochs, the loops' set-up), ``wall_s`` and ``goodput`` (train over
wall)."""

import io
import os
import shutil
import tempfile
import time

import torch
import torch.nn as nn
from _truth import BEFORE, EVAL, OUTSIDE, TRAIN, Truth
from torch.utils.data import DataLoader, Dataset

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(0)
truth = Truth("goodput_epochs")

EPOCHS, TRAIN_STEPS, EVAL_STEPS, BATCH, WIDTH, CLASSES = 3, 40, 20, 16, 256, 10
SAMPLE_DELAY_TRAIN, SAMPLE_DELAY_EVAL = 0.00025, 0.0003
STARTUP_WORK_S, UPLOAD_S = 0.8, 0.4
DISK_BYTES_PER_S = 8e6  # the slow filesystem: about 0.13 s per checkpoint of this model


def process_started() -> float:
    """This process's start on the ``perf_counter`` clock, by the kernel (None without /proc)."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        ticks = int(stat[stat.rindex(b")") + 2:].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.perf_counter() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class Samples(Dataset):
    """Synthetic feature vectors whose decode sleeps (like reading files)."""

    def __init__(self, n, delay, mode):
        g = torch.Generator().manual_seed(n)
        self.x = torch.randn(n, WIDTH, generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)
        self.delay, self.mode = delay, mode

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        truth.sleep(self.mode, "dataloader_next", self.delay)
        return self.x[i], self.y[i]


class SlowDisk(io.FileIO):
    """A file on a slow (network) filesystem: each write takes its bytes' time."""

    def write(self, b):
        time.sleep(len(b) / DISK_BYTES_PER_S)
        return super().write(b)


clock = {"train": [], "eval": [], "checkpoint": []}  # [start, end] of each loop and save (perf_counter s)


def train(loader, model, criterion, optimizer):
    with truth.timed(OUTSIDE, "outside"):
        model.train()
    start = time.perf_counter()
    for x, y in loader:
        loss = criterion(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        truth.train_step()
        truth.samples(TRAIN, x.size(0))
    clock["train"].append([start, time.perf_counter()])
    truth.loop_end()


def validate(loader, model, criterion):
    with truth.timed(OUTSIDE, "outside"):
        model.eval()
    start = time.perf_counter()
    correct = 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x).argmax(1) == y).sum())
            truth.eval_step()
            truth.samples(EVAL, x.size(0))
    clock["eval"].append([start, time.perf_counter()])
    truth.loop_end()
    return correct


def save_checkpoint(state, path):
    start = time.perf_counter()
    with SlowDisk(path, "w") as fh:
        torch.save(state, fh)
    clock["checkpoint"].append([start, time.perf_counter()])


def upload_metrics(epoch, correct):
    time.sleep(UPLOAD_S)  # a blocking HTTP call to the experiment tracker


with truth.timed(BEFORE, "before"):
    time.sleep(STARTUP_WORK_S)  # building the model, indexing the data set
    layers = [m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train_loader = DataLoader(Samples(TRAIN_STEPS * BATCH, SAMPLE_DELAY_TRAIN, TRAIN), batch_size=BATCH, shuffle=True)
    val_loader = DataLoader(Samples(EVAL_STEPS * BATCH, SAMPLE_DELAY_EVAL, EVAL), batch_size=BATCH)
    checkpoint_dir = tempfile.mkdtemp(prefix="goodput-epochs-")

truth.start()
for epoch in range(EPOCHS):
    train(train_loader, model, criterion, optimizer)
    correct = validate(val_loader, model, criterion)
    with truth.timed(OUTSIDE, "outside"):
        save_checkpoint({"epoch": epoch + 1, "state_dict": model.state_dict(),
                         "optimizer": optimizer.state_dict()}, os.path.join(checkpoint_dir, "checkpoint.pth.tar"))
        upload_metrics(epoch, correct)
truth.stop()
shutil.rmtree(checkpoint_dir, ignore_errors=True)

started = process_started()
if started is not None:
    end = time.perf_counter()
    span = lambda pairs: sum(b - a for a, b in pairs)  # noqa: E731
    last_step_end = clock["eval"][-1][1]
    after = [c for c in clock["checkpoint"] if c[0] >= last_step_end]
    job = {
        "wall_s": end - started,
        "startup_s": clock["train"][0][0] - started,
        "train_s": span(clock["train"]),
        "eval_s": span(clock["eval"]),
        "checkpoint_s": span(clock["checkpoint"]),
        "shutdown_s": end - last_step_end - span(after),
    }
    job["other_s"] = job["wall_s"] - sum(job[k] for k in ("startup_s", "train_s", "eval_s", "checkpoint_s",
                                                           "shutdown_s"))
    job["goodput"] = job["train_s"] / job["wall_s"]
    truth.notes["job"] = job
truth.notes.update(epochs=EPOCHS, upload_s=UPLOAD_S, startup_work_s=STARTUP_WORK_S)
truth.emit()
