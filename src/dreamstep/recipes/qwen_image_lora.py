"""Qwen-Image DreamBooth LoRA: ``dreamstep train qwen-image-lora``.

Features: instance images with one prompt or per-image captions (``--caption_extension``), or a Kohya dataset TOML
(``--dataset_config``); prior preservation with the class images of ``--class_data_dir``; LoRA on the transformer
(``--lora_layers``: attention (the script's to_k, to_q, to_v, to_out.0), attention+ff, all-linear, or module
names); sd-scripts' caption flags; the flow-matching loss of diffusers' ``train_dreambooth_lora_qwen_image.py``
(σ from the scheduler's table, the SD3 weighting schemes, 5-D latents normalised by the VAE's latents mean / std,
the prompt mask), sd-scripts' ``--timestep_sampling`` and ``--loss_type``; every caption encoded by the Qwen2.5-VL
(quantized with ``--text_encoder_quantization``) before the transformer loads, and the encoder then dropped;
quantized base (``--base_quantization``), block swap, gradient checkpointing; mixed precision; an EMA;
resumable checkpoints; validation samples (true CFG with the empty negative prompt), validation loss and scores.

Outputs in --output_dir: ``pytorch_lora_weights.safetensors`` (diffusers layout, what
``QwenImagePipeline.load_lora_weights`` reads), ``pytorch_lora_weights_comfyui.safetensors`` (ComfyUI's
``diffusion_model.transformer_blocks...`` names), with --save_kohya_format
``pytorch_lora_weights_kohya.safetensors`` (``lora_unet_transformer_blocks_0_attn_to_q``), with --ema_decay
``pytorch_lora_weights_ema.safetensors``, ``samples/``, ``loss_curve.png``, evaluation tables, TensorBoard event
files, ``checkpoint-N/``, ``cache/`` and ``config.toml``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from inspect import signature
from pathlib import Path
from typing import Any, NamedTuple

import torch
from PIL import Image

from dreamstep.config.qwen_image_lora import QwenImageLoraConfig
from dreamstep.config.schema import config_to_toml
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
from dreamstep.lora.comfyui_files import (
    EMA_WEIGHT_NAME,
    KOHYA_WEIGHT_NAME,
    LORA_WEIGHT_NAME,
    save_comfyui_lora,
)
from dreamstep.lora.convert import convert_lora
from dreamstep.lora.inject import TrainableState, save_flux_lora
from dreamstep.lora.training import prepare_lora_training
from dreamstep.models import memory_plan as mp
from dreamstep.models.class_images import (
    denoising_within_plan,
    encode_class_prompt,
    fill_class_folder,
    make_class_images,
    missing_class_images,
)
from dreamstep.models.plans import RunPlan, plan_report
from dreamstep.models.qwen_image import plumbing as qwen
from dreamstep.models.qwen_image.family import FAMILY
from dreamstep.models.qwen_image.lora_targets import qwen_image_lora_targets
from dreamstep.models.qwen_image.step import QwenImageFlowMatchingStep

COMMAND = "train qwen-image-lora"
FOLDER_FLAG = "instance_data_dir"  # the flag an image folder is read from (the dashboard's dataset check)


class QwenImageLoraStep(QwenImageFlowMatchingStep):
    """diffusers' DreamBooth LoRA step: the transformer predicts the velocity of the target's tokens."""

    def predict(self, model: torch.nn.Module, inputs: dict[str, Any], batch: dict[str, Any],
                condition: None) -> torch.Tensor:
        return model(**inputs, return_dict=False)[0]


def training_datasets(config: QwenImageLoraConfig) -> list[DatasetConfig]:
    """The instance (and, once it holds --num_class_images images, class) folders or the dataset TOML, checked image
    by image before a model loads."""
    prior = config.with_prior_preservation and config.dataset_config is None
    class_dir = config.class_data_dir if prior and not _class_images_missing(config) else None
    return dreambooth_datasets(config, class_dir, COMMAND)


def plan_inputs(config: QwenImageLoraConfig, dataset_configs: list[DatasetConfig],
                encodes_in_the_loop: bool) -> RunPlan:
    """The memory plan's inputs; ``encodes_in_the_loop``: the loop encodes random crops itself. Class images still
    to make add their phase."""
    options = qwen.plan_options(config, dataset_configs, validation_images=bool(config.validation_prompt),
                                encoders_on_device=not config.cache_latents or encodes_in_the_loop)
    if _class_images_missing(config):
        options = replace(options, class_images_batch=config.sample_batch_size)
    return RunPlan(FAMILY.name, config.pretrained_model_name_or_path, options, {"lora_layers": config.lora_layers})


class LoraTransformer(NamedTuple):
    """The loaded transformer with its LoRA, what the accelerator prepared (``model``, ``optimizer``), the schedule
    and the EMA."""

    transformer: torch.nn.Module
    model: torch.nn.Module
    optimizer: Any
    lr_scheduler: Any
    ema: Any | None
    accelerator: Any

    def step_options(self, config: Any, pipeline: Any, length_of_dataloader: int) -> dict[str, Any]:
        """The flow-matching step's options every Qwen-Image recipe passes."""
        return dict(optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, accelerator=self.accelerator,
                    ema=self.ema, max_grad_norm=config.max_grad_norm or None,
                    gradient_accumulation_steps=config.gradient_accumulation_steps,
                    length_of_dataloader=length_of_dataloader, **flow_options(config, pipeline))


