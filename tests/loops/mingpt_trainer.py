# Shape: karpathy/minGPT mingpt/trainer.py — Trainer.run(): a DataLoader over a RandomSampler(replacement=True), next(data_iter) with a StopIteration restart, forward, zero_grad, backward, clip, step, trigger_callbacks('on_batch_end'), max_iters.
"""One step per ``optimizer.step()``. Changes from the original, to stay small on 2
cores: ``num_workers=0`` (the original uses 4 worker processes) and a RandomSampler of 28
samples rather than 1e10, so that the ``StopIteration`` restart branch runs twice in 20
iterations (a loader end must not make a step of its own). Planted: a slow Dataset
``__getitem__`` (``dataloader_next``) and a slow ``on_batch_end`` callback of the
user's own (``untracked``: it is not a framework callback)."""

import time
from collections import defaultdict

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.data import Dataset
from torch.utils.data.dataloader import DataLoader

from _truth import TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(3407)
truth = Truth("mingpt_trainer")
SAMPLE_DELAY, CALLBACK_DELAY = 0.010, 0.020


class CharDataset(Dataset):
    def __init__(self, n=64, block_size=12, vocab=32):
        self.data = torch.randint(vocab, (n + block_size + 1,))
        self.n, self.block_size = n, block_size

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        truth.sleep(TRAIN, "dataloader_next", SAMPLE_DELAY)  # e.g. tokenizing text on the fly
        chunk = self.data[idx:idx + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class TinyLM(nn.Module):
    def __init__(self, vocab=32, n_embd=32):
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 64), nn.GELU(), nn.Linear(64, vocab))

    def forward(self, idx, targets=None):
        logits = self.mlp(self.tok(idx))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, config):
        return torch.optim.AdamW(self.parameters(), lr=config["learning_rate"], betas=config["betas"])


class Trainer:
    def __init__(self, config, model, train_dataset):
        self.config = config
        self.model = model
        self.optimizer = None
        self.train_dataset = train_dataset
        self.callbacks = defaultdict(list)
        self.device = "cpu"
        self.model = self.model.to(self.device)
        self.iter_num = 0
        self.iter_time = 0.0
        self.iter_dt = 0.0

    def add_callback(self, onevent, callback):
        self.callbacks[onevent].append(callback)

    def trigger_callbacks(self, onevent):
        for callback in self.callbacks.get(onevent, []):
            callback(self)

    def run(self):
        model, config = self.model, self.config
        self.optimizer = model.configure_optimizers(config)
        train_loader = DataLoader(
            self.train_dataset,
            sampler=torch.utils.data.RandomSampler(self.train_dataset, replacement=True, num_samples=28),
            shuffle=False,
            pin_memory=False,  # True in the original: a no-op without an accelerator
            batch_size=config["batch_size"],
            num_workers=config["num_workers"],
        )
        model.train()
        self.iter_num = 0
        self.iter_time = time.time()
        truth.start()  # just before the loop (building AdamW above takes ~1 s of imports)
        data_iter = iter(train_loader)
        while True:
            try:
                batch = next(data_iter)
            except StopIteration:
                data_iter = iter(train_loader)
                batch = next(data_iter)
            batch = [t.to(self.device) for t in batch]
            x, y = batch
            logits, self.loss = model(x, y)
            model.zero_grad(set_to_none=True)
            self.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config["grad_norm_clip"])
            self.optimizer.step()
            truth.train_step(microbatches=1)
            self.trigger_callbacks("on_batch_end")
            self.iter_num += 1
            tnow = time.time()
            self.iter_dt = tnow - self.iter_time
            self.iter_time = tnow
            if config["max_iters"] is not None and self.iter_num >= config["max_iters"]:
                break


def batch_end_callback(trainer):
    if trainer.iter_num % 10 == 0:
        print(f"iter_dt {trainer.iter_dt * 1000:.2f}ms; iter {trainer.iter_num}: train loss {trainer.loss.item():.5f}")
    truth.sleep(TRAIN, "untracked", CALLBACK_DELAY)  # e.g. pushing metrics to a tracker


config = {"num_workers": 0, "max_iters": 20, "batch_size": 4, "learning_rate": 5e-4,
          "betas": (0.9, 0.95), "grad_norm_clip": 1.0}
trainer = Trainer(config, TinyLM(), CharDataset())
trainer.add_callback("on_batch_end", batch_end_callback)
trainer.run()
truth.stop()
truth.emit()
