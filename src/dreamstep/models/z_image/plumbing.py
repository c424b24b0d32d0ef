"""Z-Image plumbing shared by its trainer and tools: loading the base for training, caption features through
diffusers' own ``ZImagePipeline.encode_prompt`` (chat template, Qwen3's second-to-last hidden state, padding
dropped), the conditioner that feeds the step from the caches, and sampling."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from PIL import Image

from dreamstep.data.cache import TensorCache, latents_for_batch, text_content_key
from dreamstep.errors import UserError
from dreamstep.models import parking, quantization
from dreamstep.models.loading import _DTYPE_KWARG, _from_pretrained, component_identity, host_placement
from dreamstep.models.precision import freeze, weight_dtype_for
from dreamstep.models.vae import encode_posterior
from dreamstep.models.z_image import configs
from dreamstep.notices import CAPTION_CUT, hidden
from dreamstep.png_text import JSON_KEY, sample_parameters


@dataclass
class ZImageComponents:
    """The parts of a Z-Image pipeline as the trainer holds them (``text_encoder_2`` is always ``None``: the
    shared phase helpers ask every family for it)."""

    scheduler: Any
    vae: torch.nn.Module
    text_encoder: torch.nn.Module
    tokenizer: Any
    transformer: torch.nn.Module | None = None
    text_encoder_2: None = None
    pipeline_class: type = ZImagePipeline
    pipeline_options: dict[str, Any] = field(default_factory=dict)  # the pipeline's own settings (Krea 2's layers)

    def pipeline(self, transformer: torch.nn.Module | None = None, scheduler: Any = None) -> Any:
        """A pipeline of ``pipeline_class`` over these modules (no copies), with ``transformer`` and ``scheduler``
        in place of the held ones."""
        pipe = self.pipeline_class(scheduler=scheduler or self.scheduler, vae=self.vae, text_encoder=self.text_encoder,
                                   tokenizer=self.tokenizer, transformer=transformer or self.transformer,
                                   **self.pipeline_options)
        pipe.set_progress_bar_config(disable=True)
        return pipe


@dataclass(frozen=True)
class Kind:
    """What tells a family's model folders and loads them: its title, pipeline and transformer classes, the
    pipelines its folders may hold, and an example hub id for messages."""

    title: str
    pipeline_class: type
    transformer_class: type
    pipelines: tuple[str, ...]
    example: str


Z_IMAGE = Kind("Z-Image", ZImagePipeline, ZImageTransformer2DModel, ("ZImagePipeline", "ZImageImg2ImgPipeline"),
               configs.BASE_ID)


def check_source(source: str, flag: str = "--pretrained_model_name_or_path", kind: Kind = Z_IMAGE) -> None:
    """One line naming ``flag`` when ``source`` is neither a pipeline folder of ``kind`` nor a hub id (in the local
    cache when HF_HUB_OFFLINE is set), before anything loads."""
    from dreamstep.models.family import family_of_pipeline
    from dreamstep.models.sources import HUB_ID, json_file

    path = Path(source).expanduser()
    if path.is_dir():
        index = path / "model_index.json"
        if not index.is_file():
            raise UserError(f"{flag} {source}: not a diffusers pipeline folder (no model_index.json); give the "
                            f"{kind.title} folder that holds it, or a hub id such as {kind.example}")
        found = json_file(index).get("_class_name", "an unknown pipeline")
        if found not in kind.pipelines:
            other = family_of_pipeline(found)
            hint = f" (a {other.title} model: train it with 'dreamstep train {other.name}-lora')" if other else ""
            raise UserError(f"{flag} {source}: holds a {found}{hint}, not {kind.title}; give a "
                            f"{kind.pipelines[0]} folder such as {kind.example}")
        parts = ("transformer", "text_encoder", "tokenizer", "vae", "scheduler")
        missing = [part for part in parts if not (path / part).is_dir()]
        if missing:
            raise UserError(f"{flag} {source}: incomplete {kind.title} folder, no {', '.join(missing)}/; copy or "
                            "download the whole pipeline folder")
        return
    if path.exists() or not HUB_ID.match(source):
        raise UserError(f"{flag} {source}: no such folder; give a {kind.title} pipeline folder or a hub id such as "
                        f"{kind.example}")
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(source, "model_index.json"), str):
        raise UserError(f"{flag} {source}: a hub id that is not in the Hugging Face cache while HF_HUB_OFFLINE is "
                        "set; give a local folder, or unset HF_HUB_OFFLINE to download it")


def transformer_config(source: str, revision: str | None = None, kind: Kind = Z_IMAGE) -> dict[str, Any]:
    """The transformer's config, read before anything loads."""
    return kind.transformer_class.load_config(source, subfolder="transformer", revision=revision)


