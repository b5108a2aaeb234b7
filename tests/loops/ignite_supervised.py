# Shape: pytorch/ignite examples/mnist/mnist.py (+ the PiecewiseLinear / Checkpoint / DiskSaver handlers of examples/cifar10/main.py) — create_supervised_trainer (gradient_accumulation_steps=2) and create_supervised_evaluator (Accuracy, Loss); tqdm bar moved by an ITERATION_COMPLETED(every=log_interval) handler; two EPOCH_COMPLETED handlers running evaluator.run(train_loader) and evaluator.run(val_loader) with tqdm.write of the metrics; log_time on EPOCH_COMPLETED | COMPLETED; trainer.run(train_loader, max_epochs).
"""A PyTorch-Ignite training script in the shape of Ignite's MNIST example
(examples/mnist/mnist.py ``run()``), download-free and on CPU, with two handlers a
real Ignite script adds, taken from examples/cifar10/main.py: a ``PiecewiseLinear``
learning-rate schedule on ``ITERATION_STARTED`` (one warm-up epoch, then linear decay)
and a ``Checkpoint`` of trainer, model, optimizer and schedule through a ``DiskSaver``
(here on ``EPOCH_COMPLETED``, to a temp dir).

Kept from the real code: ``create_supervised_trainer`` / ``create_supervised_evaluator``
(their own process functions: ``supervised_training_step``, ``supervised_evaluation_step``),
one evaluator run over the train loader and then over the val loader from two
``EPOCH_COMPLETED`` handlers, ``setup_logger`` loggers, the tqdm bar, ``log_time``.
Not in the original: ``gradient_accumulation_steps=2`` (an argument of
``create_supervised_trainer`` since 0.4.7), the two cifar10 handlers, tiny sizes, a
synthetic Dataset, ``torch.set_num_threads(1)``.

How Ignite's engine loops (ignite/engine/engine.py ``_run_once_on_dataset_as_gen``):
``len(loader)`` is the ``epoch_length``, so an epoch ends with ``break`` once
``epoch_length`` batches were processed -- no ``StopIteration``, no extra fetch. The
trainer keeps its exhausted DataLoader iterator across epochs: the next epoch's first
``next()`` raises ``StopIteration`` (after ``EPOCH_STARTED`` and ``GET_BATCH_STARTED``),
fires ``DATALOADER_STOP_ITERATION``, makes a new iterator and fetches again. The
evaluator's iterator is dropped at the end of each ``run()`` (``_dataloader_iter =
None``), never exhausted by a ``next()``. ``supervised_training_step`` counts
accumulation on the global ``engine.state.iteration``: with 8 batches an epoch and
``gradient_accumulation_steps=2`` every update lies within one epoch (as with mnist.py's
own sizes: 60000 images in batches of 64, 938 iterations an epoch). (With an epoch
length that ``gradient_accumulation_steps`` does not divide, an update's micro-batches
straddle the epoch end and the evaluator runs in between: not planted here.)

Truth (docs/steps.md): one training step per optimizer update with its micro-batches:
4 updates of 2 micro-batches an epoch, 3 epochs; one eval step per evaluator batch
(8 over the train loader, 3 over the val loader, each epoch). Counted from inside:
``ITERATION_STARTED`` of the trainer (each iteration runs one backward pass), a step
hook on the torch optimizer (updates), ``ITERATION_COMPLETED`` of the evaluator.

Planted: a slow Dataset ``__getitem__`` (``dataloader_next``), booked by the engine that
fetched the batch (``GET_BATCH_COMPLETED``): the train loader feeds both the trainer
(train) and the evaluator (eval); a slow console behind the tqdm bar's update every
``LOG_INTERVAL`` iterations (train ``untracked``: after an update the tail of its step,
after an accumulating micro-batch inside the step under way); a slow console behind
the ``tqdm.write`` of the metrics after each ``evaluator.run`` and a slow network file
system under the ``DiskSaver`` (eval ``untracked``, see below).

Where time between steps lies. Every engine loop here ends with ``break`` after the
batch it used last, fetching nothing more: docs/steps.md names no such loop end; the
suite counts what runs after it, until the next step begins, as the last step's tail
(``fabric_accumulate``'s docstring). So: the trainer's epoch end (``pbar.refresh()``,
the evaluator's ``STARTED`` / ``EPOCH_STARTED`` handlers: metric resets) is the tail of
the epoch's last training step; the evaluator's end (metric ``compute()``, the
"Training Results" / "Validation Results" lines) the tail of its last eval step;
``log_time``, the checkpoint and the next epoch's ``EPOCH_STARTED`` the tail of the
epoch's last val step. The one ``StopIteration`` -- the trainer's old iterator at the
start of epochs 2 and 3 -- and what runs after it until the next step's fetch
(``DATALOADER_STOP_ITERATION``, the new iterator) lie between steps
(``truth.loop_end()``; nothing planted there: Ignite runs no user code there unless a
handler is attached to that event). The last epoch: ``COMPLETED``'s ``log_time`` is the
tail of the last val step, then the loop ends (``truth.stop()``): the trainer drops its
iterator without a ``StopIteration``, so nothing marks that end for otel-training, and
nothing but ``pbar.close()`` and the TRUTH line follows it here (as in mnist.py)."""

