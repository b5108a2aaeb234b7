"""PyTorch Lightning (``lightning.pytorch`` or ``pytorch_lightning``) integration.

Lightning already names everything it runs through ``trainer.profiler`` (the
``[Callback]<state_key>.<hook>`` actions, ``[_TrainingEpochLoop].train_dataloader_next``,
``[Strategy]...batch_to_device``, ...). After ``Trainer.__init__`` we tap that
profiler instance (the user's profiler keeps working) and map its actions:

- a batch fetch (``*_next``) starts a step (``driver="lightning"``), so the wait
  for data is the step's ``dataloader_next``; the step lasts until the next fetch;
- a loop-level hook (``on_train_epoch_end``, ``on_validation_start``, ...) ends it;
- ``batch_to_device`` is the ``to_device`` phase;
- the module's ``on_train_start`` hands ``trainer.global_step`` to goodput (a resumed
  attempt's lost progress);
- every *overridden* Callback / LightningModule / LightningDataModule hook is a user
  phase ``callback.<Class>.<hook>`` (compute hooks such as ``optimizer_step`` excluded).

Lightning runs forward/backward inside ``optimizer.step(closure)``; the closure is
run outside the ``optimizer_step`` phase so they are timed as ``forward``/``backward``
(the parameter update after it is ``optimizer_step`` again).
"""

from __future__ import annotations

import importlib
import re
import weakref
from typing import Any

from otel_training import semconv as sc
from otel_training.integrations._bridge import Bridge, callback_phase

_FETCH = re.compile(r"^\[\w+\]\.\w+_next$")
_LOOP_HOOK = re.compile(r"^on_(train|validation|test|predict|fit|sanity_check)(_epoch)?_(start|end)$")
# LightningModule hooks that wrap the model's own compute or configuration: not phases.
_COMPUTE_HOOKS = frozenset(
    {
        "forward",
        "training_step",
        "validation_step",
        "test_step",
        "predict_step",
        "backward",
        "optimizer_step",
        "optimizer_zero_grad",
        "lr_scheduler_step",
        "transfer_batch_to_device",
        "configure_optimizers",
        "configure_callbacks",
        "configure_model",
        "configure_sharded_model",
        "configure_gradient_clipping",
        "setup",
        "teardown",
        "prepare_data",
        "state_dict",
        "on_save_checkpoint",
        "on_load_checkpoint",
    }
)
_NONE, _STEP, _LOOP, _PHASE, _TO_DEVICE, _TRAIN_START = range(6)


class _Tap:
    """Replaces ``start``/``stop`` on one profiler instance with timing-aware versions."""

    def __init__(self, integ: Integration, trainer: Any, profiler: Any) -> None:
        self.bridge: Bridge = integ.bridge
        self.integ = integ
        self.trainer = weakref.ref(trainer)
        self.profiler = profiler
        self.orig_start = profiler.start
        self.orig_stop = profiler.stop
        self.cache: dict[str, tuple[int, str | None]] = {}
        self.open: list = []  # (action, phase) for phases we opened
        profiler.start = self.start
        profiler.stop = self.stop

    def remove(self) -> None:
        for name in ("start", "stop"):
            if self.profiler.__dict__.get(name) == getattr(self, name):
                del self.profiler.__dict__[name]

    def start(self, action: str) -> None:
        try:
            self._on_start(action)
        except Exception as exc:
            self.bridge.error(exc)
        return self.orig_start(action)

    def stop(self, action: str) -> None:
        try:
            return self.orig_stop(action)
        finally:
            if self.open:
                try:
                    self._on_stop(action)
                except Exception as exc:
                    self.bridge.error(exc)

    def _on_start(self, action: str) -> None:
        kind, phase = self.cache.get(action) or self._classify(action)
        if kind == _NONE:
            return
        if kind == _STEP:
            self.bridge.start_step()
        elif kind == _LOOP:
            self.bridge.discard_empty_step()
        elif kind == _TRAIN_START:  # the checkpoint of a resumed fit is restored by now
            self.bridge.discard_empty_step()
            trainer = self.trainer
            self.bridge.follow_global_step(lambda: getattr(trainer(), "global_step", None))
        elif phase is not None and self.bridge.begin(phase, auto=kind == _TO_DEVICE):
            self.open.append((action, phase))

    def _on_stop(self, action: str) -> None:
        for i in range(len(self.open) - 1, -1, -1):
            if self.open[i][0] == action:
                _, phase = self.open.pop(i)
                self.bridge.end(phase)
                return

    def _classify(self, action: str) -> tuple[int, str | None]:
        result: tuple[int, str | None] | None = (_NONE, None)
        if _FETCH.match(action):
            result = (_STEP, None)
        elif action.startswith("["):
            source, _, rest = action[1:].partition("]")
            target, _, hook = rest.rpartition(".")
            if source == "Strategy":
                result = (_TO_DEVICE, sc.PHASE_TO_DEVICE) if hook == "batch_to_device" else (_NONE, None)
            elif source == "LightningModule" and hook == "on_train_start":
                result = (_TRAIN_START, None)
            elif _LOOP_HOOK.match(hook):
                result = (_LOOP, None)
            elif source in ("Callback", "LightningModule", "LightningDataModule"):
                result = self._hook_phase(source, target, hook)
        if result is not None:
            self.cache[action] = result
            return result
        return (_NONE, None)  # not resolvable yet (callback not attached): retry later

    def _hook_phase(self, source: str, target: str, hook: str) -> tuple[int, str | None] | None:
        trainer = self.trainer()
        if trainer is None:
            return (_NONE, None)
        if source == "Callback":
            obj = next((cb for cb in trainer.callbacks if cb.state_key == target), None)
            base = self.integ.base(trainer, "Callback")
        elif hook in _COMPUTE_HOOKS:
            return (_NONE, None)
        elif source == "LightningModule":
            obj, base = trainer.lightning_module, self.integ.base(trainer, "LightningModule")
        else:
            obj, base = getattr(trainer, "datamodule", None), self.integ.base(trainer, "LightningDataModule")
        if obj is None:
            return None
        mine = getattr(type(obj), hook, None)
        if mine is None or mine is getattr(base, hook, None):
            return (_NONE, None)
        return (_PHASE, callback_phase(type(obj).__name__, hook))


