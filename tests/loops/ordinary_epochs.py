# Shape: pytorch/examples imagenet/main.py — per epoch: train() over a DataLoader (data_time / batch_time AverageMeters, forward, criterion, accuracy, losses.update(loss.item()), zero_grad, backward, step, progress.display every print_freq), validate() under no_grad over a val DataLoader (display_summary at its end), then save_checkpoint({epoch, state_dict, best_acc1, optimizer, scheduler}, is_best) with torch.save; here AdamW, CosineAnnealingLR stepped per batch, bf16 autocast on the CPU, tqdm bars, the checkpoint under the README's @otel_training.phase("checkpoint"), and one more save after the last epoch.
"""The issue-33 "ordinary loop": one train step per ``optimizer.step()``, one eval step
per val batch (the last one short), and between epochs a named checkpoint
(``otel_training.phase("checkpoint")`` with no step open: named time between steps),
plus a final save after the last step (counted too). A small CNN on synthetic 16x16
images stands in for resnet18; forward and loss run under
``torch.autocast("cpu", dtype=torch.bfloat16)``. The script keeps imagenet's own clock
(``batch_time``: from the end of one iteration to the end of the next) per mode and
prints it in TRUTH ``notes.clock`` (each step's samples and seconds, in each mode's
step order): samples/s per mode are checked against it. Planted: a slow Dataset ``__getitem__`` for both loaders
(``dataloader_next``), a slow console behind the progress display every
``PRINT_FREQ`` train batches (train ``untracked``), a slow ``display_summary`` after
each validation loop (between steps), and a slow filesystem under each
``torch.save`` (named ``checkpoint`` time). Train steps are compute-heavy (the
compute finding's advice is read for a bf16-autocast CPU run): the delays inside
steps are planted as shares of the model's own time so far, by the script's clock,
because that time spans two orders of magnitude between CPUs (a few ms a step with
native bf16, hundreds emulating it)."""

import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.nn as nn
from _truth import BEFORE, EVAL, OUTSIDE, TRAIN, Truth
from torch.optim.lr_scheduler import CosineAnnealingLR
from torch.utils.data import DataLoader, Dataset

import otel_training

try:
    from tqdm import tqdm
except ImportError:  # the loop runs without progress bars
    tqdm = None

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(0)
truth = Truth("ordinary_epochs")

# 16x16 images, 8 batches an epoch: torch 2.4's bf16 convolutions on a CPU without native
# bf16 (no AVX512-BF16) take seconds a step at 48x48; this keeps the run well inside the
# runner's limit there and still compute-bound everywhere.
EPOCHS, BATCH_SIZE, PRINT_FREQ, IMAGE, CLASSES = 3, 32, 4, 16, 10
TRAIN_SAMPLES, VAL_SAMPLES = 8 * BATCH_SIZE, 3 * BATCH_SIZE + 16  # the last val batch holds 16
# Planted inside steps, as shares of the mode's model time a step (forward, loss,
# backward, update): a batch's decode, and the console behind every PRINT_FREQ-th display.
DATA_SHARE = {TRAIN: 0.10, EVAL: 0.15}
DISPLAY_SHARE = 0.4  # a tenth of a step on average
SUMMARY_DELAY, SAVE_DELAY = 0.030, 0.150  # between steps: fixed
MIN_SLEEP = 0.0005  # a decode's delay is slept once this much is owed (time.sleep's own cost)
# A batch's decode takes 1 ms at least: the loader's own bookkeeping outside the fetch
# (a few hundred us a step) stays within the check's tolerance of the delay.
MIN_DATA_S = 0.001
clock = {TRAIN: {"samples": [], "step_s": []}, EVAL: {"samples": [], "step_s": []}}  # imagenet's batch_time, per step
model_s = {TRAIN: [], EVAL: []}  # the script's clock around each step's model work


def planted(mode, share, least=0.0):
    """``share`` of the mode's median model time a step so far (the train mode's before
    the first eval step; 5 ms before any), ``least`` at least."""
    seen = model_s[mode] or model_s[TRAIN] or [0.005]
    return max(least, share * statistics.median(seen[-8:]))


