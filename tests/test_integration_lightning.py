"""PyTorch Lightning integration: framework-driven steps, phases and callback timing.

A tiny LightningModule runs on CPU under the real instrumentor with in-memory
exporters; a deliberately slow callback must come out as the bottleneck, by name.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from tests.conftest import run_script_for_summary

L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed")
import torch  # noqa: E402

from otel_training.aggregate.run_model import Run  # noqa: E402
from otel_training.diagnosis.verdict import diagnose  # noqa: E402

# well above a loaded CI machine's slowest train_batch, so the callback stays the largest phase
SLOW_S = 0.15
SLOW = "callback.SlowLoggingCallback.on_train_batch_end"
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", module="lightning")


class SlowLoggingCallback(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(SLOW_S)  # e.g. a synchronous upload of metrics


class QuickCallback(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pass


class TinyModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(n):
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 2, (n,), generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)


@pytest.fixture(autouse=True, scope="module")
def _warm_up():
    """One uninstrumented forward/backward first: torch's one-time start-up (autograd
    threads, kernel dispatch caches) must not count as the model's compute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: intra-op threads only add contention noise
    m = TinyModule()
    for _ in range(3):
        x, y = next(iter(_loader(8)))
        torch.nn.functional.cross_entropy(m(x), y).backward()
    yield
    torch.set_num_threads(threads)


def _trainer(**kw):
    return L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)


def test_lightning_steps_phases_and_slow_callback(instrumented):
    tel = instrumented(integrations=("lightning",))
    trainer = _trainer(callbacks=[SlowLoggingCallback(), QuickCallback()])
    trainer.fit(TinyModule(), _loader(48), _loader(16))
    tel.flush()
    summary = tel.runtime.summary_dict()
    steps = tel.steps()
    train = [s for s in steps if s.mode == "train"]
    evals = [s for s in steps if s.mode == "eval"]
    assert len(train) == 6 and len(evals) == 2, steps

    for s in train:
        top = s.top_level()
        # the fetch starts the step; batch_to_device, the hooks and the batch follow in order
        assert top[0] == "dataloader_next", s
        assert top.index("to_device") < top.index("train_batch") < top.index(SLOW), s
        assert "callback.QuickCallback.on_train_batch_start" in top
        (batch,) = s.named("train_batch")
        kids = [c.name for c in s.children(batch)]
        # forward/backward run inside optimizer.step(closure): they must not hide in optimizer_step
        assert {"forward", "backward", "optimizer_step"} <= set(kids), s
        assert all(s.parent_of(f).name == "train_batch" for f in s.named("forward"))
        assert s.total(SLOW) >= SLOW_S * 0.9
        assert s.attributes["training.batch_size"] == 8
    for s in evals:
        assert s.top_level()[0] == "dataloader_next" and "eval_batch" in s.top_level(), s
        assert not any(n.startswith("callback.") for n in s.names())
    # only overridden hooks become phases
    names = {n for s in steps for n in s.names() if n.startswith("callback.")}
    assert names == {SLOW, "callback.QuickCallback.on_train_batch_start"}

    totals = tel.phase_totals(parent="step", mode="train")
    assert totals[SLOW] >= 6 * SLOW_S * 0.9
    assert max(totals, key=totals.get) == SLOW
    findings = diagnose(Run.from_dict(summary))
    assert findings[0].kind == "callback", findings
    assert findings[0].title == "slow callback SlowLoggingCallback"
    assert "SlowLoggingCallback.on_train_batch_end" in findings[0].detail

    tel.uninstrument()
    assert "start" not in vars(trainer.profiler)
    assert type(vars(L.Trainer)["__init__"]).__name__ == "function"


def test_lightning_module_hooks_and_loop_boundaries(instrumented):
    class LoggingModule(TinyModule):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            time.sleep(0.01)

        def on_train_epoch_end(self):
            time.sleep(0.15)  # epoch-level work: must not land in a step

    tel = instrumented(integrations=("lightning",))
    _trainer(limit_val_batches=0).fit(LoggingModule(), _loader(24))
    steps = tel.steps()
    assert [s.mode for s in steps] == ["train"] * 3
    for s in steps:
        assert "callback.LoggingModule.on_train_batch_end" in s.top_level()
        assert "callback.LoggingModule.on_train_epoch_end" not in s.names()
    assert steps[-1].duration < 0.1  # the 150 ms epoch-end work is not in it



