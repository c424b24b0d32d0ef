"""Z-Image (base and Turbo) as a :class:`~dreamstep.models.family.ModelFamily`."""

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


class ZImageFamily:
    name = "z-image"
    title = "Z-Image"
    released_name = "Z-Image"
    pipeline_classes = ("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline")
    denoiser = "transformer"
    component_labels = {"transformer": "transformer", "text_encoder": "text_encoder (Qwen3)", "vae": "vae"}
    long_text_encoder = "text_encoder"
    resolution_step = 16  # the VAE's 8 times the transformer's 2x2 patches
    kohya_prefixes = {"lora_unet": "transformer", "lora_te1": "text_encoder"}
    # The refiners and the fused/feed-forward names are Z-Image's alone (diffusers' and the released layout's).
    key_hints = ("noise_refiner", "context_refiner", "attention.qkv", "attention_qkv", "feed_forward.w1",
                 "feed_forward_w1")
    weak_key_hints = ()
    lycoris_readers = "ComfyUI"
    mindspore_port = False
    variants = {"z-image": 1}
    commands = {
        ("train", "z-image-lora"): (
            "Z-Image LoRA (train_dreambooth_lora_z_image.py's flags; --validation_model_path samples with Turbo)",
            "dreamstep.recipes.z_image_lora:train", "dreamstep.config.z_image_lora:ZImageLoraConfig"),
        ("generate", "z-image"): ("generate images with Z-Image or Z-Image Turbo (+ LoRAs)",
                                  "dreamstep.commands.generate:run",
                                  "dreamstep.config.z_image_generate:ZImageGenerateConfig"),
        ("eval", "z-image"): ("score Z-Image LoRAs / checkpoints against the base model",
                              "dreamstep.commands.evaluate", None),
    }

    def lora_keys(self, configs: Mapping[str, Mapping] | None) -> ModelKeys:
        from dreamstep.models.z_image.lora_keys import keys_from_configs

        return keys_from_configs(configs or {})

    def lora_targets(self, denoiser: nn.Module, layers: Sequence[str]) -> list[str]:
        from dreamstep.models.z_image.lora_targets import z_image_lora_targets

        return z_image_lora_targets(denoiser, layers or ["attention"])

    def meta_components(self, folder: Path | None, variant: str | None = None) -> dict[str, nn.Module]:
        from dreamstep.models.z_image.meta import meta_components

        return meta_components(folder)

    def training_pass(self, denoiser: nn.Module, *, resolution: int, batch: int, text_tokens: int, train: bool,
                      image_token_multiplier: int = 1, trainable: nn.Module | None = None,
                      ) -> Callable[[], torch.Tensor | None]:
        from dreamstep.models.z_image.meta import training_pass

        return training_pass(denoiser, resolution=resolution, batch=batch, text_tokens=text_tokens, train=train,
                             image_token_multiplier=image_token_multiplier, trainable=trainable)

    def loop_text_encoders(self, *, long_encoder_trains: bool) -> tuple[str, ...]:
        return ("text_encoder",) if long_encoder_trains else ()

    def released_components(self, configs: Mapping[str, Mapping]) -> dict[str, nn.Module]:
        from dreamstep.models.z_image.meta import released_components

        return released_components(configs)

    def released_configs(self) -> dict[str, dict[str, Any]]:
        from dreamstep.models.z_image import configs

        return {"transformer": dict(configs.TRANSFORMER), "text_encoder": dict(configs.TEXT_ENCODER)}

    def check_generation_model(self, variant: str, model: str, model_config: str | None,
                               component_files: Mapping[str, str]) -> None:
        from dreamstep.models.z_image.generation import check_model

        if model_config is not None:
            raise UserError("--model_config: Z-Image loads from its diffusers folder or hub id alone; remove it")
        check_model(model)

    def generation_pipeline(self, variant: str, model: str, *, model_config: str | None, dtype: torch.dtype,
                            component_files: Mapping[str, str], controlnet: Any | None) -> DiffusionPipeline:
        from dreamstep.models.z_image.generation import pipeline

        if controlnet is not None:
            raise UserError("--controlnet: dreamstep has no Z-Image ControlNet; remove it")
        return pipeline(model, dtype)

    def sampling_defaults(self, variant: str, pipe: DiffusionPipeline, images: Sequence[Image.Image]
                          ) -> dict[str, Any]:
        from dreamstep.models.z_image.generation import sampling_defaults

        return sampling_defaults(pipe, images)

    def image_inputs(self, variant: str, images: Sequence[Image.Image], width: int, height: int) -> dict[str, Any]:
        return {}

    def build_tiny(self, variant: str, *, seed: int, guidance_embeds: bool) -> DiffusionPipeline:
        from dreamstep.models.z_image.tiny import build_tiny_z_image

        if guidance_embeds:
            raise UserError("--guidance_embeds: Z-Image has no guidance embedding; remove it")
        return build_tiny_z_image(seed=seed)

    def check_single_files(self, variant: str) -> None:
        raise UserError(f"--single_file: dreamstep trains {variant} from its diffusers folder; remove --single_file")

    def write_single_files(self, pipe: DiffusionPipeline, out_dir: Path) -> None:
        self.check_single_files("z-image")


FAMILY = ZImageFamily()
