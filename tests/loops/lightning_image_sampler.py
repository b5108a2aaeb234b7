# Shape: Lightning docs + lightning-bolts' image-sampler callbacks (TensorboardGenerativeModelImageSampler, LatentDimInterpolator): a LightningModule autoencoder trained with Trainer.fit (automatic optimization), and a Callback whose on_train_epoch_end, on rank 0, takes one batch of its own DataLoader, runs pl_module under eval() + no_grad and writes the image grid.
"""Lightning drives the training steps (one per optimizer update, one batch each). After
each epoch the sampler callback runs the model outside every step Lightning begins: by
docs/steps.md an eval step (one forward batch, no backward), its wait for its own
loader's batch that step's ``dataloader_next`` and the grid's write its ``untracked``.
Counted from inside: a step hook on the torch optimizer and the callback's forward.
Planted: a slow Dataset ``__getitem__`` for the training loader and for the sampler's
loader (``dataloader_next``), a slow image write (eval ``untracked``). No validation
loader: the sampler's batches are the run's only eval steps. The loop's wall time is
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
truth = Truth("lightning_image_sampler")
SAMPLE_DELAY_TRAIN, SAMPLE_DELAY_SAMPLER, WRITE_DELAY = 0.004, 0.006, 0.030
EPOCHS, N_TRAIN, BATCH, N_SAMPLES = 3, 48, 8, 8


class Images(Dataset):
    def __init__(self, n, delay, mode):
        g = torch.Generator().manual_seed(n)
        self.x = torch.rand(n, 1, 8, 8, generator=g)
        self.delay, self.mode = delay, mode

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        truth.sleep(self.mode, "dataloader_next", self.delay)  # decode + transform
        return self.x[i], 0


class LitAutoEncoder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 16), torch.nn.ReLU())
        self.decoder = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Sigmoid())

    def forward(self, x):
        return self.decoder(self.encoder(x)).view(-1, 1, 8, 8)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        loss = torch.nn.functional.mse_loss(self(x), x)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
        optimizer.register_step_post_hook(lambda *_: truth.train_step())
        return optimizer


class ImageSampler(L.Callback):
    """bolts' sampler callbacks, reduced: a fixed batch of the callback's own loader
    through the model, and the grid written out (a slow event file)."""

    def __init__(self, loader):
        self.loader = loader

    def on_train_epoch_end(self, trainer, pl_module):
        if not trainer.is_global_zero:
            return
        x, _ = next(iter(self.loader))
        x = x.to(pl_module.device)
        pl_module.eval()
        with torch.no_grad():
            images = pl_module(x)
        pl_module.train()
        truth.eval_step()
        with truth.timed(EVAL, "untracked"):
            grid = torch.cat([x, images], dim=0).clamp(0, 1)
            truth.sleep(EVAL, "untracked", WRITE_DELAY)  # torchvision.utils.make_grid + add_image
            del grid


class LoopClock(L.Callback):
    def on_train_start(self, trainer, pl_module):
        truth.start()

    def on_train_end(self, trainer, pl_module):
        truth.stop()


train = DataLoader(Images(N_TRAIN, SAMPLE_DELAY_TRAIN, TRAIN), batch_size=BATCH, shuffle=True)
samples = DataLoader(Images(N_SAMPLES, SAMPLE_DELAY_SAMPLER, EVAL), batch_size=N_SAMPLES)
# enable_checkpointing=False: not in the original. ModelCheckpoint's save at each epoch end
# lies between steps, unmeasured by this script; on a loaded machine it took over the 5%
# of this short loop that test_coverage leaves (fabric_accumulate times such saves).
trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, default_root_dir=tempfile.mkdtemp(),
                    enable_checkpointing=False, callbacks=[ImageSampler(samples), LoopClock()])
trainer.fit(LitAutoEncoder(), train)
truth.emit()
