# Shape: Lightning-AI/pytorch-lightning examples/fabric/build_your_own_trainer (trainer.py MyCustomTrainer + run.py) on L.Fabric(accelerator="cpu", devices=1) — fit(): fabric.launch, setup_dataloaders, configure_optimizers, fabric.setup(model, optimizer); per epoch train_loop(): tqdm over the _FabricDataLoader, `if batch_idx >= limit_train_batches: break` at the top of the body (one batch fetched for nothing), fabric.call hooks, should_optim_step batches run optimizer.step(partial(training_step)) (the closure: model.training_step, fabric.backward) then zero_grad, the others training_step under fabric.no_backward_sync, step-interval lr scheduler via model.lr_scheduler_step; val_loop() every validation_frequency epochs (model.eval(), torch.set_grad_enabled(False), validation_step per batch); epoch-level scheduler; fabric.save checkpoint every epoch.
"""A Lightning Fabric training loop of one's own, in the shape of Fabric's
build-your-own-trainer example (examples/fabric/build_your_own_trainer: trainer.py
``MyCustomTrainer`` driven as run.py drives it), download-free and on CPU.

Kept from the real code: ``fit()`` -> ``train_loop()`` / ``val_loop()`` /
``step_scheduler()`` / ``save()``; the loaders set up with
``fabric.setup_dataloaders`` (a ``_FabricDataLoader``: its ``__iter__`` is a
generator moving each batch to the device), wrapped in tqdm; the LightningModule set
up with ``fabric.setup`` (so it is also a Fabric callback) and called through
``model.training_step`` / ``model.validation_step``; every ``fabric.call`` hook;
``optimizer.step(partial(self.training_step, ...))`` on the batches that update (the
forward and ``fabric.backward`` run in the optimizer's closure, as in Lightning's own
Trainer) and a plain ``training_step`` on the others; the step-interval scheduler
stepped after ``on_train_batch_end`` of an updating batch; tqdm postfixes
(``.item()``); ``limit_train_batches`` / ``limit_val_batches`` as run.py sets them
(10 and 20): the ``break`` at the top of the loop body comes after the loader handed
out one more batch; ``validation_frequency``; ``fabric.save`` of model, optimizer and
scheduler config at the end of every epoch.

Not in the original: the accumulation condition. trainer.py's
``should_optim_step = self.global_step % self.grad_accum_steps == 0`` with
``global_step`` counting updates never updates again after the first one when
``grad_accum_steps > 1`` (run.py keeps the default 1); here it counts batches,
``(batch_idx + 1) % grad_accum_steps == 0``, and the accumulating batches run under
``fabric.no_backward_sync(model, enabled=True)`` as Fabric's gradient-accumulation
docs show (a no-op on one device). ``configure_optimizers`` returns ``(optimizer,
scheduler config)`` with ``monitor: None``: run.py's dict form makes
``_parse_optimizers_schedulers`` return no optimizer. Tiny sizes, num_workers=0
(in-process fetches keep the planted sleeps measurable), torchmetrics' functional
accuracy as in run.py.

Truth (docs/steps.md): one training step per optimizer update with its
micro-batches: 12 batches an epoch (limit_train_batches of 14), grad_accum_steps=3:
4 updates of 3 micro-batches (2 plain backward passes + the closure's) an epoch, 3
epochs; one eval step per validation batch (4 per val_loop, epochs 0 and 2). Counted
from inside: backward passes in ``training_step``, updates with a step hook on the
torch optimizer, ``validation_step`` calls.

Planted: a slow Dataset ``__getitem__`` for both loaders (``dataloader_next``); a slow
remote metrics logger (a Fabric ``Logger``, one synchronous round trip per
``log_metrics``) behind a Fabric callback's ``fabric.log_dict`` in
``on_train_batch_end`` (train ``untracked``, every batch: after the backward pass or
the update) and ``on_validation_batch_end`` (eval ``untracked``); the callback's
epoch-end logs and a slow ``CheckpointIO`` (a network file system) under
``fabric.save`` lie between steps (``OUTSIDE``). Nothing is planted inside
``training_step``: on updating batches it runs in the optimizer's closure, which
docs/telemetry.md puts in ``train_batch`` as a whole.

Where time between steps lies: the val loop ends with its loader's StopIteration;
the train loop is left with ``break`` after the loader fetched a 13th batch that no
step uses. That fetch handed out a batch to no step, and the loop is over: like the
wait of a loader that ended (docs/steps.md rule 5), it and whatever runs after the
``for`` loop until the next step begins (on_train_epoch_end, val_loop's set-up, the
checkpoint) lie between steps (``OUTSIDE``; the Dataset's sleeps are booked when the
loop body takes the batch: ``dataloader_next`` of the step, or ``OUTSIDE`` on the
``break``). Each loop end is a ``truth.loop_end()``. (docs/steps.md names no
``break`` after a fetch; the suite counts the time after a ``break`` that fetched
nothing, which otel-training cannot see, as the last step's tail. Either way that
time is not the next step's, nor the fetched batch a wait of an eval step.)"""