def flow_options(config: Any, pipeline: Any) -> dict[str, Any]:
    """The flow-matching step's σ table (``pipeline``'s scheduler's) and objective, as every Qwen-Image recipe
    sets them."""
    return {"sigmas": qwen.training_sigmas(pipeline.scheduler), "objective": config.flow_matching_objective()}


def held_out_loss(config: QwenImageLoraConfig, held_out: BucketDataset, pipeline: Any, text_cache: TensorCache,
                  device: torch.device) -> Callable[[torch.nn.Module | None], float]:
    """The validation loss the run logged, for ``dreamstep eval``: of ``pipeline`` (the base, with the LoRA eval
    applied to its transformer) on the images the run held out, encoded once, scored by the run's step at the
    same fixed noise levels and draws."""
    conditioner = qwen.QwenImageConditioner(pipeline, latent_cache=None, text_cache=text_cache,
                                            max_sequence_length=config.max_sequence_length, device=device)

    def step_for(_: torch.nn.Module | None) -> tuple[Any, list[torch.nn.Module]]:
        transformer = pipeline.transformer
        step = QwenImageLoraStep(transformer, optimizer=None, prior_loss_weight=config.prior_loss_weight,
                                 **flow_options(config, pipeline))
        return step.validation_loss_at, [transformer]

    return held_out_loss_of(held_out, conditioner, seed=config.seed, device=device,
                            mixed_precision=config.mixed_precision, step_for=step_for)


def load_lora_transformer(config: Any, source: str, pipeline: Any, run: Any, plan: Any) -> LoraTransformer:
    """The "load" phase and what trains: the transformer frozen in the --mixed_precision dtype (quantized as asked,
    its blocks swapped and checkpointed as asked) with a LoRA in fp32 on --lora_layers, set into ``pipeline``; the
    optimizer over the LoRA weights and its schedule; the EMA; prepared by the run's accelerator."""
    transformer = qwen.load_transformer_for_training(
        source, revision=config.revision, variant=config.variant, mixed_precision=config.mixed_precision,
        device=run.device, base_quantization=config.base_quantization, on_host=config.blocks_to_swap > 0)
    pipeline.register_modules(transformer=transformer)
    targets = qwen_image_lora_targets(transformer, config.lora_layers)
    training = prepare_lora_training(transformer, targets, config, run, plan)
    model, optimizer, lr_scheduler, ema = training.model, training.optimizer, training.lr_scheduler, training.ema
    return LoraTransformer(transformer, model, optimizer, lr_scheduler, ema, run.accelerator)


