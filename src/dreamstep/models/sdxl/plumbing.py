"""SDXL plumbing shared by trainers and sampling: the frozen base and its caches, prompt encoding with
both CLIP encoders (through ``StableDiffusionXLPipeline.encode_prompt``, so training sees exactly what
inference sees), the size conditioning ``add_time_ids``, VAE posteriors, and sd-scripts' sample-prompt lines.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    HeunDiscreteScheduler,
    PNDMScheduler,
    StableDiffusionXLPipeline,
)
from PIL import Image

from dreamstep.data.cache import TensorCache, latents_for_batch, text_content_key
from dreamstep.data.dataset_config import DatasetConfig
from dreamstep.errors import UserError, did_you_mean
from dreamstep.models import parking
from dreamstep.models.loading import component_identity, load_sdxl, load_sdxl_unet
from dreamstep.models.memory_plan import PlanOptions
from dreamstep.models.parking import ParkedModules
from dreamstep.models.phases import ENCODERS
from dreamstep.models.precision import freeze, weight_dtype_for
from dreamstep.models.sample_prompts import (
    SDXL_OPTIONS,
    SamplePrompt,
    parse_prompt_line,
    read_prompt_lines,
    save_samples,
)
from dreamstep.models.sdxl.family import FAMILY as SDXL
from dreamstep.models.vae import encode_posterior
from dreamstep.notices import CAPTION_CUT, hidden
from dreamstep.png_text import JSON_KEY, sample_parameters

# sd-scripts' --sample_sampler names -> diffusers schedulers.
SAMPLERS = {
    "ddim": DDIMScheduler, "pndm": PNDMScheduler, "euler": EulerDiscreteScheduler,
    "k_euler": EulerDiscreteScheduler, "euler_a": EulerAncestralDiscreteScheduler,
    "k_euler_a": EulerAncestralDiscreteScheduler, "dpmsolver++": DPMSolverMultistepScheduler,
    "heun": HeunDiscreteScheduler,
}


def check_sampler(name: str, where: str) -> str:
    """``name`` when it is one of :data:`SAMPLERS`, else an error naming ``where`` and the choices."""
    if name not in SAMPLERS:
        raise UserError(f"{where}: unknown sampler '{name}'{did_you_mean(name, SAMPLERS)}; "
                        f"choose one of {', '.join(SAMPLERS)}")
    return name


def assemble_pipeline(components: Any, unet: torch.nn.Module | None = None) -> StableDiffusionXLPipeline:
    """A ``StableDiffusionXLPipeline`` over already-loaded components (no copies)."""
    parts = {name: getattr(components, name) for name in
             ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "unet", "scheduler")}
    if unet is not None:
        parts["unet"] = unet
    pipeline = StableDiffusionXLPipeline(**parts)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def config_source(source: str, model_config: str | None) -> str:
    """Where the model configs of ``source`` are: ``model_config``, a single file's own folder when that
    holds ``model_index.json``, else ``source`` itself."""
    file = Path(source)
    if model_config is None and file.is_file() and (file.parent / "model_index.json").is_file():
        return str(file.parent)
    return model_config or source


def load_encoders_for_training(source: str, *, model_config: str | None, mixed_precision: str,
                               device: torch.device, vae_fp32: bool = False, unet_quantization: str = "none") -> Any:
    """The "encode" phases' components (:mod:`~dreamstep.models.phases`): both CLIP text encoders and the VAE
    frozen in the half-precision dtype of ``mixed_precision`` (the VAE in fp32 with ``vae_fp32``: SDXL's VAE
    overflows in fp16), waiting in host memory (:func:`~dreamstep.models.parking.encode_run` brings each to
    ``device`` in its turn). A diffusers folder or hub id leaves the UNet unloaded (``base.unet`` is
    ``None``); a single file holds it too, and it waits in host memory, frozen and quantized as
    ``unet_quantization`` says (:mod:`~dreamstep.models.quantization`), for :func:`load_unet_for_training`. A single
    file finds its configs in ``model_config``, or in its own folder when that holds ``model_index.json``, else
    diffusers fetches the SDXL base's."""
    configs = config_source(source, model_config)
    base = load_sdxl(source, config=configs if configs != source else None,
                     weight_dtype=weight_dtype_for(mixed_precision), unet_quantization=unet_quantization, unet=False)
    for name in ENCODERS:
        module = getattr(base, name)
        freeze(module)
        parking.place(module, parking.PARKING_DEVICE)
        module.eval()
    if vae_fp32:
        base.vae.to(torch.float32)
    if base.unet is not None:
        freeze(base.unet)
        parking.move(base.unet, parking.PARKING_DEVICE)
    return base


