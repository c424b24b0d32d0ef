"""Datasets described by diffusers-style flags, mapped onto the same :class:`DatasetConfig` that a Kohya
TOML produces, so every trainer has one data pipeline.

- DreamBooth (diffusers' DreamBooth scripts, e.g. FLUX LoRA): ``--instance_data_dir`` + ``--instance_prompt``
  (optionally per-image caption files via ``--caption_extension``, with the instance prompt as the fallback), and
  for prior preservation ``--class_data_dir`` + ``--class_prompt``: a regularization subset whose samples are paired
  with the instance samples in every batch, as diffusers' DreamBooth script does.
- ControlNet pairs: ``--train_data_dir`` + ``--conditioning_data_dir`` (same-named files), or a
  ``--jsonl_for_train`` file with ``image``, ``conditioning_image`` and ``text`` columns (a
  ``metadata.jsonl`` inside ``--train_data_dir`` is found on its own).
- Kohya's folder flags (SDXL LoRA): ``--train_data_dir`` of ``<repeats>_<class tokens>`` image folders,
  ``--reg_data_dir`` of the same for regularization, or ``--train_data_dir`` + ``--in_json`` (fine-tuning).

``center_crop=False`` means random crops, as in the diffusers scripts.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from dreamstep.config.schema import normalize_extension
from dreamstep.data.buckets import BucketSpec, adjust_bucket_limits
from dreamstep.data.captions import CaptionOptions
from dreamstep.data.dataset_config import (
    DatasetConfig,
    SubsetConfig,
    load_dataset_config,
    parse_resolution,
    require_methods,
)
from dreamstep.data.images import list_images
from dreamstep.data.masks import refuse_alpha_masks_without_masked_loss, with_masks
from dreamstep.errors import UserError


def bucket_spec(resolution: int | tuple[int, int], enable_bucket: bool = False, min_bucket_reso: int = 256,
                max_bucket_reso: int = 1024, bucket_reso_steps: int = 64,
                bucket_no_upscale: bool = False) -> BucketSpec:
    """A checked :class:`BucketSpec` from flag values; ``resolution`` is a side or (width, height)."""
    size = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
    if min(size) <= 0:
        raise UserError(f"--resolution must be positive, got {resolution}")
    spec = BucketSpec(size, enable_bucket, min_bucket_reso, max_bucket_reso, bucket_reso_steps, bucket_no_upscale)
    return adjust_bucket_limits(spec, "--resolution")


def _check_folder(folder: str | Path | None, flag: str) -> Path:
    if folder is None:
        raise UserError(f"{flag} is required")
    list_images(Path(folder), flag)
    return Path(folder)


def dreambooth_from_flags(instance_data_dir: str | Path, instance_prompt: str | None, *,
                          caption_extension: str | None = None, class_data_dir: str | Path | None = None,
                          class_prompt: str | None = None, buckets: BucketSpec | None = None,
                          center_crop: bool = False, random_flip: bool = False, repeats: int = 1,
                          class_repeats: int = 1, batch_size: int = 1,
                          captions: CaptionOptions | None = None) -> DatasetConfig:
    """The diffusers DreamBooth flags as one DreamBooth dataset (instance subset + optional class subset)."""
    instance_dir = _check_folder(instance_data_dir, "--instance_data_dir")
    caption_extension = normalize_extension(caption_extension)
    if not instance_prompt and caption_extension is None:
        raise UserError("--instance_prompt is required (or give --caption_extension for per-image captions)")
    if repeats < 1 or batch_size < 1:
        raise UserError("--repeats and --train_batch_size must be at least 1")
    common = dict(flip_aug=random_flip, random_crop=not center_crop)
    subsets = [SubsetConfig(where="--instance_data_dir", image_dir=instance_dir, num_repeats=repeats,
                            class_tokens=instance_prompt or None, caption_extension=caption_extension,
                            captions=captions or CaptionOptions(), caption_fallback="--instance_prompt", **common)]
    if class_data_dir is not None:
        class_dir = _check_folder(class_data_dir, "--class_data_dir")
        if not class_prompt:
            raise UserError("--class_prompt is required with --class_data_dir (prior preservation)")
        subsets.append(SubsetConfig(where="--class_data_dir", image_dir=class_dir, num_repeats=class_repeats,
                                    is_reg=True, class_tokens=class_prompt, caption_extension=None, **common))
    return DatasetConfig("--instance_data_dir", "dreambooth", buckets or bucket_spec(512), batch_size,
                         tuple(subsets), prior_pairs=class_data_dir is not None)


def controlnet_from_flags(*, train_data_dir: str | Path | None = None,
                          conditioning_data_dir: str | Path | None = None,
                          jsonl_for_train: str | Path | None = None, caption_extension: str | None = ".txt",
                          default_caption: str | None = None, buckets: BucketSpec | None = None,
                          center_crop: bool = False, random_flip: bool = False, repeats: int = 1,
                          batch_size: int = 1) -> DatasetConfig:
    """ControlNet pairs from two folders or a JSONL file, as one ControlNet dataset. With folders, captions
    come from caption files beside the images, falling back to ``default_caption``."""
    if jsonl_for_train is None and train_data_dir is not None and conditioning_data_dir is None:
        candidate = Path(train_data_dir) / "metadata.jsonl"
        if candidate.is_file():
            jsonl_for_train = candidate
    common = dict(num_repeats=repeats, flip_aug=random_flip, random_crop=not center_crop)
    if jsonl_for_train is not None:
        if not Path(jsonl_for_train).is_file():
            raise UserError(f"--jsonl_for_train: file '{jsonl_for_train}' not found; check the path")
        subset = SubsetConfig(where="--jsonl_for_train",
                              image_dir=Path(train_data_dir) if train_data_dir is not None else None,
                              metadata_file=Path(jsonl_for_train), caption_extension=None, **common)
    elif train_data_dir is not None:
        subset = SubsetConfig(where="--train_data_dir", image_dir=_check_folder(train_data_dir, "--train_data_dir"),
                              conditioning_data_dir=_check_folder(conditioning_data_dir, "--conditioning_data_dir"),
                              class_tokens=default_caption, caption_extension=normalize_extension(caption_extension),
                              caption_fallback="--default_caption", **common)
    else:
        raise UserError("no training data: give --train_data_dir with --conditioning_data_dir, "
                        "--jsonl_for_train, or --dataset_config")
    if batch_size < 1:
        raise UserError("--train_batch_size must be at least 1")
    return DatasetConfig(subset.where, "controlnet", buckets or bucket_spec(512), batch_size, (subset,))


def with_validation_folder(dataset: DatasetConfig, folder: str | Path, flag: str = "--validation_data_dir"
                           ) -> DatasetConfig:
    """``dataset`` plus a held-out subset of the images in ``folder``, captioned like the first subset."""
    first = dataset.subsets[0]
    subset = dataclasses.replace(first, where=flag, image_dir=_check_folder(folder, flag), num_repeats=1,
                                 is_validation=True)
    return dataclasses.replace(dataset, subsets=(*dataset.subsets, subset))


_KOHYA_FOLDER = re.compile(r"^(\d+)_(.*)$")


def _kohya_folders(root: str | Path, is_reg: bool, caption_extension: str, flag: str) -> list[SubsetConfig]:
    """sd-scripts' DreamBooth folder convention: ``<root>/<repeats>_<class tokens>/`` image folders."""
    folder = Path(root)
    if not folder.is_dir():
        raise UserError(f"{flag} {root}: folder not found")
    subsets = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        match = _KOHYA_FOLDER.match(sub.name)
        if match is None:
            raise UserError(f"{flag}: folder '{sub}' is not named <repeats>_<class tokens> (e.g. 10_sks dog)")
        subsets.append(SubsetConfig(where=f"{flag} {sub}", image_dir=sub, num_repeats=int(match.group(1)),
                                    is_reg=is_reg, class_tokens=match.group(2) or None,
                                    caption_extension=caption_extension,
                                    caption_fallback="the folder name's class tokens (<repeats>_<class tokens>)"))
    if not subsets:
        raise UserError(f"{flag} {root}: no <repeats>_<class tokens> folders inside")
    return subsets


