"""The step definition (docs/steps.md), rule by rule, on small loops shaped like
public ones. The subprocess suite in tests/loops/ runs whole scripts; these run
in-process against the SDK's in-memory exporters."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import otel_training
from tests.conftest import make_dataset, make_model, spin


def _modes(tel):
    return [s.mode for s in tel.steps()]


def _micro(tel):
    return [s.attributes.get("training.step.microbatches") for s in tel.steps()]


def _summary(tel):
    return tel.runtime.summary_dict()


# -- 1. no optimizer: one backward pass is a step ------------------------------------
def test_manual_sgd_without_dataloader_is_one_step_per_backward(instrumented):
    """word_language_model's shape: model.zero_grad(), forward, backward,
    p.data.add_(p.grad, alpha=-lr), .item() for logging; then a no_grad evaluate()."""
    tel = instrumented()
    model = make_model()
    criterion = nn.CrossEntropyLoss()
    for _ in range(5):
        x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
        model.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)
        loss.item()
    model.eval()
    with torch.no_grad():
        for _ in range(3):
            x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
            criterion(model(x), y).item()
    tel.uninstrument()
    assert _modes(tel) == ["train"] * 5 + ["eval"] * 3
    assert _micro(tel) == [1] * 5 + [None] * 3
    for s in tel.steps()[:5]:
        assert [len(s.named(n)) for n in ("forward", "backward")] == [1, 1]


def test_rnn_cell_called_per_time_step_is_one_step(instrumented):
    """The char-RNN tutorial: a root cell called once per character, one backward,
    a manual update: one step per sequence, not one per character."""
    tel = instrumented()
    cell = nn.RNNCell(8, 16)
    head = nn.Linear(16, 2)
    for _ in range(3):
        h = torch.zeros(1, 16)
        cell.zero_grad()
        head.zero_grad()
        for t in range(6):
            h = cell(torch.randn(1, 8), h)
        nn.functional.cross_entropy(head(h), torch.tensor([1])).backward()
        for p in list(cell.parameters()) + list(head.parameters()):
            p.data.add_(p.grad, alpha=-0.01)
    tel.uninstrument()
    assert _modes(tel) == ["train"] * 3
    assert _micro(tel) == [1, 1, 1]


# -- 2. one optimizer update is a step ----------------------------------------------
def test_accumulation_without_dataloader_merges_micro_steps(instrumented):
    """nanoGPT's shape: get_batch, gradient_accumulation_steps forward/backward,
    one optimizer step, zero_grad; estimate_loss() under no_grad every few iterations."""
    tel = instrumented()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    for it in range(4):
        if it % 2 == 0:
            model.eval()
            with torch.no_grad():
                for _ in range(3):
                    model(torch.randn(4, 8))
            model.train()
        for _ in range(3):
            loss = nn.functional.cross_entropy(model(x), y) / 3
            x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))  # the next batch
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    tel.uninstrument()
    assert _modes(tel) == ["eval"] * 3 + ["train", "train"] + ["eval"] * 3 + ["train", "train"]
    assert [m for m in _micro(tel) if m is not None] == [3] * 4
    summary = _summary(tel)
    assert summary["modes"]["train"]["steps"] == 4
    assert summary["modes"]["train"]["microbatches"] == 12
    assert summary["modes"]["eval"]["steps"] == 6


def test_two_optimizers_in_one_iteration_count_once(instrumented):
    """DCGAN: D on real, D on fake, D.step; G through D, G.step -- one step of
    two micro-batches (D's two backward passes before the first update)."""
    tel = instrumented()
    net_d, net_g = nn.Linear(8, 1), nn.Linear(4, 8)
    opt_d = torch.optim.Adam(net_d.parameters())
    opt_g = torch.optim.Adam(net_g.parameters())
    bce = nn.BCEWithLogitsLoss()
    for real, _ in DataLoader(make_dataset(12), batch_size=4):
        net_d.zero_grad()
        bce(net_d(real), torch.ones(4, 1)).backward()
        fake = net_g(torch.randn(4, 4))
        bce(net_d(fake.detach()), torch.zeros(4, 1)).backward()
        opt_d.step()
        net_g.zero_grad()
        bce(net_d(fake), torch.ones(4, 1)).backward()
        opt_g.step()
    assert _modes(tel) == ["train"] * 3
    assert _micro(tel) == [2, 2, 2]


def test_two_optimizers_without_dataloader_count_once(instrumented):
    tel = instrumented()
    net_d, net_g = nn.Linear(8, 1), nn.Linear(4, 8)
    opt_d = torch.optim.Adam(net_d.parameters())
    opt_g = torch.optim.Adam(net_g.parameters())
    for _ in range(3):
        opt_d.zero_grad()
        net_d(torch.randn(4, 8)).mean().backward()
        opt_d.step()
        opt_g.zero_grad()
        net_d(net_g(torch.randn(4, 4))).mean().backward()
        opt_g.step()
    tel.uninstrument()
    assert _modes(tel) == ["train"] * 3


def test_reinforce_episode_is_one_step(instrumented):
    """reinforce.py: select_action() runs the policy with gradients at every env
    step; finish_episode() does one backward and one optimizer step."""
    tel = instrumented()
    policy = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    for episode in range(3):
        log_probs = []
        for t in range(5 + episode):
            probs = torch.softmax(policy(torch.randn(1, 4)), -1)
            log_probs.append(torch.log(probs[0, 0]))
            spin(0.001)  # env.step()
        loss = -torch.stack(log_probs).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    tel.uninstrument()
    assert _modes(tel) == ["train"] * 3
    assert [len(s.named("forward")) for s in tel.steps()] == [5, 6, 7]


def test_no_grad_rollout_then_minibatch_updates(instrumented):
    """PPO's shape: a no_grad rollout (eval steps), then minibatch updates."""
    tel = instrumented()
    agent = nn.Linear(4, 2)
    opt = torch.optim.Adam(agent.parameters())
    for _ in range(2):
        with torch.no_grad():
            for _ in range(4):
                agent(torch.randn(1, 4))
        for _ in range(3):
            agent(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    tel.uninstrument()
    assert _modes(tel) == (["eval"] * 4 + ["train"] * 3) * 2


# -- 3. eval inside an iteration --------------------------------------------------
def test_no_grad_forward_after_the_update_is_its_own_eval_step(instrumented):
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(DataLoader(make_dataset(16), batch_size=4)):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if i % 2 == 1:
            model.eval()
            with torch.no_grad():
                model(x).argmax(1).tolist()
            model.train()
    steps = tel.steps()
    assert [s.mode for s in steps] == ["train", "train", "eval", "train", "train", "eval"]
    for s in steps:
        if s.mode == "train":
            assert len(s.named("forward")) == 1


# -- 4. closures ----------------------------------------------------------------------
def test_lbfgs_closure_is_one_step_per_step_call(instrumented):
    """time_sequence_prediction: optimizer.step(closure) (the closure prints
    loss.item()), then a no_grad prediction and drawing."""
    tel = instrumented()
    model = make_model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    for _ in range(4):
        def closure():
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.item()
            loss.backward()
            return loss
        opt.step(closure)
        with torch.no_grad():
            model(torch.randn(16, 8)).numpy()
        spin(0.002)  # drawing
    tel.uninstrument()
    steps = tel.steps()
    assert [s.mode for s in steps] == ["train", "eval"] * 4
    uncovered = []
    for s in steps[::2]:
        assert s.top_level() == ["train_batch"]  # the whole step(closure) is the container
        (batch,) = s.named("train_batch")
        kids = [c.name for c in s.children(batch)]
        assert kids[0] == "optimizer_step" and kids[-1] == "optimizer_step"
        assert kids.count("forward") == kids.count("backward") >= 1
        assert s.attributes["training.step.microbatches"] == 1
        uncovered.append(abs(s.duration - sum(c.end_time - c.start_time for c in s.children()) / 1e9))
    # phases add up: the container covers the step. A container that leaves part of the
    # step out does so every step; the machine's load can stretch one step's glue by a
    # scheduler slice (CI with both cores busy: 2.9 ms), not every step's.
    assert min(uncovered) < 1e-3, uncovered


# -- 5. GradScaler skipped updates ---------------------------------------------------------
def test_gradscaler_step_skipped_for_inf_is_a_step_marked_skipped(instrumented):
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    for i, (x, y) in enumerate(DataLoader(make_dataset(12), batch_size=4)):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        if i == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    steps = tel.steps()
    assert [s.mode for s in steps] == ["train"] * 3
    assert [s.attributes.get("training.step.update_skipped", False) for s in steps] == [False, True, False]
    assert _summary(tel)["modes"]["train"]["skipped_updates"] == 1
    assert sum(p.value for p in tel.points("training.skipped_updates")) == 1


# -- 6. loader ends, prefetching, coverage ---------------------------------------------
class _AheadLoader:
    """Fetches one batch ahead, like accelerate's DataLoaderShard."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        it = iter(self.loader)
        current = next(it)
        while True:
            try:
                following = next(it)
            except StopIteration:
                yield current
                return
            yield current
            current = following


def test_a_loader_that_fetches_ahead_makes_no_steps_of_its_own(instrumented):
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for x, y in _AheadLoader(DataLoader(make_dataset(16, delay=0.003), batch_size=4)):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    tel.uninstrument()
    steps = tel.steps()
    assert [s.mode for s in steps] == ["train"] * 8
    # the first step waited for two batches; every step holds its wait
    assert len(steps[0].named("dataloader_next")) == 2
    summary = _summary(tel)
    assert summary["coverage"]["share"] > 0.95
    assert summary["self_check"] == []


def test_coverage_reports_the_time_between_loops(instrumented):
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        for x, y in DataLoader(make_dataset(8), batch_size=4):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        if epoch == 0:
            slept = spin(0.05)  # a checkpoint between epochs: no step is open
    tel.uninstrument()
    cov = _summary(tel)["coverage"]
    # The gap holds the checkpoint and the loop's own end and start (a StopIteration, a
    # new iterator): at least what the script slept, and not a step more.
    assert slept <= cov["outside_s"] < slept + 0.03
    assert slept <= cov["largest_gap_s"] <= cov["outside_s"]
    assert cov["largest_gap_after_step"] == 1
    assert cov["in_steps_s"] + cov["outside_s"] == pytest.approx(cov["loop_s"], rel=1e-6)


# -- 7. self-check and the escape hatch -------------------------------------------------
def test_self_check_fires_when_the_optimizer_never_steps(instrumented, capsys):
    """An optimizer exists, but the loop updates parameters by hand."""
    tel = instrumented()
    model = make_model()
    torch.optim.SGD(model.parameters(), lr=0.1)  # made, never stepped
    opt_kept = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(40):
        model.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 2, (4,))).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        spin(0.001)
    with torch.no_grad():
        model(torch.randn(4, 8))
    tel.uninstrument()
    del opt_kept
    summary = _summary(tel)
    assert summary["modes"]["train"]["steps"] == 1
    kinds = [f["kind"] for f in summary["self_check"]]
    assert kinds == ["merged_steps"]
    assert "OTEL_TRAINING_STEP_BOUNDARY=backward" in summary["self_check"][0]["fix"]
    assert "otel-training: step detection in doubt" in capsys.readouterr().err


def test_step_boundary_backward_fixes_it(instrumented):
    tel = instrumented(step_boundary="backward")
    model = make_model()
    torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(6):
        model.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 2, (4,))).backward()
    tel.uninstrument()
    assert _modes(tel) == ["train"] * 6
    assert _summary(tel)["self_check"] == []


def test_step_boundary_dataloader_keeps_one_step_per_batch(instrumented):
    tel = instrumented(step_boundary="dataloader")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(DataLoader(make_dataset(16), batch_size=4)):
        nn.functional.cross_entropy(model(x), y).backward()
        if i % 2:
            opt.step()
            opt.zero_grad()
    assert _modes(tel) == ["train"] * 4


def test_step_boundary_forward_makes_one_step_per_forward(instrumented):
    tel = instrumented(step_boundary="forward")
    model = make_model()
    loss_fn = nn.CrossEntropyLoss()
    with torch.no_grad():
        for x, y in DataLoader(make_dataset(8), batch_size=4):
            for xs in x.chunk(2):  # two forwards per batch: two steps
                loss_fn(model(xs), y[:2])
    assert _modes(tel) == ["eval"] * 4


def test_step_boundary_is_validated():
    from otel_training.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="OTEL_TRAINING_STEP_BOUNDARY='epoch' is not valid: use one of auto, "
                                          "optimizer, backward, dataloader, forward"):
        load_config({"OTEL_TRAINING_STEP_BOUNDARY": "epoch"})


def test_manual_step_wins_over_detection(instrumented):
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        with otel_training.step():
            for _ in range(3):  # three updates in one user step
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
    tel.uninstrument()
    assert _modes(tel) == ["train", "train"]


MANUAL_UPDATES = r"""
import time, torch, otel_training
otel_training.instrument()
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)  # exists, never stepped
for _ in range(40):
    model.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
    time.sleep(0.001)
"""


def test_self_check_line_at_exit_and_in_the_report(tmp_path, capsys):
    """The doubtful loop as a user runs it: one line on stderr at exit, and the
    report of its summary file names the cause and the fix, with the coverage."""
    import os
    import subprocess
    import sys

    from otel_training.cli import main

    script = tmp_path / "train.py"
    script.write_text(MANUAL_UPDATES)
    summary = tmp_path / "s.json"
    env = dict(os.environ, OTEL_TRAINING_SUMMARY_FILE=str(summary), OTEL_TRAINING_HARDWARE="false",
               OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doubt = [ln for ln in proc.stderr.splitlines() if ln.startswith("otel-training: step detection in doubt")]
    assert len(doubt) == 1 and "40 backward passes" in doubt[0], proc.stderr
    assert "OTEL_TRAINING_STEP_BOUNDARY=backward" in doubt[0]

    assert main(["report", "--summary", str(summary)]) == 0
    out = capsys.readouterr().out
    assert "coverage: 100.0% of the training loop's" in out
    assert "step detection in doubt: train step 0 holds 40 backward passes" in out
    assert "fix: set OTEL_TRAINING_STEP_BOUNDARY=backward" in out

    # the escape hatch it names: 40 steps, nothing in doubt
    env["OTEL_TRAINING_STEP_BOUNDARY"] = "backward"
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "step detection" not in proc.stderr, proc.stderr
    import json

    data = json.loads(summary.read_text())
    assert data["modes"]["train"]["steps"] == 40 and data["self_check"] == []


def test_a_second_loader_read_mid_iteration_is_a_wait_of_the_same_step(instrumented):
    """DANN's shape: the source batch, its forward, then the target batch from a
    second loader, its forward, one backward and update: one step, two waits."""
    tel = instrumented()
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    source = DataLoader(make_dataset(12, delay=0.002), batch_size=4)
    target = DataLoader(make_dataset(12, delay=0.002), batch_size=4)
    target_iter = iter(target)
    for xs, ys in source:
        loss = nn.functional.cross_entropy(model(xs), ys)
        xt, _ = next(target_iter)
        loss = loss + model(xt).logsumexp(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    steps = tel.steps()
    assert [s.mode for s in steps] == ["train"] * 3
    for s in steps:
        assert len(s.named("dataloader_next")) == 2 and len(s.named("forward")) == 2


def test_a_model_loaded_for_evaluation_is_seen_from_its_first_batch(instrumented):
    """DANN's test(): each evaluation loads the saved model anew (a copy carries no
    instrumentation): the new loop re-arms discovery, so its first forward counts."""
    import io

    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(make_dataset(8), batch_size=4):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for _ in range(2):
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False).eval()
        for x, y in DataLoader(make_dataset(12), batch_size=4):
            loaded(x).argmax(1).cpu()
    steps = tel.steps()
    assert [s.mode for s in steps] == ["train"] * 2 + ["eval"] * 6
    assert all(len(s.named("forward")) == 1 for s in steps)


def test_rollout_forwards_of_methods_calling_two_roots(instrumented):
    """CleanRL's PPO: get_action_and_value() runs the actor then the critic (two
    roots, one forward batch); the bootstrap get_value() runs the critic alone."""
    tel = instrumented()
    actor, critic = nn.Linear(4, 2), nn.Linear(4, 1)
    opt = torch.optim.Adam(list(actor.parameters()) + list(critic.parameters()))
    for _ in range(2):
        with torch.no_grad():
            for _ in range(3):
                obs = torch.randn(2, 4)
                actor(obs), critic(obs)
            critic(torch.randn(2, 4))  # bootstrap value
        for _ in range(2):
            obs = torch.randn(4, 4)
            (actor(obs).sum() + critic(obs).sum()).backward()
            opt.step()
            opt.zero_grad()
    tel.uninstrument()
    assert _modes(tel) == (["eval"] * 4 + ["train"] * 2) * 2


def test_an_iterator_made_long_before_its_first_batch_does_not_start_the_step_early(instrumented):
    """makemore's InfiniteDataLoader makes its iterator at set-up; the set-up time
    before the first batch is no wait of the first step (a `for` loop's start-up is)."""
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    it = iter(DataLoader(make_dataset(16), batch_size=4))
    spin(0.1)  # building the model, the optimizer, ...
    for _ in range(3):
        x, y = next(it)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    tel.uninstrument()
    first = tel.steps()[0]
    assert first.total("dataloader_next") < 0.04
    assert _summary(tel)["coverage"]["before_first_step_s"] >= 0.1


# -- activation checkpointing: the recompute belongs to the backward pass ------------------


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recompute_is_part_of_the_backward(instrumented, reentrant):
    """A Hugging Face model with activation (gradient) checkpointing on, trained in the loop of
    the transformers docs' "Train in native PyTorch" (``model(**batch)``, ``loss.backward()``,
    ``optimizer.step()``, ``lr_scheduler.step()``, ``optimizer.zero_grad()``). On the CPU
    the backward pass recomputes each layer's forward on the training thread (and,
    reentrant, calls ``torch.autograd.backward`` again per layer): that is backward time,
    no forward of its own, no root module (the layers stay untimed) and no micro-batch."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 (the older name is deprecated)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = torch.randint(64, (12, 16))
    rows = [{"input_ids": r, "labels": r} for r in ids]
    tel = instrumented(trace_every_n=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model.train()
    for _epoch in range(2):
        for batch in DataLoader(rows, batch_size=4):
            outputs = model(**batch)
            loss = outputs.loss
            loss.backward()
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
    roots = tel.runtime.module_hooks.roots()
    tel.uninstrument()
    steps = tel.steps()
    assert _modes(tel) == ["train"] * 6 and _micro(tel) == [1] * 6
    for s in steps:
        (batch_span,) = s.named("train_batch")
        assert [c.name for c in s.children(batch_span)] == ["forward", "backward", "optimizer_step"]
        assert not s.children(s.named("backward")[0])
    assert _summary(tel)["modes"]["train"]["microbatches"] == 6
    assert [id(m) for m in roots] == [id(model)]


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_with_manual_updates_and_no_dataloader(instrumented, reentrant):
    """word_language_model's train() (get_batch(), forward, backward, clip_grad_norm_,
    ``p.data.add_(p.grad, alpha=-lr)``: no optimizer, so each backward is a step) with
    its layers checkpointed: the forwards the backward pass recomputes cut no step."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Embedding(50, 16)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
            self.decoder = nn.Linear(16, 50)

        def forward(self, x):
            h = self.encoder(x)
            for layer in self.layers:
                h = checkpoint(layer, h, use_reentrant=reentrant)
            return self.decoder(h)

    torch.manual_seed(0)
    model = Checkpointed()
    criterion = nn.CrossEntropyLoss()
    source = torch.randint(50, (9 * 4 + 1,))
    tel = instrumented(trace_every_n=1)
    model.train()
    for i in range(0, 9 * 4, 9):
        data, targets = source[i:i + 8], source[i + 1:i + 9]
        model.zero_grad()
        loss = criterion(model(data), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)
        loss.item()
    roots = tel.runtime.module_hooks.roots()
    tel.uninstrument()
    assert _modes(tel) == ["train"] * 4 and _micro(tel) == [1] * 4
    assert {id(m) for m in roots} == {id(model), id(criterion)}


