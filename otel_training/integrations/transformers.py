"""Hugging Face ``transformers.Trainer`` integration.

Why the Trainer drives steps itself: accelerate's ``DataLoaderShard`` fetches one
batch ahead (batch n+1 is read while batch n is handed out) and the Trainer collects
all gradient-accumulation micro-batches up front (``get_batch_samples``), so
DataLoader ``__next__`` calls do not line up with optimizer steps. Here:

- training: a step (``driver="transformers"``) starts when ``get_batch_samples``
  asks for the next micro-batches (or at ``on_step_begin`` on Trainers without it)
  and lasts until the next one, so ``on_step_end`` callbacks, logging and
  ``on_log``/``on_save`` are in it; ``on_epoch_end``/``on_train_end`` end it;
- evaluation/prediction: ``evaluation_loop`` ends the training step and hands step
  boundaries back to the DataLoader and the model's forwards for its duration: one
  eval step per batch, accelerate's fetch-ahead joining the step that uses the batch
  (docs/steps.md); the last eval step ends with the loop;
- accelerate's ``send_to_device`` and ``Trainer._prepare_inputs`` are ``to_device``;
- every overridden ``TrainerCallback`` hook is a phase ``callback.<Class>.<event>``;
- ``on_train_begin`` hands the ``TrainerState``'s global step to goodput (a resumed
  attempt's lost progress).
"""

from __future__ import annotations

from typing import Any

from otel_training import semconv as sc
from otel_training.integrations._bridge import Bridge, callback_phase

_END_EVENTS = frozenset({"on_epoch_end", "on_train_end"})


class Integration:
    def __init__(self, bridge: Bridge) -> None:
        from otel_training.handles import Handles

        self.bridge = bridge
        self.patcher = Handles()
        self.base: type | None = None  # TrainerCallback
        self.wrapped: set = set()  # (owner class, event) already wrapped
        self.has_batch_samples = False
        self._busy: set = set()  # phases running now (a super() call is not timed twice)
        self._evaluating = 0

    # ------------------------------------------------------------------ patching
    def patch(self, module: Any) -> None:
        if module.__name__ == "transformers.trainer":
            self._patch_trainer(module)
        elif module.__name__ == "accelerate.data_loader":
            self.patcher.wrap(module, "send_to_device", self._to_device)

    def _patch_trainer(self, module: Any) -> None:
        if self.base is not None:
            return
        from transformers.trainer_callback import CallbackHandler, TrainerCallback

        self.base = TrainerCallback
        trainer = module.Trainer
        self.patcher.wrap(CallbackHandler, "call_event", self._call_event)
        self.has_batch_samples = self.patcher.wrap(trainer, "get_batch_samples", self._get_batch_samples) is not None
        self.patcher.wrap(trainer, "evaluation_loop", self._evaluation_loop)
        if hasattr(trainer, "prediction_loop"):  # legacy loop (use_legacy_prediction_loop)
            self.patcher.wrap(trainer, "prediction_loop", self._evaluation_loop)
        self.patcher.wrap(trainer, "_prepare_inputs", self._to_device)

    def unpatch(self) -> None:
        self.patcher.remove()
        self.wrapped.clear()
        self.base = None

    # ------------------------------------------------------------------ steps
    def _ours(self) -> bool:
        t = self.bridge.tracker()
        return t is not None and t.driver == self.bridge.driver

    def _get_batch_samples(self, wrapped, instance, args, kwargs):
        self.bridge.start_step()
        result = wrapped(*args, **kwargs)
        t = self.bridge.tracker()
        if t is None or t.driver != self.bridge.driver or t.step is None:
            # A DataLoader.__iter__ inside (accelerate starts the epoch's iterator lazily)
            # ended the step: continue with a fresh one rather than implicit steps.
            self.bridge.start_step()
        try:  # samples and tokens of every micro-batch, not only the first one the DataLoader saw
            from otel_training.record.batches import set_micro_batches

            t = self.bridge.tracker()
            step = getattr(t, "step", None)
            if step is not None and isinstance(result, tuple) and isinstance(result[0], list):
                step.count_microbatches(len(result[0]) or None)  # the Trainer's own count
                set_micro_batches(result[0], step)
        except Exception as exc:
            self.bridge.error(exc)
        return result

    def _evaluation_loop(self, wrapped, instance, args, kwargs):
        if self._ours():
            self.bridge.discard_empty_step()  # the training step ends here
        self.bridge.release()  # eval steps: cut by the loader and the forwards
        self._evaluating += 1
        try:
            return wrapped(*args, **kwargs)
        finally:
            self._evaluating -= 1
            self.bridge.end_released_step()  # the last eval step ends with the loop

    def _to_device(self, wrapped, instance, args, kwargs):
        if self._evaluating:
            self.bridge.open_released_step()  # the batch was fetched ahead
        elif not self._ours():
            return wrapped(*args, **kwargs)
        opened = self.bridge.begin(sc.PHASE_TO_DEVICE, auto=True)
        try:
            return wrapped(*args, **kwargs)
        finally:
            if opened:
                self.bridge.end(sc.PHASE_TO_DEVICE)

    # ------------------------------------------------------------------ callbacks
    def _call_event(self, wrapped, instance, args, kwargs):
        event = args[0] if args else kwargs.get("event")
        try:
            if event in _END_EVENTS:
                self.bridge.discard_empty_step()
            elif event == "on_train_begin":  # a resume restored the state's global step
                state = args[2] if len(args) > 2 else kwargs.get("state")
                if state is not None:
                    self.bridge.follow_global_step(lambda: state.global_step)
            elif event == "on_step_begin" and not self.has_batch_samples:
                self.bridge.start_step()
            for cb in instance.callbacks:
                self._wrap_hook(type(cb), event)
        except Exception as exc:
            self.bridge.error(exc)
        return wrapped(*args, **kwargs)

    def _wrap_hook(self, cls: type, event: str) -> None:
        owner = next((k for k in cls.__mro__ if event in vars(k)), None)
        if owner is None or owner is self.base or (owner, event) in self.wrapped:
            return
        self.wrapped.add((owner, event))
        if not callable(vars(owner)[event]):
            return
        self.patcher.wrap(owner, event, self._timed_hook(event))

    def _timed_hook(self, event: str):
        def timed(wrapped, instance, args, kwargs):
            name = callback_phase(type(instance).__name__, event)
            if name in self._busy:
                return wrapped(*args, **kwargs)
            self._busy.add(name)
            try:
                return self.bridge.timed(name, wrapped, *args, **kwargs)
            finally:
                self._busy.discard(name)

        return timed
