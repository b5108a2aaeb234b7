# Shape: skorch-dev/skorch NeuralNetClassifier (README quickstart, notebooks/Basic_Usage + Advanced_Usage, examples/benchmarks/mnist.py) — net = NeuralNetClassifier(MyModule, max_epochs, lr, batch_size, iterator_train__shuffle=True, train_split=ValidSplit(5, stratified=True), dataset=<a skorch Dataset with its own transform()>, callbacks=[EpochScoring('accuracy', on_train=True), LRScheduler(CyclicLR, step_every='batch'), Checkpoint(dirname=tmp), EarlyStopping(), a custom logging Callback]); net.fit(X, y) (fit -> partial_fit -> fit_loop: per epoch on_epoch_begin, run_single_epoch(train: for batch in DataLoader: on_batch_begin, train_step = optimizer.step(step_fn closure: zero_grad, infer, get_loss, backward, on_grad_computed), loss.item(), on_batch_end), run_single_epoch(valid: validation_step under no_grad), on_epoch_end: scoring, checkpoint, PrintLog); then net.predict_proba(X_test) and net.predict(X_test) (forward_iter: evaluation_step per DataLoader batch).
"""skorch, the scikit-learn wrapper for PyTorch, used as its README and notebooks use it:
``NeuralNetClassifier(MyModule, ...).fit(X, y)`` on numpy arrays, then
``predict_proba(X_test)`` and ``predict(X_test)``. Download-free and on CPU: a
``make_classification`` problem, the README's ``MyModule`` (dense, dropout, dense,
softmax; NLLLoss, skorch's default for a classifier), SGD with momentum.

Kept from the real thing (skorch 1.4 ``net.py``, run unmodified): ``fit`` ->
``partial_fit`` -> ``fit_loop``; ``ValidSplit(5, stratified=True)`` makes two
``Subset``s of one dataset; per epoch ``on_epoch_begin``, ``run_single_epoch`` over the
train ``DataLoader`` (``iterator_train__shuffle=True``) and over the valid one, then
``on_epoch_end``. Each train batch: ``on_batch_begin``; ``train_step``, which hands a
closure (``step_fn``: ``zero_grad``, ``infer``, ``get_loss``, ``loss.backward()``,
``on_grad_computed``) to ``optimizer.step(step_fn)`` -- skorch does that for every
optimizer, SGD included; ``loss.item()`` into the history; ``on_batch_end``. Each valid
batch: ``validation_step`` (``module.eval()``, ``no_grad``). The default callbacks
(EpochTimer, PassthroughScoring train/valid loss, EpochScoring ``valid_acc``, PrintLog's
table) and the user's: ``EpochScoring('accuracy', on_train=True)`` (as
examples/benchmarks/mnist.py; both scorings use the cached predictions: no forward at
epoch end), ``LRScheduler(CyclicLR, step_every='batch')`` (stepped in
``on_batch_end``: its own ``step_lr_schedulers`` phase), ``Checkpoint(dirname=tmp)``
(params, optimizer, criterion, history whenever ``valid_loss`` improves),
``EarlyStopping`` (patience 5: never fires in 4 epochs). ``predict_proba`` and
``predict`` run ``forward_iter``: a new ``DataLoader`` over the test set,
``evaluation_step`` (``set_grad_enabled(False)``, ``module.eval()``) per batch, then
``np.concatenate``.

Truth (docs/steps.md): one training step per ``optimizer.step(step_fn)`` (rule 4), with
one micro-batch (SGD calls the closure once; asserted); one eval step per validation
batch and per ``forward_iter`` batch of ``predict_proba`` and ``predict``. 224 train /
56 valid samples, batch 16: 14 train steps and 4 eval steps per epoch, 4 epochs; 48 test
samples: 3 eval steps per predict call (56 train, 22 eval steps in all).

Planted: a slow per-row ``transform`` in the skorch ``Dataset`` (decoding features on
the fly; the documented hook for per-row work), read by the ``DataLoader`` for every
sample: ``dataloader_next`` of the step the batch feeds (train, valid, predict); a
custom ``Callback`` posting every batch's loss from the history to a metrics service
in ``on_batch_end`` (train / eval ``untracked``: the tail of the step after its update
or its forward).

Where the epoch-end time lies: the train loop and the valid loop of
``run_single_epoch`` are ``for batch in iterator`` loops over a DataLoader, each ending
with the loader's ``StopIteration``. So by docs/steps.md rule 5, whatever runs after
them until the next step begins lies between steps, in no step (``OUTSIDE``): the
``*_batch_count`` record, ``on_epoch_end`` (EpochTimer, the scorings' sklearn
accuracy, ``Checkpoint``'s ``save_params`` plus a planted upload to a network file
system, EarlyStopping, the logging callback's planted epoch summary, PrintLog's
table), the next epoch's ``on_epoch_begin``, ``on_train_end`` after the last
epoch, and the user's code between ``fit`` and the two predict calls; the first batch
of each loop is that loop's first step's ``dataloader_next``. (The tail rule, "time
between two steps belongs to the step before it", yields to rule 5 here: the last
train or valid batch's step ended with its loop.) ``on_train_begin`` and the first
``on_epoch_begin`` run before the first step (``BEFORE``). All epoch-level hooks are
timed through ``notify``; each loop end is a ``truth.loop_end()``.

Truth bookkeeping only (no change to what runs): ``TruthNet`` overrides ``notify``,
``run_single_epoch``, ``train_step``, ``train_step_single``, ``validation_step`` and
``evaluation_step`` to time and count around ``super()``; the Dataset's sleeps are booked in
``on_batch_begin`` (fit) or after the predict call (a callback cannot see
``forward_iter``)."""

