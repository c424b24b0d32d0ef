"""Bucket resolutions and per-image buckets, checked against values worked out by hand from
sd-scripts' algorithm."""

import numpy as np
import pytest

from dreamstep.data.buckets import BucketPlanner, BucketSpec, adjust_bucket_limits, make_bucket_resolutions, place
from dreamstep.errors import UserError

SMALL = BucketSpec((256, 256), enable_bucket=True, min_bucket_reso=128, max_bucket_reso=512, bucket_reso_steps=64)


def test_bucket_resolutions_small_case():
    # area 65536: width 128 -> 65536//128=512 -> 512; 192 -> 341 -> 320; 320 -> 204 -> 192;
    # 384 -> 170 -> 128; 448 -> 146 -> 128; 512 -> 128; plus the 256 square.
    assert make_bucket_resolutions((256, 256), 128, 512, 64) == [
        (128, 384), (128, 448), (128, 512), (192, 320), (256, 256), (320, 192), (384, 128), (448, 128),
        (512, 128)]


def test_bucket_resolutions_sdxl_contains_known_buckets():
    resos = make_bucket_resolutions((1024, 1024), 512, 2048, 64)
    for reso in [(1024, 1024), (576, 1792), (1792, 576), (640, 1600), (768, 1344), (896, 1152), (960, 1088),
                 (512, 2048)]:
        assert reso in resos
    assert all(w * h <= 1024 * 1024 and w % 64 == 0 and h % 64 == 0 for w, h in resos)


@pytest.mark.parametrize("size, bucket, resized", [
    ((300, 200), (320, 192), (320, 213)),  # aspect 1.5 -> 1.667 bucket; width matched: 200*320/300=213.3
    ((100, 333), (128, 448), (135, 448)),  # aspect 0.300 -> 0.286 bucket; height matched: 100*448/333=134.5
    ((250, 260), (256, 256), (256, 266)),  # near square -> square; width matched: 260*1.024=266.2
    ((384, 128), (384, 128), (384, 128)),  # already a bucket size: kept exactly
])
def test_select_bucket(size, bucket, resized):
    assert BucketPlanner(SMALL).select(*size) == (bucket, resized)


def test_no_upscale_buckets():
    planner = BucketPlanner(BucketSpec((256, 256), True, 128, 512, 64, bucket_no_upscale=True))
    assert planner.select(300, 200) == ((256, 192), (300, 200))  # small enough: no resize, floor to 64
    # 600x400 is larger than 256^2: fit area -> 313.5x209; rounding by height wins (ratio 1.333 vs 2.0).
    assert planner.select(600, 400) == ((256, 192), (288, 192))


def test_no_bucket_single_resolution_covers():
    planner = BucketPlanner(BucketSpec((256, 256)))
    assert planner.select(512, 300) == ((256, 256), (437, 256))
    assert planner.select(100, 100) == ((256, 256), (256, 256))


def test_centre_and_random_crop():
    rng = np.random.default_rng(0)
    centred = place((320, 192), (320, 213), random_crop=False, flip=False, rng=rng)
    assert (centred.crop_left, centred.crop_top) == (0, 10)
    assert centred.crop_top_left() == (10, 0)
    for _ in range(20):
        random = place((128, 448), (135, 448), random_crop=True, flip=False, rng=rng)
        assert 0 <= random.crop_left <= 7 and random.crop_top == 0


def test_flipped_crop_measures_from_mirrored_side():
    placement = place((128, 448), (135, 448), random_crop=False, flip=True, rng=np.random.default_rng(0))
    assert placement.crop_left == 3
    assert placement.crop_top_left() == (0, 135 - 128 - 3)


def test_bucket_limits_are_checked():
    with pytest.raises(UserError, match="min_bucket_reso"):
        adjust_bucket_limits(BucketSpec((256, 256), True, 512, 1024, 64), "x")
    with pytest.raises(UserError, match="max_bucket_reso"):
        adjust_bucket_limits(BucketSpec((1024, 1024), True, 256, 512, 64), "x")
    adjusted = adjust_bucket_limits(BucketSpec((512, 512), True, 300, 1000, 64), "x")
    assert (adjusted.min_bucket_reso, adjusted.max_bucket_reso) == (256, 1024)
