"""An HF Trainer run with ``save_steps`` that fails after a checkpoint
(``--fail-at``), then, run again (``--resume``), resumes from its last checkpoint
(``resume_from_checkpoint=True``) and finishes. No otel-training import.

Each train step sleeps ``--step-ms`` in a callback. Writes its own clock to
``<dir>/clock-<attempt>.json``: when each global step ended and each save ended
(wall-clock seconds), and the failure."""

import argparse
import json
import os
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--max-steps", type=int, default=12)
p.add_argument("--save-steps", type=int, default=4)
p.add_argument("--fail-at", type=int, default=0)
p.add_argument("--step-ms", type=float, default=150.0)
p.add_argument("--resume", action="store_true")
args = p.parse_args()
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore")
attempt = 1 if args.resume else 0
clock = {"step_end": {}, "save_end": {}}


def save_clock():
    with open(os.path.join(args.dir, f"clock-{attempt}.json"), "w") as fh:
        json.dump(clock, fh)


class Examples(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 64, (12,), generator=g),
                "attention_mask": torch.ones(12, dtype=torch.long), "labels": torch.tensor(i % 2)}


class Planted(TrainerCallback):
    def on_step_end(self, a, state, control, **kw):
        time.sleep(args.step_ms / 1e3)
        clock["step_end"][state.global_step] = time.time()
        if args.fail_at and state.global_step == args.fail_at:
            clock["failed"] = time.time()
            save_clock()
            raise RuntimeError(f"planted failure at global step {state.global_step}")

    def on_save(self, a, state, control, **kw):
        clock["save_end"][state.global_step] = time.time()


torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(
    vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
    max_position_embeddings=32, num_labels=2))
targs = TrainingArguments(
    output_dir=os.path.join(args.dir, "out"), per_device_train_batch_size=4, max_steps=args.max_steps,
    report_to="none", save_strategy="steps", save_steps=args.save_steps, use_cpu=True, disable_tqdm=True,
    dataloader_num_workers=0, logging_strategy="no")
Trainer(model=model, args=targs, train_dataset=Examples(), callbacks=[Planted()]).train(
    resume_from_checkpoint=True if args.resume else None)
clock["end"] = time.time()
save_clock()
