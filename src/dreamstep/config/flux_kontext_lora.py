"""Options of ``dreamstep train flux-kontext-lora``: the data flags of diffusers'
``train_dreambooth_lora_flux_kontext.py`` on top of the LoRA, data and validation groups and the FLUX options every
trainer shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from dreamstep.config.options import ImageDataOptions, LoraOptions, PromptValidationOptions
from dreamstep.config.schema import option, refuse_unused
from dreamstep.config.training import FluxTrainingConfig
from dreamstep.errors import UserError


@dataclass
class FluxKontextLoraConfig(LoraOptions, ImageDataOptions, PromptValidationOptions, FluxTrainingConfig):
    # The flags that shape the trained weights: a checkpoint resumes only with the values it was saved with.
    resume_must_match: ClassVar[tuple[str, ...]] = (
        "pretrained_model_name_or_path", "transformer_single_file", "rank", "lora_alpha", "lora_layers")

    instance_data_dir: str | None = option(None, "folder of the target (\"after\") images; alone it trains "
                                                 "text-to-image Kontext, as diffusers' script does")
    conditioning_data_dir: str | None = option(None, "folder of the condition (\"before\") images, each named "
                                                     "like its target in --instance_data_dir")
    instance_prompt: str | None = option(None, "the edit instruction of every target without a caption")
    dataset_name: str | None = option(None, "a local metadata file (.jsonl, .json or .csv, one row per pair) or "
                                            "a folder holding metadata.jsonl / metadata.csv (a Hugging Face image "
                                            "folder); image paths are relative to it")
    image_column: str = option("image", "with --dataset_name: the column of the target image (a row without it "
                                        "may name the image in file_name, as a Hugging Face image folder does)")
    cond_image_column: str | None = option(None, "with --dataset_name: the column of the condition image "
                                                 "(none: text-to-image Kontext training)")
    caption_column: str | None = option(None, "with --dataset_name: the column of the edit instruction "
                                              "(none: --instance_prompt for every row)")
    vae_encode_mode: Literal["mode", "sample"] = option(
        "mode", "latents of both images: the VAE posterior's mode (diffusers' Kontext default) or a fresh sample "
                "each step")
    center_crop: bool = option(False, "center-crop to --resolution (default: random crop, the same for both images)")
    validation_image: str | None = option(None, "the condition image the --validation_prompt edits in the "
                                                "validation samples (none: text-to-image samples)")

    def __post_init__(self) -> None:
        super().__post_init__()
        sources = [f for f in ("instance_data_dir", "dataset_name", "dataset_config") if getattr(self, f)]
        if len(sources) != 1:
            raise UserError("give one of --instance_data_dir (with --conditioning_data_dir for edits), "
                            "--dataset_name or --dataset_config" + (f", not {len(sources)}" if sources else ""))
        if self.dataset_config is not None:
            refuse_unused(self, _FOLDER_FLAGS + _TABLE_FLAGS, "with --dataset_config (set it in the dataset TOML)")
        elif self.dataset_name is not None:
            refuse_unused(self, ("conditioning_data_dir", "caption_extension"), "with --dataset_name")
        else:
            refuse_unused(self, _TABLE_FLAGS, "without --dataset_name")
        if self.validation_image is not None and not self.validation_prompt:
            raise UserError("--validation_image is edited by --validation_prompt: give --validation_prompt too")


_TABLE_FLAGS = ("image_column", "cond_image_column", "caption_column")
_FOLDER_FLAGS = ("conditioning_data_dir", "instance_prompt", "caption_extension", "repeats", "center_crop",
                 "random_flip")
