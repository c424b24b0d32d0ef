"""Per-epoch caption processing, in sd-scripts' order: prefix/suffix, caption dropout, split into kept and
shuffleable tags (``keep_tokens`` or ``keep_tokens_separator``), shuffle, tag dropout, join, secondary
separator. All randomness comes from the generator passed in, so a caption is reproducible from
(seed, epoch, sample).

One deliberate difference: sd-scripts leaves ``keep_tokens_separator`` (e.g. ``|||``) in the caption when
neither shuffling nor tag dropout is on; here the marker is always removed, so it never reaches the text
encoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CaptionOptions:
    """The caption keys of a Kohya subset."""

    shuffle_caption: bool = False
    keep_tokens: int = 0
    keep_tokens_separator: str = ""
    caption_separator: str = ","
    secondary_separator: str = ""
    caption_prefix: str = ""
    caption_suffix: str = ""
    caption_dropout_rate: float = 0.0
    caption_dropout_every_n_epochs: int = 0
    caption_tag_dropout_rate: float = 0.0


def add_prefix_suffix(caption: str, options: CaptionOptions) -> str:
    """``prefix + " " + caption + " " + suffix``, each part only when set (sd-scripts joins with a space)."""
    if options.caption_prefix:
        caption = f"{options.caption_prefix} {caption}"
    if options.caption_suffix:
        caption = f"{caption} {options.caption_suffix}"
    return caption


def split_tags(caption: str, options: CaptionOptions) -> tuple[list[str], list[str], list[str]]:
    """Split into (fixed, flexible, fixed_suffix) tags. With ``keep_tokens_separator`` in the caption, the
    text before its first occurrence is fixed and the text after a second one is a fixed suffix;
    otherwise the first ``keep_tokens`` tags are fixed."""
    sep = options.caption_separator

    def tags(text: str) -> list[str]:
        return [t.strip() for t in text.split(sep) if t.strip()]

    marker = options.keep_tokens_separator
    if marker and marker in caption:
        fixed_part, flex_part = caption.split(marker, 1)
        suffix_part = ""
        if marker in flex_part:
            flex_part, suffix_part = flex_part.split(marker, 1)
        return tags(fixed_part), tags(flex_part), tags(suffix_part)
    all_tags = [t.strip() for t in caption.strip().split(sep)]
    keep = max(0, options.keep_tokens)
    return all_tags[:keep], all_tags[keep:], []


def drop_tags(tags: list[str], rate: float, rng: np.random.Generator) -> list[str]:
    """Keep each tag with probability ``1 - rate``."""
    if rate <= 0:
        return tags
    return [t for t in tags if rng.random() >= rate]


def is_dropped(options: CaptionOptions, epoch: int, rng: np.random.Generator) -> bool:
    """Whole-caption dropout: at ``caption_dropout_rate``, and in every n-th epoch (1-based, as sd-scripts)."""
    if options.caption_dropout_rate > 0 and rng.random() < options.caption_dropout_rate:
        return True
    every = options.caption_dropout_every_n_epochs
    return every > 0 and (epoch + 1) % every == 0


def process_caption(caption: str, options: CaptionOptions, epoch: int, rng: np.random.Generator) -> str:
    """The caption a sample is trained with in ``epoch`` (0-based)."""
    caption = add_prefix_suffix(caption, options)
    if is_dropped(options, epoch, rng):
        return ""
    marker = options.keep_tokens_separator
    has_marker = bool(marker) and marker in caption
    if options.shuffle_caption or options.caption_tag_dropout_rate > 0 or has_marker:
        fixed, flex, suffix = split_tags(caption, options)
        if options.shuffle_caption:
            flex = [flex[i] for i in rng.permutation(len(flex))]
        flex = drop_tags(flex, options.caption_tag_dropout_rate, rng)
        caption = ", ".join(fixed + flex + suffix)
    if options.secondary_separator:
        caption = caption.replace(options.secondary_separator, options.caption_separator)
    return caption
