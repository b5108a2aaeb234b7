"""OTEL_TRAINING_TRACE_FILE: the traced steps as Chrome trace-event JSON.

* a two-rank gloo run under ``opentelemetry-instrument torchrun`` exporting to a real
  OTLP receiver: each rank's file is valid trace-event JSON (``traceEvents``, ``ph``,
  ``ts`` in microseconds, ``pid``/``tid``, properly nested), one track per rank and
  thread, and every event's start and duration equal the exported span's;
* the clock lines up with torch.profiler's (documented in docs/report.md): a real
  profile of the same steps has its ``aten::linear`` ops inside our ``forward`` events;
* bounded (oldest steps dropped and counted, the first kept), written on SIGTERM.
"""

from __future__ import annotations

import json
import signal
import uuid

import pytest

from otel_training.cli import main
from tests.otlp_receiver import OTLPReceiver, attributes, free_port
from tests.scripts.harness import BIN, SCRIPTS, Run, instrumented, otel_env, run

STEPS = 12


def check_schema(doc: dict, own: bool = True) -> list:
    """Chrome trace-event JSON (object form) as Perfetto and chrome://tracing read it;
    returns the complete events. Nesting: on each track, events either nest or follow."""
    assert set(doc) >= {"traceEvents", "displayTimeUnit", "otherData", "baseTimeNanoseconds"}
    assert not own or doc["baseTimeNanoseconds"] % (86_400 * 10**9) == 0  # a UTC midnight
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert e["ph"] in ("X", "M"), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        assert isinstance(e["name"], str) and e["name"], e
        if e["ph"] == "X":
            assert isinstance(e["ts"], float) and isinstance(e["dur"], float) and e["dur"] >= 0, e
            assert not own or 0 <= e["ts"] < 2 * 86_400e6, e  # microseconds since baseTimeNanoseconds
    complete = [e for e in events if e["ph"] == "X"]
    tracks: dict = {}
    for e in complete:
        tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for track in tracks.values():
        open_: list = []  # a stack of end times
        for e in track:  # in file order: sorted by start, parents first
            while open_ and e["ts"] >= open_[-1] - 1e-3:
                open_.pop()
            if open_:
                assert e["ts"] + e["dur"] <= open_[-1] + 1e-3, f"{e['name']} overlaps its parent's end"
            open_.append(e["ts"] + e["dur"])
    return complete


