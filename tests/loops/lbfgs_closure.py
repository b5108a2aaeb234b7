# Shape: pytorch/examples time_sequence_prediction/train.py — for each step: def closure(): zero_grad, forward, loss, print(loss.item()), backward; optimizer.step(closure) with LBFGS; then a no_grad prediction of the future on the test input; then plotting.
"""LBFGS calls the closure (forward + backward) up to ``max_iter`` times inside one
``optimizer.step(closure)``: that is one training step with one micro-batch. The no_grad
prediction after it is one eval step. Synthetic sine waves stand in for traindata.pt,
and the LSTM cells are narrower (8, not 51). Planted: a slow plot after each prediction
(eval ``untracked``: ``plt.savefig`` of a PDF). The eval step's other user code (its
log line, the ``detach`` for plotting, the next iteration's ``print`` and closure
definition before ``optimizer.step(closure)`` begins the next step) is timed with it;
the ``.item()`` and ``.numpy()`` are ``from_device``."""

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim

from _truth import BEFORE, EVAL, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
truth = Truth("lbfgs_closure")
HIDDEN, STEPS, FUTURE, PLOT_DELAY = 8, 5, 10, 0.025


class Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, HIDDEN)
        self.lstm2 = nn.LSTMCell(HIDDEN, HIDDEN)
        self.linear = nn.Linear(HIDDEN, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t = torch.zeros(input.size(0), HIDDEN, dtype=torch.double)
        c_t = torch.zeros(input.size(0), HIDDEN, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), HIDDEN, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), HIDDEN, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for i in range(future):
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        return torch.cat(outputs, dim=1)


np.random.seed(0)
torch.manual_seed(0)
# generate_sine_wave.py, smaller: 10 waves of 13 points
T, L, N = 20, 13, 10
x = np.empty((N, L), np.int64)
x[:] = np.array(range(L)) + np.random.randint(-4 * T, 4 * T, N).reshape(N, 1)
data = np.sin(x / 1.0 / T).astype("float64")
input = torch.from_numpy(data[3:, :-1])
target = torch.from_numpy(data[3:, 1:])
test_input = torch.from_numpy(data[:3, :-1])
test_target = torch.from_numpy(data[:3, 1:])
seq = Sequence()
seq.double()
criterion = nn.MSELoss()
optimizer = optim.LBFGS(seq.parameters(), lr=0.8)
truth.start()
for i in range(STEPS):
    with truth.timed(EVAL if i else BEFORE, "untracked"):  # the tail of the last eval step
        print("STEP: ", i)

        def closure():
            optimizer.zero_grad()
            out = seq(input)
            loss = criterion(out, target)
            print("loss:", loss.item())
            loss.backward()
            return loss

    optimizer.step(closure)
    truth.train_step(microbatches=1)  # however many times LBFGS called the closure
    with torch.no_grad():
        pred = seq(test_input, future=FUTURE)
        loss = criterion(pred[:, :-FUTURE], test_target)
        test_loss = loss.item()
        with truth.timed(EVAL, "untracked"):
            print("test loss:", test_loss)
            y = pred.detach()
        y = y.numpy()
    truth.eval_step()
    truth.sleep(EVAL, "untracked", PLOT_DELAY)  # plt.figure ... plt.savefig('predict%d.pdf' % i)
truth.stop()
truth.emit()
