"""Krea 2 DreamBooth LoRA: ``dreamstep train krea2-lora``, diffusers' ``train_dreambooth_lora_krea2.py``.

The Z-Image trainer's features (:mod:`dreamstep.recipes.z_image_lora`) with Krea 2's model: a draw from Qwen-Image's
VAE posterior, normalised per channel; 2x2 patches; the timestep σ; the features of twelve Qwen3-VL layers with their
mask, cached; train on RAW and draw the validation samples with ``--validation_model_path`` Turbo (8 steps, no
guidance, its fixed shift) carrying the LoRA, as the Krea 2 authors recommend.

Outputs in --output_dir: ``pytorch_lora_weights.safetensors`` (diffusers layout, what
``Krea2Pipeline.load_lora_weights`` reads), ``pytorch_lora_weights_comfyui.safetensors`` (``diffusion_model.`` + the
released module names, ``blocks.N.attn.wq`` ..., as ComfyUI and Krea's own trainer name them; diffusers reads it too),
with --save_kohya_format ``pytorch_lora_weights_kohya.safetensors``, with --ema_decay
``pytorch_lora_weights_ema.safetensors``, ``samples/``, ``loss_curve.png``, TensorBoard event files,
``checkpoint-N/``, ``cache/`` and ``config.toml``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dreamstep.config.krea2_lora import Krea2LoraConfig
from dreamstep.data.cache import TensorCache
from dreamstep.data.dataset import BucketDataset
from dreamstep.data.dataset_config import DatasetConfig
from dreamstep.engine.fit import FinishedRun
from dreamstep.models.krea2 import configs
from dreamstep.models.krea2 import plumbing as k2
from dreamstep.models.krea2.family import FAMILY
from dreamstep.models.krea2.lora_keys import comfyui_state_dict
from dreamstep.models.krea2.lora_targets import krea2_lora_targets
from dreamstep.models.krea2.step import Krea2FlowMatchingStep
from dreamstep.models.plans import RunPlan
from dreamstep.recipes import z_image_lora as dit

FOLDER_FLAG = "instance_data_dir"

KREA2 = dit.DitLora(
    family=FAMILY, kind=k2.KREA2, step_class=Krea2FlowMatchingStep, conditioner_class=k2.Krea2Conditioner,
    generate=k2.generate, is_distilled=configs.is_distilled, distilled_title="Krea 2 Turbo", base_id=configs.RAW_ID,
    distilled_sampling=configs.TURBO_SAMPLING, base_sampling=configs.RAW_SAMPLING,
    block_count=lambda found: found["num_layers"], lora_targets=krea2_lora_targets,
    comfyui_state_dict=comfyui_state_dict, pipeline_options=("text_encoder_select_layers", "is_distilled"))


def training_datasets(config: Krea2LoraConfig) -> list[DatasetConfig]:
    return dit.training_datasets(config, KREA2)


def plan_inputs(config: Krea2LoraConfig, dataset_configs: list[DatasetConfig], encodes_in_the_loop: bool) -> RunPlan:
    return dit.plan_inputs(config, dataset_configs, encodes_in_the_loop, KREA2)


def held_out_loss(config: Krea2LoraConfig, held_out: BucketDataset, pipeline: Any, text_cache: TensorCache,
                  device: torch.device) -> Callable[[torch.nn.Module | None], float]:
    """The validation loss the run logged, for ``dreamstep eval`` (:func:`dit.held_out_loss`)."""
    return dit.held_out_loss(config, held_out, pipeline, text_cache, device, KREA2)


def train(config: Krea2LoraConfig) -> FinishedRun | None:
    """Train as configured; return what was written where (nothing with --dry_run)."""
    return dit.train(config, KREA2)
