"""Z-Image DreamBooth LoRA: ``dreamstep train z-image-lora``, diffusers' ``train_dreambooth_lora_z_image.py``.

Features: instance images with one prompt or per-image captions (``--caption_extension``), or a Kohya dataset TOML
(``--dataset_config``); prior preservation on a class folder; LoRA on the transformer's main blocks and refiners
(``--lora_layers``: attention (the script's default to_q, to_k, to_v, to_out.0), attention+ff, all-linear, or
module names); the script's step (the VAE posterior's mode, the reversed timestep, per-sample caption features at
their own length, the negated prediction) with the SD3 weightings and sd-scripts' timestep sampling and loss
types; captions encoded by Qwen3 before the transformer loads, the encoder then freed from the device; latents and
caption features cached by content; quantized base (int8/fp8/nf4), block swap, gradient checkpointing, the memory
plan; an EMA of the LoRA weights; resumable checkpoints; validation samples, drawn with ``--validation_model_path``
(Z-Image Turbo: 9 steps, no guidance) carrying the LoRA that trains on the base, and the evaluation.

Outputs in --output_dir: ``pytorch_lora_weights.safetensors`` (diffusers layout, what
``ZImagePipeline.load_lora_weights`` reads), ``pytorch_lora_weights_comfyui.safetensors`` (ComfyUI's layout:
``diffusion_model.`` + the module names its Z-Image loader maps, which diffusers reads too), with
--save_kohya_format ``pytorch_lora_weights_kohya.safetensors`` (``lora_unet_`` + the released checkpoint's module
names, q, k and v fused into ``attention_qkv``), with --ema_decay
``pytorch_lora_weights_ema.safetensors``, ``samples/``, ``loss_curve.png``, TensorBoard event files,
``checkpoint-N/``, ``cache/`` and ``config.toml``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file
from torch import nn

from dreamstep.config.schema import config_to_toml
from dreamstep.config.z_image_lora import ZImageLoraConfig
from dreamstep.data.cache import TensorCache
from dreamstep.data.dataset import BucketDataset, ConditionedBatches
from dreamstep.data.dataset_config import DatasetConfig
from dreamstep.data.holdout import build_split_datasets, subject_image_paths
from dreamstep.data.sources import dreambooth_datasets
from dreamstep.engine.fit import FinishedRun, finish, fit_from_options, hooks_from_options
from dreamstep.engine.logging import say_before_the_run
from dreamstep.engine.plan import check_optimization, loader_and_plan
from dreamstep.engine.run import claim_output_dir, start_run
from dreamstep.engine.summary import print_run_summary
from dreamstep.evaluation.evaluator import build_evaluator, held_out_loss_of, load_scorer
from dreamstep.files import honour_umask
from dreamstep.lora.convert import convert_lora
from dreamstep.lora.inject import TrainableState, save_flux_lora
from dreamstep.lora.io import write_lora_file
from dreamstep.lora.training import prepare_lora_training
from dreamstep.models import parking
from dreamstep.models.class_images import (
    denoising_within_plan,
    encode_class_prompt,
    fill_class_folder,
    make_class_images,
    missing_class_images,
)
from dreamstep.models.family import check_blocks_to_swap
from dreamstep.models.memory_plan import PlanOptions
from dreamstep.models.plans import RunPlan, print_run_plan
from dreamstep.models.precision import weight_dtype_for
from dreamstep.models.z_image import configs
from dreamstep.models.z_image import plumbing as zi
from dreamstep.models.z_image.family import FAMILY
from dreamstep.models.z_image.lora_keys import comfyui_state_dict
from dreamstep.models.z_image.lora_targets import z_image_lora_targets
from dreamstep.models.z_image.step import ZImageFlowMatchingStep
from dreamstep.png_text import JSON_KEY

COMMAND = "train z-image-lora"
FOLDER_FLAG = "instance_data_dir"  # the flag an image folder is read from (the dashboard's dataset check)
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
COMFYUI_WEIGHT_NAME = "pytorch_lora_weights_comfyui.safetensors"
EMA_WEIGHT_NAME = "pytorch_lora_weights_ema.safetensors"
KOHYA_WEIGHT_NAME = "pytorch_lora_weights_kohya.safetensors"  # the released layout's names, q, k, v fused


@dataclass(frozen=True)
class DitLora:
    """What a LoRA trainer of a single-stream DiT with one Qwen text encoder (Z-Image; Krea 2 reuses it) needs of its
    family: the family and how its folders load (``kind``), its step and conditioner, how it samples
    (``generate``, :func:`~dreamstep.models.z_image.plumbing.generate`'s signature), its distilled checkpoint
    (``is_distilled``, its name, the base to train on instead, each one's recommended (steps, guidance)), its
    repeated blocks, its LoRA targets and ComfyUI names, and the pipeline config's settings to keep."""

    family: Any
    kind: zi.Kind
    step_class: type
    conditioner_class: type
    generate: Callable[..., list[Image.Image]]
    is_distilled: Callable[[str], bool]
    distilled_title: str
    base_id: str
    distilled_sampling: dict[str, float]
    base_sampling: dict[str, float]
    block_count: Callable[[dict[str, Any]], int]
    lora_targets: Callable[[torch.nn.Module, list[str]], list[str]]
    comfyui_state_dict: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]
    pipeline_options: tuple[str, ...] = ()

    @property
    def command(self) -> str:
        return f"train {self.family.name}-lora"


Z_IMAGE = DitLora(
    family=FAMILY, kind=zi.Z_IMAGE, step_class=ZImageFlowMatchingStep, conditioner_class=zi.ZImageConditioner,
    generate=zi.generate, is_distilled=configs.is_distilled, distilled_title="Z-Image Turbo",
    base_id=configs.BASE_ID, distilled_sampling=configs.TURBO_SAMPLING, base_sampling=configs.BASE_SAMPLING,
    block_count=lambda found: found["n_layers"] + 2 * found["n_refiner_layers"],
    lora_targets=z_image_lora_targets, comfyui_state_dict=lambda state, _config: comfyui_state_dict(state))


def training_datasets(config: ZImageLoraConfig, spec: DitLora = Z_IMAGE) -> list[DatasetConfig]:
    """What the run trains on: its dataset TOML, or the instance (and, once it holds --num_class_images images,
    class) folders."""
    class_dir = config.class_data_dir if config.class_images_to_generate and not _class_images_missing(config) else None
    return dreambooth_datasets(config, class_dir, spec.command)


@dataclass(frozen=True)
class DitRunPlan(RunPlan):
    """A run plan whose base is checked as a folder of its family (one line naming the flag)."""

    kind: zi.Kind = zi.Z_IMAGE

    def check_source(self) -> None:
        if self.source is not None:
            zi.check_source(self.source, kind=self.kind)


def plan_inputs(config: ZImageLoraConfig, dataset_configs: list[DatasetConfig], encodes_in_the_loop: bool,
                spec: DitLora = Z_IMAGE) -> RunPlan:
    """The memory plan's inputs (the largest resolution and batch of the datasets); ``encodes_in_the_loop``: the
    loop encodes random crops itself, so the VAE stays on the device."""
    resolution = max(round(math.prod(d.buckets.resolution) ** 0.5) for d in dataset_configs)
    options = PlanOptions(
        resolution=resolution, batch_size=max(d.batch_size for d in dataset_configs), rank=config.rank,
        gradient_checkpointing=config.gradient_checkpointing,
        cpu_offload_checkpointing=config.cpu_offload_checkpointing, base_quantization=config.base_quantization,
        text_encoder_quantization=config.text_encoder_quantization,
        encoders_on_device=not config.cache_latents or encodes_in_the_loop, blocks_to_swap=config.blocks_to_swap,
        optimizer=config.optimizer, weight_dtype=weight_dtype_for(config.mixed_precision),
        max_sequence_length=config.max_sequence_length, validation_images=bool(config.validation_prompt),
        class_images_batch=config.sample_batch_size if _class_images_missing(config) else 0)
    return DitRunPlan(spec.family.name, config.pretrained_model_name_or_path, options,
                      {"lora_layers": config.lora_layers}, kind=spec.kind)


def check_base(config: ZImageLoraConfig, spec: DitLora = Z_IMAGE) -> dict[str, Any]:
    """Every model flag checked before anything is written or loads: the base (and --validation_model_path) are
    folders or hub ids of the family, --blocks_to_swap fits the transformer; a distilled base is named once with
    the base to use. Returns the transformer's config."""
    zi.check_source(config.pretrained_model_name_or_path, kind=spec.kind)
    if config.validation_model_path is not None:
        zi.check_source(config.validation_model_path, "--validation_model_path", kind=spec.kind)
    found = zi.transformer_config(config.pretrained_model_name_or_path, config.revision, kind=spec.kind)
    check_blocks_to_swap(config.blocks_to_swap, spec.block_count(found))
    if spec.is_distilled(config.pretrained_model_name_or_path):
        say_before_the_run(
            f"warning: --pretrained_model_name_or_path {config.pretrained_model_name_or_path} is "
            f"{spec.distilled_title}, a distilled model: a LoRA trained on it breaks the distillation (its samples "
            f"lose the few-step quality). Train on the base, {spec.base_id}, and draw the validation samples with "
            f"the distilled model: --validation_model_path {config.pretrained_model_name_or_path}")
    return found


def build_step(config: ZImageLoraConfig, spec: DitLora, model: nn.Module, scheduler: Any,
               **engine_options: Any) -> Any:
    """The run's step: ``model`` (the LoRA'd transformer, or DDP's wrap of it) with the base ``scheduler``'s σ
    table; ``engine_options``: :class:`~dreamstep.engine.train_step.TrainStep`'s (without an optimizer the step
    only evaluates)."""
    return spec.step_class(model, sigmas=zi.training_sigmas(scheduler), objective=config.flow_matching_objective(),
                           prior_loss_weight=config.prior_loss_weight, **engine_options)


def held_out_loss(config: ZImageLoraConfig, held_out: BucketDataset, pipeline: Any, text_cache: TensorCache,
                  device: torch.device, spec: DitLora = Z_IMAGE) -> Callable[[nn.Module | None], float]:
    """The validation loss the run logged, for ``dreamstep eval``: of ``pipeline`` (the base, with the LoRA eval
    applied to its transformer) on the images the run held out, encoded once, scored by the run's step at the
    same fixed noise levels and draws."""
    components = zi.ZImageComponents(scheduler=pipeline.scheduler, vae=pipeline.vae,
                                     text_encoder=pipeline.text_encoder, tokenizer=pipeline.tokenizer,
                                     transformer=pipeline.transformer, pipeline_class=type(pipeline),
                                     pipeline_options={name: pipeline.config[name] for name in spec.pipeline_options})
    conditioner = spec.conditioner_class(components, latent_cache=None, text_cache=text_cache,
                                         max_sequence_length=config.max_sequence_length, device=device)

    def step_for(_: nn.Module | None) -> tuple[Any, list[nn.Module]]:
        transformer = pipeline.transformer
        return build_step(config, spec, transformer, pipeline.scheduler, optimizer=None
                          ).validation_loss_at, [transformer]

    return held_out_loss_of(held_out, conditioner, seed=config.seed, device=device,
                            mixed_precision=config.mixed_precision, step_for=step_for)


def train(config: ZImageLoraConfig, spec: DitLora = Z_IMAGE) -> FinishedRun | None:
    """Train as configured; return what was written where (nothing with --dry_run)."""
    # 1. Check and plan: every flag, folder and image and the optimizer, before a model loads.
    source = config.pretrained_model_name_or_path
    check_base(config, spec)
    claim_output_dir(config.output_dir, overwrite=config.overwrite_output_dir,
                     resume_from_checkpoint=config.resume_from_checkpoint, config_toml=config_to_toml(config),
                     resume_must_match=config.resume_must_match)
    check_optimization(**config.optimization())
    generate_class = _class_images_missing(config)
    datasets = training_datasets(config, spec)
    latent_cache, text_cache = _caches(config, datasets, spec)
    dataset, held_out = build_split_datasets(datasets, config.seed, config.validation_split,
                                             latent_cache=latent_cache, text_cache=text_cache)
    scorer = load_scorer(config)
    print_run_plan(plan_inputs(config, datasets, dataset.encodes_in_the_loop(), spec), config.device_memory)
    if config.dry_run:
        return None
    run = start_run(config.output_dir, mixed_precision=config.mixed_precision, seed=config.seed,
                    report_to=config.report_to, resume_from_checkpoint=config.resume_from_checkpoint,
                    config_toml=config_to_toml(config), command=f"dreamstep {spec.command}",
                    overwrite=config.overwrite_output_dir, allow_tf32=config.allow_tf32)

    # 2. Class images (the plan's "class images" phase): the base makes the missing ones as the run will train it
    # (quantized, swapped), from the class prompt's caption features; all is freed before the run loads its own.
    if generate_class:
        make_class_images(run, lambda: _generate_class_images(config, spec, text_cache, run.device))
        datasets = training_datasets(config, spec)
        dataset, held_out = build_split_datasets(datasets, config.seed, config.validation_split,
                                                 latent_cache=latent_cache, text_cache=text_cache)

    # 3. Data: bucketed samples, posteriors and caption features from the content-keyed caches; the step counts.
    loader, plan = loader_and_plan(run, dataset, seed=config.seed, num_workers=config.dataloader_num_workers,
                                   **config.step_counts())
    run.config_toml = config.resolved_toml(plan.num_epochs)

    # 4. Encode: the VAE then Qwen3 encode every image and caption (and the validation prompts) before the
    # transformer loads; then Qwen3 waits in host memory, and the VAE too when the latents are cached.
    base = zi.load_encoders(source, revision=config.revision, variant=config.variant,
                            mixed_precision=config.mixed_precision,
                            text_encoder_quantization=config.text_encoder_quantization, kind=spec.kind,
                            pipeline_options=spec.pipeline_options)
    conditioner = spec.conditioner_class(base, latent_cache=latent_cache, text_cache=text_cache,
                                       max_sequence_length=config.max_sequence_length, device=run.device)
    zi.encode_run(conditioner, dataset, held_out, epochs=plan.num_epochs)
    sampler = _Sampler(config, base, conditioner, spec) if config.validation_prompt else None
    vae_in_the_loop = latent_cache is None or dataset.encodes_in_the_loop()
    encoders = parking.ParkedModules({"text_encoder": base.text_encoder,
                                      **({} if vae_in_the_loop else {"vae": base.vae})}, run.device)
    encoders.park()
    if vae_in_the_loop:
        parking.place(base.vae, run.device)
    batches = ConditionedBatches(loader, conditioner)

    # 5. Load: the transformer frozen in the --mixed_precision dtype (quantized as asked); LoRA weights in fp32.
    transformer = zi.load_transformer(source, revision=config.revision, variant=config.variant,
                                      mixed_precision=config.mixed_precision, device=run.device,
                                      base_quantization=config.base_quantization, on_host=config.blocks_to_swap > 0,
                                      kind=spec.kind)
    base.transformer = transformer
    targets = spec.lora_targets(transformer, config.lora_layers)
    training = prepare_lora_training(transformer, targets, config, run, plan)
    model, optimizer, lr_scheduler, ema = training.model, training.optimizer, training.lr_scheduler, training.ema

    # 6. Step: AdamW/8-bit/Prodigy over the LoRA weights, the LR schedule, clipping, accumulation.
    step = build_step(config, spec, model, base.scheduler, optimizer=optimizer, lr_scheduler=lr_scheduler,
                      accelerator=run.accelerator, ema=ema, max_grad_norm=config.max_grad_norm or None,
                      gradient_accumulation_steps=config.gradient_accumulation_steps,
                      length_of_dataloader=len(loader))
    print_run_summary(run, dataset, plan, gradient_accumulation_steps=config.gradient_accumulation_steps,
                      mixed_precision=config.mixed_precision, trainable=(transformer,),
                      caches={"latents": latent_cache, "text": text_cache}, outputs=config.output_dir,
                      tokenizers={"Qwen": (base.tokenizer, config.max_sequence_length)})

    # 7. Loop: the engine trains, checkpoints and validates (samples, then the validation loss and scores).
    evaluator = build_evaluator(config, scorer, held_out=held_out, conditioner=conditioner,
                                loss_at=step.validation_loss_at, modules=[model], seed=config.seed,
                                subject_images=subject_image_paths(dataset, held_out), device=run.device)
    prompts = [config.validation_prompt] * config.num_validation_images if config.validation_prompt else []
    drawn: dict[int, list[Image.Image]] = {}  # the samples of the last step sampled, for its scores

    def sample(global_step: int) -> list[Image.Image]:
        with encoders.on_device("vae"):
            drawn[global_step] = sampler(transformer, datasets[0].buckets.resolution)
        return sampler.labelled(drawn[global_step])

    hooks = hooks_from_options(config, sample=sample if sampler is not None else None,
                               score=(lambda at, _: evaluator(drawn.pop(at, []), prompts))
                               if evaluator is not None else None,
                               ema=ema)
    result = fit_from_options(run, step, batches, config, total_steps=plan.total_steps,
                              trained=TrainableState({"transformer": transformer}), ema=ema, hooks=hooks)

    # 8. Save: the diffusers layout and ComfyUI's, final samples and scores, loss curve, summary.
    written: dict[str, Path | None] = {}
    if run.is_main_process:
        written["LoRA (diffusers)"] = save_flux_lora(config.output_dir, transformer, weight_name=LORA_WEIGHT_NAME)
        written["LoRA (ComfyUI)"] = save_comfyui_lora(
            written["LoRA (diffusers)"], Path(config.output_dir) / COMFYUI_WEIGHT_NAME,
            lambda state: spec.comfyui_state_dict(state, transformer.config))
        if config.save_kohya_format:
            kohya_path = Path(config.output_dir) / KOHYA_WEIGHT_NAME
            convert_lora(written["LoRA (diffusers)"], kohya_path, to="kohya", model=spec.family.name, overwrite=True)
            written["LoRA (Kohya)"] = kohya_path
        if ema is not None:
            with ema.swapped_in():
                written["LoRA (EMA)"] = save_flux_lora(config.output_dir, transformer, weight_name=EMA_WEIGHT_NAME)
    return finish(run, written, result, hooks, best_by=config.best_metric(held_out is not None))


def save_comfyui_lora(diffusers_file: Path, path: Path,
                      rename: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Path:
    """The diffusers-layout file (alpha already folded into lora_B) under ComfyUI's names (``rename``), no
    header."""
    write_lora_file(path, rename(load_file(str(diffusers_file))), {}, "safetensors")
    honour_umask(path)
    return path


def _caches(config: ZImageLoraConfig, datasets: list[DatasetConfig], spec: DitLora) -> tuple[Any, Any]:
    image_dirs = [s.image_dir for d in datasets for s in d.subsets if s.image_dir is not None]
    if config.class_images_to_generate:  # a class folder still to fill is not among the datasets yet
        image_dirs.append(Path(config.class_data_dir))
    return zi.training_caches(config.cache_root(), config.pretrained_model_name_or_path, revision=config.revision,
                              variant=config.variant, mixed_precision=config.mixed_precision,
                              max_sequence_length=config.max_sequence_length, cache_latents=config.cache_latents,
                              image_dirs=image_dirs, kind=spec.kind)


def _class_images_missing(config: ZImageLoraConfig) -> bool:
    """Whether prior preservation's class folder holds fewer than --num_class_images images (the base makes the
    rest)."""
    return config.class_images_to_generate and missing_class_images(config.class_data_dir, config.num_class_images) > 0


def _generate_class_images(config: ZImageLoraConfig, spec: DitLora, text_cache: Any, device: torch.device) -> None:
    """The missing class images, made within the run's plan (:mod:`~dreamstep.models.class_images`): the class prompt
    (and the empty prompt, for the base's guidance) encoded first, then the transformer loaded as the run trains it
    (--base_quantization, --blocks_to_swap) drawing with the base's own steps and guidance; all dropped on return."""
    source = config.pretrained_model_name_or_path
    base = zi.load_encoders(source, revision=config.revision, variant=config.variant,
                            mixed_precision=config.mixed_precision,
                            text_encoder_quantization=config.text_encoder_quantization, kind=spec.kind,
                            pipeline_options=spec.pipeline_options)
    conditioner = spec.conditioner_class(base, latent_cache=None, text_cache=text_cache,
                                         max_sequence_length=config.max_sequence_length, device=device)
    sampling = spec.distilled_sampling if spec.is_distilled(source) else spec.base_sampling
    text = encode_class_prompt(base, device, ("text_encoder",), lambda: {
        "class": conditioner.prompts([config.class_prompt]),
        "negative": conditioner.prompts([""]) if sampling["guidance_scale"] > 0 else None})
    transformer = zi.load_transformer(source, revision=config.revision, variant=config.variant,
                                      mixed_precision=config.mixed_precision, device=device,
                                      base_quantization=config.base_quantization, on_host=config.blocks_to_swap > 0,
                                      kind=spec.kind)
    say_before_the_run(f"generating class images of '{config.class_prompt}' in {config.class_data_dir}")
    with denoising_within_plan(base, transformer, device, config.blocks_to_swap):
        pipe = base.pipeline(transformer)

        def make(count: int, generator: torch.Generator) -> list[Image.Image]:
            return spec.generate(pipe, [config.class_prompt] * count, seed=generator.initial_seed(),
                                 steps=sampling["steps"], guidance_scale=sampling["guidance_scale"],
                                 width=config.resolution, height=config.resolution,
                                 embeddings={config.class_prompt: text["class"]}, negative=text["negative"])

        fill_class_folder(config.class_data_dir, config.num_class_images, make, batch_size=config.sample_batch_size,
                          seed=config.seed)


class _Sampler:
    """The validation samples: the prompt's caption features (and the empty prompt's, for guidance) encoded now,
    drawn later by the base's transformer carrying the LoRA, or with ``--validation_model_path`` by that checkpoint's
    weights swapped into it for the draw (same architecture; the LoRA layers stay) and its scheduler."""

    def __init__(self, config: ZImageLoraConfig, base: zi.ZImageComponents, conditioner: zi.ZImageConditioner,
                 spec: DitLora):
        self.config = config
        self.base = base
        self.spec = spec
        self.model = config.validation_model_path or config.pretrained_model_name_or_path
        recommended = spec.distilled_sampling if spec.is_distilled(self.model) else spec.base_sampling
        self.steps = config.validation_inference_steps or recommended["steps"]
        self.guidance = (config.validation_guidance_scale if config.validation_guidance_scale is not None
                         else recommended["guidance_scale"])
        self.embeddings = {config.validation_prompt: conditioner.prompts([config.validation_prompt])}
        self.negative = conditioner.prompts([""]) if self.guidance > 0 else None
        self.weights: dict[str, torch.Tensor] | None = None
        self.scheduler = base.scheduler
        if config.validation_model_path is not None:
            other, self.scheduler = zi.load_sampling_model(config.validation_model_path, revision=None, variant=None,
                                                           mixed_precision=config.mixed_precision, kind=spec.kind)
            self.weights = other.state_dict()

    def __call__(self, transformer: torch.nn.Module, size: tuple[int, int]) -> list[Image.Image]:
        was_training = transformer.training
        transformer.eval()
        try:
            with self._weights_of_the_validation_model_path(transformer):
                pipe = self.base.pipeline(transformer, self.scheduler)
                if "is_distilled" in pipe.config:  # Krea 2 samples a distilled model with its fixed shift
                    pipe.register_to_config(is_distilled=self.spec.is_distilled(self.model))
                images = self.spec.generate(pipe, [self.config.validation_prompt] * self.config.num_validation_images,
                                     seed=self.config.seed, steps=self.steps, guidance_scale=self.guidance,
                                     width=size[0], height=size[1], embeddings=self.embeddings,
                                     negative=self.negative)
        finally:
            transformer.train(was_training)
        for image in images:
            image.info[JSON_KEY]["model"] = self.model
        return images

    @contextlib.contextmanager
    def _weights_of_the_validation_model_path(self, transformer: torch.nn.Module) -> Iterator[None]:
        """The validation model's frozen weights in the transformer's place (each on the device its own is on, so
        swapped blocks stay swapped), the base's back afterwards."""
        if self.weights is None:
            yield
            return
        kept = {}
        for name, param in _base_parameters(transformer):
            kept[name] = param.data
            param.data = self.weights[name].to(param.device, param.dtype)
        try:
            yield
        finally:
            for name, param in _base_parameters(transformer):
                param.data = kept[name]

    def labelled(self, images: list[Image.Image]) -> list[Image.Image]:
        """With --validation_model_path, each sample with a band that names the model that drew it (the grid's PNG
        text names it in any case)."""
        if self.config.validation_model_path is None:
            return images
        return [_with_band(image, f"drawn by {Path(self.model).name} + LoRA") for image in images]


def _base_parameters(transformer: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The frozen base weights under their names in an unadapted transformer's state dict (peft's wrapped layers
    keep theirs under ``base_layer``)."""
    for name, param in transformer.named_parameters():
        if not param.requires_grad:
            yield name.replace(".base_layer.", "."), param


def _with_band(image: Image.Image, text: str) -> Image.Image:
    banded = Image.new("RGB", (image.width, image.height + 12), "white")
    banded.paste(image, (0, 0))
    ImageDraw.Draw(banded).text((2, image.height), text, fill="black")
    banded.info = dict(image.info)
    return banded