class SlowImages(Dataset):
    """Synthetic 16x16 RGB images whose decode sleeps (like reading JPEG files)."""

    def __init__(self, n, mode):
        g = torch.Generator().manual_seed(n)
        self.x = torch.randn(n, 3, IMAGE, IMAGE, generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)
        self.mode, self.owed = mode, 0.0

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        self.owed += planted(self.mode, DATA_SHARE[self.mode], MIN_DATA_S) / BATCH_SIZE
        if self.owed >= MIN_SLEEP:
            # what a sleep overshot (by milliseconds on a loaded machine) is owed back, so
            # that the data wait stays the planted share of the step (not in the original)
            self.owed -= truth.sleep(self.mode, "dataloader_next", self.owed)
        return self.x[i], self.y[i]


class AverageMeter:
    def __init__(self, name):
        self.name = name
        self.val = self.avg = self.sum = 0.0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def accuracy(output, target):
    """Top-1 accuracy of the batch, in percent (a tensor)."""
    with torch.no_grad():
        return output.argmax(dim=1).eq(target).float().mean() * 100.0


class Timed:
    """The loader as the ``for`` statement sees it, with the script's clock on what lies
    between steps (not in the original): making its iterator (before the loop's first
    step) and the ``next()`` that ends the loop (its StopIteration, the loader's and the
    hooks' own work there) -- on a loaded machine these took several ms a loop end."""

    def __init__(self, loader, first):
        self.loader, self.first = loader, first

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        with truth.timed(BEFORE if self.first else OUTSIDE, "outside"):
            it = iter(self.loader)
        while True:
            t = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                truth.add(OUTSIDE, "outside", time.perf_counter() - t)
                truth.loop_end()
                return
            yield item


def bar(loader, desc, mode, first=False):
    loader = Timed(loader, first)
    if tqdm is None:
        return loader
    progress = tqdm(loader, desc=desc, mininterval=0.5)
    close = progress.close  # after the loop's end: between steps (tqdm's own close is a no-op once closed)

    def timed_close(*args, **kwargs):
        with truth.timed(OUTSIDE, "outside"):
            return close(*args, **kwargs)

    progress.close = timed_close
    # The bar's redraw runs inside the for statement, after the loop body: the step's
    # untracked time, every step once a step outlasts mininterval (a slow CPU). Timed as
    # the rest of the user code there (not in the original).
    refresh = progress.refresh

    def timed_refresh(*args, **kwargs):
        with truth.timed(mode, "untracked"):
            return refresh(*args, **kwargs)

    progress.refresh = timed_refresh
    return progress


def train(train_loader, model, criterion, optimizer, scheduler, epoch):
    with truth.timed(BEFORE if epoch == 0 else OUTSIDE, "outside"):  # after the last epoch's checkpoint
        batch_time, losses, top1 = AverageMeter("Time"), AverageMeter("Loss"), AverageMeter("Acc@1")
        model.train()
        progress = bar(train_loader, f"Epoch: [{epoch}]", TRAIN, first=epoch == 0)
        end = time.perf_counter()
    for i, (images, target) in enumerate(progress):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = model(images)
            loss = criterion(output, target)
        forward_s = time.perf_counter() - t
        with truth.timed(TRAIN, "untracked"):  # tensor ops on the bf16 output: slow without native bf16
            acc1 = accuracy(output, target)
        optimizer.zero_grad()
        t = time.perf_counter()
        loss.backward()
        optimizer.step()
        model_s[TRAIN].append(forward_s + time.perf_counter() - t)
        scheduler.step()
        truth.train_step(microbatches=1)
        truth.samples(TRAIN, images.size(0))
        loss_value, acc_value = loss.item(), acc1.item()
        with truth.timed(TRAIN, "untracked"):
            losses.update(loss_value, images.size(0))
            top1.update(acc_value, images.size(0))
            now = time.perf_counter()
            batch_time.update(now - end)
            clock[TRAIN]["step_s"].append(now - end)
            clock[TRAIN]["samples"].append(images.size(0))
            end = now  # as imagenet's train(): the display is in the next iteration's batch_time
            if i % PRINT_FREQ == 0:
                if tqdm is not None:
                    progress.set_postfix(loss=f"{losses.avg:.4f}", acc1=f"{top1.avg:.1f}")
                else:
                    print(f"Epoch: [{epoch}][{i}/{len(train_loader)}]\tLoss {losses.avg:.4e}", flush=True)
                truth.sleep(TRAIN, "untracked", planted(TRAIN, DISPLAY_SHARE))  # a slow console / log shipper


