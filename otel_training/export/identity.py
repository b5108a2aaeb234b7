"""Who we are: agent, rank, run. Read once from the environment torchrun sets."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

from otel_training import semconv as sc

_RUN_ID = None


def _int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def run_id() -> str:
    """``TORCHELASTIC_RUN_ID`` (shared by all ranks of a torchrun job) or one per process."""
    global _RUN_ID
    if _RUN_ID is None:
        _RUN_ID = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("OTEL_TRAINING_RUN_ID") or uuid.uuid4().hex
    return _RUN_ID


@dataclass(frozen=True)
class ProcessInfo:
    host_name: str
    rank: int
    local_rank: int
    world_size: int

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def metric_attributes(self) -> dict:
        """Attributes on every training data point."""
        attrs: dict[str, str | int] = {sc.ATTR_HOST_NAME: self.host_name}
        if self.distributed:
            attrs[sc.ATTR_RANK] = self.rank
            attrs[sc.ATTR_LOCAL_RANK] = self.local_rank
            attrs[sc.ATTR_WORLD_SIZE] = self.world_size
        return attrs


def process_info() -> ProcessInfo:
    world = _int("WORLD_SIZE") or 1
    rank = _int("RANK") or 0
    local = _int("LOCAL_RANK")
    return ProcessInfo(socket.gethostname(), rank, rank if local is None else local, world)
