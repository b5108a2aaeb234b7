# Shape: pytorch/tutorials intermediate_source/torch_compile_tutorial.py — generate_data(b) each iteration, train(mod, data): opt.zero_grad(True), pred = mod(data[0]), CrossEntropyLoss, backward, opt.step(); eval iterations of the compiled model under torch.no_grad.
"""A ``torch.compile``d model: the first training step compiles forward and backward,
the first no_grad eval step recompiles for inference; both inside their steps. The
tutorial compiles with the default inductor backend; here the backend is
``aot_eager`` (AOTAutograd traces forward and backward, no C++ codegen): inductor
works on this machine (a C compiler is present) but costs ~11 s of compilation on 2
cores for a first step. ``LOOPS_COMPILE_BACKEND=inductor`` selects it. An MLP stands in
for densenet121. Planted: a slow log line after each train iteration (train
``untracked``) and after each eval iteration (eval ``untracked``). The loop's other user
code is timed with them: ``generate_data`` and ``zero_grad`` before a forward (the tail
of the step before; for the first iteration, before any step), the log lines and the
``argmax`` (the ``.item()`` and ``.tolist()`` are ``from_device``)."""

import os

import torch

from _truth import BEFORE, EVAL, TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(0)
truth = Truth("compile_loop")
N_ITERS, N_EVAL, LOG_DELAY = 20, 10, 0.030
BACKEND = os.environ.get("LOOPS_COMPILE_BACKEND", "aot_eager")


def generate_data(b):
    return torch.randn(b, 32), torch.randint(10, (b,))


def init_model():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


model = init_model()
opt = torch.optim.Adam(model.parameters())
model_opt = torch.compile(model, backend=BACKEND)


def train(mod, data):
    with truth.timed(TRAIN if truth.train_steps else BEFORE, "untracked"):  # the tail of the step before
        opt.zero_grad(True)
    pred = mod(data[0])
    loss = torch.nn.CrossEntropyLoss()(pred, data[1])
    loss.backward()
    opt.step()
    return loss


truth.start()
for i in range(N_ITERS):
    with truth.timed(TRAIN if i else BEFORE, "untracked"):  # the tail of the step before
        inp = generate_data(16)
    loss = train(model_opt, inp)
    truth.train_step(microbatches=1)
    loss_value = loss.item()
    with truth.timed(TRAIN, "untracked"):
        print(f"compile train iteration {i}: loss {loss_value:.4f}")
        truth.sleep(TRAIN, "untracked", LOG_DELAY)
for i in range(N_EVAL):
    with truth.timed(EVAL if i else TRAIN, "untracked"):  # the tail of the step before
        inp = generate_data(16)[0]
    with torch.no_grad():
        out = model_opt(inp)
    truth.eval_step()
    with truth.timed(EVAL, "untracked"):
        top = out.argmax(-1)[:4]
    top = top.tolist()
    with truth.timed(EVAL, "untracked"):
        print(f"compile eval iteration {i}: {top}")
        truth.sleep(EVAL, "untracked", LOG_DELAY)
truth.stop()
truth.notes["backend"] = BACKEND
# torch's own compile-time counters (seconds per timed function): dynamo's compile of
# each frame, and the backward graphs compiled at their first backward
truth.notes["compile_times"] = {k: sum(v) for k, v in torch._dynamo.utils.compilation_time_metrics.items()}
truth.emit()
