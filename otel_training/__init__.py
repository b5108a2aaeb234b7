"""otel-training: OpenTelemetry for PyTorch training.

Zero code change: ``opentelemetry-instrument python train.py``. Custom loops::

    import otel_training
    otel_training.instrument()
    for batch in batches:
        with otel_training.step():
            with otel_training.phase("augment"):
                ...
"""

from otel_training.api import instrument, phase, step, uninstrument
from otel_training.version import __version__

__all__ = ["instrument", "uninstrument", "step", "phase", "__version__"]
