"""Loss masks for ``--masked_loss``, with sd-scripts' semantics: each training image has a mask, from its alpha
channel (``alpha_mask = true`` in a subset) or from the same-named image in the subset's ``conditioning_data_dir``
(its red channel). White trains, black does not. The mask gets the image's bucket resize, crop and flip, and is
applied to the per-element loss in latent space (:func:`dreamstep.diffusion.losses.masked`).

Every mask is read before training: a missing one, one of another aspect ratio, or an all-black one is an
error naming the file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from dreamstep.data.dataset_config import DatasetConfig, SubsetConfig
from dreamstep.errors import UserError


def with_masks(dataset: DatasetConfig) -> DatasetConfig:
    """``dataset`` with every subset's mask source set; a subset without masks is an error naming it."""
    return dataclasses.replace(dataset, subsets=tuple(_masked_subset(s) for s in dataset.subsets))


def _masked_subset(subset: SubsetConfig) -> SubsetConfig:
    if subset.alpha_mask:
        return dataclasses.replace(subset, mask_source="alpha")
    if subset.conditioning_data_dir is not None:
        return dataclasses.replace(subset, mask_source="conditioning")
    raise UserError(f"{subset.where}: --masked_loss needs a mask for every image; set alpha_mask = true (the "
                    "images' alpha channel) or conditioning_data_dir (a folder of same-named masks)")


def refuse_alpha_masks_without_masked_loss(datasets: list[DatasetConfig]) -> None:
    for dataset in datasets:
        for subset in dataset.subsets:
            if subset.alpha_mask:
                raise UserError(f"{subset.where}: alpha_mask = true has no effect without --masked_loss; add the "
                                "flag or remove the key")


def read_mask(path: Path, source: str) -> Image.Image:
    """The mask as upright 8-bit greyscale ("L"): the alpha channel of ``path``, or the red channel of the
    conditioning image ``path``."""
    with Image.open(path) as image:
        image.load()
        image = ImageOps.exif_transpose(image)
        if source == "conditioning":
            return image.convert("RGB").getchannel("R")
        if "A" not in image.getbands() and "transparency" not in image.info:
            raise UserError(f"{path}: alpha_mask = true but the image has no alpha channel; save it with "
                            "transparency or give its mask in conditioning_data_dir")
        return image.convert("RGBA").getchannel("A")


def check_mask(path: Path, source: str) -> None:
    """An all-black mask would train nothing on its image: an error naming the file."""
    if not np.asarray(read_mask(path, source)).any():
        what = "alpha channel" if source == "alpha" else "mask"
        raise UserError(f"{path}: the {what} is black everywhere, so the image would train nothing; fix the mask "
                        "or remove the image")


def mask_path(image: Path, conditioning: Path | None, source: str) -> Path:
    """The file a mask is read from: the image itself (alpha) or its conditioning image."""
    return image if source == "alpha" or conditioning is None else conditioning
