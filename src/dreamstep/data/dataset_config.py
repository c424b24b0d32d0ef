"""Kohya's dataset ``.toml``: ``[general]``, ``[[datasets]]``, ``[[datasets.subsets]]``.

A subset's value for a key is taken from the subset, else its dataset, else ``[general]``, else the
command line, else the default. Each dataset's method follows from its subsets, as in sd-scripts:
ControlNet when every subset has ``conditioning_data_dir``, fine-tuning when every subset has
``metadata_file``, DreamBooth when none has; anything else is an error. Keys are checked strictly: an
unknown key, or one that its place or method does not use, is an error naming the key, its dotted place
and the closest valid key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dreamstep.config.schema import convert_value, load_toml, normalize_extension, toml_value
from dreamstep.data.buckets import BucketSpec, adjust_bucket_limits
from dreamstep.data.captions import CaptionOptions
from dreamstep.errors import UserError, did_you_mean

Method = Literal["dreambooth", "finetune", "controlnet"]
METHOD_NAMES = {"dreambooth": "DreamBooth", "finetune": "fine-tuning", "controlnet": "ControlNet"}
ALL_METHODS = frozenset(METHOD_NAMES)


@dataclass(frozen=True)
class _Key:
    type: Any
    default: Any
    level: Literal["subset_only", "subset", "dataset"]  # subset_only keys cannot be inherited
    methods: frozenset[str] = ALL_METHODS


_DB = frozenset({"dreambooth"})
_DB_CN = frozenset({"dreambooth", "controlnet"})
KEYS: dict[str, _Key] = {
    "image_dir": _Key(str, None, "subset_only"),
    "is_reg": _Key(bool, False, "subset_only", _DB),
    "is_validation": _Key(bool, False, "subset_only"),
    "metadata_file": _Key(str, None, "subset_only", frozenset({"finetune"})),
    "conditioning_data_dir": _Key(str, None, "subset_only", frozenset({"controlnet"})),
    "num_repeats": _Key(int, 1, "subset"),
    "class_tokens": _Key(str, None, "subset", _DB_CN),
    "caption_extension": _Key(str, ".caption", "subset", _DB_CN),
    "flip_aug": _Key(bool, False, "subset"),
    "random_crop": _Key(bool, False, "subset"),
    "shuffle_caption": _Key(bool, False, "subset"),
    "keep_tokens": _Key(int, 0, "subset"),
    "keep_tokens_separator": _Key(str, "", "subset"),
    "caption_separator": _Key(str, ",", "subset"),
    "secondary_separator": _Key(str, "", "subset"),
    "caption_prefix": _Key(str, "", "subset"),
    "caption_suffix": _Key(str, "", "subset"),
    "caption_dropout_rate": _Key(float, 0.0, "subset"),
    "caption_dropout_every_n_epochs": _Key(int, 0, "subset"),
    "caption_tag_dropout_rate": _Key(float, 0.0, "subset"),
    "alpha_mask": _Key(bool, False, "subset"),
    "resolution": _Key("resolution", None, "dataset"),
    "batch_size": _Key(int, 1, "dataset"),
    "enable_bucket": _Key(bool, False, "dataset"),
    "min_bucket_reso": _Key(int, 256, "dataset"),
    "max_bucket_reso": _Key(int, 1024, "dataset"),
    "bucket_reso_steps": _Key(int, 64, "dataset"),
    "bucket_no_upscale": _Key(bool, False, "dataset"),
}
# sd-scripts keys that dreamstep reads but does not implement: named as such rather than as typos.
UNSUPPORTED_KEYS = frozenset({
    "color_aug", "face_crop_aug_range", "enable_wildcard", "token_warmup_min", "token_warmup_step",
    "cache_info", "custom_attributes", "network_multiplier", "debug_dataset",
    "validation_seed", "validation_split", "resize_interpolation",
})
CLI_ALIASES = {"train_batch_size": "batch_size"}


@dataclass(frozen=True)
class SubsetConfig:
    """One folder (or metadata file) of images with the settings that apply to it.

    ``where`` names the subset in errors: a dotted TOML place such as ``datasets[0].subsets[1]``, or the
    flag it came from. ``caption_extension=None`` reads no caption files (``class_tokens`` is the caption).
    ``caption_fallback`` names how the user sets ``class_tokens`` for this subset (a TOML key, or the flag
    that became it), for the message about a missing caption file.
    """

    where: str
    image_dir: Path | None = None
    num_repeats: int = 1
    is_reg: bool = False
    is_validation: bool = False  # held out: scored by the validation loss, never trained on
    class_tokens: str | None = None
    caption_extension: str | None = ".caption"
    metadata_file: Path | None = None
    conditioning_data_dir: Path | None = None
    flip_aug: bool = False
    random_crop: bool = False
    captions: CaptionOptions = field(default_factory=CaptionOptions)
    caption_fallback: str = "class_tokens"
    alpha_mask: bool = False  # the image's alpha channel is its loss mask (with --masked_loss)
    # Where --masked_loss reads each image's mask: "alpha", "conditioning" (conditioning_data_dir), or None.
    mask_source: str | None = None


@dataclass(frozen=True)
class DatasetConfig:
    """A group of subsets that share a resolution, bucketing and batch size."""

    where: str
    method: Method
    buckets: BucketSpec
    batch_size: int
    subsets: tuple[SubsetConfig, ...]
    # diffusers' prior preservation instead of sd-scripts' balancing: every batch holds batch_size instance
    # samples and as many class samples, and an epoch cycles the shorter list to the length of the longer.
    prior_pairs: bool = False


def describe_datasets(datasets: list[DatasetConfig]) -> str:
    """The data as a run reads it, as TOML comment lines for its ``config.toml``: the flags there are only the
    defaults of a dataset TOML, whose own values (batch size, resolution, caption extension, repeats) win, so
    the resolved file says which values each dataset and subset trained with."""
    lines = ["", "# The data as this run reads it (a dataset TOML's own values win over the flags above):"]
    for dataset in datasets:
        buckets = dataset.buckets
        size = "x".join(str(side) for side in buckets.resolution)
        bucketing = (f", buckets {buckets.min_bucket_reso}-{buckets.max_bucket_reso} px in steps of "
                     f"{buckets.bucket_reso_steps}" if buckets.enable_bucket else "")
        lines.append(f"# {dataset.where}: batch_size = {dataset.batch_size}, resolution = {size}{bucketing}")
        for subset in dataset.subsets:
            values = {"image_dir": subset.image_dir, "metadata_file": subset.metadata_file,
                      "conditioning_data_dir": subset.conditioning_data_dir, "num_repeats": subset.num_repeats,
                      "caption_extension": subset.caption_extension, "class_tokens": subset.class_tokens,
                      "is_reg": subset.is_reg or None, "is_validation": subset.is_validation or None}
            shown = ", ".join(f"{key} = {toml_value(str(value) if isinstance(value, Path) else value)}"
                              for key, value in values.items() if value is not None)
            lines.append(f"#   {subset.where}: {shown}")
    return "\n".join(lines) + "\n"


def load_dataset_config(path: str | Path, cli: Mapping[str, Any] | None = None) -> list[DatasetConfig]:
    """Read a Kohya dataset TOML; ``cli`` holds the trainer's flags, the lowest-precedence values."""
    return parse_dataset_config(load_toml(path, "--dataset_config"), str(path), cli)


