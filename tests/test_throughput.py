"""Throughput: samples and tokens per step, counted exactly, on real loops shaped like
real scripts -- nanoGPT's ``get_batch()`` loop (no DataLoader), a Hugging Face-style
dict batch with ``input_ids`` and a padding ``attention_mask`` (with and without a
DataLoader), and a DataLoader of token windows -- through the real SDK."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from tests.gpt_model import GPT, GPTConfig

CFG = GPTConfig(block_size=32, vocab_size=128, n_layer=1, n_head=2, n_embd=32)
PAD = 0


def _train_totals(tel):
    tel.uninstrument()
    summary = tel.runtime.summary_dict()
    train = summary["modes"]["train"]
    counter = sum(p.value for p in tel.points("training.tokens", {"training.mode": "train"}))
    samples = sum(p.value for p in tel.points("training.samples", {"training.mode": "train"}))
    return summary, train, counter, samples


def test_tokens_of_a_nanogpt_loop_without_dataloader(instrumented):
    """nanoGPT's train.py: get_batch() -> (x, y) of token ids, two micro-batches per
    update; tokens are x's elements (never y's), samples its rows."""
    tel = instrumented(trace_every_n=1)
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(CFG.vocab_size, (4096,))
    batch_size, accum, iters = 3, 2, 6

    def get_batch():
        ix = torch.randint(len(data) - CFG.block_size - 1, (batch_size,))
        x = torch.stack([data[i:i + CFG.block_size] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + CFG.block_size] for i in ix])
        return x, y

    x, y = get_batch()
    for _ in range(iters):
        for _ in range(accum):
            _, loss = model(x, y)
            x, y = get_batch()  # the next batch is fetched between forward and backward, as in nanoGPT
            (loss / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    per_step = batch_size * accum * CFG.block_size
    tel.uninstrument()  # the last step ends with the run (no next forward to cut it)
    steps = tel.steps()
    assert len(steps) == iters
    assert [s.attributes["training.step.tokens"] for s in steps] == [per_step] * iters
    assert [s.attributes["training.batch_size"] for s in steps] == [batch_size * accum] * iters
    summary, train, counter, samples = _train_totals(tel)
    assert train["tokens"] == counter == per_step * iters
    assert train["samples"] == samples == batch_size * accum * iters
    # over the train steps' own time; the step FLOPs were counted on is left out of both
    counted = per_step if "counted_step" in (train.get("flops") or {}) else 0
    assert train["tokens_per_s"] == pytest.approx((train["tokens"] - counted) / train["step_time_s"])


class _PaddedText(Dataset):
    """Sequences of random lengths; ``lengths`` is the truth."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.seqs = [torch.randint(1, CFG.vocab_size, (rng.randint(3, CFG.block_size),)) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i):
        return {"input_ids": self.seqs[i]}


def collate(items):
    """DataCollatorWithPadding's output: input_ids, attention_mask, labels (-100 on padding)."""
    longest = max(len(it["input_ids"]) for it in items)
    ids = torch.full((len(items), longest), PAD, dtype=torch.long)
    mask = torch.zeros((len(items), longest), dtype=torch.long)
    for row, it in enumerate(items):
        n = len(it["input_ids"])
        ids[row, :n] = it["input_ids"]
        mask[row, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class _HFStyleLM(torch.nn.Module):
    """A causal LM called the Hugging Face way: ``model(**batch)`` -> output with .loss."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(CFG)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits, _ = self.gpt(input_ids)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)
        return type("Out", (), {"loss": loss, "logits": logits})()


def _hf_loop(model, batches, opt):
    for batch in batches:
        out = model(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad()


def test_tokens_of_padded_batches_from_a_dataloader(instrumented):
    """A DataLoader of dict batches padded to the longest sequence: tokens are the
    attention mask's sum (padding excluded), exactly; the labels are no tokens."""
    tel = instrumented(trace_every_n=1)
    torch.manual_seed(0)
    data = _PaddedText(40)
    model = _HFStyleLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=8, collate_fn=collate)
    _hf_loop(model, loader, opt)
    truth = [sum(len(s) for s in data.seqs[i:i + 8]) for i in range(0, 40, 8)]
    padded = [8 * max(len(s) for s in data.seqs[i:i + 8]) for i in range(0, 40, 8)]
    assert truth != padded  # the padding is real
    steps = tel.steps()
    assert [s.attributes["training.step.tokens"] for s in steps] == truth
    summary, train, counter, samples = _train_totals(tel)
    assert train["tokens"] == counter == sum(truth)
    assert samples == 40


