"""Loop shapes of public scripts run unmodified that step detection once miscounted
(docs/steps.md): a model's submodule called directly after the loops (pytorch/examples'
VAE drawing samples with ``model.decode(z)``), Keras 3's shape pass on ``meta`` tensors
before training, and a GAN's batch used by two updates. The loop suite runs the same
shapes under ``opentelemetry-instrument`` (tests/loops/vae_decode_after_test.py,
keras_fit_meta_build.py, dcgan_two_optimizers.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import spin


def _loader(n: int, batch: int, width: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(n)
    return DataLoader(TensorDataset(torch.rand(n, width, generator=g), torch.rand(n, 2, generator=g)), batch_size=batch)


def _sizes(steps, mode: str) -> list:
    return [s.attributes.get("training.batch_size") for s in steps if s.mode == mode]


class _Dense(nn.Module):
    """A Keras ``Dense`` layer on torch: inside a meta device scope its variables read as
    ``meta`` tensors (keras/src/backend/torch/core.py ``convert_to_tensor``)."""

    def __init__(self, n_in: int, n_out: int, relu: bool = False) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(n_in, n_out) * 0.1)
        self.bias = nn.Parameter(torch.zeros(n_out))
        self.relu = relu

    def forward(self, x):
        kernel, bias = self.kernel, self.bias
        if x.is_meta:
            kernel, bias = torch.empty_like(kernel, device="meta"), torch.empty_like(bias, device="meta")
        y = x @ kernel + bias
        return F.relu(y) if self.relu else y


def test_a_forward_on_meta_tensors_is_no_step(instrumented):
    """Keras 3 on torch fetches a batch, then runs the model on ``meta`` tensors to infer
    shapes (twice: the batch dimension is unknown): no step, no samples, no root made of
    its submodules; the same on a model already known."""
    tel = instrumented()
    model = nn.Sequential(_Dense(8, 16, relu=True), _Dense(16, 2))
    params = list(model.parameters())
    loader = _loader(40, 16)
    it = iter(loader)
    next(it)  # trainer._symbolic_build: the first batch, for its shapes
    with torch.no_grad():
        for fill in (83, 89):  # backend/torch/core.py compute_output_spec
            model(torch.ones(fill, 8, device="meta"))
    del it  # epoch_iterator.reset()
    for _ in range(2):
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            model.zero_grad()
            loss.backward()
            with torch.no_grad():  # Keras's optimizer: torch ops, no torch.optim
                torch._foreach_add_(params, [p.grad for p in params], alpha=-0.1)
        with torch.no_grad():
            model(torch.ones(83, 8, device="meta"))  # a known root on meta: no step either
    roots = tel.runtime.module_hooks.roots()
    tel.uninstrument()
    steps = tel.steps()
    assert [s.mode for s in steps] == ["train"] * 6, [(s.mode, s.index, s.top_level()) for s in steps]
    assert _sizes(steps, "train") == [16, 16, 8] * 2
    assert roots == [model], roots  # its layers, called at top level on meta, are no roots


class _VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc21, self.fc22 = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 4)
        self.fc3, self.fc4 = nn.Linear(4, 16), nn.Linear(16, 8)

    def decode(self, z):
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z))))

    def forward(self, x):
        h = F.relu(self.fc1(x))
        mu, logvar = self.fc21(h), self.fc22(h)
        return self.decode(mu + torch.randn_like(logvar) * torch.exp(0.5 * logvar)), mu, logvar


def test_a_submodule_called_after_the_loops_is_an_eval_step(instrumented):
    """pytorch/examples vae/main.py: after ``test(epoch)``, ``model.decode(sample)`` under
    no_grad calls two submodules directly, never called at top level before: one eval
    step (a forward, no backward) with the 64 latents as its samples, holding the
    ``save_image`` after it."""
    tel = instrumented()
    model = _VAE()
    opt = torch.optim.Adam(model.parameters())
    train, test = _loader(32, 16), _loader(40, 16)
    saves = []
    for _ in range(2):
        model.train()
        for x, _y in train:
            opt.zero_grad()
            recon, _mu, _logvar = model(x)
            F.binary_cross_entropy(recon, x).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            for x, _y in test:
                model(x)
        with torch.no_grad():
            sample = model.decode(torch.randn(64, 4)).cpu()
            saves.append(spin(0.05))  # save_image(sample, ...)
    tel.uninstrument()
    steps = tel.steps()
    assert [s.mode for s in steps] == (["train"] * 2 + ["eval"] * 4) * 2, [(s.mode, s.top_level()) for s in steps]
    assert _sizes(steps, "eval") == [16, 16, 8, 64] * 2
    decodes = [s for s in steps if s.mode == "eval" and s.attributes.get("training.batch_size") == 64]
    for step, saved in zip(decodes, saves):
        assert step.duration >= saved, (step.duration, saved)  # the save is in that step, not between steps
        assert len(step.named("forward")) == 2  # fc3 and fc4: one step
    assert sample.shape == (64, 8)


def test_a_gan_batch_used_by_two_updates_counts_once(instrumented):
    """pytorch/examples dcgan/main.py: D on the real batch and on a fake one, D's update,
    then G's update through D on the fake batch: one training step that consumed the
    real batch once (the fake batches are no data)."""
    tel = instrumented()
    net_g, net_d = nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 1), nn.Sigmoid())
    opt_d, opt_g = torch.optim.Adam(net_d.parameters()), torch.optim.Adam(net_g.parameters())
    loader = _loader(40, 16)
    for _ in range(2):
        for x, _y in loader:
            n = x.size(0)
            net_d.zero_grad()
            F.binary_cross_entropy(net_d(x).view(-1), torch.ones(n)).backward()
            fake = net_g(torch.randn(n, 4))
            F.binary_cross_entropy(net_d(fake.detach()).view(-1), torch.zeros(n)).backward()
            opt_d.step()
            net_g.zero_grad()
            F.binary_cross_entropy(net_d(fake).view(-1), torch.ones(n)).backward()
            opt_g.step()
    tel.uninstrument()
    steps = tel.steps()
    assert [s.mode for s in steps] == ["train"] * 6
    assert _sizes(steps, "train") == [16, 16, 8] * 2
    assert [s.attributes.get("training.step.microbatches") for s in steps] == [2] * 6


def test_keras_fit_on_torch_counts_no_shape_pass(instrumented):
    """Keras 3 itself (when installed), on the torch backend: the shape passes of
    ``Sequential`` with an ``Input`` and of ``fit`` are no steps; every batch is one."""
    if "keras" in sys.modules and os.environ.get("KERAS_BACKEND") != "torch":
        pytest.skip("keras already imported with another backend")
    os.environ.setdefault("KERAS_BACKEND", "torch")
    if os.environ["KERAS_BACKEND"] != "torch":
        pytest.skip("KERAS_BACKEND is not torch")
    tel = instrumented()
    keras = pytest.importorskip("keras")
    import numpy as np

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.random((40, 8), dtype=np.float32), rng.random((40, 2), dtype=np.float32)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False, validation_data=(x[:20], y[:20]))
    tel.uninstrument()
    steps = tel.steps()
    assert _sizes(steps, "train") == [16, 16, 8] * 2, [(s.mode, s.index, s.top_level()) for s in steps]
    assert _sizes(steps, "eval") == [16, 4] * 2, [(s.mode, s.index, s.top_level()) for s in steps]
