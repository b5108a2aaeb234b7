"""Compatibility: per-step hook cost independent of model size, torch.compile
without added graph breaks or recompiles, and an exact restore on uninstrument."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.modules import module as module_mod
from torch.optim import optimizer as optimizer_mod
from torch.utils.data import DataLoader
from torch.utils.data import dataloader as dataloader_mod

import otel_training
from tests.conftest import make_dataset, make_model, train_step

STANDARD_BATCH = (("forward", ()), ("backward", ()), ("optimizer_step", ()))


def _module_global_hooks() -> dict:
    """Every module-level ``_global_*`` hook dict of torch.nn.modules.module."""
    return {k: dict(v) for k, v in vars(module_mod).items() if k.startswith("_global_") and isinstance(v, dict)}


# -- per-step cost: hooks on roots only -------------------------------------------------------
def test_the_flop_count_leaves_no_global_hook_behind(instrumented):
    """The FLOP count's one measured step runs under FlopCounterMode (global module hooks
    of its own); once it is over, the loop runs with no global hook again."""
    baseline = _module_global_hooks()
    tel = instrumented()  # FLOPs counted (the default)
    model = make_model(depth=3)
    loss_fn = torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for x, y in DataLoader(make_dataset(32), batch_size=4):
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    tel.uninstrument()
    flops = tel.runtime.summary_dict()["modes"]["train"].get("flops") or {}
    assert flops, "no FLOP count in the summary"
    assert _module_global_hooks() == baseline
    assert torch._C._len_torch_dispatch_stack() == 0


def test_only_root_modules_keep_hooks_after_the_first_step(instrumented):
    baseline = _module_global_hooks()
    # (FLOPs off: the one step the FLOP count measures runs under FlopCounterMode, whose
    # module tracker holds global hooks of its own for that step; tests/test_flops.py.)
    tel = instrumented(flops_per_step=0)
    armed = _module_global_hooks()
    assert len(armed["_global_forward_pre_hooks"]) == len(baseline["_global_forward_pre_hooks"]) + 1
    model = make_model(depth=12)  # 25 submodules
    loss_fn = torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for i, (x, y) in enumerate(DataLoader(make_dataset(16), batch_size=4)):
        if i >= 1:  # the first step has ended: discovery is over
            seen.append(_module_global_hooks())
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert seen and all(s == baseline for s in seen)  # the global pre-hook is gone
    roots = tel.runtime.module_hooks.roots()
    assert set(map(id, roots)) == {id(model), id(loss_fn)}
    for root in (model, loss_fn):  # timed by their own call, not torch's (slower) hook path
        assert "_call_impl" in vars(root)
        assert not root._forward_pre_hooks and not root._forward_hooks
    subs = list(model.modules())[1:]
    assert len(subs) == 25
    for sub in subs:
        assert "_call_impl" not in vars(sub)
        assert not sub._forward_pre_hooks and not sub._forward_hooks
        assert not sub._backward_hooks and not sub._backward_pre_hooks
    for s in tel.steps():
        (batch,) = s.named("train_batch")
        # the loss module's forward continues the model's: one forward phase
        assert [c.name for c in s.children(batch)] == ["forward", "backward", "optimizer_step"]
    tel.uninstrument()
    assert _module_global_hooks() == baseline
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks and "_call_impl" not in vars(m)


def _user_pre_hook(module, args):  # module-level: picklable, as a user's hook must be
    module.calls = getattr(module, "calls", 0) + 1


def test_roots_can_be_deep_copied_and_pickled(instrumented):
    """EMA models (``copy.deepcopy``) and whole-model checkpoints (``torch.save``)
    work as without instrumentation: copies keep the user's hooks, not ours."""
    import copy
    import io

    tel = instrumented()
    model, loss_fn = make_model(), torch.nn.CrossEntropyLoss()
    model.register_forward_pre_hook(_user_pre_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(make_dataset(16), batch_size=4)
    for batch in loader:
        train_step(model, opt, batch, loss_fn)
    assert set(map(id, tel.runtime.module_hooks.roots())) == {id(model), id(loss_fn)}
    assert "_call_impl" in vars(model) and len(model._forward_pre_hooks) == 1

    ema = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    lossy = copy.deepcopy(loss_fn)
    for clone in (ema, loaded):
        assert list(clone._forward_pre_hooks.values()) == [_user_pre_hook]
        assert not clone._forward_hooks and not clone._forward_hooks_always_called
        assert "_call_impl" not in vars(clone)
        assert torch.equal(clone[0].weight, model[0].weight)
    assert "_call_impl" not in vars(lossy)
    # the originals keep their timing and their user hook
    assert "_call_impl" in vars(model) and "_call_impl" in vars(loss_fn)
    assert list(model._forward_pre_hooks.values()) == [_user_pre_hook]
    before, ema.calls = len(tel.steps()), 0
    for batch in loader:
        train_step(model, opt, batch, loss_fn)
        with torch.no_grad():
            ema(batch[0])
    steps = tel.steps()[before:]
    # The copy is a model of its own (discovered as the new loop begins); its no_grad
    # forward after each update is an eval step (docs/steps.md).
    assert [s.mode for s in steps] == ["train", "eval"] * 4 and all(s.named("forward") for s in steps)
    assert ema.calls == 4 and not tel.runtime.telemetry.errors


def test_a_dropped_root_is_freed_at_once_and_another_tools_call_is_kept(instrumented):
    """Our timed call holds its root weakly (no cycle: a dropped model frees its
    memory at once, not at the next full GC); a call another tool put in the
    instance runs inside ours and is back after uninstrument."""
    import gc
    import weakref

    tel = instrumented()
    calls = []
    model, other = make_model(), make_model()
    torch_call = other._call_impl

    def tools_call(*args, **kwargs):
        calls.append(len(args))
        return torch_call(*args, **kwargs)

    other._call_impl = tools_call
    opt = torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1)
    for x, y in DataLoader(make_dataset(12), batch_size=4):
        loss = torch.nn.functional.cross_entropy(model(x) + other(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert set(map(id, tel.runtime.module_hooks.roots())) == {id(model), id(other)}
    assert vars(other)["_call_impl"] is not tools_call and calls == [1, 1, 1]
    assert all(s.named("forward") for s in tel.steps())
    ref = weakref.ref(model)
    gc.disable()
    try:
        del model, opt
        assert ref() is None
    finally:
        gc.enable()
    tel.uninstrument()
    assert vars(other)["_call_impl"] is tools_call


def test_a_model_first_used_later_is_discovered(instrumented):
    baseline = _module_global_hooks()
    tel = instrumented()
    a, b = make_model(), make_model()
    during = []
    with torch.no_grad():
        for i, (x, y) in enumerate(DataLoader(make_dataset(24), batch_size=4)):
            during.append(_module_global_hooks() == baseline)
            (a if i < 2 else b)(x)
    after_loop = _module_global_hooks()
    roots = set(map(id, tel.runtime.module_hooks.roots()))
    tel.uninstrument()
    steps = tel.steps()
    # b first runs in batch 2, where no known root runs: its forward is unseen, so
    # that batch holds only its wait, which joins the next step (docs/steps.md);
    # discovery re-arms after it, b is a root from batch 3 on, and discovery is
    # lifted again.
    assert [len(s.named("forward")) for s in steps] == [1] * 5
    assert [len(s.named("dataloader_next")) for s in steps] == [1, 1, 2, 1, 1]
    assert roots == {id(a), id(b)}
    assert during == [False, True, True, False, True, True]  # armed: at the start, after batch 2
    # The loop's end looks again (a module first called after a loop is a model of its
    # own), and uninstrument removes that hook with every other attachment.
    assert after_loop != baseline
    assert _module_global_hooks() == baseline


# -- torch.compile ----------------------------------------------------------------------
class Breaking(torch.nn.Module):
    """A model with one deliberate graph break, so break counts mean something."""

    def __init__(self):
        super().__init__()
        self.a = make_model()
        self.b = torch.nn.Linear(2, 2)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h)


def _compiled_run(how: str, backend: str, steps: int = 3, model=None):
    """Train a compiled model; returns (graph breaks, unique graphs, warnings, net)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = model or Breaking()
    if how == "torch.compile":
        net = torch.compile(model, backend=backend)
    else:
        model.compile(backend=backend)
        net = model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in DataLoader(make_dataset(4 * steps), batch_size=4):
            train_step(net, opt, (x, y))
    breaks = sum(counters["graph_break"].values())
    graphs = counters["stats"]["unique_graphs"]
    return breaks, graphs, [str(w.message) for w in caught], net


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_compile_adds_no_graph_break_nor_recompile(instrumented, how):
    plain_breaks, plain_graphs, _, _ = _compiled_run(how, "aot_eager")
    tel = instrumented()
    breaks, graphs, caught, net = _compiled_run(how, "aot_eager")
    assert plain_breaks >= 1
    assert (breaks, graphs) == (plain_breaks, plain_graphs)
    assert not [w for w in caught if "global hooks" in w]
    steps = tel.steps()
    assert len(steps) == 3
    for s in steps:
        assert s.tree() == ("step", (("dataloader_next", ()), ("to_device", ()),
                                     ("train_batch", STANDARD_BATCH), ("from_device", ()))), s
    assert [id(m) for m in tel.runtime.module_hooks.roots()] == [id(net)]
    tel.uninstrument()
    if how == "module.compile":  # the compiled call is the one torch made, again
        assert getattr(net._compiled_call_impl, "_otel_inner", None) is None


def test_compile_with_inductor(instrumented):
    """The default backend end to end (C++ codegen on CPU), instrumented."""
    tel = instrumented()
    breaks, graphs, caught, net = _compiled_run("torch.compile", "inductor", steps=2, model=make_model())
    assert breaks == 0 and graphs == 1  # one graph, compiled once
    for s in tel.steps():
        assert [c.name for c in s.children(s.named("train_batch")[0])] == [n for n, _ in STANDARD_BATCH]


# -- exact restore ------------------------------------------------------------------------
def _patched_objects():
    from torch.optim import lr_scheduler

    from otel_training.record.torch_hooks import _subclasses

    objs = [torch.Tensor, torch._C.TensorBase, dataloader_mod.DataLoader, dataloader_mod._BaseDataLoaderIter,
            torch.autograd, torch.distributed, torch.nn.Module, torch.amp.GradScaler]
    objs += sorted(_subclasses(torch.amp.GradScaler), key=repr)
    base = getattr(lr_scheduler, "LRScheduler", None) or lr_scheduler._LRScheduler
    objs += sorted(_subclasses(base) | {base, lr_scheduler.ReduceLROnPlateau}, key=repr)
    try:
        from torch._dynamo.eval_frame import OptimizedModule

        objs.append(OptimizedModule)
    except ImportError:  # pragma: no cover
        pass
    return objs


def _snapshot() -> dict:
    snap = {}
    for obj in _patched_objects():
        snap[repr(obj)] = dict(vars(obj))
    snap["optimizer hooks"] = {
        "pre": dict(optimizer_mod._global_optimizer_pre_hooks),
        "post": dict(optimizer_mod._global_optimizer_post_hooks),
    }
    snap["module hooks"] = _module_global_hooks()
    snap["excepthook"] = {"excepthook": sys.excepthook}
    return snap


def _diff(before: dict, after: dict) -> list:
    out = []
    for owner, attrs in before.items():
        now = after[owner]
        for name in set(attrs) | set(now):
            if name in ("__weakref__",):
                continue
            if attrs.get(name, "<missing>") is not now.get(name, "<missing>") and not (
                    isinstance(attrs.get(name), dict) and attrs.get(name) == now.get(name)):
                out.append(f"{owner}.{name}: {attrs.get(name, '<missing>')!r} -> {now.get(name, '<missing>')!r}")
    return out


def _workload(tmp_path, with_dist: bool):
    torch.manual_seed(0)
    model = make_model()
    loss_fn = torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    scaler = torch.amp.GradScaler("cpu")
    compiled = torch.compile(make_model(), backend="eager")
    self_compiled = make_model()
    self_compiled.compile(backend="eager")
    for x, y in DataLoader(make_dataset(8), batch_size=4):
        with otel_training.phase("manual"):
            loss = loss_fn(model(x), y) + compiled(x).sum() * 0 + self_compiled(x).sum() * 0
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        plateau.step(loss.item())
        if with_dist:
            dist.all_reduce(loss.detach().clone())
        loss.detach().cpu().numpy().tolist()
    with otel_training.step():
        pass
    return model, compiled, self_compiled


def test_uninstrument_restores_every_patched_object(instrumented, tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        _workload(tmp_path, with_dist=True)  # lazy imports and first-use caches happen here
        before = _snapshot()
        tel = instrumented()
        during = _snapshot()
        assert _diff(before, during), "instrument() patched nothing?"
        model, compiled, self_compiled = _workload(tmp_path, with_dist=True)
        assert len(tel.steps()) == 3
        tel.uninstrument()
        after = _snapshot()
        assert _diff(before, after) == []
        for m in list(model.modules()) + list(compiled.modules()) + list(self_compiled.modules()):
            assert not m._forward_pre_hooks and not m._forward_hooks
        assert self_compiled.__dict__["_compiled_call_impl"].__class__.__name__ != "function" or \
            not hasattr(self_compiled._compiled_call_impl, "_otel_inner")
        # instrumenting again works as the first time
        tel2 = instrumented()
        _workload(tmp_path, with_dist=True)
        assert len(tel2.steps()) == 3
        tel2.uninstrument()
        assert _diff(before, _snapshot()) == []
    finally:
        dist.destroy_process_group()