import math
import tempfile
import time
import warnings

import numpy as np
import torch
from sklearn.datasets import make_classification
from sklearn.metrics import accuracy_score
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback, Checkpoint, EarlyStopping, EpochScoring, LRScheduler
from skorch.dataset import Dataset, ValidSplit
from torch import nn
from torch.optim.lr_scheduler import CyclicLR

from _truth import BEFORE, EVAL, OUTSIDE, TRAIN, Ledger, Truth

warnings.filterwarnings("ignore")
torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
truth = Truth("skorch_fit")

N, N_TEST, FEATURES, BATCH, EPOCHS = 280, 48, 20, 16, 4  # ValidSplit(5): 224 train, 56 valid
ROW_DELAY = 0.0005  # per sample: 8 ms a full batch
LOG_DELAY_TRAIN, LOG_DELAY_VALID = 0.005, 0.003
EPOCH_LOG_DELAY, UPLOAD_DELAY = 0.005, 0.004  # (time between steps stays under 10% of the loop: the self-check)
EPOCH_HOOKS = ("on_train_begin", "on_epoch_begin", "on_epoch_end", "on_train_end")


# -- planted: a slow Dataset, a remote metrics service, a network file system -------------
# (truth) Ledger (_truth.py): the Dataset's sleeps since the last booking, booked to the step that
# uses the batch (every fetched batch is used: no loop here is left with break).
ledger = Ledger(truth)


class DecodingDataset(Dataset):
    """skorch's Dataset; ``transform`` runs per row as the DataLoader reads it
    (skorch's docstring: "Additional transformations on X and y")."""

    def transform(self, X, y):
        ledger.sleep(ROW_DELAY)  # decode the row's features from their stored form
        return super().transform(X, y)


class RemoteMetrics(Callback):
    """A custom callback posting each batch's loss (from the history, as skorch's own
    callbacks read it) and each epoch's summary to a metrics service, synchronously."""

    def initialize(self):
        self.sent_ = []
        return self

    def post(self, mode, seconds, payload):
        """One HTTP round trip to the metrics service."""
        truth.sleep(mode, "outside" if mode == OUTSIDE else "untracked", seconds)
        self.sent_.append(payload)

    def on_batch_end(self, net, batch=None, training=False, **kwargs):
        key = "train_loss" if training else "valid_loss"
        self.post(TRAIN if training else EVAL, LOG_DELAY_TRAIN if training else LOG_DELAY_VALID,
                  {key: net.history[-1, "batches", -1, key]})

    def on_epoch_end(self, net, **kwargs):
        # after the valid loop ended: between steps
        self.post(OUTSIDE, EPOCH_LOG_DELAY, {k: net.history[-1, k] for k in
                                             ("epoch", "train_loss", "valid_loss", "valid_acc", "train_acc")})


class NetworkCheckpoint(Checkpoint):
    """skorch's Checkpoint into a folder on a network file system: each save ends with
    an upload."""

    def save_model(self, net):
        super().save_model(net)
        truth.sleep(OUTSIDE, "outside", UPLOAD_DELAY)


# -- README: the module ---------------------------------------------------------------
class MyModule(nn.Module):
    def __init__(self, num_units=10, nonlin=nn.ReLU()):
        super().__init__()

        self.dense0 = nn.Linear(FEATURES, num_units)
        self.nonlin = nonlin
        self.dropout = nn.Dropout(0.5)
        self.dense1 = nn.Linear(num_units, num_units)
        self.output = nn.Linear(num_units, 2)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, X, **kwargs):
        X = self.nonlin(self.dense0(X))
        X = self.dropout(X)
        X = self.nonlin(self.dense1(X))
        X = self.softmax(self.output(X))
        return X


