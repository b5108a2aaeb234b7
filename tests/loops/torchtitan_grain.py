# Shape: pytorch/torchtitan torchtitan/trainer.py + components/data/loader.py (b5bcd76) — Trainer.train() fed by GrainDataLoader, the current data path (llama3_8b's c4 stream): a streaming source, WindowShuffleIterDataset, random_map(TextProcessor) and packing (ConcatThenSplitIterDataset) all on the one thread of ThreadPrefetchIterDataset(prefetch_buffer_size=2) after .batch(1, batch_fn=TextCollator), its iterator made once in GrainDataLoader.__init__ and handed out by __iter__; data_iterator = batch_generator(dataloader), train_step(): zero_grad, next(data_iterator) for all 3 gradient-accumulation micro-batches up front (token-major [T] batches), then per micro-batch post_dataloading_process (document masks from positions), forward, sum CE / global_valid_tokens (llama3_debugmodel_ce_loss), backward; clip_grad_norm_, optimizers.step() (an OptimizersContainer of one AdamW), lr_schedulers.step(), metrics logged every step; checkpointer.save every 5 steps; validator.validate() at step 1 and every 5 steps (a fresh repeating Grain loader per call, steps=10: left with `break`, closed when validate() returns); DataloaderExhaustedError would end training.
"""torchtitan's current trainer with its Grain data loader, download-free, on CPU.

Read from pytorch/torchtitan at b5bcd76c66d0acb1a08b176d9639425bc55e0b2a:
``torchtitan/trainer.py`` (``Trainer.__init__``'s gradient-accumulation arithmetic and
dataloader build, ``train``, ``train_step``, ``batch_generator``,
``post_dataloading_process``, ``forward_backward_step``, ``_forward_backward_body``,
``close``), ``components/data/loader.py`` (``GrainDataLoader``: the dataset graph
``.batch(collator.num_rows_per_batch(), drop_remainder=repeat, batch_fn=collator)``,
``grain_experimental.ThreadPrefetchIterDataset(dataset, prefetch_buffer_size=
num_prefetch_batches)``, ``self._iterator = iter(dataset)`` in ``__init__``, ``__iter__``
returning it, ``state_dict`` from ``get_state()``, ``close``; ``DataloaderExhaustedError``),
``components/data/dataset.py`` (``SingleDatasetConfig``: ``MapDataset.source`` for a
random-access source, a streaming source as is; ``_build_iter_dataset``:
``WindowShuffleIterDataset``, ``random_map(processor)``, post-filters; ``TextSequence``),
``components/data/sources.py`` (``HuggingFaceStreamingSource`` and its cursor iterator),
``components/data/packing.py`` (``ConcatThenSplitPackingConfig``), ``collators.py``
(``TextCollator``: one packed row per batch, token-major ``input``/``positions``/labels),
``hf_datasets/text_datasets.py`` (``TextProcessor``; ``DATASETS["c4"]`` and
``["c4_validation"]``: streaming), ``components/validate.py`` (``Validator``: a fresh
loader per call from ``replace(config.dataloader, repeat=steps != -1)``, ``next()``
through ``iterate_and_close_dataloader``, ``break`` after ``steps`` batches),
``components/optimizer`` (``OptimizersContainer``, ``default_adamw``, warmup-stable-decay
``LambdaLR`` with ``decay_ratio``), ``components/metrics.py``, ``components/checkpointer``
(``_should_save``, a synchronous save, then a GC collection), ``tools/utils.py``
(``GarbageCollection``) and ``models/llama3/config_registry.py``: the data path of
``llama3_8b`` (``ConcatThenSplitPackingConfig(DATASETS["c4"])``, shuffled and repeated
by default; the validator's default ``c4_validation`` loader) with the schedule of
``llama3_debugmodel`` (10 steps, warmup 2, decay_ratio 0.8, log_freq 1, validation every
5 steps for 10 batches) and the loss of ``llama3_debugmodel_ce_loss`` (plain
``CrossEntropyLoss``: every other llama3 config wraps it in ``ChunkedLossWrapper``, a
shape of its own, left out here).

Truth (docs/steps.md): one training step per ``optimizers.step()`` (the container and
the AdamW it steps count once), with 3 backward passes (gradient accumulation: every
micro-batch is fetched at the top of ``train_step``, before the first forward); one eval
step per validation forward batch (10 per validation, 3 validations).

Planted: a slow tokenizer (``TOKENIZE_DELAY`` a document: ~8 documents a train step,
~3 an eval batch). A streaming dataset's ``TextProcessor`` runs where Grain iterates the
pipeline: on ``ThreadPrefetchIterDataset``'s thread, with the window shuffle, the
packing and the collator. So the training thread waits only when that thread cannot
keep up (it keeps 2 batches ready: the step after a validation hardly waits). The wait
is measured where torchtitan measures data loading, around ``next(data_iterator)`` in
``batch_generator`` (train ``dataloader_next``: the step whose ``train_step`` fetched it),
and around ``next(validation_iterator)`` in ``Validator.validate`` (eval
``dataloader_next``; each validation's first batch also waits for the new pipeline to
start and fill its shuffle window, and counts from the making of the loader's iterator,
``iter(dataset)`` in ``GrainDataLoader.__init__``: docs/steps.md puts a loop's start-up in
its first wait; the training loader's iterator, made in ``Trainer.__init__``, starts
nothing early). Also a slow metrics logger (W&B-like, a synchronous
upload: train ``untracked``, every step) and a slow checkpoint write (train
``untracked``), with the logging, saving, GC and ``zero_grad`` code timed. After a
validation (left with ``break``: no loader end) the time until the next train step's
first fetch is the last eval step's tail: timed as eval ``untracked`` but not checked
(no delay planted there), because it also holds the validation loader's ``close()``,
which joins Grain's prefetch thread and cannot be timed without changing the loop.

Not in the original: no torch.distributed (single process; the dist reductions, the
2-second rank-0 sleep and the pg timeouts are skipped), an in-memory stream of synthetic
documents for ``HuggingFaceStreamingSource`` (allenai/c4), a char-level tokenizer, a tiny
Llama-like token-major decoder (SDPA with the causal document mask that flex attention
builds from ``positions``; a meta-device build, then ``to_empty`` + ``init_weights``),
``implementation="foreach"``, gradient accumulation through
``training.num_tokens_per_train_step`` (3 micro-batches), checkpointing enabled
(``--checkpoint.enable``, interval 5) and written with ``torch.save`` rather than DCP,
``gc_freq`` 4, no-op structured logger and profiler, no config system (the ``Config``
dataclasses keep only the fields used)."""

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
from collections.abc import Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable

import grain.python as grain
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from _truth import BEFORE, EVAL, TRAIN, Truth
from grain import experimental as grain_experimental
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

REQUIRES_TORCH = "2.6"  # torch.nn.utils.get_total_norm, as torchtitan calls it (test_loops.py skips below)
torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
truth = Truth("torchtitan_grain")

# llama3_debugmodel's schedule: steps 10, warmup 2, decay_ratio 0.8, log_freq 1, validator
# freq 5 / steps 10; tokens per micro-batch 8 x 2048 there (llama3_8b: 8192), 4 x 32 here
STEPS, WARMUP, DECAY_RATIO, LOG_FREQ, VAL_FREQ, VAL_STEPS = 10, 2, 0.8, 1, 5, 10
MAX_CONTEXT_LENGTH = 32
NUM_TOKENS_PER_BATCH = 4 * MAX_CONTEXT_LENGTH  # training.num_tokens_per_microbatch_per_dp_rank
NUM_TOKENS_PER_TRAIN_STEP = 3 * NUM_TOKENS_PER_BATCH  # -> gradient_accumulation_steps 3
CKPT_INTERVAL, GC_FREQ = 5, 4
N_DOCS, N_VAL_DOCS = 256, 128
TOKENIZE_DELAY = 0.008  # per document, on the ThreadPrefetchIterDataset thread
TRAIN_LOG_DELAY, VAL_LOG_DELAY, SAVE_DELAY = 0.010, 0.010, 0.015
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


# -- the tokenizer ------------------------------------------------------------------------
class CharTokenizer:
    """Stands in for the HuggingFace tokenizer: bos=1, eos=2, characters from 3. Slow:
    ``TOKENIZE_DELAY`` a document (the planted data stage). It runs on Grain's prefetch
    thread, never on the training thread, so the sleep is not booked as such: the truth
    is the wait the training thread measures in ``next()``."""

    bos_id, eos_id, vocab_size = 1, 2, 64

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list:
        time.sleep(TOKENIZE_DELAY)  # a slow tokenizer (releases the GIL, as a native one can)
        ids = [3 + (ord(c) % (self.vocab_size - 3)) for c in text]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])


# -- torchtitan.components.data.types / dataset / sources --------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetBuildContext:
    tokenizer: CharTokenizer
    max_context_length: int
    num_tokens_per_batch: int
    read_options: grain.ReadOptions


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetIterationPolicy:
    seed: int
    shuffle: bool
    repeat: bool
    dp_rank: int
    dp_world_size: int
    streaming_shuffle_buffer_size: int


@dataclass(frozen=True, kw_only=True, slots=True)
class TextSequence:
    input_ids: np.ndarray
    labels: np.ndarray
    positions: np.ndarray | None = None