import tempfile
import time
import warnings

import torch
import torch.nn.functional as F
from ignite.engine import Events, create_supervised_evaluator, create_supervised_trainer
from ignite.handlers import Checkpoint, DiskSaver, PiecewiseLinear
from ignite.metrics import Accuracy, Loss
from ignite.utils import setup_logger
from torch import nn
from torch.optim import SGD
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from _truth import EVAL, TRAIN, Ledger, Truth

warnings.filterwarnings("ignore")
torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(1)
truth = Truth("ignite_supervised")

EPOCHS, LOG_INTERVAL, GRAD_ACCUM = 3, 3, 2
N_TRAIN, N_VAL, BATCH_TRAIN, BATCH_VAL = 64, 48, 8, 16  # 8 train batches (4 updates), 3 val batches
SAMPLE_DELAY_TRAIN, SAMPLE_DELAY_VAL = 0.0025, 0.0015
LOG_DELAY, RESULTS_DELAY, SAVE_DELAY = 0.020, 0.025, 0.015
LR, MOMENTUM, IMG = 0.01, 0.5, 20
pending = [0]  # (truth) backward passes since the last update


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=5)
        self.conv2 = nn.Conv2d(4, 8, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(32, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 32)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=-1)


# -- planted: data, a slow console, a slow checkpoint file system -----------------------
# (truth) Ledger (_truth.py): the Dataset's sleeps for the batch being fetched, booked by the engine
# that fetched it (``GET_BATCH_COMPLETED``): the train loader feeds both engines.
ledger = Ledger(truth)


