# Shape: huggingface/transformers examples/run_glue.py (v2.x, before Trainer) — for step, batch in enumerate(train_dataloader): model.train(); forward; loss / gradient_accumulation_steps; backward; tr_loss += loss.item(); `if (step + 1) % gradient_accumulation_steps == 0:` clip, optimizer.step(), scheduler.step(), model.zero_grad(), and every logging_steps evaluate() (a nested eval DataLoader loop, model.eval() + no_grad per batch) and print the logs.
"""Gradient accumulation over a DataLoader: one training step per update with
``GRAD_ACCUM`` micro-batches (9 batches per epoch, an update every 3). ``evaluate()``
runs inside the training loop, right after an update, through its own DataLoader: one
eval step per batch. A tiny classifier returning ``(loss, logits)`` stands in for BERT.
Planted: slow Dataset ``__getitem__`` for both loaders (``dataloader_next``) and a slow
``eval_results.txt`` write at the end of each ``evaluate()``.

That write, the metrics before it and the log line after ``evaluate()`` run after the
eval DataLoader loop has ended and before the next training batch is fetched: by
docs/steps.md they lie between steps, in no step (``truth.sleep_outside()`` /
``timed(OUTSIDE)``; the summary's ``coverage.outside_s``). So does the train loader's
``StopIteration`` at the end of the first epoch (``truth.loop_end()``). The write is
kept short: 2 x 10 ms between steps in a loop of ~0.6 s (the third write comes after
the last step), a few percent of the loop, so that the self-check's ``low_coverage``
(under 90% of the loop inside steps) stays silent; with 40 ms it fired (~10%). Work
between loops of a tenth of the loop is worth the finding; a few percent is not."""

import json
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, RandomSampler, SequentialSampler

from _truth import EVAL, OUTSIDE, TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(42)
truth = Truth("glue_accum_dataloader")
GRAD_ACCUM, EPOCHS, LOGGING_STEPS, MAX_GRAD_NORM = 3, 2, 2, 1.0
SAMPLE_DELAY_TRAIN, SAMPLE_DELAY_EVAL, RESULTS_DELAY = 0.0035, 0.005, 0.010
output_dir = tempfile.mkdtemp()


class Features(Dataset):
    """Like the TensorDataset of cached features; __getitem__ sleeps like a lazy reader."""

    def __init__(self, n, delay, mode):
        g = torch.Generator().manual_seed(n)
        self.ids = torch.randint(1, 100, (n, 12), generator=g)
        self.mask = torch.ones(n, 12, dtype=torch.long)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        self.delay, self.mode = delay, mode

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        truth.sleep(self.mode, "dataloader_next", self.delay)
        return self.ids[i], self.mask[i], self.labels[i]


class TinyBert(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.classifier = nn.Linear(32, 2)

    def forward(self, input_ids, attention_mask, labels):
        m = attention_mask.unsqueeze(-1).float()
        logits = self.classifier((self.embed(input_ids) * m).sum(1) / m.sum(1))
        return F.cross_entropy(logits, labels), logits


def evaluate(model):
    eval_dataset = Features(16, SAMPLE_DELAY_EVAL, EVAL)
    eval_dataloader = DataLoader(eval_dataset, sampler=SequentialSampler(eval_dataset), batch_size=8)
    eval_loss, nb_eval_steps, correct = 0.0, 0, 0
    for batch in eval_dataloader:
        model.eval()
        with torch.no_grad():
            inputs = {"input_ids": batch[0], "attention_mask": batch[1], "labels": batch[2]}
            tmp_eval_loss, logits = model(**inputs)
            eval_loss += tmp_eval_loss.mean().item()
        nb_eval_steps += 1
        correct += (logits.argmax(-1) == inputs["labels"]).sum().item()
        truth.eval_step()
    truth.loop_end()  # from here to the next training batch's fetch: between steps
    with truth.timed(OUTSIDE, "outside"):
        result = {"acc": correct / len(eval_dataset), "loss": eval_loss / nb_eval_steps}
        with open(os.path.join(output_dir, "eval_results.txt"), "w") as writer:
            truth.sleep_outside(RESULTS_DELAY)  # a slow network file system
            for key in sorted(result):
                writer.write(f"{key} = {result[key]}\n")
    return result


train_dataset = Features(36, SAMPLE_DELAY_TRAIN, TRAIN)
train_dataloader = DataLoader(train_dataset, sampler=RandomSampler(train_dataset), batch_size=4)
model = TinyBert()
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, eps=1e-8)
t_total = len(train_dataloader) // GRAD_ACCUM * EPOCHS
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, (t_total - s) / t_total))

global_step = 0
tr_loss, logging_loss = 0.0, 0.0
backward_passes = 0
model.zero_grad()
truth.start()
for _ in range(EPOCHS):
    for step, batch in enumerate(train_dataloader):
        model.train()
        inputs = {"input_ids": batch[0], "attention_mask": batch[1], "labels": batch[2]}
        outputs = model(**inputs)
        loss = outputs[0]
        if GRAD_ACCUM > 1:
            loss = loss / GRAD_ACCUM
        loss.backward()
        backward_passes += 1
        tr_loss += loss.item()
        if (step + 1) % GRAD_ACCUM == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            scheduler.step()
            model.zero_grad()
            global_step += 1
            truth.train_step(microbatches=backward_passes)
            backward_passes = 0
            if LOGGING_STEPS > 0 and global_step % LOGGING_STEPS == 0:
                logs = {f"eval_{k}": v for k, v in evaluate(model).items()}
                with truth.timed(OUTSIDE, "outside"):  # after the eval loop ended: between steps
                    logs["learning_rate"] = scheduler.get_last_lr()[0]
                    logs["loss"] = (tr_loss - logging_loss) / LOGGING_STEPS
                    logging_loss = tr_loss
                    print(json.dumps({**logs, **{"step": global_step}}))
    truth.loop_end()
truth.stop()
truth.emit()
