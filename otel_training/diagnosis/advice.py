"""Advice that fits the run: what the findings propose, given what the run already does.

The run-end summary's ``run`` section (record/run_facts.py) says what is in place: the
device, the autocast dtype seen, a compiled model, each optimizer's ``fused`` /
``foreach``, each DataLoader's ``num_workers``, ``pin_memory``, ``persistent_workers``,
``prefetch_factor`` and batch size. Advice never proposes what is already there, and
names the device it applies to. Without the section (an older summary file, a report
from Prometheus) the advice is the general one.
"""

from __future__ import annotations

from collections.abc import Iterable

from otel_training.aggregate.run_model import LoaderFacts, RunFacts

DATALOADER_ADVICE = [
    "raise DataLoader num_workers (measure with `otel-training bench-data "
    "MODULE:FACTORY` where adding workers stops helping)",
    "set persistent_workers=True so workers survive between epochs, and raise "
    "prefetch_factor (default 2) so batches queue up ahead of the step",
    "pin_memory=True, so that copies can overlap with compute",
    "make __getitem__ cheaper: pre-decode / resize the data once and cache it, "
    "use a faster decoder, or move augmentation to the GPU",
]
GRAIN_ADVICE = [
    "Grain: raise ReadOptions(num_threads=...) for the reads, and the prefetch buffer "
    "(ThreadPrefetchIterDataset's prefetch_buffer_size, torchtitan's num_prefetch_batches) "
    "so batches queue up ahead of the step",
    "Grain: move CPU-heavy map steps to worker processes (IterDataset.mp_prefetch with "
    "MultiprocessingOptions(num_workers=...)): threads share the GIL with the training loop",
    "make the per-record work cheaper: tokenize or decode once and cache it, or pack offline",
]
_BENCH = "measure with `otel-training bench-data MODULE:FACTORY --summary FILE` where adding workers stops helping"
_GPU_DEVICES = ("cuda", "xpu", "mps")


def _device(facts: RunFacts | None) -> str | None:
    return (facts.device if facts is not None else None) or None


def _on_gpu(device: str | None) -> bool:
    return device in _GPU_DEVICES


def train_loaders(facts: RunFacts) -> list[LoaderFacts]:
    """The loaders that feed training: the shuffling ones when any shuffle, else all."""
    loaders = list(facts.loaders)
    shuffled = [ld for ld in loaders if ld.shuffle]
    return shuffled or loaders


def loader_advice(loaders: Iterable[str], facts: RunFacts | None) -> list[str]:
    """The data-loading fixes for the loaders that drove the run (summary ``loaders``),
    leaving out the settings already in place."""
    loaders = tuple(loaders)
    if "grain" in loaders and "torch" not in loaders:
        return list(GRAIN_ADVICE)
    torch_advice = _dataloader_advice(facts)
    if "grain" in loaders:
        return [*torch_advice[:2], *GRAIN_ADVICE[:2]]
    return torch_advice


def _dataloader_advice(facts: RunFacts | None) -> list[str]:
    seen = train_loaders(facts) if facts else []
    if not seen:
        return list(DATALOADER_ADVICE)
    device = _device(facts)
    workers = min(int(ld.num_workers or 0) for ld in seen)
    out = []
    if workers == 0:
        out.append(
            "num_workers=0 loads each batch on the training thread, so loading never overlaps "
            f"compute: set DataLoader num_workers to 2 or more ({_BENCH})"
        )
        out.append(
            "with workers, set persistent_workers=True so they survive between epochs, and "
            "prefetch_factor (default 2) so batches queue up ahead of the step"
        )
    elif facts is not None and facts.cpus and workers >= int(facts.cpus):
        out.append(
            f"num_workers={workers} already has a worker for each of the {facts.cpus} CPUs: more workers "
            "only help while they wait on I/O; make each sample cheaper (below)"
        )
    else:
        out.append(f"raise DataLoader num_workers above {workers}, what the run used ({_BENCH})")
        extra = []
        if not all(ld.persistent_workers for ld in seen):
            extra.append("set persistent_workers=True so workers survive between epochs")
        prefetch = min(int(ld.prefetch_factor or 2) for ld in seen)
        extra.append(f"raise prefetch_factor above {prefetch} so more batches queue up ahead of the step")
        out.append(", and ".join(extra))
    if _on_gpu(device) and not all(ld.pin_memory for ld in seen):
        out.append(f"pin_memory=True, so that copies to the {device} device can overlap with compute")
    gpu_aug = f"move augmentation to the {device} device" if _on_gpu(device) else "augment whole batches as tensors"
    out.append(
        f"make __getitem__ cheaper: pre-decode / resize the data once and cache it, use a faster decoder, or {gpu_aug}"
    )
    return out


