# Shape: pytorch/torchtitan torchtitan/trainer.py (b5bcd76) — Trainer.train(): data_iterator = self.batch_generator(self.dataloader) (a generator over the DataLoader), per step gc_handler.run(step) (gc disabled, gc.collect every gc_freq steps), train_step(): optimizers.zero_grad(), next(data_iterator) for every gradient-accumulation microbatch up front, then per microbatch forward_backward_step() (post_dataloading_process, model, sum cross-entropy / global_valid_tokens, loss.backward()), clip_grad_norm_, optimizers.step() (OptimizersContainer: itself a torch Optimizer, stepping an Adam and an AdamW), lr_schedulers.step() (one LambdaLR per optimizer), at log steps loss.item() / grad_norm.item() + MetricsProcessor.log(); checkpointer.save(); validator.validate() at step 1 and every freq steps (a fresh finite DataLoader read with next() through iterate_and_close_dataloader until StopIteration, no_grad, model.eval()), log_validation.
"""torchtitan's trainer, download-free, single process, on CPU.

Read from pytorch/torchtitan at b5bcd76c66d0acb1a08b176d9639425bc55e0b2a:
``torchtitan/trainer.py`` (``Trainer.train``, ``train_step``, ``batch_generator``,
``forward_backward_step``, ``_forward_backward_body``, ``post_dataloading_process``),
``torchtitan/components/optimizer/optimizer.py`` (``OptimizersContainer``: an
``Optimizer`` subclass holding one torch optimizer per optimizer type and model part,
``Optimizer.__init__(self, all_params, {})`` in ``_post_init`` so hooks work, ``step()``
steps each inner optimizer), ``components/optimizer/lr_scheduler.py``
(``LRSchedulersContainer``: a ``LambdaLR`` per optimizer, warmup-stable-decay),
``tools/utils.py`` (``GarbageCollection``: ``gc.disable()``, ``gc.collect(1)`` when
``step % gc_freq == 0``), ``components/metrics.py`` (``should_log``: step 1 and every
``log_freq``; ``log``/``log_validation``), ``components/checkpointer/dcp.py``
(``_should_save``: every ``interval`` and the last step, model-only at the last step,
a GC collection after a synchronous save), ``components/validate.py`` (``Validator``:
``should_validate`` at step 1 and every ``freq``; a fresh validation dataloader per call,
``next()`` through ``iterate_and_close_dataloader`` until ``StopIteration`` with
``steps=-1``) and ``components/loss.py`` (sum cross-entropy divided by the global
valid-token count). The data path is the last torch-DataLoader one, from c537bca68d96
(the parent of 1b04fc1c3, which replaced it with Grain): ``ParallelAwareDataloader``
(a ``StatefulDataLoader``, i.e. a ``torch.utils.data.DataLoader``; num_workers=0 by
default) over ``HuggingFaceTextDataset`` (an ``IterableDataset`` that tokenizes
documents and packs them into ``seq_len`` samples; the training one loops forever,
re-looping with a new epoch; the validation one is finite).

Truth (docs/steps.md): one training step per ``optimizers.step()`` (the container and
the two optimizers it steps count once), with ``gradient_accumulation_steps`` = 3
backward passes (the micro-batches, all fetched at the top of ``train_step``); one eval
step per validation batch.

Planted: a slow streaming read of each document in both datasets
(``dataloader_next``: a train step reads ~8 documents over its 3 fetches, an eval step
4); a slow metrics logger (W&B-like) at log steps and a slow checkpoint write at save
steps (train ``untracked``, with the logging / saving code timed); ``gc.collect`` and
the ``zero_grad`` at the top of the next step are timed as the previous step's tail.
After a validation loop's ``StopIteration`` the validation log line, ``model.train()``
and the next iteration's top (gc, ``zero_grad``) lie between steps (docs/steps.md rule
5: ``truth.loop_end()``, ``timed(OUTSIDE)`` / ``sleep_outside()``).

Not in the original: no torch.distributed (single process: the dist reductions, the
2-second rank-0 sleep at the end and pg timeouts are skipped, as they are where
``parallel_dims`` has no mesh), ``torch.utils.data.DataLoader`` in place of torchdata's
``StatefulDataLoader`` (its subclass), a char-level tokenizer, a tiny Llama-like model
built on the meta device then ``to_empty`` + ``init_weights`` as torchtitan does,
``implementation="foreach"`` (torchtitan's default ``fused`` is the CUDA path), a
checkpoint written with ``torch.save`` rather than DCP, no-op structured logger and
profiler (both disabled by default), no config system."""

import gc
import logging
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from functools import partial
from typing import Generic, TypeVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from _truth import BEFORE, EVAL, OUTSIDE, TRAIN, Truth
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, IterableDataset

REQUIRES_TORCH = "2.6"  # torch.nn.utils.get_total_norm, as torchtitan calls it (test_loops.py skips below)
torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
truth = Truth("torchtitan_train")

STEPS, GRAD_ACCUM, LOCAL_BATCH, SEQ_LEN = 15, 3, 4, 32
LOG_FREQ, CKPT_INTERVAL, VAL_FREQ, GC_FREQ, WARMUP = 3, 4, 5, 3, 3
N_TRAIN_DOCS, N_VAL_DOCS = 48, 16  # the validation set: 4 batches of 4 one-sample documents
READ_DELAY_TRAIN, READ_DELAY_VAL = 0.002, 0.002  # per document (a streaming read)
TRAIN_LOG_DELAY, VAL_LOG_DELAY, SAVE_DELAY = 0.020, 0.012, 0.015
IGNORE_INDEX = -100
dump_folder = tempfile.mkdtemp()

logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="[titan] %(message)s")
logger = logging.getLogger("torchtitan")


# -- torchtitan.observability.structured_logger (disabled by default: no-ops) ------------
class sl:  # noqa: N801
    @staticmethod
    def log_trace_span(name):
        return nullcontext()

    @staticmethod
    def log_trace_scalar(d):
        pass

    @staticmethod
    def set_step(step, relative_step=None):
        pass

    @staticmethod
    def add_step_tag(tag):
        pass


# -- torchtitan.tools.utils.GarbageCollection --------------------------------------------
class GarbageCollection:
    def __init__(self, gc_freq: int = 1000, debug: bool = False):
        assert gc_freq > 0, "gc_freq must be a positive integer"
        self.gc_freq = gc_freq
        self.debug = debug
        gc.disable()
        self.collect("Initial GC collection")

    def run(self, step_count: int) -> bool:
        if self.debug:
            self.collect("Force GC to perform collection to obtain debug information", generation=2)
            gc.collect()
            return True
        if step_count > 1 and step_count % self.gc_freq == 0:
            self.collect("Performing periodic GC collection")
            return True
        return False

    @staticmethod
    def collect(reason: str, generation: int = 1):
        begin = time.monotonic()
        gc.collect(generation)
        logger.info("[GC] %s took %.2f seconds", reason, time.monotonic() - begin)


