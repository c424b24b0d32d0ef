"""Qwen-Image and Qwen-Image-Edit (Edit, Edit-Plus) as a :class:`~dreamstep.models.family.ModelFamily`."""

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

# FLUX.1 has 19 double blocks (``transformer_blocks.0`` to ``.18``); Qwen-Image has 60, so a block index of 19 or
# more is Qwen-Image's. The single-stream ``single_transformer_blocks.N.`` of FLUX is told by FLUX's own hint first.
_DEEP_BLOCKS = tuple(f"transformer_blocks.{i}." for i in range(19, 60))


class QwenImageFamily:
    name = "qwen-image"
    title = "Qwen-Image"
    released_name = "Qwen-Image"
    pipeline_classes = ("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline",
                        "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline")
    denoiser = "transformer"
    component_labels = {"transformer": "transformer", "text_encoder": "text_encoder (Qwen2.5-VL)", "vae": "vae"}
    long_text_encoder = "text_encoder"
    resolution_step = 16  # the VAE's 8 times the transformer's 2x2 patches
    kohya_prefixes = {"lora_unet": "transformer"}
    # Module names only Qwen-Image's blocks have (its MLPs and modulation), in diffusers' / ComfyUI's dotted form and
    # in Kohya's underscored one; ComfyUI's prefix with diffusers' block names; blocks past FLUX's 19.
    key_hints = ("img_mlp.net", "txt_mlp.net", "img_mod.1", "txt_mod.1", "img_mlp_net", "txt_mlp_net", "img_mod_1",
                 "txt_mod_1", "diffusion_model.transformer_blocks.", "lora_unet_transformer_blocks_", *_DEEP_BLOCKS)
    weak_key_hints = ()
    lycoris_readers = "ComfyUI, LyCORIS on diffusers' Qwen-Image (SimpleTuner)"
    mindspore_port = False
    commands = {
        ("train", "qwen-image-lora"): ("Qwen-Image LoRA (diffusers' train_dreambooth_lora_qwen_image.py flags)",
                                       "dreamstep.recipes.qwen_image_lora:train",
                                       "dreamstep.config.qwen_image_lora:QwenImageLoraConfig"),
        ("train", "qwen-image-edit-lora"): ("Qwen-Image-Edit LoRA: image editing from before/after pairs",
                                            "dreamstep.recipes.qwen_image_edit_lora:train",
                                            "dreamstep.config.qwen_image_edit_lora:QwenImageEditLoraConfig"),
        ("generate", "qwen-image"): ("generate images with Qwen-Image (+ LoRAs)", "dreamstep.commands.generate:run",
                                     "dreamstep.config.qwen_image_generate:QwenImageGenerateConfig"),
        ("generate", "qwen-image-edit"): ("edit images with Qwen-Image-Edit (+ LoRAs; one to three --image)",
                                          "dreamstep.commands.generate:run",
                                          "dreamstep.config.qwen_image_generate:QwenImageEditGenerateConfig"),
        ("eval", "qwen-image"): ("score Qwen-Image LoRAs / checkpoints against the base model",
                                 "dreamstep.commands.evaluate", None),
    }

    def check_generation_model(self, variant: str, model: str, model_config: str | None,
                               component_files: Mapping[str, str]) -> None:
        from dreamstep.models.qwen_image.generation import check_model

        check_model(variant, model, model_config, component_files)

    def generation_pipeline(self, variant: str, model: str, *, model_config: str | None, dtype: torch.dtype,
                            component_files: Mapping[str, str], controlnet: Any | None) -> DiffusionPipeline:
        from dreamstep.models.qwen_image.generation import pipeline

        return pipeline(variant, model, dtype=dtype, controlnet=controlnet)

    def sampling_defaults(self, variant: str, pipe: DiffusionPipeline, images: Sequence[Image.Image]
                          ) -> dict[str, Any]:
        from dreamstep.models.qwen_image.generation import sampling_defaults

        return sampling_defaults(variant, pipe, images)

    def image_inputs(self, variant: str, images: Sequence[Image.Image], width: int, height: int) -> dict[str, Any]:
        from dreamstep.models.qwen_image.generation import image_inputs

        return image_inputs(variant, images, width, height)

    def lora_keys(self, configs: Mapping[str, Mapping] | None) -> ModelKeys:
        from dreamstep.models.qwen_image.lora_keys import keys_from_configs

        return keys_from_configs(configs or {})

    def lora_targets(self, denoiser: nn.Module, layers: Sequence[str]) -> list[str]:
        from dreamstep.models.qwen_image.lora_targets import qwen_image_lora_targets

        return qwen_image_lora_targets(denoiser, layers or ["attention"])

    def meta_components(self, folder: Path | None, variant: str | None = None) -> dict[str, nn.Module]:
        # Qwen-Image-Edit (2509, 2511) has Qwen-Image's architecture and configs: one released model plans both.
        from dreamstep.models.qwen_image.meta import meta_components

        return meta_components(folder)

    def training_pass(self, denoiser: nn.Module, *, resolution: int, batch: int, text_tokens: int, train: bool,
                      image_token_multiplier: int = 1, trainable: nn.Module | None = None,
                      ) -> Callable[[], torch.Tensor | None]:
        from dreamstep.models.qwen_image.meta import training_pass

        return training_pass(denoiser, resolution=resolution, batch=batch, text_tokens=text_tokens, train=train,
                             image_token_multiplier=image_token_multiplier)

    def loop_text_encoders(self, *, long_encoder_trains: bool) -> tuple[str, ...]:
        # The Qwen2.5-VL's outputs are always cached: no Qwen-Image trainer trains it.
        return ("text_encoder",) if long_encoder_trains else ()

    def released_components(self, configs: Mapping[str, Mapping]) -> dict[str, nn.Module]:
        from dreamstep.models.qwen_image.meta import released_components

        return released_components(configs)

    def released_configs(self) -> dict[str, dict[str, Any]]:
        from dreamstep.models.qwen_image.configs import QWEN_IMAGE_TRANSFORMER

        return {"transformer": dict(QWEN_IMAGE_TRANSFORMER)}

    # Qwen-Image-Edit reads its reference image's tokens beside the target's (Edit-Plus up to three).
    variants = {"qwen-image": 1, "qwen-image-edit": 2}

    def build_tiny(self, variant: str, *, seed: int, guidance_embeds: bool) -> DiffusionPipeline:
        from dreamstep.models.qwen_image.tiny import build_tiny_qwen_image, build_tiny_qwen_image_edit

        if guidance_embeds:
            raise UserError(f"--guidance_embeds: {variant} has no guidance-distilled kind; remove it")
        return build_tiny_qwen_image_edit(seed=seed) if variant == "qwen-image-edit" else build_tiny_qwen_image(seed)

    def check_single_files(self, variant: str) -> None:
        raise UserError(f"--single_file: dreamstep reads {variant} from diffusers folders only; leave it out")

    def write_single_files(self, pipe: DiffusionPipeline, out_dir: Path) -> None:
        raise UserError("--single_file: Qwen-Image has no single files here; leave it out")


FAMILY = QwenImageFamily()