# -- loaders wrapped in a generator ----------------------------------------------------------


class _Prefetcher:
    """A loader wrapper of one's own, one batch ahead (the shape of timm's PrefetchLoader
    and accelerate's DataLoaderShard): a generator ``__iter__`` over a DataLoader."""

    def __init__(self, loader, ahead=True):
        self.loader, self.ahead = loader, ahead

    def __iter__(self):
        if not self.ahead:  # a pass-through: ends right after its DataLoader
            for batch in self.loader:
                yield batch
            return
        it = iter(self.loader)
        current = next(it)
        for nxt in it:
            yield current
            current = nxt
        yield current


@pytest.mark.parametrize("ahead", [True, False])
def test_a_generator_wrapped_loader_ends_its_loop_where_the_generator_does(instrumented, ahead):
    """Three epochs, each followed by 30 ms of work outside the loop (a checkpoint): each
    batch is one train step; a wrapper one batch ahead is recognised in its first loop,
    so from its second loop on the time after the loop lies between steps (a pass-through
    generator ends with its DataLoader: every loop's end is seen)."""

    tel = instrumented(trace_every_n=1)
    model, data = make_model(), make_dataset(12)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = _Prefetcher(DataLoader(data, batch_size=4), ahead=ahead)
    slept = []
    for _epoch in range(3):
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        slept.append(spin(0.03))  # checkpoint
    model(torch.randn(2, 8))  # a step after the last loop, so its gap counts
    tel.uninstrument()
    assert _modes(tel)[:9] == ["train"] * 9 and _micro(tel)[:9] == [1] * 9
    coverage = _summary(tel)["coverage"]
    seen = 3 if not ahead else 2
    # at least the checkpoints seen (the last ones: the first loop's may be in a step),
    # and less than all three and a step
    assert coverage["gaps"] >= seen and sum(sorted(slept)[:seen]) <= coverage["outside_s"] < sum(slept) + 0.02


