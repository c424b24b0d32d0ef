"""Memory plans of FLUX.1 and SDXL LoRA runs (see :mod:`dreamstep.models.memory_plan` for the method), built
from the model folder's configs on the meta device."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from dreamstep.errors import UserError
from dreamstep.models import memory_plan as mp
from dreamstep.models import published_configs as published
from dreamstep.config.memory import parse_bytes
from dreamstep.models.memory_plan import Line, MemoryPlan, PlanOptions

def _with_lora(model: nn.Module, rank: int, targets: list[str]) -> nn.Module:
    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets), model)
    return model


def flux_components(folder: Path | None) -> dict[str, nn.Module]:
    """The FLUX.1 components on the meta device, from ``folder``'s configs or FLUX.1-dev's."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    def config(sub: str, fallback: dict[str, Any]) -> dict[str, Any]:
        return mp.load_config(folder, sub, fallback)

    return {
        "transformer": mp.build_on_meta(FluxTransformer2DModel, config("transformer", published.FLUX_DEV_TRANSFORMER)),
        "text_encoder_2 (T5)": mp.build_on_meta(T5EncoderModel, config("text_encoder_2", published.T5_XXL_ENCODER)),
        "text_encoder (CLIP)": mp.build_on_meta(CLIPTextModel, config("text_encoder", published.CLIP_L_TEXT)),
        "vae": mp.build_on_meta(AutoencoderKL, config("vae", published.FLUX_VAE)),
    }