def test_tokens_of_padded_batches_without_dataloader(instrumented):
    """The same dict batches built in the loop and passed as ``model(**batch)``: read
    from the root module's forward inputs."""
    tel = instrumented(trace_every_n=1)
    torch.manual_seed(0)
    data = _PaddedText(30, seed=1)
    model = _HFStyleLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [collate([data[j] for j in range(i, i + 6)]) for i in range(0, 30, 6)]
    _hf_loop(model, batches, opt)
    tel.uninstrument()
    truth = [int(b["attention_mask"].sum()) for b in batches]
    assert [s.attributes["training.step.tokens"] for s in tel.steps()] == truth
    summary, train, counter, samples = _train_totals(tel)
    assert train["tokens"] == counter == sum(truth)
    assert train["samples"] == samples == 30


def test_positional_input_ids_with_a_keyword_mask(instrumented):
    """``model(input_ids, attention_mask=mask)``: the mask still excludes the padding."""
    tel = instrumented(trace_every_n=1)
    torch.manual_seed(0)
    data = _PaddedText(12, seed=2)
    model = _HFStyleLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [collate([data[j] for j in range(i, i + 4)]) for i in range(0, 12, 4)]
    for b in batches:
        model(b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss.backward()
        opt.step()
        opt.zero_grad()
    tel.uninstrument()
    assert [s.attributes["training.step.tokens"] for s in tel.steps()] == [int(b["attention_mask"].sum())
                                                                          for b in batches]


def test_tokens_of_a_dataloader_of_token_windows_and_none_for_images(instrumented):
    """A DataLoader of (x, y) token windows: B x T tokens a step. An image loop (float
    inputs, integer labels of rank 1) has samples and no tokens."""
    tel = instrumented(trace_every_n=1)
    torch.manual_seed(0)
    data = torch.randint(CFG.vocab_size, (2000,))
    windows = [(data[i:i + CFG.block_size], data[i + 1:i + 1 + CFG.block_size]) for i in range(0, 1000, 50)]
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in DataLoader(windows, batch_size=4):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert [s.attributes["training.step.tokens"] for s in tel.steps()] == [4 * CFG.block_size] * 5
    summary, train, counter, samples = _train_totals(tel)
    assert counter == 20 * CFG.block_size and samples == 20

    tel2 = instrumented(trace_every_n=1)
    convnet = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 10))
    images = [(torch.randn(3, 8, 8), i % 10) for i in range(12)]
    opt = torch.optim.SGD(convnet.parameters(), lr=0.01)
    for x, y in DataLoader(images, batch_size=4):
        torch.nn.functional.cross_entropy(convnet(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert all("training.step.tokens" not in s.attributes for s in tel2.steps())
    summary, train, counter, samples = _train_totals(tel2)
    assert train["tokens"] == 0 and counter == 0 and samples == 12
    assert "tokens/s" not in _render(summary) and "samples/s" in _render(summary)


def _render(summary):
    from otel_training.diagnosis.summary_text import render_summary

    return render_summary(summary)


def test_the_run_end_table_shows_tokens_per_second(instrumented):
    tel = instrumented()
    torch.manual_seed(0)
    data = _PaddedText(16, seed=3)
    model = _HFStyleLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _hf_loop(model, DataLoader(data, batch_size=4, collate_fn=collate), opt)
    summary, train, _, _ = _train_totals(tel)
    text = _render(summary)
    assert f"{train['tokens_per_s']:,.0f} tokens/s" in text
    assert "samples/s" in text


def test_samples_of_a_graph_loop_are_its_graphs(instrumented):
    """PyTorch Geometric's examples/mutag_gin.py: ``for data in train_loader``, where
    a batch is a ``torch_geometric.data.Batch`` (no tensor, sequence or mapping): its
    samples are its graphs (``num_graphs``), the short last batch included; ``test()``
    batches (eval mode, no no_grad) are eval steps with their graphs too."""
    pyg = pytest.importorskip("torch_geometric")
    from torch.nn import Linear, ReLU, Sequential
    from torch_geometric.data import Data
    from torch_geometric.loader import DataLoader as GraphLoader
    from torch_geometric.nn import GINConv, global_add_pool

    del pyg
    tel = instrumented(trace_every_n=1)
    torch.manual_seed(0)
    gen = random.Random(4)
    graphs = []
    for _ in range(22):
        n = gen.randint(4, 9)
        edges = torch.randint(n, (2, 2 * n))
        graphs.append(Data(x=torch.randn(n, 7), edge_index=edges, y=torch.tensor([gen.randint(0, 1)])))
    train_loader = GraphLoader(graphs[4:], batch_size=8)  # 18 graphs: 8, 8, 2
    test_loader = GraphLoader(graphs[:4], batch_size=8)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = GINConv(Sequential(Linear(7, 16), ReLU(), Linear(16, 16)))
            self.fc = Linear(16, 2)

        def forward(self, x, edge_index, batch):
            x = torch.relu(self.conv1(x, edge_index))
            return torch.log_softmax(self.fc(global_add_pool(x, batch)), dim=-1)

    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _epoch in range(2):
        model.train()
        loss_all = 0.0
        for data in train_loader:
            optimizer.zero_grad()
            output = model(data.x, data.edge_index, data.batch)
            loss = torch.nn.functional.nll_loss(output, data.y)
            loss.backward()
            loss_all += loss.item() * data.num_graphs
            optimizer.step()
        model.eval()
        for data in test_loader:
            model(data.x, data.edge_index, data.batch).max(dim=1)[1].eq(data.y).sum().item()
    tel.uninstrument()
    sizes = {mode: [s.attributes.get("training.batch_size") for s in tel.steps() if s.attributes["training.mode"] == mode]
             for mode in ("train", "eval")}
    assert sizes == {"train": [8, 8, 2] * 2, "eval": [4] * 2}
    summary = tel.runtime.summary_dict()
    assert summary["modes"]["train"]["samples"] == 36
    assert sum(p.value for p in tel.points("training.samples", {"training.mode": "train"})) == 36
    assert "samples/s" in _render(summary)


class _Jagged:
    """Sparse ids as values and lengths (what torchrec's KeyedJaggedTensor holds): no
    ``shape``, so it never counts as the batch's first tensor."""

    def __init__(self, values, lengths):
        self.values, self.lengths = values, lengths


def test_samples_of_dataclass_batches(instrumented):
    """torchrec's ``datasets/utils.py`` ``Batch``: a dataclass of dense features, jagged
    sparse features and labels, yielded ready-made by an IterableDataset through a
    ``DataLoader(batch_size=None)`` (torchrec's RandomRecDataset): samples are the first
    tensor field's rows; a dataclass of ``input_ids`` and ``attention_mask`` counts the
    mask's tokens, as a dict batch does."""
    from dataclasses import dataclass

    @dataclass
    class Batch:
        dense_features: torch.Tensor
        sparse_features: _Jagged
        labels: torch.Tensor

    class RandomRecDataset(torch.utils.data.IterableDataset):
        def __init__(self, sizes):
            self.sizes = sizes

        def __iter__(self):
            for b in self.sizes:
                lengths = torch.randint(1, 4, (b,))
                yield Batch(torch.randn(b, 13), _Jagged(torch.randint(100, (int(lengths.sum()),)), lengths),
                            torch.randint(2, (b,)).float())

    class DLRM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.EmbeddingBag(100, 8, mode="sum")
            self.top = torch.nn.Linear(13 + 8, 1)

        def forward(self, dense, sparse):
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), sparse.lengths.cumsum(0)[:-1]])
            return self.top(torch.cat([dense, self.emb(sparse.values, offsets)], dim=1)).squeeze(1)

    tel = instrumented(trace_every_n=1)
    torch.manual_seed(0)
    model = DLRM()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    sizes = [16, 16, 9]
    for batch in DataLoader(RandomRecDataset(sizes), batch_size=None):
        logits = model(batch.dense_features, batch.sparse_features)
        torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels).backward()
        opt.step()
        opt.zero_grad()
    tel.uninstrument()
    assert [s.attributes.get("training.batch_size") for s in tel.steps()] == sizes
    assert tel.runtime.summary_dict()["modes"]["train"]["samples"] == sum(sizes)

    @dataclass
    class TextBatch:
        input_ids: torch.Tensor
        attention_mask: torch.Tensor

    tel2 = instrumented(trace_every_n=1)
    lm = _HFStyleLM()
    opt = torch.optim.SGD(lm.parameters(), lr=0.01)
    texts = [b for b in DataLoader(_PaddedText(12, seed=5), batch_size=4, collate_fn=collate)]
    for b in DataLoader(texts, batch_size=None, collate_fn=lambda b: TextBatch(b["input_ids"], b["attention_mask"])):
        lm(b.input_ids, attention_mask=b.attention_mask, labels=b.input_ids).loss.backward()
        opt.step()
        opt.zero_grad()
    tel2.uninstrument()
    assert [s.attributes["training.step.tokens"] for s in tel2.steps()] == [int(b["attention_mask"].sum())
                                                                            for b in texts]
    assert [s.attributes["training.batch_size"] for s in tel2.steps()] == [4, 4, 4]


