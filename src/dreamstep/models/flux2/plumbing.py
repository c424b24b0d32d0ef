"""FLUX.2 plumbing shared by its recipes: latents as the transformer reads them (the VAE posterior patchified 2x2 and
normalised by the VAE's batch-norm statistics), token packing and position ids, prompt encoding through the
pipeline's own ``encode_prompt``, the caches, and loading for training.

diffusers' FLUX.2 scripts encode an image's posterior mode, patchify it ((B, C, h, w) -> (B, 4C, h/2, w/2)) and
normalise each of the 4C channels by the VAE's ``bn`` running mean and std: an affine map per channel, so the cache
holds the posterior's mean and std in those units and every draw or mean taken from it is what the script computes.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline

from dreamstep.data.cache import TensorCache, latents_for_batch, text_content_key
from dreamstep.data.dataset_config import DatasetConfig
from dreamstep.errors import UserError
from dreamstep.models import parking, quantization
from dreamstep.models.family import check_blocks_to_swap
from dreamstep.models.flux2.family import FAMILY
from dreamstep.models.loading import component_identity, host_placement
from dreamstep.models.memory_plan import PlanOptions
from dreamstep.models.parking import ParkedModules
from dreamstep.models.precision import freeze, weight_dtype_for
from dreamstep.notices import CAPTION_CUT, hidden

PIPELINES = {"Flux2KleinPipeline": Flux2KleinPipeline, "Flux2Pipeline": Flux2Pipeline}


# ---------------------------------------------------------------- latents and tokens

def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, 4C, h/2, w/2): each 2x2 latent patch as channels, in the pipelines' order."""
    return Flux2KleinPipeline._patchify_latents(latents)


def bn_statistics(vae: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's batch-norm mean and std over patchified channels, (1, 4C, 1, 1) each, in fp32."""
    mean = vae.bn.running_mean.float().view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.float().view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return mean, std


@torch.no_grad()
def encode_posterior(vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels in [-1, 1], (B, 3, H, W) -> the posterior's mean and std as the transformer reads latents
    (patchified, normalised): (B, 8C, H/16, W/16), fp32 (see the module docstring)."""
    posterior = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
    bn_mean, bn_std = bn_statistics(vae)
    mean = (patchify(posterior.mean.float()) - bn_mean) / bn_std
    return torch.cat([mean, patchify(posterior.std.float()) / bn_std], dim=1)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h·w, C): one token per patchified latent position."""
    return Flux2KleinPipeline._pack_latents(latents)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, h·w, C) -> (B, C, h, w), the inverse of :func:`pack` (the pipelines scatter by the ids, which are in
    row-major order)."""
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], height, width)


@functools.lru_cache(maxsize=32)
def latent_ids(height: int, width: int, device: torch.device | str, time: int = 0) -> torch.Tensor:
    """Rotary position ids (T, H, W, L) of a packed latent of ``height`` x ``width``: (h·w, 4), int64; ``time`` is 0
    for the image being denoised and 10, 20, ... for reference images (``Flux2Pipeline._prepare_image_ids``)."""
    ids = torch.cartesian_prod(torch.tensor([time]), torch.arange(height), torch.arange(width), torch.arange(1))
    return ids.to(device)


@functools.lru_cache(maxsize=8)
def text_ids(sequence_length: int, device: torch.device | str) -> torch.Tensor:
    """Position ids of the text tokens, (S, 4): (0, 0, 0, l) as ``encode_prompt`` gives them."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1),
                                torch.arange(sequence_length)).to(device)


# ---------------------------------------------------------------- text

@torch.no_grad()
def encode_prompts(pipeline: Any, prompts: list[str], max_sequence_length: int,
                   text_encoder_out_layers: tuple[int, ...] | None = None) -> dict[str, torch.Tensor]:
    """The prompt embeddings (B, S, D) of each prompt, fp32 on the host, through the pipeline's ``encode_prompt``
    (Qwen3's chat template, the stacked hidden states of ``text_encoder_out_layers``; ``None``: the pipeline's)."""
    extra = {"text_encoder_out_layers": tuple(text_encoder_out_layers)} if text_encoder_out_layers else {}
    with hidden(CAPTION_CUT):
        embeds, _ = pipeline.encode_prompt(prompt=prompts, device=pipeline.text_encoder.device,
                                           max_sequence_length=max_sequence_length, **extra)
    return {"prompt_embeds": embeds.float().cpu()}


