"""A CPU loop with a slow loader, for tests/test_top.py: each batch's fetch sleeps
``--fetch-ms`` (whole batches from the Dataset), the model's work is a few ms. Prints
``first step <unix time>`` when its first step ends and ``done <steps>`` at the end.
Plain PyTorch, no OpenTelemetry."""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--fetch-ms", type=float, default=30.0)
args = parser.parse_args()


class SlowBatches(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 32, 64, generator=g)
        self.y = torch.randint(0, 4, (n, 32), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(args.fetch_ms / 1e3)  # a slow disk or decode
        return self.x[i], self.y[i]


torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(SlowBatches(args.steps), batch_size=None)
steps = 0
for x, y in loader:
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    steps += 1
    if steps == 1:
        print(f"first step {time.time():.3f}", flush=True)
print(f"done {steps}", flush=True)
