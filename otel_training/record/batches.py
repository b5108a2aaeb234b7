"""What a batch holds: its size (samples) and its tokens, from its tensors' shapes.

Samples: the first dimension of the batch's first tensor (one level deep). A batch
that is no tensor, sequence or mapping: a dataclass is read like a dict of its fields
(torchrec's ``Batch``); another object by an integer ``batch_size`` or ``num_graphs``
(PyTorch Geometric's ``Batch``: its graphs).
Tokens: the elements of a token-id tensor -- an integer tensor of rank 2 (batch,
sequence): a dict batch's ``input_ids`` (else its first tensor), a list or tuple
batch's first tensor (``x`` of nanoGPT's ``x, y``; never the labels after it).
With an ``attention_mask`` beside ``input_ids`` the padding is left out: tokens are
the mask's sum. That sum is not taken here: a CPU mask is kept and summed on the
pipeline thread; on an accelerator the sum is launched here (asynchronous, no sync)
and its value read on the pipeline thread.

Training thread: shape and dtype reads only, a few hundred nanoseconds a batch.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

from otel_training.record.timeline import StepTimeline

_INT_NAMES = ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64")
_ints: frozenset = frozenset()  # torch's integer dtypes, once torch is imported


def _int_dtypes() -> frozenset:
    global _ints
    torch = sys.modules.get("torch")
    if torch is not None and not _ints:
        _ints = frozenset(getattr(torch, n) for n in _INT_NAMES if hasattr(torch, n))
    return _ints


def is_token_ids(t: Any) -> bool:
    """An integer tensor of rank 2 (batch, sequence)."""
    shape = getattr(t, "shape", None)
    return shape is not None and len(shape) == 2 and getattr(t, "dtype", None) in (_ints or _int_dtypes())


def infer_batch_size(batch: Any) -> int | None:
    """First dimension of the first tensor in the batch (one level deep)."""
    items: Any
    try:
        if isinstance(batch, (list, tuple)):  # the usual (inputs, targets): tested first
            items = batch
        elif isinstance(batch, dict):
            items = batch.values()
        else:
            shape = getattr(batch, "shape", None)
            if shape is not None:
                return int(shape[0]) if len(shape) else None
            fields = _dataclass_fields(batch)
            if fields is None:
                return _object_size(batch)
            items = fields.values()
        for item in items:
            shape = getattr(item, "shape", None)
            if shape is not None and len(shape):
                return int(shape[0])
    except Exception:
        return None
    return None


def read_batch(batch: Any, step: Any) -> None:
    """Set ``step.batch_size`` and its tokens from a DataLoader batch (the first
    batch of a piece: the caller checks ``step.batch_size is None``)."""
    try:
        if isinstance(batch, (list, tuple)):
            for item in batch:
                shape = getattr(item, "shape", None)
                if shape is not None and len(shape):
                    step.count_samples(int(shape[0]))
                    if len(shape) == 2 and item.dtype in (_ints or _int_dtypes()):
                        step.count_tokens(int(shape[0]) * int(shape[1]))
                    return
        elif isinstance(batch, Mapping):
            _read_mapping(batch, step)
        else:
            shape = getattr(batch, "shape", None)
            if shape is not None:
                if len(shape):
                    step.count_samples(int(shape[0]))
                    if is_token_ids(batch):
                        step.count_tokens(int(shape[0]) * int(shape[1]))
                return
            fields = _dataclass_fields(batch)
            if fields is not None:
                _read_mapping(fields, step)
            else:
                step.count_samples(_object_size(batch))
    except Exception:
        return


def _dataclass_fields(batch: Any) -> dict | None:
    """A dataclass batch's fields by name, in order (None: not a dataclass instance)."""
    if not dataclasses.is_dataclass(batch) or isinstance(batch, type):
        return None
    return {f.name: getattr(batch, f.name, None) for f in dataclasses.fields(batch)}


def _object_size(batch: Any) -> int | None:
    """Samples of a batch object that says how many it holds: an integer ``batch_size``
    or ``num_graphs`` attribute (PyTorch Geometric's ``Batch`` has both)."""
    for name in ("batch_size", "num_graphs"):
        size = getattr(batch, name, None)
        if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
            return size
    return None


def set_micro_batches(batches: list, step: Any) -> None:
    """A framework's micro-batches of one step (the HF Trainer's ``get_batch_samples``):
    their samples -- when every one is known -- and tokens replace what the
    DataLoader's fetches set."""
    counts = []
    for batch in batches:
        c = StepTimeline(-1, None)  # (only its counts are read: one per micro-batch, per step)
        read_batch(batch, c)
        counts.append(c)
    batch_size = step.batch_size
    if counts and all(c.batch_size is not None for c in counts):
        batch_size = sum(c.batch_size for c in counts)
    masks = [m for c in counts for m in c.token_masks or ()]
    tokens = [c.token_count for c in counts if c.token_count is not None]
    step.take_batch(batch_size, sum(tokens) if tokens else None, masks or None)


def read_inputs(args: tuple, kwargs: dict | None, step: Any) -> None:
    """Add a root forward's inputs to ``step`` (no DataLoader drives the loop):
    ``model(x, y)``, ``model(input_ids, attention_mask=m)``, ``model(**batch)``."""
    try:
        first = None
        for item in args:
            shape = getattr(item, "shape", None)
            if shape is not None and len(shape):
                first = item
                break
        if first is None:
            if kwargs:
                _read_mapping(kwargs, step, add=True)
            return
        shape = first.shape
        step.count_samples(int(shape[0]), add=True)
        if is_token_ids(first):
            mask = kwargs.get("attention_mask") if kwargs else None
            _add_tokens(step, first, mask)
    except Exception:
        return


def _read_mapping(batch: Mapping, step: Any, add: bool = False) -> None:
    ids = batch.get("input_ids")
    if ids is None:
        for ids in batch.values():
            shape = getattr(ids, "shape", None)
            if shape is not None and len(shape):
                break
        else:
            return
    shape = getattr(ids, "shape", None)
    if shape is None or not len(shape):
        return
    step.count_samples(int(shape[0]), add=add)
    if is_token_ids(ids):
        _add_tokens(step, ids, batch.get("attention_mask"))


def _add_tokens(step: Any, ids: Any, mask: Any) -> None:
    """Tokens of ``ids``: all its elements, or the mask's sum (deferred)."""
    if mask is not None and getattr(mask, "shape", None) == ids.shape:
        pending = mask if mask.device.type == "cpu" else mask.sum()  # launched, never waited for
        step.add_token_mask(pending)
        return
    shape = ids.shape
    step.count_tokens(int(shape[0]) * int(shape[1]), add=True)


def mask_tokens(masks: list) -> int | None:
    """The deferred masks' tokens (pipeline thread): a CPU mask is summed, an
    accelerator's sum (0-dim) is read -- a wait of this thread alone, for a kernel
    launched when its batch arrived. None if a mask cannot be read."""
    total = 0
    try:
        for m in masks:
            if m.dim() == 0:
                total += int(m)
                continue
            try:  # numpy: a single-threaded sum, no second OpenMP team beside training's
                total += int(m.numpy().sum())
            except Exception:
                total += int(m.sum())
    except Exception:
        return None
    return total
