"""FLUX.1 Kontext LoRA (image editing from before/after pairs): ``dreamstep train flux-kontext-lora``.

Features: pairs as two folders (``--instance_data_dir`` of "after" images + ``--conditioning_data_dir`` of the
same-named "before" images, instructions from caption files or ``--instance_prompt``), a metadata table
(``--dataset_name`` with ``--image_column``, ``--cond_image_column``, ``--caption_column``) or a Kohya dataset
TOML whose subsets have ``conditioning_data_dir``; without condition images, text-to-image Kontext training.
The step is diffusers' ``train_dreambooth_lora_flux_kontext.py``: the condition latents are packed and
concatenated to the noisy target's tokens with position ids offset in the first axis, the prediction is cut
back to the target's tokens, the flow-matching loss is on the target alone; latents are the VAE posterior's
mode (``--vae_encode_mode``). Both images share crop, flip and bucket; target and condition latents and
the instruction embeddings are cached. LoRA on the transformer (``--lora_layers``), quantized base, block swap,
encoders parked during the loop, the memory plan, resumable checkpoints, validation edits of
``--validation_image``, evaluation (validation loss on held-out pairs; CLIP-T of the instruction, DINO / CLIP-I
against the "after" images).

Outputs in --output_dir: ``pytorch_lora_weights.safetensors`` (diffusers layout, what
``FluxKontextPipeline.load_lora_weights`` reads), with --save_kohya_format also
``pytorch_lora_weights_kohya.safetensors``, ``samples/``, ``loss_curve.png``, evaluation tables, TensorBoard
event files, ``checkpoint-N/``, ``cache/`` and ``config.toml``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers import FluxKontextPipeline
from PIL import Image
from torch import nn

from dreamstep.config.flux_kontext_lora import FluxKontextLoraConfig
from dreamstep.config.schema import config_to_toml
from dreamstep.data.cache import TensorCache
from dreamstep.data.dataset import BucketDataset, ConditionedBatches
from dreamstep.data.dataset_config import DatasetConfig, describe_datasets
from dreamstep.data.edit_pairs import edit_pair_datasets, read_validation_image
from dreamstep.data.holdout import build_split_datasets, subject_image_paths
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
from dreamstep.models.flow_step import condition_latents
from dreamstep.models.flux import kontext
from dreamstep.models.flux import plumbing as flux
from dreamstep.models.flux.controlnet import side_by_side
from dreamstep.models.flux.family import FAMILY as FLUX
from dreamstep.models.flux.files import base_of
from dreamstep.models.flux.lora_targets import flux_lora_targets
from dreamstep.models.flux.step import FluxFlowMatchingStep
from dreamstep.models.plans import RunPlan, print_run_plan
from dreamstep.models.vae import posterior_mean, sample_latents

KOHYA_WEIGHT_NAME = "pytorch_lora_weights_kohya.safetensors"
EMA_WEIGHT_NAME = "pytorch_lora_weights_ema.safetensors"


class FluxKontextStep(FluxFlowMatchingStep):
    """diffusers' Kontext LoRA step: the condition image's packed tokens follow the noisy target's, with position
    ids offset in the first axis; the transformer predicts both, and only the target's tokens are kept. Both
    images' latents are their posterior's mode, or with ``vae_encode_mode="sample"`` one draw each."""

    def __init__(self, transformer: torch.nn.Module, *, vae_encode_mode: str, **options: Any):
        super().__init__(transformer, **options)
        self.draws = vae_encode_mode == "sample"

    def target(self, batch: dict[str, Any]) -> torch.Tensor:
        return sample_latents(batch["latent_dist"]) if self.draws else posterior_mean(batch["latent_dist"])

    def condition(self, batch: dict[str, Any], sample: bool) -> torch.Tensor | None:
        return condition_latents(batch, sample and self.draws) if "condition_dist" in batch else None

    def predict(self, transformer: torch.nn.Module, inputs: dict[str, Any], batch: dict[str, Any],
                condition: torch.Tensor | None) -> torch.Tensor:
        # (B, N + N', 4C) in, the target's N tokens out.
        prediction = transformer(**kontext.joined_inputs(inputs, condition), return_dict=False)[0]
        return kontext.target_prediction(prediction, inputs["hidden_states"].shape[1])


FOLDER_FLAG = "instance_data_dir"  # the flag an image folder is read from (the dashboard's dataset check)


def training_datasets(config: FluxKontextLoraConfig) -> list[DatasetConfig]:
    return edit_pair_datasets(config)


def plan_inputs(config: FluxKontextLoraConfig, dataset_configs: list[DatasetConfig],
                encodes_in_the_loop: bool) -> RunPlan:
    """The memory plan's inputs; ``encodes_in_the_loop``: the loop encodes random crops itself. The transformer
    reads the condition's tokens beside the target's: twice the image tokens of a pair."""
    paired = dataset_configs[0].method == "controlnet"
    return RunPlan(FLUX.name, base_of(config).source, flux.plan_options(
        config, dataset_configs, rank=config.rank, encoders_on_device=not config.cache_latents or encodes_in_the_loop,
        validation_images=bool(config.validation_prompt), image_token_multiplier=2 if paired else 1),
        {"lora_layers": config.lora_layers})


KONTEXT_BASE = "black-forest-labs/FLUX.1-Kontext-dev"


def build_step(config: FluxKontextLoraConfig, model: nn.Module, transformer: nn.Module, scheduler: Any,
               **engine_options: Any) -> FluxKontextStep:
    """The run's step: ``model`` (the LoRA'd transformer, or DDP's wrap of it) with the base ``scheduler``'s σ
    table; ``engine_options``: :class:`~dreamstep.engine.train_step.TrainStep`'s (without an optimizer the step
    only evaluates)."""
    return FluxKontextStep(model, sigmas=flux.training_sigmas(scheduler), objective=config.flow_matching_objective(),
                           vae_encode_mode=config.vae_encode_mode,
                           guidance_scale=config.guidance_scale if transformer.config.guidance_embeds else None,
                           **engine_options)


def held_out_loss(config: FluxKontextLoraConfig, held_out: BucketDataset, pipeline: Any, text_cache: TensorCache,
                  device: torch.device) -> Callable[[nn.Module | None], float]:
    """The validation loss the run logged, for ``dreamstep eval``: of ``pipeline`` (the base, with the LoRA eval
    applied to its transformer) on the pairs the run held out, encoded once, scored by the run's step at the
    same fixed noise levels and draws."""
    encoder = flux.FluxConditioner(pipeline, latent_cache=None, text_cache=text_cache,
                                   max_sequence_length=config.max_sequence_length, device=device)
    paired = training_datasets(config)[0].method == "controlnet"

    def step_for(_: nn.Module | None) -> tuple[Any, list[nn.Module]]:
        transformer = pipeline.transformer
        return build_step(config, transformer, transformer, pipeline.scheduler, optimizer=None
                          ).validation_loss_at, [transformer]

    return held_out_loss_of(held_out, flux.ControlConditioner(encoder) if paired else encoder, seed=config.seed,
                            device=device, mixed_precision=config.mixed_precision, step_for=step_for)


def _warn_unless_kontext(source: str | None) -> None:
    """A FLUX.1 base that is not Kontext trains (the architecture is the same) but has never edited an image: the
    LoRA learns editing from scratch. Say so once; the pipeline class is read from the base's model_index.json (a
    folder's, or a hub id's copy in the local cache)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        index = Path(source) / "model_index.json"
        index = index if index.is_file() else Path(try_to_load_from_cache(source, "model_index.json"))
        pipeline = json.loads(index.read_text(encoding="utf-8")).get("_class_name")
    except (TypeError, OSError, ValueError):  # no source (files alone), nothing cached, not JSON
        return
    if pipeline not in (None, FluxKontextPipeline.__name__):
        say_before_the_run(f"warning: --pretrained_model_name_or_path {source} is a {pipeline}, not FLUX.1 Kontext "
                           f"(FluxKontextPipeline): its LoRA learns editing from scratch; train on {KONTEXT_BASE}")


