# Shape: huggingface/accelerate examples/by_feature/gradient_accumulation.py — Accelerator(gradient_accumulation_steps=2); `with accelerator.accumulate(model):` forward, accelerator.backward, optimizer.step(), lr_scheduler.step(), optimizer.zero_grad() on every batch; then a no_grad eval loop with gather_for_metrics.
"""``optimizer.step()`` is called on every batch, but accelerate skips it (and the
scheduler step) except on every second batch and on the last batch of the loader
(``sync_with_dataloader``): with 15 batches an epoch has 7 updates of two micro-batches
and a last one of one. The real updates are counted with a step hook on the wrapped
torch optimizer. Planted: a slow ``collate_fn`` (``dataloader_next``) for both loaders."""

import torch
from accelerate import Accelerator
from torch.optim import AdamW
from torch.utils.data import DataLoader

from _text import TinySequenceClassifier, linear_schedule_with_warmup, make_collate, tokenized
from _truth import EVAL, TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
truth = Truth("accelerate_accumulate")
COLLATE_DELAY_TRAIN, COLLATE_DELAY_EVAL = 0.022, 0.035


def training_function(config, gradient_accumulation_steps):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=gradient_accumulation_steps)
    torch.manual_seed(config["seed"])
    train_dataloader = DataLoader(tokenized(60, 0), shuffle=True, batch_size=config["batch_size"], drop_last=True,
                                  collate_fn=make_collate(truth, TRAIN, COLLATE_DELAY_TRAIN))
    eval_dataloader = DataLoader(tokenized(24, 1), shuffle=False, batch_size=8,
                                 collate_fn=make_collate(truth, EVAL, COLLATE_DELAY_EVAL))
    model = TinySequenceClassifier().to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=config["lr"])
    lr_scheduler = linear_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=2,
                                               num_training_steps=len(train_dataloader) * config["num_epochs"])
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    pending = [0]  # backward passes since the last real update
    optimizer.optimizer.register_step_post_hook(
        lambda *_: (truth.train_step(microbatches=pending[0]), pending.__setitem__(0, 0)))

    truth.start()
    for epoch in range(config["num_epochs"]):
        model.train()
        for step, batch in enumerate(train_dataloader):
            with accelerator.accumulate(model):
                output = model(**batch)
                loss = output.loss
                accelerator.backward(loss)
                pending[0] += 1
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        assert pending[0] == 0, "the loader's end forces an update"

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


training_function({"lr": 2e-3, "num_epochs": 2, "seed": 42, "batch_size": 4}, gradient_accumulation_steps=2)
truth.emit()
