"""Qwen-Image-Edit LoRA (image editing from before/after pairs): ``dreamstep train qwen-image-edit-lora``.

Features: pairs as ``train flux-kontext-lora`` takes them (two folders of same-named "after" and "before" images with
caption files or ``--instance_prompt``, a metadata table with ``--dataset_name``, or a dataset TOML whose subsets
have ``conditioning_data_dir``); the step is the edit pipeline's own forward (diffusers has no Qwen-Image-Edit
training script): the reference's latents (the posterior's mode, same crop, flip and bucket as the target) packed
after the noisy target's, ``img_shapes`` naming both, the instruction encoded by the Qwen2.5-VL with the reference
image (Edit-Plus' "Picture 1:" template, the image at 384² of area), the prediction cut to the target's tokens;
the flow-matching loss of ``train dreambooth_lora_qwen_image.py`` on the target. Targets, references and
instruction embeddings cached, the Qwen2.5-VL dropped before the transformer loads; LoRA on the transformer
(``--lora_layers``), quantized base, block swap, the memory plan (twice the image tokens), resumable checkpoints,
validation edits of ``--validation_image``, the validation loss.

Outputs in --output_dir: as ``train qwen-image-lora`` (``pytorch_lora_weights.safetensors``, what
``QwenImageEditPlusPipeline.load_lora_weights`` reads, and ``pytorch_lora_weights_comfyui.safetensors``).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from PIL import Image

from dreamstep.config.qwen_image_edit_lora import QwenImageEditLoraConfig
from dreamstep.config.schema import config_to_toml
from dreamstep.data.dataset import ConditionedBatches
from dreamstep.data.dataset_config import DatasetConfig
from dreamstep.data.edit_pairs import edit_pair_datasets, read_validation_image
from dreamstep.data.holdout import build_split_datasets
from dreamstep.engine.fit import FinishedRun, finish, fit_from_options, hooks_from_options
from dreamstep.engine.plan import check_optimization, loader_and_plan
from dreamstep.engine.run import claim_output_dir, start_run
from dreamstep.engine.summary import print_run_summary
from dreamstep.errors import UserError
from dreamstep.evaluation.evaluator import build_evaluator, load_scorer
from dreamstep.lora.inject import TrainableState
from dreamstep.models import parking
from dreamstep.models.flow_step import condition_latents
from dreamstep.models.plans import RunPlan
from dreamstep.models.qwen_image import edit
from dreamstep.models.qwen_image import plumbing as qwen
from dreamstep.models.qwen_image.family import FAMILY
from dreamstep.models.qwen_image.lora_targets import qwen_image_lora_targets
from dreamstep.models.qwen_image.step import QwenImageFlowMatchingStep
from dreamstep.models.qwen_image.vl_processor import image_text_processor
from dreamstep.models.vae import posterior_mean, sample_latents
from dreamstep.recipes.qwen_image_lora import load_lora_transformer, print_plan, save_loras, validation_images

COMMAND = "train qwen-image-edit-lora"
FOLDER_FLAG = "instance_data_dir"  # the flag an image folder is read from (the dashboard's dataset check)
EDIT_PIPELINES = (QwenImageEditPlusPipeline.__name__, QwenImageEditPipeline.__name__)


class QwenImageEditStep(QwenImageFlowMatchingStep):
    """The edit pipeline's forward as a training step: the reference's packed tokens after the noisy target's,
    ``img_shapes`` naming both, the prediction of the target's tokens kept. The reference's latents are its
    posterior's mode (the pipeline's ``argmax``); the target's too, or with ``vae_encode_mode="sample"`` a draw."""

    def __init__(self, transformer: torch.nn.Module, *, vae_encode_mode: str, **options: Any):
        super().__init__(transformer, **options)
        self.draws = vae_encode_mode == "sample"

    def target(self, batch: dict[str, Any]) -> torch.Tensor:
        return sample_latents(batch["latent_dist"]) if self.draws else posterior_mean(batch["latent_dist"])

    def condition(self, batch: dict[str, Any], sample: bool) -> list[torch.Tensor]:
        return [condition_latents(batch, sample=False)]

    def predict(self, model: torch.nn.Module, inputs: dict[str, Any], batch: dict[str, Any],
                condition: list[torch.Tensor]) -> torch.Tensor:
        prediction = model(**edit.joined_inputs(inputs, condition), return_dict=False)[0]
        return prediction[:, :inputs["hidden_states"].shape[1]]


def training_datasets(config: QwenImageEditLoraConfig) -> list[DatasetConfig]:
    datasets = edit_pair_datasets(config)
    if datasets[0].method != "controlnet":
        raise UserError(f"--dataset_config {config.dataset_config}: Qwen-Image-Edit trains on pairs; give each subset "
                        "a conditioning_data_dir of reference images")
    return datasets


def plan_inputs(config: QwenImageEditLoraConfig, dataset_configs: list[DatasetConfig],
                encodes_in_the_loop: bool) -> RunPlan:
    """The memory plan's inputs: the transformer reads the reference's tokens beside the target's."""
    return RunPlan(FAMILY.name, config.pretrained_model_name_or_path, qwen.plan_options(
        config, dataset_configs, validation_images=bool(config.validation_prompt), image_token_multiplier=2,
        encoders_on_device=not config.cache_latents or encodes_in_the_loop), {"lora_layers": config.lora_layers})


