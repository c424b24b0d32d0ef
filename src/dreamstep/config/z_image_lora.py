"""Options of ``dreamstep train z-image-lora``: the flags of diffusers' ``train_dreambooth_lora_z_image.py``
(instance / class images, LoRA shape and layers, the flow-matching weighting) on top of the options every
flow-matching trainer shares, and ``--validation_model_path``: the checkpoint that draws the validation samples (Z-Image
Turbo, while the LoRA trains on the base)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from dreamstep.config.options import ImageDataOptions, LoraOptions, MaskedLossOptions, PromptValidationOptions
from dreamstep.config.schema import option, refuse_unused
from dreamstep.config.training import TrainingConfig
from dreamstep.errors import UserError


@dataclass
class ZImageLoraConfig(LoraOptions, ImageDataOptions, MaskedLossOptions, PromptValidationOptions, TrainingConfig):
    # The flags that shape the trained weights: a checkpoint resumes only with the values it was saved with.
    model_title: ClassVar[str] = "Z-Image"
    resume_must_match: ClassVar[tuple[str, ...]] = (
        "pretrained_model_name_or_path", "rank", "lora_alpha", "lora_layers")

    pretrained_model_name_or_path: str = option(
        help="the Z-Image base to train on: a diffusers folder or hub id (Tongyi-MAI/Z-Image; a LoRA trained on the "
             "distilled Turbo breaks its distillation)")
    instance_data_dir: Optional[str] = option(None, "folder of the subject's images")
    instance_prompt: Optional[str] = option(None, "prompt with the identifier, e.g. 'a photo of sks dog'; images "
                                                  "without a --caption_extension file train with it")
    class_data_dir: Optional[str] = option(None, "folder of class images for prior preservation (it must hold "
                                                 "--num_class_images images)")
    class_prompt: Optional[str] = option(None, "prompt of the class, e.g. 'a photo of a dog'")
    with_prior_preservation: bool = option(False, "add the prior-preservation loss on class images, as diffusers' "
                                                  "DreamBooth script")
    prior_loss_weight: float = option(1.0, "weight of the prior-preservation loss", bounds="[0, inf)")
    num_class_images: int = option(100, "class images the class folder must hold", bounds="[1, inf)")
    center_crop: bool = option(False, "center-crop to --resolution (default: random crop)")
    validation_data_dir: Optional[str] = option(None, "folder of held-out images of the subject for the validation "
                                                      "loss (captioned like the instance images)")
    validation_model_path: Optional[str] = option(
        None, "draw the validation samples with this Z-Image checkpoint's transformer and scheduler (a folder or "
              "hub id, e.g. Tongyi-MAI/Z-Image-Turbo) carrying the LoRA being trained; default: the base")
    validation_inference_steps: Optional[int] = option(  # type: ignore[assignment]
        None, "denoising steps of the validation samples (default: 9 for Turbo, 50 for the base, as their model "
              "cards say)", bounds="[1, inf)")
    validation_guidance_scale: Optional[float] = option(
        None, "classifier-free guidance of the validation samples (default: 0 for Turbo, 4 for the base)",
        bounds="[0, inf)")

    def __post_init__(self) -> None:
        if self.resolution % 16:
            raise UserError(f"--resolution must be a multiple of 16 for {self.model_title}'s 8x VAE and 2x2 patches "
                            f"(got {self.resolution}; try {max(16, round(self.resolution / 16) * 16)})")
        super().__post_init__()
        if self.dataset_config is None and self.instance_data_dir is None:
            raise UserError("give --instance_data_dir (with --instance_prompt) or --dataset_config")
        if self.dataset_config is not None and self.instance_data_dir is not None:
            raise UserError("give either --instance_data_dir or --dataset_config, not both")
        if self.with_prior_preservation and (not self.class_data_dir or not self.class_prompt):
            raise UserError("--with_prior_preservation needs --class_data_dir and --class_prompt")
        if self.dataset_config is not None:
            refuse_unused(self, _INSTANCE_FLAGS, "with --dataset_config (set them in the dataset TOML instead)")
        if not self.with_prior_preservation:
            refuse_unused(self, ("class_data_dir", "class_prompt", "num_class_images"),
                          "without --with_prior_preservation")
        if not self.validation_prompt:
            refuse_unused(self, ("validation_model_path", "validation_guidance_scale"), "without --validation_prompt")
        if self.validation_model_path is not None and self.base_quantization != "none":
            raise UserError(f"--validation_model_path swaps that model's weights into the transformer for each "
                            f"validation, which --base_quantization {self.base_quantization} stores quantized; "
                            "remove one of them")

    def may_hold_out_images(self) -> bool:
        return super().may_hold_out_images() or self.validation_data_dir is not None

    @property
    def class_images_to_generate(self) -> bool:
        """Class images come from the flags' class folder (dreambooth_datasets reads it when this is true)."""
        return self.with_prior_preservation and self.dataset_config is None


_INSTANCE_FLAGS = ("instance_prompt", "caption_extension", "center_crop", "random_flip", "repeats",
                   "with_prior_preservation", "validation_data_dir", "class_data_dir", "class_prompt")
