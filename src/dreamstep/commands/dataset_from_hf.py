"""``dreamstep dataset from-hf SOURCE OUT``: a Hugging Face dataset as an image folder, ``metadata.json`` and
``dataset.toml``, with :mod:`dreamstep.data.from_hf`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dreamstep.config.schema import add_arguments, build_config, option
from dreamstep.data.from_hf import CAPTION_COLUMNS, METADATA_NAME, TOML_NAME, Conversion, convert_dataset


@dataclass
class FromHfConfig:
    source: str = option(help="parquet/arrow/json/csv file, a save_to_disk or data folder, or a hub name")
    output_dir: str = option(help="folder for the images, metadata.json and dataset.toml")
    image_column: str | None = option(None, "column with the images (default: the first image column)")
    caption_column: str | None = option(None, f"column with the captions (default: the first of "
                                              f"{', '.join(CAPTION_COLUMNS)})")
    split: str | None = option(None, "split to convert (default: train, or the only split)")
    dataset_config_name: str | None = option(None, "the hub dataset's configuration (subset) name")
    limit: int | None = option(None, "convert only the first N rows (a later run without it continues)",
                               bounds="[1, inf)")
    resolution: int = option(1024, "training resolution written into dataset.toml", bounds="[64, inf)")



def summary(result: Conversion) -> list[str]:
    out = result.output_dir
    lines = [f"wrote {result.written} images to {out}" + (f" ({result.kept} already there from an earlier run)"
                                                          if result.kept else "")
             + f"; captions of all {result.images} in {out / METADATA_NAME}; use {out / TOML_NAME} as "
               "--dataset_config"]
    if result.no_caption:
        rows = ", ".join(str(i) for i in result.no_caption[:10])
        lines.append(f"left out {len(result.no_caption)} rows with an empty caption (rows {rows}"
                     f"{', ...' if len(result.no_caption) > 10 else ''})")
    for index, reason in result.unreadable[:10]:
        lines.append(f"left out row {index}: {reason}")
    if len(result.unreadable) > 10:
        lines.append(f"left out {len(result.unreadable) - 10} more rows with unreadable images")
    return lines


def configure_parser(parser: argparse.ArgumentParser, key: tuple[str, ...]) -> None:
    parser.add_argument("source", nargs="?", default=argparse.SUPPRESS,
                        help="parquet/arrow/json/csv file, a save_to_disk or data folder, or a hub dataset name")
    parser.add_argument("output_dir", nargs="?", default=argparse.SUPPRESS, metavar="OUT",
                        help="folder for the images, metadata.json and dataset.toml; run again to continue")
    add_arguments(parser, FromHfConfig)


def run(args: argparse.Namespace, key: tuple[str, ...]) -> None:
    config = build_config(FromHfConfig, args)
    result = convert_dataset(config.source, config.output_dir, image_column=config.image_column,
                             caption_column=config.caption_column, split=config.split,
                             config_name=config.dataset_config_name, limit=config.limit,
                             resolution=config.resolution)
    for line in summary(result):
        print(line)
