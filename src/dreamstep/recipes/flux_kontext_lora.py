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

from pathlib import Path
from typing import Any

import torch
from PIL import Image

from dreamstep.config.flux_kontext_lora import FluxKontextLoraConfig
from dreamstep.config.schema import config_to_toml
from dreamstep.data.dataset import ConditionedBatches, make_dataloader
from dreamstep.data.holdout import build_split_datasets, subject_image_paths
from dreamstep.data.images import load_rgb
from dreamstep.diffusion import flow_matching as fm
from dreamstep.engine.fit import FinishedRun, RunHooks, finish, fit
from dreamstep.engine.loop import Every
from dreamstep.engine.optim import build_lr_scheduler, build_optimizer
from dreamstep.engine.plan import check_optimization, plan_steps
from dreamstep.engine.run import claim_output_dir, start_run
from dreamstep.engine.summary import print_run_summary
from dreamstep.engine.train_step import TrainStep
from dreamstep.evaluation.evaluator import build_evaluator, load_scorer
from dreamstep.lora.convert import convert_lora
from dreamstep.lora.inject import TrainableState, add_lora, flux_lora_targets, save_flux_lora
from dreamstep.models import flux, kontext, parking
from dreamstep.models.blocks import prepare_blocks
from dreamstep.models.controlnet import side_by_side
from dreamstep.models.plans import print_run_plan
from dreamstep.models.precision import cast_trainable_params_to_fp32
from dreamstep.models.vae import posterior_mean, sample_latents

KOHYA_WEIGHT_NAME = "pytorch_lora_weights_kohya.safetensors"


class FluxKontextStep(TrainStep):
    """One flow-matching step on the target's tokens, the condition image's tokens beside them."""

    def __init__(self, transformer: torch.nn.Module, *, sigmas: torch.Tensor, weighting_scheme: str,
                 logit_mean: float, logit_std: float, mode_scale: float, guidance_scale: float | None,
                 vae_encode_mode: str, **engine_options: Any):
        super().__init__(transformer, **engine_options)
        self.sigmas = sigmas  # (num_train_timesteps,): the training σ table
        self.weighting_scheme = weighting_scheme
        self.sampling = {"logit_mean": logit_mean, "logit_std": logit_std, "mode_scale": mode_scale}
        self.guidance_scale = guidance_scale
        self.encoded = sample_latents if vae_encode_mode == "sample" else posterior_mean

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        # latent_dist / condition_dist: (B, 2C, h, w) VAE posterior mean and std; the reference draws the
        # latents, then the noise, then the timesteps.
        latents = self.encoded(batch["latent_dist"])
        condition = self.encoded(batch["condition_dist"]) if "condition_dist" in batch else None
        noise = torch.randn_like(latents)
        indices = fm.sample_timestep_indices(self.weighting_scheme, len(latents), len(self.sigmas), **self.sampling)
        sigmas = fm.sigmas_at(self.sigmas, indices, latents.ndim, latents.device)
        loss = self.per_sample_loss(self.model, batch, latents, condition, noise, sigmas, self.weighting_scheme)
        return (self.scale_loss(loss.mean()),)

    def per_sample_loss(self, transformer: torch.nn.Module, batch: dict[str, torch.Tensor], latents: torch.Tensor,
                        condition: torch.Tensor | None, noise: torch.Tensor, sigmas: torch.Tensor,
                        weighting_scheme: str) -> torch.Tensor:
        """The flow-matching loss of each sample, (B,), for given latents, condition latents, noise and σ."""
        bsz, _, height, width = latents.shape
        # x_σ = (1 - σ)·x + σ·ε packed to (B, N, 4C); the condition's N' tokens follow: (B, N + N', 4C).
        packed = flux.pack(fm.noisy_latents(latents, noise, sigmas))
        hidden_states, img_ids = kontext.joined_tokens(packed, (height, width), condition)
        guidance = (torch.full((bsz,), self.guidance_scale, device=latents.device)
                    if self.guidance_scale is not None else None)
        prediction = transformer(hidden_states=hidden_states, timestep=sigmas.flatten(), guidance=guidance,
                                 pooled_projections=batch["pooled"], encoder_hidden_states=batch["prompt_embeds"],
                                 txt_ids=batch["text_ids"], img_ids=img_ids, return_dict=False)[0]
        pred = flux.unpack(kontext.target_prediction(prediction, packed.shape[1]), height, width)
        # Flow-matching target v = ε - x on the target's tokens, each sample weighted by its own σ.
        return fm.weighted_mse(pred, fm.velocity_target(latents, noise), sigmas, weighting_scheme)

    def validation_loss_at(self, batch: dict[str, torch.Tensor], latents: torch.Tensor, noise: torch.Tensor,
                           fraction: float) -> torch.Tensor:
        """Unweighted loss at the fixed σ that ``fraction`` of the schedule selects, with the condition
        posterior's mean (validation)."""
        sigmas = torch.full((len(latents), 1, 1, 1), fm.sigma_at_fraction(self.sigmas, fraction),
                            device=latents.device)
        condition = posterior_mean(batch["condition_dist"]) if "condition_dist" in batch else None
        with self.autocast():
            return self.per_sample_loss(self.unwrapped_model, batch, latents, condition, noise, sigmas, "none")


