"""Options of ``dreamstep generate VARIANT``: one class per model, so each command lists and accepts only the flags
that mean something for its model. A family's own class subclasses :class:`GenerateConfig` in its config module and
overrides the hooks its flags need (:meth:`GenerateConfig.call_kwargs`, :meth:`GenerateConfig.sized_to_image`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

from dreamstep.config.choices import CHECKPOINT_WEIGHTS_HELP
from dreamstep.config.options import FluxComponentFileOptions
from dreamstep.config.schema import SEED_BOUNDS, option
from dreamstep.errors import UserError
from dreamstep.files import check_folder_can_be_made


@dataclass
class GenerateConfig:
    """The flags both models share."""

    model_type: ClassVar[str]
    lora_model: ClassVar[str]  # the model whose LoRA formats --lora reads
    size_multiple: ClassVar[int]  # the VAE downsamples 8x; FLUX packs 2x2 latent patches on top

    model: str = option(help="diffusers pipeline folder, hub id, or single file (SDXL checkpoint such as "
                             "sd_xl_base_1.0.safetensors; FLUX transformer such as flux1-dev.safetensors, with "
                             "--clip_l, --t5xxl, --ae or --model_config)")
    model_config: str | None = option(None, "for a single-file --model: the diffusers folder or hub id "
                                            "that supplies the other components and configs (default: "
                                            "FLUX.1-dev / SDXL base 1.0 from the hub)")
    prompt: str | None = option(None, "the prompt")
    from_file: str | None = option(None, "text file with one prompt per line (blank lines skipped), "
                                         "instead of --prompt")
    negative_prompt: str | None = option(None, "what to steer away from")
    lora: list[str] = option([], "LoRA file, optionally FILE:WEIGHT (default weight 1); repeat the flag "
                                 "or list several; Kohya, diffusers/PEFT and MindSpore .ckpt files load")
    checkpoint_weights: Literal["auto", "ema", "raw"] = option("auto", CHECKPOINT_WEIGHTS_HELP)
    merge: bool = option(False, "fold the LoRAs into the model weights (faster sampling) instead of "
                                "applying them as adapters")
    steps: int | None = option(None, "sampling steps (default: SDXL 50; FLUX 28, or 4 for a model "
                                     "without guidance embedding such as FLUX.1-schnell)", bounds="[1, inf)")
    guidance_scale: float | None = option(None, "SDXL: classifier-free guidance (default 7); FLUX: the "
                                                "distilled guidance value (default 3.5; schnell ignores it)",
                                          bounds="[0, inf)")
    width: int | None = option(None, "image width (default: --height if given, else the model's native size)",
                               bounds="[1, inf)")
    height: int | None = option(None, "image height (default: --width if given, else the model's native size)",
                                bounds="[1, inf)")
    num_images: int = option(1, "images per prompt", bounds="[1, inf)")
    batch_size: int = option(1, "images per pipeline call", bounds="[1, inf)")
    seed: int | None = option(None, "seed of the first image; image i uses seed + i (default: random)",
                              bounds=SEED_BOUNDS)
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = option("auto", "weight and compute precision; auto: fp32 "
                                                            "on the CPU, bf16 (else fp16) on a GPU")
    device: str | None = option(None, "cpu, cuda, cuda:N or mps (default: the best available)")
    no_half_vae: bool = option(False, "keep the VAE in fp32 when --dtype is half precision")
    cpu_offload: bool = option(False, "keep each model on the CPU until it runs (large models, small GPUs)")
    output_dir: str = option("outputs", "folder for the PNGs; earlier images there are kept")

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.from_file is None):
            raise UserError("give --prompt or --from_file (one of them)")
        check_folder_can_be_made(self.output_dir, "--output_dir")  # made at the first image: refused now
        for flag in ("width", "height"):
            value = getattr(self, flag)
            multiple = self.size_multiple
            if value is not None and value % multiple:
                raise UserError(f"--{flag} {value}: {self.model_type.upper()} needs a multiple of {multiple} "
                                f"(e.g. {max(multiple, value // multiple * multiple)})")

    def input_images(self) -> tuple[str, list[str]]:
        """(flag, paths) of the images the pipeline call reads: an edit's input images, a control image."""
        for flag in ("image", "control_image"):
            value = getattr(self, flag, None)
            if value:
                return flag, [value] if isinstance(value, str) else list(value)
        return "image", []

    def call_kwargs(self) -> dict[str, Any]:
        """The pipeline call's keywords that this model's own flags set (beyond prompt, steps, guidance, size)."""
        return {}

    def sized_to_image(self, image_size: tuple[int, int]) -> tuple[int, int] | None:
        """The (width, height) to generate at for an input image of ``image_size`` when a flag asks for its own
        size; ``None``: the model's default."""
        return None

    def own_parameters(self) -> dict[str, Any]:
        """This model's own flags and their values, recorded in each image's PNG."""
        shared = {f.name for f in fields(GenerateConfig)}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in shared}