class InMemoryStreamingSource(grain.IterDataset):
    """Stands in for ``HuggingFaceStreamingSource`` (allenai/c4, streaming): a DP-sharded
    stream (here an in-memory list of documents) with cursor checkpointing."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        texts: tuple

        def build(self, *, dataset_iteration_policy: DatasetIterationPolicy) -> "InMemoryStreamingSource":
            return InMemoryStreamingSource(self, dataset_iteration_policy=dataset_iteration_policy)

    def __init__(self, config: Config, *, dataset_iteration_policy: DatasetIterationPolicy) -> None:
        super().__init__()
        rows = [{"text": t} for t in config.texts]
        # split_dataset_by_node(dataset, rank=dp_rank, world_size=dp_world_size)
        self._rows = rows[dataset_iteration_policy.dp_rank::dataset_iteration_policy.dp_world_size]
        self._repeat = dataset_iteration_policy.repeat
        self._shuffle = dataset_iteration_policy.shuffle

    def __iter__(self) -> grain.DatasetIterator:
        return _CursorIterator(self._rows, repeat=self._repeat, shuffle=self._shuffle)


class _CursorIterator(grain.DatasetIterator):
    """``_HuggingFaceCursorIterator``: exposes the stream's cursor to Grain's checkpoint
    recursion; on exhaustion with ``repeat``, a new epoch (``set_epoch`` reshuffles the
    stream's shards when ``shuffle``)."""

    def __init__(self, rows: list, *, repeat: bool, shuffle: bool) -> None:
        super().__init__()
        self._rows, self._repeat, self._shuffle = rows, repeat, shuffle
        self._epoch = 0
        self._cursor = 0
        self._order = list(range(len(rows)))

    def _set_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._order = list(range(len(self._rows)))
        if self._shuffle and epoch:
            random.Random(epoch).shuffle(self._order)

    def __next__(self) -> dict:
        if self._cursor >= len(self._rows):
            if not self._repeat:
                raise StopIteration
            self._set_epoch(self._epoch + 1)
            self._cursor = 0
        row = self._rows[self._order[self._cursor]]
        self._cursor += 1
        return row

    def get_state(self) -> dict:
        return {"epoch": self._epoch, "hf": {"cursor": self._cursor}}

    def set_state(self, state: dict) -> None:
        self._set_epoch(state["epoch"])
        self._cursor = state["hf"]["cursor"]


def _read_text(sample: dict) -> str:
    return sample["text"]


class TextProcessor:
    """hf_datasets.text_datasets.TextProcessor: tokenizes plain text into next-token
    input and label pairs (a ``SampleProcessor``: called with Grain's rng)."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        text_fn: Callable[[dict], str] = _read_text

        def build(self, *, context: DatasetBuildContext) -> "TextProcessor":
            return TextProcessor(self, context=context)

    def __init__(self, config: Config, *, context: DatasetBuildContext) -> None:
        self._tokenizer = context.tokenizer
        self._text_fn = config.text_fn

    def __call__(self, sample: dict, rng: np.random.Generator) -> TextSequence | None:
        del rng
        input_ids = np.asarray(self._tokenizer.encode(self._text_fn(sample), add_bos=True, add_eos=True),
                               dtype=np.int64)
        if len(input_ids) < 2:
            return None
        return TextSequence(input_ids=input_ids[:-1], labels=input_ids[1:])


@dataclass(frozen=True, kw_only=True, slots=True)
class SingleDatasetConfig:
    """components.data.dataset.SingleDatasetConfig: a source and row-level transforms."""

    source: Any
    pre_filters: tuple = ()
    processor: Any = None
    post_filters: tuple = ()

    def build(self, *, context: DatasetBuildContext, dataset_iteration_policy: DatasetIterationPolicy):
        source = self.source.build(dataset_iteration_policy=dataset_iteration_policy)
        if isinstance(source, grain.IterDataset):
            dataset = source
        elif hasattr(source, "__len__") and hasattr(source, "__getitem__"):  # RandomAccessDataSource
            dataset = grain.MapDataset.source(source)
        else:
            raise TypeError("source must be a RandomAccessDataSource or grain.IterDataset")
        if isinstance(dataset, grain.MapDataset):
            return self._build_map_dataset(dataset, context=context,
                                           dataset_iteration_policy=dataset_iteration_policy)
        return self._build_iter_dataset(dataset, context=context, dataset_iteration_policy=dataset_iteration_policy)

    def _build_map_dataset(self, dataset, *, context, dataset_iteration_policy):
        for filter_fn in self.pre_filters:
            dataset = dataset.filter(filter_fn)
        if self.processor is not None:
            dataset = dataset.random_map(self.processor.build(context=context), seed=dataset_iteration_policy.seed)
        for filter_fn in self.post_filters:
            dataset = dataset.filter(filter_fn)
        if dataset_iteration_policy.shuffle:
            dataset = dataset.shuffle(seed=dataset_iteration_policy.seed)
        if len(dataset) < dataset_iteration_policy.dp_world_size:
            raise ValueError(f"dataset has {len(dataset)} rows, fewer than "
                             f"dp_world_size={dataset_iteration_policy.dp_world_size}")
        shard_size, remainder = divmod(len(dataset), dataset_iteration_policy.dp_world_size)
        shard_start = dataset_iteration_policy.dp_rank * shard_size + min(dataset_iteration_policy.dp_rank, remainder)
        shard_stop = shard_start + shard_size
        if dataset_iteration_policy.dp_rank < remainder:
            shard_stop += 1
        dataset = dataset[shard_start:shard_stop]
        if dataset_iteration_policy.repeat:
            dataset = dataset.repeat()
        return dataset

    def _build_iter_dataset(self, dataset, *, context, dataset_iteration_policy):
        """Shuffle streaming rows before row processing (all of it on the one thread
        that iterates the pipeline: here ThreadPrefetchIterDataset's)."""
        if dataset_iteration_policy.shuffle:
            dataset = grain.experimental.WindowShuffleIterDataset(
                dataset, window_size=dataset_iteration_policy.streaming_shuffle_buffer_size,
                seed=dataset_iteration_policy.seed)
        for filter_fn in self.pre_filters:
            dataset = dataset.filter(filter_fn)
        if self.processor is not None:
            dataset = dataset.random_map(self.processor.build(context=context),
                                         seed=dataset_iteration_policy.seed + dataset_iteration_policy.dp_rank)
        for filter_fn in self.post_filters:
            dataset = dataset.filter(filter_fn)
        return dataset


# -- torchtitan.components.data.packing ---------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class ConcatThenSplitPackingConfig:
    dataset: Any

    def build(self, *, context: DatasetBuildContext, dataset_iteration_policy: DatasetIterationPolicy):
        dataset = self.dataset.build(context=context, dataset_iteration_policy=dataset_iteration_policy)
        dataset = dataset.map(partial(_text_sequence_to_packing_input, max_context_length=context.max_context_length))
        if isinstance(dataset, grain.MapDataset):
            dataset = dataset.to_iter_dataset(read_options=context.read_options)
        dataset = grain_experimental.ConcatThenSplitIterDataset(
            dataset,
            length_struct={"input_ids": context.num_tokens_per_batch, "labels": context.num_tokens_per_batch,
                           "positions": context.num_tokens_per_batch},
        )
        dataset = dataset.filter(_packing_output_is_full)
        return dataset.map(_packing_output_to_text_sequence)


def _packing_output_is_full(packing_output: dict) -> bool:
    return bool(np.all(np.asarray(packing_output["input_ids_segment_ids"]) != 0))


def _text_sequence_to_packing_input(text_sequence: TextSequence, *, max_context_length: int) -> dict:
    positions = text_sequence.positions
    if positions is None:
        positions = np.arange(len(text_sequence.input_ids), dtype=np.int64) % max_context_length
    return {"input_ids": np.asarray(text_sequence.input_ids), "labels": np.asarray(text_sequence.labels),
            "positions": np.asarray(positions)}


def _packing_output_to_text_sequence(packing_output: dict) -> TextSequence:
    labels = np.asarray(packing_output["labels"]).copy()
    labels[np.asarray(packing_output["input_ids_segment_ids"]) == 0] = IGNORE_INDEX
    boundaries = np.asarray(packing_output["positions"]) == 0
    token_indices = np.arange(len(boundaries), dtype=np.int64)
    segment_starts = np.maximum.accumulate(np.where(boundaries, token_indices, 0))
    return TextSequence(input_ids=np.asarray(packing_output["input_ids"]), labels=labels,
                        positions=token_indices - segment_starts)


# -- torchtitan.components.data.collators ------------------------------------------------
class TextCollator:
    """Concatenates text rows and pads only the final token-batch tail."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        def build(self, *, context: DatasetBuildContext) -> "TextCollator":
            return TextCollator(self, context=context)

    def __init__(self, config: Config, *, context: DatasetBuildContext) -> None:
        del config
        self._num_tokens_per_batch = context.num_tokens_per_batch

    def num_rows_per_batch(self) -> int:
        return 1

    def __call__(self, rows: Sequence[TextSequence]):
        num_tokens = sum(len(row.input_ids) for row in rows)
        if num_tokens > self._num_tokens_per_batch:
            raise ValueError("text rows exceed the configured token batch")
        input_ids = torch.cat([torch.as_tensor(row.input_ids) for row in rows])
        labels = torch.cat([torch.as_tensor(row.labels) for row in rows])
        positions = torch.cat([torch.arange(len(row.input_ids)) if row.positions is None
                               else torch.as_tensor(row.positions) for row in rows])
        pad_len = self._num_tokens_per_batch - num_tokens
        if pad_len:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad_len))
            labels = torch.nn.functional.pad(labels, (0, pad_len), value=IGNORE_INDEX)
            positions = torch.cat([positions, torch.arange(pad_len, dtype=positions.dtype)])
        return {"input": input_ids, "positions": positions}, labels


# -- torchtitan.components.data.loader ---------------------------------------------------
class DataloaderExhaustedError(Exception):
    """An exception that indicates dataloader exhaustion (not a StopIteration: PEP 479)."""


class BaseDataLoader:
    def __iter__(self):
        raise NotImplementedError

    def close(self) -> None:
        pass


class GrainDataLoader(BaseDataLoader):
    """Batches and checkpoints one composed Grain dataset graph."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        dataset: Any
        collator: Any = field(default_factory=TextCollator.Config)
        seed: int = 42
        shuffle: bool = True
        repeat: bool = True
        streaming_shuffle_buffer_size: int = 1_000
        read_options: grain.ReadOptions = field(default_factory=grain.ReadOptions)
        num_prefetch_batches: int = 2

        def build(self, **kwargs) -> "GrainDataLoader":
            return GrainDataLoader(self, **kwargs)

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, max_context_length: int,
                 num_tokens_per_batch: int, **kwargs: Any) -> None:
        del kwargs
        if dp_world_size > 1 and not config.repeat:
            raise ValueError("repeat=False with data parallelism can exhaust ranks at different steps and hang "
                             "collectives; use repeat=True with a trainer-controlled step count")
        self._dp_world_size = dp_world_size
        self._rank_id = f"dp_rank_{dp_rank}"

        read_options = config.read_options
        context = DatasetBuildContext(tokenizer=tokenizer, max_context_length=max_context_length,
                                      num_tokens_per_batch=num_tokens_per_batch, read_options=read_options)
        dataset_iteration_policy = DatasetIterationPolicy(
            seed=config.seed, shuffle=config.shuffle, repeat=config.repeat, dp_rank=dp_rank,
            dp_world_size=dp_world_size, streaming_shuffle_buffer_size=config.streaming_shuffle_buffer_size)

        dataset = config.dataset.build(context=context, dataset_iteration_policy=dataset_iteration_policy)
        collator = config.collator.build(context=context)

        if isinstance(dataset, grain.MapDataset):
            dataset = dataset.to_iter_dataset(read_options=read_options)

        # Batch and collate samples.
        dataset = dataset.batch(collator.num_rows_per_batch(), drop_remainder=config.repeat, batch_fn=collator)

        # Queue completed batches while the trainer consumes the previous batch.
        dataset = grain_experimental.ThreadPrefetchIterDataset(dataset,
                                                               prefetch_buffer_size=config.num_prefetch_batches)
        self._iter_started = time.perf_counter()  # not in the original: the truth (the loop's start-up)
        self._iterator = iter(dataset)

    def __iter__(self):
        return self._iterator

    def state_dict(self) -> dict:
        return {"version": 1, "dp_world_size": self._dp_world_size, self._rank_id: self._iterator.get_state()}

    def close(self) -> None:
        self._iterator.close()


def _synthetic_texts(n: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    words = ["the", "model", "token", "layer", "train", "data", "shard", "titan", "loss", "grad"]
    out = []
    for _ in range(n):
        length = int(torch.randint(20, 71, (1,), generator=g))
        text = ""
        while len(text) < length:
            text += words[int(torch.randint(len(words), (1,), generator=g))] + " "
        out.append(text[:length])
    return tuple(out)


DATASETS = {
    "c4": SingleDatasetConfig(
        source=InMemoryStreamingSource.Config(texts=_synthetic_texts(N_DOCS, 1)),
        processor=TextProcessor.Config(),
        post_filters=(lambda sample: sample is not None,),
    ),
    "c4_validation": SingleDatasetConfig(
        source=InMemoryStreamingSource.Config(texts=_synthetic_texts(N_VAL_DOCS, 2)),
        processor=TextProcessor.Config(),
        post_filters=(lambda sample: sample is not None,),
    ),
}


# -- the model: a tiny Llama-style decoder, token-major ([T] tokens) -----------------------
class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, attention_masks, cos, sin):
        T, _ = x.shape
        q, k, v = (w(x).view(T, self.n_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, T, head_dim]
        if attention_masks is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_masks)
        return self.wo(y.squeeze(0).transpose(0, 1).reshape(T, -1))


def _rope(x, cos, sin):  # x: [T, H, head_dim]; cos/sin: [T, 1, head_dim / 2]
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

    def forward(self, x, attention_masks, cos, sin):
        x = x + self.attention(self.attention_norm(x), attention_masks, cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(self, vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden=64, max_seq_len=MAX_CONTEXT_LENGTH):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, n_heads, hidden) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
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
        nn.init.trunc_normal_(self.lm_head.weight, mean=0.0, std=self.lm_head.weight.shape[1] ** -0.5)

    def get_attention_masks(self, positions: torch.Tensor) -> torch.Tensor:
        """Causal and packed-document masking from per-document positions (what flex
        attention's mask mods compute), as a boolean [T, T] mask for SDPA."""
        document = torch.cumsum(positions == 0, dim=0)
        causal = torch.ones(len(positions), len(positions), dtype=torch.bool, device=positions.device).tril()
        return causal & (document[:, None] == document[None, :])

    def forward(self, tokens, positions=None, attention_masks=None):
        if positions is None:
            positions = torch.arange(tokens.shape[0], device=tokens.device)
        half = self.head_dim // 2
        rope = self.rope_cache[positions]  # [T, head_dim]
        cos, sin = rope[..., :half].unsqueeze(1), rope[..., half:].unsqueeze(1)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, attention_masks, cos, sin)
        return self.lm_head(self.norm(h))