# -- torchtitan.distributed (no process group: every mesh is absent) ---------------------
class ParallelDims:
    dp_enabled = pp_enabled = cp_enabled = dp_cp_enabled = ep_enabled = False
    non_data_parallel_size = 1

    def get_optional_mesh(self, name):
        return None


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None,
                    pp_mesh=None, ep_enabled=False):
    """torchtitan.distributed.utils.clip_grad_norm_, the non-EP, non-PP path."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, foreach)
    return total_norm


# -- data: tokenizer, HuggingFaceTextDataset, ParallelAwareDataloader ---------------------
class CharTokenizer:
    """Stands in for the HuggingFace tokenizer: bos=1, eos=2, characters from 3."""

    bos_id, eos_id, vocab_size = 1, 2, 64

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list:
        ids = [3 + (ord(c) % (self.vocab_size - 3)) for c in text]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])


class StreamingShards:
    """An iterable-style (streaming) dataset source: each document is read from remote
    storage as it is iterated (the planted delay); ``set_epoch`` reshuffles."""

    def __init__(self, texts: list, mode: str, delay: float):
        self.texts, self.mode, self.delay = texts, mode, delay
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = list(range(len(self.texts)))
        if self.epoch:
            random.Random(1000 + self.epoch).shuffle(order)
        for i in order:
            truth.sleep(self.mode, "dataloader_next", self.delay)  # a slow object-store read
            yield {"text": self.texts[i]}

    def state_dict(self):
        return {"epoch": self.epoch}


def _process_c4_text(sample: dict) -> str:
    return sample["text"]


def _synthetic_texts(n: int, seed: int, fixed_len: int | None = None) -> list:
    g = torch.Generator().manual_seed(seed)
    words = ["the", "model", "token", "layer", "train", "data", "shard", "titan", "loss", "grad"]
    out = []
    for _ in range(n):
        length = fixed_len if fixed_len is not None else int(torch.randint(20, 71, (1,), generator=g))
        text = ""
        while len(text) < length:
            text += words[int(torch.randint(len(words), (1,), generator=g))] + " "
        out.append(text[:length])
    return out


DATASETS = {
    "c4_test": (lambda: StreamingShards(_synthetic_texts(N_TRAIN_DOCS, 1), TRAIN, READ_DELAY_TRAIN)),
    # Validation documents of seq_len + 1 tokens with bos/eos: one packed sample each, so
    # the final fetch (the StopIteration) reads no document.
    "c4_validation": (lambda: StreamingShards(_synthetic_texts(N_VAL_DOCS, 2, fixed_len=SEQ_LEN - 1), EVAL,
                                              READ_DELAY_VAL)),
}


class HuggingFaceTextDataset(IterableDataset):
    def __init__(self, dataset_name: str, tokenizer: CharTokenizer, seq_len: int = 2048, dp_rank: int = 0,
                 dp_world_size: int = 1, infinite: bool = False) -> None:
        dataset_name = dataset_name.lower()
        ds = DATASETS[dataset_name]()
        self.dataset_name = dataset_name
        self._original_data = ds  # split_dataset_by_node(ds, 0, 1) is the dataset itself
        self._data = self._original_data
        self._tokenizer = tokenizer
        self.seq_len = seq_len
        self.infinite = infinite
        self._text_processor = _process_c4_text
        self._sample_idx = 0
        self._epoch = 0
        self._inputs_buffer: list = []
        self._labels_buffer: list = []
        self._positions_buffer: list = []

    def _get_data_iter(self):
        return iter(self._data)

    def _normalize_positions(self, positions: list) -> list:
        offset = positions[0]
        if offset > 0:
            for i, p in enumerate(positions):
                if p == 0:
                    break
                positions[i] = p - offset
        return positions

    def __iter__(self):
        while True:
            for sample in self._get_data_iter():
                sample_text = self._text_processor(sample)
                sample_tokens = self._tokenizer.encode(sample_text, add_bos=True, add_eos=True)
                self._inputs_buffer.extend(sample_tokens[:-1])
                self._labels_buffer.extend(sample_tokens[1:])
                self._positions_buffer.extend(range(len(sample_tokens) - 1))
                self._sample_idx += 1

                while len(self._inputs_buffer) >= self.seq_len:
                    input_ids = torch.LongTensor(self._inputs_buffer[: self.seq_len])
                    label_ids = torch.LongTensor(self._labels_buffer[: self.seq_len])
                    positions = torch.LongTensor(self._normalize_positions(self._positions_buffer[: self.seq_len]))
                    self._inputs_buffer = self._inputs_buffer[self.seq_len:]
                    self._labels_buffer = self._labels_buffer[self.seq_len:]
                    self._positions_buffer = self._positions_buffer[self.seq_len:]
                    yield {"input": input_ids, "positions": positions}, label_ids

            if not self.infinite:
                logger.warning(f"Dataset {self.dataset_name} has run out of data")
                break
            self.reloop()

    def reloop(self) -> None:
        self._sample_idx = 0
        self._epoch += 1
        if hasattr(self._data, "set_epoch") and hasattr(self._data, "epoch"):
            self._data.set_epoch(self._data.epoch + 1)
        logger.warning(f"Dataset {self.dataset_name} is being re-looped (epoch {self._epoch})")

    def state_dict(self):
        return {"inputs_buffer": self._inputs_buffer, "labels_buffer": self._labels_buffer,
                "positions_buffer": self._positions_buffer, "data": self._data.state_dict()}


class BaseDataLoader:
    def close(self) -> None:
        pass


class ParallelAwareDataloader(DataLoader, BaseDataLoader):
    """torchtitan's ParallelAwareDataloader; its base, torchdata's StatefulDataLoader,
    is a torch DataLoader (here the DataLoader itself)."""

    def __init__(self, dataset: IterableDataset, dp_rank: int, dp_world_size: int, **kwargs):
        self.dp_world_size = dp_world_size
        self.dp_rank = dp_rank
        self._rank_id = f"dp_rank_{dp_rank}"
        super().__init__(dataset, **kwargs)

    def state_dict(self) -> dict:
        return {self._rank_id: self.dataset.state_dict(), "world_size": self.dp_world_size}


def build_text_dataloader(dataset: str, infinite: bool, *, dp_world_size: int, dp_rank: int, tokenizer,
                          seq_len: int, local_batch_size: int) -> ParallelAwareDataloader:
    """HuggingFaceTextDataLoader.__init__ (num_workers=0: torchtitan's default)."""
    hf_ds = HuggingFaceTextDataset(dataset_name=dataset, tokenizer=tokenizer, seq_len=seq_len, dp_rank=dp_rank,
                                   dp_world_size=dp_world_size, infinite=infinite)
    return ParallelAwareDataloader(hf_ds, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                   batch_size=local_batch_size, num_workers=0)


# -- the model: a tiny Llama-style decoder -------------------------------------------------
class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q, k, v = (w(x).view(B, S, self.n_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, S, -1))


def _rope(x, cos, sin):  # cos/sin: [B, S, 1, head_dim / 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, hidden):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention, self.feed_forward = Attention(dim, n_heads), FeedForward(dim, hidden)
        self.moe_enabled = False

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(self, vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden=64, max_seq_len=SEQ_LEN):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, n_heads, hidden) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.head_dim, self.max_seq_len = dim // n_heads, max_seq_len
        self.register_buffer("rope_cache", torch.empty(max_seq_len, self.head_dim), persistent=False)

    def init_weights(self, buffer_device=None):
        half = self.head_dim // 2
        freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float32), freqs)
        self.rope_cache.copy_(torch.cat([angles.cos(), angles.sin()], dim=-1))
        nn.init.normal_(self.tok_embeddings.weight)
        for block in self.layers.values():
            for lin in (block.attention.wq, block.attention.wk, block.attention.wv, block.attention.wo,
                        block.feed_forward.w1, block.feed_forward.w2, block.feed_forward.w3):
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=self.output.weight.shape[1] ** -0.5)

    def forward(self, tokens, positions=None, attention_masks=None):
        if positions is None:
            positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        half = self.head_dim // 2
        rope = self.rope_cache[positions]  # [B, S, head_dim]
        cos, sin = rope[..., :half].unsqueeze(2), rope[..., half:].unsqueeze(2)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


class CrossEntropyLoss:
    """torchtitan.components.loss.CrossEntropyLoss: sum reduction, / global_valid_tokens."""

    def __call__(self, pred, labels, global_valid_tokens=None, **kwargs):
        loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
                               ignore_index=IGNORE_INDEX)
        if global_valid_tokens is not None:
            loss = loss / global_valid_tokens
        return loss, {}


# -- torchtitan.components.optimizer ------------------------------------------------------
T = TypeVar("T", bound=Optimizer)


class ParamGroupConfig:
    def __init__(self, pattern: str, optimizer_name: str, optimizer_kwargs: dict):
        self.pattern, self.optimizer_name, self.optimizer_kwargs = pattern, optimizer_name, optimizer_kwargs