def load_unet_for_training(base: Any, source: str, *, mixed_precision: str, device: torch.device,
                           sdpa: bool = False, gradient_checkpointing: bool = False, unet_quantization: str = "none",
                           on_host: bool = False) -> torch.nn.Module:
    """The "load" phase: the UNet frozen in the dtype of ``mixed_precision``, its linear weights quantized as
    ``unet_quantization`` says, on ``device`` (``on_host``: left in host memory for a block swapper to place),
    set as ``base.unet``. A single file's UNet, read in the "encode" phases, comes from host memory."""
    unet = base.unet
    if unet is None:
        unet = load_sdxl_unet(source, weight_dtype=weight_dtype_for(mixed_precision),
                              unet_quantization=unet_quantization, on_host=on_host)
        freeze(unet)
    parking.move(unet, torch.device("cpu") if on_host else device)
    if sdpa:
        from diffusers.models.attention_processor import AttnProcessor2_0

        unet.set_attn_processor(AttnProcessor2_0())
    if gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    base.unet = unet.eval()
    return unet


def attach_unet(pipeline: StableDiffusionXLPipeline, base: Any) -> None:
    """Put the UNet loaded after the "encode" phases into the pipeline assembled before it."""
    pipeline.register_modules(unet=base.unet)
    pipeline.default_sample_size = base.unet.config.sample_size  # the pipeline reads it from its UNet when built


def without_text_encoders(pipeline: StableDiffusionXLPipeline) -> StableDiffusionXLPipeline:
    """The same pipeline (same modules, no copies) without its text encoders, for prompts given as embeddings:
    the encoders may wait off the device, and the pipeline neither runs them nor computes on their device."""
    view = type(pipeline)(**{**pipeline.components, "text_encoder": None, "text_encoder_2": None})
    view.set_progress_bar_config(disable=True)
    return view


def _identity(source: str, component: str, precision: str) -> str:
    """Cache identity of one component: source and dtype, and for a single file its size and time."""
    path = Path(source)
    stamp = f"{path.stat().st_size}:{path.stat().st_mtime_ns}" if path.is_file() else ""
    return component_identity(path, component, extra=f"{stamp}|{precision}")


def training_caches(root: Path, source: str, *, mixed_precision: str, vae_fp32: bool, cache_latents: bool,
                    cache_text: bool, image_dirs: list[Path]) -> tuple[TensorCache | None, TensorCache | None]:
    """The latent and text-embedding caches of a run under ``root`` (``None`` where off), each keyed to the
    weights and dtype that fill it."""
    vae_precision = "no" if vae_fp32 else mixed_precision
    latents = (TensorCache(root / "latents", _identity(source, "vae", vae_precision), image_dirs)
               if cache_latents else None)
    text = None
    if cache_text:
        text_id = "+".join(_identity(source, name, mixed_precision) for name in ("text_encoder", "text_encoder_2"))
        text = TensorCache(root / "text", text_id, image_dirs)
    return latents, text


