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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file

from dreamstep.config.schema import config_to_toml
from dreamstep.config.z_image_lora import ZImageLoraConfig
from dreamstep.data.dataset import ConditionedBatches
from dreamstep.data.dataset_config import DatasetConfig
from dreamstep.data.holdout import build_split_datasets, subject_image_paths
from dreamstep.data.images import IMAGE_EXTENSIONS
from dreamstep.data.sources import dreambooth_datasets
from dreamstep.engine.ema import validation_weights, weight_average, with_average
from dreamstep.engine.fit import FinishedRun, RunHooks, finish, fit
from dreamstep.engine.logging import say_before_the_run
from dreamstep.engine.loop import Every
from dreamstep.engine.optim import build_lr_scheduler, build_optimizer
from dreamstep.engine.plan import check_optimization, loader_and_plan
from dreamstep.engine.run import claim_output_dir, start_run
from dreamstep.engine.summary import print_run_summary
from dreamstep.errors import UserError
from dreamstep.evaluation.evaluator import build_evaluator, load_scorer
from dreamstep.files import honour_umask
from dreamstep.lora.convert import convert_lora
from dreamstep.lora.inject import TrainableState, add_lora, save_flux_lora
from dreamstep.lora.io import write_lora_file
from dreamstep.models import parking
from dreamstep.models.blocks import enable_checkpointing, prepare_blocks
from dreamstep.models.family import check_blocks_to_swap
from dreamstep.models.memory_plan import PlanOptions
from dreamstep.models.plans import RunPlan, print_run_plan
from dreamstep.models.precision import cast_trainable_params_to_fp32, weight_dtype_for
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


def training_datasets(config: ZImageLoraConfig) -> list[DatasetConfig]:
    """What the run trains on: its dataset TOML, or the instance (and class) folders."""
    class_dir = config.class_data_dir if config.class_images_to_generate else None
    if class_dir is not None:
        _check_class_images(config)
    return dreambooth_datasets(config, class_dir, COMMAND)


@dataclass(frozen=True)
class ZImageRunPlan(RunPlan):
    """A run plan whose base is checked as a Z-Image folder (one line naming the flag)."""

    def check_source(self) -> None:
        if self.source is not None:
            zi.check_source(self.source)


def plan_inputs(config: ZImageLoraConfig, dataset_configs: list[DatasetConfig], encodes_in_the_loop: bool) -> RunPlan:
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
        max_sequence_length=config.max_sequence_length, validation_images=bool(config.validation_prompt))
    return ZImageRunPlan(FAMILY.name, config.pretrained_model_name_or_path, options,
                         {"lora_layers": config.lora_layers})


def check_base(config: ZImageLoraConfig) -> dict[str, Any]:
    """Every model flag checked before anything is written or loads: the base (and --validation_model_path) are Z-Image
    folders or hub ids, --blocks_to_swap fits the transformer; a distilled base is named once with the base to use.
    Returns the transformer's config."""
    zi.check_source(config.pretrained_model_name_or_path)
    if config.validation_model_path is not None:
        zi.check_source(config.validation_model_path, "--validation_model_path")
    found = zi.transformer_config(config.pretrained_model_name_or_path, config.revision)
    check_blocks_to_swap(config.blocks_to_swap, found["n_layers"] + 2 * found["n_refiner_layers"])
    if configs.is_distilled(config.pretrained_model_name_or_path):
        say_before_the_run(
            f"warning: --pretrained_model_name_or_path {config.pretrained_model_name_or_path} is Z-Image Turbo, a "
            f"distilled model: a LoRA trained on it breaks the distillation (its samples lose the 8-step quality). "
            f"Train on the base, {configs.BASE_ID}, and draw the validation samples with Turbo: "
            f"--validation_model_path {config.pretrained_model_name_or_path}")
    return found