@pytest.mark.slow
def test_two_rank_gloo_run_trace_files_match_the_spans(tmp_path):
    run_id = uuid.uuid4().hex
    with OTLPReceiver() as receiver:
        env = otel_env(receiver.endpoint, tmp_path, OTEL_METRIC_EXPORT_INTERVAL="1000",
                       OTEL_TRAINING_TRACE_EVERY_N="3", OTEL_TRAINING_TRACE_MAX_PER_SECOND="1000",
                       OTEL_TRAINING_HARDWARE="false", GLOO_SOCKET_IFNAME="lo",
                       OTEL_TRAINING_TRACE_FILE=str(tmp_path / "trace-{rank}.json"))
        cmd = [str(BIN / "opentelemetry-instrument"), str(BIN / "torchrun"), "--nnodes=1", "--nproc_per_node=2",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={run_id}",
               str(SCRIPTS / "train_ddp.py"), "--steps", str(STEPS), "--sync-every", "4", "--slow-ms", "10"]
        r = run(cmd, env, timeout=300)
        assert r.proc.returncode == 0, r.stderr
        receiver.wait_for(lambda rc: len([s for _, s in rc.spans() if s.name == "step"]) >= 2 * (STEPS // 3))
        spans = receiver.spans()
    # the exported spans by (rank, trace): start/end per name, in order
    by_trace: dict = {}
    for _res, s in spans:
        by_trace.setdefault(s.trace_id, []).append(s)
    expected = {}
    for group in by_trace.values():
        root = next(s for s in group if s.name == "step")
        attrs = attributes(root.attributes)
        key = (attrs["training.rank"], attrs["training.step"])
        expected[key] = sorted((s.start_time_unix_nano, s.end_time_unix_nano, s.name) for s in group)
    pids = set()
    for rank in (0, 1):
        doc = json.loads((tmp_path / f"trace-{rank}.json").read_text())
        complete = check_schema(doc)
        meta = {e["name"]: e for e in doc["traceEvents"] if e["ph"] == "M"}
        assert meta["process_name"]["args"]["name"].startswith(f"rank {rank} (")
        assert meta["thread_name"]["args"]["name"].startswith("steps (")
        assert doc["otherData"]["rank"] == rank and doc["otherData"]["run_id"] == run_id
        assert doc["otherData"]["dropped_steps"] == 0
        assert len({(e["pid"], e["tid"]) for e in complete}) == 1  # one track: the training thread
        pids.add(complete[0]["pid"])
        steps = [e for e in complete if e["name"] == "step"]
        numbers = [e["args"]["training.step"] for e in steps]
        assert set(range(0, STEPS, 3)) <= set(numbers)  # one in 3, and slow steps
        assert sorted(numbers) == sorted(n for r, n in expected if r == rank)  # the spans' sample, exactly
        assert {e["name"] for e in complete} >= {"step", "dataloader_next", "train_batch", "forward", "backward",
                                                 "optimizer_step", "reduce_metrics"}
        for step in steps:
            key = (rank, step["args"]["training.step"])
            assert key in expected, f"no exported span for rank {rank} step {key[1]}"
            end = step["ts"] + step["dur"]
            mine = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in complete
                          if step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= end + 1e-3)
            theirs = expected[key]
            assert [n for *_, n in mine] == [n for *_, n in theirs]
            for (ts, te, name), (ss, se, _) in zip(mine, theirs):
                # the same clock as the spans, to the nanosecond (in integers: epoch ns
                # need 61 bits, and a double rounds them to 256 ns)
                assert doc["baseTimeNanoseconds"] + round(ts * 1000) == ss, name
                assert abs((te - ts) * 1000 - (se - ss)) < 1, name
    assert len(pids) == 2  # one process track per rank
    # both ranks in one file: one process track each, every event where it was
    out = tmp_path / "merged.json"
    assert main(["trace-merge", "-o", str(out), str(tmp_path / "trace-0.json"), str(tmp_path / "trace-1.json")]) == 0
    merged = json.loads(out.read_text())
    events = check_schema(merged)
    assert len({e["pid"] for e in events}) == 2 and len(events) == sum(
        len([e for e in json.loads((tmp_path / f"trace-{r}.json").read_text())["traceEvents"] if e["ph"] == "X"])
        for r in (0, 1))
    names = {e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"}
    assert len(names) == 2 and all(n.startswith("rank ") for n in names)


def test_clock_lines_up_with_torch_profiler(instrumented, tmp_path):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tests.conftest import make_dataset, make_model, train_step

    tel = instrumented(trace_file=str(tmp_path / "trace.json"))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(make_dataset(48, delay=0.001), batch_size=8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in loader:
            train_step(model, opt, batch)
    tel.uninstrument()
    prof.export_chrome_trace(str(tmp_path / "torch.json"))
    assert "baseTimeNanoseconds" in json.loads((tmp_path / "torch.json").read_text())  # Kineto's, like ours
    out = tmp_path / "merged.json"
    assert main(["trace-merge", "-o", str(out), str(tmp_path / "trace.json"), str(tmp_path / "torch.json")]) == 0
    merged = json.loads(out.read_text())["traceEvents"]
    linears = sorted(e["ts"] for e in merged if e.get("ph") == "X" and e.get("name") == "aten::linear")
    forwards = [e for e in merged if e.get("name") == "forward" and e.get("cat") == "phase"]
    ours = [e for e in merged if e.get("cat") in ("phase", "train", "eval")]
    check_schema({"traceEvents": ours, "displayTimeUnit": "ms", "otherData": {}, "baseTimeNanoseconds": 0},
                 own=False)
    torch_tracks = {(e.get("pid"), e.get("tid")) for e in merged if e.get("cat") == "cpu_op"}
    assert not torch_tracks & {(e["pid"], e["tid"]) for e in ours}  # a track of their own
    assert len(forwards) == 6 and len(linears) >= 6 * 3
    for f in forwards:  # each forward of the 3-layer model holds its 3 linear ops
        inside = [t for t in linears if f["ts"] - 50 <= t <= f["ts"] + f["dur"] + 50]
        assert len(inside) == 3, (f, inside[:5])


def test_bounded_the_first_step_kept(instrumented, tmp_path, monkeypatch):
    import torch

    from otel_training.export import trace_file
    from tests.conftest import make_dataset, make_model, train_step

    monkeypatch.setattr(trace_file, "MAX_BYTES", 12_000)
    path = tmp_path / "trace.json"
    tel = instrumented(trace_file=str(path))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in torch.utils.data.DataLoader(make_dataset(400), batch_size=2):
        train_step(model, opt, batch)
    tel.uninstrument()
    doc = json.loads(path.read_text())
    steps = [e["args"]["training.step"] for e in check_schema(doc) if e["name"] == "step"]
    assert steps[0] == 0 and steps[-1] == 199  # the first, and the newest
    assert doc["otherData"]["dropped_steps"] == 200 - len(steps) > 100
    assert len(path.read_bytes()) < 12_000 + 6_000  # the bound, plus the first step and metadata


@pytest.mark.slow
def test_written_on_sigterm(tmp_path):
    path = tmp_path / "trace.json"
    env = otel_env(None, tmp_path, OTEL_TRAINING_HARDWARE="false", OTEL_TRACES_EXPORTER="none",
                   OTEL_METRICS_EXPORTER="none", OTEL_TRAINING_TRACE_EVERY_N="5", OTEL_TRAINING_TRACE_MAX_PER_SECOND="1000",
                   OTEL_TRAINING_TRACE_FILE=str(path))
    r = Run(instrumented("train_loop.py", "--steps", "0", "--ready-after", "30"), env)
    r.wait_for_line("READY")
    r.proc.send_signal(signal.SIGTERM)
    assert r.wait(60) == -signal.SIGTERM  # died of SIGTERM, as without us
    steps = [e["args"]["training.step"] for e in check_schema(json.loads(path.read_text())) if e["name"] == "step"]
    assert {0, 5, 10, 15, 20, 25} <= set(steps)  # one in 5 (and slow steps) up to the signal


def test_a_folder_is_refused_with_the_variable_named(tmp_path):
    from otel_training.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config({"OTEL_TRAINING_TRACE_FILE": str(tmp_path) + "/"})
    assert "OTEL_TRAINING_TRACE_FILE=" in str(err.value) and "use a file path, not a folder" in str(err.value)
    assert load_config({"OTEL_TRAINING_TRACE_FILE": "t-{rank}.json"}).trace_file == "t-{rank}.json"
