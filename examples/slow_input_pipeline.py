"""An image-classification loop with two planted bottlenecks, for docs/diagnose.md.

- ``EncodedImages``: each sample is stored compressed (``load``) and decoded,
  cropped and normalized per access (``transform``); the decoder is slow
  (``--decode-ms``, like a JPEG decoder on a busy CPU).
- ``MetricsUploader``: a logging callback that uploads the loss synchronously
  every step (``--upload-ms``, like an HTTP call), and reads it with ``.item()``.

Nothing here imports OpenTelemetry. Run it instrumented, with a run-end summary::

    OTEL_TRAINING_SUMMARY_FILE=run.json opentelemetry-instrument \\
        --service_name slow-pipeline python examples/slow_input_pipeline.py
    otel-training report --summary run.json
    otel-training bench-data examples/slow_input_pipeline.py:make_dataset --summary run.json

``--framework lightning`` runs the same model, data and callback through PyTorch
Lightning (the integration then times ``MetricsUploader`` by name).
"""

from __future__ import annotations

import argparse
import os
import time
import zlib

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

SIZE = 40  # stored images are 3x40x40 uint8; the model sees 3x32x32 crops
DECODE_S = float(os.environ.get("SLOW_PIPELINE_DECODE_MS", "6")) / 1e3


class EncodedImages(Dataset):
    """Synthetic compressed images; ``dataset[i] == transform(load(i))``."""

    def __init__(self, n: int = 512, decode_s: float = DECODE_S) -> None:
        self.n, self.decode_s = n, decode_s
        g = torch.Generator().manual_seed(0)
        pixels = torch.randint(0, 256, (n, 3, SIZE, SIZE), dtype=torch.uint8, generator=g)
        self.blobs = [zlib.compress(p.numpy().tobytes()) for p in pixels]
        self.labels = [int(x) for x in torch.randint(0, 10, (n,), generator=g)]

    def __len__(self) -> int:
        return self.n

    def load(self, i: int):
        """Read the stored (compressed) sample: cheap here, I/O in real life."""
        return self.blobs[i], self.labels[i]

    def transform(self, raw):
        """Decode, random-crop, normalize: the expensive part."""
        blob, label = raw
        x = torch.frombuffer(bytearray(zlib.decompress(blob)), dtype=torch.uint8).view(3, SIZE, SIZE)
        time.sleep(self.decode_s)  # the slow decoder
        top, left = torch.randint(0, SIZE - 32 + 1, (2,)).tolist()
        x = x[:, top:top + 32, left:left + 32].float().div_(255).sub_(0.5).div_(0.25)
        return x, label

    def __getitem__(self, i: int):
        return self.transform(self.load(i))


def make_dataset():
    """Factory for ``otel-training bench-data examples/slow_input_pipeline.py:make_dataset``."""
    return EncodedImages()


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )


class MetricsUploader:
    """A logging callback: uploads the loss every step, synchronously."""

    def __init__(self, upload_s: float) -> None:
        self.upload_s = upload_s

    def on_step_end(self, step: int, loss: torch.Tensor) -> None:
        value = loss.item()  # a device-to-host sync on a GPU
        time.sleep(self.upload_s)  # stands in for requests.post(...)
        if step % 50 == 0:
            print(f"step {step} loss {value:.3f}", flush=True)


def train_plain(args, dataset, device) -> None:
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        pin_memory=device.type == "cuda", persistent_workers=args.workers > 0)
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    callbacks = [MetricsUploader(args.upload_ms / 1e3)]
    step = 0
    while step < args.steps:
        for images, labels in loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = nn.functional.cross_entropy(model(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            for cb in callbacks:
                cb.on_step_end(step, loss)
            step += 1
            if step >= args.steps:
                break


def train_lightning(args, dataset, device) -> None:
    import lightning.pytorch as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()

        def training_step(self, batch, batch_idx):
            images, labels = batch
            return nn.functional.cross_entropy(self.net(images), labels)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    class UploaderCallback(L.Callback):
        def __init__(self, upload_s):
            self.uploader = MetricsUploader(upload_s)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.uploader.on_step_end(trainer.global_step, outputs["loss"])

    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        persistent_workers=args.workers > 0)
    trainer = L.Trainer(max_steps=args.steps, accelerator=device.type, devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[UploaderCallback(args.upload_ms / 1e3)])
    trainer.fit(Module(), loader)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=0, help="DataLoader num_workers (default 0)")
    p.add_argument("--decode-ms", type=float, default=DECODE_S * 1e3, help="decoder time per image")
    p.add_argument("--upload-ms", type=float, default=40.0, help="the callback's upload time per step")
    p.add_argument("--framework", choices=("plain", "lightning"), default="plain")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    torch.manual_seed(0)
    dataset = EncodedImages(decode_s=args.decode_ms / 1e3)
    device = torch.device(args.device)
    (train_lightning if args.framework == "lightning" else train_plain)(args, dataset, device)


if __name__ == "__main__":
    main()
