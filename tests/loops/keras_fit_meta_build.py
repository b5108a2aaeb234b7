# Shape: keras-team/keras 3 on the torch backend, Model.fit (keras/src/backend/torch/trainer.py fit, trainers/trainer.py _symbolic_build, trainers/epoch_iterator.py, backend/torch/core.py compute_output_spec) — fit makes an EpochIterator over a DataLoader, _symbolic_build takes its first batch and runs the model on `meta` tensors under no_grad to infer shapes (twice: the batch dimension is unknown), reset(); then per epoch: a train step per batch (forward, loss, backward, Keras's optimizer applying torch ops, no torch.optim), the EpochIterator leaving each epoch by its own count and making the next DataLoader iterator ahead; evaluate() over a cached validation EpochIterator (test steps under no_grad).
"""Reproduced without Keras (not a test dependency; tests/test_loop_shapes_found.py runs
Keras itself when it is installed): the shape pass on ``meta`` tensors computes
nothing and is no step at all -- not an eval step with the fetched batch's samples and
wait. With no torch optimizer, each backward pass is a train step; each validation
batch an eval step, the last one short. Keras's layers read their variables as
``meta`` tensors inside the meta pass (``convert_to_tensor`` under
``device_scope("meta")``): ``Dense`` below does the same. Planted: a slow Dataset
``__getitem__`` (``dataloader_next``; the shape pass's fetch lies before the first
step) and a slow progress bar after each train batch (``callbacks.on_train_batch_end``:
train ``untracked``)."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from _truth import BEFORE, EVAL, TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(0)
truth = Truth("keras_fit_meta_build")

EPOCHS, BATCH_SIZE, LR = 2, 16, 0.01
SAMPLE_DELAY, PROGBAR_DELAY = 0.002, 0.015


class Arrays(Dataset):
    """``x, y`` numpy-like arrays behind Keras's data adapter; reading a sample sleeps."""

    def __init__(self, n, mode):
        g = torch.Generator().manual_seed(n)
        self.x, self.y = torch.rand(n, 8, generator=g), torch.rand(n, 2, generator=g)
        self.mode = mode

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        truth.sleep(self.mode, "dataloader_next", SAMPLE_DELAY)
        return self.x[i], self.y[i]


class EpochIterator:
    """keras/src/trainers/epoch_iterator.py (steps_per_execution=1, no steps_per_epoch)."""

    def __init__(self, dataset):
        self.loader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=False)
        self._num_batches = len(self.loader)
        self._current_iterator = None
        self._steps_seen = 0

    def reset(self):
        self._current_iterator = None
        self._steps_seen = 0
        self._epoch_iterator = None

    def _enumerate_iterator(self):
        steps_per_epoch = self._num_batches
        self._current_iterator = iter(self.loader)
        self._steps_seen = 0
        for step in range(0, steps_per_epoch):
            if self._steps_seen >= self._num_batches:
                break
            self._steps_seen += 1
            yield step, step, self._current_iterator
        if self._steps_seen >= self._num_batches:
            self._current_iterator = iter(self.loader)  # the next epoch's, made ahead
            self._steps_seen = 0

    def __iter__(self):
        self._epoch_iterator = self._enumerate_iterator()
        return self

    def __next__(self):
        begin_step, end_step, iterator = next(self._epoch_iterator)
        return begin_step, end_step, [next(iterator)]


class Dense(nn.Module):
    def __init__(self, n_in, n_out, relu=False):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(n_in, n_out) * 0.2)
        self.bias = nn.Parameter(torch.zeros(n_out))
        self.relu = relu

    def forward(self, x):
        kernel, bias = self.kernel, self.bias
        if x.is_meta:  # a variable read inside device_scope("meta")
            kernel, bias = torch.empty_like(kernel, device="meta"), torch.empty_like(bias, device="meta")
        y = x @ kernel + bias
        return F.relu(y) if self.relu else y


class Sequential(nn.Module):
    def __init__(self, *layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def compute_output_spec(fn, shape):
    """backend/torch/core.py: meta tensors for the symbolic inputs, under no_grad; a
    ``None`` dimension filled with 83, then with 89, to see which dimensions vary."""
    with torch.no_grad():
        outs = [fn(torch.ones((fill,) + tuple(shape[1:]), device="meta")) for fill in (83, 89)]
    return (None,) + tuple(outs[0].shape[1:])


model = Sequential(Dense(8, 32, relu=True), Dense(32, 2))
params = list(model.parameters())
train_data, val_data = Arrays(152, TRAIN), Arrays(40, EVAL)  # batches 16 x 9 + 8; 16, 16, 8


def train_step(data):
    x, y = data[0]
    y_pred = model(x)
    loss = F.mse_loss(y_pred, y)
    model.zero_grad()
    loss.backward()
    with torch.no_grad():  # Keras's optimizer.apply: torch ops on the variables
        torch._foreach_add_(params, [p.grad for p in params], alpha=-LR)
    truth.train_step(microbatches=1)
    truth.samples(TRAIN, x.size(0))
    return {"loss": loss}


def test_step(data):
    x, y = data[0]
    with torch.no_grad():
        loss = F.mse_loss(model(x), y)
    truth.eval_step()
    truth.samples(EVAL, x.size(0))
    return {"loss": loss}


def evaluate(epoch_iterator):
    model.eval()
    logs = {}
    for _begin, _end, data in epoch_iterator:
        logs = test_step(data)
    return {k: v.item() for k, v in logs.items()}


def fit(epochs):
    epoch_iterator = EpochIterator(train_data)
    train_data.mode = BEFORE  # _symbolic_build's batch: fetched before the first step
    for _, _, data in epoch_iterator:
        data_batch = data[0]
        break
    compute_output_spec(model, data_batch[0].shape)
    epoch_iterator.reset()
    train_data.mode = TRAIN
    eval_epoch_iterator = None
    truth.start()
    for epoch in range(epochs):
        model.train()
        logs = {}
        for _begin, _end, data in epoch_iterator:
            logs = train_step(data)
            with truth.timed(TRAIN, "untracked"):  # callbacks.on_train_batch_end: the progress bar
                truth.sleep(TRAIN, "untracked", PROGBAR_DELAY)
        epoch_logs = {k: v.item() for k, v in logs.items()}
        if eval_epoch_iterator is None:
            eval_epoch_iterator = EpochIterator(val_data)
        epoch_logs.update({f"val_{k}": v for k, v in evaluate(eval_epoch_iterator).items()})
        print(f"Epoch {epoch + 1}/{epochs} - " + " - ".join(f"{k}: {v:.4f}" for k, v in epoch_logs.items()))
    truth.stop()


fit(EPOCHS)
truth.emit()
