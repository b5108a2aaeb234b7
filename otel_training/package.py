"""The library this instrumentation instruments (matches the ``instruments`` extra).

``TORCH_FLOOR`` is the lowest torch release the core tests pass on
(``scripts/test-torch-range.sh`` runs them there and on the newest release).
"""

TORCH_FLOOR = "2.4"

_instruments = (f"torch >= {TORCH_FLOOR}",)

_supports_metrics = True
