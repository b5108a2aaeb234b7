"""Numbers a user reads first, on an ordinary loop with an eval pass between training
epochs: each mode's throughput over its own step time (summary, run-end
table, report, HTML card and chart agree), ``training.step`` in train numbering with
eval steps numbered apart, coverage's gaps in train numbering, the FLOP-count step
named and left out of the step-time statistics, counts that agree with their nouns,
and a mode's chart line broken where that mode did not run."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from tests.conftest import make_dataset  # noqa: E402

TRAIN_S = 0.03  # planted per train forward
EVAL_S = 0.04  # planted per eval forward
EVAL_BATCH = 16
TRAIN_STEPS = 6  # per epoch (48 samples, batch 8)
EVAL_STEPS = 2  # per pass (32 samples, batch 16)
EPOCHS = 3
CHECKPOINT_S = 0.4  # planted after the first epoch's eval pass


class _Slow(nn.Module):
    """A model whose forward sleeps: the step times are known from the plant."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x):
        time.sleep(TRAIN_S if self.training else EVAL_S)
        return self.lin(x)


def _run(tel) -> dict:
    """Train epochs with an eval pass (and, after the first, a checkpoint) between them."""
    torch.manual_seed(0)
    model = _Slow()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train, val = make_dataset(TRAIN_STEPS * 8), make_dataset(EVAL_STEPS * EVAL_BATCH)
    for epoch in range(EPOCHS):
        model.train()
        for x, y in DataLoader(train, batch_size=8):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            for x, _ in DataLoader(val, batch_size=EVAL_BATCH):
                model(x)
        if epoch == 0:
            time.sleep(CHECKPOINT_S)  # a checkpoint the user did not name
    tel.uninstrument()
    return tel.runtime.summary_dict()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One instrumented run (every step traced), its summary and spans."""
    from tests.conftest import Instrumented

    path = tmp_path_factory.mktemp("summary") / "summary.json"
    tel = Instrumented(trace_every_n=1, trace_slow_factor=0, summary_file=str(path))  # (time series on)
    try:
        summary = _run(tel)
        steps = [(s.mode, s.index, s.duration, s.attributes) for s in tel.steps()]
    finally:
        tel.close()
    path.write_text(json.dumps(summary, default=str))
    return summary, steps, str(path)


def test_eval_throughput_is_over_the_eval_steps_own_time(run, capsys):
    """Eval between training epochs: samples/s over the eval steps' time, not over the
    span from the first eval step to the last (which holds two training epochs)."""
    from otel_training.cli import main
    from otel_training.diagnosis.summary_text import render_summary
    from otel_training.report.page import build_html
    from otel_training.report.sources import load_summaries

    summary, _, path = run
    ev = summary["modes"]["eval"]
    assert ev["steps"] == EPOCHS * EVAL_STEPS and ev["samples"] == EPOCHS * EVAL_STEPS * EVAL_BATCH
    ceiling = EVAL_BATCH / EVAL_S  # each eval step sleeps EVAL_S at least
    assert ev["samples_per_s"] <= ceiling * 1.001
    assert ev["samples_per_s"] >= EVAL_BATCH / (EVAL_S + 0.04)  # the wall-span figure is ~6x lower
    assert ev["samples_per_s"] == pytest.approx(ev["samples"] / ev["step_time_s"])

    # the run-end table, the report and the HTML card say the same
    assert f"{ev['samples_per_s']:.0f} samples/s" in render_summary(summary).split("otel-training: eval")[1]
    report = load_summaries([path])
    assert report.modes["eval"].samples_per_s == pytest.approx(ev["samples_per_s"])
    assert main(["report", "--summary", path, "--mode", "eval"]) == 0
    assert f"{ev['samples_per_s']:,.1f} samples/s" in capsys.readouterr().out
    html = build_html([replace(report, findings=(), mode="train")])
    assert f"<b>{ev['samples_per_s']:,.1f}</b><span>samples/s</span>" in html

    # the chart's eval throughput: every point near the eval steps' own rate
    from otel_training.report.charts import Colors, run_charts

    charts = {c["id"]: c for c in run_charts(replace(report, mode="train"), Colors())}
    (line,) = [s for s in charts["throughput"]["series"] if s["label"] == "eval samples/s"]
    points = [v for v in line["values"] if v is not None]
    assert points and all(EVAL_BATCH / (EVAL_S + 0.1) <= v <= ceiling * 1.001 for v in points)


def test_train_steps_are_numbered_as_the_global_step_and_eval_steps_apart(run):
    _, steps, _ = run
    train = [n for mode, n, _, _ in steps if mode == "train"]
    evals = [n for mode, n, _, _ in steps if mode == "eval"]
    assert train == list(range(EPOCHS * TRAIN_STEPS))
    assert evals == list(range(EPOCHS * EVAL_STEPS))
    # in time order: epoch e's train steps, then its eval steps
    order = [(mode, n) for mode, n, _, _ in steps]
    first_eval = order.index(("eval", 0))
    assert order[first_eval - 1] == ("train", TRAIN_STEPS - 1)
    assert order[first_eval + EVAL_STEPS] == ("train", TRAIN_STEPS)
    for mode, n, _, attrs in steps:
        assert attrs["training.step"] == n and attrs["training.mode"] == mode


def test_the_largest_gap_is_placed_in_train_numbering(run):
    from otel_training.aggregate.run_model import Run
    from otel_training.diagnosis.measures_text import coverage_line

    summary, _, _ = run
    cov = summary["coverage"]
    assert cov["largest_gap_s"] >= CHECKPOINT_S
    assert cov["largest_gap_after_step"] == TRAIN_STEPS - 1  # after the eval pass that followed it
    assert f"after train step {TRAIN_STEPS - 1}" in coverage_line(Run.from_dict(summary).coverage)


def test_the_flop_count_step_is_named_and_left_out_of_step_times(run):
    from otel_training.diagnosis.summary_text import render_summary
    from otel_training.record.flops import WARMUP

    summary, steps, _ = run
    tr = summary["modes"]["train"]
    f = tr["flops"]
    assert f["source"] == "measured" and f["counted_step"] == WARMUP  # after WARMUP train steps
    assert tr["steps"] == EPOCHS * TRAIN_STEPS and tr["timed_steps"] == tr["steps"] - 1
    durations = {n: d for mode, n, d, _ in steps if mode == "train"}
    assert f["counted_step_s"] == pytest.approx(durations[f["counted_step"]], abs=1e-6)
    others = sum(d for n, d in durations.items() if n != f["counted_step"])
    assert tr["step_time_s"] == pytest.approx(others, abs=1e-5)
    assert tr["step_mean_s"] == pytest.approx(others / (tr["steps"] - 1))
    assert tr["samples_per_s"] == pytest.approx((tr["samples"] - 8) / tr["step_time_s"])
    phases = {p["name"]: p for p in tr["phases"] if p["parent"] == "step"}
    assert phases["train_batch"]["count"] == tr["steps"] - 1
    assert sum(p["total_s"] for p in phases.values()) == pytest.approx(tr["step_time_s"], rel=1e-6)
    assert f"counted once on train step {WARMUP}" in render_summary(summary)
    assert sum(summary["timeseries"]["train"]["steps"]) == tr["steps"] - 1


def test_counts_agree_with_their_nouns(run, capsys):
    from otel_training.cli import main

    summary, _, path = run
    assert summary["coverage"]["gaps"] >= 1
    one = dict(summary, coverage=dict(summary["coverage"], gaps=1))
    path1 = path.replace("summary.json", "one_gap.json")
    with open(path1, "w") as fh:
        json.dump(one, fh, default=str)
    assert main(["report", "--summary", path1]) == 0
    out = capsys.readouterr().out
    assert "1 summary file," in out or "1 summary file)" in out
    assert " in 1 gap (" in out and "1 gaps" not in out and "file(s)" not in out


def test_a_modes_chart_line_breaks_where_it_did_not_run(run):
    from otel_training.report.charts import Colors, run_charts
    from otel_training.report.sources import load_summaries

    summary, _, path = run
    ts = summary["timeseries"]
    # no eval window spans a training epoch: each lasts about its own steps
    assert len(ts["eval"]["t"]) >= EPOCHS
    assert all(w < TRAIN_STEPS * TRAIN_S for w in ts["eval"]["wall_s"])
    charts = {c["id"]: c for c in run_charts(replace(load_summaries([path]), mode="train"), Colors())}
    for cid in ("step-time", "throughput"):
        series = charts[cid]["series"]
        (ev,) = [s for s in series if s["label"] in ("eval p50", "eval samples/s")]
        train = next(s for s in series if s["label"].startswith("train"))
        at = [k for k, v in enumerate(ev["values"]) if v is not None]
        breaks = set(ev.get("breaks") or ())
        # between two eval points with training between them, the eval line breaks
        cut = 0
        for a, b in zip(at, at[1:]):
            if any(train["values"][k] is not None for k in range(a + 1, b)):
                assert breaks & set(range(a + 1, b)), (cid, a, b)
                cut += 1
        assert cut >= EPOCHS - 1
