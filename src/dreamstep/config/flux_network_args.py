"""sd-scripts' ``networks.lora_flux`` ``--network_args``, parsed and checked without torch: which FLUX modules get a
LoRA, at which rank, and LoRA+ learning-rate ratios (:mod:`dreamstep.lora.kohya_flux_network` builds the network).

The keys and their meaning are sd-scripts': ``train_blocks`` (all, single, double), ``split_qkv``, ``train_t5xxl``
(a LoRA on T5-XXL too, ``lora_te3_…``), the per-type ranks
``img_attn_dim`` … ``single_mod_dim`` (0 leaves those modules out), ``in_dims`` (ranks of img_in, time_in,
vector_in, guidance_in, txt_in), ``train_double_block_indices`` / ``train_single_block_indices`` ("all", "none",
or "0-3,7"), ``rank_dropout``, ``module_dropout``, ``loraplus_lr_ratio`` and its per-part forms.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dreamstep.config.schema import parse_key_values
from dreamstep.errors import UserError, did_you_mean

# The per-type rank keys, each with the words a module's sd-scripts name must all contain (first match wins).
TYPE_DIM_KEYS = {"img_attn_dim": ("img_attn",), "txt_attn_dim": ("txt_attn",), "img_mlp_dim": ("img_mlp",),
                 "txt_mlp_dim": ("txt_mlp",), "img_mod_dim": ("img_mod",), "txt_mod_dim": ("txt_mod",),
                 "single_dim": ("single_blocks", "linear"), "single_mod_dim": ("modulation",)}
# in_dims' five entries, in sd-scripts' order: the name fragment of the modules each rank is for.
IN_DIM_NAMES = ("_img_in", "_time_in", "_vector_in", "_guidance_in", "_txt_in")
_FLOATS = ("rank_dropout", "module_dropout", "loraplus_lr_ratio", "loraplus_unet_lr_ratio",
           "loraplus_text_encoder_lr_ratio")
_KEYS = ("train_blocks", "split_qkv", "train_t5xxl", *TYPE_DIM_KEYS, "in_dims", "train_double_block_indices",
         "train_single_block_indices", *_FLOATS)
# sd-scripts keys of networks.lora_flux that dreamstep does not implement: named as such, never taken for typos.
UNSUPPORTED = {"ggpo_beta": "LoRA-GGPO", "ggpo_sigma": "LoRA-GGPO", "network_reg_lrs": "per-module learning rates",
               "network_reg_dims": "per-module ranks by regex (use the *_dim keys)", "verbose": "the module listing",
               "conv_dim": "LoRA on convolutions (FLUX has none)", "conv_alpha": "LoRA on convolutions (FLUX has none)"}


@dataclass(frozen=True)
class FluxNetworkOptions:
    """What ``networks.lora_flux`` builds (see the module docstring); ``None`` ranks mean ``dim``."""

    dim: int = 4
    alpha: float = 1.0
    dropout: float | None = None
    rank_dropout: float | None = None
    module_dropout: float | None = None
    train_blocks: str = "all"
    split_qkv: bool = False
    train_t5xxl: bool = False
    type_dims: dict[str, int] | None = None
    in_dims: tuple[int, ...] | None = None
    double_blocks: str | None = None
    single_blocks: str | None = None
    loraplus_unet: float | None = None
    loraplus_text_encoder: float | None = None

    @classmethod
    def from_flags(cls, dim: int, alpha: float, dropout: float | None, network_args: Iterable[str]
                   ) -> tuple[FluxNetworkOptions, dict[str, str]]:
        """--network_dim/alpha/dropout and --network_args as checked options, and the args as given."""
        network_args = list(network_args)
        args = parse_key_values(network_args, "--network_args", "train_blocks=single split_qkv=True")
        keys = [item.partition("=")[0].strip() for item in network_args]
        twice = next((key for key in keys if keys.count(key) > 1), None)
        if twice is not None:
            raise UserError(f"--network_args: '{twice}' is given twice; keep one")
        for key in args:
            if key in UNSUPPORTED:
                raise UserError(f"--network_args: '{key}' ({UNSUPPORTED[key]}) is an sd-scripts option dreamstep "
                                "does not support; remove it")
            if key not in _KEYS:
                raise UserError(f"--network_args: unknown key '{key}'{did_you_mean(key, _KEYS)}; valid keys: "
                                f"{', '.join(_KEYS)}")
        floats = {key: _number(args, key, float) for key in _FLOATS if key in args}
        for key in ("rank_dropout", "module_dropout"):
            if key in floats and not 0 <= floats[key] < 1:
                raise UserError(f"--network_args {key} must be in [0, 1) (got {floats[key]})")
        for key in _FLOATS[2:]:
            if key in floats and floats[key] <= 0:
                raise UserError(f"--network_args {key} must be positive (got {floats[key]})")
        train_blocks = args.get("train_blocks", "all")
        if train_blocks not in ("all", "single", "double"):
            raise UserError(f"--network_args train_blocks={train_blocks}: use all, single or double")
        type_dims = {key: _number(args, key, int) for key in TYPE_DIM_KEYS if key in args}
        negative = next((key for key, d in type_dims.items() if d < 0), None)
        if negative is not None:
            raise UserError(f"--network_args {negative}={type_dims[negative]}: a rank is 0 or more (0 leaves those "
                            "modules out)")
        in_dims = _in_dims(args["in_dims"]) if "in_dims" in args else None
        for key, kind in (("train_double_block_indices", "double"), ("train_single_block_indices", "single")):
            if key in args:
                block_ranges(args[key], key)  # the block counts are checked with the model
                if train_blocks not in ("all", kind):
                    raise UserError(f"--network_args {key} selects {kind} blocks, but train_blocks={train_blocks} "
                                    f"trains none; remove it, or set train_blocks=all or {kind}")
        plus = floats.get("loraplus_lr_ratio")
        options = cls(dim=dim, alpha=alpha, dropout=dropout, rank_dropout=floats.get("rank_dropout"),
                      module_dropout=floats.get("module_dropout"), train_blocks=train_blocks,
                      split_qkv=_flag(args, "split_qkv"), train_t5xxl=_flag(args, "train_t5xxl"),
                      type_dims=type_dims or None, in_dims=in_dims,
                      double_blocks=args.get("train_double_block_indices"),
                      single_blocks=args.get("train_single_block_indices"),
                      loraplus_unet=floats.get("loraplus_unet_lr_ratio", plus),
                      loraplus_text_encoder=floats.get("loraplus_text_encoder_lr_ratio", plus))
        return options, args

    def check_blocks(self, num_double: int, num_single: int) -> None:
        """The block selections against the transformer's block counts (read from its config before it loads)."""
        for text, count, key in ((self.double_blocks, num_double, "train_double_block_indices"),
                                 (self.single_blocks, num_single, "train_single_block_indices")):
            if text is not None:
                block_selection(text, count, key)

    def rank_of(self, name: str) -> int:
        """The rank of the block module sd-scripts names ``name`` (0: no LoRA there), by the per-type ranks."""
        key = self.type_dim_key(name)
        return self.dim if key is None else self.type_dims[key]

    def type_dim_key(self, name: str) -> str | None:
        """The ``--network_args`` key that sets the rank of block module ``name``, or ``None``: --network_dim."""
        for key, words in TYPE_DIM_KEYS.items():
            if self.type_dims and key in self.type_dims and all(w in name for w in words):
                return key
        return None


