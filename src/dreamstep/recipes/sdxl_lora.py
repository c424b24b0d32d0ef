"""Kohya-compatible SDXL LoRA: ``dreamstep train sdxl-lora``, taking sd-scripts' ``sdxl_train_network.py``
flags with their meaning.

Features: the dataset from a Kohya dataset TOML (``--dataset_config``: DreamBooth class+identifier, DreamBooth
captions, fine-tuning metadata, regularization subsets, buckets) or from Kohya's folder flags (``--train_data_dir``
with ``<repeats>_<class tokens>`` folders, ``--reg_data_dir``, ``--in_json``); the ``networks.lora`` network on the
UNet and both text encoders with sd-scripts' key names (``--network_dim``, ``--network_alpha``,
``--network_dropout``, ``--network_args conv_dim= conv_alpha= rank_dropout= module_dropout=``,
``--network_train_unet_only``, ``--network_train_text_encoder_only``, ``--network_weights``), or LyCORIS'
``lycoris.kohya`` (``--network_args algo=lokr|loha|locon|lora factor= preset= dora_wd= ...``: LoKr, LoHa, LoCon,
DoRA) with the same names; ε- or v-prediction
(``--v_parameterization``) with ``--min_snr_gamma``, ``--noise_offset`` + ``--adaptive_noise_scale``, multires
noise, ``--ip_noise_gamma``, ``--prior_loss_weight``, ``--loss_type`` (Huber schedules),
``--debiased_estimation_loss``; sd-scripts' caption flags; an EMA of the LoRA weights (``--ema_decay``); precision
``--mixed_precision``, ``--full_fp16``, ``--full_bf16``, ``--no_half_vae``; ``--gradient_checkpointing``;
``--sdpa``/``--flash_attn``/``--xformers`` (all PyTorch scaled-dot-product attention); the optimizers of
:mod:`dreamstep.engine.optim` with ``--optimizer_args``; LR schedules with warm-up; latents and text embeddings
cached by content (exactly what encoding every step gives: the VAE posterior is cached and sampled each step);
``--save_every_n_steps``/``--save_every_n_epochs``; ``--save_state`` + ``--resume`` (exact); ``--sample_prompts``
with sd-scripts' per-line options; TensorBoard and a loss curve; evaluation every ``--validate_every_n_steps``
(validation loss on held-out images: ``--validation_split`` or a TOML subset with ``is_validation = true``;
``--eval_metrics`` scores of the sample prompts' images).

Outputs in --output_dir: ``<output_name>.safetensors`` (or ``.ckpt``) with sd-scripts' ``ss_*`` metadata (with
--ema_decay also ``<output_name>_ema.*``, the EMA weights),
``<output_name>-step00000500.*`` and ``<output_name>-000001.*`` along the way, ``checkpoint-N/`` with
--save_state, ``sample/`` PNGs, ``config.toml``, TensorBoard logs, ``loss_curve.png`` and with evaluation
``metrics.csv`` and ``metrics.png``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from dreamstep.config.lycoris import LYCORIS_MODULE, LycorisOptions, lycoris_from_network_args
from dreamstep.config.schema import config_to_toml
from dreamstep.config.sdxl_lora import SDXLLoraConfig
from dreamstep.data import (
    ConditionedBatches,
)
from dreamstep.data.cache import TensorCache, remove_caches
from dreamstep.data.dataset import BucketDataset
from dreamstep.data.dataset_config import DatasetConfig, describe_datasets
from dreamstep.data.holdout import build_split_datasets, subject_image_paths
from dreamstep.data.sources import kohya_datasets
from dreamstep.diffusion import noise_prediction as noise_math
from dreamstep.diffusion.losses import LossFunction, masked
from dreamstep.engine.ema import validation_weights, weight_average, with_average
from dreamstep.engine.fit import FinishedRun, RunHooks, finish, fit
from dreamstep.engine.loop import AnyOf, Every
from dreamstep.engine.optim import build_lr_scheduler, build_optimizer, parse_optimizer_args
from dreamstep.engine.plan import check_optimization, loader_and_plan
from dreamstep.engine.run import claim_output_dir, start_run
from dreamstep.engine.summary import print_run_summary
from dreamstep.engine.train_step import TrainStep
from dreamstep.evaluation.evaluator import build_evaluator, held_out_loss_of, load_scorer
from dreamstep.lora.kohya_files import KohyaLoraWriter, dataset_metadata, network_metadata, training_metadata
from dreamstep.lora.kohya_network import (
    LoRANetwork,
    NetworkOptions,
    create_network,
)
from dreamstep.lora.lycoris_network import LycorisNetwork, create_sdxl_network
from dreamstep.models import parking
from dreamstep.models.blocks import prepare_blocks
from dreamstep.models.memory_plan import model_folder
from dreamstep.models.plans import RunPlan, print_run_plan
from dreamstep.models.precision import dtype_named, in_compute_dtype, weight_dtype_for
from dreamstep.models.sdxl import plumbing as sdxl
from dreamstep.models.sdxl.family import FAMILY as SDXL
from dreamstep.models.vae import sample_latents

# ------------------------------------------------------------------------------------------- builders

def _create_network(config: SDXLLoraConfig, base: Any,
                    options: NetworkOptions | LycorisOptions) -> LoRANetwork | LycorisNetwork:
    create = create_sdxl_network if isinstance(options, LycorisOptions) else create_network
    return create(base.unet, {"text_encoder": base.text_encoder, "text_encoder_2": base.text_encoder_2},
                  options, train_unet=not config.network_train_text_encoder_only,
                  train_text_encoder=not config.network_train_unet_only)


def check_network_weights(config: SDXLLoraConfig, options: NetworkOptions | LycorisOptions) -> None:
    """--network_weights against the network the flags build over the base's configs on the meta device, before
    anything is written. What the meta device cannot hold is checked when the file loads: a LyCORIS file's alphas,
    and a DoRA network (its magnitudes start from the base weights)."""
    if config.network_weights is None:
        return
    folder = model_folder(sdxl.config_source(config.pretrained_model_name_or_path, config.model_config))
    try:
        network = _create_network(config, SimpleNamespace(**SDXL.meta_components(folder)), options)
    except NotImplementedError:  # "Cannot copy out of meta tensor"
        return
    network.check_weights(config.network_weights)


def build_network(config: SDXLLoraConfig, base: Any,
                  options: NetworkOptions | LycorisOptions) -> LoRANetwork | LycorisNetwork:
    """The Kohya or LyCORIS network, its trainable dtype set (fp32, or half with --full_fp16/--full_bf16)."""
    network = _create_network(config, base, options)
    if config.network_weights is not None:
        network.load_weights(config.network_weights)
    half = config.full_fp16 or config.full_bf16
    trainable_dtype = weight_dtype_for(config.mixed_precision) if half else torch.float32
    network.to(trainable_dtype)
    if config.gradient_checkpointing and not config.network_train_unet_only:
        for encoder in (base.text_encoder, base.text_encoder_2):
            encoder.gradient_checkpointing_enable()
    return network


# ----------------------------------------------------------------------------------------- the step

class SDXLLoraStep(TrainStep):
    """One DDPM step: noise the latents at a random timestep, predict ε (or v), weighted loss (--loss_type),
    in sd-scripts' order of draws and weights."""

    def __init__(self, model: nn.Module, *, noise_scheduler: Any, v_prediction: bool, min_snr_gamma: float | None,
                 noise_offset: float | None, adaptive_noise_scale: float | None, multires_iterations: int | None,
                 multires_discount: float, timestep_range: tuple[int, int], prior_loss_weight: float,
                 loss: LossFunction, debiased_estimation_loss: bool, ip_noise_gamma: float | None,
                 ip_noise_gamma_random_strength: bool, **engine_options: Any):
        super().__init__(model, **engine_options)
        self.noise_scheduler = noise_scheduler
        self.prediction_type = "v_prediction" if v_prediction else "epsilon"
        self.min_snr_gamma = min_snr_gamma
        self.loss = loss
        self.debiased_estimation_loss = debiased_estimation_loss
        self.input_perturbation = (ip_noise_gamma, ip_noise_gamma_random_strength)
        self.noise_offset, self.adaptive_noise_scale = noise_offset, adaptive_noise_scale
        self.multires = (multires_iterations, multires_discount)
        self.timestep_range = timestep_range
        self.prior_loss_weight = prior_loss_weight

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        latents = sample_latents(batch["latent_dist"])  # (B, 4, h, w), scaled by 0.13025
        noise = torch.randn_like(latents)
        if self.noise_offset:
            noise = noise_math.offset_noise(noise, latents, self.noise_offset, self.adaptive_noise_scale)
        if self.multires[0]:
            noise = noise_math.pyramid_noise(noise, *self.multires)
        timesteps = noise_math.sample_timesteps(latents.shape[0], *self.timestep_range, device=latents.device)
        input_noise = noise
        if self.input_perturbation[0]:
            input_noise = noise_math.input_perturbation(noise, *self.input_perturbation)
        loss = self.per_sample_loss(self.model, batch, latents, noise, timesteps, input_noise)  # (B,)
        loss = loss * torch.where(batch["is_reg"], self.prior_loss_weight, 1.0)
        v_prediction = self.prediction_type == "v_prediction"
        if self.min_snr_gamma or self.debiased_estimation_loss:
            snr = noise_math.snr(self.noise_scheduler.alphas_cumprod, timesteps)
        if self.min_snr_gamma:
            loss = loss * noise_math.min_snr_weight(snr, self.min_snr_gamma, v_prediction)
        if self.debiased_estimation_loss:
            loss = loss * noise_math.debiased_estimation_weight(snr, v_prediction)
        return loss.mean()

    def per_sample_loss(self, model: nn.Module, batch: dict[str, Any], latents: torch.Tensor, noise: torch.Tensor,
                        timesteps: torch.Tensor, input_noise: torch.Tensor | None = None) -> torch.Tensor:
        """The loss (--loss_type) of the prediction target per sample, (B,), at the given noise and timesteps;
        ``input_noise`` (default: ``noise``) is what the model's input is noised with (input perturbation)."""
        # x_t = √ᾱ_t·x₀ + √(1-ᾱ_t)·ε
        noisy = self.noise_scheduler.add_noise(latents, noise if input_noise is None else input_noise, timesteps)
        # The UNet reads x_t and the embeddings in the compute dtype, as sd-scripts casts them (the sizes stay exact
        # in fp32: the UNet embeds them and casts the embedding); the loss stays fp32.
        device_type = latents.device.type
        prediction = model(in_compute_dtype(noisy, device_type), timesteps, batch["add_time_ids"],
                           prompt_embeds=in_compute_dtype(batch.get("prompt_embeds"), device_type),
                           pooled=in_compute_dtype(batch.get("pooled"), device_type), captions=batch.get("captions"))
        target = noise_math.prediction_target(self.noise_scheduler, latents, noise, timesteps, self.prediction_type)
        per_element = self.loss.per_element(prediction, target, timesteps,
                                            self.noise_scheduler.config.num_train_timesteps,
                                            self.noise_scheduler.alphas_cumprod)
        if "masks" in batch:  # --masked_loss: a black region of the image contributes nothing
            per_element = masked(per_element, batch["masks"])
        return per_element.mean(dim=tuple(range(1, per_element.ndim)))

    def validation_loss_at(self, batch: dict[str, Any], latents: torch.Tensor, noise: torch.Tensor,
                           fraction: float) -> torch.Tensor:
        """Unweighted loss at the fixed timestep ``fraction`` of the way through the training range."""
        low, high = self.timestep_range
        timesteps = torch.full((len(latents),), low + int(fraction * (high - low)), device=latents.device)
        with self.autocast():
            return self.per_sample_loss(self.unwrapped_model, batch, latents, noise, timesteps)