class OptimizersContainer(Optimizer, Generic[T]):
    """torchtitan's OptimizersContainer: one torch optimizer per optimizer type per model
    part; itself an Optimizer (``_post_init``) so step hooks work; ``step()`` steps each."""

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        return {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}[name]

    @staticmethod
    def _build_param_groups(model: nn.Module, param_group_configs: list, impl_kwargs: dict):
        groups: dict = defaultdict(list)
        patterns: dict = defaultdict(list)
        claimed: set = set()
        for pg in param_group_configs:
            pattern = re.compile(pg.pattern)
            params, param_names = [], []
            for name, param in model.named_parameters():
                if param.requires_grad and name not in claimed and pattern.search(name):
                    params.append(param)
                    param_names.append(name)
                    claimed.add(name)
            if not params:
                raise ValueError(f"Optimizer param_groups pattern '{pg.pattern}' matched no parameters")
            groups[pg.optimizer_name].append({"params": params, "param_names": param_names, **impl_kwargs,
                                              **pg.optimizer_kwargs})
            patterns[pg.optimizer_name].append(pg.pattern)
        return groups, patterns

    def __init__(self, param_groups: list, implementation: str, *, model_parts: list) -> None:
        impl_kwargs = {"fused": implementation in ("fused", "fused_opt_states_bf16"),
                       "foreach": implementation == "foreach"}
        all_params = []
        self.optimizers = []
        self.model_parts = model_parts
        for part_idx, model in enumerate(self.model_parts):
            groups_by_opt_name, patterns_by_opt_name = self._build_param_groups(model, param_groups, impl_kwargs)
            for opt_name, opt_param_groups in groups_by_opt_name.items():
                optimizer = self._resolve_optimizer_factory(opt_name)(opt_param_groups)
                self.optimizers.append(optimizer)
                for group, pattern in zip(optimizer.param_groups, patterns_by_opt_name[opt_name]):
                    logger.info(f"Optimizer {type(optimizer).__name__} (model_part={part_idx}): "
                                f"{len(group['params'])} params [{pattern}] lr={group['lr']}")
                for group in opt_param_groups:
                    all_params.extend(group["params"])
        self._validate_params(all_params)
        self._post_init(all_params)

    def _validate_params(self, all_params: list) -> None:
        expected = {id(p) for model in self.model_parts for p in model.parameters() if p.requires_grad}
        assert expected == {id(p) for p in all_params}

    def __iter__(self):
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def step(self, closure=None):
        assert closure is None, "OptimizersContainer does not support closures"
        for optimizer in self.optimizers:
            optimizer.step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        result: dict = {}
        for i, optim in enumerate(self.optimizers):
            init_optim_state(optim)
            result[f"optimizer_{i}"] = optim.state_dict()
        return result

    def _post_init(self, all_params: list) -> None:
        # torchtitan: "We need to call Optimizer.__init__() to initialize some necessary
        # optimizer functionality such as hooks (e.g. register_step_pre_hook ...)."
        Optimizer.__init__(self, all_params, {})


def init_optim_state(optim: Optimizer) -> None:
    """components/optimizer/utils.py: a zero-lr step if the state does not exist yet
    (never here: checkpoints come after the first update)."""
    if optim.state:
        return
    for param_group in optim.param_groups:
        for param in param_group["params"]:
            if param.grad is not None:
                return
    for param_group in optim.param_groups:
        for param in param_group["params"]:
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    saved_lrs = []
    for param_group in optim.param_groups:
        saved_lrs.append(param_group["lr"])
        param_group["lr"] = 0.0
    optim.step(closure=None)
    for param_group in optim.param_groups:
        param_group["lr"] = saved_lrs.pop(0)
    optim.zero_grad(set_to_none=True)


def linear_warmup_stable_decay(current_step, warmup_steps, stable_steps, decay_steps, lr_decay_type, min_lr_factor):
    warmup_stable_steps = warmup_steps + stable_steps
    if current_step < warmup_steps:
        current_step += 1
        return float(current_step / warmup_steps)
    if current_step < warmup_stable_steps:
        return 1.0
    current_step += 1
    progress = float(current_step - warmup_stable_steps) / decay_steps
    if lr_decay_type == "linear":
        curr_adjustment = 1 - progress
    elif lr_decay_type == "sqrt":
        curr_adjustment = 1 - math.sqrt(progress)
    else:
        curr_adjustment = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1 - min_lr_factor) * curr_adjustment


class LRSchedulersContainer:
    def __init__(self, optimizers: OptimizersContainer, lr_lambda) -> None:
        assert len(optimizers) > 0
        self.schedulers = [LambdaLR(optimizer, lr_lambda) for optimizer in optimizers]

    def __iter__(self):
        return iter(self.schedulers)

    def __len__(self) -> int:
        return len(self.schedulers)

    def get_metrics(self) -> dict:
        metrics = {}
        for scheduler in self.schedulers:
            opt_name = type(scheduler.optimizer).__name__
            last_lrs = scheduler.get_last_lr()
            for i, lr_val in enumerate(last_lrs):
                key = f"lr/{opt_name}" if len(last_lrs) == 1 else f"lr/{opt_name}/{i}"
                metrics[key] = float(lr_val)
        return metrics

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def state_dict(self) -> dict:
        return {"last_epoch": self.schedulers[0].last_epoch}


