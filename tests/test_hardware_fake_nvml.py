"""The fake NVML stays faithful to the installed nvidia-ml-py (names, values, types, errors)."""

import importlib
import inspect
import sys

import pytest

from tests import fake_pynvml as fake


@pytest.fixture
def real(monkeypatch):
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    module = importlib.import_module("pynvml")  # importing needs no driver
    if getattr(module, "__file__", None) == fake.__file__:
        pytest.skip("the real pynvml is not importable")
    return module


def _constants(module):
    return {k: v for k, v in vars(module).items()
            if (k.startswith("NVML_") or k.startswith("nvmlClocks")) and isinstance(v, int)}


def test_constants_have_the_real_values(real):
    mine = _constants(fake)
    assert mine
    theirs = _constants(real)
    assert {k: theirs.get(k) for k in mine} == mine


def test_error_classes_match(real):
    for name, cls in vars(fake).items():
        if name.startswith("NVMLError_"):
            assert issubclass(getattr(real, name), real.NVMLError), name
    err = fake.NVMLError(fake.NVML_ERROR_NOT_SUPPORTED)
    assert type(err) is fake.NVMLError_NotSupported and err.value == 3
    assert isinstance(err, fake.NVMLError)
    assert fake.NVMLError_LibraryNotFound().value == real.NVMLError_LibraryNotFound().value
    assert str(fake.NVMLError(fake.NVML_ERROR_DRIVER_NOT_LOADED)) == "Driver Not Loaded"


def test_structures_have_the_real_fields(real):
    for name in ("c_nvmlMemory_t", "c_nvmlUtilization_t", "c_nvmlValue_t", "c_nvmlSample_t",
                 "c_nvmlProcessUtilizationSample_t"):
        mine = [f[0] for f in getattr(fake, name)._fields_]
        assert mine == [f[0] for f in getattr(real, name)._fields_], name


def test_functions_have_the_real_signatures(real):
    for name, fn in vars(fake).items():
        if name.startswith("nvml") and inspect.isfunction(fn):
            assert hasattr(real, name), name
            params = list(inspect.signature(fn).parameters)
            assert params == list(inspect.signature(getattr(real, name)).parameters), name


def test_calls_before_init_raise_uninitialized():
    fake.configure([fake.FakeGpu(0)])
    with pytest.raises(fake.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    assert fake.nvmlDeviceGetCount() == 1
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(fake.NVMLError_NotFound):
        fake.nvmlDeviceGetSamples(handle, fake.NVML_GPU_UTILIZATION_SAMPLES, 0)
    fake.nvmlShutdown()
    fake.configure()
