"""FLUX.1 (dev, schnell, Kontext; its ControlNets) as a :class:`~dreamstep.models.family.ModelFamily`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dreamstep.errors import UserError

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline
    from torch import nn

    from dreamstep.models.lora_keys import ModelKeys


class FluxFamily:
    name = "flux"
    title = "FLUX.1"
    released_name = "FLUX.1-dev"
    pipeline_classes = ("FluxPipeline", "FluxKontextPipeline", "FluxControlNetPipeline", "FluxImg2ImgPipeline",
                        "FluxInpaintPipeline", "FluxFillPipeline")
    denoiser = "transformer"
    component_labels = {"transformer": "transformer", "text_encoder_2": "text_encoder_2 (T5)",
                        "text_encoder": "text_encoder (CLIP)", "vae": "vae"}
    long_text_encoder = "text_encoder_2"
    resolution_step = 16  # the VAE's 8 times the transformer's 2x2 patches
    kohya_prefixes = {"lora_unet": "transformer", "lora_te1": "text_encoder", "lora_te3": "text_encoder_2"}
    # BFL's block names, sd-scripts' T5 prefix, diffusers' single blocks, LyCORIS' names of diffusers' modules
    # (diffusers' double blocks, "transformer.transformer_blocks", are Qwen-Image's too: the weak hint tells them).
    key_hints = ("lycoris_", "double_blocks", "single_blocks", "lora_te3", "single_transformer_blocks")
    weak_key_hints = ("transformer.",)
    lycoris_readers = "ComfyUI, Forge, LyCORIS on diffusers' FLUX (SimpleTuner)"
    mindspore_port = False

    def lora_keys(self, configs: Mapping[str, Mapping] | None) -> ModelKeys:
        from dreamstep.models.flux.lora_keys import keys_from_configs

        return keys_from_configs(configs or {})

    def lora_targets(self, denoiser: nn.Module, layers: Sequence[str]) -> list[str]:
        from dreamstep.models.flux.lora_targets import flux_lora_targets

        return flux_lora_targets(denoiser, layers or ["attention"])

    def meta_components(self, folder: Path | None) -> dict[str, nn.Module]:
        from dreamstep.models.flux.meta import meta_components

        return meta_components(folder)

    def training_pass(self, denoiser: nn.Module, *, resolution: int, batch: int, text_tokens: int, train: bool,
                      image_token_multiplier: int = 1, trainable: nn.Module | None = None,
                      ) -> Callable[[], torch.Tensor | None]:
        from dreamstep.models.flux.meta import training_pass

        return training_pass(denoiser, resolution=resolution, batch=batch, text_tokens=text_tokens, train=train,
                             image_token_multiplier=image_token_multiplier, trainable=trainable)

    def loop_text_encoders(self, *, long_encoder_trains: bool) -> tuple[str, ...]:
        # CLIP trains with --train_text_encoder; T5's outputs are cached unless T5 trains too (flux-kohya's
        # train_t5xxl).
        return ("text_encoder", "text_encoder_2") if long_encoder_trains else ("text_encoder",)

    def released_components(self, configs: Mapping[str, Mapping]) -> dict[str, nn.Module]:
        from dreamstep.models.flux.meta import released_components

        return released_components(configs)

    def released_configs(self) -> dict[str, dict[str, Any]]:
        from dreamstep.models import published_configs as published

        return {"transformer": published.FLUX_DEV_TRANSFORMER, "text_encoder": published.CLIP_L_TEXT,
                "text_encoder_2": published.T5_XXL_ENCODER}


    variants = {"flux": 1, "flux-kontext": 2}  # Kontext reads the reference image's tokens beside the target's

    def build_tiny(self, variant: str, *, seed: int, guidance_embeds: bool) -> DiffusionPipeline:
        from dreamstep.models.flux.tiny import build_tiny_flux, build_tiny_flux_kontext

        if variant == "flux-kontext":
            if guidance_embeds:
                raise UserError("--guidance_embeds: flux-kontext is guidance-distilled already; remove it")
            return build_tiny_flux_kontext(seed=seed)
        return build_tiny_flux(seed=seed, guidance_embeds=guidance_embeds)

    def check_single_files(self, variant: str) -> None:
        if variant != "flux":
            raise UserError(f"--single_file: {variant} has no single files of its own; use it with flux")

    def write_single_files(self, pipe: DiffusionPipeline, out_dir: Path) -> None:
        from dreamstep.models.flux.tiny import write_flux_component_files

        write_flux_component_files(pipe, out_dir)


FAMILY = FluxFamily()
