"""Options of ``dreamstep train flux-kohya``: sd-scripts' ``flux_train_network.py`` flags, by its names and with its
defaults and meaning.

Why a command of its own rather than a second spelling inside ``train flux-lora``: the two trainers differ where a
user would not see it. sd-scripts reads the prediction as ``--model_prediction_type`` (default ``sigma_scaled``),
draws σ from a table shifted by ``--discrete_flow_shift``, weighs regularization images per sample, trains the
fused BFL modules (``img_attn.qkv``) and writes ``lora_unet_…`` files; diffusers' script does none of these. One
flag set per command keeps each default true to its source, so a command line copied from either trainer trains
what it trained there. Both commands share the recipe kit (option groups, the FLUX step, the engine, the data,
model and LoRA code); this config only names sd-scripts' flags.

sd-scripts flags that dreamstep does not implement are named in :data:`REFUSED_FLAGS` with the reason; the command
line answers them (all at once) in one line, and never accepts a flag it would ignore.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, Optional

from dreamstep.config.choices import MODEL_PREDICTION_TYPES, TIMESTEP_SAMPLINGS
from dreamstep.config.flux_network_args import FluxNetworkOptions
from dreamstep.config.memory import parse_bytes
from dreamstep.config.options import (
    CaptionAugmentationOptions,
    FluxComponentFileOptions,
    LossOptions,
    MaskedLossOptions,
)
from dreamstep.config.schema import RANK_BOUNDS, SEED_BOUNDS, check_option_groups, option, refuse_unused
from dreamstep.config.training import LR_SCHEDULERS
from dreamstep.errors import UserError
from dreamstep.files import check_folder_can_be_made

if TYPE_CHECKING:
    from dreamstep.diffusion.flow_matching import FlowMatchingObjective

NETWORK_MODULE = "networks.lora_flux"
WEIGHTING_SCHEMES = ("uniform", "none", "sigma_sqrt", "logit_normal", "mode", "cosmap")

# sd-scripts flags of flux_train_network.py that dreamstep does not implement, and why (or what to use instead).
REFUSED_FLAGS = {
    "highvram": "dreamstep places the models itself; remove it",
    "lowram": "dreamstep places the models itself; remove it",
    "xformers": "FLUX runs PyTorch's scaled-dot-product attention (--sdpa)",
    "mem_eff_attn": "FLUX runs PyTorch's scaled-dot-product attention (--sdpa)",
    "split_mode": "sd-scripts deprecated it; use --blocks_to_swap",
    "model_type": "only FLUX.1 trains here (not Chroma)",
    "fp8_base_unet": "use --fp8_base (T5 stays in the precision of its file)",
    "sample_sampler": "FLUX samples with its flow-matching Euler sampler, as sd-scripts does",
    "max_token_length": "FLUX reads --t5xxl_max_token_length",
    "clip_skip": "FLUX reads CLIP-L's pooled output, which no layer skip changes",
    "ip_noise_gamma": "not implemented for FLUX",
    "noise_offset": "sd-scripts' FLUX trainer has no offset noise",
    "min_snr_gamma": "flow matching has no SNR weighting; see --weighting_scheme",
    "v_parameterization": "FLUX predicts the velocity; see --model_prediction_type",
    "save_last_n_epochs": "not implemented; delete old files yourself",
    "save_last_n_steps": "not implemented; delete old files yourself",
    "save_state_on_train_end": "use --save_state",
    "network_multiplier": "not implemented (the multiplier is 1)",
    "scale_weight_norms": "not implemented",
    "base_weights": "not implemented",
    "dim_from_weights": "not implemented; give --network_dim",
    "training_comment": "not implemented",
    "no_metadata": "dreamstep always writes sd-scripts' metadata",
    "huggingface_repo_id": "dreamstep does not upload",
    "wandb_api_key": "dreamstep logs to TensorBoard (--log_with tensorboard)",
    "deepspeed": "dreamstep's flux-lora and flux-controlnet shard with FSDP",
    "validation_split": "not implemented here; dreamstep's train flux-lora scores held-out images",
    "validate_every_n_steps": "not implemented here; dreamstep's train flux-lora scores held-out images",
    "masked_loss_prob": "not implemented",
}


@dataclass
class FluxKohyaConfig(FluxComponentFileOptions, LossOptions, MaskedLossOptions, CaptionAugmentationOptions):
    # The flags that shape the trained weights: a checkpoint resumes only with the values it was saved with.
    resume_must_match: ClassVar[tuple[str, ...]] = (
        "pretrained_model_name_or_path", "network_module", "network_dim", "network_alpha", "network_args",
        "network_train_unet_only", "network_train_text_encoder_only")
    refused_flags: ClassVar[dict[str, str]] = REFUSED_FLAGS
    revision: ClassVar[None] = None  # the FLUX loaders' hub revision: sd-scripts names files, never hub ids
    variant: ClassVar[None] = None

    pretrained_model_name_or_path: str = option(
        help="the FLUX.1 transformer file (flux1-dev.safetensors, an fp8 copy, a .gguf) with --clip_l, --t5xxl and "
             "--ae, or a diffusers FLUX folder / hub id")
    output_dir: str = option(help="where the LoRA, step files, states, samples and logs are written")
    output_name: str = option("last", "file name of the LoRA, without extension")
    model_config: Optional[str] = option(
        None, "a diffusers FLUX folder or hub id with the configs, tokenizers and the parts not given as files "
              "(default: the file's folder when it holds model_index.json, else FLUX.1-dev's or -schnell's "
              "published configs)")
    dataset_config: Optional[str] = option(None, "Kohya dataset TOML ([general], [[datasets]], [[datasets.subsets]])")
    train_data_dir: Optional[str] = option(None, "folder of <repeats>_<class tokens> image folders (DreamBooth), "
                                                 "or of images with --in_json (fine-tuning)")
    reg_data_dir: Optional[str] = option(None, "folder of <repeats>_<class> regularization image folders")
    in_json: Optional[str] = option(None, "fine-tuning metadata JSON for --train_data_dir")
    caption_extension: str = option(".caption", "caption file extension (with --train_data_dir)")
    resolution: Optional[str] = option(None, "training resolution 'W,H' or 'S' (the dataset TOML may set it)")
    enable_bucket: Optional[bool] = option(None, "aspect-ratio buckets (with --train_data_dir)")
    min_bucket_reso: Optional[int] = option(None, "smallest bucket side", bounds="[1, inf)")
    max_bucket_reso: Optional[int] = option(None, "largest bucket side", bounds="[1, inf)")
    bucket_reso_steps: Optional[int] = option(None, "bucket sides are multiples of this (FLUX needs 16s)",
                                              bounds="[1, inf)")
    bucket_no_upscale: Optional[bool] = option(None, "never enlarge images to fill a bucket")
    train_batch_size: int = option(1, "batch size (the dataset TOML's batch_size wins)", bounds="[1, inf)")
    max_data_loader_n_workers: int = option(0, "data loading worker processes", bounds="[0, inf)")
    persistent_data_loader_workers: bool = option(False, "keep the loader's workers between epochs (dreamstep's "
                                                         "workers always persist)")
    seed: Optional[int] = option(None, "seed for init, data order, noise and timesteps (default: random, saved in "
                                       "config.toml)", bounds=SEED_BOUNDS)
    network_module: str = option(NETWORK_MODULE, "network type: networks.lora_flux")
    network_dim: int = option(4, "LoRA rank", bounds=RANK_BOUNDS)
    network_alpha: float = option(1.0, "LoRA alpha; the update is scaled by alpha / dim", bounds="(0, inf)")
    network_dropout: Optional[float] = option(None, "dropout on the LoRA down projection's output", bounds="[0, 1)")
    network_args: list[str] = option(
        [], "key=value of networks.lora_flux: train_blocks=all|single|double, split_qkv=True, img_attn_dim= "
            "txt_attn_dim= img_mlp_dim= txt_mlp_dim= img_mod_dim= txt_mod_dim= single_dim= single_mod_dim= (0 skips "
            "those modules), in_dims=[img,time,vector,guidance,txt], train_double_block_indices=0-3,7 "
            "train_single_block_indices=, rank_dropout=, module_dropout=, loraplus_lr_ratio= "
            "loraplus_unet_lr_ratio= loraplus_text_encoder_lr_ratio=")
    network_weights: Optional[str] = option(None, "continue from this LoRA file")
    network_train_unet_only: bool = option(False, "LoRA on the transformer only (default: on CLIP-L too, as "
                                                  "sd-scripts)")
    network_train_text_encoder_only: bool = option(False, "LoRA on CLIP-L only")
    learning_rate: float = option(2e-6, "learning rate (sd-scripts' default 2e-6; its FLUX examples give 1e-4)",
                                  bounds="(0, inf)")
    unet_lr: Optional[float] = option(None, "learning rate of the transformer LoRA (default: --learning_rate)",
                                      bounds="(0, inf)")
    text_encoder_lr: Optional[float] = option(None, "learning rate of the CLIP-L LoRA (default: --learning_rate)",
                                              bounds="(0, inf)")
    optimizer_type: str = option("AdamW", "AdamW, AdamW8bit, Lion, Prodigy or Adafactor")
    optimizer_args: list[str] = option([], "optimizer key=value arguments, e.g. weight_decay=0.05 "
                                           "relative_step=False")
    lr_scheduler: Literal[LR_SCHEDULERS] = option("constant", "learning-rate schedule")  # type: ignore[valid-type]
    lr_warmup_steps: float = option(0, "warm-up steps (a value below 1 is a fraction of the training steps)",
                                    bounds="[0, inf)")
    lr_scheduler_num_cycles: int = option(1, "cycles of cosine_with_restarts", bounds="[1, inf)")
    lr_scheduler_power: float = option(1.0, "power of the polynomial schedule", bounds="(0, inf)")
    max_grad_norm: float = option(1.0, "clip the gradient norm to this (0: no clipping)", bounds="[0, inf)")
    gradient_accumulation_steps: int = option(1, "micro-batches per optimizer step", bounds="[1, inf)")
    max_train_steps: int = option(1600, "optimizer steps to train", bounds="[1, inf)")
    max_train_epochs: Optional[int] = option(None, "epochs to train (overrides --max_train_steps)", bounds="[1, inf)")
    mixed_precision: Literal["no", "fp16", "bf16"] = option(
        "no", "frozen weights and compute in this precision (bf16 is FLUX's own)")
    full_fp16: bool = option(False, "LoRA weights in fp16 too (needs --mixed_precision fp16)")
    full_bf16: bool = option(False, "LoRA weights in bf16 too (needs --mixed_precision bf16)")
    fp8_base: bool = option(False, "store the frozen transformer's linear weights in fp8 (pip install "
                                   "'dreamstep[quant]'); a transformer file stored in fp8 trains so anyway")
    gradient_checkpointing: bool = option(False, "recompute activations in backward to save memory")
    cpu_offload_checkpointing: bool = option(False, "keep the block inputs that gradient checkpointing saves in host "
                                                    "memory until backward needs them (needs "
                                                    "--gradient_checkpointing; not with --blocks_to_swap)")
    blocks_to_swap: int = option(0, "keep the last N transformer blocks in host memory and bring each to the "
                                    "device only while it runs (small cards; needs --gradient_checkpointing)",
                                 bounds="[0, inf)")
    sdpa: bool = option(False, "PyTorch scaled-dot-product attention (FLUX's attention here in any case)")
    device_memory: Optional[str] = option(None, "memory of the training device for the memory plan, e.g. 12GB "
                                                "(default: detected on CUDA)")
    dry_run: bool = option(False, "print the memory plan and stop before loading any model")
    timestep_sampling: Literal[TIMESTEP_SAMPLINGS] = option(  # type: ignore[valid-type]
        "sigma", "σ sampling: sigma (an entry of the σ table shifted by --discrete_flow_shift, drawn by "
                 "--weighting_scheme), uniform, sigmoid (of N(0, 1)·--sigmoid_scale), shift (that, shifted by "
                 "--discrete_flow_shift) or flux_shift (that, shifted by the image's token count)")
    sigmoid_scale: float = option(1.0, "scale of the normal draw of sigmoid, shift and flux_shift", bounds="(0, inf)")
    discrete_flow_shift: float = option(3.0, "shift of the σ table (sigma) and of --timestep_sampling shift",
                                        bounds="(0, inf)")
    model_prediction_type: Literal[MODEL_PREDICTION_TYPES] = option(  # type: ignore[valid-type]
        "sigma_scaled", "how the output is read before the loss against ε - x: raw, additive (+ x_σ) or "
                        "sigma_scaled (x_σ - σ·output, weighted by --weighting_scheme)")
    weighting_scheme: Literal[WEIGHTING_SCHEMES] = option(  # type: ignore[valid-type]
        "uniform", "σ density of --timestep_sampling sigma (logit_normal, mode) or loss weighting of sigma_scaled "
                   "(sigma_sqrt, cosmap); uniform and none are the same")
    logit_mean: float = option(0.0, "mean of logit_normal", bounds="(-inf, inf)")
    logit_std: float = option(1.0, "std of logit_normal", bounds="(0, inf)")
    mode_scale: float = option(1.29, "scale of mode", bounds="[-1, 1.75]")
    guidance_scale: float = option(3.5, "guidance fed to a guidance-distilled base (FLUX.1-dev) while training",
                                   bounds="[0, inf)")
    t5xxl_max_token_length: Optional[int] = option(None, "T5 tokens per caption (default: 512 for dev, 256 for "
                                                         "schnell)", bounds="[1, 512]")
    apply_t5_attn_mask: bool = option(False, "T5 reads each caption with its attention mask, and the transformer "
                                             "masks T5's padding tokens out of its attention (training and samples)")
    prior_loss_weight: float = option(1.0, "loss weight of regularization images", bounds="[0, inf)")
    cache_latents: bool = option(True, "encode each image with the VAE once (its posterior is sampled every step)")
    cache_latents_to_disk: bool = option(False, "keep the latent cache in OUTPUT_DIR/cache after the run")
    cache_text_encoder_outputs: Optional[bool] = option(
        None, "encode each caption once (default: on; CLIP-L runs every step while its LoRA trains; off with "
              "--network_args train_t5xxl=True, whose T5 runs every step)")
    cache_text_encoder_outputs_to_disk: bool = option(False, "keep the text cache in OUTPUT_DIR/cache after the run")
    save_model_as: Literal["safetensors", "ckpt", "pt"] = option("safetensors", "LoRA file format")
    save_precision: Optional[Literal["fp32", "float", "fp16", "bf16"]] = option(
        None, "dtype of saved LoRA files (default: the training dtype)")
    save_every_n_steps: Optional[int] = option(None, "write <output_name>-stepNNNNNNNN every N steps",
                                               bounds="[1, inf)")
    save_every_n_epochs: Optional[int] = option(None, "write <output_name>-NNNNNN every N epochs", bounds="[1, inf)")
    save_state: bool = option(False, "with every saved LoRA also write a resumable checkpoint-N folder")
    resume: Optional[str] = option(None, "a checkpoint-N folder (or 'latest') to resume exactly")
    sample_prompts: Optional[str] = option(None, "prompt file; options per line: --n --w --h --s --d --l --g")
    sample_every_n_steps: Optional[int] = option(None, "sample images every N steps", bounds="[1, inf)")
    sample_every_n_epochs: Optional[int] = option(None, "sample images every N epochs", bounds="[1, inf)")
    sample_at_first: bool = option(False, "sample images before training")
    log_with: Literal["tensorboard", "none"] = option("tensorboard", "where scalars are logged")
    logging_dir: Optional[str] = option(None, "folder for the TensorBoard event files (default: --output_dir)")
    logging_steps: int = option(10, "read the loss from the device every N optimizer steps (each step is still "
                                    "logged)", bounds="[1, inf)")
    overwrite_output_dir: bool = option(False, "allow writing into a non-empty --output_dir")

    def __post_init__(self) -> None:
        if self.logging_dir is not None:  # made when the run starts: refused now, not then
            check_folder_can_be_made(self.logging_dir, "--logging_dir")
        if self.network_module != NETWORK_MODULE:
            raise UserError(f"--network_module '{self.network_module}' is not supported here; train flux-kohya "
                            f"trains '{NETWORK_MODULE}'")
        network, _ = FluxNetworkOptions.from_flags(self.network_dim, self.network_alpha, self.network_dropout,
                                                   self.network_args)
        if self.network_train_unet_only and self.network_train_text_encoder_only:
            raise UserError("--network_train_unet_only and --network_train_text_encoder_only exclude each other")
        if self.full_fp16 and self.mixed_precision != "fp16":
            raise UserError("--full_fp16 needs --mixed_precision fp16")
        if self.full_bf16 and self.mixed_precision != "bf16":
            raise UserError("--full_bf16 needs --mixed_precision bf16")
        if self.blocks_to_swap and not self.gradient_checkpointing:
            raise UserError("--blocks_to_swap needs --gradient_checkpointing: without it backward holds every "
                            "block's weights on the device and swapping saves no memory")
        if self.cpu_offload_checkpointing and not self.gradient_checkpointing:
            raise UserError("--cpu_offload_checkpointing needs --gradient_checkpointing: it offloads the inputs "
                            "that checkpointing keeps; add --gradient_checkpointing")
        if self.cpu_offload_checkpointing and self.blocks_to_swap:
            raise UserError("--cpu_offload_checkpointing with --blocks_to_swap: sd-scripts takes one of the two; "
                            "drop one")
        if (self.dataset_config is None) == (self.train_data_dir is None):
            raise UserError("give the data with --dataset_config, or with --train_data_dir (not both)")
        if self.output_name != Path(self.output_name).name or self.output_name in ("", ".", ".."):
            raise UserError(f"--output_name {self.output_name}: give a file name without folders (files go "
                            f"into --output_dir), e.g. --output_name {Path(self.output_name).name or 'last'}")
        if self.device_memory is not None:
            parse_bytes(self.device_memory, "--device_memory")
        if self.timestep_sampling not in ("sigmoid", "shift", "flux_shift"):
            refuse_unused(self, ("sigmoid_scale",), f"with --timestep_sampling {self.timestep_sampling}")
        if self.timestep_sampling in ("uniform", "sigmoid", "flux_shift"):
            refuse_unused(self, ("discrete_flow_shift",), f"with --timestep_sampling {self.timestep_sampling}")
        density = self.weighting_scheme in ("logit_normal", "mode")
        if density and self.timestep_sampling != "sigma":
            raise UserError(f"--weighting_scheme {self.weighting_scheme} draws σ from the σ table, which "
                            f"--timestep_sampling {self.timestep_sampling} does not use; give one of the two")
        if self.weighting_scheme in ("sigma_sqrt", "cosmap") and self.model_prediction_type != "sigma_scaled":
            raise UserError(f"--weighting_scheme {self.weighting_scheme} weighs the loss only with "
                            f"--model_prediction_type sigma_scaled (as in sd-scripts); drop it or use sigma_scaled")
        if self.weighting_scheme != "logit_normal":
            refuse_unused(self, ("logit_mean", "logit_std"), f"with --weighting_scheme {self.weighting_scheme}")
        if self.weighting_scheme != "mode":
            refuse_unused(self, ("mode_scale",), f"with --weighting_scheme {self.weighting_scheme}")
        if not self.sample_prompts:
            refuse_unused(self, ("sample_every_n_steps", "sample_every_n_epochs", "sample_at_first"),
                          "without --sample_prompts")
        if self.cache_latents_to_disk:
            self.cache_latents = True  # as sd-scripts: caching to disk caches
        if self.cache_text_encoder_outputs_to_disk:
            self.cache_text_encoder_outputs = True
        if network.train_t5xxl:
            if self.network_train_unet_only:
                raise UserError("--network_args train_t5xxl=True with --network_train_unet_only: no text encoder "
                                "LoRA would train (sd-scripts adds none); drop one of the two")
            if self.cache_text_encoder_outputs:
                raise UserError("--cache_text_encoder_outputs with --network_args train_t5xxl=True: T5-XXL trains, "
                                "so its outputs cannot be cached (sd-scripts' rule); drop "
                                "--cache_text_encoder_outputs[_to_disk]")
            self.cache_text_encoder_outputs = False
        elif self.cache_text_encoder_outputs is False:
            raise UserError("--cache_text_encoder_outputs false: dreamstep's FLUX trainers encode each caption with "
                            "T5 once (the same embeddings as encoding every step); drop the value")
        else:
            self.cache_text_encoder_outputs = True
        if self.dataset_config is not None:
            refuse_unused(self, ("reg_data_dir", "in_json"), "with --dataset_config (sd-scripts ignores it there; "
                                                             "set the folders in the dataset TOML)")
        check_option_groups(self)
        if self.seed is None:
            self.seed = random.randrange(2**31)

    @property
    def base_quantization(self) -> str:
        return "fp8" if self.fp8_base else "none"

    @property
    def train_transformer(self) -> bool:
        return not self.network_train_text_encoder_only

    @property
    def train_clip(self) -> bool:
        return not self.network_train_unet_only

    @property
    def train_t5(self) -> bool:
        """``--network_args train_t5xxl=True``: T5-XXL gets a LoRA and runs every step (its outputs uncached)."""
        return FluxNetworkOptions.from_flags(self.network_dim, self.network_alpha, self.network_dropout,
                                             self.network_args)[0].train_t5xxl

    def take_base_file(self, transformer_file: str | None, stored_fp8: bool) -> None:
        """What the base's transformer file tells (see ``FluxTrainingConfig.take_base_file``): a file stored in fp8
        trains as the fp8 base it is, as sd-scripts' --fp8_base."""
        self.fp8_base = self.fp8_base or stored_fp8

    def cache_root(self) -> Path:
        """Where the run's latent and text caches live (kept after the run with --cache_*_to_disk)."""
        return Path(self.output_dir) / "cache"

    def max_sequence_length(self, guidance_embeds: bool) -> int:
        """T5 tokens per caption: --t5xxl_max_token_length, or sd-scripts' 512 for dev and 256 for schnell."""
        if self.t5xxl_max_token_length is not None:
            return self.t5xxl_max_token_length
        return 512 if guidance_embeds else 256

    def flow_matching_objective(self) -> FlowMatchingObjective:
        """sd-scripts' reading of the step: σ drawn by --timestep_sampling, the output read by
        --model_prediction_type and weighted (sigma_scaled) by --weighting_scheme."""
        from dreamstep.diffusion.flow_matching import FlowMatchingObjective  # torch: not at import

        scheme = "none" if self.weighting_scheme == "uniform" else self.weighting_scheme
        return FlowMatchingObjective(
            weighting_scheme=scheme, logit_mean=self.logit_mean, logit_std=self.logit_std,
            mode_scale=self.mode_scale, timestep_sampling=self.timestep_sampling, sigmoid_scale=self.sigmoid_scale,
            discrete_flow_shift=self.discrete_flow_shift, model_prediction_type=self.model_prediction_type,
            loss=self.loss_function())
