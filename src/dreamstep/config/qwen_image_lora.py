"""Options of ``dreamstep train qwen-image-lora``: the flags of diffusers' ``train_dreambooth_lora_qwen_image.py``
(instance and class images, prior preservation, rank / alpha / dropout, ``--lora_layers``, the flow-matching
sampling, ``--max_sequence_length``) on top of the LoRA, data and validation groups and the options every
flow-matching trainer shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from dreamstep.config.options import ImageDataOptions, LoraOptions, MaskedLossOptions, PromptValidationOptions
from dreamstep.config.schema import option, refuse_unused
from dreamstep.config.training import TrainingConfig
from dreamstep.errors import UserError


@dataclass
class QwenImageTrainingConfig(TrainingConfig):
    """What every Qwen-Image trainer has on top of :class:`TrainingConfig`."""

    pretrained_model_name_or_path: str = option(
        help="base Qwen-Image model: a diffusers folder (Qwen/Qwen-Image's layout) or a hub id")
    true_cfg_scale: float = option(4.0, "validation samples: the pipeline's true classifier-free guidance scale "
                                        "(with the empty negative prompt; 1 turns it off)", bounds="[1, inf)",
                                   kw_only=True)

    def __post_init__(self) -> None:
        if not getattr(self, "validation_prompt", None):
            refuse_unused(self, ("true_cfg_scale",), "without --validation_prompt")
        if self.resolution % 16:
            raise UserError(f"--resolution must be a multiple of 16 for Qwen-Image's 8x VAE and 2x2 latent patches "
                            f"(got {self.resolution}; try {max(16, round(self.resolution / 16) * 16)})")
        super().__post_init__()


@dataclass
class QwenImageLoraConfig(LoraOptions, ImageDataOptions, MaskedLossOptions, PromptValidationOptions,
                          QwenImageTrainingConfig):
    # The flags that shape the trained weights: a checkpoint resumes only with the values it was saved with.
    resume_must_match: ClassVar[tuple[str, ...]] = (
        "pretrained_model_name_or_path", "rank", "lora_alpha", "lora_layers")

    instance_data_dir: Optional[str] = option(None, "folder of the subject's images")
    instance_prompt: Optional[str] = option(None, "prompt with the identifier, e.g. 'a photo of sks dog'; images "
                                                  "without a --caption_extension file train with it")
    class_data_dir: Optional[str] = option(None, "folder of class images for prior preservation")
    class_prompt: Optional[str] = option(None, "prompt of the class, e.g. 'a photo of a dog'")
    with_prior_preservation: bool = option(False, "add the prior-preservation loss on class images, as diffusers' "
                                                  "DreamBooth script: every batch holds its instance samples and as "
                                                  "many class samples")
    prior_loss_weight: float = option(1.0, "weight of the prior-preservation loss, or of a dataset TOML's "
                                           "regularization images", bounds="[0, inf)")
    num_class_images: int = option(100, "class images wanted in --class_data_dir (give them all: Qwen-Image "
                                        "class images are not generated here)", bounds="[1, inf)")
    center_crop: bool = option(False, "center-crop to --resolution (default: random crop)")
    validation_data_dir: Optional[str] = option(None, "folder of held-out images of the subject for the validation "
                                                      "loss (captioned like the instance images)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dataset_config is None and self.instance_data_dir is None:
            raise UserError("give --instance_data_dir (with --instance_prompt) or --dataset_config")
        if self.dataset_config is not None and self.instance_data_dir is not None:
            raise UserError("give either --instance_data_dir or --dataset_config, not both")
        if self.with_prior_preservation and self.dataset_config is None:
            if not self.class_data_dir or not self.class_prompt:
                raise UserError("--with_prior_preservation needs --class_data_dir and --class_prompt")
        if self.dataset_config is not None:
            refuse_unused(self, _INSTANCE_FLAGS, "with --dataset_config (set them in the dataset TOML instead)")
        if not self.with_prior_preservation:
            refuse_unused(self, _PRIOR_FLAGS, "without --with_prior_preservation")
            if self.dataset_config is None:
                refuse_unused(self, ("prior_loss_weight",), "without --with_prior_preservation or --dataset_config")

    def may_hold_out_images(self) -> bool:
        return super().may_hold_out_images() or self.validation_data_dir is not None


_PRIOR_FLAGS = ("class_data_dir", "class_prompt", "num_class_images")
_INSTANCE_FLAGS = ("instance_prompt", "caption_extension", "center_crop", "random_flip", "repeats",
                   "with_prior_preservation", "validation_data_dir", *_PRIOR_FLAGS)
