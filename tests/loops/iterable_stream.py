# Shape: the IterableDataset example of torch.utils.data (MyIterableDataset: __iter__ over a range, split with get_worker_info) feeding pytorch/examples mnist/main.py's train() and no_grad test() loops.
"""Streaming data: ``IterableDataset``s (no ``__len__``, no sampler) under a batching
DataLoader; the stream's end is the loader's ``StopIteration``, which must not make a
step. The last train batch of each pass is short (50 samples, batches of 8). One
training step per update, one eval step per test batch. Planted: a slow stream (each
sample takes time to arrive: ``dataloader_next`` of train and eval steps) and a slow
log line every batch (``untracked``)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from _truth import EVAL, TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(0)
truth = Truth("iterable_stream")
EPOCHS, SAMPLE_DELAY_TRAIN, SAMPLE_DELAY_TEST, LOG_DELAY = 2, 0.005, 0.003, 0.020


class RecordStream(IterableDataset):
    def __init__(self, start, end, delay, mode):
        super().__init__()
        assert end > start
        self.start, self.end, self.delay, self.mode = start, end, delay, mode

    def __iter__(self):
        worker_info = get_worker_info()
        if worker_info is None:
            iter_start, iter_end = self.start, self.end
        else:
            per_worker = int(math.ceil((self.end - self.start) / float(worker_info.num_workers)))
            iter_start = self.start + worker_info.id * per_worker
            iter_end = min(iter_start + per_worker, self.end)
        for i in range(iter_start, iter_end):
            truth.sleep(self.mode, "dataloader_next", self.delay)  # the next record arrives over the network
            g = torch.Generator().manual_seed(i)
            yield torch.randn(20, generator=g), i % 3


model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
train_loader = DataLoader(RecordStream(0, 50, SAMPLE_DELAY_TRAIN, TRAIN), batch_size=8)
test_loader = DataLoader(RecordStream(1000, 1024, SAMPLE_DELAY_TEST, EVAL), batch_size=12)

truth.start()
for epoch in range(1, EPOCHS + 1):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        truth.train_step(microbatches=1)
        print(f"Train Epoch: {epoch} batch {batch_idx} ({len(data)} records)\tLoss: {loss.item():.6f}")
        truth.sleep(TRAIN, "untracked", LOG_DELAY)
    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            correct += (model(data).argmax(1) == target).sum().item()
            truth.eval_step()
    print(f"Test set: {correct} correct")
truth.stop()
truth.emit()
