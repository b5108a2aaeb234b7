"""The rank, learned once torch.distributed's process group exists.

At start-up the identity is what the launcher's variables say (``export/identity.py``).
Some launchers set only part of them (Lightning's children have ``LOCAL_RANK`` and
``WORLD_SIZE`` but no ``RANK``; its rank 0 sets its own after start-up; ``mp.spawn``'s
children have none), so the process group's answer replaces it: when
``init_process_group`` returns (a removable wrap), at install when the group already
exists, and when a loop starts before the first step (a group made through a path not
wrapped). Never per step.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from typing import Any

from otel_training.export.identity import ProcessInfo, from_process_group

_said = False


def say_missing(info: ProcessInfo, environ: Any = None) -> None:
    """The one line (once per process) naming what the telemetry leaves out for now."""
    global _said
    missing = info.missing
    if _said or not missing:
        return
    _said = True
    environ = os.environ if environ is None else environ
    present = [n for n in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR") if n in environ]
    seen = f"{', '.join(present)} set" if present else "no launcher variables"
    if "RANK" not in environ:
        seen += ", no RANK"
    until = "" if info.source == "process group" else " until torch.distributed's process group is initialized"
    line = f"otel-training: {', '.join(missing)} not known ({seen}): absent from the telemetry"
    try:
        print(line + until, file=sys.stderr, flush=True)
    except Exception:  # a closed stderr: nothing left to tell
        pass


class RankWatch:
    """Calls ``on_known(info)`` once, with the process group's identity, as soon as the
    group exists."""

    def __init__(
        self,
        on_known: Callable[[ProcessInfo], None],
        on_error: Callable[[str, BaseException], None],
        spawned: bool = False,
    ) -> None:
        self._on_known = on_known
        self._on_error = on_error
        self._spawned = spawned
        self.settled = False

    def install(self, handles: Any) -> RankWatch:
        """Wrap ``init_process_group`` (under each name torch calls it by:
        ``init_device_mesh`` calls its own import; removed with ``handles``) and look once now."""
        try:
            import torch.distributed as dist

            if dist.is_available():
                mesh = sys.modules.get("torch.distributed.device_mesh")
                for owner in (dist, dist.distributed_c10d, mesh):
                    if owner is not None and hasattr(owner, "init_process_group"):
                        handles.wrap(owner, "init_process_group", self._after_init)
        except Exception as exc:
            self._on_error("identity", exc)
        self.check()
        return self

    def _after_init(self, wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        self.check()
        return result

    def check(self) -> None:
        """Learn the identity if the group exists now (until it once did)."""
        if self.settled:
            return
        try:
            dist = sys.modules.get("torch.distributed")
            if dist is None or not dist.is_available() or not dist.is_initialized():
                return
            self.settled = True
            self._on_known(from_process_group(dist, os.environ, socket.gethostname(), self._spawned))
        except Exception as exc:  # the start-up identity stays
            self._on_error("identity", exc)
