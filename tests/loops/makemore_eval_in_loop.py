# Shape: karpathy/makemore makemore.py — InfiniteDataLoader.next() each step, forward, zero_grad, backward, step, log; every eval interval an @inference_mode evaluate() builds a new DataLoader inside the step loop and breaks out of it after max_batches.
"""Eval inside the training loop, over loaders nested in it: every ``EVAL_EVERY`` steps
``evaluate()`` runs on the train set and on the test set, each through a fresh
``DataLoader`` left early with ``break`` (as in the original, ``i >= max_batches``
breaks after ``max_batches + 1`` batches). The train Dataset object is shared by the
train loader and ``evaluate()``: its planted ``__getitem__`` delay counts for whichever
mode is fetching. Planted: the slow ``__getitem__`` (``dataloader_next`` of train and
eval steps), a slow log line every other step (train ``untracked``) and a slow
tensorboard flush after each evaluation (eval ``untracked``)."""

import os
import tempfile

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from _truth import EVAL, TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(3407)
truth = Truth("makemore_eval_in_loop")
MAX_STEPS, EVAL_EVERY, MAX_BATCHES = 16, 6, 2
SAMPLE_DELAY, LOG_DELAY, FLUSH_DELAY = 0.005, 0.040, 0.120
work_dir = tempfile.mkdtemp()
mode = TRAIN  # who is fetching from the datasets right now (train step or evaluate())


class CharDataset(Dataset):
    def __init__(self, n, max_len=8, vocab=27):
        g = torch.Generator().manual_seed(n)
        self.words = torch.randint(1, vocab, (n, max_len), generator=g)

    def __len__(self):
        return len(self.words)

    def __getitem__(self, idx):
        truth.sleep(mode, "dataloader_next", SAMPLE_DELAY)  # encoding a word, on the fly
        w = self.words[idx]
        x = torch.cat([torch.zeros(1, dtype=torch.long), w[:-1]])
        return x, w


class InfiniteDataLoader:
    def __init__(self, dataset, **kwargs):
        train_sampler = torch.utils.data.RandomSampler(dataset, replacement=True, num_samples=int(1e10))
        self.train_loader = DataLoader(dataset, sampler=train_sampler, **kwargs)
        self.data_iter = iter(self.train_loader)

    def next(self):
        try:
            batch = next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.train_loader)
            batch = next(self.data_iter)
        return batch


class Bigram(nn.Module):
    def __init__(self, vocab=27):
        super().__init__()
        self.logits = nn.Parameter(torch.zeros((vocab, vocab)))

    def forward(self, idx, targets=None):
        logits = self.logits[idx]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


@torch.inference_mode()
def evaluate(model, dataset, batch_size=50, max_batches=None):
    global mode
    mode = EVAL
    model.eval()
    loader = DataLoader(dataset, shuffle=True, batch_size=batch_size, num_workers=0)
    losses = []
    for i, batch in enumerate(loader):
        X, Y = batch
        logits, loss = model(X, Y)
        losses.append(loss.item())
        truth.eval_step()
        if max_batches is not None and i >= max_batches:
            break
    mean_loss = torch.tensor(losses).mean().item()
    model.train()
    mode = TRAIN
    return mean_loss


train_dataset, test_dataset = CharDataset(200), CharDataset(60)
model = Bigram()
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-8)
truth.start()  # before the InfiniteDataLoader: it starts its iterator when built
batch_loader = InfiniteDataLoader(train_dataset, batch_size=8, pin_memory=False, num_workers=0)

best_loss = None
step = 0
while True:
    batch = batch_loader.next()
    X, Y = batch
    logits, loss = model(X, Y)
    model.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    truth.train_step(microbatches=1)

    if step % 2 == 0:
        print(f"step {step} | loss {loss.item():.4f}")
        truth.sleep(TRAIN, "untracked", LOG_DELAY)

    if step > 0 and step % EVAL_EVERY == 0:
        train_loss = evaluate(model, train_dataset, batch_size=6, max_batches=MAX_BATCHES)
        test_loss = evaluate(model, test_dataset, batch_size=6, max_batches=MAX_BATCHES)
        truth.sleep(EVAL, "untracked", FLUSH_DELAY)  # writer.add_scalar(...); writer.flush()
        with truth.timed(EVAL, "untracked"):  # still the tail of the last eval step
            print(f"step {step} train loss: {train_loss} test loss: {test_loss}")
            if best_loss is None or test_loss < best_loss:
                torch.save(model.state_dict(), os.path.join(work_dir, "model.pt"))
                best_loss = test_loss

    step += 1
    if step >= MAX_STEPS:
        break
truth.stop()
truth.emit()