def train(config: ZImageLoraConfig) -> FinishedRun | None:
    """Train as configured; return what was written where (nothing with --dry_run)."""
    # 1. Check and plan: every flag, folder and image and the optimizer, before a model loads.
    source = config.pretrained_model_name_or_path
    check_base(config)
    claim_output_dir(config.output_dir, overwrite=config.overwrite_output_dir,
                     resume_from_checkpoint=config.resume_from_checkpoint, config_toml=config_to_toml(config),
                     resume_must_match=config.resume_must_match)
    check_optimization(**config.optimization())
    datasets = training_datasets(config)
    image_dirs = [s.image_dir for d in datasets for s in d.subsets if s.image_dir is not None]
    latent_cache, text_cache = zi.training_caches(
        config.cache_root(), source, revision=config.revision, variant=config.variant,
        mixed_precision=config.mixed_precision, max_sequence_length=config.max_sequence_length,
        cache_latents=config.cache_latents, image_dirs=image_dirs)
    dataset, held_out = build_split_datasets(datasets, config.seed, config.validation_split,
                                             latent_cache=latent_cache, text_cache=text_cache)
    scorer = load_scorer(config)
    print_run_plan(plan_inputs(config, datasets, dataset.encodes_in_the_loop()), config.device_memory)
    if config.dry_run:
        return None
    run = start_run(config.output_dir, mixed_precision=config.mixed_precision, seed=config.seed,
                    report_to=config.report_to, resume_from_checkpoint=config.resume_from_checkpoint,
                    config_toml=config_to_toml(config), command=f"dreamstep {COMMAND}",
                    overwrite=config.overwrite_output_dir, allow_tf32=config.allow_tf32)

    # 2. Data: bucketed samples, posteriors and caption features from the content-keyed caches; the step counts.
    loader, plan = loader_and_plan(run, dataset, seed=config.seed, num_workers=config.dataloader_num_workers,
                                   **config.step_counts())
    run.config_toml = config.resolved_toml(plan.num_epochs)

    # 3. Encode: the VAE then Qwen3 encode every image and caption (and the validation prompts) before the
    # transformer loads; then Qwen3 waits in host memory, and the VAE too when the latents are cached.
    base = zi.load_encoders(source, revision=config.revision, variant=config.variant,
                            mixed_precision=config.mixed_precision,
                            text_encoder_quantization=config.text_encoder_quantization)
    conditioner = zi.ZImageConditioner(base, latent_cache=latent_cache, text_cache=text_cache,
                                       max_sequence_length=config.max_sequence_length, device=run.device)
    zi.encode_run(conditioner, dataset, held_out, epochs=plan.num_epochs)
    sampler = _Sampler(config, base, conditioner) if config.validation_prompt else None
    vae_in_the_loop = latent_cache is None or dataset.encodes_in_the_loop()
    encoders = parking.ParkedModules({"text_encoder": base.text_encoder,
                                      **({} if vae_in_the_loop else {"vae": base.vae})}, run.device)
    encoders.park()
    if vae_in_the_loop:
        parking.place(base.vae, run.device)
    batches = ConditionedBatches(loader, conditioner)

    # 4. Load: the transformer frozen in the --mixed_precision dtype (quantized as asked); LoRA weights in fp32.
    transformer = zi.load_transformer(source, revision=config.revision, variant=config.variant,
                                      mixed_precision=config.mixed_precision, device=run.device,
                                      base_quantization=config.base_quantization, on_host=config.blocks_to_swap > 0)
    base.transformer = transformer
    add_lora(transformer, z_image_lora_targets(transformer, config.lora_layers), config.rank, config.alpha,
             config.lora_dropout)
    cast_trainable_params_to_fp32(transformer)
    if config.gradient_checkpointing:
        enable_checkpointing(transformer, offload_to_host=config.cpu_offload_checkpointing, device=run.device)
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
    ema = weight_average(transformer, config.ema_options())
    model, optimizer = run.accelerator.prepare(transformer, optimizer, device_placement=[swapper is None, True])
    step = ZImageFlowMatchingStep(
        model, optimizer=optimizer, lr_scheduler=lr_scheduler, accelerator=run.accelerator, ema=ema,
        max_grad_norm=config.max_grad_norm or None, gradient_accumulation_steps=config.gradient_accumulation_steps,
        length_of_dataloader=len(loader), sigmas=zi.training_sigmas(base.scheduler),
        objective=config.flow_matching_objective(), prior_loss_weight=config.prior_loss_weight)
    print_run_summary(run, dataset, plan, gradient_accumulation_steps=config.gradient_accumulation_steps,
                      mixed_precision=config.mixed_precision, trainable=(transformer,),
                      caches={"latents": latent_cache, "text": text_cache}, outputs=config.output_dir,
                      tokenizers={"Qwen3": (base.tokenizer, config.max_sequence_length)})

    # 6. Loop: the engine trains, checkpoints and validates (samples, then the validation loss and scores).
    evaluator = build_evaluator(config, scorer, held_out=held_out, conditioner=conditioner,
                                loss_at=step.validation_loss_at, modules=[model], seed=config.seed,
                                subject_images=subject_image_paths(dataset, held_out), device=run.device)
    prompts = [config.validation_prompt] * config.num_validation_images if config.validation_prompt else []
    drawn: dict[int, list[Image.Image]] = {}  # the samples of the last step sampled, for its scores

    def sample(global_step: int) -> list[Image.Image]:
        with encoders.on_device("vae"):
            drawn[global_step] = sampler(transformer, datasets[0].buckets.resolution)
        return sampler.labelled(drawn[global_step])

    hooks = RunHooks(sample=sample if sampler is not None else None,
                     score=(lambda at, _: evaluator(drawn.pop(at, []), prompts)) if evaluator is not None else None,
                     sample_every=Every(config.validation_steps or None), sample_first=evaluator is not None,
                     checkpoint_every=Every(config.checkpointing_steps or None),
                     checkpoints_total_limit=config.checkpoints_total_limit,
                     validation_weights=validation_weights(ema, config.ema_validation))
    result = fit(run, step, batches, total_steps=plan.total_steps,
                 trained=with_average(TrainableState({"transformer": transformer}), ema), hooks=hooks,
                 on_nonfinite_loss=config.on_nonfinite_loss,
                 max_skipped_steps_fraction=config.max_skipped_steps_fraction, logging_steps=config.logging_steps)

    # 7. Save: the diffusers layout and ComfyUI's, final samples and scores, loss curve, summary.
    written: dict[str, Path | None] = {}
    if run.is_main_process:
        written["LoRA (diffusers)"] = save_flux_lora(config.output_dir, transformer, weight_name=LORA_WEIGHT_NAME)
        written["LoRA (ComfyUI)"] = save_comfyui_lora(written["LoRA (diffusers)"],
                                                      Path(config.output_dir) / COMFYUI_WEIGHT_NAME)
        if config.save_kohya_format:
            kohya_path = Path(config.output_dir) / KOHYA_WEIGHT_NAME
            convert_lora(written["LoRA (diffusers)"], kohya_path, to="kohya", model=FAMILY.name, overwrite=True)
            written["LoRA (Kohya)"] = kohya_path
        if ema is not None:
            with ema.swapped_in():
                written["LoRA (EMA)"] = save_flux_lora(config.output_dir, transformer, weight_name=EMA_WEIGHT_NAME)
    return finish(run, written, result, hooks, best_by=config.best_metric(held_out is not None))


