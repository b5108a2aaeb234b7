# Shape: pytorch/examples mnist/main.py — per epoch: train() over a DataLoader (zero_grad, forward, nll_loss, backward, step, log every log_interval), test() under no_grad over a test DataLoader, then scheduler.step().
"""One step per ``optimizer.step()``; one eval step per test batch. Planted: a slow
Dataset ``__getitem__`` for both loaders (``dataloader_next``) and a slow log line
every ``LOG_INTERVAL`` train batches (``untracked``)."""

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Dataset

from _truth import EVAL, TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(1)
truth = Truth("mnist_dataloader")

EPOCHS, BATCH_SIZE, TEST_BATCH_SIZE, LOG_INTERVAL = 2, 8, 16, 2
SAMPLE_DELAY_TRAIN, SAMPLE_DELAY_TEST, LOG_DELAY = 0.005, 0.0025, 0.040


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(8 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


class SlowImages(Dataset):
    """Synthetic 12x12 "digits" whose decode sleeps (like reading and decoding files)."""

    def __init__(self, n, delay, mode):
        g = torch.Generator().manual_seed(n)
        self.x = torch.randn(n, 1, 12, 12, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.delay, self.mode = delay, mode

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        truth.sleep(self.mode, "dataloader_next", self.delay)
        return self.x[i], self.y[i]


def train(model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        truth.train_step(microbatches=1)
        if batch_idx % LOG_INTERVAL == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)}]"
                  f"\tLoss: {loss.item():.6f}")
            truth.sleep(TRAIN, "untracked", LOG_DELAY)  # a slow console / log shipper


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
            truth.eval_step()
    test_loss /= len(test_loader.dataset)
    print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(test_loader.dataset)}\n")


device = torch.device("cpu")
train_loader = DataLoader(SlowImages(64, SAMPLE_DELAY_TRAIN, TRAIN), batch_size=BATCH_SIZE, shuffle=True)
test_loader = DataLoader(SlowImages(48, SAMPLE_DELAY_TEST, EVAL), batch_size=TEST_BATCH_SIZE)
model = Net().to(device)
optimizer = optim.Adadelta(model.parameters(), lr=1.0)
scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
truth.start()
for epoch in range(1, EPOCHS + 1):
    train(model, device, train_loader, optimizer, epoch)
    test(model, device, test_loader)
    scheduler.step()
truth.stop()
truth.emit()