class Integration:
    """Patches one or both Lightning packages (``lightning.pytorch``, ``pytorch_lightning``)."""

    def __init__(self, bridge: Bridge) -> None:
        from otel_training.handles import Handles

        self.bridge = bridge
        self.patcher = Handles()
        self.taps: weakref.WeakKeyDictionary[Any, _Tap] = weakref.WeakKeyDictionary()
        self.bases: dict[str, dict[str, Any]] = {}  # package name -> base classes
        self._reopened = 0  # optimizer_step phases reopened after a closure

    def base(self, trainer: Any, name: str) -> Any:
        module = type(trainer).__module__
        for pkg, bases in self.bases.items():
            if module == pkg or module.startswith(pkg + "."):
                return bases.get(name)
        return None

    def patch(self, pkg: Any) -> None:
        if pkg.__name__ in self.bases:
            return
        self.bases[pkg.__name__] = {
            "Callback": pkg.Callback,
            "LightningModule": pkg.LightningModule,
            "LightningDataModule": pkg.LightningDataModule,
        }
        self.patcher.wrap(pkg.Trainer, "__init__", self._trainer_init)
        try:
            precision = importlib.import_module(pkg.__name__ + ".plugins.precision.precision")
            strategy = importlib.import_module(pkg.__name__ + ".strategies.strategy")
            if self.patcher.wrap(strategy.Strategy, "optimizer_step", self._strategy_step):
                self.patcher.wrap(precision.Precision, "_wrap_closure", self._closure)
        except (ImportError, AttributeError) as exc:  # other Lightning layouts: phases nest
            self.bridge.error(exc)

    def unpatch(self) -> None:
        for tap in list(self.taps.values()):
            tap.remove()
        self.taps.clear()
        self.patcher.remove()
        self.bases.clear()

    def _trainer_init(self, wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        try:
            self.attach(instance)
        except Exception as exc:
            self.bridge.error(exc)
        return result

    def attach(self, trainer: Any) -> None:
        """Tap ``trainer.profiler`` (idempotent)."""
        profiler = trainer.profiler
        tap = self.taps.get(profiler)
        if tap is not None:  # a profiler shared between trainers: follow the newest
            tap.trainer = weakref.ref(trainer)
            tap.cache.clear()
            return
        self.taps[profiler] = _Tap(self, trainer, profiler)

    def _closure(self, wrapped, instance, args, kwargs):
        # optimizer.step(closure): torch's pre-hook opened optimizer_step before the
        # closure ran forward/backward. End it before the closure and reopen it after
        # (the reopened phase ends when Strategy.optimizer_step returns).
        bridge = self.bridge
        if not bridge.is_open(sc.PHASE_OPTIMIZER_STEP):
            return wrapped(*args, **kwargs)
        bridge.end(sc.PHASE_OPTIMIZER_STEP)
        try:
            return wrapped(*args, **kwargs)
        finally:
            if bridge.begin(sc.PHASE_OPTIMIZER_STEP, auto=True):
                self._reopened += 1

    def _strategy_step(self, wrapped, instance, args, kwargs):
        try:
            return wrapped(*args, **kwargs)
        finally:
            if self._reopened:
                self._reopened -= 1
                self.bridge.end(sc.PHASE_OPTIMIZER_STEP)