def encode_prompts(pipeline: StableDiffusionXLPipeline, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Penultimate hidden states of CLIP-L and CLIP-G, concatenated: (B, 77, 768 + 1280 for SDXL), and
    CLIP-G's projected pooled output (B, 1280). Differentiable when a text encoder trains. The prompts are
    training captions: the run summary names those that get cut, so the pipeline's notices are hidden."""
    device = pipeline.text_encoder_2.device
    with hidden(CAPTION_CUT):
        embeds, _, pooled, _ = pipeline.encode_prompt(prompt=prompts, device=device,
                                                      do_classifier_free_guidance=False)
    return {"prompt_embeds": embeds, "pooled": pooled}


def add_time_ids(original_sizes: torch.Tensor, crop_top_lefts: torch.Tensor,
                 target_sizes: torch.Tensor) -> torch.Tensor:
    """SDXL's micro-conditioning, (B, 6): original (h, w), crop (top, left), target (h, w) of each sample
    (each (B, 2), from the data pipeline's true sizes and crops)."""
    return torch.cat([original_sizes, crop_top_lefts, target_sizes], dim=1)


class SDXLLoraModel(torch.nn.Module):
    """What DDP wraps: the UNet with the network's hooks; prompts are encoded here when the text encoders
    train (``captions``), else they come cached (``prompt_embeds``, ``pooled``)."""

    def __init__(self, unet: torch.nn.Module, network: torch.nn.Module | None, pipeline: Any):
        """``network``: the Kohya network hooked into the UNet (and text encoders); ``None`` where a LoRA was
        loaded into the pipeline instead (``dreamstep eval``)."""
        super().__init__()
        self.unet = unet
        self.network = network
        self._pipeline = (pipeline,)  # not a module: its parts are the UNet and frozen encoders

    def forward(self, noisy: torch.Tensor, timesteps: torch.Tensor, add_time_ids: torch.Tensor,
                prompt_embeds: torch.Tensor | None = None, pooled: torch.Tensor | None = None,
                captions: list[str] | None = None) -> torch.Tensor:
        if captions is not None:
            encoded = encode_prompts(self._pipeline[0], captions)
            prompt_embeds, pooled = encoded["prompt_embeds"], encoded["pooled"]
        conditions = {"text_embeds": pooled, "time_ids": add_time_ids}
        return self.unet(noisy, timesteps, encoder_hidden_states=prompt_embeds, added_cond_kwargs=conditions,
                         return_dict=False)[0]


def park_encoders(base: Any, device: torch.device, *, text_in_the_loop: bool, latents_cached: bool) -> ParkedModules:
    """Move the encoders the loop does not use off ``device`` (:func:`~dreamstep.models.parking.park_encoders`):
    both CLIP encoders unless they encode in the loop (they train, or their outputs are not cached), the VAE
    when the latents are cached."""
    return parking.park_encoders(SDXL, base, device, text_encoders_train=text_in_the_loop,
                                 latents_cached=latents_cached)


class SDXLConditioner:
    """A collated batch -> the step's inputs: VAE posteriors (from the latent cache when given), size
    conditioning, and prompt embeddings from the text cache; with ``text_cache=None`` the captions are
    passed on to be encoded inside the step (text encoders that train)."""

    def __init__(self, pipeline: StableDiffusionXLPipeline, *, device: torch.device,
                 latent_cache: TensorCache | None, text_cache: TensorCache | None, encode_text: bool):
        self.pipeline = pipeline
        self.device = device
        self.latent_cache = latent_cache
        self.text_cache = text_cache
        self.encode_text = encode_text

    def latents(self, batch: dict[str, Any]) -> torch.Tensor:
        def encode(pixels: torch.Tensor) -> torch.Tensor:
            return encode_posterior(self.pipeline.vae, pixels.to(self.device)).cpu()

        return latents_for_batch(batch, encode, self.latent_cache).to(self.device, non_blocking=True)

    @torch.no_grad()
    def prompts(self, captions: list[str], known: Any = None) -> dict[str, torch.Tensor]:
        """The captions' prompt embeddings; ``known``: the cache entries the loader read (``batch["text"]``)."""
        def encode(missing: list[int]) -> dict[str, torch.Tensor]:
            found = encode_prompts(self.pipeline, [captions[i] for i in missing])
            return {k: v.cpu() for k, v in found.items()}

        if self.text_cache is None:
            return {k: v.to(self.device) for k, v in encode(list(range(len(captions)))).items()}
        found = self.text_cache.get_or_compute([text_content_key(c) for c in captions], encode, known)
        return {k: v.to(self.device, non_blocking=True) for k, v in found.items()}

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        inputs: dict[str, Any] = {
            "latent_dist": self.latents(batch),
            "add_time_ids": add_time_ids(batch["original_sizes"], batch["crop_top_lefts"],
                                         batch["target_sizes"]).to(self.device, non_blocking=True),
            "is_reg": batch["is_reg"].to(self.device, non_blocking=True),
        }
        if self.encode_text:
            inputs.update(self.prompts(batch["captions"], batch.get("text")))
        else:
            inputs["captions"] = batch["captions"]
        if "masks" in batch:  # --masked_loss: (B, 1, H, W) in [0, 1], at the image's size
            inputs["masks"] = batch["masks"].to(self.device, non_blocking=True)
        return inputs


# ------------------------------------------------------------------------------------- sample prompts

def parse_sample_prompt(line: str, where: str, default_size: tuple[int, int]) -> SamplePrompt:
    """Parse one prompt line with sd-scripts' SDXL options (--n --w --h --s --l --d --ss)."""
    sample = parse_prompt_line(line, where, {"width": default_size[0], "height": default_size[1]}, SDXL_OPTIONS)
    if sample.sampler is not None:
        check_sampler(sample.sampler, f"{where}: --ss")
    return sample


def read_sample_prompts(path: str, default_size: tuple[int, int]) -> list[SamplePrompt]:
    """A prompt file (one prompt per line, '#' comments); every line is checked before training starts."""
    return [parse_sample_prompt(line, where, default_size) for where, line in read_prompt_lines(path)]


def sampler_for(name: str, scheduler_config: Any, where: str = "--sample_sampler") -> Any:
    """The diffusers scheduler for an sd-scripts sampler name, built from the model's schedule."""
    return SAMPLERS[check_sampler(name, where)].from_config(scheduler_config)


def prompt_key(sample: SamplePrompt) -> tuple[str, str]:
    return sample.prompt, sample.negative_prompt


@torch.no_grad()
def sample_prompt_embeddings(pipeline: StableDiffusionXLPipeline, prompts: list[SamplePrompt]
                             ) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    """What the pipeline encodes for each distinct sample prompt and negative prompt (for classifier-free
    guidance; no negative prompt gives SDXL's zeros), in host memory: the "encode text" phase makes them, so that
    samples need no text encoder. Keys: :func:`prompt_key`; values: the pipeline's embedding arguments."""
    found = {}
    for sample in prompts:
        if prompt_key(sample) not in found:
            encoded = pipeline.encode_prompt(prompt=sample.prompt, negative_prompt=sample.negative_prompt or None,
                                             device=pipeline.text_encoder_2.device, do_classifier_free_guidance=True)
            names = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds",
                     "negative_pooled_prompt_embeds")
            found[prompt_key(sample)] = {name: tensor.cpu() for name, tensor in zip(names, encoded)}
    return found


