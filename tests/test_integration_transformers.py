"""Hugging Face Trainer integration: optimizer-step steps, eval steps, callback timing.

A tiny BERT built from a config (no download) trains on a few synthetic examples on
CPU under the real instrumentor; a deliberately slow callback must be named.
"""

from __future__ import annotations

import os
import time
import warnings

import pytest

from tests.conftest import run_script_for_summary

pytest.importorskip("accelerate", reason="accelerate is not installed (the Trainer needs it)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import torch  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments,
)

from otel_training.aggregate.run_model import Run  # noqa: E402
from otel_training.diagnosis.verdict import diagnose  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", module="transformers")
SLOW_S = 0.05
SLOW = "callback.SlowLogCallback.on_step_end"


class SlowLogCallback(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(SLOW_S)  # e.g. a synchronous metrics upload


class QuickLogCallback(TrainerCallback):
    def __init__(self):
        self.logs = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs += 1


class Examples(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 64, (12,), generator=g),
                "attention_mask": torch.ones(12, dtype=torch.long), "labels": torch.tensor(i % 2)}


def _model():
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, num_labels=2))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: intra-op threads only add contention noise
    m = _model()  # warm-up: torch's one-time start-up is not the model's compute
    batch = torch.utils.data.default_collate([Examples(4)[i] for i in range(4)])
    m(**batch).loss.backward()
    yield
    torch.set_num_threads(threads)


def _trainer(tmp_path, callbacks, **kw):
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, per_device_eval_batch_size=8,
        gradient_accumulation_steps=2, num_train_epochs=1, report_to="none", save_strategy="no",
        eval_strategy="epoch", logging_steps=2, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, **kw)
    return Trainer(model=_model(), args=args, train_dataset=Examples(32), eval_dataset=Examples(16),
                   callbacks=callbacks)


def test_trainer_steps_phases_and_slow_callback(instrumented, tmp_path):
    tel = instrumented(integrations=("transformers",))
    quick = QuickLogCallback()
    trainer = _trainer(tmp_path, [SlowLogCallback(), quick])
    trainer.train()
    tel.flush()
    summary = tel.runtime.summary_dict()
    steps = [s for s in tel.steps() if s.names()]  # (an empty step: see the module docstring of
    train = [s for s in steps if s.mode == "train"]  # integrations/transformers.py)
    evals = [s for s in steps if s.mode == "eval"]
    assert trainer.state.global_step == 4
    assert len(train) == 4, steps  # one step per optimizer step (2 micro-batches each)
    assert len(evals) == 2, steps  # 16 eval examples / 8
    assert quick.logs >= 2

    for s in train:
        top = s.top_level()
        assert len(s.named("forward")) == 2 and len(s.named("backward")) == 2, s
        assert len(s.named("optimizer_step")) == 1 and "step_lr_schedulers" in top, s
        assert all(s.parent_of(f).name == "train_batch" for f in s.named("forward"))
        assert top.index("optimizer_step" if "optimizer_step" in top else "train_batch") < top.index(SLOW)
        assert s.total(SLOW) >= SLOW_S * 0.9
        assert s.attributes["training.batch_size"] == 8  # both micro-batches
        assert s.attributes["training.step.tokens"] == 8 * 12  # their attention masks' sums
        assert s.attributes["training.step.microbatches"] == 2  # gradient_accumulation_steps
    for s in train[1:]:  # the fetches (accelerate reads one batch ahead) are in the step
        assert s.top_level()[0] in ("to_device", "dataloader_next"), s
        assert len(s.named("dataloader_next")) == 2, s
    assert any("callback.QuickLogCallback.on_log" in s.names() for s in train)
    for s in evals:
        assert "eval_batch" in s.top_level() and "to_device" in s.top_level(), s
        assert not s.named("backward")
    callbacks = {n for s in steps for n in s.names() if n.startswith("callback.")}
    assert SLOW in callbacks
    assert not any(n.startswith("callback.TrainerCallback.") for n in callbacks)

    totals = tel.phase_totals(parent="step", mode="train")
    assert totals[SLOW] >= 4 * SLOW_S * 0.9
    # the slow callback outweighs every other phase but the model's compute, which a loaded
    # machine stretches past it (CI on torch 2.4 with both cores busy)
    assert max((k for k in totals if k != "train_batch"), key=totals.get) == SLOW, totals
    assert summary["modes"]["train"]["samples"] == 32  # every micro-batch counted
    assert summary["modes"]["train"]["tokens"] == 32 * 12
    assert summary["modes"]["train"]["microbatches"] == 8
    assert summary["self_check"] == []
    findings = diagnose(Run.from_dict(summary))
    assert findings[0].kind == "callback" and findings[0].title == "slow callback SlowLogCallback", findings

    tel.uninstrument()
    assert type(vars(Trainer)["get_batch_samples"]).__name__ == "function"
    assert "on_step_end" in vars(SlowLogCallback) and \
        type(vars(SlowLogCallback)["on_step_end"]).__name__ == "function"


def test_trainer_evaluate_alone(instrumented, tmp_path):
    tel = instrumented(integrations=("transformers",))
    trainer = _trainer(tmp_path, [])
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics
    steps = [s for s in tel.steps() if s.names()]
    assert [s.mode for s in steps] == ["eval", "eval"], steps
    assert all(len(s.named("forward")) == 1 for s in steps)


SCRIPT = r"""
import os, time, torch
torch.set_num_threads(1)
import otel_training
otel_training.instrument(configure_sdk=False)   # before transformers is imported
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments
class Upload(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        time.sleep(0.05)
class DS(torch.utils.data.Dataset):
    def __len__(self): return 16
    def __getitem__(self, i):
        return {"input_ids": torch.randint(0, 64, (8,)), "labels": torch.tensor(i % 2)}
model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
    num_attention_heads=2, intermediate_size=32, max_position_embeddings=16))
args = TrainingArguments(output_dir=os.environ["OUT_DIR"], per_device_train_batch_size=4, num_train_epochs=1,
    report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, logging_strategy="no")
Trainer(model=model, args=args, train_dataset=DS(), callbacks=[Upload()]).train()
"""


def test_transformers_imported_after_instrumentation(tmp_path):
    summary, phases = run_script_for_summary(
        tmp_path, SCRIPT, timeout=180, OUT_DIR=str(tmp_path / "out"), HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error", OTEL_TRAINING_INTEGRATIONS=None)  # default: all integrations
    assert summary["modes"]["train"]["steps"] == 4
    # phases hold the timed steps: the FLOP-count step is counted as a step but left
    # out of the phase totals (flops.counted_step), so the callback is in each of the rest
    train = summary["modes"]["train"]
    assert train["timed_steps"] == 4 - ("counted_step" in train.get("flops", {}))
    assert phases["callback.Upload.on_step_end"]["count"] == train["timed_steps"]
    assert diagnose(Run.from_dict(summary))[0].title == "slow callback Upload"
