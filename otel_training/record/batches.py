"""What a batch holds: its size (samples), inferred from its tensors' shapes."""

from __future__ import annotations

from typing import Any


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
            return None
        for item in items:
            shape = getattr(item, "shape", None)
            if shape is not None and len(shape):
                return int(shape[0])
    except Exception:
        return None
    return None
