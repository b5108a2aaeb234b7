# Shape: pytorch/examples regression/main.py, with a torch optimizer built (and used for zero_grad) while the update stays manual: optimizer.step() is never called.
"""NEGATIVE case: step detection must report doubt. An optimizer exists but never
steps, so a detector that waits for optimizer updates sees one huge train step that
swallows all 40 backward passes; the run-end self-check must say so (``self_check``
not empty, an ``otel-training: step detection`` line on stderr). TRUTH is printed for
reference only: it is what a human would count (40 backward passes, 40 updates)."""

import torch
import torch.nn.functional as F

from _truth import TRAIN, Truth

torch.set_num_threads(1)
torch.manual_seed(0)
truth = Truth("neg_optimizer_never_stepped")
W_target = torch.randn(4, 1) * 5
b_target = torch.randn(1) * 5


def get_batch(batch_size=32):
    x = torch.randn(batch_size).unsqueeze(1)
    x = torch.cat([x ** i for i in range(1, 5)], 1)
    return x, x.mm(W_target) + b_target.item()


fc = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(fc.parameters(), lr=0.1)  # built, used for zero_grad only
truth.start()
for batch_idx in range(1, 41):
    batch_x, batch_y = get_batch()
    optimizer.zero_grad()
    output = F.smooth_l1_loss(fc(batch_x), batch_y)
    output.backward()
    with torch.no_grad():
        for param in fc.parameters():
            param -= 0.1 * param.grad
    truth.train_step(microbatches=1)
    truth.sleep(TRAIN, "untracked", 0.005)
truth.stop()
truth.emit()
