"""FLOPs per training step, counted once per run on one real step (training thread).

``FlopProbe`` sits between the step assembler and the pipeline until it is done.
After ``WARMUP`` training steps it enters ``torch.utils.flop_counter.FlopCounterMode``
as one step is handed on, and leaves it as the next is: the ops in between -- one
whole step, its micro-batches and optimizer update included -- are counted (the
matmuls, convolutions and attention kernels torch has FLOP formulas for), and that
step's timeline carries the ``FlopCount`` to the pipeline. That one step runs slower
(every op goes through Python dispatch): its extra time is ``FlopCount.cost_s``.
Then the probe takes itself out of the path: no cost on later steps.

The counted ops' dtypes (and devices) give the peak (``record/peak_flops.py``) for MFU,
unless ``OTEL_TRAINING_PEAK_FLOPS`` gives it. ``OTEL_TRAINING_FLOPS_PER_STEP`` gives
the count itself (nothing is measured; the table's bf16 peak, as nanoGPT's MFU does),
``0`` turns FLOPs off. Not counted, with one log line: compiled modules (dynamo and
a dispatch mode do not mix), a step under CUDA graph capture, a step that counts no
FLOPs (only kernels torch has no formula for).

The count stays out of ``torch.inference_mode()``: it does not begin inside it, and
entering it on the counting thread ends the count first (uncounted; a later training
step is counted instead). ``inference_mode`` saves the thread's dispatch keys on entry
and restores them on exit, so a count begun outside and ended inside leaves torch's
Python dispatch key on with no mode behind it (the next op without a tensor argument
fails an internal assert); and before torch 2.5, ``Tensor.data`` of an inference
tensor raises under any dispatch mode ("Cannot set version_counter for inference
tensor", pytorch#134798), as in timm's validate (``loss.data``).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

from otel_training.record.peak_flops import peak_flops

logger = logging.getLogger("otel_training")

WARMUP = 3  # training steps handed on before the count begins
MAX_TRIES = 8  # windows that ended on an eval step or under capture, before giving up
SOURCE_MEASURED = "measured"
SOURCE_GIVEN = "OTEL_TRAINING_FLOPS_PER_STEP"
_IN_INFERENCE = "training steps run in torch.inference_mode() (set OTEL_TRAINING_FLOPS_PER_STEP to give the count)"
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


class FlopCount(NamedTuple):
    """FLOPs of one training step and what MFU divides them by."""

    per_step: float
    peak: float | None  # peak FLOP/s of the device for ``dtype``, if known
    dtype: str | None  # the dtype most FLOPs ran in: bf16, fp16, tf32, fp32, fp8
    device: str | None  # the GPU model, or "cpu"
    source: str  # SOURCE_MEASURED or SOURCE_GIVEN
    step: int | None = None  # the train step counted (its ``training.step``)
    cost_s: float | None = None  # how much longer that step took (the one-off cost)


class FlopProbe:
    """Between the assembler and ``sink`` until FLOPs are known (or cannot be):
    ``__call__(step)`` hands each step on and answers True once done, when the
    assembler hands steps to ``sink`` directly."""

    def __init__(
        self,
        sink: Callable[[Any], None],
        flops_per_step: float | None,
        peak: float | None,
        compiled: Callable[[], bool] = lambda: False,
    ) -> None:
        self._sink = sink
        self._given = flops_per_step
        self._peak = peak
        self._compiled = compiled
        self._train_steps = 0
        self._tries = 0
        self._counter: Any = None  # the FlopCounterMode while counting
        self._tallies: dict = defaultdict(float)  # (device type, dtype) -> FLOPs
        self._thread: int | None = None
        self._last_ns = 0  # duration of the last training step before the count
        self.done = False
        self._mode_class: Any = None
        self._guard: Any = None  # (inference_mode, its __enter__, ours) while counting
        self.prepare()

    def prepare(self) -> None:
        """Import ``FlopCounterMode`` ahead of the count (1.2 ms; 125 ms on torch 2.4,
        which registers its decompositions then): now if torch is loaded, and again once
        the runtime installed its torch hooks (start-up), else at the first training
        step -- never at the step boundary where the count begins, which may lie between
        steps (a loader that ended)."""
        if self._mode_class is None and self._given is None and "torch" in sys.modules:
            from torch.utils.flop_counter import FlopCounterMode

            self._mode_class = FlopCounterMode

    def __call__(self, step: Any) -> bool:
        if not self.done:  # (done outside a call: an inference_mode() that ended the count)
            try:
                self._on_step(step)
            except Exception as exc:  # our bug: never the user's problem
                logger.warning("otel-training: FLOPs not counted (%s: %s)", type(exc).__name__, exc)
                self._finish()
        self._sink(step)
        return self.done

    def _on_step(self, step: Any) -> None:
        train = step.saw_backward or step.saw_optimizer
        if self._counter is not None:
            self._stop_counting(step, train)
            return
        if not train:
            return
        if self._given is not None:
            step.carry_flops(FlopCount(self._given, self._peak or _table_peak("bf16"), None, None, SOURCE_GIVEN))
            self._finish()
            return
        self._train_steps += 1
        self._last_ns = step.marks[-1] - step.marks[0] if step.marks else 0
        if self._train_steps >= WARMUP:
            self._start_counting()
        else:
            self.prepare()

    def _start_counting(self) -> None:
        if self._compiled():
            self._give_up("compiled modules run (set OTEL_TRAINING_FLOPS_PER_STEP to give the count)")
            return
        torch = sys.modules.get("torch")
        if torch is None:
            self._finish()
            return
        if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            self._retry("the step runs under CUDA graph capture")
            return
        if torch.is_inference_mode_enabled():
            self._retry(_IN_INFERENCE)
            return
        self.prepare()
        counter = self._mode_class(display=False)
        tallies = self._tallies
        # Each formula also adds its FLOPs under the dtype and device of its first
        # tensor argument: the dtype that most FLOPs ran in picks the peak.
        counter.flop_registry = {k: _tallied(f, tallies) for k, f in counter.flop_registry.items()}
        counter.__enter__()
        self._counter = counter
        self._thread = threading.get_ident()
        self._guard_inference_mode(torch)

    def _guard_inference_mode(self, torch: Any) -> None:
        """While counting: ``torch.inference_mode()`` entered on the counting thread
        (either mode) ends the count before its guard saves the dispatch keys."""
        cls = torch.autograd.grad_mode.inference_mode
        enter = cls.__dict__["__enter__"]
        probe = self

        def __enter__(mode: Any) -> Any:
            try:
                if probe._counter is not None and threading.get_ident() == probe._thread:
                    probe._abort(_IN_INFERENCE)
            except Exception:  # pragma: no cover - never into the user's with
                pass
            return enter(mode)

        cls.__enter__ = __enter__
        self._guard = (cls, enter, __enter__)

    def _unguard(self) -> None:
        guard, self._guard = self._guard, None
        if guard is not None:
            cls, enter, ours = guard
            if cls.__dict__.get("__enter__") is ours:
                cls.__enter__ = enter

    def _abort(self, why: str) -> None:
        """End the count now, uncounted; a later training step is counted instead."""
        self.close()
        self._tallies.clear()
        self._retry(why)

    def _stop_counting(self, step: Any, train: bool) -> None:
        counter, self._counter = self._counter, None
        self._unguard()
        counter.__exit__(None, None, None)
        total = counter.get_total_flops()
        if not train or step.error is not None:
            self._tallies.clear()
            self._retry("the counted step was no training step")
            return
        if total <= 0:
            self._give_up("the step ran no op with a FLOP formula (custom kernels?)")
            return
        device, dtype = max(self._tallies.items(), key=lambda kv: kv[1])[0] if self._tallies else (None, None)
        if dtype == "fp32" and device == "cuda" and _tf32():
            dtype = "tf32"
        name = _device_name(device)
        peak = self._peak if self._peak is not None else _table_peak(dtype, name)
        duration = step.marks[-1] - step.marks[0] if step.marks else 0
        cost = max(0.0, (duration - self._last_ns) / 1e9) if self._last_ns else None
        step.carry_flops(FlopCount(float(total), peak, dtype, name, SOURCE_MEASURED, step=step.index, cost_s=cost))
        self._finish()

    def _retry(self, why: str) -> None:
        self._tries += 1
        if self._tries >= MAX_TRIES:
            self._give_up(why)

    def _give_up(self, why: str) -> None:
        logger.warning("otel-training: FLOPs per step not counted: %s", why)
        self._finish()

    def _finish(self) -> None:
        """Leave the step path: the assembler hands steps to the pipeline directly."""
        self.close()
        self.done = True

    def close(self) -> None:
        """Leave the counting mode if a count is open (only its own thread can)."""
        self._unguard()
        counter, self._counter = self._counter, None
        if counter is not None and self._thread == threading.get_ident():
            try:
                counter.__exit__(None, None, None)
            except Exception:  # pragma: no cover
                pass


def flop_probe(sink: Callable, config: Any, compiled: Callable[[], bool]) -> FlopProbe | None:
    """A probe to put between the assembler and ``sink`` (the pipeline), unless FLOPs are off."""
    if config.flops_per_step == 0:
        return None
    return FlopProbe(sink, config.flops_per_step, config.peak_flops, compiled)


def _tallied(formula: Callable, tallies: dict) -> Callable:
    def count(*args: Any, **kwargs: Any) -> int:
        flops = formula(*args, **kwargs)
        for a in args:
            dtype = getattr(a, "dtype", None)
            if dtype is not None:
                name = str(dtype).rsplit(".", 1)[-1]
                key = _DTYPES.get(name, "fp8" if name.startswith("float8") else name)
                tallies[(a.device.type, key)] += flops
                break
        return flops

    return count


def _tf32() -> bool:
    """Whether fp32 matmuls run on TF32 tensor cores (read quietly: newer torch warns
    about the older of its two settings)."""
    import warnings

    torch = sys.modules["torch"]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.get_float32_matmul_precision() != "highest" or bool(torch.backends.cuda.matmul.allow_tf32)
    except Exception:
        return False


def _device_name(device_type: str | None) -> str | None:
    if device_type == "cuda":
        try:
            return str(sys.modules["torch"].cuda.get_device_name())
        except Exception:
            return None
    return device_type


def _table_peak(dtype: str | None, name: str | None = None) -> float | None:
    if name is None:
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return None
        name = _device_name("cuda")
    return peak_flops(name, dtype)
