# Shape: pytorch/examples vae/main.py — per epoch: train(epoch) over a DataLoader (zero_grad, forward, BCE+KLD loss, backward, loss.item(), step, log every log_interval), test(epoch) under no_grad over a test DataLoader (save_image of a reconstruction at i == 0), then under no_grad `sample = model.decode(torch.randn(64, 20))` and save_image of the samples.
"""One train step per ``optimizer.step()``; one eval step per test batch (the last one
short); and ``model.decode(sample)`` after ``test()``: the model's submodules called
directly (``decode`` is a method, not a module call), one forward with no backward,
never called at top level during the loops -- an eval step of its own, with the 64
sampled latents as its samples. Tiny linear layers on 8x8 "images" stand in for
MNIST. Planted: a slow Dataset ``__getitem__`` for both loaders (``dataloader_next``),
a slow log line every ``LOG_INTERVAL`` train batches (train ``untracked``), a slow
``save_image`` of the reconstruction and of the samples (eval ``untracked``)."""

import torch
import torch.nn.functional as F
import torch.utils.data
from torch import nn, optim
from torch.utils.data import DataLoader, Dataset

from _truth import EVAL, TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(1)
truth = Truth("vae_decode_after_test")

EPOCHS, BATCH_SIZE, LOG_INTERVAL, PIXELS, LATENT, SAMPLES = 2, 16, 2, 64, 8, 64
SAMPLE_DELAY_TRAIN, SAMPLE_DELAY_TEST, LOG_DELAY, SAVE_DELAY = 0.002, 0.002, 0.030, 0.020


class SlowImages(Dataset):
    """Synthetic 8x8 images in [0, 1] whose decode sleeps (like reading files)."""

    def __init__(self, n, delay, mode):
        g = torch.Generator().manual_seed(n)
        self.x = torch.rand(n, 1, 8, 8, generator=g)
        self.delay, self.mode = delay, mode

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        truth.sleep(self.mode, "dataloader_next", self.delay)
        return self.x[i], 0


train_loader = DataLoader(SlowImages(128, SAMPLE_DELAY_TRAIN, TRAIN), batch_size=BATCH_SIZE, shuffle=True)
test_loader = DataLoader(SlowImages(40, SAMPLE_DELAY_TEST, EVAL), batch_size=BATCH_SIZE, shuffle=False)


class VAE(nn.Module):
    def __init__(self):
        super(VAE, self).__init__()
        self.fc1 = nn.Linear(PIXELS, 32)
        self.fc21 = nn.Linear(32, LATENT)
        self.fc22 = nn.Linear(32, LATENT)
        self.fc3 = nn.Linear(LATENT, 32)
        self.fc4 = nn.Linear(32, PIXELS)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, PIXELS))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


model = VAE()
optimizer = optim.Adam(model.parameters(), lr=1e-3)


def loss_function(recon_x, x, mu, logvar):
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, PIXELS), reduction="sum")
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE + KLD


def save_image(tensor, path):
    truth.sleep(EVAL, "untracked", SAVE_DELAY)  # torchvision's save_image: a grid, a PNG


def train(epoch):
    model.train()
    train_loss = 0
    for batch_idx, (data, _) in enumerate(train_loader):
        optimizer.zero_grad()
        recon_batch, mu, logvar = model(data)
        loss = loss_function(recon_batch, data, mu, logvar)
        loss.backward()
        train_loss += loss.item()
        optimizer.step()
        truth.train_step(microbatches=1)
        truth.samples(TRAIN, data.size(0))
        if batch_idx % LOG_INTERVAL == 0:
            print(
                "Train Epoch: {} [{}/{}]\tLoss: {:.6f}".format(
                    epoch, batch_idx * len(data), len(train_loader.dataset), loss.item() / len(data)
                )
            )
            truth.sleep(TRAIN, "untracked", LOG_DELAY)  # a slow console
    truth.loop_end()
    print("====> Epoch: {} Average loss: {:.4f}".format(epoch, train_loss / len(train_loader.dataset)))


def test(epoch):
    model.eval()
    test_loss = 0
    with torch.no_grad():
        for i, (data, _) in enumerate(test_loader):
            recon_batch, mu, logvar = model(data)
            test_loss += loss_function(recon_batch, data, mu, logvar).item()
            truth.eval_step()
            truth.samples(EVAL, data.size(0))  # the last batch holds 8
            if i == 0:
                n = min(data.size(0), 8)
                comparison = torch.cat([data[:n], recon_batch.view(data.size(0), 1, 8, 8)[:n]])
                save_image(comparison.cpu(), "results/reconstruction_" + str(epoch) + ".png")
    truth.loop_end()
    test_loss /= len(test_loader.dataset)
    print("====> Test set loss: {:.4f}".format(test_loss))


truth.start()
for epoch in range(1, EPOCHS + 1):
    train(epoch)
    test(epoch)
    with torch.no_grad():
        sample = torch.randn(SAMPLES, LATENT)
        sample = model.decode(sample).cpu()
        truth.eval_step()
        truth.samples(EVAL, SAMPLES)
        save_image(sample.view(SAMPLES, 1, 8, 8), "results/sample_" + str(epoch) + ".png")
truth.stop()
truth.emit()
