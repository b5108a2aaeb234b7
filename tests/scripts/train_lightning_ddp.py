"""Two ranks under Lightning's own launcher: ``Trainer(strategy="ddp", devices=2)`` on
the CPU (gloo). Rank 0 starts rank 1 as a copy of its own command line, with
``LOCAL_RANK`` and ``WORLD_SIZE`` but no ``RANK``. No OpenTelemetry in here.

Each rank prints ``RANK_OF <pid> <global rank> <world size>``: the truth to compare with."""

import argparse
import os

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.steps * 8, 8), torch.randint(0, 2, (args.steps * 8,)))
    trainer = L.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), DataLoader(data, batch_size=4))
    # One write of the whole line: the ranks share stdout, and print() writes the newline apart.
    os.write(1, f"RANK_OF {os.getpid()} {trainer.global_rank} {trainer.world_size}\n".encode())