def test_a_callbacks_model_work_after_the_epoch_is_an_eval_step(instrumented):
    """A bolts-style image sampler: on_train_epoch_end, one no_grad batch of the
    callback's own loader through the model, then the grid written (50 ms). By the step
    definition an eval step: the wait its ``dataloader_next``, the write in it; the
    training steps keep their shape. A callback reading its loader with no model work
    makes no step."""

    class Sampler(L.Callback):
        def __init__(self, loader):
            self.loader = loader

        def on_train_epoch_end(self, trainer, pl_module):
            x, _ = next(iter(self.loader))
            pl_module.eval()
            with torch.no_grad():
                pl_module(x)
            pl_module.train()
            time.sleep(0.05)  # the image grid written out

    class Peek(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            # a look at the data, no model work (from the second epoch: before Lightning's
            # first fetch no framework drives steps yet)
            if trainer.current_epoch:
                next(iter(_loader(8)))

        def on_train_epoch_end(self, trainer, pl_module):
            next(iter(_loader(8)))

    tel = instrumented(integrations=("lightning",))
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[Peek(), Sampler(_loader(8))])
    trainer.fit(TinyModule(), _loader(24))
    steps = tel.steps()
    assert [s.mode for s in steps] == (["train"] * 3 + ["eval"]) * 2
    for s in steps:
        assert len(s.named("forward")) == 1 and len(s.named("dataloader_next")) == 1, (s.mode, s.top_level())
    for s in steps[3::4]:
        assert s.top_level()[0] == "dataloader_next" and s.duration >= 0.05, s.top_level()
    for s in steps[:3] + steps[4:7]:
        assert s.duration < 0.05

def test_lightning_gradient_accumulation_is_one_step_per_update(instrumented):
    """``accumulate_grad_batches=2``: Lightning runs the first batch's closure
    directly and the second inside ``optimizer.step(closure)``; the step is the
    update (Lightning's global_step), with two micro-batches and both fetches."""
    class Counting(TinyModule):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            time.sleep(0.005)

    tel = instrumented(integrations=("lightning",))
    trainer = _trainer(limit_val_batches=0, accumulate_grad_batches=2)
    trainer.fit(Counting(), _loader(48))
    tel.uninstrument()
    steps = tel.steps()
    assert trainer.global_step == 3
    assert [s.mode for s in steps] == ["train"] * 3, steps
    for s in steps:
        assert s.attributes["training.step.microbatches"] == 2
        # (the update's optimizer_step pauses while its closure runs forward/backward)
        assert len(s.named("dataloader_next")) == 2 and s.named("optimizer_step"), s
        assert len(s.named("forward")) == len(s.named("backward")) == 2, s
        assert len(s.named("callback.Counting.on_train_batch_end")) == 2, s
    summary = tel.runtime.summary_dict()
    assert summary["modes"]["train"]["microbatches"] == 6
    assert summary["self_check"] == []


SCRIPT = r"""
import os, time, torch, warnings, logging
warnings.filterwarnings("ignore")
torch.set_num_threads(1)
w = torch.nn.Linear(8, 2)   # warm-up: torch's one-time start-up before we measure
torch.nn.functional.cross_entropy(w(torch.randn(8, 8)), torch.randint(0, 2, (8,))).backward()
import otel_training
otel_training.instrument(configure_sdk=False)   # before lightning is imported
import lightning.pytorch as L
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
class Slow(L.Callback):
    def on_train_batch_end(self, *a):
        time.sleep(0.05)
class M(L.LightningModule):
    def __init__(self):
        super().__init__(); self.l = torch.nn.Linear(8, 2)
    def training_step(self, b, i):
        return torch.nn.functional.cross_entropy(self.l(b[0]), b[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), 0.1)
ds = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 2, (32,)))
m = M()
L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, callbacks=[Slow()],
          enable_progress_bar=False, enable_model_summary=False).fit(m, torch.utils.data.DataLoader(ds, batch_size=8))
"""


def test_lightning_imported_after_instrumentation(tmp_path):
    """The post-import hook arms the integration; the report names the callback."""
    summary, phases = run_script_for_summary(tmp_path, SCRIPT, OTEL_TRAINING_INTEGRATIONS="lightning")
    assert summary["modes"]["train"]["steps"] == 4
    # phases hold the timed steps: the FLOP-count step is counted as a step but left
    # out of the phase totals (flops.counted_step), so the callback is in each of the rest
    train = summary["modes"]["train"]
    assert train["timed_steps"] == 4 - ("counted_step" in train.get("flops", {}))
    assert phases["callback.Slow.on_train_batch_end"]["count"] == train["timed_steps"]
    out = subprocess.run([sys.executable, "-c", "import sys; from otel_training.cli.report import main; "
                          "sys.exit(main(sys.argv[1:]))", "--summary", str(tmp_path / "s.json")],
                         cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "callback.Slow.on_train_batch_end" in out.stdout
    assert "verdict: slow callback Slow: Slow.on_train_batch_end takes" in out.stdout