def kohya_folders_from_flags(train_data_dir: str | Path, *, reg_data_dir: str | Path | None = None,
                             in_json: str | Path | None = None, caption_extension: str = ".caption",
                             buckets: BucketSpec, batch_size: int = 1) -> DatasetConfig:
    """sd-scripts' folder flags as one dataset: DreamBooth subsets from ``<repeats>_<class tokens>``
    folders (regularization ones from ``reg_data_dir``), or one fine-tuning subset with ``in_json``."""
    if in_json is not None:
        subset = SubsetConfig(where="--in_json", image_dir=Path(train_data_dir), metadata_file=Path(in_json),
                              caption_extension=None)
        return DatasetConfig("--in_json", "finetune", buckets, batch_size, (subset,))
    subsets = _kohya_folders(train_data_dir, False, caption_extension, "--train_data_dir")
    if reg_data_dir is not None:
        subsets += _kohya_folders(reg_data_dir, True, caption_extension, "--reg_data_dir")
    return DatasetConfig("--train_data_dir", "dreambooth", buckets, batch_size, tuple(subsets))


def kohya_datasets(config: Any, command: str) -> list[DatasetConfig]:
    """What an sd-scripts-flag trainer (``train sdxl-lora``, ``train flux-kohya``) trains on: its Kohya dataset TOML
    (the flags are its lowest-precedence values), or Kohya's folder flags; every key and folder checked, no image
    read yet. ``config`` has sd-scripts' data flags (``dataset_config``, ``train_data_dir``, ``resolution`` …)."""
    cli = {k: getattr(config, k) for k in ("resolution", "train_batch_size", "enable_bucket", "min_bucket_reso",
                                           "max_bucket_reso", "bucket_reso_steps", "bucket_no_upscale")}
    # As in sd-scripts, --caption_extension is the TOML's fallback too (a subset's own value wins).
    cli["caption_extension"] = config.caption_extension
    if config.dataset_config is not None:
        datasets = load_dataset_config(config.dataset_config, cli={**cli, **config.caption_flags()})
        return masked_datasets(datasets, config.masked_loss, command)
    if config.resolution is None:
        raise UserError("--resolution is required with --train_data_dir (e.g. --resolution 1024,1024)")
    buckets = bucket_spec(parse_resolution(config.resolution, "--resolution"), bool(config.enable_bucket),
                          **{k: v for k, v in cli.items()
                             if k.endswith(("reso", "steps", "upscale")) and v is not None})
    dataset = kohya_folders_from_flags(config.train_data_dir, reg_data_dir=config.reg_data_dir, in_json=config.in_json,
                                       caption_extension=config.caption_extension, buckets=buckets,
                                       batch_size=config.train_batch_size)
    return [with_caption_flags(dataset, config.caption_flags())]


