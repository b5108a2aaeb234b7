"""Throughput, FLOPs and memory per step: one part in each stage, wired together.

- training thread: the FLOP probe between the step assembler and the pipeline
  (``record/flops.py``), memory read at step ends (``record/memory.py``); a batch's
  samples and tokens are read by the tracker itself (``record/batches.py``);
- pipeline thread: the memory trend and its creep fit (``aggregate/memory.py``), the
  tokens, FLOPs and MFU instruments (``export/throughput.py``), the run summary's
  tokens and FLOPs (``aggregate/summary.py``);
- collection: the memory instruments (``export/memory.py``).

``Runtime`` makes one ``StepMeasures`` and calls it at construction, for the summary's
sections and at shutdown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from otel_training.aggregate.memory import MemoryTrend
from otel_training.aggregate.run_model import Memory, RunFacts
from otel_training.record.flops import flop_probe
from otel_training.record.memory import MemoryReader


class StepMeasures:
    """Throughput, FLOPs and memory of one runtime's steps; ``consumers`` go to the pipeline."""

    def __init__(self, config: Any, meter: Any, common: dict, on_error: Callable[[str, BaseException], None]):
        self.config = config
        self.trend = MemoryTrend()
        self.consumers: list = [self.trend]
        self.probe: Any = None
        self.reader = MemoryReader() if config.memory else None  # the tracker's, read at step ends
        self._facts: Callable[[], dict] | None = None
        self._compiled: Callable[[], bool] = lambda: False
        try:
            from otel_training.export.throughput import perf_metrics

            self.consumers += perf_metrics(meter, common, self.trend, config.memory)
        except Exception as exc:  # the instruments are optional: the trend and summary stay
            on_error("metrics", exc)

    def rebind(self, common: dict) -> None:
        """Report under ``common`` (the rank, once known) from now on."""
        for consumer in self.consumers:
            rebind = getattr(consumer, "rebind", None)
            if rebind is not None:
                rebind(common)

    def make_probe(self, submit: Callable, module_hooks: Callable[[], Any]) -> Any:
        """The FLOP probe to put before ``submit`` (None: FLOPs off). ``module_hooks()``:
        the RootModuleHooks, once installed (they know whether a compiled module ran)."""

        def compiled() -> bool:
            hooks = module_hooks()
            return hooks is not None and hooks.has_compiled()

        self._compiled = compiled
        self.probe = flop_probe(submit, self.config, compiled)
        return self.probe

    def attach(self, assembler: Any, tracker: Any) -> None:
        """The run facts come from ``tracker`` and ``assembler``'s optimizers."""
        compiled = self._compiled
        self._facts = lambda: tracker.facts.to_dict(assembler.optimizers, compiled())

    def prepare(self) -> None:
        """torch is loaded (start-up): what the FLOP count needs is imported now, not
        inside a step's phase."""
        if self.probe is not None:
            self.probe.prepare()

    def memory(self) -> Memory | None:
        """The summary's ``memory`` section (None without readings)."""
        return self.trend.section()

    def facts(self) -> RunFacts | None:
        """The summary's ``run`` section: what the run already does (record/run_facts.py)."""
        return None if self._facts is None else RunFacts.from_dict(self._facts(), "run")

    def close(self) -> None:
        """The run ended: a FLOP count still open is left, the memory file closed."""
        if self.probe is not None:
            self.probe.close()
        if self.reader is not None:
            self.reader.close()