def print_plan(run_plan: RunPlan, device_memory: str | None) -> None:
    """The run's memory plan, before any model loads (the base was checked by :func:`qwen.check_base`)."""
    memory = mp.parse_bytes(device_memory, "--device_memory") if device_memory else mp.detected_device_memory()
    say_before_the_run(plan_report(run_plan.estimator(), run_plan.options, memory))


def train(config: QwenImageLoraConfig) -> FinishedRun | None:
    """Train as configured; return what was written where (nothing with --dry_run)."""
    # 1. Check and plan: the base, every flag, folder and image, and the optimizer, before a model loads.
    source = qwen.check_base(config.pretrained_model_name_or_path)
    claim_output_dir(config.output_dir, overwrite=config.overwrite_output_dir,
                     resume_from_checkpoint=config.resume_from_checkpoint, config_toml=config_to_toml(config),
                     resume_must_match=config.resume_must_match)
    check_optimization(**config.optimization())
    generate_class = _class_images_missing(config)
    datasets = training_datasets(config)
    latent_cache, text_cache = qwen.training_caches(config, datasets)
    dataset, held_out = build_split_datasets(datasets, config.seed, config.validation_split,
                                             latent_cache=latent_cache, text_cache=text_cache)
    scorer = load_scorer(config)
    # --blocks_to_swap and --lora_layers checked against the transformer before anything is encoded.
    qwen_image_lora_targets(qwen.meta_transformer(config), config.lora_layers)
    print_plan(plan_inputs(config, datasets, dataset.encodes_in_the_loop()), config.device_memory)
    if config.dry_run:
        return None
    run = start_run(config.output_dir, mixed_precision=config.mixed_precision, seed=config.seed,
                    report_to=config.report_to, resume_from_checkpoint=config.resume_from_checkpoint,
                    config_toml=config_to_toml(config), command=f"dreamstep {COMMAND}",
                    overwrite=config.overwrite_output_dir, allow_tf32=config.allow_tf32)

    # 2. Class images (the plan's "class images" phase): the base makes the missing ones as the run will train it
    # (quantized, swapped), from the class prompt's embedding; all is freed before the run loads its own models.
    if generate_class:
        make_class_images(run, lambda: _generate_class_images(config, source, run.device))
        datasets = training_datasets(config)
        dataset, held_out = build_split_datasets(datasets, config.seed, config.validation_split,
                                                 latent_cache=latent_cache, text_cache=text_cache)

    # 3. Data: bucketed samples, posteriors and prompt embeddings from the content-keyed caches; the step counts.
    loader, plan = loader_and_plan(run, dataset, seed=config.seed, num_workers=config.dataloader_num_workers,
                                   **config.step_counts())
    run.config_toml = config.resolved_toml(plan.num_epochs)

    # 4. Encode: the VAE, then the Qwen2.5-VL, encode every image, caption and validation prompt before the
    # transformer loads; then the Qwen2.5-VL is dropped and the VAE waits in host memory (it stays on the device when
    # latents are not cached).
    pipeline = qwen.load_encoders_for_training(source, revision=config.revision, variant=config.variant,
                                               mixed_precision=config.mixed_precision,
                                               text_encoder_quantization=config.text_encoder_quantization)
    conditioner = qwen.QwenImageConditioner(pipeline, latent_cache=latent_cache, text_cache=text_cache,
                                            max_sequence_length=config.max_sequence_length, device=run.device)
    prompts = [config.validation_prompt] * config.num_validation_images if config.validation_prompt else []
    qwen.encode_run(conditioner, dataset, held_out, epochs=plan.num_epochs)
    embeddings = qwen.prompt_embeddings(conditioner, prompts + [""] if prompts else [])
    encoders = qwen.free_text_encoder_and_park_vae(
        pipeline, run.device, latents_cached=latent_cache is not None and not dataset.encodes_in_the_loop())

    # 5. Load, and the step: the transformer frozen in the --mixed_precision dtype (quantized as asked) with its LoRA
    # in fp32; AdamW/8-bit/Prodigy over the LoRA weights, the LR schedule, clipping, accumulation.
    lora = load_lora_transformer(config, source, pipeline, run, plan)
    batches = ConditionedBatches(loader, conditioner)
    transformer, model, ema = lora.transformer, lora.model, lora.ema
    step = QwenImageLoraStep(model, **lora.step_options(config, pipeline, len(loader)),
                             prior_loss_weight=config.prior_loss_weight)
    print_run_summary(run, dataset, plan, gradient_accumulation_steps=config.gradient_accumulation_steps,
                      mixed_precision=config.mixed_precision, trainable=(transformer,),
                      caches={"latents": latent_cache, "text": text_cache}, outputs=config.output_dir,
                      tokenizers={"Qwen2.5-VL": (pipeline.tokenizer, config.max_sequence_length)})

    # 6. Loop: the engine trains, checkpoints and validates (samples, then the validation loss and scores).
    evaluator = build_evaluator(config, scorer, held_out=held_out, conditioner=conditioner,
                                loss_at=step.validation_loss_at, modules=[model], seed=config.seed,
                                subject_images=subject_image_paths(dataset, held_out), device=run.device)

    def sample(global_step: int) -> list[Image.Image]:
        with encoders.on_device("vae"):
            return validation_images(config, pipeline, datasets[0].buckets.resolution, embeddings)

    hooks = hooks_from_options(config, sample=sample if prompts else None,
                               score=(lambda _, images: evaluator(images, prompts)) if evaluator is not None else None,
                               ema=ema)
    trained = TrainableState({"transformer": transformer})
    result = fit_from_options(run, step, batches, config, total_steps=plan.total_steps,
                              trained=trained, ema=ema, hooks=hooks)

    # 7. Save: diffusers' layout and ComfyUI's (and Kohya's, the EMA's), final samples and scores, the loss curve.
    written = save_loras(config, transformer, ema) if run.is_main_process else {}
    return finish(run, written, result, hooks, best_by=config.best_metric(held_out is not None))