def parse_dataset_config(data: Mapping[str, Any], source: str = "dataset config",
                         cli: Mapping[str, Any] | None = None) -> list[DatasetConfig]:
    """Check and resolve an already-parsed dataset TOML; ``source`` prefixes every error."""
    _check_keys(data, {"general", "datasets"}, source, "top level", None)
    general = _table(data.get("general", {}), source, "[general]")
    _check_keys(general, _inheritable_keys(ALL_METHODS, "dataset"), source, "[general]", None)
    datasets = data.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise UserError(f"{source}: no [[datasets]] table; add one with at least one [[datasets.subsets]]")
    cli_values = _cli_values(cli or {})
    return [_parse_dataset(_table(ds, source, f"datasets[{i}]"), i, general, cli_values, source)
            for i, ds in enumerate(datasets)]


def _table(value: Any, source: str, place: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UserError(f"{source}: {place}: expected a table, got {type(value).__name__}")
    return value


def _inheritable_keys(methods: frozenset[str], up_to: str) -> set[str]:
    levels = {"dataset": ("subset", "dataset"), "subset": ("subset",)}[up_to]
    return {k for k, spec in KEYS.items() if spec.level in levels and spec.methods & methods}


def _check_keys(table: Mapping[str, Any], allowed: set[str], source: str, place: str,
                method: str | None) -> None:
    for key in table:
        if key in allowed:
            continue
        if key in UNSUPPORTED_KEYS:
            raise UserError(f"{source}: {place}: '{key}' is an sd-scripts option dreamstep does not support; "
                            "remove it")
        spec = KEYS.get(key)
        if spec is not None and method is not None and method not in spec.methods:
            raise UserError(f"{source}: {place}: key '{key}' is not used by {METHOD_NAMES[method]} datasets; "
                            "remove it or move the subset to a dataset of the right kind")
        if spec is not None and spec.level == "subset_only":
            raise UserError(f"{source}: {place}: key '{key}' belongs in a [[datasets.subsets]] table")
        if spec is not None:
            raise UserError(f"{source}: {place}: key '{key}' belongs in [[datasets]] or [general], "
                            "not in a subset")
        raise UserError(f"{source}: {place}: unknown key '{key}'{did_you_mean(key, allowed)}")


def _cli_values(cli: Mapping[str, Any]) -> dict[str, Any]:
    values = {}
    for key, value in cli.items():
        key = CLI_ALIASES.get(key, key)
        if key in KEYS and KEYS[key].level != "subset_only" and value is not None:
            values[key] = value
    return values


def detect_method(subsets: list[dict[str, Any]], source: str, place: str) -> Method:
    """The dataset's method from its subsets' keys (sd-scripts' rule); a mix is an error."""
    with_cond = [i for i, s in enumerate(subsets) if "conditioning_data_dir" in s]
    with_meta = [i for i, s in enumerate(subsets) if "metadata_file" in s]
    if with_cond and len(with_cond) == len(subsets) and not with_meta:
        return "controlnet"
    if with_cond:
        other = next(i for i in range(len(subsets)) if i not in with_cond or i in with_meta)
        raise UserError(f"{source}: {place}: subsets[{with_cond[0]}] has conditioning_data_dir (ControlNet) but "
                        f"subsets[{other}] is not a ControlNet subset; every subset of a ControlNet dataset needs "
                        "conditioning_data_dir and no metadata_file")
    if len(with_meta) == len(subsets):
        return "finetune"
    if not with_meta:
        return "dreambooth"
    other = next(i for i in range(len(subsets)) if i not in with_meta)
    raise UserError(f"{source}: {place}: subsets[{with_meta[0]}] has metadata_file (fine-tuning) but "
                    f"subsets[{other}] has none (DreamBooth); they cannot be mixed in one dataset, "
                    "put them in separate [[datasets]]")


def _parse_dataset(table: dict[str, Any], index: int, general: dict[str, Any], cli: dict[str, Any],
                   source: str) -> DatasetConfig:
    place = f"datasets[{index}]"
    subsets = table.get("subsets")
    if not isinstance(subsets, list) or not subsets:
        raise UserError(f"{source}: {place}: no [[datasets.subsets]]; add one with image_dir")
    subsets = [_table(s, source, f"{place}.subsets[{j}]") for j, s in enumerate(subsets)]
    method = detect_method(subsets, source, place)
    methods = frozenset({method})
    _check_keys(table, _inheritable_keys(methods, "dataset") | {"subsets"}, source, place, method)
    layers = [(table, place), (general, "[general]"), (cli, "command line")]
    resolve = _Resolver(source, layers)
    buckets = adjust_bucket_limits(BucketSpec(
        resolution=resolve.resolution(place),
        enable_bucket=resolve("enable_bucket"), min_bucket_reso=resolve("min_bucket_reso"),
        max_bucket_reso=resolve("max_bucket_reso"), bucket_reso_steps=resolve("bucket_reso_steps"),
        bucket_no_upscale=resolve("bucket_no_upscale")), f"{source}: {place}")
    batch_size = resolve("batch_size")
    if batch_size < 1:
        raise UserError(f"{source}: {place}: batch_size must be at least 1, got {batch_size}")
    parsed = []
    for j, sub in enumerate(subsets):
        sub_place = f"{place}.subsets[{j}]"
        allowed = _inheritable_keys(methods, "subset") | {
            k for k, s in KEYS.items() if s.level == "subset_only" and method in s.methods}
        _check_keys(sub, allowed, source, sub_place, method)
        parsed.append(_parse_subset(_Resolver(source, [(sub, sub_place), *layers]), sub_place, method))
    return DatasetConfig(f"{source}: {place}", method, buckets, batch_size, tuple(parsed))


class _Resolver:
    """Looks a key up through the layers (subset, dataset, general, command line), converting its type."""

    def __init__(self, source: str, layers: list[tuple[Mapping[str, Any], str]]):
        self.source = source
        self.layers = layers

    def __call__(self, key: str) -> Any:
        spec = KEYS[key]
        for table, place in self.layers:
            if key in table:
                return convert_value(table[key], spec.type, f"{self.source}: {place}: key '{key}'", typed=True)
        return spec.default

    def resolution(self, place: str) -> tuple[int, int]:
        for table, layer in self.layers:
            if "resolution" in table:
                return parse_resolution(table["resolution"], f"{self.source}: {layer}: key 'resolution'")
        raise UserError(f"{self.source}: {place}: 'resolution' is required (e.g. resolution = 1024); set it in "
                        "[[datasets]], [general] or with --resolution")


def parse_resolution(value: Any, where: str) -> tuple[int, int]:
    """``1024``, ``"1024"``, ``"1024,768"`` or ``[1024, 768]`` -> (width, height)."""
    parts = value.split(",") if isinstance(value, str) else value
    parts = parts if isinstance(parts, (list, tuple)) else [parts]
    if len(parts) not in (1, 2):
        raise UserError(f"{where}: expected one size or [width, height], got {value!r}")
    sizes = [convert_value(p.strip() if isinstance(p, str) else p, int, where) for p in parts]
    if min(sizes) <= 0:
        raise UserError(f"{where}: sizes must be positive, got {value!r}")
    return (sizes[0], sizes[-1])


def _fraction(value: float, where: str) -> float:
    if not 0.0 <= value <= 1.0:
        raise UserError(f"{where}: must be between 0 and 1, got {value}")
    return value


def _parse_subset(resolve: _Resolver, place: str, method: Method) -> SubsetConfig:
    where = f"{resolve.source}: {place}"
    image_dir = resolve("image_dir")
    if image_dir is None and method != "finetune":
        raise UserError(f"{where}: 'image_dir' is required; set it to the folder with this subset's images")
    num_repeats = resolve("num_repeats")
    if num_repeats < 1:
        raise UserError(f"{where}: num_repeats must be at least 1, got {num_repeats}")
    keep_tokens = resolve("keep_tokens")
    if keep_tokens < 0:
        raise UserError(f"{where}: keep_tokens must be 0 or more, got {keep_tokens}")
    captions = CaptionOptions(
        shuffle_caption=resolve("shuffle_caption"), keep_tokens=keep_tokens,
        keep_tokens_separator=resolve("keep_tokens_separator"), caption_separator=resolve("caption_separator"),
        secondary_separator=resolve("secondary_separator"), caption_prefix=resolve("caption_prefix"),
        caption_suffix=resolve("caption_suffix"),
        caption_dropout_rate=_fraction(resolve("caption_dropout_rate"), f"{where}: caption_dropout_rate"),
        caption_dropout_every_n_epochs=resolve("caption_dropout_every_n_epochs"),
        caption_tag_dropout_rate=_fraction(resolve("caption_tag_dropout_rate"), f"{where}: caption_tag_dropout_rate"))
    if not captions.caption_separator:
        raise UserError(f"{where}: caption_separator must not be empty")
    metadata, conditioning = resolve("metadata_file"), resolve("conditioning_data_dir")
    return SubsetConfig(
        where=where, image_dir=Path(image_dir) if image_dir is not None else None, num_repeats=num_repeats,
        is_reg=resolve("is_reg"), is_validation=resolve("is_validation"), class_tokens=resolve("class_tokens"),
        caption_extension=normalize_extension(resolve("caption_extension")),
        metadata_file=Path(metadata) if metadata is not None else None,
        conditioning_data_dir=Path(conditioning) if conditioning is not None else None,
        flip_aug=resolve("flip_aug"), random_crop=resolve("random_crop"), captions=captions,
        alpha_mask=resolve("alpha_mask"))


def require_methods(configs: list[DatasetConfig], allowed: tuple[Method, ...], trainer: str) -> None:
    """Refuse datasets of a kind the trainer cannot use, e.g. a DreamBooth dataset for ControlNet."""
    for config in configs:
        if config.method not in allowed:
            wanted = " or ".join(METHOD_NAMES[m] for m in allowed)
            hint = "; give every subset conditioning_data_dir" if allowed == ("controlnet",) else ""
            raise UserError(f"{config.where}: this is a {METHOD_NAMES[config.method]} dataset but {trainer} "
                            f"needs {wanted} datasets{hint}")