def dreambooth_datasets(config: Any, class_dir: str | None, command: str) -> list[DatasetConfig]:
    """What a trainer with the flags of diffusers' DreamBooth scripts (``train flux-lora``: a
    :class:`~dreamstep.config.flux_lora.FluxLoraConfig`) trains on: its dataset TOML, or its instance (and class)
    folders, with its defaults. The dashboard's dataset check reads a folder through this too, so it shows what
    the trainer will do."""
    if config.dataset_config is not None:
        datasets = load_dataset_config(config.dataset_config, cli={
            "resolution": config.resolution, "train_batch_size": config.train_batch_size, **config.caption_flags()})
        return masked_datasets(datasets, config.masked_loss, command)
    dataset = with_caption_flags(dreambooth_from_flags(
        config.instance_data_dir, config.instance_prompt, caption_extension=config.caption_extension,
        class_data_dir=class_dir, class_prompt=config.class_prompt if class_dir else None,
        buckets=bucket_spec(config.resolution), center_crop=config.center_crop,
        random_flip=config.random_flip, repeats=config.repeats, batch_size=config.train_batch_size),
        config.caption_flags())
    if config.validation_data_dir is not None:
        dataset = with_validation_folder(dataset, config.validation_data_dir)
    return [dataset]


def masked_datasets(datasets: list[DatasetConfig], masked_loss: bool, command: str) -> list[DatasetConfig]:
    """A LoRA trainer's TOML datasets: DreamBooth or fine-tuning ones; with ``--masked_loss`` each subset's masks
    set (:func:`~dreamstep.data.masks.with_masks`; a dataset with ``conditioning_data_dir`` holds masks then)."""
    if not masked_loss:
        require_methods(datasets, ("dreambooth", "finetune"), command)
        refuse_alpha_masks_without_masked_loss(datasets)
        return datasets
    require_methods(datasets, ("dreambooth", "finetune", "controlnet"), command)
    return [with_masks(d) for d in datasets]


def paired_datasets(config: Any, methods: tuple[str, ...], command: str) -> list[DatasetConfig]:
    """What a trainer of image pairs trains on, from its config (a
    :class:`~dreamstep.config.options.PairedDataOptions`): its dataset TOML (subsets with
    ``conditioning_data_dir``; ``methods`` are the TOML methods ``command`` takes), or its folder / JSONL
    flags; with the caption flags (:class:`~dreamstep.config.options.CaptionAugmentationOptions`)."""
    if config.dataset_config is not None:
        datasets = load_dataset_config(config.dataset_config, cli={
            "resolution": config.resolution, "train_batch_size": config.train_batch_size, **config.caption_flags()})
        require_methods(datasets, methods, command)
    else:
        datasets = [controlnet_from_flags(
            train_data_dir=config.train_data_dir, conditioning_data_dir=config.conditioning_data_dir,
            jsonl_for_train=config.jsonl_for_train, caption_extension=config.caption_extension,
            default_caption=config.default_caption, buckets=bucket_spec(config.resolution),
            center_crop=not config.random_crop, random_flip=config.random_flip, repeats=config.repeats,
            batch_size=config.train_batch_size)]
        datasets = [with_caption_flags(d, config.caption_flags()) for d in datasets]
    return datasets


def with_caption_flags(dataset: DatasetConfig, flags: dict[str, Any]) -> DatasetConfig:
    """``dataset`` with every subset's caption options set by the caption flags (sd-scripts' names, e.g.
    ``caption_dropout_rate``): the draws are made per (seed, epoch, sample), so a resumed run draws the same."""
    subsets = tuple(dataclasses.replace(s, captions=dataclasses.replace(s.captions, **flags)) for s in dataset.subsets)
    return dataclasses.replace(dataset, subsets=subsets)
