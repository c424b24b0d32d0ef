"""LyCORIS' options (``algo=lokr factor=16 ...``) as dreamstep checks them before any model loads: sd-scripts'
``--network_module lycoris.kohya --network_args`` words, with LyCORIS' names and defaults, and flux-lora's
``--lora_type`` flags, both into one :class:`LycorisOptions` (the network is built by
:mod:`dreamstep.lora.lycoris_network`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from dreamstep.config.schema import parse_key_values
from dreamstep.errors import UserError, did_you_mean

LYCORIS_MODULE = "lycoris.kohya"
ALGORITHMS = ("lora", "locon", "loha", "lokr")  # LyCORIS' algo names that dreamstep trains
PRESETS = ("full", "full-lin", "attn-mlp", "attn-only", "unet-only", "unet-transformer-only", "unet-convblock-only")


@dataclass(frozen=True)
class LycorisOptions:
    """One algorithm and its settings, in LyCORIS' names and with its defaults."""

    algo: str = "lora"
    preset: str = "full"  # SDXL: which layers (LyCORIS' preset names, as sd-scripts applies them)
    dim: int = 4
    alpha: float = 1.0
    conv_dim: int | None = None  # 3x3 convolutions (LoCon); None: LyCORIS' default, dim
    conv_alpha: float | None = None  # None: alpha
    factor: int = -1  # LoKr: the Kronecker factor; -1 the most balanced split of each width
    decompose_both: bool = False  # LoKr: also the small Kronecker factor as a low-rank product
    full_matrix: bool = False  # LoKr: the large factor as a full matrix (no rank)
    use_tucker: bool = False  # Tucker decomposition of convolutions
    use_scalar: bool = False  # a trained scalar in front of the update
    dora_wd: bool = False  # DoRA: magnitude and direction
    # DoRA: one magnitude per input column (False) or per output row (True, LyCORIS' default). dreamstep's default
    # is the column, the form A1111, Forge and every ComfyUI apply exactly (see lycoris_network's docstring).
    wd_on_output: bool = False
    rs_lora: bool = False  # scale alpha / sqrt(dim) instead of alpha / dim
    dropout: float = 0.0  # LoRA/LoCon only
    rank_dropout: float = 0.0
    module_dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.algo not in ALGORITHMS:
            raise UserError(f"algo={self.algo}: dreamstep trains {', '.join(ALGORITHMS)} with LyCORIS; "
                            "choose one of them")
        if self.preset not in PRESETS:
            raise UserError(f"preset={self.preset}: use one of LyCORIS' presets {', '.join(PRESETS)}"
                            f"{did_you_mean(self.preset, PRESETS)} (preset files are not supported)")
        if self.dim < 1 or (self.conv_dim is not None and self.conv_dim < 0):
            raise UserError(f"the adapter rank must be at least 1 (got {self.dim}, conv_dim {self.conv_dim})")
        if self.factor == 0 or self.factor < -1:
            raise UserError(f"factor={self.factor}: the LoKr factor is a positive width divisor, or -1 for the "
                            "most balanced split")
        for name in ("dropout", "rank_dropout", "module_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"{name}={getattr(self, name)} must be in [0, 1)")
        if self.dropout and self.algo in ("loha", "lokr"):
            raise UserError(f"dropout={self.dropout}: LyCORIS' {self.algo} has no plain dropout; use rank_dropout "
                            "or module_dropout")

    @property
    def conv_rank(self) -> int:
        return self.dim if self.conv_dim is None else self.conv_dim

    def module_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of a LyCORIS module class (beyond name, layer, multiplier, rank and alpha)."""
        return {"dropout": self.dropout, "rank_dropout": self.rank_dropout, "module_dropout": self.module_dropout,
                "use_tucker": self.use_tucker, "use_scalar": self.use_scalar, "decompose_both": self.decompose_both,
                "factor": self.factor, "weight_decompose": self.dora_wd, "wd_on_out": self.wd_on_output,
                "full_matrix": self.full_matrix, "rs_lora": self.rs_lora}

    def metadata(self) -> dict[str, str]:
        """The settings as strings, for a file's header and ``lora info``."""
        return {k: str(v) for k, v in asdict(self).items() if v is not None}


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise ValueError(text)


# lycoris.kohya's network_args that dreamstep implements, with their types. LyCORIS' own defaults apply to the
# ones not given: algo=lora, preset=full, conv_dim = --network_dim, conv_alpha = --network_alpha, factor=-1; except
# wd_on_output, False here (LyCORIS: True), and then written into ss_network_args so sd-scripts builds the same.
NETWORK_ARGS: dict[str, Any] = {
    "algo": str, "preset": str, "conv_dim": int, "conv_alpha": float, "dropout": float, "rank_dropout": float,
    "module_dropout": float, "factor": int, "decompose_both": _bool, "use_tucker": _bool, "use_scalar": _bool,
    "dora_wd": _bool, "wd_on_output": _bool, "full_matrix": _bool, "rs_lora": _bool,
}
# LyCORIS' older names, which it still takes (use_tucker's inverse included).
RENAMED_ARGS = {"use_cp": "use_tucker", "use_conv_cp": "use_tucker"}
UNSUPPORTED_ARGS = frozenset({"train_norm", "bypass_mode", "block_size", "constraint", "rescaled",
                              "rank_dropout_scale", "unbalanced_factorization", "train_t5xxl", "loraplus_lr_ratio",
                              "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio", "disable_conv_cp"})


def parse_lycoris_args(items: Iterable[str]) -> dict[str, Any]:
    """``--network_args algo=lokr factor=16 ...`` as typed values, in LyCORIS' names."""
    parsed: dict[str, Any] = {}
    for key, text in parse_key_values(items, "--network_args", "algo=lokr factor=16").items():
        key = RENAMED_ARGS.get(key, key)
        if key in UNSUPPORTED_ARGS:
            raise UserError(f"--network_args: '{key}' is a LyCORIS option dreamstep does not support; remove it")
        if key not in NETWORK_ARGS:
            raise UserError(f"--network_args: unknown key '{key}'{did_you_mean(key, NETWORK_ARGS)}; LyCORIS keys "
                            f"dreamstep takes: {', '.join(NETWORK_ARGS)}")
        try:
            parsed[key] = NETWORK_ARGS[key](text)
        except ValueError:
            kind = "true or false" if NETWORK_ARGS[key] is _bool else "a number"
            raise UserError(f"--network_args: {key}={text} is not {kind}") from None
    return parsed


def lycoris_from_network_args(dim: int, alpha: float, dropout: float | None, network_args: Iterable[str]
                              ) -> tuple[LycorisOptions, dict[str, Any]]:
    """sd-scripts' --network_dim/--network_alpha/--network_args for lycoris.kohya as checked options (LyCORIS'
    defaults where not given), and the parsed args. LyCORIS ignores --network_dropout: refused."""
    if dropout:
        raise UserError("--network_dropout has no effect with --network_module lycoris.kohya (LyCORIS reads "
                        "--network_args dropout=P); move it there")
    args = parse_lycoris_args(network_args)
    if args.get("dora_wd"):
        args.setdefault("wd_on_output", False)
    options = LycorisOptions(dim=dim, alpha=alpha, **{k: v for k, v in args.items()
                                                     if k not in ("conv_dim", "conv_alpha")},
                             conv_dim=args.get("conv_dim", dim), conv_alpha=args.get("conv_alpha", alpha))
    return options, args


def check_quantized_base(dora: bool, quantization: str, quantization_flag: str, dora_flag: str) -> None:
    """LoKr, LoHa and LoRA train on a quantized base through LyCORIS' bypass forward; DoRA cannot (one line)."""
    if dora and quantization != "none":
        raise UserError(f"{quantization_flag} with {dora_flag}: DoRA divides by the norm of each adapted full "
                        "weight, and a quantized weight has no norm or sum in LyCORIS; train LoKr, LoHa or LoRA on "
                        "it, or drop the quantization")
