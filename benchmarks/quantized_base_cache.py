"""The second start of a run with a quantized base: quantizing the frozen FLUX transformer (what every start did)
against reading back the copy the first start kept (``models/quantized_cache.py``), through the trainer's own
loader (``load_flux_transformer``), in one run.

A FLUX-shaped transformer (random weights, bf16) is saved once as a diffusers folder; then per mode the first load
quantizes and keeps it, the second reads it back. Printed per mode: both times, their ratio, and the kept folder's
size. The first time includes writing the kept copy; the second is diffusers' from_pretrained of it (safetensors
are memory-mapped: the weights are read as they move to the device). The ratio is what a resume or a second run
gains; the full 12B model (19 double + 38 single blocks) scales both times by about its size.

Measured on the development CPU (2 cores shared with three other jobs; torch 2.13, diffusers 0.42.1, torchao 0.18),
default size (1250 MiB kept per mode): int8 30.7 s to quantize and keep, 0.1 s to read back; fp8 15.7 s and 0.1 s.

    python benchmarks/quantized_base_cache.py                     # 3072 wide (FLUX.1's), 2 double + 4 single blocks
    python benchmarks/quantized_base_cache.py --double 19 --single 38   # the full model (24 GB of disk per mode)
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch


def _save_model(folder: Path, width: int, double: int, single: int) -> None:
    """A FLUX pipeline folder: the tiny model's other components, and a transformer of this size."""
    from diffusers import FluxTransformer2DModel

    from dreamstep.models.tiny import write_tiny_model

    write_tiny_model("flux", folder, seed=0, guidance_embeds=True)
    shutil.rmtree(folder / "transformer")

    heads = width // 128
    with torch.device("cpu"):
        model = FluxTransformer2DModel(num_layers=double, num_single_layers=single, attention_head_dim=128,
                                       num_attention_heads=heads, joint_attention_dim=4096, pooled_projection_dim=768,
                                       guidance_embeds=True).to(torch.bfloat16)
    model.save_pretrained(folder / "transformer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--double", type=int, default=2)
    parser.add_argument("--single", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=["int8", "fp8"])
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="dreamstep-bench-") as work:
        work_dir = Path(work)
        os.environ["DREAMSTEP_QUANTIZED_CACHE"] = str(work_dir / "kept")
        model = work_dir / "model"
        _save_model(model, args.width, args.double, args.single)
        from dreamstep.models.loading import load_flux_transformer

        print(f"FLUX transformer, width {args.width}, {args.double} double + {args.single} single blocks, bf16; "
              f"torch {torch.__version__}")
        print(f"{'mode':<6} {'quantize (s)':>13} {'read back (s)':>14} {'ratio':>7} {'kept (MiB)':>11}")
        for mode in args.modes:
            timings = []
            for _ in range(2):
                start = time.perf_counter()
                load_flux_transformer(str(model), weight_dtype=torch.bfloat16, base_quantization=mode)
                timings.append(time.perf_counter() - start)
            kept = sum(f.stat().st_size for f in (work_dir / "kept").rglob("*") if f.is_file()) / 2**20
            print(f"{mode:<6} {timings[0]:13.1f} {timings[1]:14.1f} {timings[0] / timings[1]:6.1f}x {kept:11.1f}")
            shutil.rmtree(work_dir / "kept")


if __name__ == "__main__":
    main()