def validate(val_loader, model, criterion):
    with truth.timed(OUTSIDE, "outside"):
        batch_time, losses, top1 = AverageMeter("Time"), AverageMeter("Loss"), AverageMeter("Acc@1")
        model.eval()
        progress = bar(val_loader, "Test", EVAL)
    with torch.no_grad():
        end = time.perf_counter()
        for images, target in progress:
            t = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                output = model(images)
                loss = criterion(output, target)
            model_s[EVAL].append(time.perf_counter() - t)
            with truth.timed(EVAL, "untracked"):
                acc1 = accuracy(output, target)
            truth.eval_step()
            truth.samples(EVAL, images.size(0))
            loss_value, acc_value = loss.item(), acc1.item()
            with truth.timed(EVAL, "untracked"):
                losses.update(loss_value, images.size(0))
                top1.update(acc_value, images.size(0))
                now = time.perf_counter()
                batch_time.update(now - end)
                clock[EVAL]["step_s"].append(now - end)
                clock[EVAL]["samples"].append(images.size(0))
                end = now
    with truth.timed(OUTSIDE, "outside"):
        print(f" * Acc@1 {top1.avg:.3f} Loss {losses.avg:.4f}", flush=True)  # progress.display_summary()
        truth.sleep_outside(SUMMARY_DELAY)  # a slow console
    return top1.avg


checkpoint_dir = tempfile.mkdtemp(prefix="ordinary-epochs-")


@otel_training.phase("checkpoint")  # the README's decorator
def save_checkpoint(state, is_best, filename="checkpoint.pth.tar"):
    with truth.named("checkpoint"):
        path = os.path.join(checkpoint_dir, filename)
        torch.save(state, path)
        if is_best:
            shutil.copyfile(path, os.path.join(checkpoint_dir, "model_best.pth.tar"))
        time.sleep(SAVE_DELAY)  # a slow (network) filesystem


model = nn.Sequential(  # a small CNN for resnet18: the step's time is mostly compute
    nn.Conv2d(3, 48, 3, padding=1),
    nn.ReLU(),
    nn.Conv2d(48, 96, 3, stride=2, padding=1),
    nn.ReLU(),
    nn.Conv2d(96, 96, 3, padding=1),
    nn.ReLU(),
    nn.AdaptiveAvgPool2d(1),
    nn.Flatten(),
    nn.Linear(96, CLASSES),
)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
train_loader = DataLoader(
    SlowImages(TRAIN_SAMPLES, TRAIN), batch_size=BATCH_SIZE, shuffle=True, num_workers=0
)
val_loader = DataLoader(
    SlowImages(VAL_SAMPLES, EVAL), batch_size=BATCH_SIZE, shuffle=False, num_workers=0
)
scheduler = CosineAnnealingLR(optimizer, T_max=EPOCHS * len(train_loader))  # stepped per batch
best_acc1 = 0.0

truth.start()
for epoch in range(EPOCHS):
    train(train_loader, model, criterion, optimizer, scheduler, epoch)
    acc1 = validate(val_loader, model, criterion)
    with truth.timed(OUTSIDE, "outside"):
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        state = {
            "epoch": epoch + 1,
            "arch": "mlp",
            "state_dict": model.state_dict(),
            "best_acc1": best_acc1,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        }
    save_checkpoint(state, is_best)
with truth.timed(OUTSIDE, "outside"):
    state = {"epoch": EPOCHS, "state_dict": model.state_dict()}
save_checkpoint(state, False, "final.pth.tar")  # after the last step
truth.stop()
shutil.rmtree(checkpoint_dir, ignore_errors=True)
truth.notes.update(clock=clock, epochs=EPOCHS, save_delay_s=SAVE_DELAY)
truth.emit()
