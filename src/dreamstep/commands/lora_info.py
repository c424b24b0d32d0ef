"""``dreamstep lora info FILE``: a LoRA file's layout, target model and whether it fits, ranks and alphas
per module group, dtypes and metadata (the report is :mod:`dreamstep.lora.info`).
"""

from __future__ import annotations

import argparse

from dreamstep.config.choices import CHECKPOINT_WEIGHTS, CHECKPOINT_WEIGHTS_HELP
from dreamstep.models.family import families


def configure_parser(parser: argparse.ArgumentParser, key: tuple[str, ...]) -> None:
    parser.add_argument("file", help="LoRA file (.safetensors, torch .ckpt/.pt, MindSpore .ckpt), a checkpoint-N "
                                     "folder of a LoRA run, or a run folder (its final LoRA)")
    parser.add_argument("--model", choices=tuple(families()), help="the model family, when the keys do not tell")
    parser.add_argument("--base", metavar="DIR",
                        help="diffusers pipeline folder to check the modules and shapes against (default: "
                             "the released FLUX.1-dev / SDXL base 1.0, built without weights)")
    parser.add_argument("--checkpoint_weights", choices=CHECKPOINT_WEIGHTS, default="auto",
                        help=CHECKPOINT_WEIGHTS_HELP)


def run(args: argparse.Namespace, key: tuple[str, ...]) -> None:
    import tempfile
    from pathlib import Path

    from dreamstep.evaluation.candidates import lora_file_for
    from dreamstep.lora.info import describe

    given = Path(args.file).expanduser()
    with tempfile.TemporaryDirectory(prefix="dreamstep-lora-") as work_dir:
        file = lora_file_for(given, Path(work_dir), "lora info", args.checkpoint_weights)
        if file != given:
            print(f"from:      {given}")
        print(describe(str(file), args.model, args.base))
