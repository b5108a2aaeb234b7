# Shape: pytorch/examples dcgan/main.py — for each DataLoader batch: netD.zero_grad, D on real + backward, D on G(noise).detach() + backward, optimizerD.step(); netG.zero_grad, D on fake + backward, optimizerG.step(); print with .item(); `if i % 100 == 0`: save real samples, netG(fixed_noise), save fake samples; per epoch torch.save of both nets.
"""Both optimizers stepped in one iteration count once: one training step per batch,
with two micro-batches (the discriminator's two backward passes before
``optimizerD.step()``). ``netG(fixed_noise)`` at ``i % 100 == 0`` (here once per epoch,
at ``i == 0``) is a forward after the updates with no backward: its own eval step (it
runs with grad enabled and in train mode, as in the original). Tiny MLP nets stand in
for the conv nets. Planted: a slow Dataset ``__getitem__`` (``dataloader_next``), a
slow console after every iteration (train ``untracked``) and a slow ``save_image`` of
the fixed-noise samples (eval ``untracked``). The ``torch.save`` calls are timed as
user code of the train steps they follow. Samples: each real batch once per train step
(the generator's update reuses it), the fixed noise for the eval step."""

import os
import tempfile

import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, Dataset

from _truth import EVAL, TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(999)
truth = Truth("dcgan_two_optimizers")
NZ, IMG, NITER, BATCH = 8, 64, 2, 8
SAMPLE_DELAY, PRINT_DELAY, SAVE_DELAY = 0.005, 0.020, 0.020
outf = tempfile.mkdtemp()


class Images(Dataset):
    def __init__(self, n):
        self.x = torch.rand(n, IMG) * 2 - 1

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        truth.sleep(TRAIN, "dataloader_next", SAMPLE_DELAY)  # decoding an image
        return self.x[i], 0


def save_image(tensor, path):
    truth.sleep(EVAL, "untracked", SAVE_DELAY)  # vutils.save_image: make a grid, write a PNG
    torch.save(tensor, path)


netG = nn.Sequential(nn.Linear(NZ, 32), nn.ReLU(True), nn.Linear(32, IMG), nn.Tanh())
netD = nn.Sequential(nn.Linear(IMG, 32), nn.LeakyReLU(0.2, inplace=True), nn.Linear(32, 1), nn.Sigmoid())
criterion = nn.BCELoss()
fixed_noise = torch.randn(BATCH, NZ)
real_label, fake_label = 1, 0
optimizerD = optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
optimizerG = optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
dataloader = DataLoader(Images(64), batch_size=BATCH, shuffle=True)

truth.start()
for epoch in range(NITER):
    for i, data in enumerate(dataloader, 0):
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        real_cpu = data[0]
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
        output = netD(real_cpu).view(-1)
        errD_real = criterion(output, label)
        errD_real.backward()
        D_x = output.mean().item()
        noise = torch.randn(batch_size, NZ)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach()).view(-1)
        errD_fake = criterion(output, label)
        errD_fake.backward()
        D_G_z1 = output.mean().item()
        errD = errD_real + errD_fake
        optimizerD.step()

        # (2) Update G network: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)
        output = netD(fake).view(-1)
        errG = criterion(output, label)
        errG.backward()
        D_G_z2 = output.mean().item()
        optimizerG.step()
        truth.train_step(microbatches=2)
        truth.samples(TRAIN, batch_size)  # the real batch, once (the fake ones are no data)

        print(f"[{epoch}/{NITER}][{i}/{len(dataloader)}] Loss_D: {errD.item():.4f} Loss_G: {errG.item():.4f} "
              f"D(x): {D_x:.4f} D(G(z)): {D_G_z1:.4f} / {D_G_z2:.4f}")
        truth.sleep(TRAIN, "untracked", PRINT_DELAY)  # a slow console
        if i % 100 == 0:
            with truth.timed(TRAIN, "untracked"):  # user code in the train step's tail
                torch.save(real_cpu, os.path.join(outf, "real_samples.pt"))
            fake = netG(fixed_noise)
            truth.eval_step()
            truth.samples(EVAL, fixed_noise.size(0))
            save_image(fake.detach(), os.path.join(outf, f"fake_samples_epoch_{epoch:03d}.pt"))
    with truth.timed(TRAIN, "untracked"):  # the checkpoint: in the epoch's last train step
        torch.save(netG.state_dict(), os.path.join(outf, f"netG_epoch_{epoch}.pth"))
        torch.save(netD.state_dict(), os.path.join(outf, f"netD_epoch_{epoch}.pth"))
truth.stop()
truth.emit()
