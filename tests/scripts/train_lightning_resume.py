"""A Lightning run with ``ModelCheckpoint(every_n_train_steps=...)`` that fails after
a checkpoint (``--fail-at``), then, run again (``--resume``), resumes from the
checkpoint of global step ``--resume-at`` (``fit(ckpt_path=...)``) and finishes. No
otel-training import.

Each train step sleeps ``--step-ms``. Writes its own clock to
``<dir>/clock-<attempt>.json``: when each save ended (wall-clock seconds) and the
failure."""

import argparse
import json
import os
import time
import warnings

import torch

try:
    import lightning.pytorch as pl
except ImportError:  # the older package name
    import pytorch_lightning as pl

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--max-steps", type=int, default=12)
p.add_argument("--every", type=int, default=4)
p.add_argument("--fail-at", type=int, default=0)
p.add_argument("--resume-at", type=int, default=0)
p.add_argument("--step-ms", type=float, default=150.0)
args = p.parse_args()
warnings.filterwarnings("ignore")
attempt = 1 if args.resume_at else 0
clock = {"save_end": {}}


def save_clock():
    with open(os.path.join(args.dir, f"clock-{attempt}.json"), "w") as fh:
        json.dump(clock, fh)


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, i):
        x, y = batch
        time.sleep(args.step_ms / 1e3)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Checkpoints(pl.callbacks.ModelCheckpoint):
    def _save_checkpoint(self, trainer, filepath):
        super()._save_checkpoint(trainer, filepath)
        clock["save_end"][trainer.global_step] = time.time()


class Planted(pl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, i):
        if args.fail_at and trainer.global_step == args.fail_at:
            clock["failed"] = time.time()
            save_clock()
            raise RuntimeError(f"planted failure at global step {trainer.global_step}")


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
loader = torch.utils.data.DataLoader(data, batch_size=4)
ckpts = os.path.join(args.dir, "ckpt")
trainer = pl.Trainer(
    max_steps=args.max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
    enable_model_summary=False, num_sanity_val_steps=0,
    callbacks=[Planted(), Checkpoints(dirpath=ckpts, every_n_train_steps=args.every, save_top_k=-1)])
path = None
if args.resume_at:
    path = next(os.path.join(ckpts, f) for f in os.listdir(ckpts) if f.endswith(f"step={args.resume_at}.ckpt"))
trainer.fit(Model(), loader, ckpt_path=path)
clock["end"] = time.time()
save_clock()