def sdxl_components(folder: Path | None) -> dict[str, nn.Module]:
    """The SDXL components on the meta device, from ``folder``'s configs or SDXL base 1.0's."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    def config(sub: str, fallback: dict[str, Any]) -> dict[str, Any]:
        return mp.load_config(folder, sub, fallback)

    return {
        "unet": mp.build_on_meta(UNet2DConditionModel, config("unet", published.SDXL_UNET)),
        "text_encoder (CLIP-L)": mp.build_on_meta(CLIPTextModel, config("text_encoder", published.CLIP_L_TEXT)),
        "text_encoder_2 (bigG)": mp.build_on_meta(CLIPTextModelWithProjection,
                                                  config("text_encoder_2", published.OPENCLIP_BIGG_TEXT)),
        "vae": mp.build_on_meta(AutoencoderKL, config("vae", published.SDXL_VAE)),
    }


def _flux_step(transformer: nn.Module, resolution: int, batch: int, text_tokens: int,
               controlnet: nn.Module | None = None) -> Callable[[], torch.Tensor]:
    """One training forward of the transformer (fed by ``controlnet``'s residuals when given) at
    ``resolution`` (FLUX packs 2x2 latent patches: a 1024 px image is 64 x 64 tokens), returning a loss."""
    config = transformer.config
    tokens = (resolution // 16) ** 2

    def run() -> torch.Tensor:
        dtype = transformer.dtype
        inputs = dict(
            hidden_states=torch.empty(batch, tokens, config.in_channels, dtype=dtype),
            encoder_hidden_states=torch.empty(batch, text_tokens, config.joint_attention_dim, dtype=dtype),
            pooled_projections=torch.empty(batch, config.pooled_projection_dim, dtype=dtype),
            timestep=torch.empty(batch), img_ids=torch.empty(tokens, 3), txt_ids=torch.empty(text_tokens, 3),
            guidance=torch.empty(batch) if config.guidance_embeds else None, return_dict=False)
        residuals = {}
        if controlnet is not None:
            double, single = controlnet(controlnet_cond=torch.empty_like(inputs["hidden_states"]), **inputs)
            residuals = {"controlnet_block_samples": double, "controlnet_single_block_samples": single}
        out = transformer(**inputs, **residuals)[0]
        return out.float().pow(2).mean()

    return run


def _sdxl_step(unet: nn.Module, resolution: int, batch: int, text_tokens: int) -> Callable[[], torch.Tensor]:
    config = unet.config
    side = resolution // 8

    def run() -> torch.Tensor:
        dtype = unet.dtype
        out = unet(torch.empty(batch, config.in_channels, side, side, dtype=dtype), torch.empty(batch),
                   encoder_hidden_states=torch.empty(batch, text_tokens, config.cross_attention_dim, dtype=dtype),
                   added_cond_kwargs={"text_embeds": torch.empty(batch, config.projection_class_embeddings_input_dim
                                                                 - 6 * config.addition_time_embed_dim, dtype=dtype),
                                      "time_ids": torch.empty(batch, 6)}, return_dict=False)[0]
        return out.float().pow(2).mean()

    return run


class Estimator:
    """Estimates plans of one run's models (built once on the meta device) for any :class:`PlanOptions`.

    ``arch``: "flux" or "sdxl" (a LoRA of ``rank`` on the transformer / UNet), or "flux-controlnet" (a
    ControlNet of ``controlnet_layers`` = (double, single) blocks trained beside the frozen transformer)."""

    def __init__(self, arch: str, source: str | None, rank: int = 0, lora_layers: list[str] | None = None,
                 controlnet_layers: tuple[int, int] = (4, 10)):
        from dreamstep.lora.inject import flux_lora_targets

        folder = mp.model_folder(source)
        self.arch = arch
        if arch not in ("flux", "sdxl", "flux-controlnet"):
            raise UserError(f"unknown model '{arch}'; use flux or sdxl")
        self.components = sdxl_components(folder) if arch == "sdxl" else flux_components(folder)
        for module in self.components.values():
            module.requires_grad_(False)
        self.base_name = "unet" if arch == "sdxl" else "transformer"
        self.base = self.components[self.base_name]
        if arch == "flux-controlnet":
            from diffusers import FluxControlNetModel

            with torch.device("meta"), mp.default_dtype(torch.bfloat16):
                self.trainable = FluxControlNetModel.from_transformer(
                    self.base, *controlnet_layers, attention_head_dim=self.base.config.attention_head_dim,
                    num_attention_heads=self.base.config.num_attention_heads, load_weights_from_transformer=False)
            self.trainable_label = f"ControlNet ({controlnet_layers[0]} + {controlnet_layers[1]} blocks)"
        else:
            targets = (flux_lora_targets(self.base, lora_layers or ["attention"]) if arch == "flux" else
                       # sd-scripts' networks.lora adapts every linear layer of the UNet's transformer blocks.
                       [name for name, m in self.base.named_modules()
                        if isinstance(m, nn.Linear) and ".attentions." in name])
            self.trainable = _with_lora(self.base, rank, targets)
            self.trainable_label = f"LoRA rank {rank}"
            # Activations are computed with LoRA weights in the compute dtype, as autocast runs them.
            for param in self.trainable.parameters():
                if param.requires_grad:
                    param.data = param.data.to(torch.bfloat16)
        self.blocks = ([*self.base.transformer_blocks, *self.base.single_transformer_blocks] if arch != "sdxl" else
                       [m for m in self.base.modules() if type(m).__name__ == "BasicTransformerBlock"])

    @lru_cache(maxsize=8)
    def activations(self, resolution: int, batch: int, checkpointing: bool, text_tokens: int) -> int:
        models = [self.base] if self.trainable is self.base else [self.trainable, self.base]
        for model in models:
            if checkpointing:
                model.enable_gradient_checkpointing()
            else:
                model.disable_gradient_checkpointing()
            model.train()
        if self.arch == "sdxl":
            step = _sdxl_step(self.base, resolution, batch, 77)
        else:
            step = _flux_step(self.base, resolution, batch, text_tokens,
                              controlnet=self.trainable if self.trainable is not self.base else None)
        with torch.device("meta"):
            return mp.activation_peak(nn.ModuleList(models), step)

    def __call__(self, options: PlanOptions) -> MemoryPlan:
        dtype_bytes = torch.finfo(options.weight_dtype).bits // 8
        dtype = mp.dtype_name(options.weight_dtype)
        lines = []
        for name, module in self.components.items():
            frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
            if module is self.base:
                quant = options.base_quantization
                lines.append(Line(f"{name} (frozen)", frozen, _label(quant, dtype),
                                  mp.weight_bytes(module, quant, dtype_bytes, frozen_only=True)))
                if options.blocks_to_swap:
                    swapped = mp.swapped_bytes(self.blocks, options.blocks_to_swap,
                                               lambda b: mp.weight_bytes(b, quant, dtype_bytes, frozen_only=True))
                    lines.append(Line(f"  {options.blocks_to_swap} blocks swapped to the CPU", 0, "", -swapped))
                continue
            quant = options.text_encoder_quantization if "T5" in name else "none"
            on_device = options.encoders_on_device
            lines.append(Line(name if on_device else f"{name}: off the device during the loop", frozen,
                              _label(quant, dtype), mp.weight_bytes(module, quant, dtype_bytes) if on_device else 0))
        trained = sum(p.numel() for p in self.trainable.parameters() if p.requires_grad)
        state = mp.OPTIMIZER_BYTES.get(options.optimizer, mp.OPTIMIZER_BYTES["AdamW"])
        lines.append(Line(f"{self.trainable_label}: fp32 weights + {options.optimizer} state", trained, "fp32",
                          trained * (4 + state)))
        checkpointing = "with" if options.gradient_checkpointing else "without"
        lines.append(Line(f"activations: {options.resolution}px, batch {options.batch_size}, {checkpointing} "
                          "checkpointing", 0, dtype,
                          self.activations(options.resolution, options.batch_size, options.gradient_checkpointing,
                                           options.max_sequence_length)))
        return MemoryPlan(options, lines)


def _label(quant: str, dtype: str) -> str:
    return dtype if quant == "none" else quant


def plan_report(estimator: Estimator, options: PlanOptions, device_memory: int | None,
                measured: int | None = None) -> str:
    """The plan's table, and for a card it does not fit on, the option changes that would make it fit."""
    plan = estimator(options)
    text = mp.format_plan(plan, device_memory, measured)
    if device_memory is not None and not mp.fits(plan, device_memory):
        found = mp.options_that_fit(estimator, options, device_memory, max_blocks=len(estimator.blocks) - 1,
                                    cuda=torch.cuda.is_available())
        text += "\n" + mp.suggestion_lines(found)
    return text


def print_run_plan(arch: str, source: str, options: PlanOptions, device_memory: str | None,
                   **estimator_options: Any) -> None:
    """Print a training run's plan before its models load (``device_memory`` as the user wrote it, or
    ``None`` to detect the card); ``estimator_options`` go to :class:`Estimator`."""
    from tqdm.auto import tqdm

    from dreamstep.models.loading import check_pipeline_source

    check_pipeline_source(source, "sdxl" if arch == "sdxl" else "flux")
    memory = parse_bytes(device_memory, "--device_memory") if device_memory else mp.detected_device_memory()
    estimator = Estimator(arch, source, options.rank, **estimator_options)
    tqdm.write(plan_report(estimator, options, memory))
