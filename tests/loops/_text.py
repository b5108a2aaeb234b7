"""Small shared pieces for the accelerate-shaped scripts: a synthetic "tokenized" text
classification set, a padding ``collate_fn`` (with a planted delay, like
``tokenizer.pad``) and a tiny sequence classifier whose forward takes the batch as
keywords and returns ``.loss`` / ``.logits`` the way a Transformers model does."""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 100


def tokenized(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(5, 16, (1,), generator=g))
        out.append({"input_ids": torch.randint(1, VOCAB, (length,), generator=g).tolist(), "labels": i % 2})
    return out


def make_collate(truth, mode, delay):
    def collate_fn(examples):
        truth.sleep(mode, "dataloader_next", delay)  # like tokenizer.pad(..., return_tensors="pt")
        width = max(len(e["input_ids"]) for e in examples)
        ids = torch.zeros(len(examples), width, dtype=torch.long)
        mask = torch.zeros(len(examples), width, dtype=torch.long)
        for row, e in enumerate(examples):
            ids[row, :len(e["input_ids"])] = torch.tensor(e["input_ids"])
            mask[row, :len(e["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask,
                "labels": torch.tensor([e["labels"] for e in examples])}
    return collate_fn


class TinySequenceClassifier(nn.Module):
    def __init__(self, dim=32, num_labels=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.encoder = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.classifier = nn.Linear(dim, num_labels)

    def forward(self, input_ids, attention_mask, labels=None):
        h = self.encoder(self.embed(input_ids))
        m = attention_mask.unsqueeze(-1).float()
        logits = self.classifier((h * m).sum(1) / m.sum(1))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return SimpleNamespace(loss=loss, logits=logits)


def linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps):
    """What transformers.get_linear_schedule_with_warmup does, without importing it."""
    def lr_lambda(step):
        if step < num_warmup_steps:
            return float(step) / float(max(1, num_warmup_steps))
        return max(0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