class SyntheticDigits(Dataset):
    """20x20 "digits" decoded on the fly (the decode sleeps, like reading image files)."""

    def __init__(self, n, delay, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 1, IMG, IMG, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.delay = delay

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        ledger.sleep(self.delay)
        return self.x[i], self.y[i]


class NetworkDiskSaver(DiskSaver):
    """A ``DiskSaver`` on a network file system: every save waits for the upload."""

    def __call__(self, checkpoint, filename, metadata=None):
        with truth.timed(EVAL, "untracked"):  # (truth) after the val loop's break: its last step's tail
            super().__call__(checkpoint, filename, metadata)
            truth.sleep(EVAL, "untracked", SAVE_DELAY)


def get_data_loaders(train_batch_size, val_batch_size):
    train_loader = DataLoader(SyntheticDigits(N_TRAIN, SAMPLE_DELAY_TRAIN, seed=1),
                              batch_size=train_batch_size, shuffle=True)
    val_loader = DataLoader(SyntheticDigits(N_VAL, SAMPLE_DELAY_VAL, seed=2),
                            batch_size=val_batch_size, shuffle=False)
    return train_loader, val_loader


def run(train_batch_size, val_batch_size, epochs, lr, momentum, log_interval):
    train_loader, val_loader = get_data_loaders(train_batch_size, val_batch_size)
    model = Net()
    device = "cpu"

    if torch.cuda.is_available():
        device = "cuda"

    model.to(device)  # Move model before creating optimizer
    optimizer = SGD(model.parameters(), lr=lr, momentum=momentum)
    optimizer.register_step_post_hook(  # (truth) one training step per update, with its backward passes
        lambda *_: (truth.train_step(microbatches=pending[0]), pending.__setitem__(0, 0)))
    criterion = nn.NLLLoss()
    trainer = create_supervised_trainer(model, optimizer, criterion, device=device,
                                        gradient_accumulation_steps=GRAD_ACCUM)
    trainer.logger = setup_logger("trainer")

    val_metrics = {"accuracy": Accuracy(), "nll": Loss(criterion)}
    evaluator = create_supervised_evaluator(model, metrics=val_metrics, device=device)
    evaluator.logger = setup_logger("evaluator")

    # (truth) counting and booking, from the engines' own events
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda _: pending.__setitem__(0, pending[0] + 1))
    trainer.add_event_handler(Events.GET_BATCH_COMPLETED, lambda _: ledger.book(TRAIN))
    trainer.add_event_handler(Events.DATALOADER_STOP_ITERATION, lambda _: truth.loop_end())
    evaluator.add_event_handler(Events.GET_BATCH_COMPLETED, lambda _: ledger.book(EVAL))
    evaluator.add_event_handler(Events.ITERATION_COMPLETED, lambda _: truth.eval_step())

    # examples/cifar10/main.py: warm-up then linear decay, per iteration
    le = len(train_loader)
    milestones_values = [(0, 0.0), (le * 1, lr), (le * epochs, 0.0)]
    lr_scheduler = PiecewiseLinear(optimizer, param_name="lr", milestones_values=milestones_values)
    trainer.add_event_handler(Events.ITERATION_STARTED, lr_scheduler)

    pbar = tqdm(initial=0, leave=False, total=len(train_loader), desc=f"ITERATION - loss: {0:.2f}")

    @trainer.on(Events.ITERATION_COMPLETED(every=log_interval))
    def log_training_loss(engine):
        with truth.timed(TRAIN, "untracked"):
            pbar.desc = f"ITERATION - loss: {engine.state.output:.2f}"
            pbar.update(log_interval)
            truth.sleep(TRAIN, "untracked", LOG_DELAY)  # a slow console / log shipper

    @trainer.on(Events.EPOCH_COMPLETED)
    def log_training_results(engine):
        with truth.timed(TRAIN, "untracked"):  # (truth) after the train loop's break: its last step's tail
            pbar.refresh()
        evaluator.run(train_loader)
        with truth.timed(EVAL, "untracked"):  # (truth) after the evaluator's break: its last step's tail
            metrics = evaluator.state.metrics
            avg_accuracy = metrics["accuracy"]
            avg_nll = metrics["nll"]
            tqdm.write(
                f"Training Results - Epoch: {engine.state.epoch} Avg accuracy: {avg_accuracy:.2f} "
                f"Avg loss: {avg_nll:.2f}"
            )
            truth.sleep(EVAL, "untracked", RESULTS_DELAY)

    @trainer.on(Events.EPOCH_COMPLETED)
    def log_validation_results(engine):
        evaluator.run(val_loader)
        with truth.timed(EVAL, "untracked"):  # (truth) after the evaluator's break: its last step's tail
            metrics = evaluator.state.metrics
            avg_accuracy = metrics["accuracy"]
            avg_nll = metrics["nll"]
            tqdm.write(
                f"Validation Results - Epoch: {engine.state.epoch} Avg accuracy: {avg_accuracy:.2f} "
                f"Avg loss: {avg_nll:.2f}"
            )
            truth.sleep(EVAL, "untracked", RESULTS_DELAY)

            pbar.n = pbar.last_print_n = 0

    @trainer.on(Events.EPOCH_COMPLETED | Events.COMPLETED)
    def log_time(engine):
        with truth.timed(EVAL, "untracked"):  # (truth) the last val step's tail
            tqdm.write(
                f"{trainer.last_event_name.name} took {trainer.state.times[trainer.last_event_name.name]} seconds"
            )

    # examples/cifar10/main.py: to_save, Checkpoint through a DiskSaver (after log_time:
    # it fires SAVED_CHECKPOINT, which log_time would take for the event it runs on)
    to_save = {"trainer": trainer, "model": model, "optimizer": optimizer, "lr_scheduler": lr_scheduler}
    checkpoint = Checkpoint(to_save, NetworkDiskSaver(tempfile.mkdtemp(), require_empty=False), n_saved=2)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)

    truth.start()
    trainer.run(train_loader, max_epochs=epochs)
    pbar.close()
    truth.stop()
    assert pending[0] == 0, "every backward pass went into an update"
    truth.notes.update(updates_per_epoch=le // GRAD_ACCUM, eval_batches_per_epoch=le + len(val_loader),
                       iterations=trainer.state.iteration)


if __name__ == "__main__":
    run(BATCH_TRAIN, BATCH_VAL, EPOCHS, LR, MOMENTUM, LOG_INTERVAL)
    truth.emit()