def check_edit_base(source: str) -> str:
    """The base is a Qwen-Image-Edit folder (or a hub id): a text-to-image folder has no processor."""
    found = qwen.check_base(source)
    if qwen.pipeline_class_of(found) not in (None, *EDIT_PIPELINES):
        raise UserError(f"--pretrained_model_name_or_path {source}: holds a {qwen.pipeline_class_of(found)}, not "
                        "Qwen-Image-Edit; train it with dreamstep train qwen-image-lora, or give an Edit base")
    return found


def train(config: QwenImageEditLoraConfig) -> FinishedRun | None:
    """Train as configured; return what was written where (nothing with --dry_run)."""
    # 1. Check and plan: the base, every flag, pair and image, and the optimizer, before a model loads.
    source = check_edit_base(config.pretrained_model_name_or_path)
    claim_output_dir(config.output_dir, overwrite=config.overwrite_output_dir,
                     resume_from_checkpoint=config.resume_from_checkpoint, config_toml=config_to_toml(config),
                     resume_must_match=config.resume_must_match)
    check_optimization(**config.optimization())
    datasets = training_datasets(config)
    latent_cache, text_cache = qwen.training_caches(config, datasets)
    dataset, held_out = build_split_datasets(datasets, config.seed, config.validation_split,
                                             latent_cache=latent_cache, text_cache=None)
    reference = read_validation_image(config.validation_image)
    scorer = load_scorer(config)
    qwen_image_lora_targets(qwen.meta_transformer(config), config.lora_layers)
    print_plan(plan_inputs(config, datasets, dataset.encodes_in_the_loop()), config.device_memory)
    if config.dry_run:
        return None
    run = start_run(config.output_dir, mixed_precision=config.mixed_precision, seed=config.seed,
                    report_to=config.report_to, resume_from_checkpoint=config.resume_from_checkpoint,
                    config_toml=config_to_toml(config), command=f"dreamstep {COMMAND}",
                    overwrite=config.overwrite_output_dir, allow_tf32=config.allow_tf32)
    loader, plan = loader_and_plan(run, dataset, seed=config.seed, num_workers=config.dataloader_num_workers,
                                   **config.step_counts())
    run.config_toml = config.resolved_toml(plan.num_epochs)

    # 2. Encode: the VAE encodes targets and references, then the Qwen2.5-VL every instruction with its reference
    # (and the validation prompt with --validation_image); then the Qwen2.5-VL is dropped.
    edit_class = (QwenImageEditPipeline if qwen.pipeline_class_of(source) == QwenImageEditPipeline.__name__
                  else QwenImageEditPlusPipeline)
    pipeline = qwen.load_encoders_for_training(source, revision=config.revision, variant=config.variant,
                                               mixed_precision=config.mixed_precision,
                                               text_encoder_quantization=config.text_encoder_quantization,
                                               pipeline_class=edit_class,
                                               processor=image_text_processor(source, revision=config.revision))
    conditioner = edit.EditConditioner(pipeline, dataset, latent_cache=latent_cache, text_cache=text_cache,
                                       device=run.device, held_out=held_out)
    qwen.encode_run(conditioner, dataset, held_out, epochs=plan.num_epochs, fill_texts=edit.fill_edit_texts)
    prompts = [config.validation_prompt] * config.num_validation_images if config.validation_prompt else []
    embeddings = ({p: edit.join_prompts([edit.encode_edit_prompt(pipeline, p, [reference])], run.device)
                   for p in (config.validation_prompt, "")} if prompts else {})
    encoders = qwen.free_text_encoder_and_park_vae(
        pipeline, run.device, latents_cached=latent_cache is not None and not dataset.encodes_in_the_loop())

    # 3. Load, and the step: the LoRA'd transformer, AdamW/8-bit/Prodigy, the LR schedule, clipping, accumulation.
    lora = load_lora_transformer(config, source, pipeline, run, plan)
    transformer, model, ema = lora.transformer, lora.model, lora.ema
    step = QwenImageEditStep(model, **lora.step_options(config, pipeline, len(loader)),
                             vae_encode_mode=config.vae_encode_mode)
    print_run_summary(run, dataset, plan, gradient_accumulation_steps=config.gradient_accumulation_steps,
                      mixed_precision=config.mixed_precision, trainable=(transformer,),
                      caches={"latents": latent_cache, "text": text_cache}, outputs=config.output_dir)
    evaluator = build_evaluator(config, scorer, held_out=held_out, conditioner=conditioner,
                                loss_at=step.validation_loss_at, modules=[model], seed=config.seed,
                                subject_images=[], device=run.device)

    def sample(global_step: int) -> list[Image.Image]:
        with encoders.on_device("vae"):
            return validation_images(config, pipeline, datasets[0].buckets.resolution, embeddings,
                                     image=[reference])

    hooks = hooks_from_options(config, sample=sample if prompts else None,
                               score=(lambda _, images: evaluator(images, prompts)) if evaluator is not None else None,
                               ema=ema)
    result = fit_from_options(run, step, ConditionedBatches(loader, conditioner), config,
                              total_steps=plan.total_steps,
                              trained=TrainableState({"transformer": transformer}), ema=ema, hooks=hooks)

    # 5. Save: diffusers' layout and ComfyUI's (and Kohya's, the EMA's).
    written = save_loras(config, transformer, ema) if run.is_main_process else {}
    parking.free_device_memory(run.device)
    return finish(run, written, result, hooks, best_by=config.best_metric(held_out is not None))