def save_comfyui_lora(diffusers_file: Path, path: Path) -> Path:
    """The diffusers-layout file (alpha already folded into lora_B) under ComfyUI's Z-Image names, no header."""
    write_lora_file(path, comfyui_state_dict(load_file(str(diffusers_file))), {}, "safetensors")
    honour_umask(path)
    return path


def _check_class_images(config: ZImageLoraConfig) -> None:
    folder = Path(config.class_data_dir)
    found = [p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS] if folder.is_dir() else []
    if len(found) < config.num_class_images:
        raise UserError(f"--class_data_dir {folder} holds {len(found)} images, --num_class_images asks for "
                        f"{config.num_class_images}; add class images (e.g. from 'dreamstep generate') or lower "
                        "--num_class_images")


class _Sampler:
    """The validation samples: the prompt's caption features (and the empty prompt's, for guidance) encoded now,
    drawn later by the base's transformer carrying the LoRA, or with ``--validation_model_path`` by that checkpoint's
    weights swapped into it for the draw (same architecture; the LoRA layers stay) and its scheduler."""

    def __init__(self, config: ZImageLoraConfig, base: zi.ZImageComponents, conditioner: zi.ZImageConditioner):
        self.config = config
        self.base = base
        self.model = config.validation_model_path or config.pretrained_model_name_or_path
        distilled = configs.is_distilled(self.model)
        recommended = configs.TURBO_SAMPLING if distilled else configs.BASE_SAMPLING
        self.steps = config.validation_inference_steps or recommended["steps"]
        self.guidance = (config.validation_guidance_scale if config.validation_guidance_scale is not None
                         else recommended["guidance_scale"])
        self.embeddings = {config.validation_prompt: conditioner.prompts([config.validation_prompt])}
        self.negative = conditioner.prompts([""]) if self.guidance > 0 else None
        self.weights: dict[str, torch.Tensor] | None = None
        self.scheduler = base.scheduler
        if config.validation_model_path is not None:
            other, self.scheduler = zi.load_sampling_model(config.validation_model_path, revision=None, variant=None,
                                                           mixed_precision=config.mixed_precision)
            self.weights = other.state_dict()

    def __call__(self, transformer: torch.nn.Module, size: tuple[int, int]) -> list[Image.Image]:
        was_training = transformer.training
        transformer.eval()
        try:
            with self._weights_of_the_validation_model_path(transformer):
                pipe = zi.ZImageComponents(scheduler=self.scheduler, vae=self.base.vae,
                                           text_encoder=self.base.text_encoder, tokenizer=self.base.tokenizer,
                                           ).pipeline(transformer)
                images = zi.generate(pipe, [self.config.validation_prompt] * self.config.num_validation_images,
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
