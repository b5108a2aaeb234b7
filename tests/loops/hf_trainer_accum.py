# Shape: transformers Trainer usage — Trainer(model, TrainingArguments(..., gradient_accumulation_steps=2, eval_strategy="epoch"), train_dataset, eval_dataset, callbacks=[...]).train(); a tiny BERT built from a BertConfig (no download).
"""One training step per optimizer update (``state.global_step``), each with two
micro-batches; one eval step per evaluation batch. The Trainer fetches the two
micro-batches of a step up front (``get_batch_samples``) through accelerate's
``DataLoaderShard``, which itself reads one batch ahead. Counted from inside: a step
hook on the Trainer's torch optimizer, a gradient hook on one parameter (one call per
backward pass) and a forward pre-hook for the no-grad evaluation forwards. Planted: a
slow Dataset ``__getitem__`` for both sets (``dataloader_next``) and a slow
``on_step_end`` callback (``callback.SlowLogCallback.on_step_end``). The loop's wall
time is taken from ``on_train_begin`` to ``on_train_end``."""

import os
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments,
)

from _truth import EVAL, TRAIN, Truth  # noqa: E402

transformers.logging.set_verbosity_error()
torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
truth = Truth("hf_trainer_accum")
SAMPLE_DELAY_TRAIN, SAMPLE_DELAY_EVAL, CALLBACK_DELAY = 0.0075, 0.005, 0.020
backward_passes = [0]


class Examples(torch.utils.data.Dataset):
    def __init__(self, n, delay, mode):
        self.n, self.delay, self.mode = n, delay, mode

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        truth.sleep(self.mode, "dataloader_next", self.delay)  # e.g. tokenizing on the fly
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 64, (12,), generator=g),
                "attention_mask": torch.ones(12, dtype=torch.long), "labels": torch.tensor(i % 2)}


class SlowLogCallback(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        truth.sleep(TRAIN, "callback.SlowLogCallback.on_step_end", CALLBACK_DELAY)  # e.g. a metrics upload


class Counting(TrainerCallback):
    """The ground truth, from hooks: the loop's wall time, updates and backward passes."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        def updated(*_):
            truth.train_step(microbatches=backward_passes[0])
            backward_passes[0] = 0
        getattr(optimizer, "optimizer", optimizer).register_step_post_hook(updated)  # the torch optimizer
        truth.start()

    def on_train_end(self, args, state, control, **kwargs):
        truth.stop()


torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(
    vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
    max_position_embeddings=32, num_labels=2))
next(model.parameters()).register_post_accumulate_grad_hook(
    lambda p: backward_passes.__setitem__(0, backward_passes[0] + 1))
model.register_forward_pre_hook(lambda m, a: None if torch.is_grad_enabled() else truth.eval_step())

args = TrainingArguments(
    output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, per_device_eval_batch_size=8,
    gradient_accumulation_steps=2, num_train_epochs=2, report_to="none", eval_strategy="epoch",
    logging_steps=2, use_cpu=True)  # the defaults otherwise (progress bars, no worker processes)
trainer = Trainer(model=model, args=args, train_dataset=Examples(48, SAMPLE_DELAY_TRAIN, TRAIN),
                  eval_dataset=Examples(16, SAMPLE_DELAY_EVAL, EVAL), callbacks=[SlowLogCallback(), Counting()])
trainer.train()
assert truth.train_steps == trainer.state.global_step, (truth.train_steps, trainer.state.global_step)
assert backward_passes[0] == 0
truth.emit()