def training_sigmas(scheduler: Any) -> torch.Tensor:
    """The σ table of training, (num_train_timesteps,): a fresh scheduler's (a pipeline call replaces the held
    one's with its inference schedule), shifted as the base's scheduler config says, as the script reads it."""
    fresh = type(scheduler).from_config(scheduler.config)
    return fresh.sigmas[:fresh.config.num_train_timesteps].clone()


def load_encoders(source: str, *, revision: str | None, variant: str | None, mixed_precision: str,
                  text_encoder_quantization: str = "none", kind: Kind = Z_IMAGE,
                  pipeline_options: tuple[str, ...] = ()) -> ZImageComponents:
    """The "encode" phases' components, frozen in the dtype of ``mixed_precision`` (the text encoder quantized as
    asked), waiting in host memory; the transformer is not loaded. ``pipeline_options``: the pipeline config's
    settings its pipelines are built with again (Krea 2's ``text_encoder_select_layers``)."""
    dtype = weight_dtype_for(mixed_precision)
    quantize = {"text_encoder": text_encoder_quantization} if text_encoder_quantization != "none" else {}
    extra: dict[str, Any] = {}
    if quantize:
        extra["quantization_config"] = quantization.pipeline_config(quantize, dtype)
    pipe = _from_pretrained(kind.pipeline_class, source, transformer=None, revision=revision, variant=variant,
                            **{_DTYPE_KWARG: dtype}, **extra)
    components = ZImageComponents(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=pipe.text_encoder,
                                  tokenizer=pipe.tokenizer, pipeline_class=kind.pipeline_class,
                                  pipeline_options={name: pipe.config[name] for name in pipeline_options})
    for module in (components.vae, components.text_encoder):
        quantization.keep_only_quantized_weights(module)
        freeze(module)
        parking.place(module, parking.PARKING_DEVICE)
        module.eval()
    return components


def load_transformer(source: str, *, revision: str | None, variant: str | None, mixed_precision: str,
                     device: torch.device, base_quantization: str = "none", on_host: bool = False,
                     kind: Kind = Z_IMAGE) -> torch.nn.Module:
    """The "load" phase: the transformer frozen in the dtype of ``mixed_precision``, its linear weights quantized
    as asked, on ``device`` (``on_host``: in host memory, for a block swapper to place)."""
    dtype = weight_dtype_for(mixed_precision)
    transformer = _from_pretrained(
        kind.transformer_class, source, subfolder="transformer", revision=revision, variant=variant,
        quantization_config=quantization.diffusers_config(base_quantization, dtype), **{_DTYPE_KWARG: dtype},
        **host_placement(base_quantization, on_host))
    quantization.keep_only_quantized_weights(transformer)
    freeze(transformer)
    if not on_host:
        transformer.to(device)
    return transformer.eval()


@torch.no_grad()
def encode_prompts(pipeline: ZImagePipeline, prompts: list[str], max_sequence_length: int
                   ) -> dict[str, torch.Tensor]:
    """Each prompt's caption features as ``ZImagePipeline.encode_prompt`` makes them, padded with zeros to
    ``max_sequence_length`` (``prompt_embeds`` (B, S, D), fp32 on the CPU) with their lengths (``prompt_lengths``
    (B,))."""
    with hidden(CAPTION_CUT):
        features, _ = pipeline.encode_prompt(prompt=list(prompts), device=pipeline.text_encoder.device,
                                             do_classifier_free_guidance=False,
                                             max_sequence_length=max_sequence_length)
    padded = torch.zeros(len(features), max_sequence_length, features[0].shape[-1])
    for row, feature in enumerate(features):
        padded[row, :len(feature)] = feature.float().cpu()
    return {"prompt_embeds": padded, "prompt_lengths": torch.tensor([len(f) for f in features])}


class ZImageConditioner:
    """Turns a collated batch into the step's inputs: VAE posteriors from the latent cache and caption features
    from the text cache, encoding (and storing) only what is not cached yet."""

    def __init__(self, components: ZImageComponents, *, latent_cache: TensorCache | None, text_cache: TensorCache,
                 max_sequence_length: int, device: torch.device):
        self.components = components
        self.pipeline = components  # what parking's phase helpers place (vae, text_encoder)
        self.encoding_pipeline = components.pipeline()
        self.latent_cache = latent_cache
        self.text_cache = text_cache
        self.max_sequence_length = max_sequence_length
        self.device = device

    def posterior(self, pixels: torch.Tensor) -> torch.Tensor:
        """The VAE posterior's mean and std (B, 2C, h, w) in the transformer's latent units."""
        return encode_posterior(self.components.vae, pixels)

    def latents(self, batch: dict[str, Any], prefix: str = "") -> torch.Tensor:
        def encode(pixels: torch.Tensor) -> torch.Tensor:
            return self.posterior(pixels.to(self.device)).cpu()

        return latents_for_batch(batch, encode, self.latent_cache, prefix=prefix).to(self.device, non_blocking=True)

    def prompts(self, captions: list[str], known: Any = None) -> dict[str, torch.Tensor]:
        """Padded caption features (B, S, D) on the device, cut to the batch's longest caption, and their lengths
        (B,) on the CPU."""
        def encode(missing: list[int]) -> dict[str, torch.Tensor]:
            return encode_prompts(self.encoding_pipeline, [captions[i] for i in missing], self.max_sequence_length)

        found = self.text_cache.get_or_compute([text_content_key(c) for c in captions], encode, known)
        lengths = found["prompt_lengths"]
        embeds = found["prompt_embeds"][:, :int(lengths.max())]
        return {"prompt_embeds": embeds.to(self.device, non_blocking=True), "prompt_lengths": lengths}

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        inputs = {"latent_dist": self.latents(batch), **self.prompts(batch["captions"], batch.get("text")),
                  "is_reg": batch["is_reg"]}
        if "masks" in batch:
            inputs["masks"] = batch["masks"].to(self.device, non_blocking=True)
        return inputs


