"""Advice that fits the run: the summary's ``run`` section records what a real loop
already does (device, autocast dtype, compiled model, fused/foreach optimizers, each
DataLoader's settings), and the findings never propose it again; each piece of advice
names the device it applies to. Without the section, the general advice stays."""

from __future__ import annotations

import json

import torch
from torch.utils.data import DataLoader, TensorDataset

from otel_training.diagnosis.advice import DATALOADER_ADVICE
from otel_training.report.build import diagnosed
from otel_training.report.sources import load_summaries
from tests.conftest import make_dataset, make_model, train_step
from tests.test_verdict import _diagnose


def _advice(findings, kind):
    found = [f for f in findings if f.kind == kind]
    assert found, [(f.kind, f.detail) for f in findings]
    return " | ".join(found[0].advice)


def test_a_bf16_autocast_loop_is_not_told_to_use_mixed_precision(instrumented):
    """A compute-heavy CPU loop under bf16 autocast, a fused AdamW and two loaders
    (a shuffling train loader, an eval loader): the ``run`` section holds each fact,
    and the compute finding proposes neither mixed precision, nor fused optimizers,
    nor a batch size 'while GPU memory allows'."""
    tel = instrumented()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 768), torch.nn.ReLU(), torch.nn.Linear(768, 768), torch.nn.ReLU(), torch.nn.Linear(768, 2)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    data = TensorDataset(torch.randn(256, 64), torch.randint(0, 2, (256,)))
    train = DataLoader(data, batch_size=32, shuffle=True)
    evaluate = DataLoader(data, batch_size=64)
    for _ in range(2):
        model.train()
        for x, y in train:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss.item()
        model.eval()
        with torch.no_grad():
            for x, _y in evaluate:
                model(x)
    tel.uninstrument()
    summary = tel.runtime.summary_dict()
    run = summary["run"]
    assert run["device"] == "cpu" and run["cpus"] >= 1
    assert run["autocast_dtype"] == "bfloat16" and run["autocast_device"] == "cpu"
    assert run["compiled"] is False
    assert run["optimizers"] == [{"class": "AdamW", "fused": True, "foreach": None}]
    assert run["loaders"] == [
        {
            "num_workers": 0,
            "pin_memory": False,
            "persistent_workers": False,
            "prefetch_factor": None,
            "batch_size": 32,
            "shuffle": True,
        },
        {
            "num_workers": 0,
            "pin_memory": False,
            "persistent_workers": False,
            "prefetch_factor": None,
            "batch_size": 64,
            "shuffle": False,
        },
    ]
    json.dumps(summary)  # the summary file's JSON
    text = _advice(_diagnose(summary), "compute_bound")
    assert "mixed precision" not in text and "autocast" not in text
    assert "GPU memory" not in text and "fused" not in text
    assert "torch.compile(model)" in text and "cpu" in text