class _Task(nn.Module):
    """timm's ``ClassificationTask``: the model and the criterion in one module."""

    def __init__(self, model):
        super().__init__()
        self.trainable_module = model
        self.criterion = nn.CrossEntropyLoss()

    def forward(self, x, y):
        return self.criterion(self.trainable_module(x), y)


@pytest.mark.parametrize("wrapped", ["train", "eval"])
def test_training_through_a_wrapper_and_evaluation_through_the_wrapped_model(instrumented, wrapped):
    """timm's train.py: training calls the task wrapping the model, validate() the model
    itself, a submodule of training's root (``wrapped="train"``); and the converse. Both
    over a loader one batch ahead: one step per batch, each with its forward and wait."""
    tel = instrumented()
    model = make_model()
    task = _Task(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = _Prefetcher(DataLoader(make_dataset(32), batch_size=4))
    val = _Prefetcher(DataLoader(make_dataset(20), batch_size=4))
    for _epoch in range(2):
        model.train()
        for x, y in train:
            loss = task(x, y) if wrapped == "train" else nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
        model.eval()
        with torch.inference_mode():
            for x, y in val:
                out = nn.functional.cross_entropy(model(x), y) if wrapped == "train" else task(x, y)
                out.item()
    tel.uninstrument()
    assert _modes(tel) == (["train"] * 8 + ["eval"] * 5) * 2
    for s in tel.steps():
        assert len(s.named("forward")) == 1, (s.mode, s.top_level())
    # each batch's wait is in a step of its loop: the first step holds two (one ahead)
    assert sum(len(s.named("dataloader_next")) for s in tel.steps() if s.mode == "eval") >= 10


def test_accelerate_loops_are_watched_in_every_instrumentation(instrumented):
    """accelerate's DataLoaderShard (one batch ahead) is watched from its first loop, in a
    second instrumentation after an uninstrument too; uninstrument gives its own
    ``__iter__`` back."""

    accelerate = pytest.importorskip("accelerate")
    from accelerate.data_loader import DataLoaderShard

    own = DataLoaderShard.__dict__["__iter__"]
    for _run in range(2):
        tel = instrumented(trace_every_n=1)
        accelerator = accelerate.Accelerator(cpu=True)
        net = make_model()
        model, opt, loader = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01),
                                                 DataLoader(make_dataset(8), batch_size=4))
        slept = 0.0
        for _epoch in range(2):
            for x, y in loader:
                accelerator.backward(nn.functional.cross_entropy(model(x), y))
                opt.step()
                opt.zero_grad()
            slept += spin(0.03)  # after the loop: between steps
        model(torch.randn(2, 8))
        tel.uninstrument()
        assert _modes(tel)[:4] == ["train"] * 4
        coverage = _summary(tel)["coverage"]
        assert coverage["gaps"] >= 2 and slept <= coverage["outside_s"] < slept + 0.04
        assert DataLoaderShard.__dict__["__iter__"] is own