def block_ranges(text: str, key: str) -> list[tuple[int, int]] | None:
    """sd-scripts' block selection as (first, last) ranges: "0-3,7" -> [(0, 3), (7, 7)]; ``None`` for "all"."""
    text = text.strip()
    if not text:
        raise UserError(f"--network_args {key}=: give all, none, or block indices such as 0-3,7")
    if text in ("all", "none"):
        return None if text == "all" else []
    ranges = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            start, end = int(first), int(last or first)
        except ValueError:
            raise UserError(f"--network_args {key}={text}: '{part}' is not a block index or range such as 0-3") \
                from None
        if not 0 <= start <= end:
            raise UserError(f"--network_args {key}={text}: '{part}' is not a range from low to high")
        ranges.append((start, end))
    return ranges


def block_selection(text: str, count: int, key: str) -> list[bool]:
    """sd-scripts' block selection ("all", "none", "0-3,7") over ``count`` blocks, one flag per block."""
    ranges = block_ranges(text, key)
    if ranges is None:
        return [True] * count
    chosen = [False] * count
    for start, end in ranges:
        if end >= count:
            part = f"{start}-{end}" if end > start else str(start)
            raise UserError(f"--network_args {key}={text.strip()}: '{part}' is outside blocks 0-{count - 1}")
        for index in range(start, end + 1):
            chosen[index] = True
    return chosen


def _flag(args: dict[str, str], key: str) -> bool:
    text = args.get(key, "False")
    if text not in ("True", "true", "False", "false"):
        raise UserError(f"--network_args {key}={text}: give True or False")
    return text in ("True", "true")


def _number(args: dict[str, str], key: str, kind: type) -> Any:
    try:
        return kind(args[key])
    except ValueError:
        raise UserError(f"--network_args {key}={args[key]} is not {'an integer' if kind is int else 'a number'}") \
            from None


def _in_dims(text: str) -> tuple[int, ...]:
    parts = text.strip().removeprefix("[").removesuffix("]").split(",")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if len(dims) != 5 or any(d < 0 for d in dims):
        raise UserError(f"--network_args in_dims={text}: give five ranks [img,time,vector,guidance,txt], "
                        "e.g. in_dims=[4,0,0,0,4]")
    return dims
