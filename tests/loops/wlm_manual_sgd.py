# Shape: pytorch/examples word_language_model/main.py — train() with manual SGD (no optimizer), then a no_grad evaluate(), per epoch; no DataLoader.
"""No optimizer at all: every ``loss.backward()`` followed by ``p.data.add_(p.grad,
alpha=-lr)`` is one training step; every batch of the no_grad ``evaluate()`` loop is one
eval step. Planted: a slow progress print after each update (``untracked`` of train
steps) and, as in the original, ``torch.save(model)`` of the best model each epoch."""

import math
import os
import tempfile

import torch
import torch.nn as nn

from _truth import TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(0)
truth = Truth("wlm_manual_sgd")

NTOKENS, EMSIZE, NHID, BPTT, CLIP = 50, 16, 16, 8, 0.25
BATCH_SIZE, EVAL_BATCH_SIZE, EPOCHS, LOG_INTERVAL = 4, 2, 2, 1
LOG_DELAY = 0.025


class RNNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(NTOKENS, EMSIZE)
        self.rnn = nn.LSTM(EMSIZE, NHID, 1)
        self.decoder = nn.Linear(NHID, NTOKENS)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, NTOKENS)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        w = next(self.parameters())
        return (w.new_zeros(1, bsz, NHID), w.new_zeros(1, bsz, NHID))


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    return data[:nbatch * bsz].view(bsz, -1).t().contiguous()


# a synthetic "corpus": 15 train batches and 5 validation batches of BPTT tokens
train_data = batchify(torch.randint(NTOKENS, (BATCH_SIZE * (15 * BPTT + 1),)), BATCH_SIZE)
val_data = batchify(torch.randint(NTOKENS, (EVAL_BATCH_SIZE * (5 * BPTT + 1),)), EVAL_BATCH_SIZE)
model = RNNModel()
criterion = nn.NLLLoss()
save_path = os.path.join(tempfile.mkdtemp(), "model.pt")


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(BPTT, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].view(-1)


def evaluate(data_source):
    model.eval()
    total_loss = 0.
    hidden = model.init_hidden(EVAL_BATCH_SIZE)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, BPTT):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
            truth.eval_step()
    return total_loss / (len(data_source) - 1)


def train(epoch):
    model.train()
    total_loss = 0.
    hidden = model.init_hidden(BATCH_SIZE)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, BPTT)):
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        truth.train_step(microbatches=1)
        total_loss += loss.item()
        if batch % LOG_INTERVAL == 0 and batch > 0:
            cur_loss = total_loss / LOG_INTERVAL
            print(f"| epoch {epoch:3d} | {batch:5d} batches | lr {lr:02.2f} | loss {cur_loss:5.2f}")
            truth.sleep(TRAIN, "untracked", LOG_DELAY)  # a slow console / log shipper
            total_loss = 0


lr = 20.0
best_val_loss = None
truth.start()
for epoch in range(1, EPOCHS + 1):
    train(epoch)
    val_loss = evaluate(val_data)
    print(f"| end of epoch {epoch:3d} | valid loss {val_loss:5.2f} | valid ppl {math.exp(min(val_loss, 50)):8.2f}")
    if not best_val_loss or val_loss < best_val_loss:
        with open(save_path, "wb") as f:
            torch.save(model, f)
        best_val_loss = val_loss
    else:
        lr /= 4.0
truth.stop()
truth.emit()
