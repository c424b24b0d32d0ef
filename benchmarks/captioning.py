"""Captioning throughput of ``dreamstep caption``: the same pictures captioned one at a time (the reference: a
loop over images, as a captioning script without batching does) and in batches, in one process with one loaded
model each, printing images per second and the ratio. Without --model it builds the tiny random captioner of
--captioner (`dreamstep tiny-model captioners`), which shows the command's own overhead; give a real model on a
GPU to see what batching buys there.

    python benchmarks/captioning.py                                   # tiny Florence-2, 32 pictures, CPU
    python benchmarks/captioning.py --captioner florence2 --model florence-community/Florence-2-large \\
        --images 256 --batch_size 16                                  # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from dreamstep.cli import main

_SPEED = re.compile(r"wrote (\d+) captions .* \(([\d.]+) images/s\)")


def pictures(folder: Path, count: int, size: tuple[int, int]) -> None:
    """``count`` JPEGs of smooth random colour fields (decoding costs what a photo's does)."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        Image.fromarray(small).resize(size, Image.Resampling.BICUBIC).save(folder / f"{i:04d}.jpg", quality=90)


def caption(folder: Path, args: argparse.Namespace, model: str, batch_size: int) -> float:
    """Caption every picture of ``folder``; return the images per second the command reports."""
    printed = io.StringIO()
    argv = ["caption", str(folder), "--captioner", args.captioner, "--model", model, "--overwrite",
            "--batch_size", str(batch_size), "--max_new_tokens", str(args.max_new_tokens)]
    with contextlib.redirect_stdout(printed):
        code = main(argv)
    found = _SPEED.search(printed.getvalue())
    if code != 0 or found is None:
        raise SystemExit(f"dreamstep {' '.join(argv)} failed (exit {code}):\n{printed.getvalue()}")
    return float(found[2])


def main_benchmark() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--captioner", default="florence2", choices=["florence2", "blip", "qwen-vl", "wd14"])
    parser.add_argument("--model", help="hub id or folder (default: the tiny random captioner)")
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--size", type=int, nargs=2, default=(768, 512), metavar=("W", "H"))
    parser.add_argument("--max_new_tokens", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.model
        if model is None:
            from dreamstep.captioning.tiny import write_tiny_captioners

            tiny = {"qwen-vl": "llava"}.get(args.captioner, args.captioner)
            model = str(write_tiny_captioners(root / "models")[tiny])
        pictures(root / "one", args.images, tuple(args.size))
        shutil.copytree(root / "one", root / "batched")
        single = caption(root / "one", args, model, 1)
        batched = caption(root / "batched", args, model, args.batch_size)
    print(f"{args.captioner} {model}, {args.images} pictures of {args.size[0]}x{args.size[1]}, "
          f"at most {args.max_new_tokens} new tokens")
    print(f"  one at a time (reference)  {single:8.2f} images/s")
    print(f"  batches of {args.batch_size:<3}            {batched:8.2f} images/s   {batched / single:.2f}x")


if __name__ == "__main__":
    main_benchmark()
