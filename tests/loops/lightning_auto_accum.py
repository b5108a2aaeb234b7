# Shape: Lightning docs, automatic optimization (LightningModule.training_step returns the loss, validation_step, configure_optimizers; Trainer.fit) with Trainer(accumulate_grad_batches=2).
"""Lightning runs backward for every batch and steps the optimizer every second batch:
one training step per optimizer update with two micro-batches; one eval step per
``validation_step``. Lightning's fetcher prefetches one batch ahead. Counted from
inside: ``training_step`` / ``validation_step`` calls and a step hook on the torch
optimizer. Planted: a slow Dataset ``__getitem__`` for both loaders
(``dataloader_next``) and a slow ``on_train_batch_end`` callback
(``callback.SlowLogging.on_train_batch_end``, twice per step). The loop's wall time is
taken from ``on_train_start`` to ``on_train_end``."""

import logging
import tempfile
import warnings

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

from _truth import EVAL, TRAIN, Truth

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")
torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
truth = Truth("lightning_auto_accum")
SAMPLE_DELAY_TRAIN, SAMPLE_DELAY_VAL, CALLBACK_DELAY = 0.005, 0.005, 0.010
pending = [0]  # backward passes since the last update


class Points(Dataset):
    def __init__(self, n, delay, mode):
        g = torch.Generator().manual_seed(n)
        self.x, self.y = torch.randn(n, 16, generator=g), torch.randint(0, 2, (n,), generator=g)
        self.delay, self.mode = delay, mode

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        truth.sleep(self.mode, "dataloader_next", self.delay)
        return self.x[i], self.y[i]


class LitClassifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        pending[0] += 1  # automatic optimization: Lightning runs one backward per training_step
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("val_loss", loss)
        truth.eval_step()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        optimizer.register_step_post_hook(
            lambda *_: (truth.train_step(microbatches=pending[0]), pending.__setitem__(0, 0)))
        return optimizer


class SlowLogging(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        truth.sleep(TRAIN, "callback.SlowLogging.on_train_batch_end", CALLBACK_DELAY)  # a synchronous upload


class LoopClock(L.Callback):
    def on_train_start(self, trainer, pl_module):
        truth.start()

    def on_train_end(self, trainer, pl_module):
        truth.stop()


train = DataLoader(Points(48, SAMPLE_DELAY_TRAIN, TRAIN), batch_size=4, shuffle=True)
val = DataLoader(Points(32, SAMPLE_DELAY_VAL, EVAL), batch_size=8)
# Lightning's defaults otherwise: progress bar, model summary, checkpointing, logger and
# the sanity check (its two validation batches run before on_train_start: eval steps
# too, before the timed loop).
trainer = L.Trainer(max_epochs=2, accumulate_grad_batches=2, accelerator="cpu", devices=1,
                    default_root_dir=tempfile.mkdtemp(), callbacks=[SlowLogging(), LoopClock()])
trainer.fit(LitClassifier(), train, val)
assert pending[0] == 0, "every backward pass went into an update"
truth.emit()