@torch.no_grad()
def generate_samples(pipeline: StableDiffusionXLPipeline, prompts: list[SamplePrompt], *, default_sampler: str,
                     seed: int, v_prediction: bool = False,
                     embeddings: dict[tuple[str, str], dict[str, torch.Tensor]] | None = None) -> list[Image.Image]:
    """One image per prompt; a prompt without --d gets ``seed + its index``, so samples are comparable
    across steps. ``v_prediction`` samples a v-prediction model (--v_parameterization). ``embeddings``
    (:func:`sample_prompt_embeddings`) are used instead of the text encoders, which may then wait off the device;
    the pipeline makes the size conditioning (time ids) itself."""
    if embeddings is not None:
        pipeline = without_text_encoders(pipeline)
    images = []
    base_scheduler = pipeline.scheduler
    try:
        for i, sample in enumerate(prompts):
            config = {**base_scheduler.config, "prediction_type": "v_prediction" if v_prediction else "epsilon"}
            pipeline.scheduler = sampler_for(sample.sampler or default_sampler, config)
            generator = torch.Generator("cpu").manual_seed(sample.seed if sample.seed is not None else seed + i)
            text = (embeddings[prompt_key(sample)] if embeddings is not None else
                    {"prompt": sample.prompt, "negative_prompt": sample.negative_prompt or None})
            result = pipeline(**text, width=sample.width, height=sample.height, num_inference_steps=sample.steps,
                              guidance_scale=sample.scale, generator=generator)
            image = result.images[0]
            image.info[JSON_KEY] = sample_parameters(
                pipeline, prompt=sample.prompt, negative_prompt=sample.negative_prompt,
                seed=sample.seed if sample.seed is not None else seed + i, steps=sample.steps,
                guidance_scale=sample.scale, width=sample.width, height=sample.height)
            images.append(image)
    finally:
        pipeline.scheduler = base_scheduler
    return images


