# Shape: pytorch/examples regression/main.py — `for batch_idx in count(1)`: get_batch, fc.zero_grad, forward, .item(), backward, manual param update; no optimizer, no DataLoader.
"""No optimizer: one backward pass (with its forward) is one training step. The
original stops at loss < 1e-3; a cap of 40 batches keeps the run short. Planted: a slow
progress report after each update (``untracked``)."""

from itertools import count

import torch
import torch.nn.functional as F

from _truth import TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(0)
truth = Truth("regression_manual_sgd")

POLY_DEGREE = 4
MAX_BATCHES = 30
REPORT_DELAY = 0.025
W_target = torch.randn(POLY_DEGREE, 1) * 5
b_target = torch.randn(1) * 5


def make_features(x):
    x = x.unsqueeze(1)
    return torch.cat([x ** i for i in range(1, POLY_DEGREE + 1)], 1)


def f(x):
    return x.mm(W_target) + b_target.item()


def get_batch(batch_size=32):
    random = torch.randn(batch_size)
    x = make_features(random)
    return x, f(x)


fc = torch.nn.Linear(W_target.size(0), 1)

truth.start()
for batch_idx in count(1):
    batch_x, batch_y = get_batch()
    fc.zero_grad()
    output = F.smooth_l1_loss(fc(batch_x), batch_y)
    loss = output.item()
    output.backward()
    for param in fc.parameters():
        param.data.add_(-0.1 * param.grad)
    truth.train_step(microbatches=1)
    truth.sleep(TRAIN, "untracked", REPORT_DELAY)  # e.g. a progress report to a dashboard
    if loss < 1e-3 or batch_idx >= MAX_BATCHES:
        break
truth.stop()
print(f"Loss: {loss:.6f} after {batch_idx} batches")
truth.emit()
