"""Krea 2 (RAW and Turbo) as a :class:`~dreamstep.models.family.ModelFamily`."""

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


class Krea2Family:
    name = "krea2"
    title = "Krea 2"
    released_name = "Krea 2 RAW"
    pipeline_classes = ("Krea2Pipeline",)
    denoiser = "transformer"
    component_labels = {"transformer": "transformer", "text_encoder": "text_encoder (Qwen3-VL)", "vae": "vae"}
    long_text_encoder = "text_encoder"
    resolution_step = 16  # Qwen-Image's VAE's 8 times the transformer's 2x2 patches
    kohya_prefixes = {"lora_unet": "transformer"}
    # The text fusion and the gated attention are Krea 2's alone, in diffusers' and the released names.
    key_hints = ("text_fusion.", "txtfusion", "attn.to_gate", "attn_to_gate", "attn.wq", "attn_wq")
    weak_key_hints = ()
    lycoris_readers = "ComfyUI"
    mindspore_port = False
    variants = {"krea2": 1}
    commands = {
        ("train", "krea2-lora"): (
            "Krea 2 LoRA (train_dreambooth_lora_krea2.py's flags; --validation_model_path samples with Turbo)",
            "dreamstep.recipes.krea2_lora:train", "dreamstep.config.krea2_lora:Krea2LoraConfig"),
        ("generate", "krea2"): ("generate images with Krea 2 Turbo or RAW (+ LoRAs)", "dreamstep.commands.generate:run",
                                "dreamstep.config.krea2_generate:Krea2GenerateConfig"),
        ("eval", "krea2"): ("score Krea 2 LoRAs / checkpoints against the base model", "dreamstep.commands.evaluate",
                            None),
    }

    def lora_keys(self, configs: Mapping[str, Mapping] | None) -> ModelKeys:
        from dreamstep.models.krea2.lora_keys import krea2_keys

        return krea2_keys((configs or {}).get("transformer"))

    def lora_targets(self, denoiser: nn.Module, layers: Sequence[str]) -> list[str]:
        from dreamstep.models.krea2.lora_targets import krea2_lora_targets

        return krea2_lora_targets(denoiser, layers or ["attention"])

    def meta_components(self, folder: Path | None, variant: str | None = None) -> dict[str, nn.Module]:
        from dreamstep.models.krea2.meta import meta_components

        return meta_components(folder)

    def training_pass(self, denoiser: nn.Module, *, resolution: int, batch: int, text_tokens: int, train: bool,
                      image_token_multiplier: int = 1, trainable: nn.Module | None = None,
                      ) -> Callable[[], torch.Tensor | None]:
        from dreamstep.models.krea2.meta import training_pass

        return training_pass(denoiser, resolution=resolution, batch=batch, text_tokens=text_tokens, train=train,
                             image_token_multiplier=image_token_multiplier, trainable=trainable)

    def loop_text_encoders(self, *, long_encoder_trains: bool) -> tuple[str, ...]:
        return ("text_encoder",) if long_encoder_trains else ()

    def released_components(self, configs: Mapping[str, Mapping]) -> dict[str, nn.Module]:
        from dreamstep.models.krea2.meta import released_components

        return released_components(configs)

    def released_configs(self) -> dict[str, dict[str, Any]]:
        from dreamstep.models.krea2 import configs

        return {"transformer": dict(configs.TRANSFORMER)}

    def check_generation_model(self, variant: str, model: str, model_config: str | None,
                               component_files: Mapping[str, str]) -> None:
        from dreamstep.models.krea2.plumbing import KREA2
        from dreamstep.models.z_image.plumbing import check_source

        if model_config is not None:
            raise UserError("--model_config: Krea 2 loads from its diffusers folder or hub id alone; remove it")
        check_source(model, "--model", kind=KREA2)

    def generation_pipeline(self, variant: str, model: str, *, model_config: str | None, dtype: torch.dtype,
                            component_files: Mapping[str, str], controlnet: Any | None) -> DiffusionPipeline:
        from diffusers import Krea2Pipeline

        from dreamstep.models.loading import _DTYPE_KWARG, _from_pretrained

        if controlnet is not None:
            raise UserError("--controlnet: dreamstep has no Krea 2 ControlNet; remove it")
        return _from_pretrained(Krea2Pipeline, model, **{_DTYPE_KWARG: dtype})

    def sampling_defaults(self, variant: str, pipe: DiffusionPipeline, images: Sequence[Image.Image]
                          ) -> dict[str, Any]:
        from dreamstep.models.krea2 import configs

        sampling = configs.TURBO_SAMPLING if pipe.config.get("is_distilled") else configs.RAW_SAMPLING
        return {**sampling, "width": 1024, "height": 1024}

    def image_inputs(self, variant: str, images: Sequence[Image.Image], width: int, height: int) -> dict[str, Any]:
        return {}

    def build_tiny(self, variant: str, *, seed: int, guidance_embeds: bool) -> DiffusionPipeline:
        from dreamstep.models.krea2.tiny import build_tiny_krea2

        if guidance_embeds:
            raise UserError("--guidance_embeds: Krea 2 has no guidance embedding; remove it")
        return build_tiny_krea2(seed=seed)

    def check_single_files(self, variant: str) -> None:
        raise UserError(f"--single_file: dreamstep reads {variant} from its diffusers folder; remove --single_file")

    def write_single_files(self, pipe: DiffusionPipeline, out_dir: Path) -> None:
        self.check_single_files("krea2")


FAMILY = Krea2Family()
