"""``dreamstep caption FOLDER_OR_TOML``: caption a folder of pictures (or every folder of a dataset TOML) with
Florence-2, a Qwen-VL instruction model, BLIP or a WD14 tagger; see :mod:`dreamstep.captioning`."""

from __future__ import annotations

import argparse
from pathlib import Path

from dreamstep.config.caption import CaptionConfig
from dreamstep.config.schema import add_arguments, build_config
from dreamstep.errors import UserError

EXAMPLES = """examples:
  dreamstep caption photos/                                  Florence-2 captions in photos/*.txt
  dreamstep caption photos/ --captioner qwen-vl --prefix "sks dog, "
  dreamstep caption anime/ --captioner wd14 --caption_extension .caption
  dreamstep caption dataset.toml --dry_run                   print what would be written, write nothing
Images that have a caption are skipped (a second run resumes); --overwrite or --append to change them."""


def configure_parser(parser: argparse.ArgumentParser, key: tuple[str, ...]) -> None:
    parser.description = ("Write a caption for every image of a folder that has none: a caption file beside "
                          "each image (what the trainers read), or metadata.jsonl.")
    parser.usage = "dreamstep caption FOLDER_OR_TOML [options]"
    parser.epilog = EXAMPLES
    parser.add_argument("folder_or_toml", nargs="?", type=Path, metavar="FOLDER_OR_TOML", default=None,
                        help="an image folder, a folder of <repeats>_<name> folders, or a dataset TOML")
    add_arguments(parser, CaptionConfig)


def run(args: argparse.Namespace, key: tuple[str, ...]) -> None:
    values = vars(args)
    positional = values.pop("folder_or_toml")
    if positional is not None:
        values["source"] = positional
    elif "source" not in values and "config" not in values:
        raise UserError("what should be captioned? give the image folder or dataset TOML: "
                        "dreamstep caption FOLDER_OR_TOML [options]")
    config = build_config(CaptionConfig, values)
    from dreamstep.captioning.run import caption
    from dreamstep.notices import hide_transformers_progress_bars

    hide_transformers_progress_bars()
    caption(config)