def build_step(config: SDXLLoraConfig, model: nn.Module, scheduler: Any, **engine_options: Any) -> SDXLLoraStep:
    """The run's step over ``model`` (:class:`~dreamstep.models.sdxl.plumbing.SDXLLoraModel`, or DDP's wrap of it)
    with the base ``scheduler``'s table; ``engine_options``: :class:`~dreamstep.engine.train_step.TrainStep`'s
    (without an optimizer the step only evaluates)."""
    return SDXLLoraStep(
        model, noise_scheduler=noise_math.training_scheduler(scheduler.config, config.zero_terminal_snr),
        v_prediction=config.v_parameterization, min_snr_gamma=config.min_snr_gamma,
        noise_offset=config.noise_offset, adaptive_noise_scale=config.adaptive_noise_scale,
        multires_iterations=config.multires_noise_iterations, multires_discount=config.multires_noise_discount,
        timestep_range=(config.min_timestep, config.max_timestep), prior_loss_weight=config.prior_loss_weight,
        loss=config.loss_function(), debiased_estimation_loss=config.debiased_estimation_loss,
        ip_noise_gamma=config.ip_noise_gamma, ip_noise_gamma_random_strength=config.ip_noise_gamma_random_strength,
        **engine_options)


def held_out_loss(config: SDXLLoraConfig, held_out: BucketDataset, pipeline: Any, text_cache: TensorCache,
                  device: torch.device) -> Callable[[nn.Module | None], float]:
    """The validation loss the run logged, for ``dreamstep eval``: of ``pipeline`` (the base, with the LoRA eval
    applied to its UNet and text encoders) on ``held_out`` (the images the run held out), encoded once, scored by
    the run's step at the same fixed timesteps and draws. Text encoders that trained encode the captions with
    their LoRA, as in training."""
    train_text = not config.network_train_unet_only
    conditioner = sdxl.SDXLConditioner(pipeline, device=device, latent_cache=None, text_cache=text_cache,
                                       encode_text=not train_text)

    def step_for(_: nn.Module | None) -> tuple[Any, list[nn.Module]]:
        model = sdxl.SDXLLoraModel(pipeline.unet, None, pipeline)
        return build_step(config, model, pipeline.scheduler, optimizer=None).validation_loss_at, [model]

    return held_out_loss_of(held_out, conditioner, seed=config.seed, device=device,
                            mixed_precision=config.mixed_precision, step_for=step_for)


