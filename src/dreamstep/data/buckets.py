"""Aspect-ratio buckets, with the same results as sd-scripts (``make_bucket_resolutions`` and
``BucketManager.select_bucket``), and the crop that turns an image into its bucket.

Sizes are ``(width, height)`` as in sd-scripts. An image is resized so that it covers its bucket, then the
overhang is cropped (centred, or at a random offset). :class:`Placement` records the true crop offset in
the resized image, which is what SDXL's ``crops_coords_top_left`` means (sd-scripts reports an offset that
ignores the actual crop; we report the real one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dreamstep.errors import UserError

Size = tuple[int, int]


def make_bucket_resolutions(max_reso: Size, min_size: int = 256, max_size: int = 1024,
                            divisible: int = 64) -> list[Size]:
    """All (w, h) with both sides in [min_size, max_size], multiples of ``divisible``, whose area is at most
    that of ``max_reso`` (taking the tallest height for each width), plus the square; sorted."""
    max_area = max_reso[0] * max_reso[1]
    side = int(math.sqrt(max_area) // divisible) * divisible
    resos = {(side, side)}
    width = min_size
    while width <= max_size:
        height = min(max_size, int((max_area // width) // divisible) * divisible)
        if height >= min_size:
            resos.add((width, height))
            resos.add((height, width))
        width += divisible
    return sorted(resos)


@dataclass(frozen=True)
class BucketSpec:
    """How one dataset buckets its images. ``enable_bucket=False`` means one bucket: ``resolution``."""

    resolution: Size
    enable_bucket: bool = False
    min_bucket_reso: int = 256
    max_bucket_reso: int = 1024
    bucket_reso_steps: int = 64
    bucket_no_upscale: bool = False


class BucketPlanner:
    """Chooses each image's bucket and the size it is resized to before cropping."""

    def __init__(self, spec: BucketSpec):
        self.spec = spec
        self.max_area = spec.resolution[0] * spec.resolution[1]
        if not spec.enable_bucket:
            self.predefined = [spec.resolution]
        elif spec.bucket_no_upscale:
            self.predefined = []
        else:
            self.predefined = make_bucket_resolutions(spec.resolution, spec.min_bucket_reso,
                                                      spec.max_bucket_reso, spec.bucket_reso_steps)
        self._ratios = np.array([w / h for w, h in self.predefined])

    def select(self, width: int, height: int) -> tuple[Size, Size]:
        """Return ``(bucket, resized_size)`` for an image of ``width`` x ``height``."""
        if self.spec.enable_bucket and self.spec.bucket_no_upscale:
            return self._select_no_upscale(width, height)
        aspect = width / height
        reso = (width, height)
        if reso not in self.predefined:
            reso = self.predefined[int(np.abs(self._ratios - aspect).argmin())]
        # Scale so the image covers the bucket: match the side that is relatively shorter.
        scale = reso[1] / height if aspect > reso[0] / reso[1] else reso[0] / width
        return reso, (int(width * scale + 0.5), int(height * scale + 0.5))

    def _select_no_upscale(self, width: int, height: int) -> tuple[Size, Size]:
        """Per-image bucket: shrink only when the area exceeds the resolution's, then floor to the step."""
        steps = self.spec.bucket_reso_steps
        aspect = width / height
        if width * height > self.max_area:
            resized_w = math.sqrt(self.max_area * aspect)
            resized_h = self.max_area / resized_w
            w_rounded = self._round_to_steps(resized_w)
            h_in_wr = self._round_to_steps(w_rounded / aspect)
            h_rounded = self._round_to_steps(resized_h)
            w_in_hr = self._round_to_steps(h_rounded * aspect)
            error_w = abs(w_rounded / max(h_in_wr, 1) - aspect)
            error_h = abs(w_in_hr / max(h_rounded, 1) - aspect)
            if error_w < error_h:
                resized = (w_rounded, int(w_rounded / aspect + 0.5))
            else:
                resized = (int(h_rounded * aspect + 0.5), h_rounded)
        else:
            resized = (width, height)
        bucket = (resized[0] - resized[0] % steps, resized[1] - resized[1] % steps)
        return bucket, resized

    def _round_to_steps(self, x: float) -> int:
        value = int(x + 0.5)
        return value - value % self.spec.bucket_reso_steps


def adjust_bucket_limits(spec: BucketSpec, where: str) -> BucketSpec:
    """With buckets on, round min/max bucket sizes to the step (as sd-scripts does) and check they bracket
    the resolution; with buckets off they are unused."""
    if not spec.enable_bucket:
        return spec
    steps = spec.bucket_reso_steps
    if steps <= 0:
        raise UserError(f"{where}: bucket_reso_steps must be positive, got {steps}")
    low = spec.min_bucket_reso - spec.min_bucket_reso % steps
    high = spec.max_bucket_reso + (-spec.max_bucket_reso) % steps
    if min(spec.resolution) < low:
        raise UserError(f"{where}: min_bucket_reso ({low}) is larger than the resolution {spec.resolution}; "
                        "lower min_bucket_reso or raise resolution")
    if max(spec.resolution) > high:
        raise UserError(f"{where}: max_bucket_reso ({high}) is smaller than the resolution {spec.resolution}; "
                        "raise max_bucket_reso or lower resolution")
    return BucketSpec(spec.resolution, spec.enable_bucket, low, high, steps, spec.bucket_no_upscale)


@dataclass(frozen=True)
class Placement:
    """How one image becomes a training sample: resize to ``resized``, crop ``bucket`` at (left, top),
    then mirror if ``flip``. ``crop_left`` is given in the unflipped resized image."""

    bucket: Size
    resized: Size
    crop_left: int
    crop_top: int
    flip: bool
    random_crop: bool = False

    def crop_top_left(self) -> tuple[int, int]:
        """SDXL's ``crops_coords_top_left`` (top, left): the crop's offset in the resized image as the model
        sees it, so a flipped sample measures ``left`` from the mirrored side."""
        left = self.resized[0] - self.bucket[0] - self.crop_left if self.flip else self.crop_left
        return self.crop_top, left

    def is_fixed(self) -> bool:
        """Whether every epoch gives this sample the same pixels: no random crop, or a crop with no room to
        move (the resized image is exactly the bucket). A random flip is fixed too: it is part of the key."""
        return not self.random_crop or self.resized == self.bucket

    def describe(self) -> str:
        """A stable text form, used in cache keys."""
        return (f"bucket={self.bucket[0]}x{self.bucket[1]};resized={self.resized[0]}x{self.resized[1]};"
                f"crop={self.crop_left},{self.crop_top};flip={int(self.flip)}")


def place(bucket: Size, resized: Size, random_crop: bool, flip: bool, rng: np.random.Generator) -> Placement:
    """Choose the crop window: centred (floor of half the overhang, as sd-scripts), or uniform at random."""
    over_w, over_h = resized[0] - bucket[0], resized[1] - bucket[1]
    if over_w < 0 or over_h < 0:
        raise ValueError(f"resized size {resized} does not cover bucket {bucket}")
    if random_crop:
        left, top = int(rng.integers(0, over_w + 1)), int(rng.integers(0, over_h + 1))
    else:
        left, top = over_w // 2, over_h // 2
    return Placement(bucket, resized, left, top, flip, random_crop)
