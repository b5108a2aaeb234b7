"""otel-training bench-data: per-stage timing, the worker sweep, the feed check and
OTLP export, on small datasets whose costs are known (sleeps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from otel_training.cli.bench_data import main
from otel_training.cli.bench_data.export import export
from tests.otlp_receiver import OTLPReceiver, attributes, data_points

ROOT = Path(__file__).resolve().parents[1]

DATA = textwrap.dedent('''
    import time, torch

    class Images(torch.utils.data.Dataset):
        """load(i) reads 1 ms, transform(raw) decodes 4 ms (both sleep, so workers scale)."""
        def __init__(self, n=96):
            self.n = n
        def __len__(self):
            return self.n
        def load(self, i):
            time.sleep(0.001)
            return bytes([i % 256]) * 48
        def transform(self, raw):
            time.sleep(0.004)
            return torch.tensor(list(raw[:12]), dtype=torch.float32), raw[0] % 2
        def __getitem__(self, i):
            return self.transform(self.load(i))

    class Raw(torch.utils.data.Dataset):
        def __len__(self):
            return 64
        def __getitem__(self, i):
            time.sleep(0.001)
            return torch.full((4,), float(i))

    def slow_collate(batch):
        time.sleep(0.002)
        return torch.utils.data.default_collate(batch)

    def decode(x):
        time.sleep(0.003)
        return x * 2

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            for i in range(40):
                yield torch.zeros(3)

    def images():
        return Images()

    def loader_kwargs():
        return {"dataset": Raw(), "batch_size": 4, "collate_fn": slow_collate, "num_workers": 7}

    def with_transform():
        return Raw(), decode

    def stream():
        return Stream()

    def broken():
        raise RuntimeError("no data here")

    def not_a_dataset():
        return 42
''')


@pytest.fixture
def data_module(tmp_path, monkeypatch):
    (tmp_path / "benchdata_mod.py").write_text(DATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("OTEL_METRICS_EXPORTER", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    yield tmp_path
    sys.modules.pop("benchdata_mod", None)


def bench(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_split_timing_sweep_and_feed(data_module, capsys):
    code, out, err = bench(capsys, "benchdata_mod:images", "--workers", "0,2", "--seconds", "0.6",
                           "--samples", "12", "--batch-size", "8", "--step-rate", "1000", "--json")
    assert code == 0, err
    r = json.loads(out)
    s = r["samples"]
    assert s["split"] == "load/transform" and s["count"] == 12
    assert 0.9 <= s["load_ms"] < 4 and 3.6 <= s["transform_ms"] < 12  # sleeps 1 ms and 4 ms
    assert s["sample_ms"] == pytest.approx(s["load_ms"] + s["transform_ms"])
    runs = {(x["num_workers"], x["pin_memory"]): x for x in r["runs"]}
    assert set(runs) == {(0, False), (2, False)}
    serial = runs[(0, False)]["samples_per_s"]
    assert 0.5 * 1e3 / s["sample_ms"] < serial < 1.5 * 1e3 / s["sample_ms"]  # one process: ~1/sample cost
    assert runs[(2, False)]["samples_per_s"] > 1.4 * serial  # sleeping workers overlap
    assert r["best"]["num_workers"] == 2 and r["knee"]["false"]["workers"] == 2
    feed = r["feed"]
    assert feed["needed_samples_per_s"] == 8000 and feed["can_feed"] is False
    assert feed["fewest_workers"] is None
    assert any("transform is" in a for a in r["advice"])
    # progress on stderr, one line per configuration
    assert "[1/2] num_workers=0 pin_memory=False" in err and "[2/2] num_workers=2" in err


def test_text_output_and_can_feed(data_module, capsys):
    """A loader fast enough at num_workers=0 still does not keep up there: it loads on the
    training thread, so loading never overlaps compute. The fewest that keeps up has a worker."""
    code, out, err = bench(capsys, "benchdata_mod:images", "--workers", "0,1", "--seconds", "0.3",
                           "--samples", "4", "--step-rate", "0.5", "--quiet")
    assert code == 0 and err == ""
    assert "per sample (4 timed, one process): load" in out and "transform" in out
    assert "the loader CAN feed it" in out and "training needs 16.0 samples/s (0.50 steps/s x 32" in out
    assert "num_workers=1 is the fewest that keeps up" in out
    assert "num_workers=0 is the fewest" not in out
    assert "num_workers=0 loads each batch on the training thread: every step would wait about" in out
    assert "best:" in out


def test_workers_zero_alone_never_keeps_up(data_module, capsys):
    code, out, err = bench(capsys, "benchdata_mod:images", "--workers", "0", "--seconds", "0.3",
                           "--samples", "4", "--step-rate", "0.5", "--json", "--quiet")
    assert code == 0, err
    r = json.loads(out)
    assert r["runs"][0]["samples_per_s"] > 16  # fast enough in throughput ...
    assert r["feed"]["can_feed"] is False and r["feed"]["fewest_workers"] is None  # ... but never overlapping
    assert any("only num_workers=0 was tried" in a for a in r["advice"])


def _waiting_summary(path, workers):
    """A run that waited 19.5% of each train step for data, with ``workers`` in its
    ``run`` section (None: an older summary without one)."""
    summary = {"schema": "otel-training/summary/v1", "modes": {"train": {
        "steps": 100, "samples": 800, "step_time_s": 100.0, "phases": [
            {"name": "dataloader_next", "parent": "step", "total_s": 19.5},
            {"name": "train_batch", "parent": "step", "total_s": 80.5}]}}}
    if workers is not None:
        summary["run"] = {"device": "cpu", "loaders": [{"num_workers": workers, "pin_memory": False,
                                                        "persistent_workers": False, "prefetch_factor": None,
                                                        "batch_size": 8, "shuffle": True}]}
    path.write_text(json.dumps(summary))
    return str(path)


def test_summary_recommendation_agrees_with_the_runs_measured_wait(data_module, capsys, tmp_path):
    """The run waited 19.5% of each step with num_workers=0 (~1.2 steps/s compute-only x 8
    = ~10 samples/s, which every configuration delivers in isolation): bench-data never
    calls num_workers=0 enough, and says what the run measured."""
    path = _waiting_summary(tmp_path / "s0.json", 0)
    code, out, err = bench(capsys, "benchdata_mod:images", "--workers", "0,1", "--seconds", "0.3",
                           "--samples", "4", "--summary", path, "--quiet")
    assert code == 0, err
    assert "num_workers=0 is the fewest" not in out
    assert "num_workers=1 is the fewest that keeps up" in out
    assert "the run waited 19.5% of each train step (195.0 ms) for data with num_workers=0" in out
    # The run waited with 1 worker: the sweep's num_workers=1 is not called enough either.
    path = _waiting_summary(tmp_path / "s1.json", 1)
    code, out, err = bench(capsys, "benchdata_mod:images", "--workers", "0,1", "--seconds", "0.3",
                           "--samples", "4", "--summary", path, "--json", "--quiet")
    r = json.loads(out)
    assert code == 0 and r["feed"]["fewest_workers"] is None and r["feed"]["can_feed"] is False
    assert r["batch_size"] == 8
    assert any("the run waited for data with num_workers=1" in a and "--workers 1,3,6" in a for a in r["advice"])
    # An older summary (no run section): the wait is still reported; num_workers=0 still never enough.
    path = _waiting_summary(tmp_path / "old.json", None)
    code, out, err = bench(capsys, "benchdata_mod:images", "--workers", "0,1", "--seconds", "0.3",
                           "--samples", "4", "--summary", path, "--quiet")
    assert code == 0 and "num_workers=1 is the fewest that keeps up" in out
    assert "the run waited 19.5% of each train step (195.0 ms) for data\n" in out


def test_dataloader_kwargs_factory_keeps_batch_size_and_collate(data_module, capsys):
    code, out, err = bench(capsys, "benchdata_mod:loader_kwargs", "--workers", "0,1", "--seconds", "0.3",
                           "--samples", "8", "--json", "--quiet")
    assert code == 0, err
    r = json.loads(out)
    assert r["batch_size"] == 4
    assert r["collate_ms"] >= 2.0  # the factory's collate_fn (sleeps 2 ms), not default_collate
    assert r["samples"]["split"] == "none" and r["samples"]["getitem_ms"] >= 1.0
    assert [x["num_workers"] for x in r["runs"]] == [0, 1]  # its num_workers=7 is swept, not used
    # each batch costs 4 x 1 ms + 2 ms collate in one process
    assert r["runs"][0]["samples_per_s"] < 4 / 0.006 * 1.1


def test_transform_tuple_and_option(data_module, capsys):
    code, out, _ = bench(capsys, "benchdata_mod:with_transform", "--workers", "0", "--seconds", "0.2",
                         "--samples", "6", "--json", "--quiet")
    r = json.loads(out)
    assert code == 0 and r["samples"]["split"] == "transform given"
    assert r["samples"]["transform_ms"] >= 2.7 and r["samples"]["load_ms"] >= 0.9
    code, out, _ = bench(capsys, str(data_module / "benchdata_mod.py") + ":loader_kwargs", "--transform",
                         "benchdata_mod:decode", "--workers", "0", "--seconds", "0.2", "--samples", "6",
                         "--json", "--quiet")
    r = json.loads(out)
    assert code == 0 and r["samples"]["split"] == "transform given" and r["samples"]["transform_ms"] >= 2.7


def test_iterable_dataset_sweep_only(data_module, capsys):
    code, out, err = bench(capsys, "benchdata_mod:stream", "--workers", "0", "--seconds", "0.2",
                           "--batch-size", "5", "--json", "--quiet")
    assert code == 0, err
    r = json.loads(out)
    assert r["samples"]["count"] == 0 and r["collate_ms"] is None
    assert r["runs"][0]["samples_per_s"] > 0 and r["runs"][0]["batches"] > 0


def test_rate_from_summary(data_module, capsys, tmp_path):
    summary = {"schema": "otel-training/summary/v1", "modes": {"train": {
        "steps": 100, "samples": 1600, "step_time_s": 20.0, "phases": [
            {"name": "dataloader_next", "parent": "step", "total_s": 15.0},
            {"name": "train_batch", "parent": "step", "total_s": 5.0}]}}}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(summary))
    code, out, err = bench(capsys, "benchdata_mod:images", "--workers", "0", "--seconds", "0.2",
                           "--samples", "4", "--summary", str(path), "--json", "--quiet")
    assert code == 0, err
    r = json.loads(out)
    assert r["batch_size"] == 16  # 1600 samples / 100 steps
    # without its 15 s of data waits the model ran 100 steps in 5 s: 20 steps/s x 16
    assert r["feed"]["step_rate"] == pytest.approx(20.0)
    assert r["feed"]["needed_samples_per_s"] == pytest.approx(320.0)
    assert r["feed"]["can_feed"] is False


@pytest.mark.parametrize("argv,message", [
    (["nocolon"], "is not MODULE:NAME"),
    (["no_such_module_xyz:f"], "cannot import 'no_such_module_xyz'"),
    (["benchdata_mod:missing"], "has no callable 'missing'"),
    (["benchdata_mod:broken"], "raised RuntimeError: no data here"),
    (["benchdata_mod:not_a_dataset"], "returned int, not a Dataset"),
    (["benchdata_mod:images", "--workers", "a,b"], "--workers 'a,b'"),
    (["benchdata_mod:images", "--summary", "/nonexistent.json"], "does not exist"),
])
def test_errors_are_one_line(data_module, capsys, argv, message):
    code, out, err = bench(capsys, *argv, "--seconds", "0.1", "--quiet")
    assert code == 2 and out == ""
    assert err.startswith("otel-training bench-data: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_export_gauges_in_memory():
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    result = {"dataset": "m:f", "batch_size": 8, "collate_ms": 2.0,
              "samples": {"load_ms": 1.0, "transform_ms": 4.0},
              "runs": [{"num_workers": 0, "pin_memory": False, "samples_per_s": 100.0},
                       {"num_workers": 2, "pin_memory": False, "samples_per_s": 190.0}]}
    reader = InMemoryMetricReader()
    assert export(result, environ={}, reader=reader) is None
    points = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for dp in m.data.data_points:
                    points[(m.name, m.unit, tuple(sorted(dp.attributes.items())))] = dp.value
    base = (("training.data.batch_size", 8), ("training.data.dataset", "m:f"))
    tput = ("training.data.throughput", "{sample}/s")
    assert points[tput + (tuple(sorted(base + (("training.data.num_workers", 2),
                                                ("training.data.pin_memory", False)))),)] == 190.0
    stage = ("training.data.stage.duration", "s")
    assert points[stage + (tuple(sorted(base + (("training.data.stage", "transform"),))),)] == 0.004
    assert points[stage + (tuple(sorted(base + (("training.data.stage", "collate"),))),)] == 0.002
    assert export(result, environ={}) is None  # nothing configured: nothing exported
    assert "supports otlp, console, none" in export(result, environ={"OTEL_METRICS_EXPORTER": "prometheus"})


def test_cli_exports_over_otlp(data_module):
    """The command, as a process, sends its gauges to a real OTLP/gRPC receiver."""
    with OTLPReceiver() as rx:
        env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=rx.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
                   PYTHONPATH=os.pathsep.join([str(data_module), str(ROOT)]))
        env.pop("OTEL_METRICS_EXPORTER", None)
        env.pop("OTEL_SERVICE_NAME", None)
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-c", "import sys; from otel_training.cli.bench_data import main; "
                               "sys.exit(main(sys.argv[1:]))", "benchdata_mod:images", "--workers", "0",
                               "--seconds", "0.2", "--samples", "4", "--quiet"],
                              env=env, cwd=data_module, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == "" and "best:" in proc.stdout
        assert time.time() - t0 < 60
        received = rx.metrics()
    metrics = {m.name: m for _, m in received}
    assert set(metrics) >= {"training.data.throughput", "training.data.stage.duration"}
    (dp,) = data_points(metrics["training.data.throughput"])
    attrs = attributes(dp.attributes)
    assert attrs["training.data.num_workers"] == 0 and attrs["training.data.dataset"] == "benchdata_mod:images"
    assert dp.as_double > 0
    assert received[0][0]["service.name"] == "otel-training-bench-data"
