# Shape: huggingface/accelerate examples/nlp_example.py — accelerator.prepare(model, optimizer, train_dl, eval_dl, lr_scheduler); per epoch: train loop with loss / gradient_accumulation_steps, accelerator.backward, `if step % gradient_accumulation_steps == 0: optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()`; then a no_grad eval loop with gather_for_metrics.
"""The "no trainer" loop of accelerate with its own accumulation test
``step % gradient_accumulation_steps == 0``: with 2 it updates after batch 0 (one
micro-batch), then after every second batch (two). 15 batches per epoch make the last
batch of each epoch an update, so no gradient is carried across epochs. The prepared
loader is accelerate's ``DataLoaderShard``, which fetches one batch ahead. A tiny
classifier stands in for bert-base-cased (no download). Planted: a slow
``collate_fn`` for both loaders (``dataloader_next``)."""

import torch
from accelerate import Accelerator
from torch.optim import AdamW
from torch.utils.data import DataLoader

from _text import TinySequenceClassifier, linear_schedule_with_warmup, make_collate, tokenized
from _truth import EVAL, TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
truth = Truth("accelerate_nlp")
COLLATE_DELAY_TRAIN, COLLATE_DELAY_EVAL = 0.022, 0.035


def get_dataloaders(batch_size, eval_batch_size):
    train_dataloader = DataLoader(tokenized(60, 0), shuffle=True, batch_size=batch_size, drop_last=True,
                                  collate_fn=make_collate(truth, TRAIN, COLLATE_DELAY_TRAIN))
    eval_dataloader = DataLoader(tokenized(24, 1), shuffle=False, batch_size=eval_batch_size,
                                 collate_fn=make_collate(truth, EVAL, COLLATE_DELAY_EVAL))
    return train_dataloader, eval_dataloader


def training_function(config):
    accelerator = Accelerator(cpu=True)
    lr, num_epochs, batch_size = config["lr"], config["num_epochs"], config["batch_size"]
    gradient_accumulation_steps = config["gradient_accumulation_steps"]
    torch.manual_seed(config["seed"])
    train_dataloader, eval_dataloader = get_dataloaders(batch_size, 8)
    model = TinySequenceClassifier().to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = linear_schedule_with_warmup(
        optimizer=optimizer, num_warmup_steps=2,
        num_training_steps=(len(train_dataloader) * num_epochs) // gradient_accumulation_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    backward_since_update = 0
    truth.start()
    for epoch in range(num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            # (batch.to(accelerator.device) in the original: a no-op with device_placement=True)
            outputs = model(**batch)
            loss = outputs.loss
            loss = loss / gradient_accumulation_steps
            accelerator.backward(loss)
            backward_since_update += 1
            if step % gradient_accumulation_steps == 0:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                truth.train_step(microbatches=backward_since_update)
                backward_since_update = 0
        assert backward_since_update == 0, "the epoch must end on an update"

        model.eval()
        correct = total = 0
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += (predictions == references).sum().item()
            total += references.numel()
            truth.eval_step()
        accelerator.print(f"epoch {epoch}:", {"accuracy": correct / total})
    truth.stop()
    accelerator.end_training()


training_function({"lr": 2e-3, "num_epochs": 2, "seed": 42, "batch_size": 4, "gradient_accumulation_steps": 2})
truth.emit()
