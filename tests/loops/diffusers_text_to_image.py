# Shape: huggingface/diffusers examples/text_to_image/train_text_to_image.py — Accelerator(gradient_accumulation_steps=2); frozen vae + text_encoder (requires_grad_(False), eval mode from from_pretrained, called with grad on); accelerator.prepare(unet, optimizer, train_dataloader, lr_scheduler); per batch `with accelerator.accumulate(unet):` vae.encode -> latents, noise, timesteps, noise_scheduler.add_noise, text_encoder(input_ids), unet -> mse_loss, gather + .item(), accelerator.backward, clip_grad_norm_ if sync_gradients, optimizer.step(), lr_scheduler.step(), optimizer.zero_grad(); `if accelerator.sync_gradients:` ema_unet.step, progress_bar.update, global_step += 1, accelerator.log; break at max_train_steps; per epoch `epoch % validation_epochs == 0`: ema store/copy_to, log_validation (StableDiffusionPipeline under no_grad per prompt: text encoder, denoising loop of unet calls, vae.decode), ema restore; at the end save the pipeline and run a final round of inference.
"""The diffusers text-to-image fine-tuning loop, download-free: tiny MLPs stand in for
AutoencoderKL (``encode``/``decode`` call its ``encoder``/``quant_conv`` and
``post_quant_conv``/``decoder`` submodules, never ``forward``), CLIPTextModel and
UNet2DConditionModel; plain tensor math for DDPMScheduler (``add_noise``) and the
validation pipeline's scheduler. As after ``from_pretrained`` in the original, the
frozen vae and text encoder are in eval mode, and in the training step they run with
gradients on (no ``torch.no_grad``): their forwards belong to the training step.

Steps (docs/steps.md): accelerate's ``accumulate()`` calls ``optimizer.step()`` on every
batch but steps the torch optimizer only when gradients sync (every second batch, and
the loader's last one): one training step per real update, counted with a step hook
on the wrapped torch optimizer; 30 images in batches of 4 make 8 batches (the last
of 2) and 4 updates of 2 micro-batches an epoch. The validation pipeline has no
DataLoader: every ``unet`` call of its denoising loop is a root forward with no
backward under ``no_grad``, so each one is an eval step (like the PPO rollout
forwards); the prompt's text-encoder forward before the loop and the ``vae.decode``
after it join the unet calls next to them. 2 prompts x 5 inference steps (20 in the
original) make 10 eval steps per validation (epochs 0 and 2 of 3, validation_epochs=2)
and 10 more in the final round. Classifier-free guidance is left out (the real
pipeline's default guidance_scale=7.5 also encodes a negative prompt and doubles the
unet batch): one text-encoder call per prompt.

Where time between steps lies: epochs 0 and 1 end with the loader's StopIteration, so
until the next step begins (the first prompt's text-encoder forward, or the next
epoch's first batch) the time is between steps (``OUTSIDE``); the last epoch is left
with ``break`` at ``max_train_steps``, so the time after it is the tail of the last
training step (as ``makemore_eval_in_loop`` counts a ``break``). Planted: a slow
Dataset ``__getitem__`` (image decoding, transforms, tokenizer: ``dataloader_next``),
a slow tensorboard flush in every ``accelerator.log`` (train ``untracked``), the
pipeline's ``from_pretrained`` (scheduler / feature-extractor configs read from disk:
outside, train or eval time as above), a slow ``numpy_to_pil`` per image and
``writer.add_images`` per validation (eval ``untracked``), and the final
``pipeline.save_pretrained`` (eval ``untracked``). The user code between forwards
(noise, ``add_noise``, the loss, EMA, scheduler steps, tokenizing) is timed with them."""

import argparse
import logging
import math
import os
import tempfile
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.tracking import GeneralTracker
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import Dataset

from _truth import EVAL, OUTSIDE, TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
truth = Truth("diffusers_text_to_image")
logger = get_logger(__name__, log_level="INFO")

VOCAB, MAX_LEN, RES, LATENT_CH = 64, 8, 8, 4
SAMPLE_DELAY = 0.004  # per image: PIL decode, Resize, crop, flip, ToTensor, tokenizer
FLUSH_DELAY = 0.025  # tensorboard writer.flush() in accelerator.log
LOAD_DELAY = 0.080  # StableDiffusionPipeline.from_pretrained: configs from disk
PIL_DELAY = 0.010  # numpy_to_pil per image
ADD_IMAGES_DELAY = 0.040  # writer.add_images of the validation images
SAVE_DELAY = 0.050  # pipeline.save_pretrained: safetensors written
# Where code between forwards lies right now (truth bookkeeping, not in the original):
# a training step's tail, an eval step, or between steps after a loader ended.
GAP = [TRAIN]


