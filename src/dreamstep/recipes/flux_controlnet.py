"""FLUX.1 ControlNet: ``dreamstep train flux-controlnet``.

Features: a ControlNet built from the base transformer (``--num_double_layers``, ``--num_single_layers``; output
projections zero-initialised, so training starts from the base's own prediction) or loaded
(``--controlnet_model_name_or_path``), trained beside the frozen base as diffusers' ``train_controlnet_flux.py``
does: the control image's latents are packed like the target's and fed to the ControlNet, whose per-block residuals
are added inside the transformer; gradients flow through the frozen transformer into the ControlNet. Data: a folder
of pairs (``--train_data_dir`` + ``--conditioning_data_dir``, same-named files, captions from
``--caption_extension`` files), a ``metadata.jsonl`` with ``image``, ``conditioning_image`` and ``text``
(``--jsonl_for_train``, or found in ``--train_data_dir``), or a Kohya dataset TOML whose subsets have
``conditioning_data_dir``; every pair is checked before a model loads. Text embeddings cached; target and control
latents cached (except random crops of images larger than their bucket); caption dropout
(``--caption_dropout_rate``, alias ``--proportion_empty_prompts``) and sd-scripts' caption flags; SD3 timestep
sampling / weighting, sd-scripts' ``--timestep_sampling`` and ``--loss_type``; guidance for guidance-distilled
bases; gradient checkpointing; AdamW / AdamW8bit / Prodigy. Precision: frozen weights in ``--mixed_precision``,
ControlNet weights fp32 with half-precision compute, or with ``--controlnet_weights_dtype bf16`` bf16 weights and an
AdamW whose math is fp32 with stochastic rounding (12 instead of 16 bytes of trainable state per parameter). An EMA
of the ControlNet weights (``--ema_decay``). Resumable checkpoints, validation grids through diffusers'
``FluxControlNetPipeline`` (control image beside the results), TensorBoard, a loss curve PNG; evaluation at the
validation points (validation loss on held-out pairs: --validation_split or a TOML subset with is_validation;
--eval_metrics edge,clip_t,...: the samples' edge agreement with edge-map controls).

Outputs in --output_dir: ``config.json`` + ``diffusion_pytorch_model.safetensors`` (what
``FluxControlNetModel.from_pretrained`` loads), with --ema_decay the EMA weights in ``ema/`` (the same layout),
``samples/``, ``loss_curve.png``, ``metrics.csv`` and
``metrics.png`` with evaluation, ``logs``,
``checkpoint-N/`` and the run's ``config.toml``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from dreamstep.config.flux_controlnet import FluxControlNetConfig
from dreamstep.config.schema import config_to_toml
from dreamstep.data.cache import TensorCache
from dreamstep.data.dataset import BucketDataset, ConditionedBatches
from dreamstep.data.dataset_config import DatasetConfig, describe_datasets
from dreamstep.data.holdout import build_split_datasets, subject_image_paths
from dreamstep.data.images import load_rgb
from dreamstep.data.sources import paired_datasets
from dreamstep.engine.bf16_adamw import StochasticRoundingAdamW
from dreamstep.engine.ema import weight_average
from dreamstep.engine.fit import FinishedRun, finish, fit_from_options, hooks_from_options
from dreamstep.engine.optim import build_lr_scheduler, build_optimizer
from dreamstep.engine.plan import check_optimization, loader_and_plan
from dreamstep.engine.run import claim_output_dir, start_run
from dreamstep.engine.sharding import FullState, full_model_state, is_sharded, shard_model
from dreamstep.engine.summary import print_run_summary
from dreamstep.evaluation.evaluator import build_evaluator, held_out_loss_of, load_scorer
from dreamstep.models import parking
from dreamstep.models.blocks import enable_checkpointing, prepare_blocks
from dreamstep.models.flow_step import condition_latents
from dreamstep.models.flux import controlnet as cn
from dreamstep.models.flux import plumbing as flux
from dreamstep.models.flux.family import FAMILY as FLUX
from dreamstep.models.flux.files import base_of
from dreamstep.models.flux.step import FluxFlowMatchingStep
from dreamstep.models.plans import RunPlan, print_run_plan
from dreamstep.models.precision import autocast


class FluxControlNetStep(FluxFlowMatchingStep):
    """diffusers' ControlNet step: the ControlNet (``model``, the only part that learns) reads the packed control
    latents beside x_σ; its residuals, one (B, N, D) per block, are added to the frozen transformer's hidden
    states block by block, and the gradients flow back through the transformer."""

    def __init__(self, controlnet: torch.nn.Module, *, transformer: torch.nn.Module, **options: Any):
        super().__init__(controlnet, **options)
        self.transformer = transformer

    def condition(self, batch: dict[str, Any], sample: bool) -> torch.Tensor:
        return condition_latents(batch, sample)

    def predict(self, controlnet: torch.nn.Module | None, inputs: dict[str, Any], batch: dict[str, Any],
                condition: torch.Tensor) -> torch.Tensor:
        """``controlnet`` ``None``: the transformer alone (eval's base-model row; what a freshly built
        ControlNet, its output projections zero, also predicts)."""
        residuals = {} if controlnet is None else cn.residuals(controlnet, controlnet_cond=flux.pack(condition),
                                                               **inputs)
        return self.transformer(**inputs, **residuals, return_dict=False)[0]


def build_step(config: FluxControlNetConfig, controlnet: torch.nn.Module | None, transformer: torch.nn.Module,
               scheduler: Any, **engine_options: Any) -> FluxControlNetStep:
    """The run's step over the base ``transformer`` and its ``scheduler``'s σ table; ``engine_options``:
    :class:`~dreamstep.engine.train_step.TrainStep`'s (without an optimizer the step only evaluates)."""
    return FluxControlNetStep(
        controlnet, transformer=transformer, sigmas=flux.training_sigmas(scheduler),
        objective=config.flow_matching_objective(),
        guidance_scale=config.guidance_scale if transformer.config.guidance_embeds else None, **engine_options)