def build_lr_schedulers(optimizers, training_steps, warmup_steps, decay_type="linear", min_lr_factor=0.0):
    total_steps = training_steps
    warmup_steps = min(int(warmup_steps), total_steps)
    decay_steps = total_steps - warmup_steps
    stable_steps = total_steps + 1 - warmup_steps - decay_steps  # a virtual last step
    lr_lambda = partial(linear_warmup_stable_decay, warmup_steps=warmup_steps, stable_steps=stable_steps,
                        decay_steps=decay_steps, lr_decay_type=decay_type, min_lr_factor=min_lr_factor)
    return LRSchedulersContainer(optimizers, lr_lambda)


# -- torchtitan.components.metrics --------------------------------------------------------
class DeviceMemStats:
    max_active_gib = max_active_pct = max_reserved_gib = max_reserved_pct = 0.0
    num_alloc_retries = num_ooms = 0


class DeviceMemoryMonitor:  # CPU: nothing to read
    def get_peak_stats(self):
        return DeviceMemStats()

    def reset_peak_stats(self):
        pass


class SlowMetricLogger:
    """The metric logger (WandBLogger.log): a synchronous upload per log call."""

    def log(self, metrics: dict, step: int) -> None:
        if any(k.startswith("validation_metrics/") for k in metrics):
            truth.sleep_outside(VAL_LOG_DELAY)  # after the validation loop's StopIteration
        else:
            truth.sleep(TRAIN, "untracked", TRAIN_LOG_DELAY)

    def close(self) -> None:
        pass


class MetricsProcessor:
    def __init__(self, log_freq: int, parallel_dims: ParallelDims):
        self.log_freq = log_freq
        self.parallel_dims = parallel_dims
        self.logger = SlowMetricLogger()
        self.device_memory_monitor = DeviceMemoryMonitor()
        self.ntokens_since_last_log = 0
        self.data_loading_times: list = []
        self.time_last_log = time.perf_counter()
        self.num_flops_per_token = -1
        self.gpu_peak_flops = 312e12  # get_peak_flops() falls back to A100's on an unknown device
        self.has_quantization = False

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.log_freq == 0

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        with truth.timed(TRAIN, "untracked"):
            assert self.num_flops_per_token > 0, "num_flops_per_token must be set"
            time_delta = time.perf_counter() - self.time_last_log
            tps = self.ntokens_since_last_log / (time_delta * self.parallel_dims.non_data_parallel_size)
            tflops = self.num_flops_per_token * tps / 1e12
            mfu = 100 * self.num_flops_per_token * tps / self.gpu_peak_flops
            time_end_to_end = time_delta / self.log_freq
            time_data_loading = sum(self.data_loading_times) / len(self.data_loading_times)
            time_data_loading_pct = 100 * sum(self.data_loading_times) / time_delta
            device_mem_stats = self.device_memory_monitor.get_peak_stats()
            metrics = {
                "loss_metrics/global_avg_loss": global_avg_loss,
                "loss_metrics/global_max_loss": global_max_loss,
                "grad_norm": grad_norm,
                "throughput(tps)": tps,
                "tflops": tflops,
                "time_metrics/end_to_end(s)": time_end_to_end,
                "time_metrics/data_loading(s)": time_data_loading,
                "time_metrics/data_loading(%)": time_data_loading_pct,
                "memory/max_reserved(GiB)": device_mem_stats.max_reserved_gib,
                "mfu(%)": mfu,
            }
            if extra_metrics:
                metrics.update(extra_metrics)
            self.logger.log(metrics, step)
            logger.info(f"step: {step:2}  loss: {global_avg_loss:8.5f}  grad_norm: {grad_norm:7.4f}  "
                        f"memory: {device_mem_stats.max_reserved_gib:5.2f}GiB  tps: {round(tps):,}  "
                        f"tflops: {tflops:,.2f}  mfu: {mfu:.2f}%")
            self.ntokens_since_last_log = 0
            self.data_loading_times.clear()
            self.time_last_log = time.perf_counter()
            self.device_memory_monitor.reset_peak_stats()

    def log_validation(self, loss: float, step: int, extra_metrics=None):
        with truth.timed(OUTSIDE, "outside"):
            time_delta = time.perf_counter() - self.time_last_log
            device_mem_stats = self.device_memory_monitor.get_peak_stats()
            tps = self.ntokens_since_last_log / (time_delta * self.parallel_dims.non_data_parallel_size)
            metrics = {"validation_metrics/loss": loss, "validation_metrics/throughput(tps)": tps,
                       "validation_metrics/memory/max_reserved(GiB)": device_mem_stats.max_reserved_gib}
            if extra_metrics:
                metrics.update(extra_metrics)
            self.logger.log(metrics, step)
            logger.info(f"validate step: {step:2}  loss: {loss:7.4f}  "
                        f"memory: {device_mem_stats.max_reserved_gib:5.2f}GiB  tps: {round(tps):,}")
            self.ntokens_since_last_log = 0
            self.time_last_log = time.perf_counter()
            self.device_memory_monitor.reset_peak_stats()

    def close(self):
        self.logger.close()


