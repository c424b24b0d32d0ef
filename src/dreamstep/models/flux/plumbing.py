"""FLUX.1 plumbing shared by the trainers: latent packing, position ids, VAE posteriors and prompt
encoding, all through diffusers' own ``FluxPipeline`` helpers so the layout matches inference exactly.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import torch
from diffusers import FluxControlNetPipeline, FluxPipeline
from PIL import Image

from dreamstep.data.cache import TensorCache, latents_for_batch, text_content_key
from dreamstep.data.dataset_config import DatasetConfig
from dreamstep.models import parking
from dreamstep.models.family import check_blocks_to_swap
from dreamstep.models.flux.family import FAMILY as FLUX
from dreamstep.models.flux.files import FLAGS, FluxFiles, base_of, config_folder, read_header
from dreamstep.models.loading import component_identity, load_flux, load_flux_transformer
from dreamstep.models.memory_plan import PlanOptions
from dreamstep.models.parking import ParkedModules
from dreamstep.models.phases import ENCODERS, TEXT_ENCODERS
from dreamstep.models.precision import freeze, weight_dtype_for
from dreamstep.models.sources import check_pipeline_source
from dreamstep.models.vae import encode_posterior
from dreamstep.notices import CAPTION_CUT, hidden
from dreamstep.png_text import JSON_KEY, sample_parameters

# FLUX.1-dev's recommended sampling: 28 steps at distilled guidance 3.5.
FLUX_DEV_SAMPLING = {"steps": 28, "guidance_scale": 3.5}


def training_sigmas(scheduler: Any) -> torch.Tensor:
    """The σ table of training, (num_train_timesteps,), from a fresh scheduler of the same config: a
    pipeline call (validation, class images) replaces a scheduler's table with its inference schedule.
    With FLUX.1-dev's dynamic shifting this table is unshifted, as in diffusers' training scripts."""
    fresh = type(scheduler).from_config(scheduler.config)
    return fresh.sigmas[:fresh.config.num_train_timesteps].clone()


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 · w/2, 4C): FLUX sees 2x2 latent patches as tokens."""
    b, c, h, w = latents.shape
    return FluxPipeline._pack_latents(latents, b, c, h, w)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, h/2 · w/2, 4C) -> (B, C, h, w) for a latent of ``height`` x ``width``."""
    # diffusers' helper takes pixel sizes and a VAE factor; factor 1 makes it work in latent units.
    return FluxPipeline._unpack_latents(tokens, height, width, vae_scale_factor=1)


@functools.lru_cache(maxsize=32)
def latent_image_ids(height: int, width: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """Rotary position ids of the packed latent tokens: (h/2 · w/2, 3). Made once per size, device and dtype
    (diffusers builds them on the CPU and copies them over, which would make every step wait); the model
    only reads them."""
    return FluxPipeline._prepare_latent_image_ids(1, height // 2, width // 2, device, dtype)


@torch.no_grad()
def encode_prompts(pipeline: FluxPipeline, prompts: list[str], max_sequence_length: int,
                   t5_attention_mask: bool = False) -> dict[str, torch.Tensor]:
    """T5 sequence embeddings (B, S, D) and CLIP pooled embeddings (B, P) for each prompt (training
    captions: the run summary names those that get cut, so the pipeline's notices are hidden).
    ``t5_attention_mask`` (sd-scripts' ``--apply_t5_attn_mask``): T5 reads its tokens with their attention mask
    (padding masked out), which is returned as ``t5_mask`` (B, S) for the transformer to mask the same tokens."""
    if t5_attention_mask:
        ids, mask = t5_tokens(pipeline, prompts, max_sequence_length)
        with hidden(CAPTION_CUT):
            pooled = pipeline._get_clip_prompt_embeds(prompts, device=pipeline.text_encoder.device)
        embeds = t5_embeddings(pipeline.text_encoder_2, ids, mask)
        return {"prompt_embeds": embeds.float().cpu(), "pooled": pooled.float().cpu(), "t5_mask": mask}
    with hidden(CAPTION_CUT):
        prompt_embeds, pooled, _ = pipeline.encode_prompt(prompt=prompts, prompt_2=prompts,
                                                          device=pipeline.text_encoder.device,
                                                          max_sequence_length=max_sequence_length)
    return {"prompt_embeds": prompt_embeds.float().cpu(), "pooled": pooled.float().cpu()}


def t5_tokens(pipeline: FluxPipeline, prompts: list[str], max_sequence_length: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """T5 token ids and attention mask (B, S), padded and truncated to ``max_sequence_length`` as
    ``FluxPipeline`` (and sd-scripts) tokenize."""
    tokens = pipeline.tokenizer_2(prompts, padding="max_length", max_length=max_sequence_length, truncation=True,
                                  return_tensors="pt")
    return tokens.input_ids, tokens.attention_mask


def t5_embeddings(text_encoder: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """T5's last hidden state (B, S, D) for token ``ids``, reading them with the attention ``mask`` when given
    (sd-scripts' ``--apply_t5_attn_mask``) or every token (``FluxPipeline``'s way)."""
    device = next(text_encoder.parameters()).device
    return text_encoder(ids.to(device), attention_mask=None if mask is None else mask.to(device))[0]


def joint_attention_mask(text_mask: torch.Tensor, image_tokens: int) -> torch.Tensor:
    """The FLUX attention mask of sd-scripts' ``--apply_t5_attn_mask``: (B, 1, 1, S + N) booleans over the keys of
    the joint [text, image] sequence, false at T5's padding tokens (``text_mask`` (B, S) is 0 there); every query
    (image and text tokens alike) attends only to the others. diffusers' ``FluxAttnProcessor`` takes it as
    ``joint_attention_kwargs={"attention_mask": ...}``."""
    image = torch.ones(len(text_mask), image_tokens, dtype=torch.bool, device=text_mask.device)
    return torch.cat([text_mask.bool(), image], dim=1)[:, None, None, :]


def clip_input_ids(pipeline: FluxPipeline, prompts: list[str]) -> torch.Tensor:
    """CLIP token ids (B, 77), padded and truncated exactly as ``FluxPipeline`` does at inference."""
    return pipeline.tokenizer(prompts, padding="max_length", max_length=pipeline.tokenizer_max_length,
                              truncation=True, return_tensors="pt").input_ids


def text_ids(sequence_length: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Position ids of the text tokens: all zero, (S, 3), as in ``FluxPipeline.encode_prompt``."""
    return torch.zeros(sequence_length, 3, device=device, dtype=dtype)


def assemble_pipeline(components: Any, controlnet: torch.nn.Module | None = None,
                      pipeline_class: type[FluxPipeline] | None = None, **modules: Any) -> FluxPipeline:
    """A pipeline over already-loaded components (no copies): a ``FluxPipeline``, a ``FluxControlNetPipeline``
    when a ``controlnet`` is given, or ``pipeline_class`` (another FLUX pipeline of diffusers) with the further
    ``modules`` it takes."""
    parts = {name: getattr(components, name) for name in
             ("scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "transformer")}
    if controlnet is not None:
        pipeline_class, modules = FluxControlNetPipeline, {**modules, "controlnet": controlnet}
    pipeline = (pipeline_class or FluxPipeline)(**parts, **modules)
    pipeline.set_progress_bar_config(disable=True)  # the trainer shows its own progress
    return pipeline


def without_text_encoders(pipeline: FluxPipeline) -> FluxPipeline:
    """The same pipeline (same modules, no copies) without its text encoders, for prompts given as embeddings:
    the encoders may wait off the device, and the pipeline neither runs them nor computes on their device."""
    view = type(pipeline)(**{**pipeline.components, "text_encoder": None, "text_encoder_2": None})
    view.set_progress_bar_config(disable=True)
    return view


class FluxConditioner:
    """Turns a collated batch into the step's inputs: VAE posteriors from the latent cache and prompt
    embeddings from the text cache, encoding (and storing) only what is not cached yet."""

    def __init__(self, pipeline: FluxPipeline, *, latent_cache: TensorCache | None, text_cache: TensorCache | None,
                 max_sequence_length: int, device: torch.device, clip_ids: bool = False,
                 t5_attention_mask: bool = False):
        self.pipeline = pipeline
        self.latent_cache = latent_cache
        self.text_cache = text_cache
        self.max_sequence_length = max_sequence_length
        self.device = device
        self.clip_ids = clip_ids
        self.t5_attention_mask = t5_attention_mask

    def latents(self, batch: dict[str, Any], prefix: str = "") -> torch.Tensor:
        """(B, 2C, h, w) posterior mean and std of the batch's images (or its conditioning images)."""
        def encode(pixels: torch.Tensor) -> torch.Tensor:
            return encode_posterior(self.pipeline.vae, pixels.to(self.device)).cpu()

        return latents_for_batch(batch, encode, self.latent_cache, prefix=prefix).to(self.device, non_blocking=True)

    def prompts(self, captions: list[str], known: Any = None) -> dict[str, torch.Tensor]:
        """T5 embeddings (B, S, D), CLIP pooled (B, P) and text ids (S, 3) for the captions, and with
        ``t5_attention_mask`` T5's attention mask (``text_mask`` (B, S)); ``known``: the cache entries the loader
        read (``batch["text"]``). Without a text cache (T5 trains, so it runs in the step) the T5 token ids
        (``t5_input_ids`` (B, S)) come instead of the embeddings, which are ``None``."""
        if self.text_cache is None:
            return self._token_ids(captions)

        def encode(missing: list[int]) -> dict[str, torch.Tensor]:
            return encode_prompts(self.pipeline, [captions[i] for i in missing], self.max_sequence_length,
                                  self.t5_attention_mask)

        found = self.text_cache.get_or_compute([text_content_key(c) for c in captions], encode, known)
        embeds = found["prompt_embeds"].to(self.device, non_blocking=True)
        inputs = {"prompt_embeds": embeds, "pooled": found["pooled"].to(self.device, non_blocking=True),
                  "text_ids": text_ids(embeds.shape[1], self.device, embeds.dtype)}
        if self.t5_attention_mask:
            inputs["text_mask"] = found["t5_mask"].to(self.device, non_blocking=True)
        if self.clip_ids:
            inputs["clip_input_ids"] = clip_input_ids(self.pipeline, captions).to(self.device, non_blocking=True)
        return inputs

    def _token_ids(self, captions: list[str]) -> dict[str, Any]:
        ids, mask = t5_tokens(self.pipeline, captions, self.max_sequence_length)
        inputs = {"prompt_embeds": None, "pooled": None, "t5_input_ids": ids.to(self.device, non_blocking=True),
                  "clip_input_ids": clip_input_ids(self.pipeline, captions).to(self.device, non_blocking=True),
                  "text_ids": text_ids(ids.shape[1], self.device, torch.float32)}
        if self.t5_attention_mask:
            inputs["text_mask"] = mask.to(self.device, non_blocking=True)
        return inputs

    def __call__(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        # is_reg stays on the CPU: the loss splits the batch by it without waiting for the device.
        inputs = {"latent_dist": self.latents(batch), **self.prompts(batch["captions"], batch.get("text")),
                  "is_reg": batch["is_reg"]}
        if "masks" in batch:  # --masked_loss: (B, 1, H, W) in [0, 1], at the image's size
            inputs["masks"] = batch["masks"].to(self.device, non_blocking=True)
        return inputs


class ControlConditioner:
    """The step's inputs of a model with a condition image: what ``FluxConditioner`` gives (target posterior,
    prompt embeddings) plus the condition images' posteriors (``condition_dist``), encoded with the same crop
    and flip and through the same latent cache."""

    def __init__(self, conditioner: FluxConditioner):
        self.conditioner = conditioner

    def __call__(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {**self.conditioner(batch), "condition_dist": self.conditioner.latents(batch, prefix="conditioning_")}


def training_caches(root: Path, source: str | None, *, revision: str | None, variant: str | None,
                    mixed_precision: str, max_sequence_length: int, cache_latents: bool, image_dirs: list[Path],
                    files: FluxFiles | None = None, t5_attention_mask: bool = False
                    ) -> tuple[TensorCache | None, TensorCache]:
    """The latent cache (``None`` when ``cache_latents`` is off) and the text-embedding cache of a run,
    each keyed to the weights that fill it (a component file's own, or the folder's) and the text cache to the
    way T5 reads (``t5_attention_mask``: masked, its entries holding the mask); nothing is written until the
    first entry is stored."""
    files = files or FluxFiles()
    ident = dict(revision=revision, variant=variant, extra=mixed_precision)

    def identity(part: str, subfolder: str) -> str:
        if getattr(files, part) is not None:
            return f"{files.identity(part)}|{mixed_precision}"
        return component_identity(str(source), subfolder, **ident)

    latents = TensorCache(root / "latents", identity("ae", "vae"), image_dirs) if cache_latents else None
    text_id = "+".join((identity("clip_l", "text_encoder"), identity("t5xxl", "text_encoder_2")))
    masked = "|t5_attention_mask" if t5_attention_mask else ""
    text = TensorCache(root / "text", f"{text_id}|{max_sequence_length}{masked}", image_dirs)
    return latents, text


@torch.no_grad()
def generate(pipeline: FluxPipeline, prompts: list[str], *, seed: int, steps: int, guidance_scale: float,
             height: int, width: int, max_sequence_length: int = 512,
             embeddings: dict[str, dict[str, torch.Tensor]] | None = None, **pipeline_kwargs: Any) -> list[Image.Image]:
    """One image per prompt, each from its own generator seeded ``seed + i`` (reproducible one by one); each
    carries its parameters in ``image.info["dreamstep"]``, which sample grids print and store. ``embeddings``
    (prompt -> :meth:`FluxConditioner.prompts` of it) are used instead of the text encoders, which may then
    wait off the device."""
    images = []
    if embeddings is not None:
        pipeline = without_text_encoders(pipeline)
    for i, prompt in enumerate(prompts):
        generator = torch.Generator("cpu").manual_seed(seed + i)
        text = {"prompt": prompt}
        if embeddings is not None:
            dtype = pipeline.transformer.dtype
            text = {"prompt_embeds": embeddings[prompt]["prompt_embeds"].to(dtype),
                    "pooled_prompt_embeds": embeddings[prompt]["pooled"].to(dtype)}
        result = pipeline(**text, num_inference_steps=steps, guidance_scale=guidance_scale,
                          height=height, width=width, generator=generator,
                          max_sequence_length=max_sequence_length, **pipeline_kwargs)
        image = result.images[0]
        image.info[JSON_KEY] = sample_parameters(pipeline, prompt=prompt, seed=seed + i, steps=steps,
                                                 guidance_scale=guidance_scale, width=width, height=height)
        images.append(image)
    return images


def load_encoders_for_training(source: str | None, *, revision: str | None, variant: str | None,
                               mixed_precision: str, device: torch.device, text_encoder_quantization: str = "none",
                               files: FluxFiles | None = None) -> Any:
    """The "encode" phases' components (:mod:`~dreamstep.models.phases`): the text encoders and the VAE frozen in
    the half-precision dtype of ``mixed_precision`` (fp32 for "no"), T5 quantized as asked, waiting in host memory
    (:func:`~dreamstep.models.parking.encode_run` brings each to ``device`` in its turn); the transformer is not
    loaded (``components.transformer`` is ``None``). ``files``: component files replacing the folder's parts (its
    transformer file is read only to tell dev from schnell)."""
    components = load_flux(source, revision=revision, variant=variant, weight_dtype=weight_dtype_for(mixed_precision),
                           quantize={"text_encoder_2": text_encoder_quantization}, transformer=False, files=files)
    for name in ENCODERS:
        module = getattr(components, name)
        freeze(module)
        parking.place(module, parking.PARKING_DEVICE)
        module.eval()
    return components


def load_transformer_for_training(components: Any, source: str | None, *, revision: str | None,
                                  variant: str | None, transformer_single_file: str | Path | None,
                                  mixed_precision: str, device: torch.device,
                                  base_quantization: str = "none", on_host: bool = False) -> torch.nn.Module:
    """The "load" phase: the transformer frozen in the dtype of ``mixed_precision``, its linear weights quantized as
    asked (:mod:`~dreamstep.models.quantization`), on ``device`` (``on_host``: left in host memory for a
    :class:`~dreamstep.models.blocks.BlockSwapper` to place part by part, a 4-bit one quantized there too), set as
    ``components.transformer``. Trainable adapters are added (in
    fp32) by the caller."""
    transformer = load_flux_transformer(source, revision=revision, variant=variant,
                                        transformer_single_file=transformer_single_file,
                                        weight_dtype=weight_dtype_for(mixed_precision),
                                        base_quantization=base_quantization, on_host=on_host)
    freeze(transformer)
    if not on_host:
        transformer.to(device)
    components.transformer = transformer.eval()
    return transformer


def transformer_config(config: Any) -> dict[str, Any]:
    """The transformer's config of a FLUX trainer's config, read before anything loads, with --blocks_to_swap
    checked against its blocks (which the transformer loads only after every caption is encoded)."""
    from diffusers import FluxTransformer2DModel

    base = base_of(config)
    if base.source is not None:
        check_pipeline_source(base.source, "flux", "--model_config" if config.model_config else FLAGS["transformer"])
    header = read_header(base.files.transformer, FLAGS["transformer"]) if base.files.transformer else None
    with config_folder(base.source, header) as configs:
        found = FluxTransformer2DModel.load_config(configs, subfolder="transformer",
                                                   revision=config.revision if base.source else None)
    check_blocks_to_swap(getattr(config, "blocks_to_swap", 0), found["num_layers"] + found["num_single_layers"])
    return found


def meta_transformer(config: Any) -> torch.nn.Module:
    """The transformer of a FLUX trainer's config built on the meta device (no weights): what its adapters
    target, checked before anything loads."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        return FluxTransformer2DModel.from_config(transformer_config(config))


def attach_transformer(pipeline: FluxPipeline, components: Any) -> None:
    """Put the transformer loaded after the "encode" phases into the pipeline assembled before it."""
    pipeline.register_modules(transformer=components.transformer)


def tokenizer_limits(pipeline: FluxPipeline, max_sequence_length: int) -> dict[str, tuple[Any, int]]:
    """Each text encoder's tokenizer and how many tokens the encoder reads (for the start-of-run summary)."""
    return {"CLIP": (pipeline.tokenizer, pipeline.tokenizer.model_max_length),
            "T5": (pipeline.tokenizer_2, max_sequence_length)}


def caches_of(config: Any, datasets: list[Any]) -> tuple[TensorCache | None, TensorCache]:
    """:func:`training_caches` of a FLUX trainer's config (any :class:`FluxTrainingConfig`) for the images of
    ``datasets`` (their image and condition folders)."""
    image_dirs = [folder for dataset in datasets for subset in dataset.subsets
                  for folder in (subset.image_dir, subset.conditioning_data_dir) if folder is not None]
    base = base_of(config)
    return training_caches(config.cache_root(), base.source, revision=config.revision,
                           variant=config.variant, mixed_precision=config.mixed_precision,
                           max_sequence_length=config.max_sequence_length, cache_latents=config.cache_latents,
                           image_dirs=image_dirs, files=base.files)


def plan_options(config: Any, datasets: list[DatasetConfig], *, rank: int, encoders_on_device: bool,
                 validation_images: bool, image_token_multiplier: int = 1) -> PlanOptions:
    """The memory-plan inputs of a FLUX trainer's config (any :class:`FluxTrainingConfig`) and the ``datasets`` it
    trains on (their largest resolution and batch: a dataset TOML's win over the flags, as in training).
    ``image_token_multiplier``: see :class:`~dreamstep.models.memory_plan.PlanOptions`."""
    resolution = max(round(math.prod(d.buckets.resolution) ** 0.5) for d in datasets)
    batch_size = max(d.batch_size for d in datasets)
    return PlanOptions(resolution=resolution, batch_size=batch_size, rank=rank,
                       gradient_checkpointing=config.gradient_checkpointing,
                       cpu_offload_checkpointing=config.cpu_offload_checkpointing,
                       base_quantization=config.base_quantization,
                       text_encoder_quantization=config.text_encoder_quantization,
                       encoders_on_device=encoders_on_device, blocks_to_swap=getattr(config, "blocks_to_swap", 0),
                       optimizer=config.optimizer, weight_dtype=weight_dtype_for(config.mixed_precision),
                       max_sequence_length=config.max_sequence_length, validation_images=validation_images,
                       image_token_multiplier=image_token_multiplier)


def kohya_plan_options(config: Any, datasets: list[DatasetConfig], *, encoders_on_device: bool,
                       validation_images: bool, max_sequence_length: int) -> PlanOptions:
    """The memory-plan inputs of flux-kohya's ``config`` (sd-scripts' flag names; its recipe and the dashboard's
    new-run form plan with these), at the first dataset's resolution and the largest batch of ``datasets``."""
    return PlanOptions(resolution=round(math.prod(datasets[0].buckets.resolution) ** 0.5),
                       batch_size=max(d.batch_size for d in datasets), rank=config.network_dim,
                       gradient_checkpointing=config.gradient_checkpointing,
                       cpu_offload_checkpointing=config.cpu_offload_checkpointing,
                       base_quantization=config.base_quantization, encoders_on_device=encoders_on_device,
                       t5_trains=config.train_t5, blocks_to_swap=config.blocks_to_swap, sd_scripts_swap=True,
                       optimizer=config.optimizer_type,
                       weight_dtype=weight_dtype_for(config.mixed_precision),
                       max_sequence_length=max_sequence_length, validation_images=validation_images)


def park_encoders(components: Any, device: torch.device, *, text_encoder_trains: bool,
                  latents_cached: bool, t5_trains: bool = False) -> ParkedModules:
    """Move the encoders the loop does not use off ``device`` (:func:`~dreamstep.models.parking.park_encoders`):
    T5 unless it trains (its outputs are cached), CLIP unless it trains, the VAE when the latents are cached."""
    return parking.park_encoders(FLUX, components, device, text_encoders_train=text_encoder_trains,
                                 latents_cached=latents_cached, t5_trains=t5_trains)


def prompt_embeddings(conditioner: FluxConditioner, prompts: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """The embeddings of each distinct prompt (validation prompts, encoded in the "encode text" phase)."""
    return {prompt: conditioner.prompts([prompt]) for prompt in dict.fromkeys(prompts)}


def generate_class_images(pipeline: FluxPipeline, class_dir: str | Path, class_prompt: str, wanted: int, *,
                          batch_size: int, resolution: int, seed: int, guidance_scale: float,
                          steps: int = FLUX_DEV_SAMPLING["steps"],
                          embeddings: dict[str, torch.Tensor] | None = None) -> int:
    """Fill ``class_dir`` up to ``wanted`` images with the base model's pictures of ``class_prompt``
    (:func:`~dreamstep.models.class_images.fill_class_folder`); return how many were generated. ``embeddings``
    (:func:`encode_prompts` of the class prompt) stand in for the text encoders, which may then wait off the
    device."""
    from dreamstep.models.class_images import fill_class_folder

    text: dict[str, Any] = {"prompt": class_prompt}
    if embeddings is not None:
        pipeline = without_text_encoders(pipeline)
        device, dtype = pipeline._execution_device, pipeline.transformer.dtype
        text = {"prompt_embeds": embeddings["prompt_embeds"].to(device, dtype),
                "pooled_prompt_embeds": embeddings["pooled"].to(device, dtype)}

    def make(count: int, generator: torch.Generator) -> list[Image.Image]:
        batch = {k: [v] * count if isinstance(v, str) else v.expand(count, *v.shape[1:]) for k, v in text.items()}
        return pipeline(**batch, num_inference_steps=steps, guidance_scale=guidance_scale, height=resolution,
                        width=resolution, generator=generator).images

    return fill_class_folder(class_dir, wanted, make, batch_size=batch_size, seed=seed)


def generate_class_images_within_plan(config: Any, class_dir: str | Path, device: torch.device) -> int:
    """The missing class images of a FLUX trainer's ``config`` (any :class:`FluxTrainingConfig` with prior
    preservation), made as :mod:`~dreamstep.models.class_images` says: the class prompt encoded first, then the
    transformer loaded as the run trains it (--base_quantization, --blocks_to_swap) denoising from its embeddings.
    Everything loaded here is dropped on return; :func:`~dreamstep.models.class_images.make_class_images` frees the
    device then."""
    from dreamstep.models.class_images import denoising_within_plan, encode_class_prompt

    base = base_of(config)
    components = load_encoders_for_training(
        base.source, revision=config.revision, variant=config.variant, mixed_precision=config.mixed_precision,
        device=device, text_encoder_quantization=config.text_encoder_quantization, files=base.files)
    pipeline = assemble_pipeline(components)
    embeddings = encode_class_prompt(components, device, TEXT_ENCODERS, lambda: encode_prompts(
        pipeline, [config.class_prompt], config.max_sequence_length))
    swapped = getattr(config, "blocks_to_swap", 0)
    load_transformer_for_training(
        components, base.source, revision=config.revision, variant=config.variant,
        transformer_single_file=base.files.transformer, mixed_precision=config.mixed_precision, device=device,
        base_quantization=config.base_quantization, on_host=swapped > 0)
    attach_transformer(pipeline, components)
    with denoising_within_plan(components, components.transformer, device, swapped):
        return generate_class_images(pipeline, class_dir, config.class_prompt, config.num_class_images,
                                     batch_size=config.sample_batch_size, resolution=config.resolution,
                                     seed=config.seed, guidance_scale=config.guidance_scale, embeddings=embeddings)
