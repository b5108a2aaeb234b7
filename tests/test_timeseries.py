"""The summary file's time series: bounded whatever the run's length, and
consistent with the run's totals. The 100 000-step run is fed straight into the
consumers (records resolved by the real ``Resolver`` from real timelines), not
trained step by step."""

from __future__ import annotations

import json
import random

from otel_training.aggregate.sampling import TailCapture
from otel_training.aggregate.step_record import Resolver
from otel_training.aggregate.summary import RunSummary, write
from otel_training.aggregate.timeseries import MAX_PHASES, MAX_WINDOWS, POINTS, TimeSeries
from otel_training.record.timeline import PhaseRecord, StepTimeline
from otel_training.timing.device import DeviceTimer


def _timeline(index: int, start: int, rng: random.Random, user: str) -> StepTimeline:
    """dataloader_next, batch (forward, backward, optimizer_step), a user phase."""
    step = StepTimeline(index, 0)
    durations = [rng.uniform(1e6, 3e6), rng.uniform(4e6, 6e6), rng.uniform(5e6, 9e6), 1e5, 2e6, 1e5]
    t = start
    step.marks = [t]
    for d in durations:
        t += int(d)
        step.marks.append(t)
    step.tokens = [None] * len(step.marks)
    dl = PhaseRecord("dataloader_next", "step", 0, True)
    dl.end = 1
    batch = PhaseRecord("batch", "step", 1, True)
    batch.end = 4
    kids = []
    for name, (a, b) in (("forward", (1, 2)), ("backward", (2, 3)), ("optimizer_step", (3, 4))):
        rec = PhaseRecord(name, "batch", a, True, outer=batch)
        rec.end = b
        kids.append(rec)
    mine = PhaseRecord(user, "step", 4, False)
    mine.end = 5
    step.phases = [dl, batch, *kids, mine]
    step.saw_backward = step.saw_optimizer = True
    step.batch_size = 32
    return step


def test_a_100k_step_run_writes_a_small_summary(tmp_path):
    rng = random.Random(0)
    resolver = Resolver(DeviceTimer(), TailCapture(2.0, 100, 20.0))
    summary = RunSummary({"service": "t", "run_id": "r", "host": "h", "rank": 0, "world_size": 1, "pid": 1}, "off")
    series = TimeSeries(offset=1_700_000_000 * 10**9)
    t = 0
    batch = []
    for i in range(100_000):
        # 40 user phase names: more than the columns kept, so "other" is exercised
        step = _timeline(i, t, rng, f"user_phase_{i % 40}")
        t = step.marks[-1]
        batch.append(resolver.resolve(step))
        if len(batch) == 500:  # the pipeline hands batches over
            summary.add(batch)
            series.add(batch)
            batch = []
    out = summary.to_dict()
    out["timeseries"] = series.to_dict()
    path = write(out, str(tmp_path / "summary.json"))
    size = len(open(path, "rb").read())
    assert size < 1_000_000, size
    ts = json.loads(open(path).read())["timeseries"]["train"]
    n = len(ts["t"])
    assert MAX_WINDOWS // 2 <= n <= MAX_WINDOWS + 1
    assert ts["width"] * (n - 1) <= 100_000 <= ts["width"] * n
    assert sum(ts["steps"]) == 100_000
    assert all(len(v) == n for k, v in ts.items() if isinstance(v, list))
    assert len(ts["phases"]) == MAX_PHASES and "other" in ts["phases"]
    # the windows add up to the run's totals
    train = out["modes"]["train"]
    assert abs(sum(ts["step_s"]) - train["step_time_s"]) < 1e-3 * train["step_time_s"]
    assert sum(ts["samples"]) == train["samples"] == 3_200_000
    dl = next(p for p in train["phases"] if p["name"] == "dataloader_next" and p["parent"] == "step")
    assert abs(sum(ts["phases"]["dataloader_next"]) - dl["total_s"]) < 1e-3 * dl["total_s"]
    top = sum(sum(v) for v in ts["phases"].values())
    assert abs(top - train["step_time_s"]) < 1e-3 * train["step_time_s"]  # every top-level second, once
    # the quantile sketch: each window's p50 is near the run's (the steps are i.i.d.)
    assert all(abs(p - train["step_p50_s"]) < 0.05 * train["step_p50_s"] for p in ts["p50_s"][1:])
    assert all(p50 <= p90 <= mx for p50, p90, mx in zip(ts["p50_s"], ts["p90_s"], ts["max_s"]))
    assert abs(max(ts["max_s"]) - train["step_max_s"]) < 1e-5 * train["step_max_s"]
    assert all(b > a for a, b in zip(ts["t"], ts["t"][1:]))
    assert ts["t"][0] == 1_700_000_000.0  # epoch seconds: the spans' clock


def test_short_runs_keep_every_step(tmp_path):
    rng = random.Random(1)
    resolver = Resolver(DeviceTimer(), TailCapture(2.0, 100, 20.0))
    series = TimeSeries(offset=0)
    steps = [resolver.resolve(_timeline(i, i * 10**8, rng, "log")) for i in range(POINTS)]
    series.add(steps[:5])
    series.add(steps[5:])
    ts = series.to_dict()["train"]
    assert ts["width"] == 1 and ts["steps"] == [1] * POINTS
    exact = [(s.times[-1] - s.times[0]) / 1e9 for s in steps]
    assert all(abs(a - b) < 1e-5 * b for a, b in zip(ts["p50_s"], exact))  # 6 significant digits
    assert ts["p50_s"] == ts["p90_s"] == ts["max_s"]


