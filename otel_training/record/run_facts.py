"""What the run already does, for advice that fits it: the summary's ``run`` section.

Read where it is cheap, never on each step's path except one counter:

- each ``DataLoader``'s settings when its first iterator is made (``torch_hooks.py``);
- each optimizer's ``fused`` / ``foreach`` when it is made, and at the summary for
  optimizers made before instrumentation;
- the device of a root module's parameters when the root is discovered, and whether a
  compiled module (``torch.compile``, ``module.compile()``) ran;
- the autocast dtype at the start of a root forward: the first 16 root forwards, then
  every 64th, until one runs under autocast (``module_hooks.py``).

Written on the training thread, read by ``to_dict`` from any thread: each field is
replaced whole or appended to, never left half-written.
"""

from __future__ import annotations

from typing import Any

_MAX_LOADERS = 8  # distinct loader configurations kept
_MAX_OPTIMIZERS = 8
_DENSE_CHECKS = 16  # the first root forwards, each checked for autocast
_CHECK_EVERY = 64  # then every this many
_AUTOCAST_DEVICES = ("cuda", "cpu", "mps", "xpu")


def _sampler_shuffles(loader: Any) -> bool | None:
    sampler = getattr(loader, "sampler", None)
    name = type(sampler).__name__
    if name == "RandomSampler":
        return True
    if name == "SequentialSampler":
        return False
    shuffle = getattr(sampler, "shuffle", None)  # DistributedSampler
    return bool(shuffle) if isinstance(shuffle, bool) else None


def loader_facts(loader: Any) -> dict:
    """A DataLoader's settings that data-loading advice depends on."""
    batch_size = getattr(loader, "batch_size", None)
    if batch_size is None:  # a batch_sampler
        batch_size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    prefetch = getattr(loader, "prefetch_factor", None)
    workers = int(getattr(loader, "num_workers", 0) or 0)
    return {
        "num_workers": workers,
        "pin_memory": bool(getattr(loader, "pin_memory", False)),
        "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
        # torch's default with workers is 2 (older torch stores 2 even without workers)
        "prefetch_factor": (int(prefetch) if prefetch is not None else 2) if workers else None,
        "batch_size": int(batch_size) if isinstance(batch_size, int) else None,
        "shuffle": _sampler_shuffles(loader),
    }


def optimizer_facts(optimizer: Any) -> dict:
    """An optimizer's class and its ``fused`` / ``foreach`` settings (None: torch's default)."""
    groups = getattr(optimizer, "param_groups", None) or [getattr(optimizer, "defaults", None) or {}]
    group = groups[0] if isinstance(groups[0], dict) else {}
    return {
        "class": type(optimizer).__name__,
        "fused": group.get("fused"),
        "foreach": group.get("foreach"),
    }


class RunFacts:
    """The facts of one run; ``to_dict`` is the summary's ``run`` section."""

    def __init__(self) -> None:
        self.device: str | None = None  # the first root module's parameter device type
        self.autocast: dict | None = None  # {"device": ..., "dtype": ...} once seen
        self.compiled = False
        self.loaders: list[dict] = []
        self.optimizers: dict[int, dict] = {}
        # root forwards so far, and the count at which autocast is checked next (0: never again)
        self.forwards = 0
        self.autocast_at = 1

    # -- training thread ---------------------------------------------------------------
    def loader(self, loader: Any) -> None:
        """A DataLoader's first iterator was made."""
        facts = loader_facts(loader)
        for known in self.loaders:
            if known == facts:
                return
        if len(self.loaders) < _MAX_LOADERS:
            self.loaders = [*self.loaders, facts]

    def optimizer(self, optimizer: Any) -> None:
        if id(optimizer) not in self.optimizers and len(self.optimizers) < _MAX_OPTIMIZERS:
            self.optimizers = {**self.optimizers, id(optimizer): optimizer_facts(optimizer)}

    def root(self, module: Any, compiled_class: Any = None) -> None:
        """A root module was discovered: its parameters' device (the first root with
        parameters decides), and whether it is a ``torch.compile`` wrapper."""
        if compiled_class is not None and isinstance(module, compiled_class):
            self.compiled = True
        if self.device is None:
            param = next(iter(module.parameters()), None)
            if param is not None and getattr(param, "device", None) is not None:
                if param.device.type != "meta":
                    self.device = str(param.device.type)

    def check_autocast(self) -> None:
        """At a root forward's start: is an autocast region open? (``forwards`` has
        reached ``autocast_at``.)"""
        n = self.forwards
        self.autocast_at = n + 1 if n < _DENSE_CHECKS else n + _CHECK_EVERY
        seen = _autocast_now(self.device)
        if seen is not None:
            self.autocast = seen
            self.autocast_at = 0

    # -- any thread ----------------------------------------------------------------------
    def to_dict(self, optimizers: Any = (), compiled: bool = False) -> dict:
        """The ``run`` section; ``optimizers``: those alive now (some may have been made
        before instrumentation), ``compiled``: a compiled module is known now."""
        opts = dict(self.optimizers)
        for opt in list(optimizers):
            if id(opt) not in opts and len(opts) < _MAX_OPTIMIZERS:
                opts[id(opt)] = optimizer_facts(opt)
        auto = self.autocast
        return {
            "device": self.device,
            "cpus": _cpus(),
            "autocast_dtype": auto["dtype"] if auto else None,
            "autocast_device": auto["device"] if auto else None,
            "compiled": bool(self.compiled or compiled),
            "optimizers": list(opts.values()),
            "loaders": list(self.loaders),
        }


def _cpus() -> int | None:
    """The CPUs this process may run on (what DataLoader workers share)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count()


def _autocast_now(device: str | None) -> dict | None:
    """The autocast region open on this thread, as ``{"device", "dtype"}``, or None."""
    import torch

    for dev in dict.fromkeys((device or "cuda", *_AUTOCAST_DEVICES)):
        try:
            if not torch.is_autocast_enabled(dev):
                continue
            dtype = torch.get_autocast_dtype(dev)
        except Exception:  # a device type this torch does not know
            continue
        return {"device": dev, "dtype": str(dtype).replace("torch.", "")}
    return None
