"""otel-training: OpenTelemetry for PyTorch training.

Zero code change: ``opentelemetry-instrument python train.py``. Custom loops::

    import otel_training
    otel_training.instrument()
    for batch in batches:
        with otel_training.step():
            with otel_training.phase("augment"):
                ...
"""

from otel_training.version import __version__

__all__ = ["instrument", "uninstrument", "step", "phase", "global_step", "__version__"]

_API = ("instrument", "uninstrument", "step", "phase", "global_step")


def __getattr__(name):
    # The manual API is imported when first used: ``opentelemetry-instrument`` imports
    # this package in every process (the distro), DataLoader workers included, and
    # the API pulls in the runtime, torch and the SDK.
    if name in _API:
        from otel_training import api

        value = getattr(api, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_API))