def training_caches(root: Path, source: str, *, revision: str | None, variant: str | None, mixed_precision: str,
                    max_sequence_length: int, cache_latents: bool, image_dirs: list[Path], kind: Kind = Z_IMAGE
                    ) -> tuple[TensorCache | None, TensorCache]:
    """The latent cache (``None`` without ``cache_latents``) and the caption-feature cache of a run, each keyed to
    the weights that fill it."""
    ident = dict(revision=revision, variant=variant, extra=mixed_precision)
    latents = (TensorCache(root / "latents", component_identity(source, "vae", **ident), image_dirs)
               if cache_latents else None)
    text = TensorCache(root / "text", f"{component_identity(source, 'text_encoder', **ident)}|{kind.title}|"
                                      f"{max_sequence_length}", image_dirs)
    return latents, text


def encode_run(conditioner: ZImageConditioner, dataset: Any, held_out: Any | None, epochs: int) -> None:
    """The "encode images" then "encode text" phases: every cached latent with the VAE alone on the device, then
    every caption with the text encoder alone there (it stays for the validation prompts)."""
    parts = [(dataset, epochs)] + ([(held_out, 1)] if held_out is not None else [])
    components, device = conditioner.components, conditioner.device
    if conditioner.latent_cache is not None:
        parking.place(components.text_encoder, parking.PARKING_DEVICE)
        parking.place(components.vae, device)
        for part, part_epochs in parts:
            parking.fill_latents(conditioner, part, part_epochs)
    parking.place(components.vae, parking.PARKING_DEVICE)
    parking.place(components.text_encoder, device)
    for part, part_epochs in parts:
        parking.fill_texts(conditioner, part, part_epochs)


@torch.no_grad()
def generate(pipeline: ZImagePipeline, prompts: list[str], *, seed: int, steps: int, guidance_scale: float,
             height: int, width: int, embeddings: dict[str, dict[str, torch.Tensor]],
             negative: dict[str, torch.Tensor] | None = None) -> list[Image.Image]:
    """One image per prompt from its cached caption features (``embeddings``: prompt -> :func:`encode_prompts`
    of it; ``negative``: the empty prompt's, for guidance > 0), each from its own generator seeded ``seed + i``,
    carrying its parameters in ``image.info``; the text encoder is not used."""
    view = ZImagePipeline(**{**pipeline.components, "text_encoder": None})
    view.set_progress_bar_config(disable=True)
    dtype = pipeline.transformer.dtype
    images = []
    for i, prompt in enumerate(prompts):
        text = {"prompt_embeds": _features(embeddings[prompt], dtype)}
        if guidance_scale > 0:
            text["negative_prompt_embeds"] = _features(negative, dtype)
        image = view(**text, num_inference_steps=steps, guidance_scale=guidance_scale, height=height, width=width,
                     generator=torch.Generator("cpu").manual_seed(seed + i)).images[0]
        image.info[JSON_KEY] = sample_parameters(view, prompt=prompt, seed=seed + i, steps=steps,
                                                 guidance_scale=guidance_scale, width=width, height=height)
        images.append(image)
    return images


def _features(encoded: dict[str, torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [encoded["prompt_embeds"][0, :int(encoded["prompt_lengths"][0])].to(dtype)]


def load_sampling_model(source: str, *, revision: str | None, variant: str | None, mixed_precision: str,
                        kind: Kind = Z_IMAGE) -> tuple[torch.nn.Module, Any]:
    """Another Z-Image checkpoint's transformer and scheduler (``--validation_model_path``: the distilled Turbo that
    draws the validation samples with the LoRA being trained on the base), frozen in the run's dtype, in host
    memory."""
    dtype = weight_dtype_for(mixed_precision)
    transformer = _from_pretrained(kind.transformer_class, source, subfolder="transformer", revision=revision,
                                   variant=variant, **{_DTYPE_KWARG: dtype})
    freeze(transformer)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler", revision=revision)
    return transformer.eval(), scheduler

