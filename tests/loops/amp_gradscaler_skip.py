# Shape: pytorch/tutorials recipes_source/recipes/amp_recipe.py ("All together") — for epoch: for input, target in zip(data, targets): autocast forward + loss; scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.zero_grad().
"""AMP with a GradScaler on CPU (``torch.amp.GradScaler("cpu")``, bfloat16 autocast;
the recipe uses CUDA and float16). One batch of the data holds an ``inf`` (a corrupt
sample): its gradients are not finite, ``scaler.step`` skips ``opt.step()`` and
``scaler.update()`` halves the scale. That iteration is still a training step, marked
skipped. No DataLoader: the batches are pre-made lists, as in the recipe. Skips are
counted from the scale (it only goes down when a step was skipped). Planted: a slow
log line after each iteration (``untracked``)."""

import torch

from _truth import TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(0)
truth = Truth("amp_gradscaler_skip")
BATCH, IN, OUT, LAYERS, NUM_BATCHES, EPOCHS, BAD_BATCH = 16, 64, 64, 3, 12, 2, 5
LOG_DELAY = 0.020


def make_model(in_size, out_size, num_layers):
    layers = []
    for _ in range(num_layers - 1):
        layers.append(torch.nn.Linear(in_size, in_size))
        layers.append(torch.nn.ReLU())
    layers.append(torch.nn.Linear(in_size, out_size))
    return torch.nn.Sequential(*tuple(layers))


data = [torch.randn(BATCH, IN) for _ in range(NUM_BATCHES)]
targets = [torch.randn(BATCH, OUT) for _ in range(NUM_BATCHES)]
data[BAD_BATCH][3, 7] = float("inf")  # a corrupt sample: this batch's update must be skipped
loss_fn = torch.nn.MSELoss()
net = make_model(IN, OUT, LAYERS)
opt = torch.optim.SGD(net.parameters(), lr=0.001)
use_amp = True
scaler = torch.amp.GradScaler("cpu", enabled=use_amp)

truth.start()
for epoch in range(EPOCHS):
    for i, (input, target) in enumerate(zip(data, targets)):
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=use_amp):
            output = net(input)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        scale_before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped = scaler.get_scale() < scale_before
        truth.train_step(microbatches=1, skipped=skipped)
        print(f"epoch {epoch} batch {i} loss {loss.item():.4f} scale {scaler.get_scale():.0f}"
              + (" (update skipped)" if skipped else ""))
        truth.sleep(TRAIN, "untracked", LOG_DELAY)
truth.stop()
truth.notes["expected_skips"] = EPOCHS  # the bad batch, once per epoch
truth.emit()