def test_a_loop_left_with_break_after_a_fetch(instrumented):
    """Lightning Fabric's build_your_own_trainer checks ``if batch_idx >= limit_batches:
    break`` at the top of the loop body: one batch is fetched that no step uses. That
    fetch, the epoch-end log (``.item()``) and the checkpoint after the loop lie between
    steps: the validation steps that follow do not absorb them."""
    import time

    PLANTED = 0.15
    tel = instrumented(trace_every_n=1)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train, val = DataLoader(make_dataset(16), batch_size=4), DataLoader(make_dataset(8), batch_size=4)
    checkpoints = []
    for _epoch in range(2):
        model.train()
        for batch_idx, (x, y) in enumerate(train):
            if batch_idx >= 2:
                break
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        loss.item()  # on_train_epoch_end's log
        saved = time.time_ns()
        time.sleep(PLANTED)  # fabric.save
        checkpoints.append((saved, time.time_ns()))
        model.eval()
        with torch.no_grad():
            for x, _ in val:
                model(x)
    tel.uninstrument()
    assert _modes(tel) == ["train", "train", "eval", "eval"] * 2
    # No step holds a checkpoint: its time lies outside every step span. (Not a bound
    # on step durations: on the loaded 2-core CI machine one tiny step took 0.49 s, a
    # pause of the whole process -- a full garbage collection late in the suite -- that
    # no checkpoint was part of.)
    for step in tel.steps():
        for saved, done in checkpoints:
            overlap = min(step.root.end_time, done) - max(step.root.start_time, saved)
            assert overlap < PLANTED * 1e9 / 10, (step.mode, overlap / 1e9)
    coverage = _summary(tel)["coverage"]
    assert coverage["gaps"] >= 2 and coverage["outside_s"] >= 2 * PLANTED


