# Shape: huggingface/pytorch-image-models train.py (HEAD, aa4b585) with its defaults — per epoch: train_one_epoch(): for batch_idx, (input, target) in enumerate(PrefetchLoader(DataLoader)) (a generator one batch ahead), task(input, target) through timm.task.ClassificationTask (the model and the criterion in one module), backward, optimizer.step() every batch (grad_accum_steps=1), loss.item(), a log line every log_interval updates, lr_scheduler.step_update(); then validate(eval_model, ...) calling the wrapped model itself (model.eval(), inference_mode, model(input), loss_fn(output, target)) over the same PrefetchLoader on an eval DataLoader; update_summary() CSV, saver.save_checkpoint(), lr_scheduler.step(epoch + 1). No --model-ema (timm's default).
"""timm's training loop as its defaults run it, download-free and on CPU.

Training calls the task module (``task(input, target)``), whose forward calls the model
and the criterion: the root module of training is the task. ``validate()`` calls the
model directly (``task.get_eval_model()`` is the wrapped model itself): a submodule of
the module seen in training, called at top level. Both loops read a ``PrefetchLoader``
(timm/data/loader.py, copied: a generator that calls ``next()`` on the DataLoader one
batch ahead and normalizes that batch; no CUDA stream on CPU, where timm uses it too).

Truth (docs/steps.md): one training step per update (11 an epoch, one micro-batch
each); one eval step per validate batch (5 an epoch).

Planted: a slow Dataset ``__getitem__`` for both loaders (``dataloader_next``; each
fetch lands in the wait of a step of its loop, two in the first), a slow log sink
(train ``untracked`` on the log lines; eval ``untracked`` with validate's accuracy
computation timed), and, after both loops of an epoch have ended, the summary CSV, the
checkpoint save and ``lr_scheduler.step()``: between steps (``timed(OUTSIDE)`` /
``sleep_outside()``). Each user-visible ``for`` loop over a PrefetchLoader ending is a
``truth.loop_end()``.

Not in the original: ``num_workers=0`` (timm's default is 4; in-process fetches keep
the planted sleeps measurable by the script's clock), tiny sizes, no AMP / mixup /
distributed branches."""

import csv
import logging
import math
import os
import sys
import tempfile
import time
from collections import OrderedDict
from contextlib import suppress
from copy import deepcopy
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data

from _truth import EVAL, OUTSIDE, TRAIN, Truth

# LOOPS_DEVICE=cuda runs it as timm runs on a GPU (tests/test_gpu_loops.py): the model and
# losses on the device, pinned batches, the PrefetchLoader's copy and normalization on a
# side CUDA stream one batch ahead.
DEVICE = torch.device(os.environ.get("LOOPS_DEVICE", "cpu"))
if DEVICE.type == "cpu":
    torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
torch.manual_seed(0)
truth = Truth("timm_task_wrapper")

IMAGENET_DEFAULT_MEAN = (0.485, 0.456, 0.406)
IMAGENET_DEFAULT_STD = (0.229, 0.224, 0.225)
EPOCHS, BATCH, GRAD_ACCUM, LOG_INTERVAL = 2, 8, 1, 50
N_TRAIN, N_EVAL, IMG = 88, 40, 16  # 11 train batches (one update each), 5 eval batches
SAMPLE_DELAY_TRAIN, SAMPLE_DELAY_EVAL = 0.002, 0.0015
TRAIN_LOG_DELAY, EVAL_LOG_DELAY, SAVE_DELAY = 0.015, 0.006, 0.008
output_dir = tempfile.mkdtemp()


class Args:  # the argparse namespace, only what this shape reads
    grad_accum_steps = GRAD_ACCUM
    log_interval = LOG_INTERVAL
    prefetcher = True
    channels_last = False
    clip_grad = None
    distributed = False
    mixup_off_epoch = 0
    synchronize_step = False
    recovery_interval = 0
    tta = 0
    val_interval = 1
    model_ema_decay = 0.9998
    eval_metric = "top1"


