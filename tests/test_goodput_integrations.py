"""Checkpoint time found without code changes in framework runs: the HF ``Trainer``
with ``save_steps`` and Lightning with ``ModelCheckpoint``. Each framework's own save
is timed by a wrapper of the test's (the truth) under ours; the summary's ``job``
section must hold those saves, as checkpoint time, once each."""

from __future__ import annotations

import logging
import os
import time
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOLERANCE = 0.15
SLACK_S = 0.02  # our wrapper around the test's: its own bookkeeping


class Clocked:
    """Wraps ``owner.name`` with a timer: the framework's save as the test sees it."""

    def __init__(self, monkeypatch, owner, name):
        self.calls: list[float] = []
        original = getattr(owner, name)
        clocked = self

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                clocked.calls.append(time.perf_counter() - t0)

        monkeypatch.setattr(owner, name, timed)


def _check(job: dict, label: str, truth: Clocked) -> None:
    ckpt = job["checkpoint"]
    calls = {c["name"]: c for c in ckpt["calls"]}
    assert truth.calls, "the framework saved no checkpoint"
    assert label in calls and calls[label]["count"] == len(truth.calls), (calls, len(truth.calls))
    want = sum(truth.calls)
    got = calls[label]["total_s"]
    assert want <= got + 1e-4 and got <= want * (1 + TOLERANCE) + SLACK_S * len(truth.calls), (got, want)
    assert job["activities"]["checkpoint"] >= want


def test_hf_trainer_checkpoints_are_found(instrumented, tmp_path, monkeypatch):
    pytest.importorskip("accelerate", reason="accelerate is not installed (the Trainer needs it)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")

    class Examples(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"input_ids": torch.randint(0, 64, (12,), generator=g),
                    "attention_mask": torch.ones(12, dtype=torch.long), "labels": torch.tensor(i % 2)}

    truth = Clocked(monkeypatch, Trainer, "_save_checkpoint")
    tel = instrumented(integrations=("transformers",))
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, num_labels=2))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=1, report_to="none",
        save_strategy="steps", save_steps=2, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    Trainer(model=model, args=args, train_dataset=Examples()).train()
    tel.uninstrument()
    summary = tel.runtime.summary_dict()
    assert summary["modes"]["train"]["steps"] == 8
    _check(summary["job"], "transformers.Trainer checkpoint", truth)
    assert len(truth.calls) == 4
    assert summary["self_check"] == []


def test_lightning_model_checkpoint_is_found(instrumented, tmp_path, monkeypatch):
    L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_save_checkpoint(self, checkpoint):
            time.sleep(0.05)  # a slow filesystem under the save

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 2, (64,), generator=g))
    truth = Clocked(monkeypatch, L.Trainer, "save_checkpoint")
    tel = instrumented(integrations=("lightning",))
    trainer = L.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path),
        callbacks=[L.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1)])
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))
    tel.uninstrument()
    summary = tel.runtime.summary_dict()
    assert summary["modes"]["train"]["steps"] == 8
    _check(summary["job"], "lightning.Trainer.save_checkpoint", truth)
    assert len(truth.calls) >= 4
    assert summary["job"]["activities"]["checkpoint"] >= 0.05 * len(truth.calls)
