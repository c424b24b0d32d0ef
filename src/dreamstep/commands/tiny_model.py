"""``dreamstep tiny-model VARIANT OUT``: write a tiny random pipeline of a family's variant with
:mod:`dreamstep.models.tiny`;
``dreamstep tiny-model evaluators OUT``: tiny random DINO and CLIP models with :mod:`dreamstep.evaluation.tiny`;
``dreamstep tiny-model captioners OUT``: tiny random captioners with :mod:`dreamstep.captioning.tiny`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dreamstep.config.choices import TINY_SDXL_SINGLE_FILE
from dreamstep.models.family import all_variants


def configure_parser(parser: argparse.ArgumentParser, key: tuple[str, ...]) -> None:
    parser.description = ("Write a tiny random pipeline folder of any family's variant (diffusers layout) for "
                          "offline tests and demos; it loads with the family's pipeline class, e.g. "
                          "FluxPipeline.from_pretrained(OUT). 'evaluators' writes tiny "
                          "DINO and CLIP models for --eval_metrics; 'captioners' tiny captioners for "
                          "'dreamstep caption --model'.")
    parser.add_argument("arch", choices=(*all_variants(), "evaluators", "captioners"),
                        help="which architecture to write; 'evaluators' writes OUT/dino and OUT/clip, tiny "
                             "stand-ins for the --dino_model and --clip_model of --eval_metrics; 'captioners' "
                             "writes OUT/florence2, OUT/blip, OUT/qwen2_5_vl, OUT/llava and OUT/wd14")
    parser.add_argument("out", type=Path, metavar="OUT", help="output folder (must be empty or new)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights (default 0)")
    parser.add_argument("--guidance_embeds", "--guidance-embeds", action="store_true",
                        help="flux only: guidance-distilled variant, like FLUX.1-dev")
    parser.add_argument("--single_file", "--single-file", action="store_true",
                        help=f"sdxl: also write OUT/{TINY_SDXL_SINGLE_FILE} in the original "
                             "(SGM) key layout, like sd_xl_base_1.0.safetensors; flux: also write the "
                             "component files flux1, ae, clip_l and t5xxl .safetensors, like ComfyUI's")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into OUT even if it is not empty (files of the same name "
                             "are replaced)")


def run(args: argparse.Namespace, key: tuple[str, ...]) -> None:
    from dreamstep.models.tiny import check_out_dir, write_tiny_model
    from dreamstep.notices import hide_transformers_progress_bars

    hide_transformers_progress_bars()
    start = time.perf_counter()
    if args.arch == "evaluators":
        from dreamstep.evaluation.tiny import write_tiny_evaluators

        check_out_dir(args.out, args.overwrite)
        folders = write_tiny_evaluators(args.out, seed=args.seed)
        print(f"wrote tiny evaluation models (seed {args.seed}): DINO {folders['dino']}, CLIP {folders['clip']}; "
              f"use them as --dino_model and --clip_model")
        return
    if args.arch == "captioners":
        from dreamstep.captioning.tiny import write_tiny_captioners

        check_out_dir(args.out, args.overwrite)
        folders = write_tiny_captioners(args.out, seed=args.seed)
        print(f"wrote tiny captioners (seed {args.seed}): " + ", ".join(f"{k} {v}" for k, v in folders.items())
              + "; use one as 'dreamstep caption FOLDER --captioner NAME --model PATH'")
        return
    out = write_tiny_model(args.arch, args.out, seed=args.seed, guidance_embeds=args.guidance_embeds,
                           single_file=args.single_file, overwrite=args.overwrite)
    seconds = time.perf_counter() - start
    print(f"wrote a tiny {args.arch} pipeline (seed {args.seed}) to {out} in {seconds:.1f} s:")
    for path in sorted(out.rglob("*")):
        if path.is_file():
            print(f"  {path.relative_to(out)}  ({path.stat().st_size / 1024:.0f} KiB)")