def gap():
    """Time a block of user code (no forward, no .item()/.cpu()) where it lies now."""
    return truth.timed(GAP[0], "untracked")


# --------------------------------------------------------------------- tiny models
class Pretrained:
    @classmethod
    def from_pretrained(cls, path, subfolder=None, revision=None, variant=None):
        torch.manual_seed(sum(map(ord, subfolder or cls.__name__)))
        model = cls()
        model.eval()  # ModelMixin / PreTrainedModel.from_pretrained: "model.eval()"
        return model


class ModelOutput(dict):
    """A transformers / diffusers ``ModelOutput``: fields by name or by position."""

    def __getattr__(self, name):
        return self[name]

    def __getitem__(self, key):
        return list(self.values())[key] if isinstance(key, int) else dict.__getitem__(self, key)


class DiagonalGaussianDistribution:
    def __init__(self, parameters):
        self.mean, self.logvar = torch.chunk(parameters, 2, dim=1)
        self.std = torch.exp(0.5 * self.logvar.clamp(-30.0, 20.0))

    def sample(self, generator=None):
        return self.mean + self.std * torch.randn(self.mean.shape, generator=generator)


class AutoencoderKL(Pretrained, nn.Module):
    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(scaling_factor=0.18215)
        n = LATENT_CH * 2 * 2
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(3 * RES * RES, 64), nn.SiLU(), nn.Linear(64, 2 * n))
        self.quant_conv = nn.Linear(2 * n, 2 * n)
        self.post_quant_conv = nn.Linear(n, n)
        self.decoder = nn.Sequential(nn.Linear(n, 64), nn.SiLU(), nn.Linear(64, 3 * RES * RES))

    def encode(self, x, return_dict=True):
        enc = self.encoder(x)
        enc = self.quant_conv(enc)
        posterior = DiagonalGaussianDistribution(enc.view(x.shape[0], 2 * LATENT_CH, 2, 2))
        return SimpleNamespace(latent_dist=posterior) if return_dict else (posterior,)

    def decode(self, z, return_dict=True, generator=None):
        z = self.post_quant_conv(z.flatten(1))
        dec = self.decoder(z).view(z.shape[0], 3, RES, RES)
        return SimpleNamespace(sample=dec) if return_dict else (dec,)


class CLIPTextModel(Pretrained, nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, 16)
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.final_layer_norm = nn.LayerNorm(16)

    def forward(self, input_ids, attention_mask=None, return_dict=True):
        h = self.final_layer_norm(self.encoder(self.embeddings(input_ids)))
        return ModelOutput(last_hidden_state=h) if return_dict else (h,)


class UNet2DConditionModel(Pretrained, nn.Module):
    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(in_channels=LATENT_CH, sample_size=2, time_cond_proj_dim=None)
        self.time_embedding = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 32))
        self.conv_in = nn.Linear(LATENT_CH * 4, 32)
        self.mid = nn.Sequential(nn.Linear(32 + 16, 64), nn.SiLU(), nn.Linear(64, 32), nn.SiLU())
        self.conv_out = nn.Linear(32, LATENT_CH * 4)

    def forward(self, sample, timestep, encoder_hidden_states, timestep_cond=None, cross_attention_kwargs=None,
                added_cond_kwargs=None, return_dict=True):
        timesteps = timestep if torch.is_tensor(timestep) else torch.tensor([timestep])
        timesteps = timesteps.reshape(-1).expand(sample.shape[0])
        freqs = torch.exp(-math.log(10000) * torch.arange(8, dtype=torch.float32) / 8)
        args = timesteps[:, None].float() * freqs[None]
        emb = self.time_embedding(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))
        h = self.conv_in(sample.flatten(1)) + emb
        h = self.mid(torch.cat([h, encoder_hidden_states.mean(1)], dim=-1))
        out = self.conv_out(h).view(sample.shape)
        return SimpleNamespace(sample=out) if return_dict else (out,)