@dataclass
class SdxlGenerateConfig(GenerateConfig):
    model_type: ClassVar[str] = "sdxl"
    lora_model: ClassVar[str] = "sdxl"
    size_multiple: ClassVar[int] = 8


@dataclass
class FluxGenerateConfig(FluxComponentFileOptions, GenerateConfig):
    """FLUX adds true classifier-free guidance and a ControlNet."""

    model_type: ClassVar[str] = "flux"
    lora_model: ClassVar[str] = "flux"
    size_multiple: ClassVar[int] = 16

    true_cfg_scale: float = option(1.0, "classifier-free guidance with --negative_prompt when > 1 "
                                        "(two transformer passes per step)", bounds="[1, inf)")
    controlnet: str | None = option(None, "FLUX ControlNet folder (config.json + weights), or a checkpoint-N "
                                           "folder of a flux-controlnet run")
    control_image: str | None = option(None, "the ControlNet's conditioning image")
    controlnet_conditioning_scale: float = option(1.0, "strength of the ControlNet's residuals", bounds="[0, inf)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.controlnet is not None and self.control_image is None:
            raise UserError("--controlnet needs --control_image (the conditioning image)")
        if self.control_image is not None and self.controlnet is None:
            raise UserError("--control_image needs --controlnet (the ControlNet folder)")
        if self.negative_prompt and self.true_cfg_scale <= 1.0:
            raise UserError("--negative_prompt has no effect on FLUX unless --true_cfg_scale > 1 "
                            "(e.g. --true_cfg_scale 4)")

    def call_kwargs(self) -> dict[str, Any]:
        if self.controlnet is None:
            return {"true_cfg_scale": self.true_cfg_scale}
        return {"true_cfg_scale": self.true_cfg_scale,
                "controlnet_conditioning_scale": self.controlnet_conditioning_scale}


@dataclass
class FluxKontextGenerateConfig(FluxComponentFileOptions, GenerateConfig):
    """FLUX.1 Kontext edits --image as --prompt says."""

    model_type: ClassVar[str] = "flux-kontext"
    lora_model: ClassVar[str] = "flux"
    size_multiple: ClassVar[int] = 16

    image: str = option(help="the image to edit", kw_only=True)
    keep_image_size: bool = option(False, "edit at the image's own size (rounded down to a multiple of 16) "
                                          "instead of the Kontext training resolution nearest its aspect ratio",
                                   kw_only=True)
    true_cfg_scale: float = option(1.0, "classifier-free guidance with --negative_prompt when > 1 "
                                        "(two transformer passes per step)", bounds="[1, inf)", kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.negative_prompt and self.true_cfg_scale <= 1.0:
            raise UserError("--negative_prompt has no effect on FLUX unless --true_cfg_scale > 1 "
                            "(e.g. --true_cfg_scale 4)")

    def call_kwargs(self) -> dict[str, Any]:
        # The output keeps the size asked for; the pipeline resizes the input to a Kontext training resolution
        # unless --keep_image_size.
        return {"true_cfg_scale": self.true_cfg_scale, "_auto_resize": not self.keep_image_size}

    def sized_to_image(self, image_size: tuple[int, int]) -> tuple[int, int] | None:
        if not self.keep_image_size:
            return None
        step = self.size_multiple
        width, height = (max(step, side // step * step) for side in image_size)
        return width, height