@pytest.mark.slow
@pytest.mark.parametrize("on_thread", [False, True], ids=["main-thread", "unjoined-thread"])
def test_the_last_step_ends_with_the_script_not_with_exit_work(tmp_path, on_thread):
    """A loop that ends without a loader's StopIteration (nanoGPT's ``while True: ...
    break``): its last step ends when the main thread's code returns, not after the
    exit-time work of libraries whose ``atexit`` handlers run before ours (torch.compile's
    worker pool took 1-1.5 s on an H100 machine). A loop on a thread the interpreter
    joins at exit is left to finish."""
    import json

    from tests.scripts.harness import instrumented, otel_env, run

    summary_file = tmp_path / "summary.json"
    args = ["--exit-work-s", "0.6"] + (["--thread"] if on_thread else [])
    env = otel_env(None, tmp_path, OTEL_TRAINING_HARDWARE="false", OTEL_TRACES_EXPORTER="none",
                   OTEL_METRICS_EXPORTER="none", OTEL_TRAINING_SUMMARY_FILE=str(summary_file))
    r = run(instrumented("exit_work.py", *args), env)
    assert r.wait() == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("LOOP ")]
    assert lines, r.stdout
    loop = json.loads(lines[0][len("LOOP "):])
    train = json.loads(summary_file.read_text())["modes"]["train"]
    assert train["steps"] == loop["steps"]
    assert train["step_max_s"] < 0.3, f"the last step holds the exit work: {train['step_max_s']:.3f} s"
    counted = (train.get("flops") or {}).get("counted_step_s", 0.0)  # the FLOP-count step: not in step times
    assert train["step_time_s"] + counted == pytest.approx(loop["loop_s"], rel=0.10)
