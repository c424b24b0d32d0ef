"""``dreamstep convert lora IN OUT --to kohya|diffusers|mindspore``: convert a LoRA between sd-scripts'
Kohya layout, the diffusers/PEFT layout and the MindSpore port's layout, for FLUX.1 and SDXL, keeping
every module's merged weight delta (and so its alpha/rank scale) exactly.
"""

from __future__ import annotations

import argparse

from dreamstep.config.choices import CHECKPOINT_WEIGHTS, CHECKPOINT_WEIGHTS_HELP, DTYPE_NAMES, LORA_LAYOUTS
from dreamstep.models.family import families


def configure_parser(parser: argparse.ArgumentParser, key: tuple[str, ...]) -> None:
    parser.add_argument("input", help="LoRA file (.safetensors, torch .ckpt/.pt, MindSpore .ckpt), a checkpoint-N "
                                      "folder of a LoRA run, or a run folder (its final LoRA)")
    parser.add_argument("output", help="file to write; the suffix picks the container: .safetensors or "
                                       ".ckpt/.pt/.pth (torch); with --to mindspore, .ckpt")
    parser.add_argument("--to", required=True, choices=LORA_LAYOUTS,
                        help="target layout: kohya (sd-scripts, ComfyUI, A1111), diffusers (PEFT, "
                             "load_lora_weights), mindspore (the mindone port, SDXL only)")
    parser.add_argument("--model", choices=tuple(families()),
                        help="the model the LoRA is for; needed only when its keys do not tell "
                             "(a LoRA on text encoders only)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, help="cast the LoRA weights (alpha stays exact)")
    parser.add_argument("--base", metavar="DIR",
                        help="diffusers pipeline folder of the base model, to check the LoRA against its "
                             "size (default: the released FLUX.1 / SDXL base 1.0)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    parser.add_argument("--checkpoint_weights", choices=CHECKPOINT_WEIGHTS, default="auto",
                        help=CHECKPOINT_WEIGHTS_HELP)


def run(args: argparse.Namespace, key: tuple[str, ...]) -> None:
    import tempfile
    from pathlib import Path

    from dreamstep.evaluation.candidates import lora_file_for
    from dreamstep.lora.convert import convert_lora
    from dreamstep.lora.formats import folder_configs

    configs = folder_configs(args.base) if args.base else None
    with tempfile.TemporaryDirectory(prefix="dreamstep-lora-") as work_dir:
        source = lora_file_for(Path(args.input).expanduser(), Path(work_dir), "convert lora",
                               args.checkpoint_weights)
        done = convert_lora(source, args.output, args.to, model=args.model, dtype=args.dtype,
                            configs=configs, overwrite=args.overwrite)
    print(f"{args.input}: {done.source.format} ({done.source.container}) -> {args.output}: "
          f"{done.target_format} ({done.container}), {done.modules} modules")
    for note in done.notes:
        print(f"note: {note}")