class CrossEntropyLoss:
    """torchtitan.components.loss.CrossEntropyLoss: pred [T, V], labels [T], sum
    reduction, divided by the global valid-token count."""

    def __call__(self, pred, labels, global_valid_tokens=None, **kwargs):
        del kwargs
        loss = F.cross_entropy(pred.float(), labels, reduction="sum", ignore_index=IGNORE_INDEX)
        if global_valid_tokens is not None:
            loss = loss / global_valid_tokens
        return loss, {}


# -- torchtitan.components.optimizer ------------------------------------------------------
class ParamGroupConfig:
    def __init__(self, pattern: str, optimizer_name: str, optimizer_kwargs: dict):
        self.pattern, self.optimizer_name, self.optimizer_kwargs = pattern, optimizer_name, optimizer_kwargs


def default_adamw(lr: float = 8e-4, **kwargs) -> list:
    """An OptimizersContainer config with a catch-all AdamW param group."""
    return [ParamGroupConfig(r".*", "AdamW", {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                                               **kwargs})]


class OptimizersContainer(Optimizer):
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
        self._post_init(all_params)

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
        return {f"optimizer_{i}": optim.state_dict() for i, optim in enumerate(self.optimizers)}

    def _post_init(self, all_params: list) -> None:
        # torchtitan: "We need to call Optimizer.__init__() to initialize some necessary
        # optimizer functionality such as hooks (e.g. register_step_pre_hook ...)."
        Optimizer.__init__(self, all_params, {})


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


