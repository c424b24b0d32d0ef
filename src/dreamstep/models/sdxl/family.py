"""SDXL (base 1.0 and models of its architecture) as a :class:`~dreamstep.models.family.ModelFamily`."""

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


class SdxlFamily:
    name = "sdxl"
    title = "SDXL"
    released_name = "SDXL base 1.0"
    pipeline_classes = ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline",
                        "StableDiffusionXLInpaintPipeline")
    denoiser = "unet"
    component_labels = {"unet": "unet", "text_encoder": "text_encoder (CLIP-L)",
                        "text_encoder_2": "text_encoder_2 (bigG)", "vae": "vae"}
    long_text_encoder = None
    resolution_step = 8  # the VAE's factor
    kohya_prefixes = {"lora_unet": "unet", "lora_te1": "text_encoder", "lora_te2": "text_encoder_2"}
    # The original (SGM) UNet names of sd-scripts' files, its second text encoder, diffusers' and MindSpore's UNet.
    key_hints = ("input_blocks", "middle_block", "output_blocks", "lora_te2", "unet.", "lora_unet.")
    weak_key_hints = ()
    lycoris_readers = "ComfyUI, Forge, A1111, sd-scripts with lycoris.kohya"
    mindspore_port = True
    commands = {
        ("train", "sdxl-lora"): ("Kohya-compatible LoRA for SDXL", "dreamstep.recipes.sdxl_lora:train",
                                 "dreamstep.config.sdxl_lora:SDXLLoraConfig"),
        ("generate", "sdxl"): ("generate images with SDXL (+ LoRAs)", "dreamstep.commands.generate:run",
                               "dreamstep.config.generate:SdxlGenerateConfig"),
        ("eval", "sdxl"): ("score SDXL LoRAs / checkpoints against the base model", "dreamstep.commands.evaluate",
                           None),
    }

    def lora_keys(self, configs: Mapping[str, Mapping] | None) -> ModelKeys:
        from dreamstep.models.sdxl.lora_keys import keys_from_configs

        return keys_from_configs(configs or {})

    def lora_targets(self, denoiser: nn.Module, layers: Sequence[str]) -> list[str]:
        from torch import nn

        if layers:
            raise UserError("--lora_layers: SDXL LoRAs adapt sd-scripts' networks.lora set; leave it out")
        # sd-scripts' networks.lora adapts every linear layer of the UNet's transformer blocks.
        return [name for name, m in denoiser.named_modules() if isinstance(m, nn.Linear) and ".attentions." in name]

    def meta_components(self, folder: Path | None, variant: str | None = None) -> dict[str, nn.Module]:
        from dreamstep.models.sdxl.meta import meta_components

        return meta_components(folder)

    def training_pass(self, denoiser: nn.Module, *, resolution: int, batch: int, text_tokens: int, train: bool,
                      image_token_multiplier: int = 1, trainable: nn.Module | None = None,
                      ) -> Callable[[], torch.Tensor | None]:
        from dreamstep.models.sdxl.meta import training_pass

        return training_pass(denoiser, resolution=resolution, batch=batch, train=train)

    def loop_text_encoders(self, *, long_encoder_trains: bool) -> tuple[str, ...]:
        return ("text_encoder", "text_encoder_2")

    def released_components(self, configs: Mapping[str, Mapping]) -> dict[str, nn.Module]:
        from dreamstep.models.sdxl.meta import released_components

        return released_components(configs)

    def released_configs(self) -> dict[str, dict[str, Any]]:
        from dreamstep.models import published_configs as published

        return {"unet": published.SDXL_UNET, "text_encoder": published.CLIP_L_TEXT,
                "text_encoder_2": published.OPENCLIP_BIGG_TEXT}

    variants = {"sdxl": 1}

    def check_generation_model(self, variant: str, model: str, model_config: str | None,
                               component_files: Mapping[str, str]) -> None:
        from dreamstep.models.sdxl.generation import check_model

        check_model(model, model_config, component_files)

    def generation_pipeline(self, variant: str, model: str, *, model_config: str | None, dtype: torch.dtype,
                            component_files: Mapping[str, str], controlnet: Any | None) -> DiffusionPipeline:
        from dreamstep.models.sdxl.generation import pipeline

        return pipeline(model, model_config=model_config, dtype=dtype)

    def sampling_defaults(self, variant: str, pipe: DiffusionPipeline, images: Sequence[Image.Image]
                          ) -> dict[str, Any]:
        from dreamstep.models.sdxl.generation import sampling_defaults

        return sampling_defaults(pipe, images)

    def image_inputs(self, variant: str, images: Sequence[Image.Image], width: int, height: int) -> dict[str, Any]:
        return {}

    def build_tiny(self, variant: str, *, seed: int, guidance_embeds: bool) -> DiffusionPipeline:
        from dreamstep.models.sdxl.tiny import build_tiny_sdxl

        if guidance_embeds:
            raise UserError("--guidance_embeds applies to flux only; remove it for sdxl")
        return build_tiny_sdxl(seed=seed)

    def check_single_files(self, variant: str) -> None:
        pass  # the SGM-layout checkpoint, as sd_xl_base_1.0.safetensors

    def write_single_files(self, pipe: DiffusionPipeline, out_dir: Path) -> None:
        from dreamstep.models.sdxl.sgm_keys import save_sdxl_single_file
        from dreamstep.models.sdxl.tiny import SINGLE_FILE_NAME

        save_sdxl_single_file(pipe, out_dir / SINGLE_FILE_NAME)


FAMILY = SdxlFamily()