class Flux2Conditioner:
    """Turns a collated batch into the step's inputs: posteriors from the latent cache (``condition_dist`` too for a
    batch with condition images) and prompt embeddings from the text cache, encoding and storing what is missing."""

    def __init__(self, pipeline: Any, *, latent_cache: TensorCache | None, text_cache: TensorCache,
                 max_sequence_length: int, device: torch.device, text_encoder_out_layers: tuple[int, ...] | None):
        self.pipeline = pipeline
        self.latent_cache = latent_cache
        self.text_cache = text_cache
        self.max_sequence_length = max_sequence_length
        self.device = device
        self.text_encoder_out_layers = text_encoder_out_layers

    def latents(self, batch: dict[str, Any], prefix: str = "") -> torch.Tensor:
        """(B, 8C, h, w) posterior mean and std of the batch's images (or its conditioning images)."""
        def encode(pixels: torch.Tensor) -> torch.Tensor:
            return encode_posterior(self.pipeline.vae, pixels.to(self.device)).cpu()

        return latents_for_batch(batch, encode, self.latent_cache, prefix=prefix).to(self.device, non_blocking=True)

    def prompts(self, captions: list[str], known: Any = None) -> dict[str, torch.Tensor]:
        """Prompt embeddings (B, S, D) of the captions; ``known``: the cache entries the loader read."""
        def encode(missing: list[int]) -> dict[str, torch.Tensor]:
            return encode_prompts(self.pipeline, [captions[i] for i in missing], self.max_sequence_length,
                                  self.text_encoder_out_layers)

        found = self.text_cache.get_or_compute([text_content_key(c) for c in captions], encode, known)
        return {"prompt_embeds": found["prompt_embeds"].to(self.device, non_blocking=True)}

    def __call__(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        inputs = {"latent_dist": self.latents(batch), **self.prompts(batch["captions"], batch.get("text")),
                  "is_reg": batch["is_reg"]}  # is_reg stays on the host: the loss splits the batch by it
        if "conditioning_keys" in batch:
            inputs["condition_dist"] = self.latents(batch, prefix="conditioning_")
        if "masks" in batch:
            inputs["masks"] = batch["masks"].to(self.device, non_blocking=True)
        return inputs


def prompt_embeddings(conditioner: Flux2Conditioner, prompts: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """The embeddings of each distinct prompt (validation prompts, encoded in the "encode text" phase)."""
    return {prompt: conditioner.prompts([prompt]) for prompt in dict.fromkeys(prompts)}


# ---------------------------------------------------------------- the base

def model_index(source: str, flag: str = "--pretrained_model_name_or_path") -> dict[str, Any]:
    """The base's ``model_index.json``, checked to be a FLUX.2 pipeline with its parts, before anything loads; a hub
    id is read from the local Hugging Face cache (one line naming ``flag`` when it is not there)."""
    path = Path(source).expanduser()
    if path.is_dir():
        index_file = path / "model_index.json"
    elif path.exists():
        raise UserError(f"{flag} {source}: a file; give the FLUX.2 diffusers folder that holds model_index.json")
    else:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, "model_index.json") if source.count("/") == 1 else None
        if not isinstance(cached, str):
            raise UserError(f"{flag} {source}: no such folder, and not a hub id in the local Hugging Face cache; give "
                            "a FLUX.2 diffusers folder (e.g. a download of black-forest-labs/FLUX.2-klein-base-4B)")
        index_file = Path(cached)
    if not index_file.is_file():
        raise UserError(f"{flag} {source}: no model_index.json there; give the folder of a diffusers pipeline")
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise UserError(f"{index_file}: not a readable JSON file ({e}); re-download or repair it") from None
    found = index.get("_class_name")
    if found not in FAMILY.pipeline_classes:
        from dreamstep.models.family import family_of_pipeline

        owner = family_of_pipeline(str(found))
        hint = f" ({owner.title}: train it with its own trainer)" if owner is not None else ""
        raise UserError(f"{flag} {source}: a {found} folder{hint}, not FLUX.2 ({' or '.join(FAMILY.pipeline_classes)})")
    missing = [part for part in ("transformer", "text_encoder", "tokenizer", "vae", "scheduler")
               if not isinstance(index.get(part), list) or (path.is_dir() and not (path / part).is_dir())]
    if missing:
        raise UserError(f"{flag} {source}: the {found} folder has no {', '.join(missing)}; copy or download the whole "
                        "pipeline folder")
    return index


def transformer_config(source: str, revision: str | None, blocks_to_swap: int) -> dict[str, Any]:
    """The transformer's config, read before anything loads, with --blocks_to_swap checked against its blocks."""
    from diffusers import Flux2Transformer2DModel

    found = Flux2Transformer2DModel.load_config(source, subfolder="transformer", revision=revision)
    check_blocks_to_swap(blocks_to_swap, found["num_layers"] + found["num_single_layers"])
    return found


def check_text_layers(source: str, revision: str | None, layers: list[int] | None) -> None:
    """--text_encoder_out_layers must name hidden states the text encoder has (its layers, 0 the embeddings)."""
    from transformers import AutoConfig

    if layers is None:
        return
    config = AutoConfig.from_pretrained(source, subfolder="text_encoder", revision=revision)
    count = getattr(config, "text_config", config).num_hidden_layers
    if max(layers) > count:
        raise UserError(f"--text_encoder_out_layers {' '.join(map(str, layers))}: the text encoder has {count} layers; "
                        f"give numbers from 0 to {count} (the pipelines read [klein] 9 18 27, [dev] 10 20 30)")


def load_encoders_for_training(source: str, *, revision: str | None, variant: str | None, mixed_precision: str,
                               text_encoder_quantization: str) -> Any:
    """The "encode" phases' pipeline (:mod:`~dreamstep.models.phases`): the text encoder (quantized as asked) and
    the VAE frozen in the dtype of ``mixed_precision``, waiting in host memory; no transformer yet."""
    dtype = weight_dtype_for(mixed_precision)
    pipeline_class = PIPELINES[model_index(source)["_class_name"]]
    pipeline = pipeline_class.from_pretrained(
        source, transformer=None, revision=revision, variant=variant, dtype=dtype,
        quantization_config=quantization.pipeline_config({"text_encoder": text_encoder_quantization}, dtype))
    pipeline.set_progress_bar_config(disable=True)
    for module in (pipeline.text_encoder, pipeline.vae):
        freeze(module)
        parking.place(module, parking.PARKING_DEVICE)
        module.eval()
    return pipeline


def load_transformer_for_training(pipeline: Any, source: str, *, revision: str | None, variant: str | None,
                                  mixed_precision: str, device: torch.device, base_quantization: str,
                                  on_host: bool) -> torch.nn.Module:
    """The "load" phase: the transformer frozen in the dtype of ``mixed_precision``, quantized as asked, on
    ``device`` (``on_host``: in host memory for the block swapper), registered in ``pipeline``."""
    from diffusers import Flux2Transformer2DModel

    dtype = weight_dtype_for(mixed_precision)
    transformer = Flux2Transformer2DModel.from_pretrained(
        source, subfolder="transformer", revision=revision, variant=variant, dtype=dtype,
        quantization_config=quantization.diffusers_config(base_quantization, dtype),
        **host_placement(base_quantization, on_host))
    quantization.keep_only_quantized_weights(transformer)
    freeze(transformer)
    if not on_host:
        transformer.to(device)
    pipeline.register_modules(transformer=transformer.eval())
    return transformer


def park_encoders(pipeline: Any, device: torch.device, *, latents_cached: bool) -> ParkedModules:
    """The text encoder (its outputs are cached) and, with cached latents, the VAE wait in host memory."""
    return parking.park_encoders(FAMILY, pipeline, device, text_encoders_train=False, latents_cached=latents_cached)


def training_sigmas(scheduler: Any) -> torch.Tensor:
    """The σ table of training from a fresh scheduler of the same config (unshifted with FLUX.2's dynamic shift, as
    the scripts' ``noise_scheduler_copy`` has it)."""
    fresh = type(scheduler).from_config(scheduler.config)
    return fresh.sigmas[:fresh.config.num_train_timesteps].clone()


def training_caches(root: Path, source: str, *, revision: str | None, variant: str | None, mixed_precision: str,
                    max_sequence_length: int, text_encoder_out_layers: tuple[int, ...] | None, cache_latents: bool,
                    image_dirs: list[Path]) -> tuple[TensorCache | None, TensorCache]:
    """The latent cache (``None`` without ``cache_latents``) and the text cache of a run, keyed to the weights that
    fill them and to how the text is read."""
    ident = dict(revision=revision, variant=variant, extra=mixed_precision)
    latents = (TensorCache(root / "latents", component_identity(source, "vae", **ident), image_dirs)
               if cache_latents else None)
    layers = ",".join(map(str, text_encoder_out_layers)) if text_encoder_out_layers else "default"
    text = TensorCache(root / "text", f"{component_identity(source, 'text_encoder', **ident)}|{max_sequence_length}"
                                      f"|{layers}", image_dirs)
    return latents, text


def plan_options(config: Any, datasets: list[DatasetConfig], *, encoders_on_device: bool,
                 image_token_multiplier: int = 1) -> PlanOptions:
    """The memory-plan inputs of a FLUX.2 trainer's config and the datasets it trains on (their largest resolution
    and batch)."""
    resolution = max(round(math.prod(d.buckets.resolution) ** 0.5) for d in datasets)
    return PlanOptions(resolution=resolution, batch_size=max(d.batch_size for d in datasets), rank=config.rank,
                       gradient_checkpointing=config.gradient_checkpointing,
                       cpu_offload_checkpointing=config.cpu_offload_checkpointing,
                       base_quantization=config.base_quantization,
                       text_encoder_quantization=config.text_encoder_quantization,
                       encoders_on_device=encoders_on_device, blocks_to_swap=config.blocks_to_swap,
                       optimizer=config.optimizer, weight_dtype=weight_dtype_for(config.mixed_precision),
                       max_sequence_length=config.max_sequence_length,
                       validation_images=bool(config.validation_prompt),
                       image_token_multiplier=image_token_multiplier)