def build_lr_schedulers(optimizers, training_steps, warmup_steps, decay_ratio=None, decay_type="linear",
                        min_lr_factor=0.0):
    total_steps = training_steps
    warmup_steps = min(int(warmup_steps), total_steps)
    if decay_ratio is not None:
        decay_steps = min(round(total_steps * decay_ratio), total_steps - warmup_steps)
    else:
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
            time.sleep(VAL_LOG_DELAY)  # in the last eval step's tail: timed there, not checked
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
                        f"tflops: {tflops:,.2f}  mfu: {mfu:.2f}%  data loading: {time_data_loading_pct:.0f}%")
            self.ntokens_since_last_log = 0
            self.data_loading_times.clear()
            self.time_last_log = time.perf_counter()
            self.device_memory_monitor.reset_peak_stats()

    def log_validation(self, loss: float, step: int, extra_metrics=None):
        with truth.timed(EVAL, "untracked"):  # after the last eval batch: that eval step's tail
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
                 enable=True, interval=500, keep_latest_k=10, last_save_model_only=True):
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
                sd[k] = v.state_dict()  # the dataloader's: its Grain iterator's get_state()
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
            else:
                states = self._flattened_model_states_sd()
            self.dcp_save(states, checkpoint_id=checkpoint_id, enable_garbage_collection=True)
            self._purge_stale_checkpoints()
            logger.info(f"Finished saving the checkpoint in {time.monotonic() - begin:.2f} seconds.")
        return True

    def _purge_stale_checkpoints(self):
        if self.keep_latest_k <= 0:
            return
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
    @dataclass(kw_only=True, slots=True)
    class Config:
        enable: bool = False
        freq: int = 10
        steps: int = -1  # -1 consumes the finite dataset; otherwise the loader repeats
        dataloader: Any = field(default_factory=lambda: GrainDataLoader.Config(
            dataset=ConcatThenSplitPackingConfig(dataset=DATASETS["c4_validation"]), repeat=False))

    def __init__(self, config: Config, *, dp_world_size, dp_rank, tokenizer, parallel_dims, loss_fn,
                 validation_context, metrics_processor, seq_len, num_tokens_per_batch):
        self.config = config
        self.tokenizer, self.parallel_dims, self.loss_fn = tokenizer, parallel_dims, loss_fn
        # A bounded validation run repeats data; steps=-1 consumes one finite pass.
        self.dl_config = replace(config.dataloader, repeat=config.steps != -1)
        self.dp_world_size, self.dp_rank = dp_world_size, dp_rank
        self.seq_len, self.num_tokens_per_batch = seq_len, num_tokens_per_batch
        self.validation_context = validation_context
        self.metrics_processor = metrics_processor

    def should_validate(self, step: int) -> bool:
        return step == 1 or step % self.config.freq == 0

    def post_dataloading_process(self, input_dict, labels, model_parts):
        inputs = input_dict["input"]
        extra_kwargs = {k: v for k, v in input_dict.items() if k != "input"}
        positions = extra_kwargs.get("positions", None)
        if positions is not None:  # flex attention (the debug model's backend): document masks
            extra_kwargs["attention_masks"] = model_parts[0].get_attention_masks(positions=positions)
        return inputs, labels, extra_kwargs

    @torch.no_grad()
    def validate(self, model_parts: list, step: int) -> None:
        with truth.timed(TRAIN, "untracked"):  # before the first eval fetch: the train step's tail
            sl.add_step_tag("eval")
            for model in model_parts:
                model.eval()
            accumulated_loss = None
            device_type = "cpu"
            total_global_valid_tokens = torch.zeros((), dtype=torch.int64, device=device_type)
            num_steps = 0
            num_pp_microbatches = 1

        build_start = time.perf_counter()  # not in the original: the truth
        validation_dataloader = self.dl_config.build(
            dp_world_size=self.dp_world_size, dp_rank=self.dp_rank, tokenizer=self.tokenizer,
            max_context_length=self.seq_len, num_tokens_per_batch=self.num_tokens_per_batch)
        # truth: building the Grain graph is the train step's tail; from its iterator's
        # making (``iter(dataset)`` in ``GrainDataLoader.__init__``) the time is the first
        # eval step's wait (docs/steps.md: a loop's first wait holds its start-up)
        truth.add(TRAIN, "untracked", validation_dataloader._iter_started - build_start)
        fetch_start = validation_dataloader._iter_started

        validation_iterator = iter(iterate_and_close_dataloader(validation_dataloader))
        while True:
            if self.config.steps != -1 and num_steps >= self.config.steps:
                break
            try:
                microbatches = []
                local_valid_tokens = torch.tensor(0, dtype=torch.int64, device=device_type)
                for _ in range(num_pp_microbatches):
                    if fetch_start is None:  # not in the original: the truth
                        fetch_start = time.perf_counter()
                    input_dict, labels = next(validation_iterator)
                    truth.add(EVAL, "dataloader_next", time.perf_counter() - fetch_start)
                    fetch_start = None
                    self.metrics_processor.ntokens_since_last_log += labels.numel()
                    for k, v in input_dict.items():
                        input_dict[k] = v.to(device_type)
                    labels = labels.to(device_type)
                    local_valid_tokens += (labels != IGNORE_INDEX).sum()
                    microbatches.append((input_dict, labels))
            except StopIteration:
                truth.loop_end()  # (a repeating validation loader never ends)
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

        with truth.timed(EVAL, "untracked"):
            for model in model_parts:
                model.train()
        # (returning drops validation_iterator: its close() joins Grain's prefetch thread)