def split_pairs(config: FluxControlNetConfig, datasets: list[DatasetConfig], *,
                latent_cache: TensorCache | None = None, text_cache: TensorCache | None = None
                ) -> tuple[BucketDataset, BucketDataset | None]:
    """The pairs trained on and those held out for the validation loss (``None``: none), chosen by content
    and ``--seed`` (:mod:`dreamstep.data.holdout`)."""
    return build_split_datasets(datasets, config.seed, config.validation_split, latent_cache=latent_cache,
                                text_cache=text_cache)


def conditioner_of(config: FluxControlNetConfig, pipeline: Any, device: torch.device, *,
                   latent_cache: TensorCache | None, text_cache: TensorCache) -> flux.ControlConditioner:
    """The step's inputs of a batch of pairs: both images' posteriors through ``pipeline``'s VAE, the
    captions' embeddings through its text encoders."""
    return flux.ControlConditioner(flux.FluxConditioner(
        pipeline, latent_cache=latent_cache, text_cache=text_cache, max_sequence_length=config.max_sequence_length,
        device=device))


def held_out_loss(config: FluxControlNetConfig, held_out: BucketDataset, pipeline: Any, text_cache: TensorCache,
                  device: torch.device) -> Callable[[torch.nn.Module | None], float]:
    """The validation loss the run logged, as a function of a ControlNet (``None``: the base transformer
    alone), for ``dreamstep eval``: ``held_out`` (:func:`split_pairs` of the run's config) encoded once by
    ``pipeline`` (the base: its VAE, text encoders, transformer and scheduler), then scored by the run's step
    at the same fixed noise levels and draws, under the run's ``--mixed_precision``."""
    def step_for(controlnet: torch.nn.Module | None) -> tuple[Any, list[torch.nn.Module]]:
        step = build_step(config, controlnet, pipeline.transformer, pipeline.scheduler, optimizer=None)
        return step.validation_loss_at, [controlnet] if controlnet is not None else []

    conditioner = conditioner_of(config, pipeline, device, latent_cache=None, text_cache=text_cache)
    return held_out_loss_of(held_out, conditioner, seed=config.seed, device=device,
                            mixed_precision=config.mixed_precision, step_for=step_for)