import logging
import os
import tempfile
import time
import warnings
from collections.abc import Iterable, Mapping
from functools import partial
from typing import Any, Literal, Optional, Union, cast

import lightning as L
import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.loggers import Logger
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.strategies import Strategy
from lightning.fabric.wrappers import _unwrap_objects
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities import apply_to_collection
from torch.utils.data import Dataset
from torchmetrics.functional.classification.accuracy import accuracy
from tqdm import tqdm

# (not in the original) trainer.py names ``L.fabric.utilities.types.LRScheduler``, which
# lightning.fabric no longer re-exports since 2.6 (#21327): an AttributeError at import
LRScheduler = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

from _truth import BEFORE, EVAL, OUTSIDE, TRAIN, Ledger, Truth

logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")
torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
truth = Truth("fabric_accumulate")

EPOCHS, GRAD_ACCUM, VAL_EVERY = 3, 3, 2
N_TRAIN, N_VAL, BATCH_TRAIN, BATCH_VAL = 56, 32, 4, 8  # 14 train batches (12 used), 4 val batches
LIMIT_TRAIN, LIMIT_VAL = 12, 20  # run.py: limit_train_batches=10, limit_val_batches=20
SAMPLE_DELAY_TRAIN, SAMPLE_DELAY_VAL = 0.003, 0.002
LOG_DELAY, SAVE_DELAY = 0.010, 0.008  # (time between steps stays under 10% of the loop: the self-check)
IMG = 12
pending = [0]  # (truth) backward passes since the last update


# -- planted: data, a remote logger, a slow checkpoint file system --------------------------
# (truth) Ledger (_truth.py): the Dataset's sleeps for the batch being fetched, booked when the loop
# body takes the batch (a step's ``dataloader_next``) or leaves it (``OUTSIDE``).