class CLIPTokenizer:
    model_max_length = MAX_LEN

    @classmethod
    def from_pretrained(cls, path, subfolder=None, revision=None):
        return cls()

    def __call__(self, captions, max_length, padding="max_length", truncation=True, return_tensors="pt"):
        if isinstance(captions, str):
            captions = [captions]
        ids = torch.zeros(len(captions), max_length, dtype=torch.long)
        for row, caption in enumerate(captions):
            toks = [1] + [2 + ord(c) % (VOCAB - 2) for c in caption][: max_length - 2] + [1]
            ids[row, : len(toks)] = torch.tensor(toks)
        return SimpleNamespace(input_ids=ids, attention_mask=(ids > 0).long())


class DDPMScheduler:
    """The training noise scheduler: add_noise is tensor math on alphas_cumprod."""

    def __init__(self, num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, prediction_type="epsilon"):
        self.config = SimpleNamespace(num_train_timesteps=num_train_timesteps, prediction_type=prediction_type)
        betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps) ** 2
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.init_noise_sigma = 1.0
        self.order = 1

    @classmethod
    def from_pretrained(cls, path, subfolder=None):
        return cls()

    def register_to_config(self, **kwargs):
        self.config.__dict__.update(kwargs)

    def add_noise(self, original_samples, noise, timesteps):
        a = self.alphas_cumprod[timesteps].flatten()
        while a.dim() < original_samples.dim():
            a = a.unsqueeze(-1)
        return a.sqrt() * original_samples + (1 - a).sqrt() * noise


class DDIMScheduler(DDPMScheduler):
    """The validation pipeline's scheduler: a deterministic DDIM step between unet calls."""

    def set_timesteps(self, num_inference_steps, device=None):
        step = self.config.num_train_timesteps // num_inference_steps
        self.timesteps = torch.arange(num_inference_steps - 1, -1, -1) * step + 1
        self.step_ratio = step

    def scale_model_input(self, sample, timestep=None):
        return sample

    def step(self, model_output, timestep, sample, generator=None, return_dict=True):
        prev = int(timestep) - self.step_ratio
        a_t = self.alphas_cumprod[int(timestep)]
        a_prev = self.alphas_cumprod[prev] if prev >= 0 else torch.tensor(1.0)
        x0 = (sample - (1 - a_t).sqrt() * model_output) / a_t.sqrt()
        prev_sample = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * model_output
        return SimpleNamespace(prev_sample=prev_sample) if return_dict else (prev_sample,)