def test_samples_when_micro_batches_are_fetched_first_or_one_ahead(instrumented):
    """torchtitan's train_step fetches all its micro-batches first (``next(data_iterator)``
    per micro-batch, then forward and backward per micro-batch): every fetched batch is
    the step's. A loader wrapper one batch ahead (accelerate's DataLoaderShard) hands out
    the batch fetched in the step before: one batch a step, the last one of each loop too."""
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    data = torch.randint(CFG.vocab_size, (4000,))
    windows = [(data[i:i + CFG.block_size], data[i + 1:i + 1 + CFG.block_size]) for i in range(0, 2400, 40)]

    def batch_generator(loader):  # torchtitan's Trainer.batch_generator
        for x, y in iter(loader):
            yield x, y

    tel = instrumented(trace_every_n=1)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data_iterator = batch_generator(DataLoader(windows, batch_size=4))
    for _step in range(5):
        microbatches = [next(data_iterator) for _ in range(3)]
        for x, y in microbatches:
            _, loss = model(x, y)
            (loss / 3).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    tel.uninstrument()
    assert [s.attributes["training.batch_size"] for s in tel.steps()] == [12] * 5
    assert [s.attributes["training.step.tokens"] for s in tel.steps()] == [12 * CFG.block_size] * 5
    summary, train, counter, samples = _train_totals(tel)
    assert samples == 60 and counter == train["tokens"] == 60 * CFG.block_size

    tel2 = instrumented(trace_every_n=1)
    accelerator = accelerate.Accelerator(cpu=True)
    model = GPT(CFG)
    model, opt, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                             DataLoader(windows[:12], batch_size=4))
    for _epoch in range(2):
        for x, y in loader:
            _, loss = model(x, y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
    tel2.uninstrument()
    assert [s.attributes.get("training.batch_size") for s in tel2.steps()] == [4] * 6
    summary, train, counter, samples = _train_totals(tel2)
    assert samples == 24 and counter == 24 * CFG.block_size


def test_a_second_instrumentation_on_the_same_providers_is_what_the_instruments_read():
    """The SDK gives the same meter back and keeps an instrument's first callbacks: after
    uninstrument and instrument again on the same providers, the token counter goes on
    from the first run's total and the memory gauge reads the new run."""
    import dataclasses
    import mmap

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider

    from otel_training.config import load_config
    from otel_training.instrumentor import TrainingInstrumentor

    def points(name):
        data = reader.get_metrics_data()
        return [(dict(p.attributes), p.value) for rm in data.resource_metrics for sm in rm.scope_metrics
                for m in sm.metrics if m.name == name for p in m.data.data_points]

    config = dataclasses.replace(load_config({}), hardware=False, gpu_timing="off", summary=False, integrations=())
    reader = InMemoryMetricReader()
    mp, tp = MeterProvider(metric_readers=[reader]), TracerProvider()
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(CFG.vocab_size, (2, CFG.block_size))
    tokens, rss = [], []
    for steps in (3, 2):
        inst = TrainingInstrumentor()
        inst.instrument(tracer_provider=tp, meter_provider=mp, config=config)
        kept = None
        if steps == 2:  # 100 MB more in the second run: fresh pages (a malloc may reuse freed, resident heap)
            kept = mmap.mmap(-1, 100 << 20)
            kept.write(b"\1" * (100 << 20))
        for _ in range(steps):
            _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        inst.uninstrument()
        tokens.append(sum(v for a, v in points("training.tokens") if a.get("training.mode") == "train"))
        ((_, value),) = points("training.memory.rss")
        rss.append(value)
        if kept is not None:
            kept.close()
    assert tokens == [3 * x.numel(), 5 * x.numel()]
    assert rss[1] > rss[0] + 50e6
    tp.shutdown()
    mp.shutdown()
