"""Options every flow-matching trainer shares, whatever its model family (flag names as in the diffusers / mindone
training scripts): :class:`TrainingConfig`; and FLUX.1's own on top of them: :class:`FluxTrainingConfig`.

Recipes extend one of them with the option groups of :mod:`dreamstep.config.options` they have and their own fields;
``__post_init__`` checks the combinations before any model is loaded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional

from dreamstep.config.choices import TIMESTEP_SAMPLINGS
from dreamstep.config.evaluation import EvaluationOptions
from dreamstep.config.memory import check_compile, check_quantization, check_single_file_quantization, parse_bytes
from dreamstep.config.options import EmaOptions, FluxComponentFileOptions, LossOptions
from dreamstep.config.schema import SEED_BOUNDS, check_option_groups, config_to_toml, option, refuse_unused
from dreamstep.errors import UserError
from dreamstep.files import check_folder_can_be_made

if TYPE_CHECKING:
    from dreamstep.diffusion.flow_matching import FlowMatchingObjective

# diffusers' get_scheduler names (all but piecewise_constant, which needs a rule string).
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")


@dataclass
class TrainingConfig(LossOptions, EmaOptions, EvaluationOptions):
    """What a flow-matching trainer of any family has: the base, the output, the schedule, the optimizer, precision,
    memory options, caches, checkpoints and validation cadence."""

    pretrained_model_name_or_path: str = option(help="the base model: a diffusers folder or a hub id")
    output_dir: str = option(help="where weights, checkpoints, samples and logs are written")
    revision: Optional[str] = option(None, "hub revision of the base model")
    variant: Optional[str] = option(None, "weight file variant of the base model, e.g. fp16")
    seed: int = option(0, "seed for initialisation, data order, noise and timesteps", bounds=SEED_BOUNDS)
    resolution: int = option(512, "training resolution in pixels (images are resized and cropped to it)",
                             bounds="[16, 16384]")
    train_batch_size: int = option(1, "micro-batch size per device", bounds="[1, inf)")
    num_train_epochs: int = option(1, "epochs to train (ignored when --max_train_steps is set)", bounds="[1, inf)")
    max_train_steps: Optional[int] = option(None, "optimizer steps to train; overrides --num_train_epochs",
                                            bounds="[1, inf)")
    gradient_accumulation_steps: int = option(1, "micro-batches per optimizer step", bounds="[1, inf)")
    learning_rate: float = option(1e-4, "learning rate", bounds="(0, inf)")
    lr_scheduler: Literal[LR_SCHEDULERS] = option("constant", "learning-rate schedule")  # type: ignore[valid-type]
    lr_warmup_steps: int = option(0, "warm-up optimizer steps", bounds="[0, inf)")
    lr_num_cycles: int = option(1, "cycles for cosine_with_restarts", bounds="[1, inf)")
    lr_power: float = option(1.0, "power of the polynomial schedule", bounds="(0, inf)")
    optimizer: str = option("AdamW", "AdamW, AdamW8bit (bitsandbytes) or Prodigy (prodigyopt)")
    adam_beta1: float = option(0.9, "Adam beta1", bounds="[0, 1)")
    adam_beta2: float = option(0.999, "Adam beta2", bounds="[0, 1)")
    adam_weight_decay: float = option(1e-4, "weight decay (diffusers' default, given to every optimizer)",
                                     bounds="[0, inf)")
    adam_epsilon: float = option(1e-8, "Adam epsilon", bounds="[0, inf)")
    max_grad_norm: float = option(1.0, "clip the global gradient norm to this (0 disables)", bounds="[0, inf)")
    mixed_precision: Literal["no", "fp16", "bf16"] = option(
        "no", "frozen weights and compute in this precision; trainable weights stay fp32 (no: fp32, with TF32 "
              "matmuls on a GPU; bf16 is about twice as fast on GPUs that have it)")
    allow_tf32: bool = option(True, "on a CUDA GPU, fp32 matmuls and convolutions use TF32 tensor cores "
                                    "(fp32 range, 10-bit mantissa) under --mixed_precision no; false: full fp32")
    weighting_scheme: Literal["none", "logit_normal", "mode", "sigma_sqrt", "cosmap"] = option(
        "none", "timestep sampling / loss weighting (SD3 paper)")
    logit_mean: float = option(0.0, "mean of logit_normal sampling", bounds="(-inf, inf)")
    logit_std: float = option(1.0, "std of logit_normal sampling", bounds="(0, inf)")
    mode_scale: float = option(1.29, "scale of mode sampling", bounds="[-1, 1.75]")
    timestep_sampling: Literal[TIMESTEP_SAMPLINGS] = option(  # type: ignore[valid-type]
        "sigma", "sd-scripts' σ sampling: sigma (an entry of the base model's σ table, drawn by --weighting_scheme), "
                 "uniform, sigmoid (of N(0, 1)·--sigmoid_scale), shift (that, shifted by --discrete_flow_shift) or "
                 "flux_shift (that, shifted by the image's token count as FLUX.1 samples)")
    sigmoid_scale: float = option(1.0, "scale of the normal draw for sigmoid, shift and flux_shift sampling",
                                  bounds="(0, inf)")
    discrete_flow_shift: float = option(3.0, "σ shift of --timestep_sampling shift", bounds="(0, inf)")
    max_sequence_length: int = option(512, "text-encoder tokens per prompt (FLUX: T5's)", bounds="[1, 512]")
    gradient_checkpointing: bool = option(False, "recompute activations in backward to save memory")
    cpu_offload_checkpointing: bool = option(False, "keep the block inputs that gradient checkpointing saves in "
                                                    "host memory until backward needs them (small cards; needs "
                                                    "--gradient_checkpointing)")
    base_quantization: Literal["none", "fp8", "int8", "nf4"] = option(
        "none", "store the frozen transformer's linear weights in 8 or 4 bits (pip install 'dreamstep[quant]'; "
                "nf4 needs a CUDA GPU)")
    text_encoder_quantization: Literal["none", "fp8", "int8", "nf4"] = option(
        "none", "store the large text encoder's linear weights (FLUX: T5's) in 8 or 4 bits while it encodes the "
                "prompts")
    device_memory: Optional[str] = option(None, "memory of the training device for the memory plan, e.g. 12GB "
                                                "(default: detected on CUDA)")
    dry_run: bool = option(False, "print the memory plan and stop before loading any model")
    blocks_to_swap: int = option(0, "keep the last N transformer blocks in host memory and bring each to the "
                                    "device only while it runs (for small cards; needs --gradient_checkpointing)",
                                 bounds="[0, inf)")
    compile: bool = option(False, "torch.compile each transformer block (regional compilation; the first "
                                  "steps are slower while it compiles)")
    cache_latents: bool = option(True, "encode each image with the VAE once and reuse the latents")
    cache_dir: Optional[str] = option(None, "where cached latents and text embeddings live "
                                            "(default: OUTPUT_DIR/cache)")
    checkpointing_steps: int = option(500, "save a resumable checkpoint every N optimizer steps (0: never)",
                                      bounds="[0, inf)")
    checkpoints_total_limit: Optional[int] = option(None, "keep at most this many checkpoints", bounds="[1, inf)")
    resume_from_checkpoint: Optional[str] = option(None, "a checkpoint folder, or 'latest'")
    num_validation_images: int = option(2, "validation images per validation run", bounds="[1, inf)")
    validation_steps: int = option(0, "run validation every N optimizer steps (0: only at the end)", bounds="[0, inf)")
    validation_inference_steps: int = option(20, "denoising steps for validation images", bounds="[1, inf)")
    report_to: Literal["tensorboard", "none"] = option("tensorboard", "where to log scalars")
    logging_steps: int = option(10, "read the loss from the device every N optimizer steps (each step is "
                                    "still logged); the GPU never waits for the host between", bounds="[1, inf)")
    on_nonfinite_loss: Literal["stop", "skip"] = option(
        "stop", "a NaN/inf loss stops the run naming the step, or is skipped with a warning")
    max_skipped_steps_fraction: float = option(
        0.1, "with --on_nonfinite_loss skip: stop with an error once more than this share of the steps is skipped",
        bounds="[0, 1]")
    dataloader_num_workers: int = option(0, "data loading worker processes", bounds="[0, inf)")
    overwrite_output_dir: bool = option(False, "allow writing into a non-empty --output_dir")

    def optimization(self) -> dict[str, Any]:
        """The optimizer and schedule flags as :func:`dreamstep.engine.plan.check_optimization` takes them."""
        return {"optimizer": self.optimizer, "learning_rate": self.learning_rate, "lr_scheduler": self.lr_scheduler,
                "num_cycles": self.lr_num_cycles, "power": self.lr_power, "betas": (self.adam_beta1, self.adam_beta2),
                "weight_decay": self.adam_weight_decay, "eps": self.adam_epsilon}

    def step_counts(self) -> dict[str, Any]:
        """The step flags as :func:`dreamstep.engine.plan.plan_steps` takes them."""
        return {"gradient_accumulation_steps": self.gradient_accumulation_steps,
                "max_train_steps": self.max_train_steps, "num_epochs": self.num_train_epochs,
                "warmup": self.lr_warmup_steps}

    def flow_matching_objective(self) -> FlowMatchingObjective:
        """How the step draws σ and scores the prediction (diffusers' reading of the prediction)."""
        from dreamstep.diffusion.flow_matching import FlowMatchingObjective  # torch: not at import

        return FlowMatchingObjective(
            weighting_scheme=self.weighting_scheme, logit_mean=self.logit_mean, logit_std=self.logit_std,
            mode_scale=self.mode_scale, timestep_sampling=self.timestep_sampling, sigmoid_scale=self.sigmoid_scale,
            discrete_flow_shift=self.discrete_flow_shift, loss=self.loss_function())

    def check_timestep_sampling(self) -> None:
        if self.timestep_sampling != "shift":
            refuse_unused(self, ("discrete_flow_shift",), f"with --timestep_sampling {self.timestep_sampling}")
        if self.timestep_sampling in ("sigma", "uniform"):
            refuse_unused(self, ("sigmoid_scale",), f"with --timestep_sampling {self.timestep_sampling}")
        if self.timestep_sampling != "sigma" and self.weighting_scheme in ("logit_normal", "mode"):
            raise UserError(f"--weighting_scheme {self.weighting_scheme} draws σ from the σ table, which "
                            f"--timestep_sampling {self.timestep_sampling} does not use; give one of the two")

    def cache_root(self) -> Path:
        """Where the run's latent and text caches live: --cache_dir, or OUTPUT_DIR/cache."""
        return Path(self.cache_dir or Path(self.output_dir) / "cache")

    def resolved_toml(self, num_epochs: int) -> str:
        """The settings for ``config.toml`` with the epochs the run really trains (those --max_train_steps
        comes to), so the file says what ran."""
        return config_to_toml(dataclasses.replace(self, num_train_epochs=num_epochs))

    def __post_init__(self) -> None:
        check_quantization(self.base_quantization, "--base_quantization")
        check_compile(self.compile, self.base_quantization, "--base_quantization")
        check_quantization(self.text_encoder_quantization, "--text_encoder_quantization")
        if self.device_memory is not None:
            parse_bytes(self.device_memory, "--device_memory")
        if self.blocks_to_swap and not self.gradient_checkpointing:
            raise UserError("--blocks_to_swap needs --gradient_checkpointing: without it backward holds every "
                            "block's weights on the device and swapping saves no memory")
        if self.cpu_offload_checkpointing and not self.gradient_checkpointing:
            raise UserError("--cpu_offload_checkpointing needs --gradient_checkpointing: it offloads the inputs "
                            "that checkpointing keeps; add --gradient_checkpointing")
        self.check_timestep_sampling()
        if self.cache_dir is not None:
            check_folder_can_be_made(self.cache_dir, "--cache_dir")
        check_option_groups(self)


@dataclass
class FluxTrainingConfig(FluxComponentFileOptions, TrainingConfig):
    """FLUX.1's options on top of :class:`TrainingConfig`: the files users of ComfyUI, Forge and sd-scripts have,
    and the guidance fed to guidance-distilled bases."""

    pretrained_model_name_or_path: str = option(
        help="base FLUX.1 model: a diffusers folder, a hub id, or the transformer file (flux1-dev.safetensors, an "
             "fp8 copy, a .gguf) with --clip_l, --t5xxl and --ae or --model_config")
    transformer_single_file: Optional[str] = option(
        None, "a single-file FLUX transformer (.safetensors, .gguf) to use instead of the folder's transformer",
        kw_only=True)
    model_config: Optional[str] = option(
        None, "with a transformer file as the model: a diffusers FLUX folder or hub id with the configs, tokenizers "
              "and the parts not given as files (default: the file's folder when it holds model_index.json, else "
              "FLUX.1-dev's or -schnell's published configs, by the file's guidance embedding)", kw_only=True)
    guidance_scale: float = option(3.5, "guidance value fed to guidance-distilled models (FLUX.1-dev)",
                                   bounds="[0, inf)", kw_only=True)

    def take_base_file(self, transformer_file: str | None, stored_fp8: bool) -> None:
        """What the base's transformer file tells (the FLUX family reads it when it resolves the base,
        :func:`~dreamstep.models.flux.files.base_of`, before anything is written): a transformer stored in fp8
        trains as the fp8 base it is (sd-scripts' --fp8_base), unless asked otherwise."""
        if stored_fp8 and self.base_quantization == "none":
            self.base_quantization = "fp8"
        file_flag = "--transformer_single_file" if self.transformer_single_file else "--pretrained_model_name_or_path"
        check_single_file_quantization(self.base_quantization, "--base_quantization", transformer_file, file_flag)
        check_compile(self.compile, self.base_quantization, "--base_quantization")

    def __post_init__(self) -> None:
        if self.resolution % 16:
            raise UserError(f"--resolution must be a multiple of 16 for FLUX's 2x2 latent packing "
                            f"(got {self.resolution}; try {max(16, round(self.resolution / 16) * 16)})")
        super().__post_init__()