class EMAModel:
    """diffusers.training_utils.EMAModel (foreach=False): shadow params, no forward."""

    def __init__(self, parameters, decay=0.9999, min_decay=0.0, update_after_step=0, model_cls=None,
                 model_config=None, foreach=False):
        self.shadow_params = [p.clone().detach() for p in parameters]
        self.temp_stored_params = None
        self.decay, self.min_decay, self.update_after_step = decay, min_decay, update_after_step
        self.optimization_step = 0
        self.cur_decay_value = None
        self.foreach, self.model_cls, self.model_config = foreach, model_cls, model_config

    def get_decay(self, optimization_step):
        step = max(0, optimization_step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        return max(min((1 + step) / (10 + step), self.decay), self.min_decay)

    @torch.no_grad()
    def step(self, parameters):
        parameters = list(parameters)
        self.optimization_step += 1
        decay = self.get_decay(self.optimization_step)
        self.cur_decay_value = decay
        one_minus_decay = 1 - decay
        for s_param, param in zip(self.shadow_params, parameters):
            if param.requires_grad:
                s_param.sub_(one_minus_decay * (s_param - param))
            else:
                s_param.copy_(param)

    def copy_to(self, parameters):
        for s_param, param in zip(self.shadow_params, list(parameters)):
            param.data.copy_(s_param.to(param.device).data)

    def to(self, device=None, dtype=None, non_blocking=False):
        self.shadow_params = [p.to(device=device, dtype=dtype, non_blocking=non_blocking)
                              if p.is_floating_point() else p.to(device=device) for p in self.shadow_params]

    def store(self, parameters):
        self.temp_stored_params = [param.detach().cpu().clone() for param in parameters]

    def restore(self, parameters):
        for c_param, param in zip(self.temp_stored_params, parameters):
            param.data.copy_(c_param.data)
        self.temp_stored_params = None


# --------------------------------------------------------------------- pipeline
class StableDiffusionPipeline:
    def __init__(self, vae, text_encoder, tokenizer, unet, scheduler):
        self.vae, self.text_encoder, self.tokenizer, self.unet = vae, text_encoder, tokenizer, unet
        self.scheduler = scheduler
        self.torch_dtype = torch.float32

    @classmethod
    def from_pretrained(cls, path, vae, text_encoder, tokenizer=None, unet=None, safety_checker=None, revision=None,
                        variant=None, torch_dtype=None):
        truth.sleep(GAP[0], "untracked", LOAD_DELAY)  # model_index.json, scheduler, feature extractor
        return cls(vae, text_encoder, tokenizer or CLIPTokenizer(), unet, DDIMScheduler.from_pretrained(path))

    def to(self, device):
        for m in (self.vae, self.text_encoder, self.unet):
            m.to(device)
        return self

    def set_progress_bar_config(self, **kwargs):
        self._progress_bar_config = kwargs

    def save_pretrained(self, save_directory):
        truth.sleep(GAP[0], "untracked", SAVE_DELAY)  # safetensors of every component
        for name in ("vae", "text_encoder", "unet"):
            torch.save(getattr(self, name).state_dict(), os.path.join(save_directory, f"{name}.pt"))

    def numpy_to_pil(self, images):
        truth.sleep(GAP[0], "untracked", PIL_DELAY)  # PIL.Image.fromarray per image
        return [(img * 255).round().astype("uint8") for img in images]

    @torch.no_grad()
    def __call__(self, prompt, num_inference_steps=50, guidance_scale=1.0, generator=None, output_type="pil"):
        with gap():  # check_inputs, encode_prompt's tokenizer
            batch_size = 1 if isinstance(prompt, str) else len(prompt)
            text_inputs = self.tokenizer(prompt, max_length=self.tokenizer.model_max_length, padding="max_length",
                                         truncation=True, return_tensors="pt")
            text_input_ids = text_inputs.input_ids
        prompt_embeds = self.text_encoder(text_input_ids, attention_mask=None)[0]
        GAP[0] = EVAL  # (truth) the pipeline's first forward: an eval step runs from here on
        with gap():  # retrieve_timesteps, prepare_latents, extra step kwargs
            self.scheduler.set_timesteps(num_inference_steps)
            timesteps = self.scheduler.timesteps
            shape = (batch_size, self.unet.config.in_channels, 2, 2)
            latents = torch.randn(shape, generator=generator, dtype=prompt_embeds.dtype)
            latents = latents * self.scheduler.init_noise_sigma
        for i, t in enumerate(timesteps):
            with gap():
                latent_model_input = self.scheduler.scale_model_input(latents, t)
            noise_pred = self.unet(latent_model_input, t, encoder_hidden_states=prompt_embeds, timestep_cond=None,
                                   cross_attention_kwargs=None, added_cond_kwargs=None, return_dict=False)[0]
            truth.eval_step()  # one unet call of the denoising loop: one forward, no backward
            with gap():  # compute the previous noisy sample x_t -> x_t-1
                latents = self.scheduler.step(noise_pred, t, latents, generator=generator, return_dict=False)[0]
        image = self.vae.decode(latents / self.vae.config.scaling_factor, return_dict=False, generator=generator)[0]
        with gap():  # run_safety_checker (None), VaeImageProcessor.postprocess: denormalize
            has_nsfw_concept = None
            image = (image / 2 + 0.5).clamp(0, 1)
        image = image.cpu().permute(0, 2, 3, 1).float().numpy()  # pt_to_numpy
        with gap():
            image = self.numpy_to_pil(image)
        return SimpleNamespace(images=image, nsfw_content_detected=has_nsfw_concept)


# --------------------------------------------------------------------- logging
class SummaryWriter:
    def __init__(self, logdir):
        self.logdir, self.scalars = logdir, []

    def add_scalar(self, tag, value, global_step=None):
        self.scalars.append((tag, value, global_step))

    def add_images(self, tag, images, global_step=None, dataformats="NCHW"):
        truth.sleep(GAP[0], "untracked", ADD_IMAGES_DELAY)  # PNG-encode the grid, write an event

    def flush(self):
        truth.sleep(TRAIN, "untracked", FLUSH_DELAY)  # the event file on a slow disk


class TensorBoardTracker(GeneralTracker):
    """accelerate's TensorBoardTracker with a stand-in SummaryWriter (no tensorboard)."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name, logging_dir):
        super().__init__()
        self.run_name, self.logging_dir = run_name, logging_dir

    def start(self):
        self.writer = SummaryWriter(os.path.join(self.logging_dir, self.run_name))

    @property
    def tracker(self):
        return self.writer

    def store_init_configuration(self, values):
        self.hparams = dict(values)

    def log(self, values, step=None, **kwargs):
        for k, v in values.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()


# --------------------------------------------------------------------- data
class ImageCaptionDataset(Dataset):
    """``dataset["train"].with_transform(preprocess_train)``: images and captions
    decoded, transformed and tokenized on access."""

    def __init__(self, n, tokenizer):
        g = torch.Generator().manual_seed(0)
        self.images = torch.rand(n, 3, RES + 2, RES + 2, generator=g)
        self.captions = [f"a drawing of creature number {i}" for i in range(n)]
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.captions)

    def __getitem__(self, i):
        truth.sleep(TRAIN, "dataloader_next", SAMPLE_DELAY)
        image = self.images[i, :, 1:1 + RES, 1:1 + RES]  # CenterCrop
        pixel_values = (image - 0.5) / 0.5  # Normalize([0.5], [0.5])
        input_ids = self.tokenizer(self.captions[i], max_length=self.tokenizer.model_max_length).input_ids[0]
        return {"pixel_values": pixel_values, "input_ids": input_ids}


def log_validation(vae, text_encoder, tokenizer, unet, args, accelerator, weight_dtype, epoch):
    with gap():
        logger.info("Running validation... ")
        pipeline = StableDiffusionPipeline.from_pretrained(
            args.pretrained_model_name_or_path, vae=accelerator.unwrap_model(vae),
            text_encoder=accelerator.unwrap_model(text_encoder), tokenizer=tokenizer,
            unet=accelerator.unwrap_model(unet), safety_checker=None, revision=args.revision, variant=args.variant,
            torch_dtype=weight_dtype)
        pipeline = pipeline.to(accelerator.device)
        pipeline.set_progress_bar_config(disable=True)
        generator = None if args.seed is None else torch.Generator(device=accelerator.device).manual_seed(args.seed)
    images = []
    for i in range(len(args.validation_prompts)):
        with gap():
            if torch.backends.mps.is_available():
                autocast_ctx = nullcontext()
            else:
                autocast_ctx = torch.autocast(accelerator.device.type)
        with autocast_ctx:
            image = pipeline(args.validation_prompts[i], num_inference_steps=args.num_inference_steps,
                             generator=generator).images[0]
        images.append(image)
    with gap():
        for tracker in accelerator.trackers:
            if tracker.name == "tensorboard":
                np_images = np.stack([np.asarray(img) for img in images])
                tracker.writer.add_images("validation", np_images, epoch, dataformats="NHWC")
            else:
                logger.warning(f"image logging not implemented for {tracker.name}")
        del pipeline
        torch.cuda.empty_cache()
    return images


def main():
    output_dir = tempfile.mkdtemp()
    args = argparse.Namespace(
        pretrained_model_name_or_path="tiny/stable-diffusion", revision=None, variant=None, non_ema_revision=None,
        output_dir=output_dir, logging_dir="logs", seed=42, train_batch_size=4, num_train_epochs=3,
        max_train_steps=None, gradient_accumulation_steps=2, learning_rate=1e-4, lr_scheduler="constant",
        lr_warmup_steps=0, adam_beta1=0.9, adam_beta2=0.999, adam_weight_decay=1e-2, adam_epsilon=1e-8,
        max_grad_norm=1.0, use_ema=True, foreach_ema=False, offload_ema=False, noise_offset=0.0,
        input_perturbation=0.0, prediction_type=None, dream_training=False, snr_gamma=None,
        checkpointing_steps=500, validation_epochs=2, num_inference_steps=5,
        validation_prompts=["a cartoon of a blue dragon", "yoda pokemon"], tracker_project_name="text2image-fine-tune",
        mixed_precision="no", num_examples=30)

    logging_dir = os.path.join(args.output_dir, args.logging_dir)
    accelerator_project_config = ProjectConfiguration(project_dir=args.output_dir, logging_dir=logging_dir)
    accelerator = Accelerator(
        cpu=True,  # not in the original: this copy trains on the CPU
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=[TensorBoardTracker(args.tracker_project_name, logging_dir)],  # report_to="tensorboard"
        project_config=accelerator_project_config,
    )
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        datefmt="%m/%d/%Y %H:%M:%S", level=logging.INFO)
    logger.info(accelerator.state, main_process_only=False)
    if args.seed is not None:
        set_seed(args.seed)

    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained_model_name_or_path, subfolder="scheduler")
    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained_model_name_or_path, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained_model_name_or_path, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="unet")

    # Freeze vae and text_encoder and set unet to trainable
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.train()

    if args.use_ema:
        ema_unet = UNet2DConditionModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="unet")
        ema_unet = EMAModel(ema_unet.parameters(), model_cls=UNet2DConditionModel, model_config=ema_unet.config,
                            foreach=args.foreach_ema)

    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                  weight_decay=args.adam_weight_decay, eps=args.adam_epsilon)

    train_dataset = ImageCaptionDataset(args.num_examples, tokenizer)

    def collate_fn(examples):
        pixel_values = torch.stack([example["pixel_values"] for example in examples])
        pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()
        input_ids = torch.stack([example["input_ids"] for example in examples])
        return {"pixel_values": pixel_values, "input_ids": input_ids}

    train_dataloader = torch.utils.data.DataLoader(train_dataset, shuffle=True, collate_fn=collate_fn,
                                                   batch_size=args.train_batch_size, num_workers=0)

    num_warmup_steps_for_scheduler = args.lr_warmup_steps * accelerator.num_processes
    len_train_dataloader_after_sharding = math.ceil(len(train_dataloader) / accelerator.num_processes)
    num_update_steps_per_epoch = math.ceil(len_train_dataloader_after_sharding / args.gradient_accumulation_steps)
    num_training_steps_for_scheduler = args.num_train_epochs * num_update_steps_per_epoch * accelerator.num_processes
    # get_scheduler("constant"): get_constant_schedule
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)

    unet, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        unet, optimizer, train_dataloader, lr_scheduler)
    if args.use_ema:
        ema_unet.to(accelerator.device)

    weight_dtype = torch.float32
    text_encoder.to(accelerator.device, dtype=weight_dtype)
    vae.to(accelerator.device, dtype=weight_dtype)

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        assert num_training_steps_for_scheduler == args.max_train_steps * accelerator.num_processes
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    if accelerator.is_main_process:
        tracker_config = dict(vars(args))
        tracker_config.pop("validation_prompts")
        accelerator.init_trackers(args.tracker_project_name, tracker_config)

    def unwrap_model(model):
        return accelerator.unwrap_model(model)

    total_batch_size = args.train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info("***** Running training *****")
    logger.info(f"  Num examples = {len(train_dataset)}")
    logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch_size}")
    logger.info(f"  Total optimization steps = {args.max_train_steps}")
    global_step = 0
    first_epoch = 0

    # (truth) a real update is one training step: the torch optimizer's own step hook
    # (accelerate's wrapper skips the torch step while gradients accumulate)
    pending = [0]  # backward passes since the last real update
    optimizer.optimizer.register_step_post_hook(
        lambda *_: (truth.train_step(microbatches=pending[0]), pending.__setitem__(0, 0)))
    left_with_break = False

    progress_bar = SimpleNamespace(n=0, postfix={})  # tqdm(range(max_train_steps), desc="Steps")
    progress_bar.update = lambda k: setattr(progress_bar, "n", progress_bar.n + k)
    progress_bar.set_postfix = lambda **kw: progress_bar.postfix.update(kw)

    truth.start()
    for epoch in range(first_epoch, args.num_train_epochs):
        train_loss = 0.0
        for step, batch in enumerate(train_dataloader):
            GAP[0] = TRAIN
            with accelerator.accumulate(unet):
                # Convert images to latent space
                posterior = vae.encode(batch["pixel_values"].to(weight_dtype)).latent_dist
                with truth.timed(TRAIN, "untracked"):
                    latents = posterior.sample()
                    latents = latents * vae.config.scaling_factor
                    # Sample noise that we'll add to the latents
                    noise = torch.randn_like(latents)
                    if args.noise_offset:
                        noise += args.noise_offset * torch.randn((latents.shape[0], latents.shape[1], 1, 1))
                    bsz = latents.shape[0]
                    timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,),
                                              device=latents.device)
                    timesteps = timesteps.long()
                    noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)

                # Get the text embedding for conditioning
                encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]

                with truth.timed(TRAIN, "untracked"):
                    if args.prediction_type is not None:
                        noise_scheduler.register_to_config(prediction_type=args.prediction_type)
                    if noise_scheduler.config.prediction_type == "epsilon":
                        target = noise
                    else:
                        raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")

                # Predict the noise residual and compute loss
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]

                with truth.timed(TRAIN, "untracked"):
                    loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
                    # Gather the losses across all processes for logging
                    avg_loss = accelerator.gather(loss.repeat(args.train_batch_size)).mean()
                train_loss += avg_loss.item() / args.gradient_accumulation_steps

                # Backpropagate
                accelerator.backward(loss)
                pending[0] += 1
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(unet.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            # Checks if the accelerator has performed an optimization step behind the scenes
            with truth.timed(TRAIN, "untracked"):
                if accelerator.sync_gradients:
                    if args.use_ema:
                        ema_unet.step(unet.parameters())
                    progress_bar.update(1)
                    global_step += 1
                    accelerator.log({"train_loss": train_loss}, step=global_step)
                    train_loss = 0.0
                    if global_step % args.checkpointing_steps == 0:  # (not reached in this short run)
                        if accelerator.is_main_process:
                            save_path = os.path.join(args.output_dir, f"checkpoint-{global_step}")
                            accelerator.save_state(save_path)
                            logger.info(f"Saved state to {save_path}")
            step_loss = loss.detach().item()
            with truth.timed(TRAIN, "untracked"):
                logs = {"step_loss": step_loss, "lr": lr_scheduler.get_last_lr()[0]}
                progress_bar.set_postfix(**logs)

            if global_step >= args.max_train_steps:
                left_with_break = True  # (truth)
                break
        assert pending[0] == 0, "the loader's end forces an update"
        # (truth) a loop that ended with StopIteration: until the next step begins, the
        # time lies between steps; one left with break: the last training step's tail
        if not left_with_break:
            truth.loop_end()
            GAP[0] = OUTSIDE

        if accelerator.is_main_process:
            if args.validation_prompts is not None and epoch % args.validation_epochs == 0:
                if args.use_ema:
                    # Store the UNet parameters temporarily and load the EMA parameters to perform inference.
                    ema_unet.store(unet.parameters())
                    with gap():
                        ema_unet.copy_to(unet.parameters())
                log_validation(vae, text_encoder, tokenizer, unet, args, accelerator, weight_dtype, global_step)
                with gap():
                    if args.use_ema:
                        # Switch back to the original UNet parameters.
                        ema_unet.restore(unet.parameters())

    # Create the pipeline using the trained modules and save it.
    with gap():
        accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with gap():
            unet = unwrap_model(unet)
            if args.use_ema:
                ema_unet.copy_to(unet.parameters())
            pipeline = StableDiffusionPipeline.from_pretrained(
                args.pretrained_model_name_or_path, text_encoder=text_encoder, vae=vae, unet=unet,
                revision=args.revision, variant=args.variant)
            pipeline.save_pretrained(args.output_dir)

        # Run a final round of inference.
        images = []
        if args.validation_prompts is not None:
            with gap():
                logger.info("Running inference for collecting generated images...")
                pipeline = pipeline.to(accelerator.device)
                pipeline.torch_dtype = weight_dtype
                pipeline.set_progress_bar_config(disable=True)
                generator = None if args.seed is None else torch.Generator(
                    device=accelerator.device).manual_seed(args.seed)
            for i in range(len(args.validation_prompts)):
                # torch.autocast("cuda") in the original: disabled (with a warning) without CUDA
                with torch.autocast("cuda", enabled=torch.cuda.is_available()):
                    image = pipeline(args.validation_prompts[i], num_inference_steps=args.num_inference_steps,
                                     generator=generator).images[0]
                images.append(image)
    truth.stop()
    accelerator.end_training()
    truth.notes.update(global_step=global_step, updates_per_epoch=num_update_steps_per_epoch,
                       batches_per_epoch=len(train_dataloader), validation_rounds=2, final_round=True)


if __name__ == "__main__":
    main()
    truth.emit()
