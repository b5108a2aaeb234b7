"""The phase engine on real torch loops: names, nesting, sums and planted delays."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import otel_training
from tests.conftest import assert_close, assert_planted, make_dataset, make_model, span_duration, spin, train_step

BATCH = 4
N = 16  # 4 steps per epoch


def _loop(epochs=1, loader=None, user_delay=0.0, phase_delay=0.0, sched=True, planted=None):
    """A standard training loop; ``planted`` (a dict) collects the delays really
    slept per step: ``user`` (plain user code) and ``log`` (inside phase("log"))."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    loader = loader or DataLoader(make_dataset(N), batch_size=BATCH)
    planted = planted if planted is not None else {}
    for _ in range(epochs):
        for x, y in loader:
            out = model(x)
            loss = loss_fn(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if sched:
                scheduler.step()
            if user_delay:
                planted.setdefault("user", []).append(spin(user_delay))  # outside every phase
            if phase_delay:
                with otel_training.phase("log"):
                    planted.setdefault("log", []).append(spin(phase_delay))
            loss.item()
    return model


def test_phase_names_and_nesting(instrumented):
    tel = instrumented()
    _loop()
    steps = tel.steps()
    assert [s.index for s in steps] == [0, 1, 2, 3]
    for s in steps:
        assert s.mode == "train"
        assert s.attributes["training.epoch"] == 0
        assert s.attributes["training.batch_size"] == BATCH
        assert s.tree() == ("step", (
            ("dataloader_next", ()),
            ("to_device", ()),
            # model then loss module: one forward (the loss continues it)
            ("train_batch", (("forward", ()), ("backward", ()), ("optimizer_step", ()))),
            ("step_lr_schedulers", ()),
            ("from_device", ()),
        )), s
        # children lie inside their parents, and siblings do not overlap
        for span in s.spans:
            parent = s.parent_of(span)
            if parent is not None:
                assert parent.start_time <= span.start_time <= span.end_time <= parent.end_time
        kids = s.children()
        for a, b in zip(kids, kids[1:]):
            assert a.end_time <= b.start_time
        assert kids[0].start_time == s.root.start_time  # the step begins waiting for its batch
    assert steps[0].attributes["training.trace.reason"] == "first"
    assert {s.attributes["training.trace.reason"] for s in steps[1:]} == {"sampled"}
    assert steps[0].attributes["training.timing"] == "off"


def test_steps_are_contiguous_and_numbered_across_epochs(instrumented):
    tel = instrumented()
    _loop(epochs=3)
    tel.uninstrument()
    steps = tel.steps()
    # StopIteration at each epoch end makes no (empty) step and burns no index
    assert [s.index for s in steps] == list(range(12))
    assert [s.attributes["training.epoch"] for s in steps] == [0] * 4 + [1] * 4 + [2] * 4
    for a, b in zip(steps, steps[1:]):
        if a.attributes["training.epoch"] == b.attributes["training.epoch"]:
            assert a.root.end_time == b.root.start_time  # one __next__ to the next
    assert all(s.named("train_batch") for s in steps)
    counts = tel.points("training.steps", {"training.mode": "train"})
    assert sum(p.value for p in counts) == 12
    samples = tel.points("training.samples", {"training.mode": "train"})
    assert sum(p.value for p in samples) == 12 * BATCH


def test_top_level_phases_and_untracked_add_up_to_the_step(instrumented):
    tel = instrumented()
    _loop(user_delay=0.01)
    steps = tel.steps()
    for s in steps:
        covered = sum(span_duration(c) for c in s.children())
        untracked = s.attributes["training.untracked.duration"]
        assert covered + untracked == pytest.approx(s.duration, abs=1e-6)
        assert untracked >= 0.01
    # the metric view: phases with parent "step" (untracked included) sum to the step time
    totals = tel.phase_totals("step")
    step_sum = sum(p.value for p in tel.points("training.step.duration"))
    assert set(totals) == {"dataloader_next", "to_device", "train_batch", "step_lr_schedulers",
                           "from_device", "untracked"}
    assert sum(totals.values()) == pytest.approx(step_sum, rel=1e-6)
    # children of train_batch are reported with parent train_batch and fit inside it
    children = tel.phase_totals("train_batch")
    assert set(children) == {"forward", "backward", "optimizer_step"}
    assert sum(children.values()) <= totals["train_batch"] + 1e-9
    # one phase point per (phase, parent), recorded once per step
    for p in tel.points("training.phase.duration", {"training.phase": "step_lr_schedulers"}):
        assert p.count == len(steps)
        assert p.attributes["training.phase.parent"] == "step"
        assert p.attributes["training.mode"] == "train"


def test_planted_delays_are_recovered(instrumented):
    per_item, user, in_phase = 0.015, 0.05, 0.05
    tel = instrumented()
    dataset = make_dataset(N, delay=per_item)
    planted = {}
    _loop(loader=DataLoader(dataset, batch_size=BATCH), user_delay=user, phase_delay=in_phase, planted=planted)
    tel.uninstrument()
    steps = tel.steps()
    assert len(steps) == 4
    waits = [sum(dataset.slept[i * BATCH:(i + 1) * BATCH]) for i in range(4)]
    # Beside each delay, in its phase: the fetch's own work (dataloader_next), zero_grad and
    # the loop's glue (untracked), entering and leaving the phase (log). A misbooked 50 ms
    # phase would overshoot these; a lost delay falls under the low side.
    around = {"dataloader_next": 0.01, "untracked": 0.025, "log": 0.005}
    for s, wait, u, log_s in zip(steps, waits, planted["user"], planted["log"]):
        assert_planted(s.total("dataloader_next"), wait, "dataloader_next", around["dataloader_next"])
        assert_planted(s.attributes["training.untracked.duration"], u, "untracked", around["untracked"])
        (log,) = s.named("log")
        assert s.parent_of(log) is s.root
        assert_planted(span_duration(log), log_s, "phase('log')", around["log"])
    totals = tel.phase_totals("step")
    n = len(steps)
    assert_planted(totals["dataloader_next"], sum(waits), "metric dataloader_next", n * around["dataloader_next"])
    assert_planted(totals["untracked"], sum(planted["user"]), "metric untracked", n * around["untracked"])
    assert_planted(totals["log"], sum(planted["log"]), "metric log", n * around["log"])


class _SlowLoss(torch.nn.Module):
    """A loss module with a planted delay."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay, self.slept = delay, []

    def forward(self, out, y):
        self.slept.append(spin(self.delay))
        return torch.nn.functional.cross_entropy(out, y)


class _SlowModel(torch.nn.Module):
    """A model with a planted delay in its forward and another in its backward."""

    def __init__(self, delay: float, backward_delay: float = 0.0) -> None:
        super().__init__()
        self.inner, self.delay, self.slept = make_model(), delay, []
        self.backward_delay, self.backward_slept = backward_delay, []

    def forward(self, x):
        self.slept.append(spin(self.delay))
        out = self.inner(x)
        if self.backward_delay:
            out.register_hook(lambda grad: self.backward_slept.append(spin(self.backward_delay)))
        return out


def test_the_loss_module_continues_the_models_forward(instrumented):
    """model(x) then loss_fn(out, y): one forward phase holding both, not two;
    a forward after a backward (gradient accumulation) is a phase of its own."""
    tel = instrumented()
    model, loss_fn = _SlowModel(0.01, backward_delay=0.06), _SlowLoss(0.02)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(make_dataset(12), batch_size=4):
        for _ in range(2):  # two micro-batches: forward, backward, forward, backward
            loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    steps = tel.steps()
    assert len(steps) == 3
    for i, s in enumerate(steps):
        (batch,) = s.named("train_batch")
        kids = s.children(batch)
        assert [c.name for c in kids] == ["forward", "backward", "forward", "backward", "optimizer_step"]
        for k in (0, 1):
            planted = model.slept[2 * i + k] + loss_fn.slept[2 * i + k]
            measured = span_duration(kids[2 * k])
            # holds the loss's delay, and stops where the backward (and its planted delay) starts;
            # the upper bound leaves room for a loaded machine, not for the backward's 60 ms
            assert planted <= measured < planted + 0.03, (measured, planted)
            assert span_duration(kids[2 * k + 1]) >= model.backward_slept[2 * i + k]


def test_to_device_is_the_time_between_batch_and_forward(instrumented):
    tel = instrumented()
    model = make_model()
    planted = []
    for x, y in DataLoader(make_dataset(8), batch_size=4):
        planted.append(spin(0.04))  # stands in for x.to(device)
        x = x.to(torch.float32)
        model(x)
    steps = tel.steps()
    assert len(steps) == 2
    for s, p in zip(steps, planted):
        assert_close(s.total("to_device"), p, what="to_device")
        assert s.top_level()[:3] == ["dataloader_next", "to_device", "eval_batch"]


def test_eval_loop_under_no_grad_is_eval(instrumented):
    tel = instrumented()
    model = make_model()
    with torch.no_grad():
        for x, y in DataLoader(make_dataset(8), batch_size=4):
            model(x).argmax(1).tolist()
    steps = tel.steps()
    assert [s.mode for s in steps] == ["eval", "eval"]
    for s in steps:
        assert s.tree() == ("step", (("dataloader_next", ()), ("to_device", ()),
                                     ("eval_batch", (("forward", ()),)), ("from_device", ())))
    assert tel.points("training.step.duration", {"training.mode": "eval"})
    assert not tel.points("training.step.duration", {"training.mode": "train"})
    assert set(tel.phase_totals("eval_batch", mode="eval")) == {"forward"}


def test_eval_loop_without_no_grad_is_eval(instrumented):
    tel = instrumented()
    model = make_model()
    for x, y in DataLoader(make_dataset(8), batch_size=4):
        torch.nn.functional.cross_entropy(model(x), y).item()
    assert [s.mode for s in tel.steps()] == ["eval", "eval"]


def test_gradient_accumulation_within_one_batch(instrumented):
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(make_dataset(16), batch_size=8):
        opt.zero_grad()
        for xs, ys in zip(x.chunk(4), y.chunk(4)):  # micro-batches
            torch.nn.functional.cross_entropy(model(xs), ys).backward()
        opt.step()
    steps = tel.steps()
    assert len(steps) == 2
    for s in steps:
        (batch,) = s.named("train_batch")
        assert [c.name for c in s.children(batch)] == ["forward", "backward"] * 4 + ["optimizer_step"]
        assert s.attributes["training.step.microbatches"] == 4  # the chunks: micro-batches


def test_gradient_accumulation_across_batches(instrumented):
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(DataLoader(make_dataset(16), batch_size=4)):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
    # A training step is one optimizer update (docs/steps.md): the two batches of
    # each update are one step of two micro-batches, each with its own wait.
    steps = tel.steps()
    assert [s.mode for s in steps] == ["train"] * 2
    for s in steps:
        assert s.attributes["training.step.microbatches"] == 2
        assert s.top_level() == ["dataloader_next", "to_device", "train_batch"] * 2
        assert [len(s.named(n)) for n in ("forward", "backward", "optimizer_step")] == [2, 2, 1]
    assert sum(p.value for p in tel.points("training.microbatches")) == 4
    assert sum(p.value for p in tel.points("training.steps")) == 2


def test_several_loaders_enumerate_and_zip(instrumented):
    tel = instrumented()
    model = make_model()
    a = DataLoader(make_dataset(12, delay=0.002), batch_size=4)
    b = DataLoader(make_dataset(12, delay=0.002), batch_size=4)
    for i, ((xa, ya), (xb, yb)) in enumerate(zip(a, b)):
        model(xa + xb)
    steps = tel.steps()
    assert len(steps) == 3  # one step per zipped pair, not per __next__
    for i, s in enumerate(steps):
        assert s.top_level()[:3] == ["dataloader_next", "dataloader_next", "to_device"]
        # both waits: at least the two batches' sleeps as they happened, and their fetches
        slept = sum(a.dataset.slept[4 * i:4 * i + 4]) + sum(b.dataset.slept[4 * i:4 * i + 4])
        assert slept * 0.9 <= s.total("dataloader_next") <= slept * 1.5 + 0.005, (s.total("dataloader_next"), slept)


def test_nested_eval_loop_inside_the_train_loop(instrumented):
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(make_dataset(8), batch_size=4)
    val = DataLoader(make_dataset(12), batch_size=4)
    for epoch in range(2):
        for batch in train:
            train_step(model, opt, batch)
        with torch.no_grad():
            for x, y in val:
                model(x)
    tel.uninstrument()
    steps = tel.steps()
    assert [s.mode for s in steps] == (["train"] * 2 + ["eval"] * 3) * 2
    # training.step: train steps numbered as the global step, eval steps apart
    assert [s.index for s in steps] == [0, 1, 0, 1, 2, 2, 3, 3, 4, 5]
    assert [s.attributes["training.epoch"] for s in steps] == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    for s in steps:
        assert s.top_level().count("dataloader_next") == 1


def test_iterable_dataset(instrumented):
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            for i in range(12):
                yield torch.randn(8), torch.tensor(i % 2)

    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for batch in DataLoader(Stream(), batch_size=4):
            train_step(model, opt, batch)
    steps = tel.steps()
    assert [s.index for s in steps] == list(range(6))
    assert all(s.attributes["training.batch_size"] == 4 for s in steps)
    assert all(s.top_level()[0] == "dataloader_next" for s in steps)


def test_break_out_of_a_loop_then_a_new_epoch(instrumented):
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(make_dataset(16), batch_size=4)
    for i, batch in enumerate(loader):
        train_step(model, opt, batch)
        if i == 1:
            break
    for batch in loader:
        train_step(model, opt, batch)
    tel.uninstrument()
    steps = tel.steps()
    assert [s.index for s in steps] == list(range(6))
    assert [s.attributes["training.epoch"] for s in steps] == [0, 0, 1, 1, 1, 1]
    for s in steps:
        assert s.top_level().count("dataloader_next") == 1
        assert s.top_level().count("train_batch") == 1


def test_worker_start_up_lands_in_the_first_step(instrumented):
    import time

    tel = instrumented()
    model = make_model()
    loader = DataLoader(make_dataset(16), batch_size=4, num_workers=2)
    t0 = time.perf_counter()
    it = iter(loader)  # forks the workers
    startup = time.perf_counter() - t0
    for x, y in it:
        model(x)
    steps = tel.steps()
    assert len(steps) == 4
    first = steps[0]
    (wait,) = first.named("dataloader_next")
    assert wait.start_time == first.root.start_time
    assert span_duration(wait) >= startup


def test_slow_sampler_start_up_counts_in_first_dataloader_next(instrumented):
    from torch.utils.data import Sampler

    class SlowStartSampler(Sampler):
        """Eager __iter__: its cost is paid inside DataLoader.__iter__."""

        def __init__(self, n):
            self.n = n

        def __iter__(self):
            slept.append(spin(0.05))
            return iter(range(self.n))

        def __len__(self):
            return self.n

    slept = []
    tel = instrumented()
    model = make_model()
    for x, y in DataLoader(make_dataset(8), batch_size=4, sampler=SlowStartSampler(8)):
        model(x)
    steps = tel.steps()
    assert len(steps) == 2
    got = steps[0].total("dataloader_next")  # start-up + first batch: the sampler's 50 ms and a fetch
    assert slept[0] <= got <= slept[0] * 1.1 + 0.01, (got, slept[0])
    assert steps[1].total("dataloader_next") < 0.025  # the 50 ms start-up is the first step's


def test_generator_loop_without_dataloader_makes_implicit_steps(instrumented):
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.CrossEntropyLoss()  # a second root module inside each step

    def batches():
        for _ in range(4):
            spin(0.005)
            yield torch.randn(4, 8), torch.randint(0, 2, (4,))

    for x, y in batches():
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    tel.uninstrument()
    steps = tel.steps()
    assert [s.index for s in steps] == [0, 1, 2, 3]
    for s in steps:
        assert s.mode == "train"
        (batch,) = s.named("train_batch")
        assert [c.name for c in s.children(batch)] == ["forward", "backward", "optimizer_step"]
        assert s.root.start_time == batch.start_time  # implicit steps begin at the forward


def test_generator_eval_loop_without_dataloader(instrumented):
    tel = instrumented()
    model = make_model()
    loss_fn = torch.nn.CrossEntropyLoss()
    with torch.no_grad():
        for _ in range(3):
            x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
            loss_fn(model(x), y)
    tel.uninstrument()
    steps = tel.steps()
    assert [s.mode for s in steps] == ["eval"] * 3
    for s in steps:
        assert [c.name for c in s.children(s.named("eval_batch")[0])] == ["forward"]


def test_generator_loop_after_a_dataloader_epoch(instrumented):
    """Once a DataLoader loop has ended, loops without a DataLoader still make steps."""
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in DataLoader(make_dataset(8), batch_size=4):
        train_step(model, opt, batch)
    for _ in range(3):
        train_step(model, opt, (torch.randn(4, 8), torch.randint(0, 2, (4,))))
    tel.uninstrument()
    steps = tel.steps()
    assert [s.index for s in steps] == list(range(5))
    assert [s.top_level()[0] for s in steps] == ["dataloader_next"] * 2 + ["train_batch"] * 3


def test_user_reseeding_python_random_does_not_repeat_trace_ids(instrumented):
    """Loops reseed ``random`` (and torch.compile saves/restores its state): span ids
    must not come from the global generator, or traces merge and repeat across ranks."""
    import random

    tel = instrumented()
    model = make_model()
    for x, y in DataLoader(make_dataset(12), batch_size=4):
        random.seed(1234)
        model(x)
        tel.flush()  # the previous step's spans are made right after the reseed
    tel.uninstrument()
    spans = tel.spans()
    assert len({s.context.trace_id for s in spans if s.parent is None}) == 3
    assert len({s.context.span_id for s in spans}) == len(spans)


def test_dataloader_iterated_by_a_prefetch_thread(instrumented):
    """A background thread iterates the DataLoader into a queue; the main thread
    trains. Steps follow the training thread (implicit steps at its forwards)."""
    import queue
    import threading

    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    q: "queue.Queue" = queue.Queue()

    def prefetch():
        for batch in DataLoader(make_dataset(16), batch_size=4):
            q.put(batch)
        q.put(None)

    t = threading.Thread(target=prefetch)
    t.start()
    t.join(timeout=30)  # the prefetch thread is the first to touch the DataLoader
    while True:
        with otel_training.phase("wait_queue"):
            batch = q.get()
        if batch is None:
            break
        train_step(model, opt, batch)
    tel.uninstrument()
    traces = tel.steps()
    # The first wait on the queue comes before the first forward, with no step open:
    # named time between steps, a span of its own (the later waits are in the open step).
    between = [t for t in traces if t.root.name != "step"]
    assert [(t.root.name, t.mode, t.index) for t in between] == [("wait_queue", "between_steps", None)]
    steps = [t for t in traces if t.root.name == "step"]
    assert between[0].root.end_time <= steps[0].root.start_time
    assert [s.index for s in steps] == [0, 1, 2, 3]
    assert [len(s.named("wait_queue")) for s in steps] == [1, 1, 1, 1]
    for s in steps:
        assert s.mode == "train"
        assert "dataloader_next" not in s.names()
        assert s.top_level()[:1] == ["train_batch"]
        (batch,) = s.named("train_batch")
        assert [c.name for c in s.children(batch)] == ["forward", "backward", "optimizer_step"]


def test_training_loop_in_a_worker_thread(instrumented):
    """Some launchers run the training function in a thread other than the main one."""
    import threading

    tel = instrumented()
    errors = []

    def train():
        try:
            model = make_model()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for batch in DataLoader(make_dataset(16), batch_size=4):
                train_step(model, opt, batch)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=train)
    t.start()
    t.join(timeout=60)
    assert not errors
    tel.uninstrument()
    steps = tel.steps()
    # the thread is known from its first forward on: the first wait is missed
    assert [s.index for s in steps] == [0, 1, 2, 3]
    assert all(s.mode == "train" for s in steps)
    assert [s.top_level()[0] for s in steps] == ["train_batch"] + ["dataloader_next"] * 3
