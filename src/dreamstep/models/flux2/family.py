"""FLUX.2 ([klein] 4B and 9B with a Qwen3 text encoder, [dev] with Mistral Small 3.1) as a
:class:`~dreamstep.models.family.ModelFamily`."""

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


class Flux2Family:
    name = "flux2"
    title = "FLUX.2"
    released_name = "FLUX.2-klein-4B"
    pipeline_classes = ("Flux2KleinPipeline", "Flux2Pipeline")
    denoiser = "transformer"
    component_labels = {"transformer": "transformer", "text_encoder": "text_encoder (Qwen3; [dev]: Mistral 3)",
                        "vae": "vae"}
    long_text_encoder = "text_encoder"  # read to --max_sequence_length, quantized by --text_encoder_quantization
    resolution_step = 16  # the VAE's 8 times the 2x2 latent patches
    kohya_prefixes = {"lora_unet": "transformer"}
    # Module names only FLUX.2's transformer has (its Kohya / ComfyUI names are FLUX.1's BFL names).
    key_hints = ("to_qkv_mlp_proj", "double_stream_modulation", "single_stream_modulation", "time_guidance_embed",
                 "ff.linear_in", "ff_context.linear_in", "ff_linear_in", "ff_context_linear_in")
    weak_key_hints = ()
    lycoris_readers = "diffusers' Flux2LoraLoaderMixin (LoKr), ComfyUI"
    mindspore_port = False
    commands = {
        ("train", "flux2-lora"): ("FLUX.2 [klein] / [dev] LoRA, text to image or reference editing (diffusers' "
                                  "train_dreambooth_lora_flux2*.py flags)", "dreamstep.recipes.flux2_lora:train",
                                  "dreamstep.config.flux2_lora:Flux2LoraConfig"),
        ("generate", "flux2-klein"): ("generate or edit images with FLUX.2 [klein] (+ LoRAs)",
                                      "dreamstep.commands.generate:run",
                                      "dreamstep.config.flux2_generate:Flux2KleinGenerateConfig"),
        ("generate", "flux2"): ("generate or edit images with FLUX.2 [dev] (+ LoRAs)",
                                "dreamstep.commands.generate:run",
                                "dreamstep.config.flux2_generate:Flux2GenerateConfig"),
        ("eval", "flux2-klein"): ("score FLUX.2 [klein] LoRAs / checkpoints against the base model",
                                  "dreamstep.commands.evaluate", None),
        ("eval", "flux2"): ("score FLUX.2 [dev] LoRAs / checkpoints against the base model",
                            "dreamstep.commands.evaluate", None),
    }

    def lora_keys(self, configs: Mapping[str, Mapping] | None) -> ModelKeys:
        from dreamstep.models.flux2.lora_keys import keys_from_configs

        return keys_from_configs(configs or {})

    def lora_targets(self, denoiser: nn.Module, layers: Sequence[str]) -> list[str]:
        from dreamstep.models.flux2.lora_targets import flux2_lora_targets

        return flux2_lora_targets(denoiser, layers or ["attention"])

    def meta_components(self, folder: Path | None, variant: str | None = None) -> dict[str, nn.Module]:
        from dreamstep.models.flux2.meta import meta_components

        return meta_components(folder, dev_without_folder=variant == "flux2")

    def training_pass(self, denoiser: nn.Module, *, resolution: int, batch: int, text_tokens: int, train: bool,
                      image_token_multiplier: int = 1, trainable: nn.Module | None = None,
                      ) -> Callable[[], torch.Tensor | None]:
        from dreamstep.models.flux2.meta import training_pass

        return training_pass(denoiser, resolution=resolution, batch=batch, text_tokens=text_tokens, train=train,
                             image_token_multiplier=image_token_multiplier, trainable=trainable)

    def loop_text_encoders(self, *, long_encoder_trains: bool) -> tuple[str, ...]:
        # The captions' embeddings are always cached: the Qwen3 encoder never runs in the loop.
        return ("text_encoder",) if long_encoder_trains else ()

    def released_components(self, configs: Mapping[str, Mapping]) -> dict[str, nn.Module]:
        from dreamstep.models.flux2.meta import released_components

        return released_components(configs)

    def released_configs(self) -> dict[str, dict[str, Any]]:
        from dreamstep.models.flux2 import published

        return {"transformer": published.KLEIN_4B_TRANSFORMER}

    # [dev] (guidance-distilled, Mistral 3), [klein] (Qwen3), and [klein] trained on edit pairs (plan: the reference
    # image's tokens beside the target's; the same model for tiny-model).
    variants = {"flux2": 1, "flux2-klein": 1, "flux2-klein-edit": 2}

    def build_tiny(self, variant: str, *, seed: int, guidance_embeds: bool) -> DiffusionPipeline:
        from dreamstep.models.flux2.tiny import build_tiny_flux2_dev, build_tiny_flux2_klein

        if guidance_embeds:
            raise UserError(f"--guidance_embeds: {variant}'s kind is fixed ([dev] has guidance embedding, [klein] "
                            "none); remove it")
        return build_tiny_flux2_dev(seed=seed) if variant == "flux2" else build_tiny_flux2_klein(seed=seed)

    def check_generation_model(self, variant: str, model: str, model_config: str | None,
                               component_files: Mapping[str, str]) -> None:
        from dreamstep.models.flux2.generation import check_model

        check_model(variant, model, model_config, component_files)

    def generation_pipeline(self, variant: str, model: str, *, model_config: str | None, dtype: torch.dtype,
                            component_files: Mapping[str, str], controlnet: Any | None) -> DiffusionPipeline:
        from dreamstep.models.flux2.generation import pipeline

        if controlnet is not None:
            raise UserError(f"--controlnet: {variant} has no ControlNets in dreamstep; remove it")
        return pipeline(variant, model, dtype)

    def sampling_defaults(self, variant: str, pipe: DiffusionPipeline, images: Sequence[Image.Image]
                          ) -> dict[str, Any]:
        from dreamstep.models.flux2.generation import sampling_defaults

        return sampling_defaults(pipe, images)

    def image_inputs(self, variant: str, images: Sequence[Image.Image], width: int, height: int) -> dict[str, Any]:
        from dreamstep.models.flux2.generation import image_inputs

        return image_inputs(images)

    def check_single_files(self, variant: str) -> None:
        raise UserError(f"--single_file: dreamstep reads {variant} from its diffusers folder only; remove it")

    def write_single_files(self, pipe: DiffusionPipeline, out_dir: Path) -> None:
        raise UserError("FLUX.2 has no single files in dreamstep")


FAMILY = Flux2Family()