def save_loras(config: Any, transformer: torch.nn.Module, ema: Any | None) -> dict[str, Path]:
    """The trained LoRA in diffusers' layout (what the Qwen pipelines' ``load_lora_weights`` read) and ComfyUI's,
    with --save_kohya_format sd-scripts' / musubi-tuner's names (``lora_unet_transformer_blocks_0_attn_to_q``), with
    --ema_decay the EMA's weights in diffusers' layout."""
    written = {"LoRA (diffusers)": save_flux_lora(config.output_dir, transformer, weight_name=LORA_WEIGHT_NAME),
               "LoRA (ComfyUI)": save_comfyui_lora(config.output_dir, transformer)}
    if ema is not None:
        with ema.swapped_in():
            written["LoRA (EMA)"] = save_flux_lora(config.output_dir, transformer, weight_name=EMA_WEIGHT_NAME)
    if config.save_kohya_format:
        kohya_path = Path(config.output_dir) / KOHYA_WEIGHT_NAME
        convert_lora(written["LoRA (diffusers)"], kohya_path, to="kohya", model=FAMILY.name, overwrite=True)
        written["LoRA (Kohya)"] = kohya_path
    return written


@torch.no_grad()
def validation_images(config: Any, pipeline: Any, size: tuple[int, int],
                      embeddings: dict[str, dict[str, Any]], **pipeline_kwargs: Any) -> list[Image.Image]:
    """Samples of --validation_prompt at the training resolution ``size`` (width, height), one generator per image
    (seed + i), from the cached embeddings (the empty prompt's as the negative one for true CFG)."""
    was_training = pipeline.transformer.training
    pipeline.transformer.eval()
    dtype = pipeline.transformer.dtype
    # The same modules without the text encoder (waiting in host memory): the pipeline computes where its
    # transformer and VAE are.
    pipeline = type(pipeline)(**{**pipeline.components, "text_encoder": None})
    pipeline.set_progress_bar_config(disable=True)
    text, negative = (_with_mask(embeddings[p], dtype) for p in (config.validation_prompt, ""))
    images = []
    for i in range(config.num_validation_images):
        images += pipeline(
            prompt_embeds=text["prompt_embeds"], prompt_embeds_mask=text["prompt_mask"],
            negative_prompt_embeds=negative["prompt_embeds"], negative_prompt_embeds_mask=negative["prompt_mask"],
            true_cfg_scale=config.true_cfg_scale, num_inference_steps=config.validation_inference_steps,
            width=size[0], height=size[1], generator=torch.Generator("cpu").manual_seed(config.seed + i),
            **pipeline_kwargs).images
    pipeline.transformer.train(was_training)
    return images