class SyntheticDigits(Dataset):
    def __init__(self, n, delay, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 1, IMG, IMG, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.delay = delay
        self.ledger = Ledger(truth)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        self.ledger.sleep(self.delay)  # decode + ToTensor, on the fly
        return self.x[i], self.y[i]


class RemoteLogger(Logger):
    """A Fabric logger posting every ``log_metrics`` call to a metrics service,
    synchronously (a slow HTTP round trip)."""

    @property
    def name(self):
        return "remote"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        key = next(iter(metrics))  # (truth) who logs: an epoch-end hook runs between steps
        mode = OUTSIDE if key.startswith("epoch/") else EVAL if key.startswith("val/") else TRAIN
        truth.sleep(mode, "outside" if mode == OUTSIDE else "untracked", LOG_DELAY)


class NetworkCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        super().save_checkpoint(checkpoint, path, storage_options)
        truth.sleep_outside(SAVE_DELAY)  # the upload to a network file system


class MetricsCallback:
    """A Fabric callback (any object with hook methods): per-batch and per-epoch metrics."""

    def on_after_setup(self, fabric, module):
        self.fabric = fabric
        self.train_losses, self.val_accs = [], []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.train_losses.append(outputs["loss"])
        self.fabric.log_dict({"train/loss": outputs["loss"], "train/accuracy": outputs["accuracy"]})

    def on_train_epoch_end(self):
        self.fabric.log("epoch/train_loss", torch.stack(self.train_losses).mean())
        self.train_losses.clear()

    def on_validation_batch_end(self, outputs, batch, batch_idx):
        self.val_accs.append(outputs["accuracy"])
        self.fabric.log_dict({"val/loss": outputs["loss"], "val/accuracy": outputs["accuracy"]})

    def on_validation_epoch_end(self):
        self.fabric.log("epoch/val_accuracy", torch.stack(self.val_accs).mean())
        self.val_accs.clear()


# -- examples/fabric/build_your_own_trainer/trainer.py ------------------------------------
class MyCustomTrainer:
    def __init__(
        self,
        accelerator: Union[str, Accelerator] = "auto",
        strategy: Union[str, Strategy] = "auto",
        devices: Union[list[int], str, int] = "auto",
        precision: Union[str, int] = "32-true",
        plugins: Optional[Union[str, Any]] = None,
        callbacks: Optional[Union[list[Any], Any]] = None,
        loggers: Optional[Union[Logger, list[Logger]]] = None,
        max_epochs: Optional[int] = 1000,
        max_steps: Optional[int] = None,
        grad_accum_steps: int = 1,
        limit_train_batches: Union[int, float] = float("inf"),
        limit_val_batches: Union[int, float] = float("inf"),
        validation_frequency: int = 1,
        use_distributed_sampler: bool = True,
        checkpoint_dir: str = "./checkpoints",
        checkpoint_frequency: int = 1,
    ) -> None:
        self.fabric = L.Fabric(
            accelerator=accelerator,
            strategy=strategy,
            devices=devices,
            precision=precision,
            plugins=plugins,
            callbacks=callbacks,
            loggers=loggers,
        )
        self.global_step = 0
        self.grad_accum_steps: int = grad_accum_steps
        self.current_epoch = 0

        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.should_stop = False

        # ensures limit_X_batches is either int or inf
        if not isinstance(limit_train_batches, int):
            assert limit_train_batches == float("inf")

        if not isinstance(limit_val_batches, int):
            assert limit_val_batches == float("inf")

        self.limit_train_batches = limit_train_batches
        self.limit_val_batches = limit_val_batches
        self.validation_frequency = validation_frequency
        self.use_distributed_sampler = use_distributed_sampler
        self._current_train_return: Union[torch.Tensor, Mapping[str, Any]] = {}
        self._current_val_return: Optional[Union[torch.Tensor, Mapping[str, Any]]] = {}

        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_frequency = checkpoint_frequency

    def fit(
        self,
        model: L.LightningModule,
        train_loader: torch.utils.data.DataLoader,
        val_loader: torch.utils.data.DataLoader,
        ckpt_path: Optional[str] = None,
    ):
        self.fabric.launch()

        # setup dataloaders
        train_loader = self.fabric.setup_dataloaders(train_loader, use_distributed_sampler=self.use_distributed_sampler)
        if val_loader is not None:
            val_loader = self.fabric.setup_dataloaders(val_loader, use_distributed_sampler=self.use_distributed_sampler)

        # setup model and optimizer
        if isinstance(self.fabric.strategy, L.fabric.strategies.fsdp.FSDPStrategy):
            raise NotImplementedError("BYOT currently does not support FSDP")

        optimizer, scheduler_cfg = self._parse_optimizers_schedulers(model.configure_optimizers())
        assert optimizer is not None
        model, optimizer = self.fabric.setup(model, optimizer)

        # assemble state (current epoch and global step will be added in save)
        state = {"model": model, "optim": optimizer, "scheduler": scheduler_cfg}

        # load last checkpoint if available
        if ckpt_path is not None and os.path.isdir(ckpt_path):
            latest_checkpoint_path = self.get_latest_checkpoint(self.checkpoint_dir)
            if latest_checkpoint_path is not None:
                self.load(state, latest_checkpoint_path)

                # check if we even need to train here
                if self.max_epochs is not None and self.current_epoch >= self.max_epochs:
                    self.should_stop = True

        truth.start()
        while not self.should_stop:
            self.train_loop(
                model, optimizer, train_loader, limit_batches=self.limit_train_batches, scheduler_cfg=scheduler_cfg
            )

            if self.should_validate:
                self.val_loop(model, val_loader, limit_batches=self.limit_val_batches)

            with truth.timed(OUTSIDE, "outside"):  # both loops have ended: between steps
                self.step_scheduler(model, scheduler_cfg, level="epoch", current_value=self.current_epoch)

                self.current_epoch += 1

                # stopping condition on epoch level
                if self.max_epochs is not None and self.current_epoch >= self.max_epochs:
                    self.should_stop = True

                self.save(state)
        truth.stop()

        # reset for next fit call
        self.should_stop = False

    def train_loop(
        self,
        model: L.LightningModule,
        optimizer: torch.optim.Optimizer,
        train_loader: torch.utils.data.DataLoader,
        limit_batches: Union[int, float] = float("inf"),
        scheduler_cfg: Optional[Mapping[str, Any]] = None,
    ):
        with truth.timed(OUTSIDE if truth.train_steps else BEFORE, "outside"):  # after the last loop ended
            self.fabric.call("on_train_epoch_start")
            iterable = self.progbar_wrapper(
                train_loader, total=min(len(train_loader), limit_batches), desc=f"Epoch {self.current_epoch}"
            )
        ledger = train_loader.dataset.ledger  # (truth)

        for batch_idx, batch in enumerate(iterable):
            # end epoch if stopping training completely or max batches for this epoch reached
            if self.should_stop or batch_idx >= limit_batches:
                ledger.book(OUTSIDE)  # (truth) a batch fetched for no step: the loop is over
                truth.loop_end()
                break
            ledger.book(TRAIN)  # (truth)

            self.fabric.call("on_train_batch_start", batch, batch_idx)

            # check if optimizer should step in gradient accumulation
            # (not in the original: `self.global_step % self.grad_accum_steps == 0`, see the docstring)
            should_optim_step = (batch_idx + 1) % self.grad_accum_steps == 0
            if should_optim_step:
                # currently only supports a single optimizer
                self.fabric.call("on_before_optimizer_step", optimizer)

                # optimizer step runs train step internally through closure
                optimizer.step(partial(self.training_step, model=model, batch=batch, batch_idx=batch_idx))
                self.fabric.call("on_before_zero_grad", optimizer)

                optimizer.zero_grad()

            else:
                # gradient accumulation -> no optimizer step
                # (Fabric's gradient-accumulation docs: skip the gradient sync while accumulating)
                with self.fabric.no_backward_sync(model, enabled=True):
                    self.training_step(model=model, batch=batch, batch_idx=batch_idx)

            self.fabric.call("on_train_batch_end", self._current_train_return, batch, batch_idx)

            # this guard ensures, we only step the scheduler once per global step
            if should_optim_step:
                self.step_scheduler(model, scheduler_cfg, level="step", current_value=self.global_step)

            # add output values to progress bar
            self._format_iterable(iterable, self._current_train_return, "train")

            # only increase global step if optimizer stepped
            self.global_step += int(should_optim_step)

            # stopping criterion on step level
            if self.max_steps is not None and self.global_step >= self.max_steps:
                self.should_stop = True
                break
        else:
            truth.loop_end()  # (truth) the loader ended (not reached with limit_train_batches here)

        with truth.timed(OUTSIDE, "outside"):
            self.fabric.call("on_train_epoch_end")

    def val_loop(
        self,
        model: L.LightningModule,
        val_loader: Optional[torch.utils.data.DataLoader],
        limit_batches: Union[int, float] = float("inf"),
    ):
        with truth.timed(OUTSIDE, "outside"):  # the train loop has ended: between steps
            # no validation if val_loader wasn't passed
            if val_loader is None:
                return

            # no validation but warning if val_loader was passed, but validation_step not implemented
            if val_loader is not None and not is_overridden("validation_step", _unwrap_objects(model)):
                L.fabric.utilities.rank_zero_warn(
                    "Your LightningModule does not have a validation_step implemented, "
                    "but you passed a validation dataloder. Skipping Validation."
                )
                return

            if not is_overridden("on_validation_model_eval", _unwrap_objects(model)):
                model.eval()
            else:
                self.fabric.call("on_validation_model_eval")  # calls `model.eval()`

            torch.set_grad_enabled(False)

            self.fabric.call("on_validation_epoch_start")

            iterable = self.progbar_wrapper(val_loader, total=min(len(val_loader), limit_batches), desc="Validation")
        ledger = val_loader.dataset.ledger  # (truth)

        for batch_idx, batch in enumerate(iterable):
            # end epoch if stopping training completely or max batches for this epoch reached
            if self.should_stop or batch_idx >= limit_batches:
                ledger.book(OUTSIDE)  # (truth) (not reached: 4 batches, limit_val_batches=20)
                truth.loop_end()
                break
            ledger.book(EVAL)  # (truth)

            self.fabric.call("on_validation_batch_start", batch, batch_idx)

            out = model.validation_step(batch, batch_idx)
            truth.eval_step()  # (truth)
            # avoid gradients in stored/accumulated values -> prevents potential OOM
            out = apply_to_collection(out, torch.Tensor, lambda x: x.detach())

            self.fabric.call("on_validation_batch_end", out, batch, batch_idx)
            self._current_val_return = out

            self._format_iterable(iterable, self._current_val_return, "val")
        else:
            truth.loop_end()  # (truth) the loader's StopIteration: until the next step, between steps

        with truth.timed(OUTSIDE, "outside"):
            self.fabric.call("on_validation_epoch_end")

            if not is_overridden("on_validation_model_train", _unwrap_objects(model)):
                model.train()
            else:
                self.fabric.call("on_validation_model_train")
            torch.set_grad_enabled(True)

    def training_step(self, model: L.LightningModule, batch: Any, batch_idx: int) -> torch.Tensor:
        outputs: Union[torch.Tensor, Mapping[str, Any]] = model.training_step(batch, batch_idx=batch_idx)

        loss = outputs if isinstance(outputs, torch.Tensor) else outputs["loss"]

        self.fabric.call("on_before_backward", loss)
        self.fabric.backward(loss)
        pending[0] += 1  # (truth)
        self.fabric.call("on_after_backward")

        # avoid gradients in stored/accumulated values -> prevents potential OOM
        self._current_train_return = apply_to_collection(outputs, dtype=torch.Tensor, function=lambda x: x.detach())

        return loss

    def step_scheduler(
        self,
        model: L.LightningModule,
        scheduler_cfg: Optional[Mapping[str, Any]],
        level: Literal["step", "epoch"],
        current_value: int,
    ) -> None:
        # no scheduler
        if scheduler_cfg is None:
            return

        # wrong interval (step vs. epoch)
        if scheduler_cfg["interval"] != level:
            return

        # right interval, but wrong step wrt frequency
        if current_value % cast(int, scheduler_cfg["frequency"]) != 0:
            return

        # assemble potential monitored values
        possible_monitor_vals = {None: None}
        if isinstance(self._current_train_return, torch.Tensor):
            possible_monitor_vals.update("train_loss", self._current_train_return)
        elif isinstance(self._current_train_return, Mapping):
            possible_monitor_vals.update({"train_" + k: v for k, v in self._current_train_return.items()})

        if isinstance(self._current_val_return, torch.Tensor):
            possible_monitor_vals.update("val_loss", self._current_val_return)
        elif isinstance(self._current_val_return, Mapping):
            possible_monitor_vals.update({"val_" + k: v for k, v in self._current_val_return.items()})

        try:
            monitor = possible_monitor_vals[cast(Optional[str], scheduler_cfg["monitor"])]
        except KeyError as ex:
            possible_keys = list(possible_monitor_vals.keys())
            raise KeyError(
                f"monitor {scheduler_cfg['monitor']} is invalid. Possible values are {possible_keys}."
            ) from ex

        # rely on model hook for actual step
        model.lr_scheduler_step(scheduler_cfg["scheduler"], monitor)

    @property
    def should_validate(self) -> bool:
        """Whether to currently run validation."""
        return self.current_epoch % self.validation_frequency == 0

    def progbar_wrapper(self, iterable: Iterable, total: int, **kwargs: Any):
        if self.fabric.is_global_zero:
            return tqdm(iterable, total=total, **kwargs)
        return iterable

    def load(self, state: Optional[Mapping], path: str) -> None:
        if state is None:
            state = {}

        remainder = self.fabric.load(path, state)
        self.global_step = remainder.pop("global_step")
        self.current_epoch = remainder.pop("current_epoch")

        if remainder:
            raise RuntimeError(f"Unused Checkpoint Values: {remainder}")

    def save(self, state: Optional[Mapping]) -> None:
        if state is None:
            state = {}

        state.update(global_step=self.global_step, current_epoch=self.current_epoch)

        self.fabric.save(os.path.join(self.checkpoint_dir, f"epoch-{self.current_epoch:04d}.ckpt"), state)

    @staticmethod
    def get_latest_checkpoint(checkpoint_dir: str) -> Optional[str]:
        if not os.path.isdir(checkpoint_dir):
            return None

        items = sorted(os.listdir(checkpoint_dir))

        if not items:
            return None

        return os.path.join(checkpoint_dir, items[-1])

    def _parse_optimizers_schedulers(self, configure_optim_output):
        _lr_sched_defaults = {"interval": "epoch", "frequency": 1, "monitor": "val_loss"}

        # single optimizer
        if isinstance(configure_optim_output, L.fabric.utilities.types.Optimizable):
            return configure_optim_output, None

        # single lr scheduler
        if isinstance(configure_optim_output, LRScheduler):
            return None, _lr_sched_defaults.update(scheduler=configure_optim_output)

        # single lr scheduler config
        if isinstance(configure_optim_output, Mapping):
            _lr_sched_defaults.update(configure_optim_output)
            return None, _lr_sched_defaults

        # list or tuple
        if isinstance(configure_optim_output, (list, tuple)):
            if all(isinstance(_opt_cand, L.fabric.utilities.types.Optimizable) for _opt_cand in configure_optim_output):
                # single optimizer in list
                if len(configure_optim_output) == 1:
                    return configure_optim_output[0][0], None

                raise NotImplementedError("BYOT only supports a single optimizer")

            if all(
                isinstance(_lr_cand, (LRScheduler, Mapping))
                for _lr_cand in configure_optim_output
            ):
                # single scheduler in list
                if len(configure_optim_output) == 1:
                    return None, self._parse_optimizers_schedulers(configure_optim_output[0])[1]

            # optimizer and lr scheduler
            elif len(configure_optim_output) == 2:
                opt_cands, lr_cands = (
                    self._parse_optimizers_schedulers(configure_optim_output[0])[0],
                    self._parse_optimizers_schedulers(configure_optim_output[1])[1],
                )
                return opt_cands, lr_cands

        return None, None

    @staticmethod
    def _format_iterable(
        prog_bar, candidates: Optional[Union[torch.Tensor, Mapping[str, Union[torch.Tensor, float, int]]]], prefix: str
    ):
        if isinstance(prog_bar, tqdm) and candidates is not None:
            postfix_str = ""
            float_candidates = apply_to_collection(candidates, torch.Tensor, lambda x: x.item())
            if isinstance(candidates, torch.Tensor):
                postfix_str += f" {prefix}_loss: {float_candidates:.3f}"
            elif isinstance(candidates, Mapping):
                for k, v in float_candidates.items():
                    postfix_str += f" {prefix}_{k}: {v:.3f}"

            if postfix_str:
                prog_bar.set_postfix_str(postfix_str)


# -- examples/fabric/build_your_own_trainer/run.py ------------------------------------------
class MNISTModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(
            torch.nn.Conv2d(in_channels=1, out_channels=4, kernel_size=5, stride=1, padding=2),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(kernel_size=2),
            torch.nn.Conv2d(4, 8, 5, 1, 2),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            # fully connected layer, output 10 classes
            torch.nn.Linear(8 * (IMG // 4) * (IMG // 4), 10),
        )
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor):
        return self.model(x)

    def training_step(self, batch, batch_idx: int):
        x, y = batch

        logits = self(x)

        loss = self.loss_fn(logits, y)
        accuracy_train = accuracy(logits.argmax(-1), y, num_classes=10, task="multiclass", top_k=1)

        return {"loss": loss, "accuracy": accuracy_train}

    def configure_optimizers(self):
        optim = torch.optim.Adam(self.parameters(), lr=1e-3)
        optim.register_step_post_hook(  # (truth) one training step per update, its backward passes
            lambda *_: (truth.train_step(microbatches=pending[0]), pending.__setitem__(0, 0)))
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=EPOCHS * LIMIT_TRAIN // GRAD_ACCUM)
        return optim, {"scheduler": scheduler, "interval": "step", "frequency": 1, "monitor": None}

    def validation_step(self, *args, **kwargs):
        return self.training_step(*args, **kwargs)


def train(model):
    train_set = SyntheticDigits(N_TRAIN, SAMPLE_DELAY_TRAIN, seed=1)
    val_set = SyntheticDigits(N_VAL, SAMPLE_DELAY_VAL, seed=2)

    train_loader = torch.utils.data.DataLoader(
        train_set, batch_size=BATCH_TRAIN, shuffle=True, pin_memory=torch.cuda.is_available(), num_workers=0
    )
    val_loader = torch.utils.data.DataLoader(
        val_set, batch_size=BATCH_VAL, shuffle=False, pin_memory=torch.cuda.is_available(), num_workers=0
    )

    trainer = MyCustomTrainer(
        accelerator="cpu", devices=1, limit_train_batches=LIMIT_TRAIN, limit_val_batches=LIMIT_VAL,
        max_epochs=EPOCHS, grad_accum_steps=GRAD_ACCUM, validation_frequency=VAL_EVERY,
        plugins=[NetworkCheckpointIO()], callbacks=[MetricsCallback()], loggers=[RemoteLogger()],
        checkpoint_dir=tempfile.mkdtemp(),
    )
    trainer.fit(model, train_loader, val_loader)
    assert pending[0] == 0, "every backward pass went into an update"
    truth.notes.update(updates_per_epoch=LIMIT_TRAIN // GRAD_ACCUM, val_batches=N_VAL // BATCH_VAL,
                       global_step=trainer.global_step)


if __name__ == "__main__":
    L.seed_everything(42, verbose=False)
    train(MNISTModule())
    truth.emit()
