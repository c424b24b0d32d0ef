"""Option groups that the trainers' configs compose, as litgpt composes ``TrainArgs`` and ``EvalArgs``: each
flag is declared once, here, and a config inherits the groups it has (``class MyConfig(LoraOptions,
PairedDataOptions, FluxTrainingConfig)``). The fields are keyword-only, so a group sits beside a config's
required fields in any order. A group's ``check_group`` refuses its bad combinations; every group a config is
composed of is checked when the config is built (:func:`~dreamstep.config.schema.check_option_groups`), before any
model loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Optional

from dreamstep.config.choices import HUBER_SCHEDULES, LOSS_TYPES
from dreamstep.config.evaluation import EvaluationOptions
from dreamstep.config.lycoris import LycorisOptions
from dreamstep.config.schema import RANK_BOUNDS, option, refuse_unused
from dreamstep.errors import UserError

if TYPE_CHECKING:
    from dreamstep.diffusion.losses import LossFunction


@dataclass
class FluxComponentFileOptions:
    """The FLUX.1 component files users of ComfyUI, Forge and sd-scripts have, by sd-scripts' flag names; each
    replaces that part of the base (the transformer file itself is given as the model)."""

    clip_l: Optional[str] = option(None, "FLUX: the CLIP-L text encoder file (clip_l.safetensors) instead of the "
                                         "base's", kw_only=True)
    t5xxl: Optional[str] = option(None, "FLUX: the T5-XXL encoder file (t5xxl_fp16.safetensors, an fp8 copy) "
                                        "instead of the base's", kw_only=True)
    ae: Optional[str] = option(None, "FLUX: the autoencoder file (ae.safetensors) instead of the base's VAE",
                               kw_only=True)

    def component_files(self) -> dict[str, str]:
        """The files given, by flag name without dashes."""
        return {name: getattr(self, name) for name in ("clip_l", "t5xxl", "ae") if getattr(self, name) is not None}


@dataclass
class LoraOptions:
    """The shape and targets of a FLUX transformer LoRA (diffusers' DreamBooth LoRA flag names). The LyCORIS
    adapter types are their own group (:class:`LycorisTypeOptions`): a trainer that has not built them has not
    got their flags."""

    rank: int = option(4, "LoRA rank", bounds=RANK_BOUNDS, kw_only=True)
    lora_alpha: Optional[float] = option(None, "LoRA alpha (default: the rank, i.e. scale 1)", bounds="(0, inf)",
                                         kw_only=True)
    lora_dropout: float = option(0.0, "dropout on the LoRA branch", bounds="[0, 1)", kw_only=True)
    lora_layers: list[str] = option(["attention"], "preset (attention, attention+ff, all-linear) or "
                                                   "comma-separated module names", kw_only=True)
    save_kohya_format: bool = option(False, "also write the LoRA with sd-scripts' key names", kw_only=True)

    @property
    def alpha(self) -> float:
        """The alpha the LoRA is built with: --lora_alpha, or the rank."""
        return self.lora_alpha if self.lora_alpha is not None else self.rank


@dataclass
class LycorisTypeOptions(LoraOptions):
    """``--lora_type``: a LoKr, LoHa or DoRA through LyCORIS instead of peft's LoRA, with their settings."""

    lora_type: Literal["lora", "lokr", "loha", "dora"] = option(
        "lora", "the adapter: lora (peft; diffusers layout), or through LyCORIS in its layout, which ComfyUI and "
                "Forge load: lokr (Kronecker product), loha (Hadamard product), dora (LoRA with a trained magnitude "
                "per input column, as ComfyUI and A1111 apply it)",
        kw_only=True)
    lokr_factor: int = option(16, "LoKr: each width splits into factor x width/factor, or the nearest divisor "
                                  "(-1: the most balanced split); 16 as SimpleTuner", bounds="[-1, inf)",
                               kw_only=True)
    lokr_full_matrix: bool = option(True, "LoKr: the larger Kronecker factor as a full matrix, so --rank is unused "
                                          "(SimpleTuner's default); false: a product of rank --rank", kw_only=True)
    lokr_decompose_both: bool = option(False, "LoKr: the smaller Kronecker factor as a product of rank --rank too",
                                       kw_only=True)
    rank_dropout: float = option(0.0, "lokr/loha/dora: drop whole output rows of the update at this rate",
                                 bounds="[0, 1)", kw_only=True)
    module_dropout: float = option(0.0, "lokr/loha/dora: leave out a module's whole update at this rate per step",
                                   bounds="[0, 1)", kw_only=True)

    def check_group(self) -> None:
        if self.lora_type == "lora":
            refuse_unused(self, ("rank_dropout", "module_dropout"), "with --lora_type lora (peft's LoRA has "
                                                                    "--lora_dropout)")
        if self.lora_type != "lokr":
            refuse_unused(self, ("lokr_factor", "lokr_full_matrix", "lokr_decompose_both"),
                          f"with --lora_type {self.lora_type}")
        if self.lora_type in ("lokr", "loha") and self.lora_dropout:
            raise UserError(f"--lora_dropout: LyCORIS' {self.lora_type} has no plain dropout; use --rank_dropout "
                            "or --module_dropout")
        if self.lora_type != "lora" and self.save_kohya_format:
            raise UserError(f"--save_kohya_format: sd-scripts' FLUX LoRA layout fuses q, k and v into one module, "
                            f"which a {self.lora_type} of separate modules cannot be written as; the "
                            "LyCORIS file (pytorch_lora_weights.safetensors) loads in ComfyUI and Forge as it is")
        if self.lora_type != "lora":
            self.lycoris_options()

    def lycoris_options(self) -> LycorisOptions:
        """The LyCORIS algorithm and settings of --lora_type lokr, loha or dora."""
        lokr = self.lora_type == "lokr"
        return LycorisOptions(
            algo="lora" if self.lora_type == "dora" else self.lora_type, dim=self.rank, alpha=self.alpha,
            factor=self.lokr_factor if lokr else -1, full_matrix=lokr and self.lokr_full_matrix,
            decompose_both=lokr and self.lokr_decompose_both, dora_wd=self.lora_type == "dora",
            dropout=self.lora_dropout, rank_dropout=self.rank_dropout, module_dropout=self.module_dropout)


@dataclass
class LossOptions:
    """sd-scripts' loss types (``--loss_type``, ``--huber_schedule``, ``--huber_c``, ``--huber_scale``), its names,
    defaults and formulas (:mod:`dreamstep.diffusion.losses`)."""

    loss_type: Literal[LOSS_TYPES] = option(  # type: ignore[valid-type]
        "l2", "loss of each latent element: l2 (MSE), l1, huber or smooth_l1 (pseudo-Huber, scheduled threshold)",
        kw_only=True)
    huber_schedule: Literal[HUBER_SCHEDULES] = option(  # type: ignore[valid-type]
        "snr", "how the Huber threshold follows the timestep (snr needs a DDPM schedule: SDXL, not FLUX)",
        kw_only=True)
    huber_c: float = option(0.1, "Huber threshold (constant), or its value at the last timestep (exponential, snr)",
                            bounds="(0, 1]", kw_only=True)
    huber_scale: float = option(1.0, "Huber threshold scale (constant, exponential)", bounds="(0, inf)",
                                kw_only=True)

    # Whether the model's noise schedule has an SNR (a DDPM schedule: SDXL); flow matching has none.
    has_snr_schedule: ClassVar[bool] = False

    def check_group(self) -> None:
        """Refuse Huber flags without a Huber loss, and the snr schedule where there is no SNR."""
        if self.loss_type not in ("huber", "smooth_l1"):
            refuse_unused(self, ("huber_c", "huber_scale"), f"with --loss_type {self.loss_type}")
            return
        if self.huber_schedule == "snr" and not self.has_snr_schedule:
            raise UserError(f"--loss_type {self.loss_type} with --huber_schedule snr needs a DDPM schedule's SNR, "
                            "which flow matching has not (sd-scripts stops there too); give --huber_schedule "
                            "constant or exponential")

    def loss_function(self) -> LossFunction:
        from dreamstep.diffusion.losses import LossFunction  # torch: not at import, so --help answers first

        return LossFunction(self.loss_type, self.huber_schedule, self.huber_c, self.huber_scale)


@dataclass
class EmaOptions:
    """An exponential moving average of the trained weights (LoRA or ControlNet), as ai-toolkit, SimpleTuner and
    OneTrainer keep one, with diffusers' EMAModel (:mod:`dreamstep.engine.ema`)."""

    ema_decay: Optional[float] = option(None, "keep an EMA of the trained weights with this decay (e.g. 0.999; "
                                              "warmed up from 0 as diffusers does); saved as a second file",
                                        bounds="(0, 1)", kw_only=True)
    ema_update_every: int = option(1, "update the EMA every N optimizer steps", bounds="[1, inf)", kw_only=True)
    ema_warmup_power: Optional[float] = option(None, "warm the decay up as 1 - (1 + n)^-power (2/3 for long runs, "
                                                     "3/4 for short; default: (1 + n) / (10 + n))",
                                               bounds="(0, inf)", kw_only=True)
    ema_on_cpu: bool = option(False, "keep the EMA in host memory (small cards; each update waits for the "
                                     "device)", kw_only=True)
    ema_validation: bool = option(True, "with --ema_decay: samples and evaluation use the EMA weights",
                                  kw_only=True)

    def check_group(self) -> None:
        if self.ema_decay is None:
            refuse_unused(self, ("ema_update_every", "ema_warmup_power", "ema_on_cpu", "ema_validation"),
                          "without --ema_decay")

    def ema_options(self) -> dict[str, Any] | None:
        """The average's settings as :class:`~dreamstep.engine.ema.WeightAverage` takes them; ``None``: no EMA."""
        if self.ema_decay is None:
            return None
        return {"decay": self.ema_decay, "update_every": self.ema_update_every,
                "warmup_power": self.ema_warmup_power, "on_cpu": self.ema_on_cpu}


@dataclass
class MaskedLossOptions:
    """sd-scripts' ``--masked_loss`` (:mod:`dreamstep.data.masks`): the masks come from a dataset TOML."""

    masked_loss: bool = option(False, "weight the loss by each image's mask: its alpha channel (alpha_mask = true "
                                      "in a dataset TOML subset) or the same-named image of the subset's "
                                      "conditioning_data_dir; black regions train nothing", kw_only=True)

    def check_group(self) -> None:
        if self.masked_loss and getattr(self, "dataset_config", None) is None:
            raise UserError("--masked_loss reads its masks from a dataset TOML (alpha_mask = true, or "
                            "conditioning_data_dir in each subset); give --dataset_config")


@dataclass
class TextEncoderLoraOptions:
    """A LoRA on the CLIP text encoder beside the transformer's, with its own optimizer group."""

    train_text_encoder: bool = option(False, "also train a LoRA on the CLIP text encoder", kw_only=True)
    text_encoder_lr: float = option(5e-6, "learning rate of the text-encoder LoRA (diffusers' default)",
                                    bounds="(0, inf)", kw_only=True)
    adam_weight_decay_text_encoder: float = option(1e-3, "weight decay of the text-encoder LoRA (diffusers' "
                                                         "default)", bounds="[0, inf)", kw_only=True)

    def check_group(self) -> None:
        if not self.train_text_encoder:
            refuse_unused(self, ("text_encoder_lr", "adam_weight_decay_text_encoder"), "without --train_text_encoder")


@dataclass
class CaptionAugmentationOptions:
    """sd-scripts' caption flags: shuffled tags, tags kept in front, tag dropout and whole-caption dropout, drawn
    per (seed, epoch, sample), so a resumed run draws the same. Every caption a run will train with, the empty
    one of a dropped caption included, is encoded once into the text cache before training (keyed by content).
    They set every subset of the folder flags, and are the lowest-precedence values of a dataset TOML (a subset's
    own keys win), as in sd-scripts."""

    shuffle_caption: bool = option(False, "shuffle the comma-separated tags of each caption every epoch",
                                   kw_only=True)
    keep_tokens: int = option(0, "with --shuffle_caption or tag dropout: keep the first N tags in place",
                              bounds="[0, inf)", kw_only=True)
    caption_dropout_rate: float = option(
        0.0, "fraction of samples trained with the empty caption (its embedding cached once)", bounds="[0, 1]",
        aliases=("proportion_empty_prompts",), kw_only=True)
    caption_dropout_every_n_epochs: int = option(0, "train every N-th epoch with empty captions (0: never)",
                                                 bounds="[0, inf)", kw_only=True)
    caption_tag_dropout_rate: float = option(0.0, "drop each tag (after --keep_tokens) with this probability",
                                             bounds="[0, 1]", kw_only=True)

    def caption_flags(self) -> dict[str, Any]:
        """The five values by their dataset TOML key."""
        return {name: getattr(self, name) for name in CAPTION_FLAGS}

    def check_group(self) -> None:
        """--keep_tokens alone has no effect, unless a dataset TOML's subsets shuffle or drop tags."""
        dataset_toml = getattr(self, "dataset_config", None) is not None
        if not dataset_toml and not self.shuffle_caption and self.caption_tag_dropout_rate == 0:
            refuse_unused(self, ("keep_tokens",), "without --shuffle_caption or --caption_tag_dropout_rate")


CAPTION_FLAGS = ("shuffle_caption", "keep_tokens", "caption_dropout_rate", "caption_dropout_every_n_epochs",
                 "caption_tag_dropout_rate")


@dataclass
class ImageDataOptions(CaptionAugmentationOptions):
    """What every FLUX trainer reads its images with: a Kohya dataset TOML, or folders with these flags."""

    dataset_config: Optional[str] = option(None, "a Kohya dataset TOML instead of the folder flags", kw_only=True)
    caption_extension: Optional[str] = option(".txt", "with folders: read each image's caption from a file with "
                                                      "this extension beside it", kw_only=True)
    repeats: int = option(1, "times each image appears per epoch", bounds="[1, inf)", kw_only=True)
    random_flip: bool = option(False, "flip images horizontally at random (an image and its condition together)",
                               kw_only=True)


@dataclass
class PairedDataOptions(ImageDataOptions):
    """Target images each paired with a condition image (diffusers' ControlNet script's flags): two folders of
    same-named files, a ``metadata.jsonl``, or a dataset TOML whose subsets have ``conditioning_data_dir``."""

    train_data_dir: Optional[str] = option(None, "folder of target images (paired with --conditioning_data_dir, "
                                                 "or holding a metadata.jsonl)", kw_only=True)
    conditioning_data_dir: Optional[str] = option(None, "folder of condition images, each named like its target",
                                                  kw_only=True)
    jsonl_for_train: Optional[str] = option(None, "a metadata.jsonl with image, conditioning_image and text "
                                                  "columns (paths relative to it or to --train_data_dir)",
                                            kw_only=True)
    default_caption: Optional[str] = option(None, "with folders: the caption of targets without a caption file",
                                            kw_only=True)
    random_crop: bool = option(False, "crop at random (default: center crop, as diffusers' scripts do)",
                               kw_only=True)

    def check_group(self) -> None:
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


@dataclass
class PromptValidationOptions(EvaluationOptions):
    """Validation samples from one prompt, made every --validation_steps (FluxTrainingConfig's cadence) and
    scored by --eval_metrics."""

    validation_prompt: Optional[str] = option(None, "prompt for validation images during training", kw_only=True)

    def check_group(self) -> None:
        if self.eval_metrics and not self.validation_prompt:
            raise UserError("--eval_metrics scores the validation samples: give --validation_prompt too")
        if not self.validation_prompt:
            refuse_unused(self, _SAMPLE_FLAGS, "without --validation_prompt")


@dataclass
class PairedValidationOptions(EvaluationOptions):
    """Validation samples from (condition image, prompt) pairs, scored by --eval_metrics: one of either is shared
    by all of the other."""

    validation_prompt: list[str] = option([], "prompts for validation images (one, or one per --validation_image)",
                                          kw_only=True)
    validation_image: list[str] = option([], "condition images for validation (one, or one per "
                                             "--validation_prompt)", kw_only=True)

    def check_group(self) -> None:
        prompts, images = len(self.validation_prompt), len(self.validation_image)
        if (prompts == 0) != (images == 0):
            raise UserError("validation needs both --validation_prompt and --validation_image")
        if prompts > 1 and images > 1 and prompts != images:
            raise UserError(f"{prompts} --validation_prompt values but {images} --validation_image values; "
                            "give one of either, or the same number of both")
        if self.eval_metrics and not self.validation_prompt:
            raise UserError("--eval_metrics scores the validation samples: give --validation_prompt and "
                            "--validation_image too")
        if not self.validation_prompt:
            refuse_unused(self, _SAMPLE_FLAGS, "without --validation_prompt and --validation_image")


    def validation_pairs(self) -> list[tuple[str, str]]:
        """(condition image path, prompt) pairs; a single prompt or image is shared by all of the other."""
        count = max(len(self.validation_prompt), len(self.validation_image))
        prompts = self.validation_prompt * count if len(self.validation_prompt) == 1 else self.validation_prompt
        images = self.validation_image * count if len(self.validation_image) == 1 else self.validation_image
        return list(zip(images, prompts))


# How validation samples are made (FluxTrainingConfig's): no samples, no effect.
_SAMPLE_FLAGS = ("num_validation_images", "validation_inference_steps")