def _with_mask(text: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Cached embeddings as the pipelines take them: in the transformer's dtype, with a mask even where nothing is
    padding (they read an all-ones mask as none, and warn when there is none)."""
    embeds = text["prompt_embeds"].to(dtype)
    mask = text["prompt_mask"]
    return {"prompt_embeds": embeds,
            "prompt_mask": mask if mask is not None else torch.ones(embeds.shape[:2], dtype=torch.long,
                                                                      device=embeds.device)}


def _class_images_missing(config: QwenImageLoraConfig) -> bool:
    """Whether prior preservation's class folder holds fewer than --num_class_images images (the base makes the
    rest)."""
    prior = config.with_prior_preservation and config.dataset_config is None
    return prior and missing_class_images(config.class_data_dir, config.num_class_images) > 0


def _generate_class_images(config: QwenImageLoraConfig, source: str, device: torch.device) -> None:
    """The missing class images, made within the run's plan (:mod:`~dreamstep.models.class_images`): the class prompt
    encoded first, then the transformer loaded as the run trains it (--base_quantization, --blocks_to_swap) denoising
    from that embedding at --resolution with the pipeline's own steps and without a negative prompt (diffusers'
    script calls ``pipeline(prompt)``); all dropped on return."""
    pipeline = qwen.load_encoders_for_training(source, revision=config.revision, variant=config.variant,
                                               mixed_precision=config.mixed_precision,
                                               text_encoder_quantization=config.text_encoder_quantization)
    text = encode_class_prompt(pipeline, device, ("text_encoder",), lambda: qwen.encode_prompts(
        pipeline, [config.class_prompt], config.max_sequence_length))
    transformer = qwen.load_transformer_for_training(
        source, revision=config.revision, variant=config.variant, mixed_precision=config.mixed_precision,
        device=device, base_quantization=config.base_quantization, on_host=config.blocks_to_swap > 0)
    pipeline.register_modules(transformer=transformer)
    say_before_the_run(f"generating class images of '{config.class_prompt}' in {config.class_data_dir}")
    steps = signature(type(pipeline).__call__).parameters["num_inference_steps"].default
    with denoising_within_plan(pipeline, transformer, device, config.blocks_to_swap):
        view = type(pipeline)(**{**pipeline.components, "text_encoder": None})
        view.set_progress_bar_config(disable=True)
        length = int(text["prompt_mask"].sum())  # the prompt's own tokens, as the pipeline encodes it
        embeds = text["prompt_embeds"][:, :length].to(view._execution_device, transformer.dtype)
        mask = text["prompt_mask"][:, :length].to(view._execution_device)

        def make(count: int, generator: torch.Generator) -> list[Image.Image]:
            return view(prompt_embeds=embeds.expand(count, -1, -1), prompt_embeds_mask=mask.expand(count, -1),
                        height=config.resolution, width=config.resolution, num_inference_steps=steps,
                        generator=generator).images

        fill_class_folder(config.class_data_dir, config.num_class_images, make, batch_size=config.sample_batch_size,
                          seed=config.seed)