def test_a_real_run_summary_file_holds_its_series(tmp_path):
    from tests.conftest import run_script_for_summary

    source = """
import torch, otel_training
otel_training.instrument(configure_sdk=False)
m = torch.nn.Linear(8, 2); opt = torch.optim.SGD(m.parameters(), 0.1)
data = torch.utils.data.TensorDataset(torch.randn(160, 8), torch.randint(0, 2, (160,)))
for epoch in range(2):
    for x, y in torch.utils.data.DataLoader(data, batch_size=4):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
    with torch.no_grad():
        for x, _ in torch.utils.data.DataLoader(data, batch_size=16):
            m(x)
"""
    summary, _ = run_script_for_summary(tmp_path, source)
    for mode, steps in (("train", 80), ("eval", 20)):
        ts = summary["timeseries"][mode]
        # The series, like the step-time statistics, leave out the step FLOPs were counted on.
        counted = 1 if mode == "train" else 0
        assert sum(ts["steps"]) + counted == summary["modes"][mode]["steps"] == steps
        assert summary["modes"][mode]["timed_steps"] == steps - counted
        assert abs(sum(ts["step_s"]) - summary["modes"][mode]["step_time_s"]) < 1e-4
        assert len(ts["t"]) <= MAX_WINDOWS
        assert summary["started_at"] - 60 < ts["t"][0] < summary["ended_at"]


def test_eval_windows_never_span_the_training_between_passes():
    """80 epochs of 40 train steps, each followed by an eval pass of 5 steps: past
    several merges, no eval window spans training time (each pass's windows merge among
    themselves while the passes are fewer than the windows kept), and the windows stay
    bounded and add up to the steps."""
    rng = random.Random(1)
    resolver = Resolver(DeviceTimer(), TailCapture(2.0, 100, 20.0))
    series = TimeSeries(offset=0)
    t, passes, batch = 0, [], []
    for epoch in range(80):
        for i in range(45):
            step = _timeline(i, t, rng, "user")
            if i >= 40:  # the eval pass: a forward with no backward
                step.saw_backward = step.saw_optimizer = False
                step.phases = [p for p in step.phases if p.name in ("dataloader_next", "batch", "forward")]
            t = step.marks[-1] + 1000
            if i == 40:
                passes.append([step.marks[0], 0])
            if i >= 40:
                passes[-1][1] = step.marks[-1]
            batch.append(resolver.resolve(step))
            if len(batch) == 64:
                series.add(batch)
                batch = []
    series.add(batch)
    ev = series.to_dict()["eval"]
    assert sum(ev["steps"]) == 80 * 5 and len(ev["t"]) <= MAX_WINDOWS and max(ev["steps"]) > 1
    train_epoch_s = 40 * 12e-3  # well under 40 train steps' time: the shortest they can take
    for start, wall in zip(ev["t"], ev["wall_s"]):
        assert wall < train_epoch_s, (start, wall)  # within one pass (a pass lasts < 5 * 22 ms)


def test_the_flop_count_step_is_left_out_when_its_batch_ends_with_eval_steps():
    """The pipeline hands over whatever steps finished: a batch may hold the FLOP-count
    step and end with an eval pass (whose steps carry no FLOP count). The series leaves
    the counted step out as the summary does, whatever the batch's last step."""
    from otel_training.record.flops import SOURCE_MEASURED, FlopCount

    rng = random.Random(2)
    resolver = Resolver(DeviceTimer(), TailCapture(2.0, 100, 20.0))
    summary = RunSummary({"service": "t", "run_id": "r", "host": "h", "rank": 0, "world_size": 1, "pid": 1}, "off")
    series = TimeSeries(offset=0)
    t, batch = 0, []
    for i in range(15):
        step = _timeline(i, t, rng, "user")
        if i == 3:  # the counted step: planted 50 ms longer than any other
            step.marks = [m + (50_000_000 if k >= 3 else 0) for k, m in enumerate(step.marks)]
            step.flops = FlopCount(1e6, None, "fp32", "cpu", SOURCE_MEASURED, step=3, cost_s=0.05)
        if i >= 10:  # an eval pass closes the batch
            step.saw_backward = step.saw_optimizer = False
            step.phases = [p for p in step.phases if p.name in ("dataloader_next", "batch", "forward")]
        t = step.marks[-1] + 1000
        batch.append(resolver.resolve(step))
    assert batch[3].flops is not None and batch[-1].flops is None
    summary.add(batch)
    series.add(batch)
    train = summary.to_dict()["modes"]["train"]
    assert train["steps"] == 10 and train["timed_steps"] == 9 and train["flops"]["counted_step"] == 3
    ts = series.to_dict()
    assert sum(ts["train"]["steps"]) == 9 and 3 not in ts["train"]["first_step"]
    assert max(ts["train"]["max_s"]) < 0.05  # the counted step's time is in no window
    assert abs(sum(ts["train"]["step_s"]) - train["step_time_s"]) < 1e-4
    assert sum(ts["eval"]["steps"]) == 5
