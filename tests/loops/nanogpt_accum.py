# Shape: karpathy/nanoGPT train.py — no DataLoader (get_batch), estimate_loss() under no_grad every eval_interval, gradient_accumulation_steps micro-steps with the next batch fetched between forward and backward, GradScaler (disabled on CPU), clip, step, zero_grad, log.
"""One training step per optimizer update, each with ``GRAD_ACCUM`` micro-batches;
``estimate_loss()`` gives ``eval_iters`` eval steps per split. As in the original the
loop runs ``max_iters + 1`` iterations (it breaks when ``iter_num > max_iters``) and
also evaluates at ``iter_num == max_iters``. Planted: a slow log line after every
update (``untracked``) and, as in the original, a checkpoint after each evaluation.

``LOOPS_DEVICE=cuda`` runs it as the original runs on a GPU (tests/test_gpu_loops.py):
a GPT-2-small-width model, bf16 autocast, fused AdamW, pinned ``non_blocking`` batches,
``LOOPS_COMPILE=1`` for ``torch.compile``; the TRUTH notes then carry nanoGPT's analytic
FLOPs per iteration (``estimate_mfu``'s numerator) and its running MFU."""

import math
import os
import tempfile
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.nn import functional as F

from _truth import TRAIN, Truth

device = os.environ.get("LOOPS_DEVICE", "cpu")
device_type = "cuda" if "cuda" in device else "cpu"
if device_type == "cpu":
    torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(1337)
truth = Truth("nanogpt_accum")

out_dir = tempfile.mkdtemp()
eval_interval, eval_iters, log_interval = 6, 3, 1
always_save_checkpoint = True
gradient_accumulation_steps = 4
batch_size, block_size = 4, 16
n_layer, n_head, n_embd, vocab_size, dropout = 1, 2, 32, 64, 0.0
learning_rate, max_iters, weight_decay, beta1, beta2, grad_clip = 1e-3, 12, 1e-1, 0.9, 0.95, 1.0
decay_lr, warmup_iters, lr_decay_iters, min_lr = True, 2, 12, 1e-4
dtype = "float32"
compile = os.environ.get("LOOPS_COMPILE") == "1"
if device_type == "cuda":  # GPT-2 small's width, 6 layers: phases of milliseconds on an H100
    gradient_accumulation_steps, batch_size, block_size = 2, 8, 256
    n_layer, n_head, n_embd, vocab_size = 6, 12, 768, 50304
    max_iters, lr_decay_iters = 24, 24
    dtype = "bfloat16"
LOG_DELAY = 0.025
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=torch.bfloat16)

# poor man's data loader over an in-memory "token file" (the original memory-maps train.bin / val.bin)
data = {"train": torch.randint(vocab_size, (max(4096, 64 * block_size),)),
        "val": torch.randint(vocab_size, (max(1024, 16 * block_size),))}


def get_batch(split):
    d = data[split]
    ix = torch.randint(len(d) - block_size, (batch_size,))
    x = torch.stack([d[i:i + block_size] for i in ix])
    y = torch.stack([d[i + 1:i + 1 + block_size] for i in ix])
    if device_type == "cuda":
        # pin arrays x,y, which allows us to move them to GPU asynchronously (non_blocking=True)
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    else:
        x, y = x.to(device), y.to(device)
    return x, y


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.attn(self.ln_1(x)).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # https://paperswithcode.com/method/weight-tying

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)) if targets is not None else None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        nodecay = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": nodecay, "weight_decay": 0.0}]
        extra_args = dict(fused=True) if device_type == "cuda" else dict()
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra_args)

    def flops_per_iter(self, fwdbwd_per_iter):
        """``estimate_mfu``'s numerator: N without the position embeddings, 6N + 12LHQT
        FLOPs per token (PaLM, Appendix B)."""
        N = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        L, H, Q, T = n_layer, n_head, n_embd // n_head, block_size
        return (6 * N + 12 * L * H * Q * T) * T * fwdbwd_per_iter


iter_num = 0
best_val_loss = 1e9
model = GPT().to(device)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
raw_model = model
if compile:
    model = torch.compile(model)
flops_per_iter = raw_model.flops_per_iter(batch_size * gradient_accumulation_steps)
running_dt = []  # nanoGPT's running MFU skips its first 5 iterations (compilation, warm-up)
train_s = []  # not in the original: each iteration's training part (no evaluation), from the second on


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
            truth.eval_step()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


truth.start()
X, Y = get_batch("train")  # fetch the very first batch
t0 = time.time()
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses["val"]
            if iter_num > 0:
                # the save lands in the next train step's untracked time: timed by the
                # script's clock (a loaded machine makes it tens of milliseconds)
                with truth.timed(TRAIN, "untracked"):
                    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                  "iter_num": iter_num, "best_val_loss": best_val_loss}
                    torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))

    t_train = time.perf_counter()
    for micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")  # prefetch the next batch while the forward runs (on a GPU)
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    truth.train_step(microbatches=gradient_accumulation_steps)

    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if iter_num % log_interval == 0:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")
        if iter_num >= 5 and iter_num % eval_interval:  # iterations without an evaluation in dt
            running_dt.append(dt)
        truth.sleep(TRAIN, "untracked", LOG_DELAY)  # e.g. a synchronous wandb.log
    if iter_num >= 1:
        train_s.append(time.perf_counter() - t_train)
    iter_num += 1
    if iter_num > max_iters:
        break
truth.stop()
truth.notes.update(device=device, compile=compile, dtype=dtype, flops_per_iter=flops_per_iter,
                   mean_iter_s=sum(running_dt) / len(running_dt) if running_dt else None,
                   train_iter_s=sum(train_s) / len(train_s) if train_s else None)
truth.emit()