# -- torchtitan.components.checkpointer (synchronous save; torch.save for DCP) -------------
class CheckpointManager:
    def __init__(self, *, dataloader, model_parts, optimizers, lr_schedulers, states, base_folder,
                 enable=True, interval=500, keep_latest_k=2, last_save_model_only=True):
        self.enable, self.interval, self.keep_latest_k = enable, interval, keep_latest_k
        self.load_only, self.enable_first_step_checkpoint = False, False
        self.last_save_model_only = last_save_model_only
        self.export_dtype = torch.float32
        self.folder = os.path.join(base_folder, "checkpoint")
        self.states = {"model": model_parts, "optimizer": optimizers, "lr_scheduler": lr_schedulers,
                       "dataloader": dataloader, **states}

    def load(self, step: int = -1) -> bool:
        return False  # a fresh run: no checkpoint folder yet

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self.enable or self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        if last_step:
            return True
        return curr_step % self.interval == 0

    def _flattened_model_states_sd(self) -> dict:
        sd = {}
        for k, v in self.states.items():
            if k == "model":
                for part in v:
                    sd.update(part.state_dict())
            else:
                sd[k] = v.state_dict()
        return sd

    def dcp_save(self, state_dict, checkpoint_id, enable_garbage_collection=False):
        os.makedirs(checkpoint_id, exist_ok=True)
        torch.save(state_dict, os.path.join(checkpoint_id, "__0_0.distcp"))
        truth.sleep(TRAIN, "untracked", SAVE_DELAY)  # a slow shared file system
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self.enable:
            return False
        if not self._should_save(curr_step, last_step):
            return False
        with truth.timed(TRAIN, "untracked"):  # after the update, before the next step: its tail
            begin = time.monotonic()
            logger.info("Saving the checkpoint.")
            checkpoint_id = os.path.join(self.folder, f"step-{curr_step}")
            if last_step and self.last_save_model_only:
                states = {k: v.to(self.export_dtype) for part in self.states["model"]
                          for k, v in part.state_dict().items()}
                logger.info(f"Saving a model only checkpoint in {self.export_dtype} at last step, step {curr_step}.")
            else:
                states = self._flattened_model_states_sd()
            self.dcp_save(states, checkpoint_id=checkpoint_id, enable_garbage_collection=True)
            self._purge_stale_checkpoints()
            logger.info(f"Finished saving the checkpoint in {time.monotonic() - begin:.2f} seconds.")
        return True

    def _purge_stale_checkpoints(self):
        found = sorted((int(m.group(1)), os.path.join(self.folder, f)) for f in os.listdir(self.folder)
                       if (m := re.search(r"step-(\d+)", f)))
        for _, path in found[: -1 * self.keep_latest_k]:
            shutil.rmtree(path, ignore_errors=True)

    def maybe_wait_for_staging(self) -> None:
        pass  # async_mode disabled

    def close(self) -> None:
        pass


# -- torchtitan.components.validate -------------------------------------------------------
def iterate_and_close_dataloader(dataloader: BaseDataLoader) -> Iterator:
    """Close a temporary dataloader when its consumer stops iterating."""
    try:
        yield from dataloader
    finally:
        dataloader.close()


class Validator:
    def __init__(self, *, freq, steps, dp_world_size, dp_rank, tokenizer, parallel_dims, loss_fn,
                 validation_context, metrics_processor, seq_len, local_batch_size):
        self.freq, self.steps = freq, steps
        self.tokenizer, self.parallel_dims, self.loss_fn = tokenizer, parallel_dims, loss_fn
        self.infinite = steps != -1  # a bounded run repeats data; -1 consumes one finite pass
        self.dp_world_size, self.dp_rank = dp_world_size, dp_rank
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.validation_context = validation_context
        self.metrics_processor = metrics_processor

    def should_validate(self, step: int) -> bool:
        return step == 1 or step % self.freq == 0

    def post_dataloading_process(self, input_dict, labels, model_parts):
        inputs = input_dict["input"]
        extra_kwargs = {k: v for k, v in input_dict.items() if k != "input"}
        return inputs, labels, extra_kwargs

    @torch.no_grad()
    def validate(self, model_parts: list, step: int) -> None:
        sl.add_step_tag("eval")
        for model in model_parts:
            model.eval()
        accumulated_loss = None
        device_type = "cpu"
        total_global_valid_tokens = torch.zeros((), dtype=torch.int64, device=device_type)
        num_steps = 0
        num_pp_microbatches = 1

        validation_dataloader = build_text_dataloader(
            "c4_validation", self.infinite, dp_world_size=self.dp_world_size, dp_rank=self.dp_rank,
            tokenizer=self.tokenizer, seq_len=self.seq_len, local_batch_size=self.local_batch_size)

        validation_iterator = iter(iterate_and_close_dataloader(validation_dataloader))
        while True:
            if self.steps != -1 and num_steps >= self.steps:
                break
            try:
                microbatches = []
                local_valid_tokens = torch.tensor(0, dtype=torch.int64, device=device_type)
                for _ in range(num_pp_microbatches):
                    input_dict, labels = next(validation_iterator)
                    self.metrics_processor.ntokens_since_last_log += labels.numel()
                    for k, v in input_dict.items():
                        input_dict[k] = v.to(device_type)
                    labels = labels.to(device_type)
                    local_valid_tokens += (labels != IGNORE_INDEX).sum()
                    microbatches.append((input_dict, labels))
            except StopIteration:
                truth.loop_end()  # the validation DataLoader ended: until the next step, between steps
                break

            global_valid_tokens = local_valid_tokens
            assert len(microbatches) == 1
            input_dict, labels = microbatches[0]
            inputs, labels, extra_kwargs = self.post_dataloading_process(input_dict, labels, model_parts)
            with self.validation_context():
                assert len(model_parts) == 1
                predictions = model_parts[0](inputs, **extra_kwargs)
                loss_sum, _ = self.loss_fn(predictions, labels)

            loss_sum = loss_sum.detach()
            if accumulated_loss is None:
                accumulated_loss = loss_sum.clone()
            else:
                accumulated_loss.add_(loss_sum)
            total_global_valid_tokens.add_(global_valid_tokens)
            num_steps += 1
            truth.eval_step()

        assert accumulated_loss is not None
        num_global_valid_tokens = int(total_global_valid_tokens.item())
        global_loss_sum = float(accumulated_loss.item())
        global_avg_loss = global_loss_sum / num_global_valid_tokens

        self.metrics_processor.log_validation(loss=global_avg_loss, step=step)

        with truth.timed(OUTSIDE, "outside"):
            for model in model_parts:
                model.train()


