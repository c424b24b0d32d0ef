"""Options of ``dreamstep train sdxl-lora``: sd-scripts' ``sdxl_train_network.py`` flags with their meaning."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from dreamstep.config.evaluation import EvaluationOptions
from dreamstep.config.lycoris import LYCORIS_MODULE, check_quantized_base, lycoris_from_network_args
from dreamstep.config.memory import check_compile, check_quantization, check_single_file_quantization, parse_bytes
from dreamstep.config.options import CaptionAugmentationOptions, EmaOptions, LossOptions, MaskedLossOptions
from dreamstep.config.schema import RANK_BOUNDS, SEED_BOUNDS, check_option_groups, option, refuse_unused
from dreamstep.config.training import LR_SCHEDULERS
from dreamstep.errors import UserError
from dreamstep.files import check_folder_can_be_made

NETWORK_MODULE = "networks.lora"
# sd-scripts' --sample_sampler names (models/sdxl/plumbing.py maps each to a diffusers scheduler).
SAMPLERS = ("ddim", "pndm", "euler", "k_euler", "euler_a", "k_euler_a", "dpmsolver++", "heun")


@dataclass
class SDXLLoraConfig(LossOptions, CaptionAugmentationOptions, EmaOptions, MaskedLossOptions, EvaluationOptions):
    # The flags that shape the trained weights: a checkpoint resumes only with the values it was saved with.
    has_snr_schedule: ClassVar[bool] = True  # SDXL's DDPM schedule (sd-scripts' --huber_schedule snr)
    resume_must_match: ClassVar[tuple[str, ...]] = (
        "pretrained_model_name_or_path", "network_module", "network_dim", "network_alpha", "network_args",
        "network_train_unet_only", "network_train_text_encoder_only")

    pretrained_model_name_or_path: str = option(
        help="base SDXL: a diffusers folder, a hub id, or a single file such as sd_xl_base_1.0.safetensors")
    output_dir: str = option(help="where the LoRA, step files, states, samples and logs are written")
    output_name: str = option("last", "file name of the LoRA, without extension")
    model_config: str | None = option(
        None, "for a single-file model: a diffusers SDXL folder or hub id with the configs and tokenizers "
              "(default: the file's folder when it holds model_index.json, else the SDXL base on the hub)")
    dataset_config: str | None = option(None, "Kohya dataset TOML ([general], [[datasets]], [[datasets.subsets]])")
    train_data_dir: str | None = option(None, "folder of <repeats>_<class tokens> image folders (DreamBooth), "
                                              "or of images with --in_json (fine-tuning)")
    reg_data_dir: str | None = option(None, "folder of <repeats>_<class> regularization image folders")
    in_json: str | None = option(None, "fine-tuning metadata JSON for --train_data_dir")
    caption_extension: str = option(".caption", "caption file extension (with --train_data_dir)")
    resolution: str | None = option(None, "training resolution 'W,H' or 'S' (the dataset TOML may set it)")
    enable_bucket: bool | None = option(None, "aspect-ratio buckets (with --train_data_dir)")
    min_bucket_reso: int | None = option(None, "smallest bucket side", bounds="[1, inf)")
    max_bucket_reso: int | None = option(None, "largest bucket side", bounds="[1, inf)")
    bucket_reso_steps: int | None = option(None, "bucket sides are multiples of this", bounds="[1, inf)")
    bucket_no_upscale: bool | None = option(None, "never enlarge images to fill a bucket")
    train_batch_size: int = option(1, "batch size (the dataset TOML's batch_size wins)", bounds="[1, inf)")
    seed: int | None = option(None, "seed for init, data order, noise and timesteps (default: random, saved "
                                    "in config.toml)", bounds=SEED_BOUNDS)
    network_module: str = option(NETWORK_MODULE, "network type: networks.lora (Kohya LoRA / LoCon), or "
                                                 "lycoris.kohya (LyCORIS: --network_args algo=lora|locon|loha|lokr "
                                                 "preset= conv_dim= conv_alpha= factor= decompose_both= "
                                                 "full_matrix= use_tucker= use_scalar= dora_wd= wd_on_output= "
                                                 "rs_lora= dropout= rank_dropout= module_dropout=, LyCORIS' "
                                                 "defaults: algo=lora preset=full conv_dim=network_dim factor=-1; "
                                                 "DoRA's magnitude per input column, as ComfyUI and A1111 apply "
                                                 "it, unless wd_on_output=True)")
    network_dim: int = option(4, "LoRA rank", bounds=RANK_BOUNDS)
    network_alpha: float = option(1.0, "LoRA alpha; the update is scaled by alpha / dim", bounds="(0, inf)")
    network_dropout: float | None = option(None, "dropout on the LoRA down projection's output", bounds="[0, 1)")
    network_args: list[str] = option([], "key=value: conv_dim, conv_alpha (LoCon), rank_dropout, module_dropout")
    network_weights: str | None = option(None, "continue from this LoRA file")
    network_train_unet_only: bool = option(False, "LoRA on the UNet only")
    network_train_text_encoder_only: bool = option(False, "LoRA on the text encoders only")
    learning_rate: float = option(1e-4, "learning rate", bounds="(0, inf)")
    unet_lr: float | None = option(None, "learning rate of the UNet LoRA (default: --learning_rate; 0 freezes it, "
                                         "as in sd-scripts)", bounds="[0, inf)")
    text_encoder_lr: float | None = option(None, "learning rate of the text-encoder LoRA (default: --learning_rate; "
                                                 "0 freezes it, as in sd-scripts)", bounds="[0, inf)")
    optimizer_type: str = option("AdamW", "AdamW, AdamW8bit, Lion, Prodigy or Adafactor")
    optimizer_args: list[str] = option([], "optimizer key=value arguments, e.g. weight_decay=0.05 betas=0.9,0.98; "
                                           "unset ones keep the optimizer's own defaults as in sd-scripts (weight "
                                           "decay 0.01 for AdamW, none for Lion, Prodigy, Adafactor; Adafactor "
                                           "with relative_step=True and its own schedule)")
    lr_scheduler: Literal[LR_SCHEDULERS] = option("constant", "learning-rate schedule")  # type: ignore[valid-type]
    lr_warmup_steps: float = option(0, "warm-up steps (a value below 1 is a fraction of the training steps)",
                                    bounds="[0, inf)")
    lr_scheduler_num_cycles: int = option(1, "cycles of cosine_with_restarts", bounds="[1, inf)")
    lr_scheduler_power: float = option(1.0, "power of the polynomial schedule", bounds="(0, inf)")
    max_grad_norm: float = option(1.0, "clip the gradient norm to this (0: no clipping)", bounds="[0, inf)")
    gradient_accumulation_steps: int = option(1, "micro-batches per optimizer step", bounds="[1, inf)")
    max_train_steps: int = option(1600, "optimizer steps to train", bounds="[1, inf)")
    max_train_epochs: int | None = option(None, "epochs to train (overrides --max_train_steps)", bounds="[1, inf)")
    mixed_precision: Literal["no", "fp16", "bf16"] = option(
        "no", "frozen weights and compute in this precision (no: fp32, with TF32 matmuls on a GPU; bf16 is about "
              "twice as fast on GPUs that have it)")
    allow_tf32: bool = option(True, "on a CUDA GPU, fp32 matmuls and convolutions use TF32 tensor cores "
                                    "(fp32 range, 10-bit mantissa) under --mixed_precision no; false: full fp32")
    full_fp16: bool = option(False, "LoRA weights in fp16 too (needs --mixed_precision fp16)")
    full_bf16: bool = option(False, "LoRA weights in bf16 too (needs --mixed_precision bf16)")
    no_half_vae: bool = option(False, "keep the VAE in fp32 (SDXL's VAE overflows in fp16)")
    gradient_checkpointing: bool = option(False, "recompute activations in backward to save memory")
    blocks_to_swap: int = option(0, "keep the last N UNet transformer blocks in host memory and bring each to "
                                    "the device only while it runs (small cards; needs --gradient_checkpointing)",
                                 bounds="[0, inf)")
    compile: bool = option(False, "torch.compile each UNet transformer block (regional compilation)")
    base_quantization: Literal["none", "fp8", "int8", "nf4"] = option(
        "none", "store the frozen UNet's linear weights in 8 or 4 bits (pip install 'dreamstep[quant]'; nf4 needs "
                "a CUDA GPU)")
    fp8_base: bool = option(False, "sd-scripts' spelling of --base_quantization fp8")
    device_memory: str | None = option(None, "memory of the training device for the memory plan, e.g. 12GB "
                                             "(default: detected on CUDA)")
    dry_run: bool = option(False, "print the memory plan and stop before loading any model")
    sdpa: bool = option(False, "PyTorch scaled-dot-product attention (the default attention)")
    flash_attn: bool = option(False, "flash attention: PyTorch scaled-dot-product attention picks it where it can")
    xformers: bool = option(False, "memory-efficient attention: PyTorch scaled-dot-product attention instead")
    v_parameterization: bool = option(False, "train v-prediction instead of ε-prediction")
    min_snr_gamma: float | None = option(None, "min-SNR loss weighting with this γ (5 is typical)", bounds="(0, inf)")
    noise_offset: float | None = option(None, "offset noise strength (e.g. 0.0357)", bounds="[0, inf)")
    adaptive_noise_scale: float | None = option(None, "raise the offset by this times |latent mean| "
                                                      "(needs --noise_offset)", bounds="(-inf, inf)")
    multires_noise_iterations: int | None = option(None, "multi-resolution noise levels (6-10 typical)",
                                                   bounds="[1, inf)")
    multires_noise_discount: float = option(0.3, "weight decay per multires noise level", bounds="[0, 1]")
    zero_terminal_snr: bool = option(False, "rescale the noise schedule to zero SNR at the last timestep "
                                            "(sd-scripts' flag; usually with --v_parameterization)")
    debiased_estimation_loss: bool = option(False, "weight each sample's loss by 1/√SNR (1/(SNR + 1) with "
                                                   "--v_parameterization), SNR capped at 1000")
    ip_noise_gamma: float | None = option(None, "input perturbation: noise the model's input with ε + γ·ξ while the "
                                                "target stays ε (0.1 is typical)", bounds="(0, inf)")
    ip_noise_gamma_random_strength: bool = option(False, "draw γ from U(0, --ip_noise_gamma) for every batch")
    min_timestep: int = option(0, "smallest training timestep", bounds="[0, 1000)")
    max_timestep: int = option(1000, "training timesteps are below this", bounds="(0, 1000]")
    prior_loss_weight: float = option(1.0, "loss weight of regularization images", bounds="[0, inf)")
    cache_latents: bool = option(True, "encode each image with the VAE once (identical results, faster)")
    cache_latents_to_disk: bool = option(False, "keep the latent cache in OUTPUT_DIR/cache after the run")
    cache_text_encoder_outputs: bool = option(True, "encode each caption once while the text encoders are frozen")
    cache_text_encoder_outputs_to_disk: bool = option(False, "keep the text cache in OUTPUT_DIR/cache after the run")
    max_data_loader_n_workers: int = option(0, "data loading worker processes", bounds="[0, inf)")
    save_model_as: Literal["safetensors", "ckpt", "pt"] = option("safetensors", "LoRA file format")
    save_precision: Literal["fp32", "float", "fp16", "bf16"] | None = option(
        None, "dtype of saved LoRA files (default: the training dtype)")
    save_every_n_steps: int | None = option(None, "write <output_name>-stepNNNNNNNN every N steps", bounds="[1, inf)")
    save_every_n_epochs: int | None = option(None, "write <output_name>-NNNNNN every N epochs", bounds="[1, inf)")
    save_state: bool = option(False, "with every saved LoRA also write a resumable checkpoint-N folder")
    resume: str | None = option(None, "a checkpoint-N folder (or 'latest') to resume exactly")
    sample_prompts: str | None = option(None, "prompt file; options per line: --n --w --h --s --l --d --ss")
    sample_every_n_steps: int | None = option(None, "sample images every N steps", bounds="[1, inf)")
    sample_every_n_epochs: int | None = option(None, "sample images every N epochs", bounds="[1, inf)")
    sample_at_first: bool = option(False, "sample images before training")
    validate_every_n_steps: int | None = option(
        None, "score the validation loss (and --eval_metrics on the --sample_prompts) every N steps; "
              "evaluation also runs before training and at the end", bounds="[1, inf)")
    sample_sampler: Literal[SAMPLERS] = option("ddim", "sampler of the sample images")  # type: ignore[valid-type]
    log_with: Literal["tensorboard", "none"] = option("tensorboard", "where scalars are logged")
    logging_dir: str | None = option(None, "folder for the TensorBoard event files (default: --output_dir)")
    logging_steps: int = option(10, "read the loss from the device every N optimizer steps (each step is "
                                    "still logged); the GPU never waits for the host between", bounds="[1, inf)")
    overwrite_output_dir: bool = option(False, "allow writing into a non-empty --output_dir")

    def __post_init__(self) -> None:
        if self.logging_dir is not None:  # made when the run starts: refused now, not then
            check_folder_can_be_made(self.logging_dir, "--logging_dir")
        if self.network_module not in (NETWORK_MODULE, "lora", LYCORIS_MODULE):
            raise UserError(f"--network_module '{self.network_module}' is not supported; dreamstep trains "
                            f"'{NETWORK_MODULE}' (LoRA, and LoCon with --network_args conv_dim=...) and "
                            f"'{LYCORIS_MODULE}' (LoKr, LoHa, LoCon, DoRA with --network_args algo=...)")
        if self.network_module == LYCORIS_MODULE:
            lycoris, _ = lycoris_from_network_args(self.network_dim, self.network_alpha, self.network_dropout,
                                                   self.network_args)
            check_quantized_base(lycoris.dora_wd, self.unet_quantization,
                                 "--fp8_base" if self.fp8_base else f"--base_quantization {self.base_quantization}",
                                 "--network_args dora_wd=True")
        if self.dataset_config is not None:
            refuse_unused(self, ("reg_data_dir", "in_json"), "with --dataset_config (sd-scripts ignores it there; "
                                                             "set the folders in the dataset TOML)")
        if not self.network_train_unet_only and not self.cache_text_encoder_outputs:
            raise UserError("--cache_text_encoder_outputs false has no effect while the text encoders train (they "
                            "encode every step); remove it, or add --network_train_unet_only")
        if not self.sample_prompts:
            refuse_unused(self, ("sample_sampler",), "without --sample_prompts")
        if self.network_train_unet_only and self.network_train_text_encoder_only:
            raise UserError("--network_train_unet_only and --network_train_text_encoder_only exclude each other")
        if self.unet_lr == 0 and self.text_encoder_lr == 0:
            raise UserError("--unet_lr 0 and --text_encoder_lr 0 leave nothing to train; give one a learning rate")
        if (self.unet_lr == 0 and self.network_train_unet_only) or \
                (self.text_encoder_lr == 0 and self.network_train_text_encoder_only):
            raise UserError("a learning rate of 0 freezes the only part that --network_train_*_only trains, "
                            "leaving nothing to train; give it a learning rate or drop the flag")
        if self.full_fp16 and self.mixed_precision != "fp16":
            raise UserError("--full_fp16 needs --mixed_precision fp16")
        if self.full_bf16 and self.mixed_precision != "bf16":
            raise UserError("--full_bf16 needs --mixed_precision bf16")
        if self.blocks_to_swap and not self.gradient_checkpointing:
            raise UserError("--blocks_to_swap needs --gradient_checkpointing: without it backward holds every "
                            "block's weights on the device and swapping saves no memory")
        if self.fp8_base and self.base_quantization not in ("none", "fp8"):
            raise UserError(f"--fp8_base asks for an fp8 UNet but --base_quantization is "
                            f"{self.base_quantization}; give one of the two")
        check_quantization(self.unet_quantization, "--fp8_base" if self.fp8_base else "--base_quantization")
        single_file = self.pretrained_model_name_or_path if Path(self.pretrained_model_name_or_path).is_file() else None
        check_single_file_quantization(self.unet_quantization, "--base_quantization", single_file,
                                       "--pretrained_model_name_or_path")
        check_compile(self.compile, self.unet_quantization, "--fp8_base" if self.fp8_base else "--base_quantization")
        if self.device_memory is not None:
            parse_bytes(self.device_memory, "--device_memory")
        if self.adaptive_noise_scale is not None and self.noise_offset is None:
            raise UserError("--adaptive_noise_scale needs --noise_offset")
        if self.ip_noise_gamma_random_strength and self.ip_noise_gamma is None:
            raise UserError("--ip_noise_gamma_random_strength needs --ip_noise_gamma")
        if self.debiased_estimation_loss and self.zero_terminal_snr and not self.v_parameterization:
            raise UserError("--debiased_estimation_loss weighs ε-prediction by 1/√SNR, infinite at the last timestep "
                            "of --zero_terminal_snr; add --v_parameterization or drop one of the two")
        if self.min_timestep >= self.max_timestep:
            raise UserError(f"--min_timestep must be below --max_timestep (got {self.min_timestep}, "
                            f"{self.max_timestep})")
        if (self.dataset_config is None) == (self.train_data_dir is None):
            raise UserError("give the data with --dataset_config, or with --train_data_dir (not both)")
        check_option_groups(self)
        if self.eval_metrics and not self.sample_prompts:
            raise UserError("--eval_metrics scores samples of the --sample_prompts: give a prompt file too")
        if self.output_name != Path(self.output_name).name or self.output_name in ("", ".", ".."):
            raise UserError(f"--output_name {self.output_name}: give a file name without folders (files go "
                            f"into --output_dir), e.g. --output_name {Path(self.output_name).name or 'last'}")
        self._settle_defaults()

    def _settle_defaults(self) -> None:
        """What the flags come to, settled once here so that the run and its config.toml agree: a seed drawn
        when none is given, and, as in sd-scripts, a part whose learning rate is 0 gets no optimizer group:
        it is not trained."""
        if self.seed is None:
            self.seed = random.randrange(2**31)
        if self.text_encoder_lr == 0:
            self.network_train_unet_only = True
        if self.unet_lr == 0:
            self.network_train_text_encoder_only = True

    @property
    def unet_quantization(self) -> str:
        return "fp8" if self.fp8_base else self.base_quantization
