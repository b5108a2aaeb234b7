# Shape: Lightning docs, manual optimization GAN example — automatic_optimization = False; training_step: g_opt, d_opt = self.optimizers(); discriminator loss on real + fake, manual_backward, d_opt.step(); generator loss, manual_backward, g_opt.step(); toggle/untoggle_optimizer.
"""Two optimizers stepped in one ``training_step``: one training step per batch. Only
the discriminator's backward comes before the step's first update, so each step has
one micro-batch. No validation. Planted: a slow ``on_train_batch_end`` callback
(``callback.SlowLogging.on_train_batch_end``). The loop's wall time is taken from
``on_train_start`` to ``on_train_end``."""

import logging
import tempfile
import warnings

import lightning.pytorch as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from _truth import TRAIN, Truth

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")
torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(0)
truth = Truth("lightning_manual_gan")
CALLBACK_DELAY, NZ = 0.020, 8


class GAN(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.G = nn.Sequential(nn.Linear(NZ, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh())
        self.D = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
        self.criterion = nn.BCEWithLogitsLoss()
        self.backward_passes = 0

    def sample_G(self, n):
        return self.G(torch.randn(n, NZ, device=self.device))

    def manual_backward(self, loss, *args, **kwargs):
        self.backward_passes += 1
        super().manual_backward(loss, *args, **kwargs)

    def training_step(self, batch, batch_idx):
        g_opt, d_opt = self.optimizers()
        (X,) = batch
        batch_size = X.shape[0]
        real_label = torch.ones((batch_size, 1), device=self.device)
        fake_label = torch.zeros((batch_size, 1), device=self.device)
        g_X = self.sample_G(batch_size)

        # optimize the discriminator
        self.toggle_optimizer(d_opt)
        d_x = self.D(X)
        errD_real = self.criterion(d_x, real_label)
        d_z = self.D(g_X.detach())
        errD_fake = self.criterion(d_z, fake_label)
        errD = errD_real + errD_fake
        d_opt.zero_grad()
        before = self.backward_passes
        self.manual_backward(errD)
        first_update_backward = self.backward_passes - before
        d_opt.step()
        self.untoggle_optimizer(d_opt)

        # optimize the generator
        self.toggle_optimizer(g_opt)
        d_z = self.D(g_X)
        errG = self.criterion(d_z, real_label)
        g_opt.zero_grad()
        self.manual_backward(errG)
        g_opt.step()
        self.untoggle_optimizer(g_opt)
        truth.train_step(microbatches=first_update_backward)
        self.log_dict({"g_loss": errG, "d_loss": errD}, prog_bar=True)

    def configure_optimizers(self):
        g_opt = torch.optim.Adam(self.G.parameters(), lr=1e-4)
        d_opt = torch.optim.Adam(self.D.parameters(), lr=1e-4)
        return g_opt, d_opt


class SlowLogging(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        truth.sleep(TRAIN, "callback.SlowLogging.on_train_batch_end", CALLBACK_DELAY)


class LoopClock(L.Callback):
    def on_train_start(self, trainer, pl_module):
        truth.start()

    def on_train_end(self, trainer, pl_module):
        truth.stop()


data = DataLoader(TensorDataset(torch.rand(80, 16) * 2 - 1), batch_size=8, shuffle=True)
# Lightning's defaults otherwise. Not its epoch-end checkpoint: that save lies between
# steps by definition (docs/steps.md; glue_accum_dataloader checks time planted there),
# and in this 0.7 s loop it alone is ~5% of the wall time.
trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, default_root_dir=tempfile.mkdtemp(),
                    enable_checkpointing=False, callbacks=[SlowLogging(), LoopClock()])
trainer.fit(GAN(), data)
truth.emit()
