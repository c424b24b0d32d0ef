"""FLUX.1 (dev, schnell, Kontext; its ControlNets) as a :class:`~dreamstep.models.family.ModelFamily`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dreamstep.errors import UserError

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline
    from PIL import Image
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
    commands = {
        ("train", "flux-lora"): ("DreamBooth / captioned LoRA for FLUX.1", "dreamstep.recipes.flux_lora:train",
                                 "dreamstep.config.flux_lora:FluxLoraConfig"),
        ("train", "flux-kohya"): ("sd-scripts' FLUX.1 LoRA (flux_train_network.py's command line)",
                                  "dreamstep.recipes.flux_kohya:train", "dreamstep.config.flux_kohya:FluxKohyaConfig"),
        ("train", "flux-controlnet"): ("ControlNet for FLUX.1", "dreamstep.recipes.flux_controlnet:train",
                                       "dreamstep.config.flux_controlnet:FluxControlNetConfig"),
        ("train", "flux-kontext-lora"): ("FLUX.1 Kontext LoRA: image editing from before/after pairs",
                                         "dreamstep.recipes.flux_kontext_lora:train",
                                         "dreamstep.config.flux_kontext_lora:FluxKontextLoraConfig"),
        ("generate", "flux"): ("generate images with FLUX.1 (+ LoRAs, ControlNet)", "dreamstep.commands.generate:run",
                               "dreamstep.config.generate:FluxGenerateConfig"),
        ("generate", "flux-kontext"): ("edit an image with FLUX.1 Kontext (+ LoRAs)",
                                       "dreamstep.commands.generate:run",
                                       "dreamstep.config.generate:FluxKontextGenerateConfig"),
        ("eval", "flux"): ("score FLUX LoRAs / ControlNets / checkpoints against the base model",
                           "dreamstep.commands.evaluate", None),
        ("eval", "flux-kontext"): ("score FLUX.1 Kontext LoRAs / checkpoints against the base model",
                                   "dreamstep.commands.evaluate", None),
    }

    def lora_keys(self, configs: Mapping[str, Mapping] | None) -> ModelKeys:
        from dreamstep.models.flux.lora_keys import keys_from_configs

        return keys_from_configs(configs or {})

    def lora_targets(self, denoiser: nn.Module, layers: Sequence[str]) -> list[str]:
        from dreamstep.models.flux.lora_targets import flux_lora_targets

        return flux_lora_targets(denoiser, layers or ["attention"])

    def meta_components(self, folder: Path | None, variant: str | None = None) -> dict[str, nn.Module]:
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

    def check_generation_model(self, variant: str, model: str, model_config: str | None,
                               component_files: Mapping[str, str]) -> None:
        from dreamstep.models.flux.generation import check_model

        check_model(model, model_config, component_files)

    def generation_pipeline(self, variant: str, model: str, *, model_config: str | None, dtype: torch.dtype,
                            component_files: Mapping[str, str], controlnet: Any | None) -> DiffusionPipeline:
        from dreamstep.models.flux.generation import pipeline

        return pipeline(variant, model, model_config=model_config, dtype=dtype, component_files=component_files,
                        controlnet=controlnet)

    def sampling_defaults(self, variant: str, pipe: DiffusionPipeline, images: Sequence[Image.Image]
                          ) -> dict[str, Any]:
        from dreamstep.models.flux.generation import sampling_defaults

        return sampling_defaults(variant, pipe, images)

    def image_inputs(self, variant: str, images: Sequence[Image.Image], width: int, height: int) -> dict[str, Any]:
        from dreamstep.models.flux.generation import image_inputs

        return image_inputs(variant, images, width, height)

    def check_single_files(self, variant: str) -> None:
        if variant != "flux":
            raise UserError(f"--single_file: {variant} has no single files of its own; use it with flux")

    def write_single_files(self, pipe: DiffusionPipeline, out_dir: Path) -> None:
        from dreamstep.models.flux.tiny import write_flux_component_files

        write_flux_component_files(pipe, out_dir)


FAMILY = FluxFamily()
