"""The phase engine against torch features: AMP, DDP, user collectives, optimizer
wrappers, LR scheduler families."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tests.conftest import assert_close, make_dataset, make_model, span_duration, spin

STANDARD = ("step", (
    ("dataloader_next", ()),
    ("to_device", ()),
    ("train_batch", (("forward", ()), ("backward", ()), ("optimizer_step", ()))),
))


def test_amp_grad_scaler_step_is_the_optimizer_step(instrumented):
    """GradScaler.step reads found-inf with .item() before stepping: that read is part
    of optimizer_step, not a from_device that splits train_batch in two."""
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    assert scaler.is_enabled()
    for x, y in DataLoader(make_dataset(8), batch_size=4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    steps = tel.steps()
    assert len(steps) == 2
    for s in steps:
        assert s.tree() == STANDARD, s
    assert set(tel.phase_totals("step")) == {"dataloader_next", "to_device", "train_batch", "untracked"}


def test_amp_with_unscale_and_clipping(instrumented):
    tel = instrumented()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    for x, y in DataLoader(make_dataset(8), batch_size=4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        loss.item()
    for s in tel.steps():
        assert s.tree() == ("step", STANDARD[1] + (("from_device", ()),)), s


def test_disabled_grad_scaler(instrumented):
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for x, y in DataLoader(make_dataset(8), batch_size=4):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert [s.tree() for s in tel.steps()] == [STANDARD] * 2


@pytest.fixture
def gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_model_and_user_collectives(instrumented, gloo):
    from torch.nn.parallel import DistributedDataParallel as DDP

    tel = instrumented()
    inner = make_model()
    model = DDP(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(make_dataset(12), batch_size=4):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # user code reducing a metric
        mean.item()
    steps = tel.steps()
    assert len(steps) == 3
    # DDP's gradient sync: the wait after the last gradient is communication, inside backward
    ddp_batch = ("train_batch", (("forward", ()), ("backward", (("communication", ()),)), ("optimizer_step", ())))
    for s in steps:
        assert s.tree() == ("step", STANDARD[1][:2] + (ddp_batch, ("reduce_metrics", ()), ("from_device", ()))), s
    hooks = tel.runtime.module_hooks
    assert hooks.roots() == [model]  # DDP is the root; the wrapped module is not
    assert not inner._forward_pre_hooks and not inner._forward_hooks


def test_collectives_inside_forward_are_part_of_forward(instrumented, gloo):
    class Syncing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 2)

        def forward(self, x):
            out = self.lin(x)
            dist.all_reduce(out.detach().clone())
            return out

    tel = instrumented()
    model = Syncing()
    for x, y in DataLoader(make_dataset(8), batch_size=4):
        model(x)
    for s in tel.steps():
        assert s.tree() == ("step", (("dataloader_next", ()), ("to_device", ()),
                                     ("eval_batch", (("forward", ()),)))), s


def test_optimizer_wrapping_another_optimizer(instrumented):
    """An optimizer whose step calls an inner optimizer's step (Lookahead-style):
    one optimizer_step phase covering the whole outer step."""

    class Wrapper(torch.optim.Optimizer):
        def __init__(self, inner):
            self.inner = inner
            super().__init__([torch.zeros(1, requires_grad=True)], {})

        @torch.no_grad()
        def step(self, closure=None):
            self.inner.step()
            slept.append(spin(0.04))  # the outer optimizer's own work, after the inner step

    slept = []
    tel = instrumented()
    model = make_model()
    opt = Wrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in DataLoader(make_dataset(8), batch_size=4):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        y.tolist()
    for s, p in zip(tel.steps(), slept):
        assert s.tree() == ("step", STANDARD[1] + (("from_device", ()),)), s
        assert_close(s.total("optimizer_step"), p, what="optimizer_step")


def test_optimizer_step_that_raised_does_not_swallow_later_phases(instrumented):
    class Flaky(torch.optim.SGD):
        calls = 0

        def step(self, closure=None):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise FloatingPointError("nan")
            return super().step(closure)

    tel = instrumented()
    model = make_model()
    opt = Flaky(model.parameters(), lr=0.1)
    for x, y in DataLoader(make_dataset(4), batch_size=4):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        with pytest.raises(FloatingPointError):
            opt.step()
        spin(0.06)
        opt.step()  # retried: a phase of its own
        y.tolist()
    (s,) = tel.steps()
    assert s.top_level() == ["dataloader_next", "to_device", "train_batch", "from_device"]
    (batch,) = s.named("train_batch")
    assert [c.name for c in s.children(batch)] == ["forward", "backward", "optimizer_step", "optimizer_step"]
    first, second = s.named("optimizer_step")
    assert first.end_time <= second.start_time  # ended when the failed step was retried
    assert span_duration(second) < 0.03  # not from the failed step's end: that holds the 60 ms


@pytest.mark.parametrize("kind", ["step_lr", "sequential", "chained", "plateau", "onecycle"])
def test_lr_scheduler_families(instrumented, kind):
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    lrs = torch.optim.lr_scheduler
    if kind == "step_lr":
        sched = lrs.StepLR(opt, 1)
    elif kind == "sequential":
        sched = lrs.SequentialLR(opt, [lrs.LinearLR(opt), lrs.ExponentialLR(opt, 0.9)], milestones=[1])
    elif kind == "chained":
        sched = lrs.ChainedScheduler([lrs.LinearLR(opt), lrs.ExponentialLR(opt, 0.9)])
    elif kind == "plateau":
        sched = lrs.ReduceLROnPlateau(opt)
    else:
        sched = lrs.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    for x, y in DataLoader(make_dataset(12), batch_size=4):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if kind == "plateau":
            sched.step(loss.detach())
        else:
            sched.step()
    for s in tel.steps():
        assert s.tree() == ("step", STANDARD[1] + (("step_lr_schedulers", ()),)), s