def train(config: FluxKontextLoraConfig) -> FinishedRun | None:
    """Train as configured; return what was written where (nothing with --dry_run)."""
    # 1. Check and plan: every flag, folder, pair and image and the optimizer, before a model loads.
    base_of(config)  # the base's files checked, and what they tell the config, before config.toml is written
    claim_output_dir(config.output_dir, overwrite=config.overwrite_output_dir,
                     resume_from_checkpoint=config.resume_from_checkpoint, config_toml=config_to_toml(config),
                     resume_must_match=config.resume_must_match)
    check_optimization(**config.optimization())
    _warn_unless_kontext(base_of(config).source)
    datasets = training_datasets(config)
    paired = datasets[0].method == "controlnet"  # every dataset has condition images, or none has
    # Target and condition posteriors cached (a random crop with room to move is encoded every step), the
    # instructions' embeddings cached.
    latent_cache, text_cache = flux.caches_of(config, datasets)
    dataset, held_out = build_split_datasets(datasets, config.seed, config.validation_split,
                                             latent_cache=latent_cache, text_cache=text_cache)
    validation_image = read_validation_image(config.validation_image)
    scorer = load_scorer(config)
    flux.transformer_config(config)  # --blocks_to_swap checked before the plan, or anything is encoded
    print_run_plan(plan_inputs(config, datasets, dataset.encodes_in_the_loop()), config.device_memory)
    if config.dry_run:
        return None
    run = start_run(config.output_dir, mixed_precision=config.mixed_precision, seed=config.seed,
                    report_to=config.report_to, resume_from_checkpoint=config.resume_from_checkpoint,
                    config_toml=config_to_toml(config) + describe_datasets(datasets),
                    command="dreamstep train flux-kontext-lora",
                    overwrite=config.overwrite_output_dir, allow_tf32=config.allow_tf32)

    # 2. Data: the pairs' loader and the step counts.
    loader, plan = loader_and_plan(run, dataset, seed=config.seed, num_workers=config.dataloader_num_workers,
                                   **config.step_counts())
    run.config_toml = config.resolved_toml(plan.num_epochs)

    # 3. Encode (models/phases.py): the text encoders and the VAE encode every instruction, pair and validation
    # prompt before the transformer loads; then those the loop does not use wait in host memory.
    base = flux.load_encoders_for_training(
        base_of(config).source, revision=config.revision, variant=config.variant,
        mixed_precision=config.mixed_precision, device=run.device,
        text_encoder_quantization=config.text_encoder_quantization, files=base_of(config).files)
    pipeline = flux.assemble_pipeline(base, pipeline_class=FluxKontextPipeline)
    encoder = flux.FluxConditioner(pipeline, latent_cache=latent_cache, text_cache=text_cache,
                                   max_sequence_length=config.max_sequence_length, device=run.device)
    conditioner = flux.ControlConditioner(encoder) if paired else encoder
    prompts = [config.validation_prompt] * config.num_validation_images if config.validation_prompt else []
    parking.encode_run(encoder, dataset, held_out, epochs=plan.num_epochs)
    embeddings = flux.prompt_embeddings(encoder, prompts)
    encoders = flux.park_encoders(base, run.device, text_encoder_trains=False,
                                  latents_cached=latent_cache is not None and not dataset.encodes_in_the_loop())
    batches = ConditionedBatches(loader, conditioner)

    # 4. Load: the transformer frozen in the --mixed_precision dtype (quantized as asked); LoRA weights in fp32.
    flux.load_transformer_for_training(
        base, base_of(config).source, revision=config.revision, variant=config.variant,
        transformer_single_file=base_of(config).files.transformer, mixed_precision=config.mixed_precision,
        device=run.device, base_quantization=config.base_quantization, on_host=config.blocks_to_swap > 0)
    flux.attach_transformer(pipeline, base)
    transformer = base.transformer
    targets = flux_lora_targets(transformer, config.lora_layers)
    training = prepare_lora_training(transformer, targets, config, run, plan)
    model, optimizer, lr_scheduler, ema = training.model, training.optimizer, training.lr_scheduler, training.ema

    # 5. Step: AdamW/8-bit/Prodigy over the LoRA weights, the LR schedule, clipping, accumulation.
    step = build_step(config, model, transformer, base.scheduler, optimizer=optimizer, lr_scheduler=lr_scheduler,
                      accelerator=run.accelerator, ema=ema, max_grad_norm=config.max_grad_norm or None,
                      gradient_accumulation_steps=config.gradient_accumulation_steps,
                      length_of_dataloader=len(loader))
    print_run_summary(run, dataset, plan, gradient_accumulation_steps=config.gradient_accumulation_steps,
                      mixed_precision=config.mixed_precision, trainable=(transformer,),
                      caches={"latents": latent_cache, "text": text_cache}, outputs=config.output_dir,
                      tokenizers=flux.tokenizer_limits(pipeline, config.max_sequence_length))

    # 6. Loop: the engine trains, checkpoints and validates (edits of the validation image, then the validation
    # loss and scores); validation images bring back only the VAE, the validation loss nothing.
    evaluator = build_evaluator(config, scorer, held_out=held_out, conditioner=conditioner,
                                loss_at=step.validation_loss_at, modules=[model], seed=config.seed,
                                subject_images=subject_image_paths(dataset, held_out), device=run.device)
    edits: dict[int, list[Image.Image]] = {}  # the samples of the last step sampled, for its scores

    def sample(global_step: int) -> list[Image.Image]:
        with encoders.on_device("vae"):
            edits[global_step] = _validation_images(config, pipeline, validation_image,
                                                    datasets[0].buckets.resolution, embeddings)
        return [side_by_side([[validation_image, *edits[global_step]]])] if validation_image else edits[global_step]

    hooks = hooks_from_options(config, sample=sample if prompts else None,
                               score=(lambda at, _: evaluator(edits.pop(at, []), prompts))
                               if evaluator is not None else None,
                               ema=ema)
    result = fit_from_options(run, step, batches, config, total_steps=plan.total_steps,
                              trained=TrainableState({"transformer": transformer}), ema=ema, hooks=hooks)

    # 7. Save: diffusers layout (+ sd-scripts names), final samples and scores, loss curve, summary.
    written = {}
    if run.is_main_process:
        written["LoRA (diffusers)"] = save_flux_lora(config.output_dir, transformer)
        if ema is not None:
            with ema.swapped_in():
                written["LoRA (EMA)"] = save_flux_lora(config.output_dir, transformer, weight_name=EMA_WEIGHT_NAME)
        if config.save_kohya_format:
            kohya_path = Path(config.output_dir) / KOHYA_WEIGHT_NAME
            convert_lora(written["LoRA (diffusers)"], kohya_path, to="kohya", model="flux", overwrite=True)
            written["LoRA (Kohya)"] = kohya_path
    return finish(run, written, result, hooks, best_by=config.best_metric(held_out is not None))


def _validation_images(config: FluxKontextLoraConfig, pipeline, condition: Image.Image | None,
                       size: tuple[int, int], embeddings: dict[str, dict[str, torch.Tensor]]) -> list[Image.Image]:
    """Edits of ``condition`` (or text-to-image samples) at the training resolution ``size`` (width, height), the
    condition resized to it, from the prompt's cached embeddings."""
    was_training = pipeline.transformer.training
    pipeline.transformer.eval()
    # Kontext would move the sample to its preferred area (1024²) and the condition to its preferred sizes.
    extra: dict[str, Any] = {"max_area": size[0] * size[1]}
    if condition is not None:
        extra |= {"image": condition if condition.size == size else condition.resize(size, Image.Resampling.LANCZOS),
                  "_auto_resize": False}
    images = flux.generate(pipeline, [config.validation_prompt] * config.num_validation_images, seed=config.seed,
                           steps=config.validation_inference_steps, guidance_scale=config.guidance_scale,
                           width=size[0], height=size[1], max_sequence_length=config.max_sequence_length,
                           embeddings=embeddings, **extra)
    pipeline.transformer.train(was_training)
    return images

