# Shape: fungtion/DANN train/main.py — per epoch: iter() over a source and a target DataLoader; while i < len_dataloader: next(source), zero_grad, forward (class + domain heads), next(target) in the middle of the step, forward, one backward of the summed losses, optimizer.step(), print; then torch.save(model) and test() on both domains (train/test.py: torch.load, .eval(), next() over a DataLoader, forwards WITHOUT no_grad).
"""Two loaders feed one step: the target batch is fetched after the source forward, in
the middle of the step. One training step per ``optimizer.step()``, one micro-batch.
``test()`` loads the saved model back (a copy that carries no instrumentation of its
own) and evaluates it in eval mode with grad still enabled, as the original does: one
eval step per test batch (forwards, no backward). Tiny MLPs stand in for the CNN.
Planted: slow ``__getitem__`` for every dataset (train and eval ``dataloader_next``;
the target fetch sits inside the step's forward/backward span) and a slow console
after each iteration (train ``untracked``). The checkpoint save and ``test()``'s set-up
are timed as user code of the step they follow."""

import os
import tempfile

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
import torch.utils.data
from torch.autograd import Function

from _truth import EVAL, TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(7)
truth = Truth("dann_two_loaders")
N_EPOCH, BATCH, LR = 2, 8, 1e-3
SAMPLE_DELAY_TRAIN, SAMPLE_DELAY_TEST, PRINT_DELAY = 0.0025, 0.005, 0.020
model_root = tempfile.mkdtemp()


class Digits(torch.utils.data.Dataset):
    def __init__(self, n, shift, delay, mode):
        g = torch.Generator().manual_seed(n + int(shift * 10))
        self.x = torch.randn(n, 3 * 8 * 8, generator=g) + shift
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.delay, self.mode = delay, mode

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        truth.sleep(self.mode, "dataloader_next", self.delay)  # image decode + transform
        return self.x[i], self.y[i]


class ReverseLayerF(Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.neg() * ctx.alpha, None


class CNNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.feature = nn.Sequential(nn.Linear(3 * 8 * 8, 32), nn.ReLU(True))
        self.class_classifier = nn.Sequential(nn.Linear(32, 10), nn.LogSoftmax(dim=1))
        self.domain_classifier = nn.Sequential(nn.Linear(32, 2), nn.LogSoftmax(dim=1))

    def forward(self, input_data, alpha):
        feature = self.feature(input_data)
        reverse_feature = ReverseLayerF.apply(feature, alpha)
        return self.class_classifier(feature), self.domain_classifier(reverse_feature)


def test(dataset_name, epoch, after):
    # the set-up runs in the tail of the step before (``after``: train for the first
    # test() of an epoch, eval for the second)
    with truth.timed(after, "untracked"):
        dataset = Digits(24, 0.0 if dataset_name == "mnist" else 0.5, SAMPLE_DELAY_TEST, EVAL)
        dataloader = torch.utils.data.DataLoader(dataset=dataset, batch_size=BATCH, shuffle=False, num_workers=0)
        my_net = torch.load(os.path.join(model_root, f"mnist_mnistm_model_epoch_{epoch}.pth"), weights_only=False)
        my_net = my_net.eval()
        len_dataloader = len(dataloader)
        data_target_iter = iter(dataloader)
    i = n_total = n_correct = 0
    while i < len_dataloader:
        t_img, t_label = next(data_target_iter)
        class_output, _ = my_net(input_data=t_img, alpha=0)
        pred = class_output.data.max(1, keepdim=True)[1]
        n_correct += pred.eq(t_label.data.view_as(pred)).cpu().sum()
        n_total += len(t_label)
        truth.eval_step()
        i += 1
    print(f"epoch: {epoch}, accuracy of the {dataset_name} dataset: {float(n_correct) / n_total:f}")


dataloader_source = torch.utils.data.DataLoader(Digits(64, 0.0, SAMPLE_DELAY_TRAIN, TRAIN), batch_size=BATCH,
                                                shuffle=True, num_workers=0)
dataloader_target = torch.utils.data.DataLoader(Digits(96, 0.5, SAMPLE_DELAY_TRAIN, TRAIN), batch_size=BATCH,
                                                shuffle=True, num_workers=0)
my_net = CNNModel()
optimizer = optim.Adam(my_net.parameters(), lr=LR)
loss_class = torch.nn.NLLLoss()
loss_domain = torch.nn.NLLLoss()
for p in my_net.parameters():
    p.requires_grad = True

truth.start()
for epoch in range(N_EPOCH):
    len_dataloader = min(len(dataloader_source), len(dataloader_target))
    data_source_iter = iter(dataloader_source)
    data_target_iter = iter(dataloader_target)
    i = 0
    while i < len_dataloader:
        p = float(i + epoch * len_dataloader) / N_EPOCH / len_dataloader
        alpha = 2. / (1. + np.exp(-10 * p)) - 1
        s_img, s_label = next(data_source_iter)
        my_net.zero_grad()
        batch_size = len(s_label)
        domain_label = torch.zeros(batch_size).long()
        class_output, domain_output = my_net(input_data=s_img, alpha=alpha)
        err_s_label = loss_class(class_output, s_label)
        err_s_domain = loss_domain(domain_output, domain_label)
        t_img, _ = next(data_target_iter)
        domain_label = torch.ones(len(t_img)).long()
        _, domain_output = my_net(input_data=t_img, alpha=alpha)
        err_t_domain = loss_domain(domain_output, domain_label)
        err = err_t_domain + err_s_domain + err_s_label
        err.backward()
        optimizer.step()
        truth.train_step(microbatches=1)
        i += 1
        print(f"epoch: {epoch}, [iter: {i} / all {len_dataloader}], err_s_label: {err_s_label.cpu().data.numpy():f}, "
              f"err_s_domain: {err_s_domain.cpu().data.numpy():f}, err_t_domain: {err_t_domain.cpu().data.numpy():f}")
        truth.sleep(TRAIN, "untracked", PRINT_DELAY)
    with truth.timed(TRAIN, "untracked"):
        torch.save(my_net, os.path.join(model_root, f"mnist_mnistm_model_epoch_{epoch}.pth"))
    test("mnist", epoch, after=TRAIN)
    test("mnist_m", epoch, after=EVAL)
truth.stop()
truth.emit()
