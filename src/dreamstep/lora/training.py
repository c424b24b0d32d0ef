"""What every LoRA trainer of a transformer sets up between loading the base and the loop: the LoRA in fp32 on the
chosen layers, gradient checkpointing and block swapping as asked, the optimizer over the LoRA weights, its schedule
and the EMA, prepared by the run's accelerator. The diffusers-style trainers (Kontext, FLUX.2, Qwen-Image, Z-Image,
Krea 2) share it; a trainer with text-encoder groups or a network of its own (flux-lora, sdxl-lora, flux-kohya)
builds its optimizer itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from dreamstep.engine.ema import weight_average
from dreamstep.engine.optim import build_lr_scheduler, build_optimizer
from dreamstep.lora.inject import add_lora
from dreamstep.models.blocks import enable_checkpointing, prepare_blocks
from dreamstep.models.precision import cast_trainable_params_to_fp32


@dataclass(frozen=True)
class LoraTraining:
    """What trains: ``model`` (the transformer as the accelerator prepared it), its optimizer, schedule and EMA."""

    model: nn.Module
    optimizer: Any
    lr_scheduler: Any
    ema: Any | None


def prepare_lora_training(transformer: nn.Module, targets: list[str], config: Any, run: Any,
                          plan: Any) -> LoraTraining:
    """Add a LoRA on ``targets`` to the frozen ``transformer`` and set up its training from ``config``'s LoRA
    (``rank``, ``alpha``, ``lora_dropout``), memory (``gradient_checkpointing``, ``cpu_offload_checkpointing``,
    ``blocks_to_swap``, ``compile``), optimizer and schedule flags; ``plan``: the run's step counts."""
    add_lora(transformer, targets, config.rank, config.alpha, config.lora_dropout)
    cast_trainable_params_to_fp32(transformer)
    if config.gradient_checkpointing:
        enable_checkpointing(transformer, offload_to_host=config.cpu_offload_checkpointing, device=run.device)
    transformer.train()
    swapper = prepare_blocks(transformer, blocks_to_swap=config.blocks_to_swap, compile=config.compile,
                             device=run.device, num_processes=run.accelerator.num_processes)
    optimizer = build_optimizer(config.optimizer, [{"params": [p for p in transformer.parameters() if p.requires_grad],
                                                    "lr": config.learning_rate}], config.learning_rate,
                                betas=(config.adam_beta1, config.adam_beta2), weight_decay=config.adam_weight_decay,
                                eps=config.adam_epsilon)
    lr_scheduler = build_lr_scheduler(config.lr_scheduler, optimizer, warmup_steps=plan.warmup_steps,
                                      total_steps=plan.total_steps, num_cycles=config.lr_num_cycles,
                                      power=config.lr_power)
    ema = weight_average(transformer, config.ema_options())
    model, optimizer = run.accelerator.prepare(transformer, optimizer, device_placement=[swapper is None, True])
    return LoraTraining(model, optimizer, lr_scheduler, ema)