def test_a_cpu_loop_starved_by_num_workers_0_is_told_so(instrumented):
    """A CPU loop that loads on the training thread (num_workers=0, 6 ms per sample):
    the data finding says why num_workers=0 cannot overlap, and proposes neither
    pin_memory nor GPU augmentation (no GPU in this run)."""
    tel = instrumented()
    torch.manual_seed(0)
    model, loader = make_model(), DataLoader(make_dataset(24, delay=0.006), batch_size=4, shuffle=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in loader:
        train_step(model, opt, batch)
    tel.uninstrument()
    summary = tel.runtime.summary_dict()
    assert summary["run"]["loaders"][0]["num_workers"] == 0
    assert summary["run"]["autocast_dtype"] is None and summary["run"]["optimizers"][0]["class"] == "SGD"
    text = _advice(_diagnose(summary), "data_loading")
    assert "num_workers=0 loads each batch on the training thread" in text
    assert "pin_memory" not in text and "GPU" not in text


def _summary(shares, children=None, run=None):
    step_time = 10.0
    phases = [
        {"name": n, "parent": "step", "total_s": s * step_time, "count": 100, "share": s} for n, s in shares.items()
    ]
    phases += [
        {"name": n, "parent": "train_batch", "total_s": s * step_time, "count": 100, "share": s}
        for n, s in (children or {}).items()
    ]
    out = {
        "schema": "otel-training/summary/v1",
        "modes": {
            "train": {
                "steps": 100,
                "samples": 3200,
                "step_time_s": step_time,
                "wall_s": 10.0,
                "step_mean_s": 0.1,
                "phases": phases,
                "gpu_idle_s": {},
            }
        },
        "telemetry": {},
    }
    if run is not None:
        out["run"] = run
    return out


_LOADER = {
    "num_workers": 4,
    "pin_memory": True,
    "persistent_workers": True,
    "prefetch_factor": 4,
    "batch_size": 64,
    "shuffle": True,
}
_DATA_BOUND = {"dataloader_next": 0.5, "to_device": 0.2, "train_batch": 0.3}
_COMPUTE_BOUND = {"train_batch": 0.9, "dataloader_next": 0.1}


def test_data_advice_leaves_out_loader_settings_already_in_place():
    run = {
        "device": "cuda",
        "loaders": [
            _LOADER,
            {**_LOADER, "num_workers": 0, "pin_memory": False, "persistent_workers": False, "shuffle": False},
        ],
    }
    found = _diagnose(_summary(_DATA_BOUND, run=run))
    text = _advice(found, "data_loading")
    assert "above 4, what the run used" in text  # the train loader (the shuffling one), not the eval one
    assert "persistent_workers" not in text and "pin_memory" not in text
    assert "raise prefetch_factor above 4" in text and "cuda device" in text
    copies = _advice(found, "host_to_device")
    assert "pin_memory=True" not in copies and ".to('cuda', non_blocking=True)" in copies
    # as many workers as CPUs: raising them is not the advice
    text = _advice(_diagnose(_summary(_DATA_BOUND, run={**run, "cpus": 4})), "data_loading")
    assert "num_workers=4 already has a worker for each of the 4 CPUs" in text and "above 4" not in text
    # one setting missing: that one is proposed, naming the device
    run = {"device": "cuda", "loaders": [{**_LOADER, "pin_memory": False}]}
    text = _advice(_diagnose(_summary(_DATA_BOUND, run=run)), "data_loading")
    assert "pin_memory=True, so that copies to the cuda device can overlap" in text
    assert "persistent_workers" not in text


def test_compute_advice_leaves_out_what_the_run_does_and_names_the_device():
    done = {
        "device": "cuda",
        "autocast_dtype": "bfloat16",
        "compiled": True,
        "optimizers": [{"class": "AdamW", "fused": True, "foreach": None}],
        "loaders": [_LOADER],
    }
    text = _advice(_diagnose(_summary(_COMPUTE_BOUND, {"optimizer_step": 0.5}, run=done)), "compute_bound")
    assert "mixed precision" not in text and "torch.compile" not in text and "fused" not in text
    assert "raise the batch size while cuda memory allows (the run used 64)" in text
    launch = _summary(_COMPUTE_BOUND, run=done)
    launch["gpu_utilization"] = {"mean": 0.3, "min": 0.1}
    text = _advice(_diagnose(launch), "launch_bound")
    assert "use torch.compile (" not in text and "mode='reduce-overhead'" in text
    bare = {
        "device": "cuda",
        "autocast_dtype": None,
        "compiled": False,
        "optimizers": [{"class": "AdamW", "fused": None, "foreach": True}],
        "loaders": [_LOADER],
    }
    text = _advice(_diagnose(_summary(_COMPUTE_BOUND, {"optimizer_step": 0.5}, run=bare)), "compute_bound")
    assert "torch.autocast('cuda', dtype=torch.bfloat16)" in text and "torch.compile(model)" in text
    assert "use fused=True optimizers (on cuda)" in text
    cpu = {**bare, "device": "cpu"}
    text = _advice(_diagnose(_summary(_COMPUTE_BOUND, run=cpu)), "compute_bound")
    assert "GPU memory" not in text and "batch size" not in text
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in text


def test_without_the_run_section_the_general_advice_stays():
    """Older summary files and Prometheus reports know nothing of the run's settings."""
    found = _diagnose(_summary(_DATA_BOUND))
    assert [f.advice for f in found if f.kind == "data_loading"][0] == DATALOADER_ADVICE
    text = _advice(_diagnose(_summary(_COMPUTE_BOUND)), "compute_bound")
    assert "use mixed precision" in text and "GPU memory allows" in text


def test_report_over_summary_files_keeps_the_run_section(tmp_path):
    """``otel-training report --summary``: the merged report (whose ``run`` is the run id)
    carries the lowest rank's ``run`` section to the findings."""
    paths = []
    for rank in (1, 0):
        s = _summary(
            _COMPUTE_BOUND,
            run={
                "device": "cuda",
                "autocast_dtype": "bfloat16" if rank == 0 else None,
                "compiled": False,
                "optimizers": [],
                "loaders": [],
            },
        )
        s.update(run_id="r1", rank=rank, host="h", pid=100 + rank, loaders=["torch"])
        path = tmp_path / f"s{rank}.json"
        path.write_text(json.dumps(s))
        paths.append(str(path))
    report = load_summaries(paths)
    assert report.run == "r1" and report.run_facts is not None and report.run_facts.autocast_dtype == "bfloat16"
    text = _advice(list(diagnosed(report).findings or ()), "compute_bound")
    assert "mixed precision" not in text and "torch.compile(model)" in text
