"""sd-scripts' FLUX.1 LoRA: ``dreamstep train flux-kohya``, taking ``flux_train_network.py``'s command line as
written (see :mod:`dreamstep.config.flux_kohya` for why it is a command of its own).

Features: the base from the files users have (the transformer file as ``--pretrained_model_name_or_path`` in BFL,
ComfyUI or diffusers layout, bf16 / fp8 / GGUF, with ``--clip_l``, ``--t5xxl``, ``--ae``; or a diffusers folder);
a Kohya dataset TOML (``--dataset_config``) or Kohya's folder flags; the ``networks.lora_flux`` network on the BFL
modules (fused ``img_attn.qkv`` / ``linear1``, or ``split_qkv=True``) and CLIP-L (unless
``--network_train_unet_only``), with ``--network_args`` train_blocks, per-type ranks, in_dims, block indices, rank
and module dropout and LoRA+ ratios; sd-scripts' objective: ``--timestep_sampling sigma|uniform|sigmoid|shift|
flux_shift`` with ``--sigmoid_scale`` and ``--discrete_flow_shift`` (which also shifts the σ table of ``sigma``),
``--model_prediction_type raw|additive|sigma_scaled`` with ``--weighting_scheme``, ``--guidance_scale``,
``--loss_type`` (Huber schedules), ``--prior_loss_weight`` per regularization sample, ``--masked_loss``;
``--fp8_base``, ``--blocks_to_swap``, ``--gradient_checkpointing`` (``--cpu_offload_checkpointing``),
``--mixed_precision`` with ``--full_bf16`` / ``--full_fp16``; ``--t5xxl_max_token_length``;
``--apply_t5_attn_mask`` (T5 reads with its mask, the transformer masks T5's padding, in training and samples);
``train_t5xxl=True`` (a ``lora_te3_`` LoRA on T5-XXL, which then runs every step); latents and T5 outputs cached by
content (``--cache_*_to_disk`` keeps them); the optimizers of :mod:`dreamstep.engine.optim`
with ``--optimizer_args``; LR schedules with warm-up; ``--save_every_n_steps`` / ``--save_every_n_epochs``;
``--save_state`` + ``--resume`` (exact); ``--sample_prompts`` with sd-scripts' FLUX line options
(``--n --w --h --s --d --l --g``); TensorBoard and a loss curve.

Outputs in --output_dir: ``<output_name>.safetensors`` in sd-scripts' FLUX LoRA layout (``lora_unet_double_blocks_0_
img_attn_qkv.lora_down.weight`` …, ``.alpha``, ``lora_te1_…``, ``lora_te3_…``) with its ``ss_*`` metadata and
``sshs_*`` hashes, ``<output_name>-step00000500.*`` and ``<output_name>-000001.*`` along the way,
``checkpoint-N/`` with --save_state, ``sample/`` PNGs, ``config.toml``, TensorBoard logs and ``loss_curve.png``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from torch import nn

from dreamstep.config.flux_kohya import FluxKohyaConfig
from dreamstep.config.flux_network_args import FluxNetworkOptions
from dreamstep.config.schema import config_to_toml
from dreamstep.data import ConditionedBatches
from dreamstep.data.cache import remove_caches
from dreamstep.data.dataset_config import DatasetConfig, describe_datasets
from dreamstep.data.holdout import build_split_datasets
from dreamstep.data.sources import kohya_datasets
from dreamstep.engine.fit import FinishedRun, RunHooks, finish, fit
from dreamstep.engine.loop import Every
from dreamstep.engine.optim import build_lr_scheduler, build_optimizer, parse_optimizer_args
from dreamstep.engine.plan import check_optimization, loader_and_plan
from dreamstep.engine.run import claim_output_dir, start_run
from dreamstep.engine.summary import print_run_summary
from dreamstep.errors import UserError
from dreamstep.lora.convert import read_lora
from dreamstep.lora.io import read_lora_file
from dreamstep.lora.kohya_files import (
    FLUX_BASE_MODEL_VERSION,
    FLUX_SS_FLAG_KEYS,
    SS_FLAG_KEYS,
    KohyaLoraWriter,
    dataset_metadata,
    network_metadata,
    training_metadata,
)
from dreamstep.lora.kohya_flux_network import FluxLoRANetwork, FluxNetworkPlan, create_flux_network
from dreamstep.models import memory_plan as mp
from dreamstep.models import parking
from dreamstep.models.blocks import enable_checkpointing, prepare_blocks
from dreamstep.models.flux import plumbing as flux
from dreamstep.models.flux.family import FAMILY as FLUX
from dreamstep.models.flux.files import base_of
from dreamstep.models.flux.samples import FluxSampleWriter, read_flux_sample_prompts
from dreamstep.models.flux.step import FluxFlowMatchingStep
from dreamstep.models.plans import RunPlan, print_run_plan
from dreamstep.models.precision import dtype_named, weight_dtype_for


class FluxKohyaModel(nn.Module):
    """What DDP wraps: the transformer (with the network's hooks), CLIP-L when its LoRA trains, which then gives the
    pooled prompt embedding every step, and T5-XXL when its LoRA trains (``train_t5xxl``), which then gives the
    sequence embeddings every step (else they come from the cache)."""

    def __init__(self, transformer: nn.Module, network: FluxLoRANetwork, clip: nn.Module | None,
                 t5: nn.Module | None = None):
        super().__init__()
        self.transformer, self.network, self.clip, self.t5 = transformer, network, clip, t5

    def forward(self, pooled_projections: torch.Tensor, clip_input_ids: torch.Tensor | None,
                text_mask: torch.Tensor | None = None, t5_input_ids: torch.Tensor | None = None,
                **transformer_inputs: torch.Tensor) -> torch.Tensor:
        if self.clip is not None:
            pooled_projections = self.clip(clip_input_ids).pooler_output
        if self.t5 is not None:  # T5 reads with its mask exactly when the transformer masks (--apply_t5_attn_mask)
            transformer_inputs["encoder_hidden_states"] = flux.t5_embeddings(self.t5, t5_input_ids, text_mask)
        masks = None
        if text_mask is not None:  # --apply_t5_attn_mask: T5's padding tokens masked out of every attention
            image_tokens = transformer_inputs["hidden_states"].shape[1]
            masks = {"attention_mask": flux.joint_attention_mask(text_mask, image_tokens)}
        return self.transformer(pooled_projections=pooled_projections, joint_attention_kwargs=masks,
                                return_dict=False, **transformer_inputs)[0]


class FluxKohyaStep(FluxFlowMatchingStep):
    """sd-scripts' FLUX step (``flux_train_network.py``): the draws and the objective of the base step, read as
    ``--model_prediction_type`` and weighted as its options say (``FluxKohyaConfig.flow_matching_objective``)."""

    def predict(self, model: FluxKohyaModel, inputs: dict[str, Any], batch: dict[str, Any],
                condition: None) -> torch.Tensor:
        return model(clip_input_ids=batch.get("clip_input_ids"), text_mask=batch.get("text_mask"),
                     t5_input_ids=batch.get("t5_input_ids"), **inputs)


def sd_scripts_sigmas(discrete_flow_shift: float) -> torch.Tensor:
    """sd-scripts' training σ table (its FlowMatchEulerDiscreteScheduler(1000, shift)): σ = t/1000 for t = 1000 … 1,
    shifted as s·σ / (1 + (s - 1)·σ); ``--timestep_sampling sigma`` draws its entries."""
    return flux.training_sigmas(FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=discrete_flow_shift))


FOLDER_FLAG = "train_data_dir"  # the flag an image folder is read from (the dashboard's dataset check)


def training_datasets(config: FluxKohyaConfig) -> list[DatasetConfig]:
    return kohya_datasets(config, "train flux-kohya")


def plan_inputs(config: FluxKohyaConfig, dataset_configs: list[DatasetConfig], encodes_in_the_loop: bool) -> RunPlan:
    """The memory plan's inputs; ``encodes_in_the_loop``: the loop encodes random crops itself."""
    guidance_embeds = flux.transformer_config(config)["guidance_embeds"]  # the files' own config
    return RunPlan(FLUX.name, base_of(config).source, flux.kohya_plan_options(
        config, dataset_configs, max_sequence_length=config.max_sequence_length(guidance_embeds),
        validation_images=bool(config.sample_prompts),
        encoders_on_device=config.train_clip or not config.cache_latents or encodes_in_the_loop),
        {"lora_network": network_plan(config)})


def network_plan(config: FluxKohyaConfig) -> FluxNetworkPlan:
    """What the run's network adapts (its own target rules, on the meta-built models of the plan)."""
    options, _ = FluxNetworkOptions.from_flags(config.network_dim, config.network_alpha, config.network_dropout,
                                               config.network_args)
    return FluxNetworkPlan(options, transformer=config.train_transformer, clip=config.train_clip,
                           t5=options.train_t5xxl)


def _check_network_weights(config: FluxKohyaConfig, options: FluxNetworkOptions) -> None:
    """``--network_weights`` read as a FLUX.1 Kohya LoRA whose block ranks are the network's (sd-scripts loads
    such a file into a network of ``--network_dim`` and stops at the first size mismatch), then every tensor
    checked against the run's network built on the meta device (nothing loads, nothing is written)."""
    path = config.network_weights
    try:
        read_lora(path, FLUX.name)
        tensors = read_lora_file(path).tensors
    except UserError as e:
        raise UserError(f"--network_weights: {e}") from None
    for key, tensor in tensors.items():
        name = key.removesuffix(".lora_down.weight")
        split = options.split_qkv and name.endswith(("_qkv", "_linear1"))  # rows hold parts·dim there
        if name != key and name.startswith("lora_unet_") and "_blocks_" in name and not split:
            expected, type_key = options.rank_of(name), options.type_dim_key(name)
            flag = "--network_dim" if type_key is None else f"--network_args {type_key}"
            if expected and tensor.shape[0] != expected:
                raise UserError(f"--network_weights: {path} has rank {tensor.shape[0]} ({name}) where {flag} is "
                                f"{expected}; give {flag}={tensor.shape[0]} to continue it")
    components = FLUX.meta_components(mp.model_folder(base_of(config).source))
    with torch.device("meta"):
        network_plan(config)(components).check_weights(path)


def train(config: FluxKohyaConfig) -> FinishedRun | None:
    """Train as configured; return what was written where (nothing with --dry_run)."""
    # 1. Check and plan: every flag, key, folder, image, prompt line and the optimizer, before a model loads.
    base_of(config)  # the base's files checked, and what they tell the config, before config.toml is written
    options, network_args = FluxNetworkOptions.from_flags(config.network_dim, config.network_alpha,
                                                          config.network_dropout, config.network_args)
    if config.network_weights is not None:  # a damaged file, another model's LoRA or another rank: nothing written
        _check_network_weights(config, options)
    claim_output_dir(config.output_dir, overwrite=config.overwrite_output_dir, resume_from_checkpoint=config.resume,
                     resume_flag="--resume", config_toml=config_to_toml(config),
                     resume_must_match=config.resume_must_match)
    datasets = training_datasets(config)
    optimizer_args = parse_optimizer_args(config.optimizer_args)
    check_optimization(config.optimizer_type, config.learning_rate, lr_scheduler=config.lr_scheduler,
                       num_cycles=config.lr_scheduler_num_cycles, power=config.lr_scheduler_power,
                       optimizer_flag="--optimizer_type", extra=optimizer_args, family="sd-scripts")
    prompts = read_flux_sample_prompts(config.sample_prompts) if config.sample_prompts else None
    base_files = base_of(config)
    transformer_config = flux.transformer_config(config)  # also checks --blocks_to_swap
    options.check_blocks(transformer_config["num_layers"], transformer_config["num_single_layers"])
    guidance_embeds = transformer_config["guidance_embeds"]
    max_sequence_length = config.max_sequence_length(guidance_embeds)
    latent_cache, text_cache = flux.training_caches(
        config.cache_root(), base_files.source, revision=None, variant=None, mixed_precision=config.mixed_precision,
        max_sequence_length=max_sequence_length, cache_latents=config.cache_latents,
        image_dirs=[s.image_dir for d in datasets for s in d.subsets if s.image_dir is not None],
        files=base_files.files, t5_attention_mask=config.apply_t5_attn_mask)
    if config.train_t5:  # T5 trains: it encodes every step, nothing of the text is cached
        text_cache = None
    dataset, _ = build_split_datasets(datasets, config.seed, latent_cache=latent_cache, text_cache=text_cache)
    print_run_plan(plan_inputs(config, datasets, dataset.encodes_in_the_loop()), config.device_memory)
    if config.dry_run:
        return None
    run = start_run(config.output_dir, mixed_precision=config.mixed_precision, seed=config.seed,
                    report_to=config.log_with, resume_from_checkpoint=config.resume,
                    config_toml=config_to_toml(config) + describe_datasets(datasets),
                    tensorboard_dir=config.logging_dir, samples_dir=Path(config.output_dir) / "sample",
                    command="dreamstep train flux-kohya", resume_flag="--resume", overwrite=config.overwrite_output_dir,
                    find_unused_parameters=bool(options.module_dropout))

    # 2. Data: the bucketed samples' loader and the step counts.
    loader, plan = loader_and_plan(run, dataset, seed=config.seed, num_workers=config.max_data_loader_n_workers,
                                   gradient_accumulation_steps=config.gradient_accumulation_steps,
                                   max_train_steps=None if config.max_train_epochs else config.max_train_steps,
                                   num_epochs=config.max_train_epochs, warmup=config.lr_warmup_steps)

    # 3. Encode (models/phases.py): the VAE, then CLIP-L and T5 encode every image, caption and sample prompt
    # while the transformer is not loaded; then the encoders the loop does not use wait in host memory.
    base = flux.load_encoders_for_training(base_files.source, revision=None, variant=None,
                                           mixed_precision=config.mixed_precision, device=run.device,
                                           files=base_files.files)
    pipeline = flux.assemble_pipeline(base)
    clip = base.text_encoder if config.train_clip else None
    t5 = base.text_encoder_2 if config.train_t5 else None
    conditioner = flux.FluxConditioner(pipeline, latent_cache=latent_cache, text_cache=text_cache,
                                       max_sequence_length=max_sequence_length, device=run.device,
                                       clip_ids=clip is not None, t5_attention_mask=config.apply_t5_attn_mask)
    parking.encode_run(conditioner, dataset, None, epochs=plan.num_epochs)
    sample_texts = FluxSampleWriter.encode(conditioner, prompts) if prompts else None
    encoders = flux.park_encoders(base, run.device, text_encoder_trains=clip is not None,
                                  latents_cached=latent_cache is not None and not dataset.encodes_in_the_loop(),
                                  t5_trains=t5 is not None)

    # 4. Load: the transformer frozen in the --mixed_precision dtype (fp8 with --fp8_base or an fp8 file); the
    # network on top in fp32 (half with --full_bf16 / --full_fp16).
    flux.load_transformer_for_training(
        base, base_files.source, revision=None, variant=None, transformer_single_file=base_files.files.transformer,
        mixed_precision=config.mixed_precision, device=run.device, base_quantization=config.base_quantization,
        on_host=config.blocks_to_swap > 0)
    flux.attach_transformer(pipeline, base)
    network = create_flux_network(base.transformer if config.train_transformer else None, clip, options, t5)
    if config.network_weights is not None:
        network.load_weights(config.network_weights)
    half = config.full_fp16 or config.full_bf16
    network.to(weight_dtype_for(config.mixed_precision) if half else torch.float32)
    if clip is not None:
        clip.train()
    if t5 is not None and config.gradient_checkpointing:  # as sd-scripts: a trained T5 checkpoints and trains (its
        t5.gradient_checkpointing_enable({"use_reentrant": False})  # dropout) with --gradient_checkpointing only
        t5.train()
    if config.gradient_checkpointing:
        enable_checkpointing(base.transformer, offload_to_host=config.cpu_offload_checkpointing, device=run.device)
    base.transformer.train()
    model = FluxKohyaModel(base.transformer, network, clip, t5)
    swapper = prepare_blocks(base.transformer, blocks_to_swap=config.blocks_to_swap, compile=False,
                             device=run.device, num_processes=run.accelerator.num_processes, place=model,
                             sd_scripts_flux=True)

    # 5. Step: the optimizer over the network (transformer and CLIP groups, LoRA+), schedule, clipping.
    optimizer = build_optimizer(
        config.optimizer_type, network.param_groups(config.unet_lr or config.learning_rate,
                                                    config.text_encoder_lr or config.learning_rate,
                                                    (options.loraplus_unet, options.loraplus_text_encoder)),
        config.learning_rate, extra=optimizer_args, flag="--optimizer_type", family="sd-scripts")
    lr_scheduler = build_lr_scheduler(config.lr_scheduler, optimizer, warmup_steps=plan.warmup_steps,
                                      total_steps=plan.total_steps, num_cycles=config.lr_scheduler_num_cycles,
                                      power=config.lr_scheduler_power)
    model, optimizer = run.accelerator.prepare(model, optimizer, device_placement=[swapper is None, True])
    step = FluxKohyaStep(
        model, optimizer=optimizer, lr_scheduler=lr_scheduler, accelerator=run.accelerator,
        max_grad_norm=config.max_grad_norm or None, gradient_accumulation_steps=config.gradient_accumulation_steps,
        length_of_dataloader=len(loader), sigmas=sd_scripts_sigmas(config.discrete_flow_shift),
        objective=config.flow_matching_objective(), prior_loss_weight=config.prior_loss_weight,
        per_sample_prior_weight=True, guidance_scale=config.guidance_scale if guidance_embeds else None)
    print_run_summary(run, dataset, plan, gradient_accumulation_steps=config.gradient_accumulation_steps,
                      mixed_precision=config.mixed_precision, trainable=(network,),
                      caches={"latents": latent_cache, "text": text_cache}, outputs=config.output_dir,
                      tokenizers=flux.tokenizer_limits(pipeline, max_sequence_length))

    # 6. Loop: the engine trains and resumes; LoRA files, samples and states on their cadences.
    folder = Path(config.output_dir)
    # As sd-scripts writes them: the steps the run comes to, its store_true flags FLUX has not as false.
    flags = dataclasses.asdict(config) | {"max_train_steps": plan.total_steps, "v_parameterization": False,
                                          "zero_terminal_snr": False}
    metadata = {**training_metadata(flags, base_model=config.pretrained_model_name_or_path,
                                    steps_per_epoch=plan.steps_per_epoch, base_model_version=FLUX_BASE_MODEL_VERSION,
                                    flag_keys=SS_FLAG_KEYS | FLUX_SS_FLAG_KEYS),
                **network_metadata(options, network_args, config.network_module),
                **dataset_metadata(dataset.records, datasets[0].batch_size, datasets[0].buckets.resolution)}
    save_dtype = dtype_named(config.save_precision, "--save_precision") if config.save_precision else None
    writer = KohyaLoraWriter(network, folder, config.output_name, config.save_model_as, config.save_every_n_epochs,
                             plan.steps_per_epoch, plan.total_steps, save_dtype, metadata)
    sampler = (FluxSampleWriter(pipeline, network, prompts, sample_texts, folder=folder / "sample",
                                name=config.output_name, seed=config.seed, autocast=run.accelerator.autocast,
                                encoders=encoders, clip_trains=clip is not None, t5_trains=t5 is not None)
               if prompts else None)
    if config.sample_at_first and sampler is not None and not run.resume_from and run.is_main_process:
        sampler(0)
    sample_every = Every(config.sample_every_n_steps, config.sample_every_n_epochs)
    save_every = Every(config.save_every_n_steps, config.save_every_n_epochs)

    def sample_final(global_step: int) -> list:
        return [] if sample_every.due(global_step, plan.steps_per_epoch) else sampler(global_step)

    hooks = RunHooks(sample=sampler, sample_every=sample_every,
                     sample_final=sample_final if sampler is not None else None,
                     save=writer.save, save_every=save_every, checkpoint_at_end=config.save_state,
                     checkpoint_every=save_every if config.save_state else Every())
    result = fit(run, step, ConditionedBatches(loader, conditioner), total_steps=plan.total_steps, trained=network,
                 hooks=hooks, logging_steps=config.logging_steps)

    # 7. Save: the final LoRA and samples; temporary caches removed; the summary.
    written: dict[str, Path | None] = {}
    if run.is_main_process:
        written["LoRA"] = writer.save(result.position.global_step, final=True)
        written["step/epoch LoRAs"] = folder if writer.saved else None
        written["samples"] = sampler.folder if sampler is not None and sampler.written else None
        written["config"] = folder / "config.toml"
        kept = {"latents": config.cache_latents_to_disk, "text": config.cache_text_encoder_outputs_to_disk}
        remove_caches(config.cache_root(), [name for name, keep in kept.items() if not keep])
    return finish(run, written, result, hooks)
