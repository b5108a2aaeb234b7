"""``otel-training demo``: a small synthetic training run with a deliberately slow
data pipeline, instrumented in-process, ending with the breakdown table.

Needs no Collector; with ``--export`` (or ``OTEL_EXPORTER_OTLP_ENDPOINT`` set) it
also exports over OTLP like any instrumented job.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

DESCRIPTION = (
    "Run a small synthetic training job with a deliberately slow data pipeline, instrumented "
    "in-process, and print where its step time goes. Needs no Collector; with --export (or "
    "OTEL_EXPORTER_OTLP_ENDPOINT set) it also exports over OTLP like any instrumented job."
)


def _build(device: str, sample_delay: float, samples: int, workers: int, batch_size: int):
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    class SlowImages(Dataset):
        """Synthetic 3x32x32 images; ``__getitem__`` sleeps like a slow decoder."""

        def __len__(self) -> int:
            return samples

        def __getitem__(self, i: int):
            time.sleep(sample_delay)
            g = torch.Generator().manual_seed(i)
            return torch.randn(3, 32, 32, generator=g), i % 10

    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    ).to(device)
    loader = DataLoader(
        SlowImages(), batch_size=batch_size, shuffle=True, num_workers=workers, pin_memory=device.startswith("cuda")
    )
    return model, loader


def train(model, loader, device: str, epochs: int, log_every: int = 20) -> float:
    """A plain PyTorch loop: nothing in it knows about OpenTelemetry."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * len(loader))
    loss_fn = torch.nn.CrossEntropyLoss()
    loss_value = 0.0
    for _epoch in range(epochs):
        model.train()
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if i % log_every == 0:
                loss_value = loss.item()
        model.eval()
        with torch.no_grad():
            for x, _ in loader:
                model(x.to(device))
                break
    return loss_value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="otel-training demo", description=DESCRIPTION)
    parser.add_argument("--epochs", type=int, default=2, help="epochs, each with an eval pass (default 2)")
    parser.add_argument("--samples", type=int, default=640, help="samples per epoch (default 640)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per batch (default 32)")
    parser.add_argument(
        "--sample-delay-ms",
        type=float,
        default=3.0,
        help="sleep per sample in the dataset, the planted bottleneck (default 3)",
    )
    parser.add_argument("--workers", type=int, default=0, help="DataLoader num_workers (default 0)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--export", action="store_true", help="export over OTLP (default when OTEL_EXPORTER_OTLP_ENDPOINT is set)"
    )
    parser.add_argument("--html", metavar="FILE", help="also write the run's HTML report (charts, findings) to FILE")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        import torch
    except ImportError:
        print("otel-training demo: needs PyTorch (pip install torch)", file=sys.stderr)
        return 2
    from opentelemetry import metrics, trace

    from otel_training.config import load_config
    from otel_training.instrumentor import TrainingInstrumentor

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    export = args.export or bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    config = dataclasses.replace(load_config(), summary=True, hardware=load_config().hardware and export)
    if export:
        from otel_training.distro import configure_sdk

        os.environ.setdefault("OTEL_SERVICE_NAME", "otel-training-demo")
        configure_sdk()
        tracer_provider, meter_provider = trace.get_tracer_provider(), metrics.get_meter_provider()
    else:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.trace import TracerProvider

        tracer_provider, meter_provider = TracerProvider(), MeterProvider()
    model, loader = _build(device, args.sample_delay_ms / 1e3, args.samples, args.workers, args.batch_size)
    print(
        f"otel-training demo: {args.epochs} epochs of {len(loader)} steps on {device}, "
        f"dataset sleeping {args.sample_delay_ms:g} ms per sample, num_workers={args.workers}",
        file=sys.stderr,
    )
    from otel_training.runtime import active as runtime

    instrumentor = TrainingInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider, config=config)
    run = runtime.current()
    try:
        train(model, loader, device, args.epochs)
    finally:
        instrumentor.uninstrument()  # ends the run: flushes and prints the summary
        if export:
            for provider in (tracer_provider, meter_provider):
                shutdown = getattr(provider, "shutdown", None)
                if shutdown:
                    shutdown()
    if args.html and run is not None:
        return _write_html(args.html, run.summary_dict())
    return 0


def _write_html(path: str, summary: dict) -> int:
    from otel_training.report.build import diagnosed
    from otel_training.report.page import write_html
    from otel_training.report.sources import ReportError, merge_summaries

    try:
        write_html(path, [diagnosed(merge_summaries([("demo run", summary)]))])
    except ReportError as exc:
        print(f"otel-training demo: {exc}", file=sys.stderr)
        return 2
    print(f"otel-training demo: wrote {path}", file=sys.stderr)
    return 0