FOLDER_FLAG = "train_data_dir"  # the flag an image folder is read from (the dashboard's dataset check)


def training_datasets(config: FluxControlNetConfig) -> list[DatasetConfig]:
    return paired_datasets(config, ("controlnet",), "train flux-controlnet")


def plan_inputs(config: FluxControlNetConfig, dataset_configs: list[DatasetConfig],
                encodes_in_the_loop: bool) -> RunPlan:
    """The memory plan's inputs; ``encodes_in_the_loop``: the loop encodes random crops itself."""
    layers = (config.num_double_layers, config.num_single_layers)
    return RunPlan(FLUX.name, base_of(config).source, flux.plan_options(
        config, dataset_configs, rank=0, encoders_on_device=not config.cache_latents or encodes_in_the_loop,
        validation_images=bool(config.validation_pairs())),
        {"build_trainable": cn.meta_builder(*layers),
         "trainable_label": f"ControlNet ({layers[0]} + {layers[1]} blocks)"})


def train(config: FluxControlNetConfig) -> FinishedRun | None:
    """Train as configured; return what was written where (nothing with --dry_run)."""
    # 1. Check and plan: every flag, folder, pair and image (validation images too) and the optimizer,
    # before a model loads.
    base_of(config)  # the base's files checked, and what they tell the config, before config.toml is written
    claim_output_dir(config.output_dir, overwrite=config.overwrite_output_dir,
                     resume_from_checkpoint=config.resume_from_checkpoint, config_toml=config_to_toml(config),
                     resume_must_match=config.resume_must_match)
    check_optimization(**config.optimization())
    datasets = training_datasets(config)
    # Target and control posteriors cached (a random crop with room to move is encoded every step), prompt
    # embeddings cached.
    latent_cache, text_cache = flux.caches_of(config, datasets)
    dataset, held_out = split_pairs(config, datasets, latent_cache=latent_cache, text_cache=text_cache)
    validation = [(load_rgb(Path(image)), prompt) for image, prompt in config.validation_pairs()]
    scorer = load_scorer(config)
    transformer_config = flux.transformer_config(config)  # checked before the plan, or anything is encoded
    if config.controlnet_model_name_or_path is None:
        cn.check_layers(config.num_double_layers, config.num_single_layers, transformer_config)
    else:
        cn.check_trained(config.controlnet_model_name_or_path, transformer_config)
    print_run_plan(plan_inputs(config, datasets, dataset.encodes_in_the_loop()), config.device_memory)
    if config.dry_run:
        return None
    run = start_run(config.output_dir, mixed_precision=config.mixed_precision, seed=config.seed,
                    report_to=config.report_to, resume_from_checkpoint=config.resume_from_checkpoint,
                    config_toml=config_to_toml(config) + describe_datasets(datasets),
                    command="dreamstep train flux-controlnet", overwrite=config.overwrite_output_dir,
                    allow_tf32=config.allow_tf32)

    # 2. Data: the pairs' loader and the step counts.
    loader, plan = loader_and_plan(run, dataset, seed=config.seed, num_workers=config.dataloader_num_workers,
                                   **config.step_counts())
    run.config_toml = config.resolved_toml(plan.num_epochs)

    # 3. Encode (models/phases.py): the text encoders and the VAE encode every caption, pair and validation
    # prompt before the transformer loads; then those the loop does not use wait in host memory.
    base = flux.load_encoders_for_training(
        base_of(config).source, revision=config.revision, variant=config.variant,
        mixed_precision=config.mixed_precision, device=run.device,
        text_encoder_quantization=config.text_encoder_quantization, files=base_of(config).files)
    conditioner = conditioner_of(config, flux.assemble_pipeline(base), run.device, latent_cache=latent_cache,
                                 text_cache=text_cache)
    parking.encode_run(conditioner.conditioner, dataset, held_out, epochs=plan.num_epochs)
    embeddings = flux.prompt_embeddings(conditioner.conditioner, [prompt for _, prompt in validation])
    encoders = flux.park_encoders(base, run.device, text_encoder_trains=False,
                                  latents_cached=latent_cache is not None and not dataset.encodes_in_the_loop())
    batches = ConditionedBatches(loader, conditioner)

    # 4. Load: the base frozen in --mixed_precision; the ControlNet built or loaded, in its weight dtype.
    flux.load_transformer_for_training(
        base, base_of(config).source, revision=config.revision, variant=config.variant,
        transformer_single_file=base_of(config).files.transformer, mixed_precision=config.mixed_precision,
        device=run.device, base_quantization=config.base_quantization, on_host=config.blocks_to_swap > 0)
    if config.controlnet_model_name_or_path is not None:
        controlnet = cn.load(config.controlnet_model_name_or_path, base.transformer)
    else:
        controlnet = cn.build_from_transformer(base.transformer, config.num_double_layers, config.num_single_layers)
    weights_dtype = torch.bfloat16 if config.controlnet_weights_dtype == "bf16" else torch.float32
    cn.cast(controlnet, weights_dtype).to(run.device)
    controlnet.requires_grad_(True)
    if config.gradient_checkpointing:
        for model in (controlnet, base.transformer):
            enable_checkpointing(model, offload_to_host=config.cpu_offload_checkpointing, device=run.device)
    controlnet.train()
    # --zero_stage: the ControlNet's weights, gradients and optimizer state (and with --shard_base the frozen
    # blocks) are spread over the processes, one FSDP unit per block.
    shard_model(controlnet, config.zero_stage, cn.BLOCK_CLASSES, run.device)
    if config.shard_base:
        shard_model(base.transformer, config.zero_stage, cn.BLOCK_CLASSES, run.device)
    sharded = is_sharded(controlnet)
    # The frozen base's blocks may be swapped (after the ControlNet copied its weights) and compiled.
    prepare_blocks(base.transformer, blocks_to_swap=config.blocks_to_swap, compile=config.compile,
                   device=run.device, num_processes=run.accelerator.num_processes)
    pipeline = flux.assemble_pipeline(base, controlnet)

    # 5. Step: the optimizer over every ControlNet weight, the LR schedule, clipping, accumulation.
    optimizer = _optimizer(config, list(controlnet.parameters()))
    lr_scheduler = build_lr_scheduler(config.lr_scheduler, optimizer, warmup_steps=plan.warmup_steps,
                                      total_steps=plan.total_steps, num_cycles=config.lr_num_cycles,
                                      power=config.lr_power)
    # A sharded model talks to its peers itself; DDP comes from accelerate.
    ema = weight_average(controlnet, config.ema_options())
    model, optimizer = (controlnet, optimizer) if sharded else run.accelerator.prepare(controlnet, optimizer)
    step = build_step(
        config, model, base.transformer, base.scheduler, optimizer=optimizer, lr_scheduler=lr_scheduler, ema=ema,
        accelerator=run.accelerator, max_grad_norm=config.max_grad_norm or None,
        gradient_accumulation_steps=config.gradient_accumulation_steps, length_of_dataloader=len(loader))

    print_run_summary(run, dataset, plan, gradient_accumulation_steps=config.gradient_accumulation_steps,
                      mixed_precision=config.mixed_precision, trainable=(controlnet,),
                      caches={"latents": latent_cache, "text": text_cache}, outputs=config.output_dir,
                      tokenizers=flux.tokenizer_limits(pipeline, config.max_sequence_length),
                      sharded_stage=config.zero_stage)

    # 6. Loop: the engine trains, checkpoints and validates (samples, then the validation loss and scores);
    # validation images bring back only the VAE (which also encodes the control image), the loss nothing.
    evaluator = build_evaluator(config, scorer, held_out=held_out, conditioner=conditioner,
                                loss_at=step.validation_loss_at, modules=[model], seed=config.seed,
                                subject_images=subject_image_paths(dataset, held_out), device=run.device)
    rows: dict[int, list] = {}  # the validation rows of the last step sampled, for its scores

    def sample(global_step: int) -> list[Image.Image]:
        rows.clear()
        with encoders.on_device("vae"):
            rows[global_step] = _validation_rows(config, pipeline, validation, run.device.type,
                                                 datasets[0].buckets.resolution, embeddings)
        return [cn.side_by_side([[control, *images] for control, _, images in rows[global_step]])]

    def score(global_step: int, _: list[Image.Image]) -> dict[str, float]:
        samples = [(image, prompt, control) for control, prompt, images in rows.pop(global_step, [])
                   for image in images]
        return evaluator([s[0] for s in samples], [s[1] for s in samples], controls=[s[2] for s in samples])

    hooks = hooks_from_options(config, sample=sample if validation else None,
                               score=score if evaluator is not None else None, ema=ema,
                               sample_on_every_process=sharded)
    result = fit_from_options(run, step, batches, config, total_steps=plan.total_steps,
                              trained=FullState(controlnet), ema=ema, hooks=hooks)

    # 7. Save: the save_pretrained layout, final samples and scores, loss curve, summary.
    written = {}
    state = full_model_state(controlnet) if sharded else None  # every process helps gather it
    if run.is_main_process:
        written["ControlNet"] = cn.save(controlnet, config.output_dir, state)
        if ema is not None:
            with ema.swapped_in():
                written["ControlNet (EMA)"] = cn.save(controlnet, Path(config.output_dir) / "ema")
    return finish(run, written, result, hooks, best_by=config.best_metric(held_out is not None))


