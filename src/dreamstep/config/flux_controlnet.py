"""Options of ``dreamstep train flux-controlnet`` (flag names as in diffusers' ``train_controlnet_flux.py``):
the ControlNet's own on top of the paired-data and paired-validation groups and the FLUX options every
trainer shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from dreamstep.config.evaluation import CONTROL_METRICS, FIDELITY_METRICS
from dreamstep.config.options import PairedDataOptions, PairedValidationOptions
from dreamstep.config.schema import option
from dreamstep.config.training import FluxTrainingConfig
from dreamstep.errors import UserError


@dataclass
class FluxControlNetConfig(PairedDataOptions, PairedValidationOptions, FluxTrainingConfig):
    # The flags that shape the trained weights: a checkpoint resumes only with the values it was saved with.
    resume_must_match: ClassVar[tuple[str, ...]] = (
        "pretrained_model_name_or_path", "transformer_single_file", "controlnet_model_name_or_path",
        "num_double_layers", "num_single_layers", "controlnet_weights_dtype")

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
    zero_stage: Literal[0, 2, 3] = option(
        0, "with several processes: 0 = DDP (each holds the whole ControlNet); 2 = FSDP2 shards its weights, "
           "gradients and optimizer state, gathering the weights once per step; 3 = the same, re-gathering each "
           "block's weights in backward (least memory)")
    shard_base: bool = option(False, "with --zero_stage 2 or 3: shard the frozen transformer's blocks too "
                                     "(for a base too large for one device)")

    metrics_allowed: ClassVar[tuple[str, ...]] = FIDELITY_METRICS + CONTROL_METRICS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.controlnet_weights_dtype == "bf16" and self.mixed_precision != "bf16":
            raise UserError("--controlnet_weights_dtype bf16 needs --mixed_precision bf16 (bf16 compute)")
        if self.controlnet_weights_dtype == "bf16" and self.optimizer.lower() != "adamw":
            raise UserError(f"--controlnet_weights_dtype bf16 trains with AdamW (fp32 math, stochastic rounding); "
                            f"drop --optimizer {self.optimizer} or use --controlnet_weights_dtype fp32")
        if self.zero_stage and self.controlnet_weights_dtype == "bf16":
            raise UserError("--controlnet_weights_dtype bf16 (stochastic-rounding AdamW) cannot train sharded "
                            "weights; use --controlnet_weights_dtype fp32 with --zero_stage")
        if self.zero_stage and self.ema_decay is not None:
            raise UserError("--ema_decay keeps an average of whole weights, which --zero_stage shards; drop one")
        if self.shard_base and not self.zero_stage:
            raise UserError("--shard_base needs --zero_stage 2 or 3")
        if self.shard_base and self.base_quantization != "none":
            raise UserError(f"--shard_base splits a bf16/fp32 base; a --base_quantization {self.base_quantization} "
                            f"base is small enough to keep whole on each process: drop --shard_base")
