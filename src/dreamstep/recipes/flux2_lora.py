"""FLUX.2 [klein] LoRA: ``dreamstep train flux2-lora``, the step of diffusers' ``train_dreambooth_lora_flux2_klein.py``
and, with condition images, of ``train_dreambooth_lora_flux2_klein_img2img.py``.

Features: instance images with one prompt or per-image captions, prior preservation (class images made by the base
model when missing), a Kohya dataset TOML, a metadata table (``--dataset_name``, ``--image_column``,
``--caption_column``); reference editing from pairs (``--conditioning_data_dir``, ``--cond_image_column``, a TOML's
``conditioning_data_dir``): the condition image's tokens follow the target's with their own time coordinate. Every
caption is encoded by the Qwen3 text encoder (quantized with ``--text_encoder_quantization``) before the transformer
loads, then the encoder waits in host memory; latents (patchified, normalised by the VAE's batch-norm statistics)
are cached. LoRA on the transformer (``--lora_layers``), quantized base, block swap, gradient checkpointing, the
memory plan, EMA, resumable checkpoints, validation samples and evaluation.

Outputs in --output_dir: ``pytorch_lora_weights.safetensors`` (diffusers layout, what
``Flux2KleinPipeline.load_lora_weights`` reads), ``pytorch_lora_weights_comfyui.safetensors`` (Black Forest Labs'
module names, which ComfyUI and diffusers' FLUX.2 loader read; --save_kohya_format), ``samples/``,
``loss_curve.png``, TensorBoard event files, ``checkpoint-N/``, ``cache/`` and ``config.toml``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from inspect import signature
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from dreamstep.config.flux2_lora import Flux2LoraConfig
from dreamstep.config.schema import config_to_toml, refuse_unused
from dreamstep.data.cache import TensorCache
from dreamstep.data.dataset import BucketDataset, ConditionedBatches
from dreamstep.data.dataset_config import DatasetConfig
from dreamstep.data.edit_pairs import edit_pair_datasets
from dreamstep.data.holdout import build_split_datasets, subject_image_paths
from dreamstep.data.sources import dreambooth_datasets
from dreamstep.engine.fit import FinishedRun, finish, fit_from_options, hooks_from_options
from dreamstep.engine.logging import say_before_the_run
from dreamstep.engine.plan import check_optimization, loader_and_plan
from dreamstep.engine.run import claim_output_dir, start_run
from dreamstep.engine.summary import print_run_summary
from dreamstep.evaluation.evaluator import build_evaluator, held_out_loss_of, load_scorer
from dreamstep.lora.convert import convert_lora
from dreamstep.lora.inject import TrainableState, save_flux_lora
from dreamstep.lora.training import prepare_lora_training
from dreamstep.models import parking
from dreamstep.models.class_images import (
    denoising_within_plan,
    encode_class_prompt,
    fill_class_folder,
    make_class_images,
    missing_class_images,
)
from dreamstep.models.flux2 import plumbing as flux2
from dreamstep.models.flux2.family import FAMILY
from dreamstep.models.flux2.generation import sampling_defaults
from dreamstep.models.flux2.lora_targets import flux2_lora_targets
from dreamstep.models.flux2.step import Flux2Step
from dreamstep.models.plans import RunPlan, print_run_plan
from dreamstep.png_text import JSON_KEY, sample_parameters

COMMAND = "train flux2-lora"
FOLDER_FLAG = "instance_data_dir"  # the flag an image folder is read from (the dashboard's dataset check)
COMFYUI_WEIGHT_NAME = "pytorch_lora_weights_comfyui.safetensors"
EMA_WEIGHT_NAME = "pytorch_lora_weights_ema.safetensors"


def training_datasets(config: Flux2LoraConfig) -> list[DatasetConfig]:
    """What the run trains on: pairs (condition folder, table column, or a TOML's conditioning_data_dir) as Kontext
    reads them, else DreamBooth folders (with the class folder once it holds --num_class_images images) or a
    dataset TOML."""
    if config.paired or config.dataset_name is not None or _toml_has_pairs(config):
        return edit_pair_datasets(config)
    class_dir = config.class_data_dir if config.with_prior_preservation and not _class_images_missing(config) else None
    return dreambooth_datasets(config, class_dir, COMMAND)


def plan_inputs(config: Flux2LoraConfig, datasets: list[DatasetConfig], encodes_in_the_loop: bool) -> RunPlan:
    """The memory plan's inputs; with condition images the transformer reads twice the image tokens. Class images
    still to make add their phase."""
    paired = datasets[0].method == "controlnet"
    options = flux2.plan_options(config, datasets, encoders_on_device=not config.cache_latents or encodes_in_the_loop,
                                 image_token_multiplier=2 if paired else 1)
    if config.with_prior_preservation and _class_images_missing(config):
        options = replace(options, class_images_batch=config.sample_batch_size)
    return RunPlan(FAMILY.name, config.pretrained_model_name_or_path, options, {"lora_layers": config.lora_layers})


def build_step(config: Flux2LoraConfig, model: nn.Module, scheduler: Any, guidance_embeds: bool,
               **engine_options: Any) -> Flux2Step:
    """The run's step: ``model`` (the LoRA'd transformer, or DDP's wrap of it) with the base ``scheduler``'s σ
    table; ``engine_options``: :class:`~dreamstep.engine.train_step.TrainStep`'s and ``prior_loss_weight`` (without
    an optimizer the step only evaluates)."""
    return Flux2Step(model, sigmas=flux2.training_sigmas(scheduler), objective=config.flow_matching_objective(),
                     guidance_scale=config.guidance_scale if guidance_embeds else None, **engine_options)


def held_out_loss(config: Flux2LoraConfig, held_out: BucketDataset, pipeline: Any, text_cache: TensorCache,
                  device: torch.device) -> Callable[[nn.Module | None], float]:
    """The validation loss the run logged, for ``dreamstep eval``: of ``pipeline`` (the base, with the LoRA eval
    applied to its transformer) on the images the run held out, encoded once, scored by the run's step at the
    same fixed noise levels and draws."""
    conditioner = flux2.Flux2Conditioner(pipeline, latent_cache=None, text_cache=text_cache,
                                         max_sequence_length=config.max_sequence_length, device=device,
                                         text_encoder_out_layers=_layers(config))

    def step_for(_: nn.Module | None) -> tuple[Any, list[nn.Module]]:
        transformer = pipeline.transformer
        return build_step(config, transformer, pipeline.scheduler, transformer.config.guidance_embeds,
                          optimizer=None).validation_loss_at, [transformer]

    return held_out_loss_of(held_out, conditioner, seed=config.seed, device=device,
                            mixed_precision=config.mixed_precision, step_for=step_for)


def train(config: Flux2LoraConfig) -> FinishedRun | None:
    """Train as configured; return what was written where (nothing with --dry_run)."""
    # 1. Check and plan: the base, every flag, folder and image and the optimizer, before a model loads.
    source = config.pretrained_model_name_or_path
    flux2.model_index(source)
    claim_output_dir(config.output_dir, overwrite=config.overwrite_output_dir,
                     resume_from_checkpoint=config.resume_from_checkpoint, config_toml=config_to_toml(config),
                     resume_must_match=config.resume_must_match)
    check_optimization(**config.optimization())
    generate_class = config.with_prior_preservation and _class_images_missing(config)
    datasets = training_datasets(config)
    latent_cache, text_cache = _caches(config, datasets)
    dataset, held_out = build_split_datasets(datasets, config.seed, config.validation_split,
                                             latent_cache=latent_cache, text_cache=text_cache)
    scorer = load_scorer(config)
    flux2.check_text_layers(source, config.revision, config.text_encoder_out_layers)
    guidance_embeds = flux2.transformer_config(source, config.revision, config.blocks_to_swap)["guidance_embeds"]
    if not guidance_embeds and not config.validation_prompt and not generate_class:
        refuse_unused(config, ("guidance_scale",), "for a base without guidance embedding ([klein]) when nothing is "
                                                   "sampled (no --validation_prompt, no class images to make)")
    print_run_plan(plan_inputs(config, datasets, dataset.encodes_in_the_loop()), config.device_memory)
    if config.dry_run:
        return None
    run = start_run(config.output_dir, mixed_precision=config.mixed_precision, seed=config.seed,
                    report_to=config.report_to, resume_from_checkpoint=config.resume_from_checkpoint,
                    config_toml=config_to_toml(config), command=f"dreamstep {COMMAND}",
                    overwrite=config.overwrite_output_dir, allow_tf32=config.allow_tf32)

    # 2. Class images (the plan's "class images" phase): the base makes the missing ones as the run will train it
    # (quantized, swapped), from the class prompt's embeddings; all is freed before the run loads its own models.
    if generate_class:
        make_class_images(run, lambda: _generate_class_images(config, run.device))
        datasets = training_datasets(config)
        dataset, held_out = build_split_datasets(datasets, config.seed, config.validation_split,
                                                 latent_cache=latent_cache, text_cache=text_cache)

    # 3. Data: bucketed samples read through the caches; the step counts.
    loader, plan = loader_and_plan(run, dataset, seed=config.seed, num_workers=config.dataloader_num_workers,
                                   **config.step_counts())
    run.config_toml = config.resolved_toml(plan.num_epochs)

    # 4. Encode: the VAE then the Qwen3 encoder fill the caches (every caption, image and validation prompt) before
    # the transformer loads; then both wait in host memory.
    pipeline = flux2.load_encoders_for_training(source, revision=config.revision, variant=config.variant,
                                                mixed_precision=config.mixed_precision,
                                                text_encoder_quantization=config.text_encoder_quantization)
    conditioner = flux2.Flux2Conditioner(pipeline, latent_cache=latent_cache, text_cache=text_cache,
                                         max_sequence_length=config.max_sequence_length, device=run.device,
                                         text_encoder_out_layers=_layers(config))
    prompts = [config.validation_prompt] * config.num_validation_images if config.validation_prompt else []
    parking.encode_run(conditioner, dataset, held_out, epochs=plan.num_epochs)
    embeddings = flux2.prompt_embeddings(conditioner, prompts + [config.validation_negative_prompt] * bool(prompts))
    encoders = flux2.park_encoders(pipeline, run.device,
                                   latents_cached=latent_cache is not None and not dataset.encodes_in_the_loop())
    batches = ConditionedBatches(loader, conditioner)

    # 5. Load: the transformer frozen in the --mixed_precision dtype (quantized as asked); LoRA weights in fp32.
    transformer = flux2.load_transformer_for_training(
        pipeline, source, revision=config.revision, variant=config.variant, mixed_precision=config.mixed_precision,
        device=run.device, base_quantization=config.base_quantization, on_host=config.blocks_to_swap > 0)
    targets = flux2_lora_targets(transformer, config.lora_layers)
    training = prepare_lora_training(transformer, targets, config, run, plan)
    model, optimizer, lr_scheduler, ema = training.model, training.optimizer, training.lr_scheduler, training.ema

    # 6. Step: the optimizer over the LoRA weights, the LR schedule, clipping, accumulation.
    step = build_step(config, model, pipeline.scheduler, guidance_embeds, optimizer=optimizer,
                      lr_scheduler=lr_scheduler, accelerator=run.accelerator, ema=ema,
                      max_grad_norm=config.max_grad_norm or None,
                      gradient_accumulation_steps=config.gradient_accumulation_steps, length_of_dataloader=len(loader),
                      prior_loss_weight=config.prior_loss_weight if _has_prior(dataset) else None)
    print_run_summary(run, dataset, plan, gradient_accumulation_steps=config.gradient_accumulation_steps,
                      mixed_precision=config.mixed_precision, trainable=(transformer,),
                      caches={"latents": latent_cache, "text": text_cache}, outputs=config.output_dir,
                      tokenizers={"Qwen3": (pipeline.tokenizer, config.max_sequence_length)})

    # 7. Loop: the engine trains, checkpoints and validates; validation images bring back only the VAE.
    evaluator = build_evaluator(config, scorer, held_out=held_out, conditioner=conditioner,
                                loss_at=step.validation_loss_at, modules=[model], seed=config.seed,
                                subject_images=subject_image_paths(dataset, held_out), device=run.device)

    def sample(global_step: int) -> list[Image.Image]:
        with encoders.on_device("vae"):
            return _validation_images(config, pipeline, datasets[0].buckets.resolution, embeddings)

    hooks = hooks_from_options(config, sample=sample if prompts else None,
                               score=(lambda _, images: evaluator(images, prompts)) if evaluator is not None else None,
                               ema=ema)
    result = fit_from_options(run, step, batches, config, total_steps=plan.total_steps,
                              trained=TrainableState({"transformer": transformer}), ema=ema, hooks=hooks)

    # 8. Save: the diffusers layout, the ComfyUI layout, final samples and scores, loss curve, summary.
    written: dict[str, Path] = {}
    if run.is_main_process:
        written["LoRA (diffusers)"] = save_flux_lora(config.output_dir, transformer)
        if ema is not None:
            with ema.swapped_in():
                written["LoRA (EMA)"] = save_flux_lora(config.output_dir, transformer, weight_name=EMA_WEIGHT_NAME)
        if config.save_kohya_format:
            comfy = Path(config.output_dir) / COMFYUI_WEIGHT_NAME
            convert_lora(written["LoRA (diffusers)"], comfy, to="kohya", model=FAMILY.name, overwrite=True)
            written["LoRA (ComfyUI)"] = comfy
    return finish(run, written, result, hooks, best_by=config.best_metric(held_out is not None))


def _caches(config: Flux2LoraConfig, datasets: list[DatasetConfig]) -> tuple[Any, Any]:
    image_dirs = [folder for dataset in datasets for subset in dataset.subsets
                  for folder in (subset.image_dir, subset.conditioning_data_dir) if folder is not None]
    return flux2.training_caches(config.cache_root(), config.pretrained_model_name_or_path, revision=config.revision,
                                 variant=config.variant, mixed_precision=config.mixed_precision,
                                 max_sequence_length=config.max_sequence_length,
                                 text_encoder_out_layers=_layers(config),
                                 cache_latents=config.cache_latents, image_dirs=image_dirs)


def _layers(config: Flux2LoraConfig) -> tuple[int, ...] | None:
    return tuple(config.text_encoder_out_layers) if config.text_encoder_out_layers else None


def _toml_has_pairs(config: Flux2LoraConfig) -> bool:
    if config.dataset_config is None:
        return False
    from dreamstep.config.schema import load_toml

    found = load_toml(config.dataset_config, "--dataset_config")
    return any("conditioning_data_dir" in subset for dataset in found.get("datasets", [])
               for subset in dataset.get("subsets", []))


def _has_prior(dataset: Any) -> bool:
    return any(record.subset.is_reg for record in dataset.records)


def _class_images_missing(config: Flux2LoraConfig) -> bool:
    """Whether the class folder holds fewer than --num_class_images images (the base model makes the rest)."""
    return bool(config.class_data_dir) and missing_class_images(config.class_data_dir, config.num_class_images) > 0


def _generate_class_images(config: Flux2LoraConfig, device: torch.device) -> None:
    """The missing class images, made within the run's plan (:mod:`~dreamstep.models.class_images`): the class
    prompt (and the empty negative prompt of the base models' guidance) encoded first, then the transformer loaded as
    the run trains it (--base_quantization, --blocks_to_swap) denoising from those embeddings; all dropped on
    return."""
    source = config.pretrained_model_name_or_path
    pipeline = flux2.load_encoders_for_training(source, revision=config.revision, variant=config.variant,
                                                mixed_precision=config.mixed_precision,
                                                text_encoder_quantization=config.text_encoder_quantization)
    prompts = [config.class_prompt] + [""] * ("negative_prompt_embeds" in signature(pipeline.__call__).parameters)
    embeddings = encode_class_prompt(pipeline, device, ("text_encoder",), lambda: [flux2.encode_prompts(
        pipeline, [prompt], config.max_sequence_length, _layers(config))["prompt_embeds"] for prompt in prompts])
    flux2.load_transformer_for_training(pipeline, source, revision=config.revision, variant=config.variant,
                                        mixed_precision=config.mixed_precision, device=device,
                                        base_quantization=config.base_quantization, on_host=config.blocks_to_swap > 0)
    say_before_the_run(f"generating class images of '{config.class_prompt}' in {config.class_data_dir}")
    steps = sampling_defaults(pipeline, [])["steps"]  # the base's own: 4 distilled, else 50
    with denoising_within_plan(pipeline, pipeline.transformer, device, config.blocks_to_swap):
        view = type(pipeline)(**{**pipeline.components, "text_encoder": None})
        view.set_progress_bar_config(disable=True)
        text = [e.to(view._execution_device, pipeline.transformer.dtype) for e in embeddings]

        def make(count: int, generator: torch.Generator) -> list[Image.Image]:
            batch = dict(zip(("prompt_embeds", "negative_prompt_embeds"), (e.expand(count, -1, -1) for e in text)))
            return view(**batch, guidance_scale=config.guidance_scale, height=config.resolution,
                        width=config.resolution, num_inference_steps=steps, generator=generator).images

        fill_class_folder(config.class_data_dir, config.num_class_images, make, batch_size=config.sample_batch_size,
                          seed=config.seed)


@torch.no_grad()
def _validation_images(config: Flux2LoraConfig, pipeline: Any, size: tuple[int, int],
                       embeddings: dict[str, dict[str, torch.Tensor]]) -> list[Image.Image]:
    """Samples at the training resolution ``size`` (width, height) from the prompt's cached embeddings (and the
    negative prompt's, for the base models' guidance), each seeded ``seed + i``."""
    was_training = pipeline.transformer.training
    pipeline.transformer.eval()
    dtype = pipeline.transformer.dtype
    positive = embeddings[config.validation_prompt]["prompt_embeds"].to(dtype)
    negative = embeddings[config.validation_negative_prompt]["prompt_embeds"].to(dtype)
    images = []
    for i in range(config.num_validation_images):
        image = pipeline(prompt_embeds=positive, negative_prompt_embeds=negative, height=size[1], width=size[0],
                         num_inference_steps=config.validation_inference_steps, guidance_scale=config.guidance_scale,
                         generator=torch.Generator("cpu").manual_seed(config.seed + i)).images[0]
        image.info[JSON_KEY] = sample_parameters(pipeline, prompt=config.validation_prompt, seed=config.seed + i,
                                                 steps=config.validation_inference_steps,
                                                 guidance_scale=config.guidance_scale, width=size[0], height=size[1])
        images.append(image)
    pipeline.transformer.train(was_training)
    return images