# -- (truth) counting and timing around skorch's own methods ----------------------------
class TruthNet(NeuralNetClassifier):
    closure_calls = 0

    def notify(self, method_name, **cb_kwargs):
        if method_name not in EPOCH_HOOKS:
            return super().notify(method_name, **cb_kwargs)
        mode = OUTSIDE if truth.train_steps or truth.eval_steps else BEFORE
        with truth.timed(mode, "outside"):
            return super().notify(method_name, **cb_kwargs)

    def run_single_epoch(self, iterator, training, prefix, step_fn, **fit_params):
        truth.start()  # just before the first loop
        super().run_single_epoch(iterator, training, prefix, step_fn, **fit_params)
        if iterator is not None:
            truth.loop_end()  # the loader's StopIteration: until the next step, between steps

    def train_step_single(self, batch, **fit_params):
        TruthNet.closure_calls += 1  # (inside the closure: once per loss.backward())
        return super().train_step_single(batch, **fit_params)

    def train_step(self, batch, **fit_params):
        TruthNet.closure_calls = 0
        step = super().train_step(batch, **fit_params)
        assert TruthNet.closure_calls == 1, "SGD calls the closure once"
        truth.train_step(microbatches=1)  # one optimizer.step(step_fn)
        return step

    def validation_step(self, batch, **fit_params):
        step = super().validation_step(batch, **fit_params)
        truth.eval_step()
        return step

    def evaluation_step(self, batch, training=False):
        out = super().evaluation_step(batch, training=training)
        truth.eval_step()  # forward_iter's batches (cached scoring never gets here)
        return out


class BookFetches(Callback):
    """(truth) Books the Dataset's sleeps of the batch just fetched to its step."""

    def on_batch_begin(self, net, batch=None, training=False, **kwargs):
        ledger.book(TRAIN if training else EVAL)


# -- README quickstart / notebooks --------------------------------------------------------
if __name__ == "__main__":
    np.random.seed(0)
    torch.manual_seed(0)
    X, y = make_classification(N + N_TEST, FEATURES, n_informative=10, random_state=0)
    X = X.astype(np.float32)
    y = y.astype(np.int64)
    X_train, X_test, y_train, y_test = X[:N], X[N:], y[:N], y[N:]

    net = TruthNet(
        MyModule,
        max_epochs=EPOCHS,
        lr=0.05,
        batch_size=BATCH,
        optimizer=torch.optim.SGD,
        optimizer__momentum=0.9,
        # Shuffle training data on each epoch
        iterator_train__shuffle=True,
        train_split=ValidSplit(5, stratified=True),
        dataset=DecodingDataset,
        callbacks=[
            ("book_fetches", BookFetches()),  # (truth)
            ("train_acc", EpochScoring("accuracy", lower_is_better=False, on_train=True, name="train_acc")),
            ("lr_scheduler", LRScheduler(policy=CyclicLR, base_lr=0.01, max_lr=0.1, step_size_up=5,
                                         step_every="batch")),
            ("checkpoint", NetworkCheckpoint(dirname=tempfile.mkdtemp(prefix="skorch-ckpt-"))),
            ("early_stopping", EarlyStopping(patience=5)),
            ("remote_metrics", RemoteMetrics()),
        ],
    )

    net.fit(X_train, y_train)

    with truth.timed(OUTSIDE, "outside"):  # the user's code after fit (the valid loop has ended)
        print("best valid_loss epoch:", int(np.argmin(net.history[:, "valid_loss"])) + 1)
    y_proba = net.predict_proba(X_test)
    truth.loop_end()  # forward_iter's DataLoader ended inside predict_proba
    ledger.book(EVAL)
    with truth.timed(OUTSIDE, "outside"):
        print("y_proba", y_proba.shape, "mean p(1) %.3f" % y_proba[:, 1].mean())
    y_pred = net.predict(X_test)
    truth.loop_end()
    ledger.book(EVAL)
    with truth.timed(OUTSIDE, "outside"):
        print("test accuracy: %.3f" % accuracy_score(y_test, y_pred))
    truth.stop()

    test_batches = math.ceil(N_TEST / BATCH)
    assert truth.eval_steps == EPOCHS * math.ceil(N // 5 / BATCH) + 2 * test_batches, truth.eval_steps
    assert truth.train_steps == EPOCHS * math.ceil(N * 4 // 5 / BATCH), truth.train_steps
    truth.notes.update(train_batches_per_epoch=net.history[-1, "train_batch_count"],
                       valid_batches_per_epoch=net.history[-1, "valid_batch_count"],
                       checkpoints=sum(net.history[:, "event_cp"]),
                       epochs=len(net.history))
    truth.emit()
