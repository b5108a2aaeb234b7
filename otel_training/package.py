"""The library this instrumentation instruments (matches the ``instruments`` extra)."""

_instruments = ("torch >= 2.13",)

_supports_metrics = True
