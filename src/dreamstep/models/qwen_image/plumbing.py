"""Qwen-Image plumbing shared by the trainers: latent packing and ``img_shapes``, the VAE posteriors in the latents'
normalised units, prompt encoding by the pipeline's own ``encode_prompt``, the caches, the phases' placement and
loading, all laid out as diffusers' ``QwenImagePipeline`` and ``train_dreambooth_lora_qwen_image.py`` lay them out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

from dreamstep.data.cache import TensorCache, latents_for_batch, text_content_key
from dreamstep.data.dataset_config import DatasetConfig
from dreamstep.errors import UserError
from dreamstep.models import parking, quantization
from dreamstep.models.family import check_blocks_to_swap, family_of_pipeline
from dreamstep.models.loading import _DTYPE_KWARG, _from_pretrained, component_identity, host_placement
from dreamstep.models.memory_plan import PlanOptions
from dreamstep.models.parking import ParkedModules
from dreamstep.models.precision import freeze, weight_dtype_for
from dreamstep.models.qwen_image.configs import TRAINING_SHIFT
from dreamstep.models.qwen_image.family import FAMILY
from dreamstep.models.sources import folder_or_hub_id
from dreamstep.notices import CAPTION_CUT, hidden

BASE_FLAG = "--pretrained_model_name_or_path"


# ---------------------------------------------------------------- layout

def training_sigmas(scheduler: Any) -> torch.Tensor:
    """The σ table of training, (num_train_timesteps,): diffusers' script loads the scheduler with ``shift=3.0``
    over its config (with Qwen-Image's dynamic shifting the table stays unshifted), from a fresh copy, as a
    pipeline call replaces a scheduler's table with its inference schedule."""
    fresh = type(scheduler).from_config(scheduler.config, shift=TRAINING_SHIFT)
    return fresh.sigmas[:fresh.config.num_train_timesteps].clone()


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 · w/2, 4C): the transformer sees 2x2 latent patches as tokens."""
    b, c, h, w = latents.shape
    return QwenImagePipeline._pack_latents(latents, b, c, h, w)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, h/2 · w/2, 4C) -> (B, C, h, w) for a latent of ``height`` x ``width`` (diffusers' helper takes pixel sizes
    and a VAE factor, 1 here, and returns the video layout's one frame)."""
    return QwenImagePipeline._unpack_latents(tokens, height, width, vae_scale_factor=1)[:, :, 0]