def _optimizer(config: FluxControlNetConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """--optimizer over fp32 weights; for bf16 weights, AdamW with fp32 math and stochastic rounding."""
    betas = (config.adam_beta1, config.adam_beta2)
    if config.controlnet_weights_dtype == "bf16":
        return StochasticRoundingAdamW(params, lr=config.learning_rate, betas=betas, eps=config.adam_epsilon,
                                       weight_decay=config.adam_weight_decay, seed=config.seed)
    return build_optimizer(config.optimizer, [{"params": params, "lr": config.learning_rate}], config.learning_rate,
                           betas=betas, weight_decay=config.adam_weight_decay, eps=config.adam_epsilon)


def _validation_rows(config: FluxControlNetConfig, pipeline, validation: list[tuple[Image.Image, str]],
                     device_type: str, size: tuple[int, int], embeddings: dict[str, dict[str, torch.Tensor]]
                     ) -> list[tuple[Image.Image, str, list[Image.Image]]]:
    """(control image, prompt, samples) per validation pair, at the training resolution ``size`` (width,
    height; the control image resized to it); the grid shows a row per pair."""
    was_training = pipeline.controlnet.training
    pipeline.controlnet.eval()
    rows = []
    # Under autocast, as in training: the fp32 (or bf16) ControlNet meets the base's half-precision tensors.
    with autocast(device_type, config.mixed_precision):
        for control, prompt in validation:
            control = control if control.size == size else control.resize(size, Image.Resampling.LANCZOS)
            images = flux.generate(pipeline, [prompt] * config.num_validation_images, seed=config.seed,
                                   steps=config.validation_inference_steps, guidance_scale=config.guidance_scale,
                                   width=size[0], height=size[1],
                                   max_sequence_length=config.max_sequence_length, control_image=control,
                                   embeddings=embeddings)
            rows.append((control, prompt, images))
    pipeline.controlnet.train(was_training)
    return rows
