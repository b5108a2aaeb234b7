"""Parse the ``OTEL_TRAINING_*`` environment variables into one immutable Config.

A malformed value raises :class:`ConfigError`, whose message is one line naming
each malformed variable and the values it accepts (every one, not only the first);
entry points print it and stop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from otel_training import environment_variables as ev

# What one step is (``OTEL_TRAINING_STEP_BOUNDARY``, docs/steps.md); the step
# assembler (record/step_assembly.py) applies it.
BOUNDARY_AUTO = "auto"  # one optimizer update, else one backward; a forward without backward for eval
BOUNDARY_OPTIMIZER = "optimizer"  # everything between two updates
BOUNDARY_BACKWARD = "backward"  # each backward pass
BOUNDARY_DATALOADER = "dataloader"  # each DataLoader batch
BOUNDARY_FORWARD = "forward"  # each root forward begins a step
BOUNDARIES = (BOUNDARY_AUTO, BOUNDARY_OPTIMIZER, BOUNDARY_BACKWARD, BOUNDARY_DATALOADER, BOUNDARY_FORWARD)


class ConfigError(ValueError):
    """A configuration variable holds a value we do not accept. ``problems``: one
    message per malformed variable (the error's text joins them with ``; ``)."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not valid: use true or false")


def _number(minimum: float, *, exclusive: bool = False, zero_ok: bool = False):
    def parse(name: str, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        ok = value == value and value not in (float("inf"), float("-inf"))
        ok = ok and (value > minimum if exclusive else value >= minimum)
        if zero_ok and value == 0:
            ok = True
        if not ok:
            bound = f"> {minimum:g}" if exclusive else f">= {minimum:g}"
            extra = " or 0 to turn it off" if zero_ok else ""
            raise ConfigError(f"{name}={raw!r} is not valid: use a number {bound}{extra}")
        return value

    return parse


def _whole(minimum: int, maximum: int | None = None):
    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            value = minimum - 1
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
            raise ConfigError(f"{name}={raw!r} is not valid: use a whole number {bounds}")
        return value

    return parse


def _choice(*choices: str):
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ConfigError(f"{name}={raw!r} is not valid: use one of {', '.join(choices)}")
        return value

    return parse


def _path(name: str, raw: str) -> str | None:
    value = raw.strip()
    if not value:
        return None
    if "\0" in value:
        raise ConfigError(f"{name}={raw!r} is not valid: use a file path")
    return value


def _file(name: str, raw: str) -> str | None:
    """A file to write (not a folder): ``{rank}``/``{pid}`` may be in it."""
    value = _path(name, raw)
    if value is not None and (value.endswith(("/", os.sep)) or os.path.isdir(value)):
        raise ConfigError(f"{name}={raw!r} is not valid: use a file path, not a folder (e.g. trace-{{rank}}.json)")
    return value


def _folder_or_none(name: str, raw: str) -> str:
    """A folder (created when needed), or ``none``: "" (not kept)."""
    if raw.strip().lower() in ("none", "off", "false"):
        return ""
    value = _path(name, raw)
    if value is None or os.path.isfile(value):
        raise ConfigError(f"{name}={raw!r} is not valid: use a folder path, or none")
    return value


def _folder(name: str, raw: str) -> str | None:
    """A folder (created when needed)."""
    value = _path(name, raw)
    if value is not None and os.path.isfile(value):
        raise ConfigError(f"{name}={raw!r} is not valid: use a folder path (it names a file)")
    return value


_INTEGRATIONS = ("lightning", "transformers")
# What arms a profile (OTEL_TRAINING_PROFILE, docs/profiles.md).
PROFILE_TRIGGERS = ("slow", "periodic", "straggler", "recompile", "demand")


def _subset(choices: tuple, every: str, none: str, accepted: str, canonical: bool = False):
    """A comma-separated subset of ``choices``; ``every`` (or nothing) is all of them,
    ``none`` none. ``canonical``: in the order of ``choices``, not as written."""

    def parse(name: str, raw: str) -> tuple:
        items = [p.strip().lower() for p in raw.split(",") if p.strip()]
        if items in ([every], []):
            return choices
        if items == [none]:
            return ()
        if any(i not in choices for i in items):
            raise ConfigError(f"{name}={raw!r} is not valid: use {accepted}")
        return tuple(c for c in choices if c in items) if canonical else tuple(items)

    return parse


_integrations = _subset(
    _INTEGRATIONS, "all", "none", f"a comma-separated list of {', '.join(_INTEGRATIONS)}, or all, or none"
)
_profile = _subset(
    PROFILE_TRIGGERS,
    "auto",
    "off",
    f"auto, off, or a comma-separated list of {', '.join(PROFILE_TRIGGERS)}",
    canonical=True,
)


@dataclass(frozen=True)
class Config:
    enabled: bool = True
    trace_slow_factor: float = 2.0
    trace_every_n: int = 100
    trace_max_per_second: float = 5.0
    gpu_timing: str = "auto"
    summary: bool = False
    summary_file: str | None = None
    trace_file: str | None = None
    hardware: bool = True
    hardware_interval: float = 1.0
    shutdown_timeout: float = 2.0
    integrations: tuple = _INTEGRATIONS
    step_boundary: str = BOUNDARY_AUTO
    flops_per_step: float | None = None  # None: counted once on a real step; 0: no FLOPs
    peak_flops: float | None = None  # None: the GPU table
    memory: bool = True
    attempts_dir: str | None = None  # None: the node's temporary directory; "": not kept
    profile: tuple = PROFILE_TRIGGERS  # the profile triggers on (docs/profiles.md)
    profile_steps: int = 2
    profile_max: int = 3
    profile_interval: float = 300.0
    profile_dir: str | None = None  # None: beside the summary file, else the temporary directory


# field name -> (variable, parser)
_SPEC: Mapping[str, tuple] = {
    "enabled": (ev.OTEL_TRAINING_ENABLED, _bool),
    "trace_slow_factor": (ev.OTEL_TRAINING_TRACE_SLOW_FACTOR, _number(1.0, zero_ok=True)),
    "trace_every_n": (ev.OTEL_TRAINING_TRACE_EVERY_N, _whole(0)),
    "trace_max_per_second": (ev.OTEL_TRAINING_TRACE_MAX_PER_SECOND, _number(0.0, exclusive=True)),
    "gpu_timing": (ev.OTEL_TRAINING_GPU_TIMING, _choice("auto", "events", "sync", "off")),
    "summary": (ev.OTEL_TRAINING_SUMMARY, _bool),
    "summary_file": (ev.OTEL_TRAINING_SUMMARY_FILE, _path),
    "trace_file": (ev.OTEL_TRAINING_TRACE_FILE, _file),
    "hardware": (ev.OTEL_TRAINING_HARDWARE, _bool),
    "hardware_interval": (ev.OTEL_TRAINING_HARDWARE_INTERVAL, _number(0.0, exclusive=True)),
    "shutdown_timeout": (ev.OTEL_TRAINING_SHUTDOWN_TIMEOUT, _number(0.0, exclusive=True)),
    "integrations": (ev.OTEL_TRAINING_INTEGRATIONS, _integrations),
    "step_boundary": (ev.OTEL_TRAINING_STEP_BOUNDARY, _choice(*BOUNDARIES)),
    "flops_per_step": (ev.OTEL_TRAINING_FLOPS_PER_STEP, _number(0.0, exclusive=True, zero_ok=True)),
    "peak_flops": (ev.OTEL_TRAINING_PEAK_FLOPS, _number(0.0, exclusive=True)),
    "memory": (ev.OTEL_TRAINING_MEMORY, _bool),
    "attempts_dir": (ev.OTEL_TRAINING_ATTEMPTS_DIR, _folder_or_none),
    "profile": (ev.OTEL_TRAINING_PROFILE, _profile),
    "profile_steps": (ev.OTEL_TRAINING_PROFILE_STEPS, _whole(1, 20)),
    "profile_max": (ev.OTEL_TRAINING_PROFILE_MAX, _whole(0)),
    "profile_interval": (ev.OTEL_TRAINING_PROFILE_INTERVAL, _number(0.0)),
    "profile_dir": (ev.OTEL_TRAINING_PROFILE_DIR, _folder),
}

assert set(_SPEC) == {f.name for f in fields(Config)}


def variables() -> list:
    """All variable names, in declaration order."""
    return [var for var, _ in _SPEC.values()]


def load_config(environ: Mapping[str, str] | None = None) -> Config:
    """Read the configuration; raises one ConfigError naming every malformed value."""
    env = os.environ if environ is None else environ
    values = {}
    problems: list[str] = []
    for field_name, (var, parse) in _SPEC.items():
        raw = env.get(var)
        if raw is None or raw.strip() == "":
            continue
        try:
            values[field_name] = parse(var, raw)
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError("; ".join(problems), problems)
    return Config(**values)


def default_text(var: str) -> str:
    """What an unset ``var`` means, in words (``auto``, ``true``, ``not written``)."""
    field_name = next(f for f, (v, _) in _SPEC.items() if v == var)
    if field_name in _DEFAULT_WORDS:
        return _DEFAULT_WORDS[field_name]
    value = getattr(Config(), field_name)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(value) or "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


_DEFAULT_WORDS = {
    "summary_file": "no summary file",
    "trace_file": "no trace file",
    "flops_per_step": "counted once on a real step",
    "peak_flops": "the GPU model's datasheet peak",
    "integrations": "all (lightning, transformers)",
    "attempts_dir": "the node's temporary directory",
    "profile": "auto (every trigger)",
    "profile_dir": "beside the summary file, else the node's temporary directory",
}
