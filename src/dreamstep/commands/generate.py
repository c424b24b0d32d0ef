"""``dreamstep generate flux|sdxl``: the command line of :mod:`dreamstep.generation.generate`."""

from __future__ import annotations

import argparse

from dreamstep.config.schema import add_arguments, build_config
from dreamstep.generation.generate import GenerateConfig, generate_images


def configure_parser(parser: argparse.ArgumentParser, key: tuple[str, ...]) -> None:
    add_arguments(parser, GenerateConfig)


def run(args: argparse.Namespace, key: tuple[str, ...]) -> None:
    config = build_config(GenerateConfig, args)
    written = generate_images(config, key[-1])
    folder = written[0].parent
    names = ", ".join(p.name for p in written[:3]) + (", ..." if len(written) > 3 else "")
    print(f"wrote {len(written)} image{'s' * (len(written) != 1)} to {folder}: {names} "
          f"(generation parameters in each PNG's 'parameters' and 'dreamstep' text chunks)")