def img_shapes(batch: int, sizes: list[tuple[int, int]]) -> list[list[tuple[int, int, int]]]:
    """The transformer's ``img_shapes`` for ``batch`` samples whose token sequence holds images of latent ``sizes``
    (height, width), the target first: one (frame, rows, columns) of 2x2 patches per image."""
    return [[(1, h // 2, w // 2) for h, w in sizes]] * batch


def _latent_norm(vae: torch.nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    config = vae.config
    mean = torch.tensor(config.latents_mean, device=device).view(1, config.z_dim, 1, 1)
    return mean, 1.0 / torch.tensor(config.latents_std, device=device).view(1, config.z_dim, 1, 1)


@torch.no_grad()
def encode_posterior(vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels in [-1, 1], (B, 3, H, W) -> the posterior's mean and std in the transformer's latent units
    ((z - latents_mean) / latents_std, per channel): (B, 2C, H/8, W/8), float32. The VAE reads them as one frame of
    a video."""
    posterior = vae.encode(pixels.to(vae.device, vae.dtype).unsqueeze(2)).latent_dist
    mean, inv_std = _latent_norm(vae, posterior.mean.device)
    return torch.cat([(posterior.mean[:, :, 0].float() - mean) * inv_std, posterior.std[:, :, 0].float() * inv_std],
                     dim=1)


@torch.no_grad()
def encode_prompts(pipeline: Any, prompts: list[str], max_sequence_length: int,
                   **images: Any) -> dict[str, torch.Tensor]:
    """Each prompt's embedding (B, L, D) and its mask (B, L) from the pipeline's own ``encode_prompt`` (the
    Qwen2.5-VL's last hidden state after the template's tokens, cut to ``max_sequence_length``), padded with zeros
    to ``max_sequence_length`` so cached prompts stack; :func:`batch_text` cuts a batch back to its longest prompt.
    ``images``: an Edit pipeline's ``image=`` (the prompt is encoded with them)."""
    device = pipeline.text_encoder.device
    with hidden(CAPTION_CUT):
        embeds, mask = pipeline.encode_prompt(prompt=prompts, device=device,
                                              max_sequence_length=max_sequence_length, **images)
    if mask is None:
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    pad = max_sequence_length - embeds.shape[1]
    return {"prompt_embeds": torch.nn.functional.pad(embeds.float(), (0, 0, 0, pad)).cpu(),
            "prompt_mask": torch.nn.functional.pad(mask, (0, pad)).cpu()}


def batch_text(found: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor | None]:
    """A batch's prompt embeddings cut to its longest prompt, as diffusers' script joins per-sample embeddings
    (``concat_prompt_embedding_batches``): the mask is ``None`` when no token of the batch is padding."""
    mask = found["prompt_mask"]
    length = int(mask.sum(dim=1).max())
    mask = mask[:, :length]
    return {"prompt_embeds": found["prompt_embeds"][:, :length].to(device, non_blocking=True),
            "prompt_mask": None if bool(mask.all()) else mask.to(device, non_blocking=True)}


class QwenImageConditioner:
    """Turns a collated batch into the step's inputs: VAE posteriors from the latent cache and prompt embeddings
    from the text cache, encoding (and storing) only what is not cached yet."""

    def __init__(self, pipeline: Any, *, latent_cache: TensorCache | None, text_cache: TensorCache,
                 max_sequence_length: int, device: torch.device):
        self.pipeline = pipeline
        self.latent_cache = latent_cache
        self.text_cache = text_cache
        self.max_sequence_length = max_sequence_length
        self.device = device

    def latents(self, batch: dict[str, Any], prefix: str = "") -> torch.Tensor:
        """(B, 2C, h, w) posterior mean and std of the batch's images (or its conditioning images)."""
        def encode(pixels: torch.Tensor) -> torch.Tensor:
            return encode_posterior(self.pipeline.vae, pixels.to(self.device)).cpu()

        return latents_for_batch(batch, encode, self.latent_cache, prefix=prefix).to(self.device, non_blocking=True)

    def prompts(self, captions: list[str], known: Any = None) -> dict[str, torch.Tensor | None]:
        """``prompt_embeds`` (B, L, D) and ``prompt_mask`` (B, L) or ``None`` for the captions (``known``: the cache
        entries the loader read)."""
        def encode(missing: list[int]) -> dict[str, torch.Tensor]:
            return encode_prompts(self.pipeline, [captions[i] for i in missing], self.max_sequence_length)

        found = self.text_cache.get_or_compute([text_content_key(c) for c in captions], encode, known)
        return batch_text(found, self.device)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        inputs = {"latent_dist": self.latents(batch), **self.prompts(batch["captions"], batch.get("text")),
                  "is_reg": batch["is_reg"]}
        if "masks" in batch:
            inputs["masks"] = batch["masks"].to(self.device, non_blocking=True)
        return inputs


def prompt_embeddings(conditioner: QwenImageConditioner, prompts: list[str]) -> dict[str, dict[str, Any]]:
    """The embeddings of each distinct prompt (validation prompts, encoded in the "encode text" phase)."""
    return {prompt: conditioner.prompts([prompt]) for prompt in dict.fromkeys(prompts)}


# ---------------------------------------------------------------- phases

def encode_run(conditioner: QwenImageConditioner, dataset: Any, held_out: Any | None, epochs: int,
               fill_texts: Callable[[Any, Any, int], None] = parking.fill_texts) -> None:
    """The "encode images" then "encode text" phases (:mod:`~dreamstep.models.phases`): the VAE encodes every cached
    latent while the Qwen2.5-VL waits in host memory, then the Qwen2.5-VL encodes every caption (``fill_texts``:
    :func:`~dreamstep.models.parking.fill_texts`, or an Edit run's instructions with their images) while the VAE
    waits there."""
    pipeline, device = conditioner.pipeline, conditioner.device
    parts = [(dataset, epochs)] + ([(held_out, 1)] if held_out is not None else [])
    if conditioner.latent_cache is not None:
        parking.place(pipeline.text_encoder, parking.PARKING_DEVICE)
        parking.place(pipeline.vae, device)
        for part, part_epochs in parts:
            parking.fill_latents(conditioner, part, part_epochs)
    parking.place(pipeline.vae, parking.PARKING_DEVICE)
    parking.place(pipeline.text_encoder, device)
    for part, part_epochs in parts:
        fill_texts(conditioner, part, part_epochs)


def free_text_encoder_and_park_vae(pipeline: Any, device: torch.device, *, latents_cached: bool) -> ParkedModules:
    """After the "encode" phases: the Qwen2.5-VL (8B parameters) is dropped, as diffusers' script drops it (every
    caption, held-out caption and validation prompt is in the text cache; nothing encodes text again), and when the
    latents are cached the VAE waits in host memory, coming back for validation images (``on_device("vae")``)."""
    pipeline.register_modules(text_encoder=None)
    parking.free_device_memory(device)
    encoders = ParkedModules({"vae": pipeline.vae} if latents_cached else {}, device)
    encoders.park()
    if not latents_cached:
        parking.place(pipeline.vae, device)
    return encoders


# ---------------------------------------------------------------- the base model

@dataclass
class QwenImageParts:
    """What every Qwen-Image folder holds, named as in ``QwenImagePipeline`` (the loader's folder check)."""

    tokenizer: Any
    text_encoder: Any
    vae: Any
    transformer: Any
    scheduler: Any


def pipeline_class_of(source: str) -> str | None:
    """``model_index.json``'s ``_class_name`` of a local folder (``None`` for a hub id or a folder without one)."""
    index = Path(source).expanduser() / "model_index.json"
    try:
        return json.loads(index.read_text(encoding="utf-8")).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None


def check_base(source: str, flag: str = BASE_FLAG) -> str:
    """``source`` checked before anything loads: a complete Qwen-Image pipeline folder or a hub id (cached when
    offline); another family's folder is one line naming the trainer that takes it."""
    found = pipeline_class_of(source)
    if found is not None and found not in FAMILY.pipeline_classes:
        other = family_of_pipeline(found)
        hint = f"; it is a {other.title} model: train it with dreamstep train {other.name}-lora" if other else ""
        raise UserError(f"{flag} {source}: holds a {found}, not a Qwen-Image pipeline "
                        f"({', '.join(FAMILY.pipeline_classes[:3])}){hint}")
    try:
        return folder_or_hub_id(source, QwenImageParts, "QwenImagePipeline")
    except UserError as e:
        raise UserError(f"{flag}: {e}") from None


def load_encoders_for_training(source: str, *, revision: str | None, variant: str | None, mixed_precision: str,
                               text_encoder_quantization: str = "none",
                               pipeline_class: type = QwenImagePipeline, **components: Any) -> Any:
    """The "encode" phases' pipeline: the Qwen2.5-VL (quantized as asked) and the VAE frozen in the half-precision
    dtype of ``mixed_precision`` (fp32 for "no"), waiting in host memory; no transformer yet
    (``pipeline.transformer`` is ``None``); ``components``: parts given instead of the folder's (Edit's
    processor)."""
    dtype = weight_dtype_for(mixed_precision)
    quantize = quantization.pipeline_config({"text_encoder": text_encoder_quantization}
                                            if text_encoder_quantization != "none" else {}, dtype)
    extra = {"quantization_config": quantize} if quantize is not None else {}
    pipeline = _from_pretrained(pipeline_class, check_base(source), transformer=None, revision=revision,
                                variant=variant, **{_DTYPE_KWARG: dtype}, **extra, **components)
    for module in (pipeline.text_encoder, pipeline.vae):
        freeze(module)
        parking.place(module, parking.PARKING_DEVICE)
        module.eval()
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def load_transformer_for_training(source: str, *, revision: str | None, variant: str | None, mixed_precision: str,
                                  device: torch.device, base_quantization: str = "none",
                                  on_host: bool = False) -> torch.nn.Module:
    """The "load" phase: the transformer frozen in the dtype of ``mixed_precision``, its linear weights quantized as
    asked, on ``device`` (``on_host``: left in host memory for a block swapper)."""
    dtype = weight_dtype_for(mixed_precision)
    transformer = _from_pretrained(
        QwenImageTransformer2DModel, check_base(source), subfolder="transformer", revision=revision,
        variant=variant, quantization_config=quantization.diffusers_config(base_quantization, dtype),
        **{_DTYPE_KWARG: dtype}, **host_placement(base_quantization, on_host))
    quantization.keep_only_quantized_weights(transformer)
    freeze(transformer)
    if not on_host:
        transformer.to(device)
    return transformer.eval()


def transformer_config(config: Any) -> dict[str, Any]:
    """The transformer's config of a trainer's config, read before anything loads, with --blocks_to_swap checked
    against its blocks."""
    found = QwenImageTransformer2DModel.load_config(check_base(config.pretrained_model_name_or_path),
                                                    subfolder="transformer", revision=config.revision)
    check_blocks_to_swap(config.blocks_to_swap, found["num_layers"])
    return found


def meta_transformer(config: Any) -> torch.nn.Module:
    """The transformer of a trainer's config built on the meta device (no weights): what its adapters target,
    checked before anything loads."""
    with torch.device("meta"):
        return QwenImageTransformer2DModel.from_config(transformer_config(config))


def training_caches(config: Any, datasets: list[DatasetConfig]) -> tuple[TensorCache | None, TensorCache]:
    """The latent cache (``None`` when --cache_latents is off) and the text-embedding cache of a run, keyed to the
    weights that fill them and the text cache to --max_sequence_length."""
    image_dirs = [folder for dataset in datasets for subset in dataset.subsets
                  for folder in (subset.image_dir, subset.conditioning_data_dir) if folder is not None]
    source = config.pretrained_model_name_or_path

    def identity(subfolder: str) -> str:
        return component_identity(source, subfolder, revision=config.revision, variant=config.variant,
                                  extra=config.mixed_precision)

    root = config.cache_root()
    latents = TensorCache(root / "latents", identity("vae"), image_dirs) if config.cache_latents else None
    text = TensorCache(root / "text", f"{identity('text_encoder')}|{config.max_sequence_length}"
                                      f"|{config.text_encoder_quantization}", image_dirs)
    return latents, text


def plan_options(config: Any, datasets: list[DatasetConfig], *, encoders_on_device: bool, validation_images: bool,
                 image_token_multiplier: int = 1) -> PlanOptions:
    """The memory-plan inputs of a Qwen-Image trainer's config and the ``datasets`` it trains on (their largest
    resolution and batch)."""
    return PlanOptions(resolution=max(round(math.prod(d.buckets.resolution) ** 0.5) for d in datasets),
                       batch_size=max(d.batch_size for d in datasets), rank=config.rank,
                       gradient_checkpointing=config.gradient_checkpointing,
                       cpu_offload_checkpointing=config.cpu_offload_checkpointing,
                       base_quantization=config.base_quantization,
                       text_encoder_quantization=config.text_encoder_quantization,
                       encoders_on_device=encoders_on_device, blocks_to_swap=config.blocks_to_swap,
                       optimizer=config.optimizer, weight_dtype=weight_dtype_for(config.mixed_precision),
                       max_sequence_length=config.max_sequence_length, validation_images=validation_images,
                       image_token_multiplier=image_token_multiplier)
