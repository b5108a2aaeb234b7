"""Who we are: agent, rank, run.

The rank comes from torch.distributed's process group once it exists
(``runtime/rank.py`` learns it when ``init_process_group`` returns), and before that
from the variables of the launcher that started the process (``from_environment``).
A rank no source gives is None (absent from the telemetry), never a guessed 0.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from otel_training import semconv as sc

_RUN_ID = None

# Variables that say this process is one of a distributed launch (torch's own set, as a
# launcher or mp.spawn's parent exports them), even when they name no rank.
_DISTRIBUTED_HINTS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def _int(environ: Mapping[str, str], name: str) -> int | None:
    try:
        return int(environ[name])
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
    """``rank``, ``local_rank``, ``world_size``: None while no source gives them."""

    host_name: str
    rank: int | None
    local_rank: int | None
    world_size: int | None
    source: str = "none"  # process group, torchrun, open mpi, slurm, launcher, none

    @property
    def distributed(self) -> bool:
        return self.world_size != 1

    @property
    def missing(self) -> tuple[str, ...]:
        """The attributes a distributed process cannot give yet."""
        if not self.distributed:
            return ()
        values = {sc.ATTR_RANK: self.rank, sc.ATTR_LOCAL_RANK: self.local_rank, sc.ATTR_WORLD_SIZE: self.world_size}
        return tuple(name for name, value in values.items() if value is None)

    def metric_attributes(self) -> dict:
        """Attributes on every training data point; an unknown one is absent."""
        attrs: dict[str, str | int] = {sc.ATTR_HOST_NAME: self.host_name}
        if self.distributed:
            for name, value in ((sc.ATTR_RANK, self.rank), (sc.ATTR_LOCAL_RANK, self.local_rank)):
                if value is not None:
                    attrs[name] = value
            if self.world_size is not None:
                attrs[sc.ATTR_WORLD_SIZE] = self.world_size
        return attrs


def _info(host: str, rank: int | None, local: int | None, world: int, source: str) -> ProcessInfo:
    if world == 1:  # a world of one: rank 0 on its own
        return ProcessInfo(host, 0, 0, 1, source)
    return ProcessInfo(host, rank, local, world, source)


def from_environment(environ: Mapping[str, str], host: str, spawned: bool = False) -> ProcessInfo:
    """The launcher's variables, the first complete set: torchrun's (also DeepSpeed's and
    accelerate's), a partial set of torch's (Lightning's children: ``LOCAL_RANK``,
    ``WORLD_SIZE``, no ``RANK``), Open MPI's, Slurm's. A ``multiprocessing`` spawned
    child inherited its parent's variables, which name the parent: no rank from them."""
    if spawned:
        hinted = any(name in environ for name in _DISTRIBUTED_HINTS)
        return ProcessInfo(host, None, None, None, "launcher") if hinted else ProcessInfo(host, 0, 0, 1)
    world, rank, local = _int(environ, "WORLD_SIZE"), _int(environ, "RANK"), _int(environ, "LOCAL_RANK")
    if (rank is not None and world is not None) or world == 1:
        return _info(host, rank, local, world, "torchrun")
    if any(name in environ for name in _DISTRIBUTED_HINTS):
        # Checked before MPI's and Slurm's: those describe the task that started the
        # launcher, which then starts the ranks itself.
        return ProcessInfo(host, None, local, world, "launcher")
    world, rank = _int(environ, "OMPI_COMM_WORLD_SIZE"), _int(environ, "OMPI_COMM_WORLD_RANK")
    if rank is not None and world is not None:
        return _info(host, rank, _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK"), world, "open mpi")
    world, rank = _int(environ, "SLURM_NTASKS"), _int(environ, "SLURM_PROCID")
    if rank is not None and world is not None:
        return _info(host, rank, _int(environ, "SLURM_LOCALID"), world, "slurm")
    return ProcessInfo(host, 0, 0, 1)


def from_process_group(dist: Any, environ: Mapping[str, str], host: str, spawned: bool = False) -> ProcessInfo:
    """Rank and world size from the initialized process group; the local rank from the
    launcher's variables read now (Lightning's rank 0 sets them after start-up) when
    they describe the same world."""
    rank, world = int(dist.get_rank()), int(dist.get_world_size())
    env = from_environment(environ, host, spawned)
    local = env.local_rank if env.world_size in (world, None) else None
    return _info(host, rank, local, world, "process group")


def process_info(environ: Mapping[str, str] | None = None, spawned: bool = False) -> ProcessInfo:
    """This process's identity now: the process group's if it is initialized (torch
    already imported), else the launcher's variables."""
    environ = os.environ if environ is None else environ
    host = socket.gethostname()
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return from_process_group(dist, environ, host, spawned)
    except Exception:  # a torch that cannot answer: the environment's view
        pass
    return from_environment(environ, host, spawned)
