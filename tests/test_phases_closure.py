"""``optimizer.step(closure)`` and framework-driven steps."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from tests.conftest import make_dataset, make_model


def test_closure_forward_and_backward_are_phases(instrumented):
    tel = instrumented()
    model = make_model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in DataLoader(make_dataset(24), batch_size=8):
        def closure():
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)
    tel.uninstrument()
    steps = tel.steps()
    assert len(steps) == 3
    for step in steps:
        names = [s.name for s in step.spans]
        assert names.count("forward") >= 2 and names.count("backward") >= 2  # LBFGS re-evaluates
        assert "optimizer_step" in names and step.mode == "train"
        by_id = {s.context.span_id: s for s in step.spans}
        for s in step.spans:
            if s.name in ("forward", "backward", "optimizer_step"):
                assert by_id[s.parent.span_id].name == "train_batch"


def test_a_framework_driver_keeps_its_step_across_a_new_dataloader_loop(instrumented):
    tel = instrumented()
    tracker = tel.tracker
    tracker.claim_driver("framework")
    model = make_model()
    loader = DataLoader(make_dataset(16), batch_size=8)
    tracker.start_step("framework")
    for x, _ in loader:  # iterator creation and waits happen inside the framework's step
        model(x)
    tracker.finish_step()
    tel.uninstrument()
    (step,) = tel.steps()
    names = [s.name for s in step.spans]
    assert names.count("dataloader_next") >= 2 and "forward" in names


def test_a_step_does_not_keep_its_dataloader_iterator_alive(instrumented):
    """After ``break``, the loop's iterator (and its worker processes) must go away
    as it would uninstrumented, not live on in the open step."""
    import gc
    import weakref

    tel = instrumented()
    model = make_model()
    it = iter(DataLoader(make_dataset(16), batch_size=4))
    ref = weakref.ref(it)
    for x, _ in it:
        model(x)
        break
    del it
    gc.collect()
    assert ref() is None
    assert tel.tracker.step is not None  # the step is still open, yet holds no iterator
