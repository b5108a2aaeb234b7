"""``import pynvml`` in a training subprocess of the stack tests: the suite's fake NVML
(tests/fake_pynvml.py) with two busy H100s, so the real hardware sampler reports GPU
gauges on a machine without a GPU. On PYTHONPATH ahead of the real nvidia-ml-py.

``FAKE_NVML_BUSY_PERCENT`` sets the GPUs' utilization instead (an idle GPU: 3), and
``FAKE_NVML_UUID_PREFIX`` their UUIDs, so two runs on one host have GPUs of their own.
"""

import os
import sys
import threading
import time

from tests import fake_pynvml as _fake

_BUSY = os.environ.get("FAKE_NVML_BUSY_PERCENT")
_PREFIX = os.environ.get("FAKE_NVML_UUID_PREFIX", "GPU-00000000-0000-0000-0000-0000000000")
_gpus = [_fake.FakeGpu(i, uuid=f"{_PREFIX}{i:02d}") for i in range(2)]


def _busy(default: int) -> int:
    return int(_BUSY) if _BUSY else default


for _i, _gpu in enumerate(_gpus):
    _gpu.utilization = (_busy(60 + 20 * _i), 30)
    _gpu.memory = (80 * 2**30, 20 * 2**30, 60 * 2**30)  # total, free, used
    _gpu.throttle_mask = 0x4  # NVML: SW power cap
    _gpu.processes = [(os.getpid(), 50 * 2**30)]
_fake.configure(_gpus)


def _feed() -> None:
    """Buffer utilization samples as the driver would (about 6 per second)."""
    n = 0
    while True:
        for i, gpu in enumerate(_gpus):
            gpu.push_utilization(_busy(55 + 20 * i + n % 10))
            gpu.push_utilization(25 + n % 5, memory=True)
            gpu.push_process_utilization(os.getpid(), _busy(50 + 20 * i))
        n += 1
        time.sleep(0.15)


threading.Thread(target=_feed, name="fake-nvml-feed", daemon=True).start()
sys.modules[__name__] = _fake
