"""Writing a Kohya LoRA network the way sd-scripts does: step files ``<name>-step00000500.<ext>``, epoch
files ``<name>-000001.<ext>``, the final ``<name>.<ext>``, each with the run's ``ss_*`` metadata (the
flags, the network, the dataset) and the epoch and step it was written at."""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dreamstep.config.flux_network_args import FluxNetworkOptions
from dreamstep.config.lycoris import LycorisOptions
from dreamstep.config.sdxl_lora import NETWORK_MODULE
from dreamstep.lora.kohya_network import NetworkOptions

# The ``ss_*`` entries that record one sd-scripts training flag as given, by the flag's name.
SS_FLAG_KEYS = {
    "ss_output_name": "output_name", "ss_learning_rate": "learning_rate", "ss_unet_lr": "unet_lr",
    "ss_text_encoder_lr": "text_encoder_lr", "ss_optimizer": "optimizer_type", "ss_lr_scheduler": "lr_scheduler",
    "ss_lr_warmup_steps": "lr_warmup_steps", "ss_max_train_steps": "max_train_steps",
    "ss_gradient_accumulation_steps": "gradient_accumulation_steps",
    "ss_gradient_checkpointing": "gradient_checkpointing", "ss_mixed_precision": "mixed_precision",
    "ss_full_fp16": "full_fp16", "ss_seed": "seed", "ss_cache_latents": "cache_latents",
    "ss_min_snr_gamma": "min_snr_gamma", "ss_noise_offset": "noise_offset",
    "ss_adaptive_noise_scale": "adaptive_noise_scale", "ss_multires_noise_iterations": "multires_noise_iterations",
    "ss_multires_noise_discount": "multires_noise_discount", "ss_v_parameterization": "v_parameterization",
    "ss_zero_terminal_snr": "zero_terminal_snr",
    "ss_prior_loss_weight": "prior_loss_weight", "ss_max_grad_norm": "max_grad_norm",
}
# The entries sd-scripts' FLUX trainer adds (flux_train_network.py's update_metadata and the loss flags).
FLUX_SS_FLAG_KEYS = {
    "ss_apply_t5_attn_mask": "apply_t5_attn_mask", "ss_weighting_scheme": "weighting_scheme",
    "ss_logit_mean": "logit_mean", "ss_logit_std": "logit_std", "ss_mode_scale": "mode_scale",
    "ss_guidance_scale": "guidance_scale", "ss_timestep_sampling": "timestep_sampling",
    "ss_sigmoid_scale": "sigmoid_scale", "ss_model_prediction_type": "model_prediction_type",
    "ss_discrete_flow_shift": "discrete_flow_shift", "ss_loss_type": "loss_type",
    "ss_huber_schedule": "huber_schedule", "ss_huber_c": "huber_c", "ss_huber_scale": "huber_scale",
    "ss_fp8_base": "fp8_base",
}
SDXL_BASE_MODEL_VERSION = "sdxl_base_v1-0"
FLUX_BASE_MODEL_VERSION = "flux1"  # sd-scripts' flux_utils.MODEL_VERSION_FLUX_V1


def training_metadata(flags: Mapping[str, Any], *, base_model: str, steps_per_epoch: int,
                      base_model_version: str = SDXL_BASE_MODEL_VERSION,
                      flag_keys: Mapping[str, str] = SS_FLAG_KEYS) -> dict[str, str]:
    """sd-scripts' run entries: a session id, the start time, the base model's version and file name, the batches
    per epoch, and every flag of ``flag_keys`` (``flags`` maps sd-scripts flag names to values; a flag the trainer
    has not is written "None", as sd-scripts writes a flag left unset)."""
    return {"ss_session_id": str(random.randrange(2**31)), "ss_training_started_at": str(time.time()),
            "ss_base_model_version": base_model_version, "ss_sd_model_name": Path(base_model).name,
            "ss_num_batches_per_epoch": str(steps_per_epoch),
            **{key: str(flags.get(flag)) for key, flag in flag_keys.items()}}


def network_metadata(options: NetworkOptions | LycorisOptions | FluxNetworkOptions, network_args: Mapping[str, Any],
                     module: str = NETWORK_MODULE) -> dict[str, str]:
    """The ``ss_network_*`` header entries (``module``: --network_module)."""
    return {
        "ss_network_module": module,
        "ss_network_dim": str(options.dim),
        "ss_network_alpha": str(options.alpha),
        "ss_network_dropout": str(options.dropout),
        "ss_network_args": json.dumps({k: str(v) for k, v in network_args.items()}) if network_args else "None",
    }



def dataset_metadata(records: Iterable[Any], batch_size: int, resolution: tuple[int, int]) -> dict[str, str]:
    """The ``ss_*`` dataset entries sd-scripts writes: image counts (with repeats), per-folder repeats and
    image counts, and how often each comma-separated caption tag occurs, per folder."""
    num_train = num_reg = 0
    dirs: dict[str, dict[str, int]] = {}
    tags: dict[str, dict[str, int]] = {}
    for record in records:
        folder = Path(record.subset.image_dir or record.image.path.parent).name
        if record.subset.is_reg:
            num_reg += record.num_repeats
        else:
            num_train += record.num_repeats
        entry = dirs.setdefault(folder, {"n_repeats": record.subset.num_repeats, "img_count": 0})
        entry["img_count"] += 1
        counts = tags.setdefault(folder, {})
        for tag in (t.strip() for t in record.caption.split(",")):
            if tag:
                counts[tag] = counts.get(tag, 0) + 1
    return {"ss_num_train_images": str(num_train), "ss_num_reg_images": str(num_reg),
            "ss_batch_size_per_device": str(batch_size), "ss_resolution": str(tuple(resolution)),
            "ss_dataset_dirs": json.dumps(dirs), "ss_tag_frequency": json.dumps(tags)}


@dataclass
class KohyaLoraWriter:
    """Saves ``network`` (anything with ``save_weights(path, dtype, metadata)``) into ``folder`` as sd-scripts
    names its files: ``<name>-000002.<ext>`` at the end of an epoch when ``every_n_epochs`` is due, else
    ``<name>-step00000500.<ext>``, and the final ``<name>.<ext>``."""

    network: Any
    folder: Path
    name: str
    extension: str
    every_n_epochs: int | None
    steps_per_epoch: int
    total_steps: int
    dtype: torch.dtype | None
    metadata: dict[str, str]
    saved: list[Path] = field(default_factory=list)

    def path(self, global_step: int, final: bool = False) -> Path:
        """Where the intermediate file of ``global_step`` goes, or with ``final`` the run's file."""
        epochs = self.every_n_epochs
        if final:
            suffix = ""
        elif epochs and global_step % (epochs * self.steps_per_epoch) == 0:
            suffix = f"-{global_step // self.steps_per_epoch:06d}"
        else:
            suffix = f"-step{global_step:08d}"
        return self.folder / f"{self.name}{suffix}.{self.extension}"

    def save(self, global_step: int, final: bool = False) -> Path:
        """Write the file of ``global_step`` (see :meth:`path`)."""
        metadata = {**self.metadata, "ss_steps": str(global_step),
                    "ss_epoch": str(math.ceil(global_step / self.steps_per_epoch)),
                    "ss_num_epochs": str(math.ceil(self.total_steps / self.steps_per_epoch)),
                    "ss_training_finished_at": str(time.time())}
        path = self.network.save_weights(self.path(global_step, final), self.dtype, metadata)
        if not final:
            self.saved.append(path)
        return path