# ------------------------------------------------------------------------------------------- main

FOLDER_FLAG = "train_data_dir"  # the flag an image folder is read from (the dashboard's dataset check)


def training_datasets(config: SDXLLoraConfig) -> list[DatasetConfig]:
    return kohya_datasets(config, "train sdxl-lora")


def plan_inputs(config: SDXLLoraConfig, dataset_configs: list[DatasetConfig], encodes_in_the_loop: bool) -> RunPlan:
    """The memory plan's inputs; ``encodes_in_the_loop``: the loop encodes random crops itself. The text encoders
    run in the loop when they train, or when their outputs are not cached."""
    text_in_the_loop = not config.network_train_unet_only or not config.cache_text_encoder_outputs
    return RunPlan(SDXL.name, sdxl.config_source(config.pretrained_model_name_or_path, config.model_config),
                   sdxl.plan_options(config, dataset_configs,
                                     encoders_on_device=text_in_the_loop or not config.cache_latents
                                     or encodes_in_the_loop,
                                     validation_images=bool(config.sample_prompts)))


def train(config: SDXLLoraConfig) -> FinishedRun | None:
    """Train as configured; return what was written where (nothing with --dry_run)."""
    # 1. Check and plan: every flag, key, folder, image and the optimizer, before a model loads.
    claim_output_dir(config.output_dir, overwrite=config.overwrite_output_dir, resume_from_checkpoint=config.resume,
                     resume_flag="--resume", config_toml=config_to_toml(config),
                     resume_must_match=config.resume_must_match)
    datasets = training_datasets(config)
    optimizer_args = parse_optimizer_args(config.optimizer_args)
    check_optimization(config.optimizer_type, config.learning_rate, lr_scheduler=config.lr_scheduler,
                       num_cycles=config.lr_scheduler_num_cycles, power=config.lr_scheduler_power,
                       optimizer_flag="--optimizer_type", extra=optimizer_args, family="sd-scripts")
    from_flags = lycoris_from_network_args if config.network_module == LYCORIS_MODULE else NetworkOptions.from_flags
    options, network_args = from_flags(config.network_dim, config.network_alpha, config.network_dropout,
                                       config.network_args)
    check_network_weights(config, options)
    prompts = (sdxl.read_sample_prompts(config.sample_prompts, datasets[0].buckets.resolution)
               if config.sample_prompts else None)
    train_text = not config.network_train_unet_only
    # The text encoders run in the loop when they train, or when their outputs are not cached.
    text_in_the_loop = train_text or not config.cache_text_encoder_outputs
    # VAE posteriors and prompt embeddings from the content-keyed caches.
    latent_cache, text_cache = sdxl.training_caches(
        Path(config.output_dir) / "cache", config.pretrained_model_name_or_path,
        mixed_precision=config.mixed_precision, vae_fp32=config.no_half_vae, cache_latents=config.cache_latents,
        cache_text=not text_in_the_loop,
        image_dirs=[s.image_dir for d in datasets for s in d.subsets if s.image_dir is not None])
    # Every image is read once (errors name the file); held-out images are split off for the validation loss.
    dataset, held_out = build_split_datasets(datasets, config.seed, config.validation_split,
                                             latent_cache=latent_cache, text_cache=text_cache)
    scorer = load_scorer(config)
    print_run_plan(plan_inputs(config, datasets, dataset.encodes_in_the_loop()), config.device_memory)
    if config.dry_run:
        return None
    # Module dropout skips whole LoRAs, and SDXL reads CLIP-L's penultimate layer, so the LoRAs on its
    # last layer never get a gradient: DDP must then look for unused parameters.
    run = start_run(config.output_dir, mixed_precision=config.mixed_precision, seed=config.seed,
                    report_to=config.log_with, resume_from_checkpoint=config.resume,
                    config_toml=config_to_toml(config) + describe_datasets(datasets),
                    tensorboard_dir=config.logging_dir, samples_dir=Path(config.output_dir) / "sample",
                    command="dreamstep train sdxl-lora", resume_flag="--resume", overwrite=config.overwrite_output_dir,
                    find_unused_parameters=bool(options.module_dropout) or train_text, allow_tf32=config.allow_tf32)

    # 2. Data: the bucketed samples' loader and the step counts.
    loader, plan = loader_and_plan(run, dataset, seed=config.seed, num_workers=config.max_data_loader_n_workers,
                                   gradient_accumulation_steps=config.gradient_accumulation_steps,
                                   max_train_steps=None if config.max_train_epochs else config.max_train_steps,
                                   num_epochs=config.max_train_epochs, warmup=config.lr_warmup_steps)

    # 3. Encode (models/phases.py): both CLIP encoders and the VAE encode every caption, held-out image and sample
    # prompt while the UNet is not on the device; then those the loop does not use wait in host memory.
    base = sdxl.load_encoders_for_training(
        config.pretrained_model_name_or_path, model_config=config.model_config,
        mixed_precision=config.mixed_precision, device=run.device, vae_fp32=config.no_half_vae,
        unet_quantization=config.unet_quantization)
    pipeline = sdxl.assemble_pipeline(base)
    conditioner = sdxl.SDXLConditioner(pipeline, device=run.device, latent_cache=latent_cache, text_cache=text_cache,
                                       encode_text=not train_text)
    parking.encode_run(conditioner, dataset, held_out, epochs=plan.num_epochs)
    # Text encoders that train give the samples' embeddings anew.
    embeddings = sdxl.sample_prompt_embeddings(pipeline, prompts) if prompts and not train_text else None
    encoders = sdxl.park_encoders(base, run.device, text_in_the_loop=text_in_the_loop,
                                  latents_cached=latent_cache is not None and not dataset.encodes_in_the_loop())

    # 4. Load: the UNet frozen in the --mixed_precision dtype (quantized as asked); the Kohya network on top.
    sdxl.load_unet_for_training(
        base, config.pretrained_model_name_or_path, mixed_precision=config.mixed_precision, device=run.device,
        sdpa=config.sdpa or config.flash_attn or config.xformers, gradient_checkpointing=config.gradient_checkpointing,
        unet_quantization=config.unet_quantization, on_host=config.blocks_to_swap > 0)
    sdxl.attach_unet(pipeline, base)
    network = build_network(config, base, options)
    model = sdxl.SDXLLoraModel(base.unet, network, pipeline).train()
    swapper = prepare_blocks(base.unet, blocks_to_swap=config.blocks_to_swap, compile=config.compile,
                             device=run.device, num_processes=run.accelerator.num_processes, place=model)

    # 5. Step: optimizer over the network (UNet and text-encoder groups), schedule, scaler, clipping.
    optimizer = build_optimizer(
        config.optimizer_type, network.param_groups(config.unet_lr or config.learning_rate,
                                                    config.text_encoder_lr or config.learning_rate),
        config.learning_rate, extra=optimizer_args, flag="--optimizer_type", family="sd-scripts")
    lr_scheduler = build_lr_scheduler(config.lr_scheduler, optimizer, warmup_steps=plan.warmup_steps,
                                      total_steps=plan.total_steps, num_cycles=config.lr_scheduler_num_cycles,
                                      power=config.lr_scheduler_power)
    ema = weight_average(network, config.ema_options())
    model, optimizer = run.accelerator.prepare(model, optimizer, device_placement=[swapper is None, True])
    step = build_step(config, model, base.scheduler, optimizer=optimizer, lr_scheduler=lr_scheduler,
                      accelerator=run.accelerator, ema=ema, max_grad_norm=config.max_grad_norm or None,
                      gradient_accumulation_steps=config.gradient_accumulation_steps,
                      length_of_dataloader=len(loader))
    print_run_summary(run, dataset, plan, gradient_accumulation_steps=config.gradient_accumulation_steps,
                      mixed_precision=config.mixed_precision, trainable=(network,),
                      caches={"latents": latent_cache, "text": text_cache}, outputs=config.output_dir,
                      tokenizers={"CLIP": (pipeline.tokenizer, pipeline.tokenizer.model_max_length)})

    # 6. Loop: the engine trains and resumes; LoRA files, samples, scores and states on their cadences. Samples
    # bring back only the VAE (their prompts were encoded in step 3); the validation loss brings back nothing.
    folder = Path(config.output_dir)
    metadata = {**training_metadata(dataclasses.asdict(config), base_model=config.pretrained_model_name_or_path,
                                    steps_per_epoch=plan.steps_per_epoch),
                **network_metadata(options, network_args, config.network_module),
                **dataset_metadata(dataset.records, datasets[0].batch_size, datasets[0].buckets.resolution)}
    save_dtype = dtype_named(config.save_precision, "--save_precision") if config.save_precision else None
    writer = KohyaLoraWriter(network, folder, config.output_name, config.save_model_as, config.save_every_n_epochs,
                             plan.steps_per_epoch, plan.total_steps, save_dtype, metadata)
    sampler = (sdxl.SampleWriter(pipeline, network, prompts, folder=folder / "sample", name=config.output_name,
                                 sampler=config.sample_sampler, seed=config.seed,
                                 v_prediction=config.v_parameterization, autocast=run.accelerator.autocast,
                                 encoders=encoders, embeddings=embeddings)
               if prompts else None)
    if config.sample_at_first and sampler is not None and not run.resume_from and run.is_main_process:
        sampler(0)
    evaluator = build_evaluator(config, scorer, held_out=held_out, conditioner=conditioner,
                                loss_at=step.validation_loss_at, modules=[model], seed=config.seed,
                                subject_images=subject_image_paths(dataset, held_out), device=run.device)
    sample_every = Every(config.sample_every_n_steps, config.sample_every_n_epochs)
    validate_every = Every(config.validate_every_n_steps)
    # --eval_metrics scores the sample prompts' images (it needs --sample_prompts): they are generated at every
    # validation point; the baseline before training (step 0) has scores only.
    scored_samples = evaluator is not None and bool(config.eval_metrics)

    def sample(global_step: int) -> list:
        regular = global_step > 0 and sample_every.due(global_step, plan.steps_per_epoch)
        for_scores = scored_samples and (global_step == 0 or validate_every.due(global_step, plan.steps_per_epoch))
        return sampler(global_step) if regular or for_scores else []

    def sample_final(global_step: int) -> list:
        regular = not sample_every.due(global_step, plan.steps_per_epoch)  # not sampled at the last step yet
        for_scores = scored_samples and global_step not in run.logger.metrics.rows
        return sampler(global_step) if regular or for_scores else []

    save_every = Every(config.save_every_n_steps, config.save_every_n_epochs)
    hooks = RunHooks(sample=sample if sampler is not None else None,
                     score=(lambda _, images: evaluator(images, [p.prompt for p in prompts or []]))
                     if evaluator is not None else None,
                     sample_every=AnyOf(sample_every, validate_every), score_every=validate_every,
                     sample_first=evaluator is not None, sample_final=sample_final if sampler is not None else None,
                     save=writer.save, save_every=save_every, checkpoint_at_end=config.save_state,
                     checkpoint_every=save_every if config.save_state else Every(),
                     validation_weights=validation_weights(ema, config.ema_validation))
    result = fit(run, step, ConditionedBatches(loader, conditioner), total_steps=plan.total_steps,
                 trained=with_average(network, ema), hooks=hooks, logging_steps=config.logging_steps)

    # 7. Save: the final LoRA, final samples and scores; temporary caches removed; the summary.
    last = result.position.global_step
    written: dict[str, Path | None] = {}
    if run.is_main_process:
        written["LoRA"] = writer.save(last, final=True)
        if ema is not None:
            with ema.swapped_in():
                written["LoRA (EMA)"] = dataclasses.replace(writer, name=f"{config.output_name}_ema").save(
                    last, final=True)
        written["step/epoch LoRAs"] = folder if writer.saved else None
        written["samples"] = sampler.folder if sampler is not None and sampler.written else None
        written["config"] = folder / "config.toml"
        kept = {"latents": config.cache_latents_to_disk, "text": config.cache_text_encoder_outputs_to_disk}
        remove_caches(folder / "cache", [name for name, keep in kept.items() if not keep])

    def saved_at(global_step: int) -> Path | None:
        path = written.get("LoRA") if global_step == last else writer.path(global_step)
        return path if path is not None and path.is_file() else None

    return finish(run, written, result, hooks, best_by=config.best_metric(held_out is not None), saved_at=saved_at)