class KontextConditioner:
    """The step's inputs: what ``FluxConditioner`` gives plus the condition images' posteriors (encoded with
    the target's crop and flip, through the same latent cache) when the batch has them."""

    def __init__(self, conditioner: flux.FluxConditioner):
        self.conditioner = conditioner

    def __call__(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        inputs = self.conditioner(batch)
        if "conditioning_keys" in batch:
            inputs["condition_dist"] = self.conditioner.latents(batch, prefix="conditioning_")
        return inputs


def train(config: FluxKontextLoraConfig) -> FinishedRun | None:
    """Train as configured; return what was written where (nothing with --dry_run)."""
    # 1. Check and plan: every flag, folder, pair and image (the validation image too) and the optimizer,
    # before a model loads.
    claim_output_dir(config.output_dir, overwrite=config.overwrite_output_dir,
                     resume_from_checkpoint=config.resume_from_checkpoint, config_toml=config_to_toml(config),
                     resume_must_match=config.resume_must_match)
    check_optimization(**config.optimization())
    datasets = kontext.kontext_datasets(config)
    dataset, held_out = build_split_datasets(datasets, config.seed, config.validation_split)
    validation_image = load_rgb(Path(config.validation_image)) if config.validation_image else None
    scorer = load_scorer(config)
    flux.transformer_config(config)  # --blocks_to_swap checked before the plan, or anything is encoded
    print_run_plan("flux", config.pretrained_model_name_or_path, flux.plan_options(
        config, rank=config.rank, encoders_on_device=not config.cache_latents or dataset.encodes_in_the_loop(),
        validation_images=bool(config.validation_prompt)), config.device_memory, lora_layers=config.lora_layers)
    if config.dry_run:
        return None
    run = start_run(config.output_dir, mixed_precision=config.mixed_precision, seed=config.seed,
                    report_to=config.report_to, resume_from_checkpoint=config.resume_from_checkpoint,
                    config_toml=config_to_toml(config), command="dreamstep train flux-kontext-lora",
                    overwrite=config.overwrite_output_dir, allow_tf32=config.allow_tf32)
    loader = make_dataloader(dataset, seed=config.seed, num_workers=config.dataloader_num_workers,
                             num_replicas=run.accelerator.num_processes, rank=run.accelerator.process_index)
    plan = plan_steps(len(loader), **config.step_counts())
    run.config_toml = config.resolved_toml(plan.num_epochs)

    # 2. Data: target and condition posteriors cached (a random crop with room to move is encoded every
    # step), instruction embeddings cached.
    latent_cache, text_cache = flux.training_caches(
        Path(config.cache_dir or Path(config.output_dir) / "cache"), config.pretrained_model_name_or_path,
        revision=config.revision, variant=config.variant, mixed_precision=config.mixed_precision,
        max_sequence_length=config.max_sequence_length, cache_latents=config.cache_latents,
        image_dirs=[d for ds in datasets for s in ds.subsets for d in (s.image_dir, s.conditioning_data_dir)
                    if d is not None])
    for part in (dataset, held_out):
        if part is not None:
            part.latent_cache, part.text_cache = latent_cache, text_cache

    # 3. Encode (models/phases.py): the text encoders and the VAE encode every instruction, pair and validation
    # prompt before the transformer loads; then those the loop does not use wait in host memory.
    base = flux.load_encoders_for_training(
        config.pretrained_model_name_or_path, revision=config.revision, variant=config.variant,
        mixed_precision=config.mixed_precision, device=run.device,
        text_encoder_quantization=config.text_encoder_quantization)
    pipeline = kontext.assemble_pipeline(base)
    conditioner = KontextConditioner(flux.FluxConditioner(
        pipeline, latent_cache=latent_cache, text_cache=text_cache, max_sequence_length=config.max_sequence_length,
        device=run.device))
    prompts = [config.validation_prompt] * config.num_validation_images if config.validation_prompt else []
    parking.encode_run(conditioner.conditioner, dataset, held_out, epochs=plan.num_epochs)
    embeddings = flux.prompt_embeddings(conditioner.conditioner, prompts)
    encoders = flux.park_encoders(base, run.device, text_encoder_trains=False,
                                  latents_cached=latent_cache is not None and not dataset.encodes_in_the_loop())
    batches = ConditionedBatches(loader, conditioner)

    # 4. Load: the transformer frozen in the --mixed_precision dtype (quantized as asked); LoRA weights in fp32.
    flux.load_transformer_for_training(
        base, config.pretrained_model_name_or_path, revision=config.revision, variant=config.variant,
        transformer_single_file=config.transformer_single_file, mixed_precision=config.mixed_precision,
        device=run.device, base_quantization=config.base_quantization, on_host=config.blocks_to_swap > 0)
    flux.attach_transformer(pipeline, base)
    transformer = base.transformer
    add_lora(transformer, flux_lora_targets(transformer, config.lora_layers), config.rank,
             config.lora_alpha if config.lora_alpha is not None else config.rank, config.lora_dropout)
    cast_trainable_params_to_fp32(transformer)
    if config.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    transformer.train()
    swapper = prepare_blocks(transformer, blocks_to_swap=config.blocks_to_swap, compile=config.compile,
                             device=run.device, num_processes=run.accelerator.num_processes)

    # 5. Step: AdamW/8-bit/Prodigy over the LoRA weights, the LR schedule, clipping, accumulation.
    optimizer = build_optimizer(config.optimizer, [{"params": [p for p in transformer.parameters() if p.requires_grad],
                                                    "lr": config.learning_rate}], config.learning_rate,
                                betas=(config.adam_beta1, config.adam_beta2), weight_decay=config.adam_weight_decay,
                                eps=config.adam_epsilon)
    lr_scheduler = build_lr_scheduler(config.lr_scheduler, optimizer, warmup_steps=plan.warmup_steps,
                                      total_steps=plan.total_steps, num_cycles=config.lr_num_cycles,
                                      power=config.lr_power)
    model, optimizer = run.accelerator.prepare(transformer, optimizer, device_placement=[swapper is None, True])
    step = FluxKontextStep(
        model, optimizer=optimizer, lr_scheduler=lr_scheduler, accelerator=run.accelerator,
        max_grad_norm=config.max_grad_norm or None, gradient_accumulation_steps=config.gradient_accumulation_steps,
        length_of_dataloader=len(loader), sigmas=flux.training_sigmas(base.scheduler),
        weighting_scheme=config.weighting_scheme, logit_mean=config.logit_mean, logit_std=config.logit_std,
        mode_scale=config.mode_scale, vae_encode_mode=config.vae_encode_mode,
        guidance_scale=config.guidance_scale if transformer.config.guidance_embeds else None)
    print_run_summary(run, dataset, plan, gradient_accumulation_steps=config.gradient_accumulation_steps,
                      mixed_precision=config.mixed_precision, trainable=(transformer,),
                      caches={"latents": latent_cache, "text": text_cache}, outputs=config.output_dir,
                      tokenizers=flux.tokenizer_limits(pipeline, config.max_sequence_length))

    # 6. Loop: the engine trains, checkpoints and validates (edits of the validation image, validation loss,
    # scores); validation images bring back only the VAE, the validation loss nothing.
    evaluator = build_evaluator(config, scorer, held_out=held_out, conditioner=conditioner,
                                loss_at=step.validation_loss_at, modules=[model], seed=config.seed,
                                subject_images=subject_image_paths(dataset, held_out), device=run.device)

    def validate(global_step: int) -> list[Image.Image]:
        images = []
        if prompts:
            with encoders.on_device("vae"):
                images = _validation_images(config, pipeline, validation_image, datasets[0].buckets.resolution,
                                            embeddings)
        if evaluator is not None and global_step not in run.logger.metrics.rows:
            run.logger.log_metrics(global_step, evaluator(images, prompts))
        return [side_by_side([[validation_image, *images]])] if images and validation_image else images

    sample = validate if prompts or evaluator else None
    hooks = RunHooks(sample=sample, sample_every=Every(config.validation_steps or None),
                     sample_first=evaluator is not None, checkpoint_every=Every(config.checkpointing_steps or None),
                     checkpoints_total_limit=config.checkpoints_total_limit)
    result = fit(run, step, batches, total_steps=plan.total_steps,
                 trained=TrainableState({"transformer": transformer}), hooks=hooks,
                 on_nonfinite_loss=config.on_nonfinite_loss,
                 max_skipped_steps_fraction=config.max_skipped_steps_fraction, logging_steps=config.logging_steps)

    # 7. Save: diffusers layout (+ sd-scripts names), final samples and scores, loss curve, summary.
    written = {}
    if run.is_main_process:
        written["LoRA (diffusers)"] = save_flux_lora(config.output_dir, transformer)
        if config.save_kohya_format:
            kohya_path = Path(config.output_dir) / KOHYA_WEIGHT_NAME
            convert_lora(written["LoRA (diffusers)"], kohya_path, to="kohya", model="flux", overwrite=True)
            written["LoRA (Kohya)"] = kohya_path
    final_step = result.position.global_step
    return finish(run, written, result, sample_final=(lambda: sample(final_step)) if sample else None,
                  best_by=config.best_metric(held_out is not None))


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