def host_to_device_advice(facts: RunFacts | None) -> list[str]:
    device = _device(facts)
    loaders = train_loaders(facts) if facts else []
    pinned = bool(loaders) and all(ld.pin_memory for ld in loaders)
    if not facts or not device:
        first = "pin_memory=True in the DataLoader and .to(device, non_blocking=True)"
    elif pinned:
        first = f".to('{device}', non_blocking=True), so copies of the (already pinned) batch overlap with compute"
    elif _on_gpu(device):
        first = f"pin_memory=True in the DataLoader and .to('{device}', non_blocking=True)"
    else:
        first = f"the model is on the {device}: look for copies or dtype conversions of the batch before the forward"
    return [
        first,
        "send compact dtypes (uint8 images, int32 token ids) and convert on the device",
        "keep preprocessing out of the window between receiving the batch and "
        "the forward (do it in the Dataset / collate_fn)",
    ]


def _all_fused(facts: RunFacts) -> bool:
    opts = facts.optimizers
    return bool(opts) and all(o.fused for o in opts)


def _batch_size(facts: RunFacts) -> int | None:
    sizes = [ld.batch_size for ld in train_loaders(facts) if ld.batch_size]
    return sizes[0] if sizes else None


def compute_advice(facts: RunFacts | None, optimizer_heavy: bool) -> list[str]:
    """The compute-bound advice: cheaper math, less overhead."""
    if facts is None or not _device(facts):
        advice = [
            "use mixed precision: torch.autocast(device_type, dtype=torch.bfloat16)",
            "raise the batch size while GPU memory allows (scale the learning rate)",
            "try torch.compile(model), fused optimizers (fused=True) and channels_last for CNNs",
        ]
        if optimizer_heavy:
            advice.insert(0, "the optimizer step is large: use foreach=True / fused=True optimizers")
        return advice
    device = str(_device(facts))
    advice = []
    fused = _all_fused(facts)
    if optimizer_heavy and not fused:
        advice.append(f"the optimizer step is large: use fused=True optimizers (on {device})")
    if not facts.autocast_dtype:
        if device == "cpu":
            advice.append(
                "use mixed precision on the cpu: torch.autocast('cpu', dtype=torch.bfloat16) "
                "(fast on CPUs with AVX-512 BF16 or AMX)"
            )
        else:
            advice.append(f"use mixed precision on {device}: torch.autocast('{device}', dtype=torch.bfloat16)")
    if _on_gpu(device):
        bs = _batch_size(facts)
        now = f" (the run used {bs})" if bs else ""
        advice.append(f"raise the batch size while {device} memory allows{now} (scale the learning rate)")
    elif device == "cpu":
        advice.append(
            "on the cpu: check that torch.get_num_threads() matches the physical cores "
            "(OMP_NUM_THREADS); a GPU is the large step"
        )
    parts = []
    if not facts.compiled:
        parts.append("torch.compile(model)")
    if not fused:
        parts.append("fused optimizers (fused=True)")
    parts.append("channels_last for CNNs")
    advice.append(f"try {', '.join(parts[:-1]) + ' and ' if len(parts) > 1 else ''}{parts[-1]} (on {device})")
    return advice
