"""Options of ``dreamstep train qwen-image-edit-lora``: before/after pairs taken as ``train flux-kontext-lora`` takes
them (two folders, a metadata table or a dataset TOML with ``conditioning_data_dir``), on top of the LoRA, data and
validation groups and the options every Qwen-Image trainer shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from dreamstep.config.options import ImageDataOptions, LoraOptions, PromptValidationOptions
from dreamstep.config.qwen_image_lora import QwenImageTrainingConfig
from dreamstep.config.schema import option, refuse_unused
from dreamstep.errors import UserError


@dataclass
class QwenImageEditLoraConfig(LoraOptions, ImageDataOptions, PromptValidationOptions, QwenImageTrainingConfig):
    # The flags that shape the trained weights: a checkpoint resumes only with the values it was saved with.
    resume_must_match: ClassVar[tuple[str, ...]] = ("pretrained_model_name_or_path", "rank", "lora_alpha",
                                                    "lora_layers")

    pretrained_model_name_or_path: str = option(
        help="base Qwen-Image-Edit model: a diffusers folder (Qwen/Qwen-Image-Edit-2509's layout) or a hub id")
    instance_data_dir: str | None = option(None, "folder of the target (\"after\") images")
    conditioning_data_dir: str | None = option(None, "folder of the reference (\"before\") images, each named like "
                                                     "its target in --instance_data_dir")
    instance_prompt: str | None = option(None, "the edit instruction of every target without a caption")
    dataset_name: str | None = option(None, "a local metadata file (.jsonl, .json or .csv, one row per pair) or a "
                                            "folder holding metadata.jsonl / metadata.csv; image paths are relative "
                                            "to it")
    image_column: str = option("image", "with --dataset_name: the column of the target image")
    cond_image_column: str | None = option(None, "with --dataset_name: the column of the reference image")
    caption_column: str | None = option(None, "with --dataset_name: the column of the edit instruction (none: "
                                              "--instance_prompt for every row)")
    vae_encode_mode: Literal["mode", "sample"] = option(
        "mode", "the target's latents: the VAE posterior's mode (as the reference's, which the pipeline encodes by "
                "its mode) or a fresh sample each step")
    center_crop: bool = option(False, "center-crop to --resolution (default: random crop, the same for both images)")
    validation_image: str | None = option(None, "the reference image --validation_prompt edits in the validation "
                                                "samples")

    def __post_init__(self) -> None:
        if not self.validation_prompt:
            refuse_unused(self, ("validation_image",), "without --validation_prompt")
        refuse_unused(self, ("max_sequence_length",), "with Qwen-Image-Edit (its pipelines encode the whole "
                                                      "instruction with its images)")
        super().__post_init__()
        sources = [f for f in ("instance_data_dir", "dataset_name", "dataset_config") if getattr(self, f)]
        if len(sources) != 1:
            raise UserError("give one of --instance_data_dir (with --conditioning_data_dir), --dataset_name or "
                            "--dataset_config" + (f", not {len(sources)}" if sources else ""))
        if self.instance_data_dir is not None and self.conditioning_data_dir is None:
            raise UserError("--instance_data_dir: Qwen-Image-Edit trains on pairs; give --conditioning_data_dir with "
                            "the reference images")
        if self.dataset_name is not None and self.cond_image_column is None:
            raise UserError("--dataset_name: Qwen-Image-Edit trains on pairs; give --cond_image_column")
        if self.dataset_config is not None:
            refuse_unused(self, _FOLDER_FLAGS + _TABLE_FLAGS, "with --dataset_config (set it in the dataset TOML)")
        elif self.dataset_name is not None:
            refuse_unused(self, ("conditioning_data_dir", "caption_extension"), "with --dataset_name")
        else:
            refuse_unused(self, _TABLE_FLAGS, "without --dataset_name")
        if self.validation_prompt and self.validation_image is None:
            raise UserError("--validation_prompt edits --validation_image: give --validation_image too")


_TABLE_FLAGS = ("image_column", "cond_image_column", "caption_column")
_FOLDER_FLAGS = ("conditioning_data_dir", "instance_prompt", "caption_extension", "repeats", "center_crop",
                 "random_flip")