# -- torchtitan.tools.profiler.Profiler (profiling disabled: a no-op) ----------------------
class Profiler:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def step(self) -> None:
        pass


class DataloaderExhaustedError(Exception):
    pass


# -- torchtitan/trainer.py -------------------------------------------------------------------
class Trainer:
    def __init__(self):
        self.device = torch.device("cpu")
        self.parallel_dims = parallel_dims = ParallelDims()
        dp_degree, dp_rank = 1, 0
        self.gc_handler = GarbageCollection(gc_freq=GC_FREQ)
        torch.manual_seed(0)  # dist_utils.set_determinism

        with torch.device("meta"):
            model = Decoder()
        self.metrics_processor = MetricsProcessor(LOG_FREQ, parallel_dims)
        n_params = sum(p.numel() for p in model.parameters())
        self.metrics_processor.num_flops_per_token = 6 * n_params
        logger.info(f"Model llama3 debugmodel size: {n_params:,} total parameters")
        self.loss_fn = CrossEntropyLoss()

        self.num_pp_microbatches = 1
        self.gradient_accumulation_steps = GRAD_ACCUM  # num_tokens_per_train_step // tokens per DP rank

        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        self.model_parts = [model]

        self.optimizers = OptimizersContainer(
            [ParamGroupConfig(r"(tok_embeddings|norm)", "Adam",
                              {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}),
             ParamGroupConfig(r".*", "AdamW", {"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})],
            implementation="foreach", model_parts=self.model_parts)
        self.lr_schedulers = build_lr_schedulers(self.optimizers, training_steps=STEPS, warmup_steps=WARMUP)

        self.step = 0
        self.ntokens_seen = 0
        self.tokenizer = CharTokenizer()
        self.dataloader = build_text_dataloader("c4_test", True, dp_world_size=dp_degree, dp_rank=dp_rank,
                                                tokenizer=self.tokenizer, seq_len=SEQ_LEN,
                                                local_batch_size=LOCAL_BATCH)
        self.checkpointer = CheckpointManager(dataloader=self.dataloader, model_parts=self.model_parts,
                                              optimizers=self.optimizers, lr_schedulers=self.lr_schedulers,
                                              states={"train_state": self}, base_folder=dump_folder,
                                              interval=CKPT_INTERVAL)
        self.train_context = nullcontext
        self.fwd_bwd_fn = self._forward_backward_body  # disable_cuda_graphs: no wrap_with_cuda_graph
        self.validator = Validator(freq=VAL_FREQ, steps=-1, dp_world_size=dp_degree, dp_rank=dp_rank,
                                   tokenizer=self.tokenizer, parallel_dims=parallel_dims, loss_fn=self.loss_fn,
                                   validation_context=self.train_context,
                                   metrics_processor=self.metrics_processor, seq_len=SEQ_LEN,
                                   local_batch_size=LOCAL_BATCH)
        self.max_norm = 1.0
        self.validator_enable = True
        # truth: where the time between this step's update and the next step's first fetch
        # goes (the first step's top: before it; after validation: between steps)
        self._top_mode = BEFORE
        self._backward_passes = 0
        logger.info(f"Trainer is initialized with local batch size {LOCAL_BATCH}, gradient accumulation steps "
                    f"{self.gradient_accumulation_steps}, sequence length {SEQ_LEN}, total steps {STEPS} "
                    f"(warmup {WARMUP})")

    def batch_generator(self, data_iterable: Iterable) -> Iterator:
        data_iterator = iter(data_iterable)
        while True:
            data_load_start = time.perf_counter()
            try:
                batch = next(data_iterator)
            except StopIteration as ex:
                raise DataloaderExhaustedError() from ex
            input_dict, labels = batch
            ntokens_batch = labels.numel()
            self.metrics_processor.ntokens_since_last_log += ntokens_batch
            self.metrics_processor.data_loading_times.append(time.perf_counter() - data_load_start)
            yield input_dict, labels

    def post_dataloading_process(self, input_dict, labels):
        inputs = input_dict["input"]
        extra_kwargs = {k: v for k, v in input_dict.items() if k != "input"}
        self.ntokens_seen += labels.numel()
        return inputs, labels, extra_kwargs

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        inputs, labels, extra_kwargs = self.post_dataloading_process(input_dict, labels)
        assert len(self.model_parts) == 1
        return self.fwd_bwd_fn(inputs, labels, global_valid_tokens, extra_kwargs)

    def _forward_backward_body(self, inputs, labels, global_valid_tokens, extra_kwargs):
        with self.train_context():
            pred = self.model_parts[0](inputs, **extra_kwargs)
            loss_kwargs = {}
            if "positions" in extra_kwargs:
                loss_kwargs["positions"] = extra_kwargs["positions"]
            loss, _ = self.loss_fn(pred, labels, global_valid_tokens, **loss_kwargs)
            del pred
            loss.backward()
            self._backward_passes += 1
        return loss

    def train_step(self, data_iterator):
        with truth.timed(self._top_mode, "untracked" if self._top_mode == TRAIN else "outside"):
            self.optimizers.zero_grad(set_to_none=True)  # disable_cuda_graphs on CPU
            lr_metrics = self.lr_schedulers.get_metrics()
            should_log = self.metrics_processor.should_log(self.step)

        parallel_dims = self.parallel_dims
        microbatch_groups = []
        local_valid_tokens = torch.tensor(0, dtype=torch.int64)
        for _ in range(self.gradient_accumulation_steps):
            microbatches = []
            for _ in range(self.num_pp_microbatches):
                with sl.log_trace_span("fetching_batch"):
                    input_dict, labels = next(data_iterator)
                local_valid_tokens += (labels != IGNORE_INDEX).sum()
                microbatches.append((input_dict, labels))
            microbatch_groups.append(microbatches)

        global_valid_tokens = local_valid_tokens.to(self.device)  # no DP mesh

        accumulated_loss = None
        loss_is_finite = torch.ones((), dtype=torch.int32, device=self.device)
        for microbatches in microbatch_groups:
            input_dict_mbs, label_mbs = [], []
            for input_dict, labels in microbatches:
                for key, value in input_dict.items():
                    if isinstance(value, torch.Tensor):
                        input_dict[key] = value.to(self.device)
                input_dict_mbs.append(input_dict)
                label_mbs.append(labels.to(self.device))
            assert len(input_dict_mbs) == len(label_mbs) == 1
            loss = self.forward_backward_step(input_dict=input_dict_mbs[0], labels=label_mbs[0],
                                              global_valid_tokens=global_valid_tokens)
            detached_loss = loss.detach()
            loss_is_finite.logical_and_(torch.isfinite(detached_loss).all())
            if should_log:
                if accumulated_loss is None:
                    accumulated_loss = detached_loss.clone()
                else:
                    accumulated_loss.add_(detached_loss)

        with sl.log_trace_span("optim"):
            grad_norm = clip_grad_norm_([p for m in self.model_parts for p in m.parameters()], self.max_norm,
                                        foreach=True, pp_mesh=None, ep_enabled=parallel_dims.ep_enabled)
            step_is_finite = loss_is_finite.logical_and(torch.isfinite(grad_norm).all())
            torch._assert_async(step_is_finite, "Loss or gradient norm is not finite on at least one rank at "
                                                f"step {self.step}. Stopping training before the optimizer update.")
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
            truth.train_step(microbatches=self._backward_passes)
            self._backward_passes = 0
            self.lr_schedulers.step()

        if not should_log:
            return
        assert accumulated_loss is not None
        global_avg_loss = global_max_loss = float(accumulated_loss.item())
        global_ntokens_seen = self.ntokens_seen
        extra_metrics = {"n_tokens_seen": global_ntokens_seen, **lr_metrics}
        self.metrics_processor.log(self.step, global_avg_loss, global_max_loss, float(grad_norm.item()),
                                   extra_metrics=extra_metrics)

    def train(self):
        self.checkpointer.load(step=-1)
        loaded_step = self.step
        logger.info(f"Training starts at step {self.step + 1}")
        truth.start()
        with Profiler() as profiler:
            data_iterator = self.batch_generator(self.dataloader)
            while self.should_continue_training():
                self.step += 1
                sl.set_step(self.step, relative_step=self.step - loaded_step)
                with sl.log_trace_span("step"):
                    with truth.timed(self._top_mode, "untracked" if self._top_mode == TRAIN else "outside"):
                        self.gc_handler.run(self.step)

                    try:
                        self.train_step(data_iterator)
                    except DataloaderExhaustedError:
                        logger.warning("Ran out of data; last step was canceled.")
                        break

                    self.checkpointer.save(self.step, last_step=(self.step == STEPS))

                    self._top_mode = TRAIN  # the next step's top is this train step's tail ...
                    if self.validator_enable and self.validator.should_validate(self.step):
                        self.validator.validate(self.model_parts, self.step)
                        self._top_mode = OUTSIDE  # ... unless a validation loop ended in between

                    profiler.step()
                    # (dist_utils.set_pg_timeouts after the first step: no process group)
        truth.stop()
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_rank() == 0:
            logger.info("Sleeping 2 seconds for other ranks to complete")
            time.sleep(2)
        logger.info("Training completed")

    def should_continue_training(self) -> bool:
        return self.step < STEPS

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def close(self) -> None:
        if self.dataloader is not None:  # (HEAD: `and self.dataloader`, for Grain's loader; a torch
            self.dataloader.close()       # DataLoader over an IterableDataset has no len())
        self.checkpointer.close()
        self.metrics_processor.close()


def main() -> None:
    trainer = Trainer()
    try:
        trainer.train()
    except Exception:
        trainer.close()
        raise
    else:
        trainer.close()
    truth.notes.update(gradient_accumulation_steps=GRAD_ACCUM, optimizers_in_container=len(trainer.optimizers),
                       validations=len([s for s in range(1, STEPS + 1) if s == 1 or s % VAL_FREQ == 0]),
                       eval_batches_per_validation=N_VAL_DOCS // LOCAL_BATCH)
    shutil.rmtree(dump_folder, ignore_errors=True)
    truth.emit()


if __name__ == "__main__":
    main()