args = Args()


# -- logging: a slow sink (a remote log shipper) --------------------------------------
class SlowSink(logging.Handler):
    def emit(self, record):
        sys.stdout.write(self.format(record) + "\n")
        sys.stdout.flush()
        truth.sleep(record.mode, "untracked", TRAIN_LOG_DELAY if record.mode == TRAIN else EVAL_LOG_DELAY)


_logger = logging.getLogger("train")
_logger.setLevel(logging.INFO)
_logger.addHandler(SlowSink())
_logger.propagate = False


# -- timm.utils ------------------------------------------------------------------------
class AverageMeter:
    def __init__(self):
        self.reset()

    def reset(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count if self.count else 0


def accuracy(output, target, topk=(1,)):
    maxk = min(max(topk), output.size()[1])
    batch_size = target.size(0)
    _, pred = output.topk(maxk, 1, True, True)
    pred = pred.t()
    correct = pred.eq(target.reshape(1, -1).expand_as(pred))
    return [correct[:min(k, maxk)].reshape(-1).float().sum(0) * 100. / batch_size for k in topk]


def update_summary(epoch, train_metrics, eval_metrics, filename, lr=None, write_header=False):
    rowd = OrderedDict(epoch=epoch)
    rowd.update([('train_' + k, v) for k, v in train_metrics.items()])
    if eval_metrics:
        rowd.update([('eval_' + k, v) for k, v in eval_metrics.items()])
    if lr is not None:
        rowd['lr'] = lr
    with open(filename, mode='a') as cf:
        dw = csv.DictWriter(cf, fieldnames=rowd.keys())
        if write_header:
            dw.writeheader()
        dw.writerow(rowd)


class CheckpointSaver:
    """timm.utils.CheckpointSaver, reduced: save to a temp file, rename, keep the best."""

    def __init__(self, model, optimizer, task, checkpoint_dir, decreasing=False):
        self.model, self.optimizer, self.task = model, optimizer, task
        self.checkpoint_dir, self.decreasing = checkpoint_dir, decreasing
        self.best_metric, self.best_epoch = None, None

    def save_checkpoint(self, epoch, metric=None):
        tmp = os.path.join(self.checkpoint_dir, 'tmp.pth.tar')
        last = os.path.join(self.checkpoint_dir, 'last.pth.tar')
        state = {'epoch': epoch, 'state_dict': self.model.state_dict(),
                 'optimizer': self.optimizer.state_dict(), 'metric': metric}
        ema = self.task.get_trainable_module(ema=True)
        if ema is not None:
            state['state_dict_ema'] = ema.module.state_dict()
        torch.save(state, tmp)
        truth.sleep_outside(SAVE_DELAY)  # a slow network file system
        os.replace(tmp, last)
        better = self.best_metric is None or (metric < self.best_metric if self.decreasing
                                              else metric > self.best_metric)
        if better:
            self.best_metric, self.best_epoch = metric, epoch
        return self.best_metric, self.best_epoch


# -- timm.data: fast_collate + PrefetchLoader ------------------------------------------
class SyntheticImages(torch.utils.data.Dataset):
    """uint8 CHW images (what timm's transforms hand fast_collate with the prefetcher)."""

    def __init__(self, n, delay, mode, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, 256, (n, 3, IMG, IMG), dtype=torch.uint8, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.delay, self.mode = delay, mode

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        truth.sleep(self.mode, "dataloader_next", self.delay)  # JPEG decode + RandomResizedCrop
        return self.x[i], int(self.y[i])


def fast_collate(batch):
    batch_size = len(batch)
    targets = torch.tensor([b[1] for b in batch], dtype=torch.int64)
    tensor = torch.zeros((batch_size, *batch[0][0].shape), dtype=torch.uint8)
    for i in range(batch_size):
        tensor[i] += batch[i][0]
    return tensor, targets


class PrefetchLoader:
    def __init__(self, loader, mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, channels=3,
                 device=torch.device('cpu'), img_dtype=None):
        normalization_shape = (1, channels, 1, 1)
        self.loader = loader
        self.device = device
        self.img_dtype = img_dtype or torch.float32
        self.mean = torch.tensor([x * 255 for x in mean], device=device, dtype=img_dtype).view(normalization_shape)
        self.std = torch.tensor([x * 255 for x in std], device=device, dtype=img_dtype).view(normalization_shape)
        self.random_erasing = None
        self.is_cuda = device.type == 'cuda' and torch.cuda.is_available()

    def __iter__(self):
        first = True
        if self.is_cuda:
            stream = torch.cuda.Stream(device=self.device)
            stream_context = partial(torch.cuda.stream, stream=stream)
        else:
            stream = None
            stream_context = suppress

        for next_input, next_target in self.loader:

            with stream_context():
                next_input = next_input.to(device=self.device, non_blocking=True)
                next_target = next_target.to(device=self.device, non_blocking=True)
                next_input = next_input.to(self.img_dtype).sub_(self.mean).div_(self.std)
                if self.random_erasing is not None:
                    next_input = self.random_erasing(next_input)

            if not first:
                yield input, target
            else:
                first = False

            if stream is not None:
                torch.cuda.current_stream(device=self.device).wait_stream(stream)

            input = next_input
            target = next_target

        yield input, target

    def __len__(self):
        return len(self.loader)

    @property
    def sampler(self):
        return self.loader.sampler

    @property
    def batch_sampler(self):
        return self.loader.batch_sampler

    @property
    def dataset(self):
        return self.loader.dataset


def create_loader(dataset, batch_size, is_training):
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, shuffle=is_training, num_workers=0,
        collate_fn=fast_collate, drop_last=is_training, pin_memory=DEVICE.type == "cuda")
    return PrefetchLoader(loader, device=DEVICE)


def _set_loader_epoch(loader, epoch):
    if hasattr(loader.dataset, 'set_epoch'):
        loader.dataset.set_epoch(epoch)
    if hasattr(loader.batch_sampler, 'set_epoch'):
        loader.batch_sampler.set_epoch(epoch)
    elif hasattr(loader.sampler, 'set_epoch'):
        loader.sampler.set_epoch(epoch)


# -- timm.scheduler: a plain class, not a torch LRScheduler ------------------------------
class CosineLRScheduler:
    def __init__(self, optimizer, t_initial, lr_min=1e-5, warmup_t=1, warmup_lr_init=1e-4,
                 t_in_epochs=True, param_group_field='lr'):
        self.optimizer = optimizer
        self.param_group_field = param_group_field
        self._initial_param_group_field = f"initial_{param_group_field}"
        for group in self.optimizer.param_groups:
            group.setdefault(self._initial_param_group_field, group[param_group_field])
        self.base_values = [group[self._initial_param_group_field] for group in self.optimizer.param_groups]
        self.metric = None
        self.t_in_epochs = t_in_epochs
        self.t_initial, self.lr_min = t_initial, lr_min
        self.warmup_t, self.warmup_lr_init = warmup_t, warmup_lr_init
        self.warmup_steps = [(v - warmup_lr_init) / self.warmup_t for v in self.base_values]
        self.update_groups([warmup_lr_init] * len(self.base_values))

    def _get_lr(self, t):
        if t < self.warmup_t:
            return [self.warmup_lr_init + t * s for s in self.warmup_steps]
        t_curr = t % self.t_initial
        return [self.lr_min + 0.5 * (lr_max - self.lr_min) * (1 + math.cos(math.pi * t_curr / self.t_initial))
                for lr_max in self.base_values]

    def _get_values(self, t, on_epoch=True):
        proceed = (on_epoch and self.t_in_epochs) or (not on_epoch and not self.t_in_epochs)
        return self._get_lr(t) if proceed else None

    def step(self, epoch, metric=None):
        self.metric = metric
        values = self._get_values(epoch, on_epoch=True)
        if values is not None:
            self.update_groups(values)

    def step_update(self, num_updates, metric=None):
        self.metric = metric
        values = self._get_values(num_updates, on_epoch=False)
        if values is not None:
            self.update_groups(values)

    def update_groups(self, values):
        for param_group, value in zip(self.optimizer.param_groups, values):
            param_group[self.param_group_field] = value


# -- timm.utils.model_ema.ModelEmaV3 + timm.task ---------------------------------------
class ModelEmaV3(nn.Module):
    def __init__(self, model, decay=0.9999, min_decay=0.0, update_after_step=0, device=None, foreach=True):
        super().__init__()
        self.module = deepcopy(model)
        self.module.eval()
        self.decay, self.min_decay, self.update_after_step = decay, min_decay, update_after_step
        self.foreach = foreach
        self.device = device

    def get_decay(self, step=None):
        if step is None:
            return self.decay
        step = max(0, step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        return self.decay

    @torch.no_grad()
    def update(self, model, step=None):
        decay = self.get_decay(step)
        ema_lerp_values, model_lerp_values = [], []
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.is_floating_point():
                ema_lerp_values.append(ema_v)
                model_lerp_values.append(model_v)
            else:
                ema_v.copy_(model_v)
        torch._foreach_lerp_(ema_lerp_values, model_lerp_values, weight=1. - decay)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class ClassificationTask(nn.Module):
    """timm.task.ClassificationTask: forward + loss in one module; owns the EMA."""

    def __init__(self, model, criterion):
        super().__init__()
        self.trainable_module = model
        self.criterion = criterion

    def get_trainable_module(self, ema=False):
        if ema:
            return getattr(self, 'trainable_module_ema', None)
        return self.trainable_module

    def setup_ema(self, decay=0.9999):
        self.trainable_module_ema = ModelEmaV3(self.get_trainable_module(), decay=decay)
        return self.trainable_module_ema

    def has_ema(self):
        return self.get_trainable_module(ema=True) is not None

    def update_ema(self, step=None):
        if self.has_ema():
            self.get_trainable_module(ema=True).update(self.get_trainable_module(), step=step)

    def get_eval_model(self, ema=False):
        return self.get_trainable_module(ema=ema)

    def forward(self, input, target):
        output = self.trainable_module(input)
        loss = self.criterion(output, target)
        return {'loss': loss, 'output': output}


class TinyResNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv_stem = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv_stem(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


# -- train.py ----------------------------------------------------------------------------
backward_passes = 0  # truth: backward passes since the last update


def train_one_epoch(epoch, model, loader, optimizer, args, task=None, lr_scheduler=None, saver=None,
                    amp_autocast=suppress, loss_scaler=None):
    global backward_passes
    second_order = hasattr(optimizer, 'is_second_order') and optimizer.is_second_order
    update_time_m, data_time_m, losses_m = AverageMeter(), AverageMeter(), AverageMeter()

    trainable_module = task.get_trainable_module()
    trainable_module.train()

    accum_steps = args.grad_accum_steps
    last_accum_steps = len(loader) % accum_steps
    updates_per_epoch = (len(loader) + accum_steps - 1) // accum_steps
    num_updates = epoch * updates_per_epoch
    last_batch_idx = len(loader) - 1
    last_batch_idx_to_accum = len(loader) - last_accum_steps

    data_start_time = update_start_time = time.time()
    optimizer.zero_grad()
    update_sample_count = 0
    for batch_idx, (input, target) in enumerate(loader):
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        update_idx = batch_idx // accum_steps
        if batch_idx >= last_batch_idx_to_accum:
            accum_steps = last_accum_steps

        if args.channels_last:
            input = input.contiguous(memory_format=torch.channels_last)

        data_time_m.update(accum_steps * (time.time() - data_start_time))

        def _forward():
            with amp_autocast():
                result = task(input, target)
                _loss = result['loss']
            if accum_steps > 1:
                _loss /= accum_steps
            return _loss, result

        def _backward(_loss):
            _loss.backward(create_graph=second_order)
            if need_update:
                optimizer.step()

        batch_size = input.shape[0]
        global_batch_size = batch_size
        loss, result = _forward()
        _backward(loss)
        backward_passes += 1
        if need_update:
            truth.train_step(microbatches=backward_passes)
            backward_passes = 0

        losses_m.update(loss.item() * accum_steps, batch_size)
        update_sample_count += global_batch_size

        if not need_update:
            data_start_time = time.time()
            continue

        num_updates += 1
        optimizer.zero_grad()
        task.update_ema(step=num_updates)

        time_now = time.time()
        update_time_m.update(time.time() - update_start_time)
        update_start_time = time_now

        if update_idx % args.log_interval == 0 or last_batch:
            with truth.timed(TRAIN, "untracked"):
                lrl = [param_group['lr'] for param_group in optimizer.param_groups]
                lr = sum(lrl) / len(lrl)
                loss_avg, loss_now = losses_m.avg, losses_m.val
                _logger.info(
                    f'Train: {epoch} [{update_idx:>4d}/{updates_per_epoch} '
                    f'({100. * (update_idx + 1) / updates_per_epoch:>3.0f}%)]  '
                    f'Loss: {loss_now:#.3g} ({loss_avg:#.3g})  '
                    f'Time: {update_time_m.val:.3f}s, {update_sample_count / update_time_m.val:>7.2f}/s  '
                    f'({update_time_m.avg:.3f}s, {update_sample_count / update_time_m.avg:>7.2f}/s)  '
                    f'LR: {lr:.3e}  '
                    f'Data: {data_time_m.val:.3f} ({data_time_m.avg:.3f})',
                    extra={'mode': TRAIN})

        if saver is not None and args.recovery_interval and ((update_idx + 1) % args.recovery_interval == 0):
            saver.save_recovery(epoch, batch_idx=update_idx)

        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=num_updates, metric=losses_m.avg)

        update_sample_count = 0
        data_start_time = time.time()
        # end for
    truth.loop_end()  # the PrefetchLoader's generator ended: until validate's first batch, between steps

    if hasattr(optimizer, 'sync_lookahead'):
        optimizer.sync_lookahead()

    return OrderedDict([('loss', losses_m.avg)])


def validate(model, loader, loss_fn, args, amp_autocast=suppress, log_suffix=''):
    batch_time_m, losses_m, top1_m, top5_m = AverageMeter(), AverageMeter(), AverageMeter(), AverageMeter()

    model.eval()

    end = time.time()
    last_idx = len(loader) - 1
    with torch.inference_mode():
        for batch_idx, (input, target) in enumerate(loader):
            last_batch = batch_idx == last_idx
            if args.channels_last:
                input = input.contiguous(memory_format=torch.channels_last)

            with amp_autocast():
                output = model(input)
                if isinstance(output, (tuple, list)):
                    output = output[0]

                reduce_factor = args.tta
                if reduce_factor > 1:
                    output = output.unfold(0, reduce_factor, reduce_factor).mean(dim=2)
                    target = target[0:target.size(0):reduce_factor]

                loss = loss_fn(output, target)
            with truth.timed(EVAL, "untracked"):
                acc1, acc5 = accuracy(output, target, topk=(1, 5))
                reduced_loss = loss.data

            batch_size = output.shape[0]
            losses_m.update(reduced_loss.item(), batch_size)
            top1_m.update(acc1.item(), batch_size)
            top5_m.update(acc5.item(), batch_size)
            truth.eval_step()

            batch_time_m.update(time.time() - end)
            end = time.time()
            if last_batch or batch_idx % args.log_interval == 0:
                with truth.timed(EVAL, "untracked"):
                    log_name = 'Test' + log_suffix
                    _logger.info(
                        f'{log_name}: [{batch_idx:>4d}/{last_idx}]  '
                        f'Time: {batch_time_m.val:.3f} ({batch_time_m.avg:.3f})  '
                        f'Loss: {losses_m.val:>7.3f} ({losses_m.avg:>6.3f})  '
                        f'Acc@1: {top1_m.val:>7.3f} ({top1_m.avg:>7.3f})  '
                        f'Acc@5: {top5_m.val:>7.3f} ({top5_m.avg:>7.3f})',
                        extra={'mode': EVAL})
    truth.loop_end()  # validate's PrefetchLoader loop ended: until the next step, between steps

    return OrderedDict([('loss', losses_m.avg), ('top1', top1_m.avg), ('top5', top5_m.avg)])


def main():
    dataset_train = SyntheticImages(N_TRAIN, SAMPLE_DELAY_TRAIN, TRAIN, seed=1)
    dataset_eval = SyntheticImages(N_EVAL, SAMPLE_DELAY_EVAL, EVAL, seed=2)
    loader_train = create_loader(dataset_train, BATCH, is_training=True)
    loader_eval = create_loader(dataset_eval, BATCH, is_training=False)

    model = TinyResNet().to(DEVICE)
    train_loss_fn = nn.CrossEntropyLoss().to(DEVICE)
    validate_loss_fn = nn.CrossEntropyLoss().to(DEVICE)
    task = ClassificationTask(model=model, criterion=train_loss_fn)
    model = task.get_trainable_module()
    eval_model = task.get_eval_model()
    assert eval_model is task.trainable_module  # validate() calls the wrapped model itself

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=2e-5)

    eval_metric = args.eval_metric
    decreasing_metric = eval_metric == 'loss'
    best_metric = None
    saver = CheckpointSaver(model=model, optimizer=optimizer, task=task, checkpoint_dir=output_dir,
                            decreasing=decreasing_metric)

    num_epochs = EPOCHS
    lr_scheduler = CosineLRScheduler(optimizer, t_initial=num_epochs, warmup_t=1)
    start_epoch = 0

    truth.start()
    for epoch in range(start_epoch, num_epochs):
        _set_loader_epoch(loader_train, epoch)

        train_metrics = train_one_epoch(epoch, model, loader_train, optimizer, args, task=task,
                                        lr_scheduler=lr_scheduler, saver=saver)

        eval_metrics = validate(eval_model, loader_eval, validate_loss_fn, args)

        ema_model = task.get_trainable_module(ema=True)
        if ema_model is not None:
            ema_eval_metrics = validate(task.get_eval_model(ema=True), loader_eval, validate_loss_fn, args,
                                        log_suffix=' (EMA)')
            eval_metrics = ema_eval_metrics

        with truth.timed(OUTSIDE, "outside"):  # both validate loops have ended: between steps
            lrs = [param_group['lr'] for param_group in optimizer.param_groups]
            update_summary(epoch, train_metrics, eval_metrics, filename=os.path.join(output_dir, 'summary.csv'),
                           lr=sum(lrs) / len(lrs), write_header=best_metric is None)
            latest_metric = eval_metrics[eval_metric]
            best_metric, best_epoch = saver.save_checkpoint(epoch, metric=latest_metric)
            lr_scheduler.step(epoch + 1, latest_metric)
    truth.stop()
    print(f'*** Best metric: {best_metric} (epoch {best_epoch})')
    truth.notes.update(updates_per_epoch=(N_TRAIN // BATCH + GRAD_ACCUM - 1) // GRAD_ACCUM,
                       eval_batches_per_validate=N_EVAL // BATCH)
    truth.emit()


if __name__ == '__main__':
    main()
