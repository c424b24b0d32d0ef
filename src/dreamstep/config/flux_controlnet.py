"""Options of ``dreamstep train flux-controlnet`` (flag names as in diffusers' ``train_controlnet_flux.py``),
on top of the FLUX options every trainer shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from dreamstep.config.evaluation import CONTROL_METRICS, FIDELITY_METRICS
from dreamstep.config.schema import option, refuse_unused
from dreamstep.config.training import FluxTrainingConfig
from dreamstep.errors import UserError


@dataclass
class FluxControlNetConfig(FluxTrainingConfig):
    # The flags that shape the trained weights: a checkpoint resumes only with the values it was saved with.
    resume_must_match: ClassVar[tuple[str, ...]] = (
        "pretrained_model_name_or_path", "transformer_single_file", "controlnet_model_name_or_path",
        "num_double_layers", "num_single_layers", "controlnet_weights_dtype")

    train_data_dir: str | None = option(None, "folder of target images (paired with --conditioning_data_dir, "
                                                 "or holding a metadata.jsonl)")
    conditioning_data_dir: str | None = option(None, "folder of control images, each named like its target")
    jsonl_for_train: str | None = option(None, "a metadata.jsonl with image, conditioning_image and text "
                                                  "columns (paths relative to it or to --train_data_dir)")
    caption_extension: str = option(".txt", "with folders: read each target's caption from a file with this "
                                            "extension beside it")
    default_caption: str | None = option(None, "with folders: the caption of targets without a caption file")
    dataset_config: str | None = option(None, "a Kohya dataset TOML (subsets with conditioning_data_dir) "
                                                 "instead of the folder flags")
    repeats: int = option(1, "times each pair appears per epoch", bounds="[1, inf)")
    random_crop: bool = option(False, "crop at random (default: center crop, as diffusers' script does)")
    random_flip: bool = option(False, "flip target and control image together, at random")
    proportion_empty_prompts: float = option(0.0, "fraction of samples trained with the empty prompt (drawn per "
                                                  "seed, epoch and sample; sets every subset's caption dropout)",
                                             bounds="[0, 1]")
    controlnet_model_name_or_path: str | None = option(None, "start from this ControlNet (save_pretrained "
                                                                "folder or hub id) instead of building one")
    num_double_layers: int = option(4, "double-stream blocks of a ControlNet built from the transformer",
                                    bounds="[0, inf)")
    num_single_layers: int = option(4, "single-stream blocks of a ControlNet built from the transformer",
                                    bounds="[0, inf)")
    controlnet_weights_dtype: Literal["fp32", "bf16"] = option(
        "fp32", "ControlNet weight dtype; bf16 needs --mixed_precision bf16 and uses AdamW with fp32 update "
                "math and stochastic rounding (less memory)")
    # diffusers' train_controlnet_flux.py defaults (the LoRA trainers keep those of the DreamBooth LoRA script).
    learning_rate: float = option(5e-6, "learning rate (diffusers' ControlNet default)", bounds="(0, inf)")
    adam_weight_decay: float = option(1e-2, "weight decay (diffusers' ControlNet default)", bounds="[0, inf)")
    weighting_scheme: Literal["none", "logit_normal", "mode", "sigma_sqrt", "cosmap"] = option(
        "logit_normal", "timestep sampling / loss weighting (SD3 paper; diffusers' ControlNet default)")
    validation_prompt: list[str] = option([], "prompts for validation images (one, or one per --validation_image)")
    validation_image: list[str] = option([], "control images for validation (one, or one per --validation_prompt)")
    zero_stage: Literal[0, 2, 3] = option(
        0, "with several processes: 0 = DDP (each holds the whole ControlNet); 2 = FSDP2 shards its weights, "
           "gradients and optimizer state, gathering the weights once per step; 3 = the same, re-gathering each "
           "block's weights in backward (least memory)")
    shard_base: bool = option(False, "with --zero_stage 2 or 3: shard the frozen transformer's blocks too "
                                     "(for a base too large for one device)")

    metrics_allowed = FIDELITY_METRICS + CONTROL_METRICS

    def __post_init__(self) -> None:
        super().__post_init__()
        flags_given = any(v is not None for v in (self.train_data_dir, self.jsonl_for_train))
        if self.dataset_config is None and not flags_given:
            raise UserError("give --train_data_dir with --conditioning_data_dir, --jsonl_for_train, "
                            "or --dataset_config")
        if self.dataset_config is not None and flags_given:
            raise UserError("give either --dataset_config or the folder flags (--train_data_dir, "
                            "--jsonl_for_train), not both")
        if self.dataset_config is not None:
            refuse_unused(self, ("conditioning_data_dir", "caption_extension", "default_caption", "repeats",
                                 "random_crop", "random_flip"), "with --dataset_config (set it in the dataset TOML)")
        if self.controlnet_weights_dtype == "bf16" and self.mixed_precision != "bf16":
            raise UserError("--controlnet_weights_dtype bf16 needs --mixed_precision bf16 (bf16 compute)")
        if self.controlnet_weights_dtype == "bf16" and self.optimizer.lower() != "adamw":
            raise UserError(f"--controlnet_weights_dtype bf16 trains with AdamW (fp32 math, stochastic rounding); "
                            f"drop --optimizer {self.optimizer} or use --controlnet_weights_dtype fp32")
        if self.eval_metrics and not self.validation_prompt:
            raise UserError("--eval_metrics scores the validation samples: give --validation_prompt and "
                            "--validation_image too")
        if self.zero_stage and self.controlnet_weights_dtype == "bf16":
            raise UserError("--controlnet_weights_dtype bf16 (stochastic-rounding AdamW) cannot train sharded "
                            "weights; use --controlnet_weights_dtype fp32 with --zero_stage")
        if self.shard_base and not self.zero_stage:
            raise UserError("--shard_base needs --zero_stage 2 or 3")
        if self.shard_base and self.base_quantization != "none":
            raise UserError(f"--shard_base splits a bf16/fp32 base; a --base_quantization {self.base_quantization} "
                            f"base is small enough to keep whole on each process: drop --shard_base")
        self._check_validation_pairs()

    def _check_validation_pairs(self) -> None:
        prompts, images = len(self.validation_prompt), len(self.validation_image)
        if (prompts == 0) != (images == 0):
            raise UserError("validation needs both --validation_prompt and --validation_image")
        if prompts > 1 and images > 1 and prompts != images:
            raise UserError(f"{prompts} --validation_prompt values but {images} --validation_image values; "
                            "give one of either, or the same number of both")

    def validation_pairs(self) -> list[tuple[str, str]]:
        """(control image path, prompt) pairs; a single prompt or image is shared by all of the other."""
        count = max(len(self.validation_prompt), len(self.validation_image))
        prompts = self.validation_prompt * count if len(self.validation_prompt) == 1 else self.validation_prompt
        images = self.validation_image * count if len(self.validation_image) == 1 else self.validation_image
        return list(zip(images, prompts))