# -- torchtitan.tools.profiler.Profiler (profiling disabled: a no-op) ----------------------
class Profiler:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def step(self) -> None:
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
        self.loss_fn = CrossEntropyLoss()  # llama3_debugmodel_ce_loss

        self.num_pp_microbatches = 1
        num_tokens_per_dp_rank = NUM_TOKENS_PER_BATCH * self.num_pp_microbatches
        num_tokens_per_train_step = NUM_TOKENS_PER_TRAIN_STEP
        if num_tokens_per_train_step < 0:
            num_tokens_per_train_step = num_tokens_per_dp_rank * dp_degree
        if num_tokens_per_train_step % (num_tokens_per_dp_rank * dp_degree) != 0:
            raise ValueError("training.num_tokens_per_train_step must be divisible by the number of tokens "
                             "processed globally in one gradient accumulation iteration")
        self.gradient_accumulation_steps = num_tokens_per_train_step // (num_tokens_per_dp_rank * dp_degree)

        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        self.model_parts = [model]

        self.optimizers = OptimizersContainer(default_adamw(lr=8e-4), implementation="foreach",
                                              model_parts=self.model_parts)
        self.lr_schedulers = build_lr_schedulers(self.optimizers, training_steps=STEPS, warmup_steps=WARMUP,
                                                 decay_ratio=DECAY_RATIO, decay_type="linear", min_lr_factor=0.0)

        self.step = 0
        self.ntokens_seen = 0
        self.tokenizer = CharTokenizer()

        # build dataloader (llama3_8b's: the packed c4 stream, shuffled and repeated by default)
        self.dataloader = GrainDataLoader.Config(dataset=ConcatThenSplitPackingConfig(dataset=DATASETS["c4"])).build(
            dp_world_size=dp_degree, dp_rank=dp_rank, tokenizer=self.tokenizer,
            max_context_length=MAX_CONTEXT_LENGTH, num_tokens_per_batch=NUM_TOKENS_PER_BATCH)

        self.checkpointer = CheckpointManager(dataloader=self.dataloader, model_parts=self.model_parts,
                                              optimizers=self.optimizers, lr_schedulers=self.lr_schedulers,
                                              states={"train_state": self}, base_folder=dump_folder,
                                              interval=CKPT_INTERVAL, last_save_model_only=False)
        self.train_context = nullcontext
        self.fwd_bwd_fn = self._forward_backward_body  # disable_cuda_graphs: no wrap_with_cuda_graph
        self.validator_config = Validator.Config(enable=True, freq=VAL_FREQ, steps=VAL_STEPS)
        self.validator = Validator(self.validator_config, dp_world_size=dp_degree, dp_rank=dp_rank,
                                   tokenizer=self.tokenizer, parallel_dims=parallel_dims, loss_fn=self.loss_fn,
                                   validation_context=self.train_context,
                                   metrics_processor=self.metrics_processor, seq_len=MAX_CONTEXT_LENGTH,
                                   num_tokens_per_batch=NUM_TOKENS_PER_BATCH)
        self.max_norm = 1.0
        # truth: where the time between a step's last work and the next step's first fetch
        # goes (the first step's top: before it; after a validation: its last eval step)
        self._top_mode = BEFORE
        self._backward_passes = 0
        logger.info(f"Trainer is initialized with {num_tokens_per_dp_rank} tokens per DP rank, "
                    f"{num_tokens_per_train_step} tokens per train step, gradient accumulation steps "
                    f"{self.gradient_accumulation_steps}, maximum context length {MAX_CONTEXT_LENGTH}, "
                    f"total steps {STEPS} (warmup {WARMUP})")

    def batch_generator(self, data_iterable: Iterable) -> Iterator:
        data_iterator = iter(data_iterable)
        while True:
            data_load_start = time.perf_counter()
            try:
                batch = next(data_iterator)
            except StopIteration as ex:
                # If data runs out during gradient accumulation, that entire step will not be executed.
                raise DataloaderExhaustedError() from ex
            truth.add(TRAIN, "dataloader_next", time.perf_counter() - data_load_start)  # not in the original
            input_dict, labels = batch
            ntokens_batch = labels.numel()
            self.metrics_processor.ntokens_since_last_log += ntokens_batch
            self.metrics_processor.data_loading_times.append(time.perf_counter() - data_load_start)
            yield input_dict, labels

    def post_dataloading_process(self, input_dict, labels):
        inputs = input_dict["input"]
        extra_kwargs = {k: v for k, v in input_dict.items() if k != "input"}
        positions = extra_kwargs.get("positions", None)
        if positions is not None:  # flex attention (the debug model's backend): document masks
            extra_kwargs["attention_masks"] = self.model_parts[0].get_attention_masks(positions=positions)
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
        with truth.timed(self._top_mode, "untracked"):
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
        sl.log_trace_scalar({"local_valid_tokens": int(local_valid_tokens)})

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
        with sl.log_trace_span("collect_dist_metrics"):
            sl.log_trace_scalar({"global_valid_tokens": int(global_valid_tokens)})
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
                    with truth.timed(self._top_mode, "untracked"):
                        self.gc_handler.run(self.step)

                    try:
                        self.train_step(data_iterator)
                    except DataloaderExhaustedError:
                        logger.warning("Ran out of data; last step was canceled.")
                        break

                    self.checkpointer.save(self.step, last_step=(self.step == STEPS))

                    self._top_mode = TRAIN  # the next step's top is this train step's tail ...
                    if self.validator_config.enable and self.validator.should_validate(self.step):
                        self.validator.validate(self.model_parts, self.step)
                        self._top_mode = EVAL  # ... or the last eval step's, after a validation

                    profiler.step()
                    # (dist_utils.set_pg_timeouts after the first step: no process group)
        truth.stop()
        logger.info("Training completed")

    def should_continue_training(self) -> bool:
        return self.step < STEPS

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def close(self) -> None:
        if hasattr(self, "dataloader") and self.dataloader:
            self.dataloader.close()
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
    validations = len([s for s in range(1, STEPS + 1) if s == 1 or s % VAL_FREQ == 0])
    truth.notes.update(gradient_accumulation_steps=trainer.gradient_accumulation_steps,
                       optimizers_in_container=len(trainer.optimizers), validations=validations,
                       eval_batches_per_validation=VAL_STEPS, tokenize_delay_s=TOKENIZE_DELAY)
    shutil.rmtree(dump_folder, ignore_errors=True)
    truth.emit()


if __name__ == "__main__":
    main()