class SampleWriter:
    """Sample images with a training network applied, on the calling process; PNGs go to ``folder`` named as
    sd-scripts names them, and the images are returned for the log's grid. With ``embeddings`` (the sample
    prompts' :func:`sample_prompt_embeddings`) the text encoders are not used; of the parked ``encoders`` only
    the VAE comes to the device, while sampling."""

    def __init__(self, pipeline: StableDiffusionXLPipeline, network: torch.nn.Module, prompts: list[SamplePrompt], *,
                 folder: Path, name: str, sampler: str, seed: int, v_prediction: bool, autocast: Any,
                 encoders: ParkedModules | None = None,
                 embeddings: dict[tuple[str, str], dict[str, torch.Tensor]] | None = None):
        self.pipeline, self.network, self.prompts = pipeline, network, prompts
        self.encoders, self.embeddings = encoders, embeddings
        self.folder, self.name = folder, name
        self.sampler, self.seed, self.v_prediction = sampler, seed, v_prediction
        self.autocast = autocast
        self.written: list[Path] = []

    def __call__(self, global_step: int) -> list[Image.Image]:
        self.network.eval()
        try:
            with self.encoders.on_device("vae") if self.encoders else contextlib.nullcontext(), self.autocast():
                images = generate_samples(self.pipeline, self.prompts, default_sampler=self.sampler,
                                          seed=self.seed, v_prediction=self.v_prediction, embeddings=self.embeddings)
        finally:
            self.network.train()
        self.written += save_samples(images, self.folder, self.name, global_step)
        return images


def plan_options(config: Any, datasets: list[DatasetConfig], *, encoders_on_device: bool,
                 validation_images: bool) -> PlanOptions:
    """The memory-plan inputs of sdxl-lora's ``config`` (its recipe and the dashboard's new-run form plan with
    these), at the first dataset's resolution and the largest batch of ``datasets``."""
    return PlanOptions(resolution=round(math.prod(datasets[0].buckets.resolution) ** 0.5),
                       batch_size=max(d.batch_size for d in datasets), rank=config.network_dim,
                       gradient_checkpointing=config.gradient_checkpointing,
                       base_quantization=config.unet_quantization, encoders_on_device=encoders_on_device,
                       blocks_to_swap=config.blocks_to_swap, optimizer=config.optimizer_type,
                       weight_dtype=weight_dtype_for(config.mixed_precision), validation_images=validation_images)
