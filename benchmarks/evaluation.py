"""What evaluation costs against training: flux-lora on the tiny FLUX, trained twice in one process with
the same settings, once without evaluation and once with a held-out validation loss and DINO / CLIP-I /
CLIP-T on the validation samples (tiny random DINO and CLIP) every --every steps. Prints the wall time of
both runs, the time per training step, the trainer's own measure of validation time, and the overhead as
a fraction of the run.

    python benchmarks/evaluation.py                  # 40 steps, validation every 10
    python benchmarks/evaluation.py --steps 200 --every 50
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import tempfile
import time
from pathlib import Path

from dreamstep.cli import main
from dreamstep.evaluation.tiny import write_tiny_evaluators
from dreamstep.models.tiny import write_tiny_model

ROBOT_DIR = Path(__file__).resolve().parents[1] / "examples" / "robot"
_VALIDATION = re.compile(r"validation \(samples and scores\) took ([\d.]+) s of the run's ([\d.]+) s")


def train(model: Path, out: Path, steps: int, extra: list[str]) -> tuple[float, str]:
    """Run the trainer; return its wall time and what it printed."""
    args = ["train", "flux-lora", "--pretrained_model_name_or_path", str(model), "--output_dir", str(out),
            "--instance_data_dir", str(ROBOT_DIR), "--instance_prompt", "a photo of sks robot", "--resolution", "64",
            "--center_crop", "--report_to", "none", "--checkpointing_steps", "0", "--max_train_steps", str(steps),
            *extra]
    printed = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(printed):
        code = main(args)
    if code != 0:
        raise SystemExit(f"the trainer failed (exit {code}) with {' '.join(args)}")
    return time.perf_counter() - start, printed.getvalue()


def main_benchmark() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="training steps of each run")
    parser.add_argument("--every", type=int, default=10, help="validation every N steps")
    parser.add_argument("--images", type=int, default=2, help="validation samples per validation point")
    parser.add_argument("--sample_steps", type=int, default=8, help="denoising steps per validation sample")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_tiny_model("flux", root / "flux", guidance_embeds=True)
        evaluators = write_tiny_evaluators(root / "evaluators")
        plain, _ = train(model, root / "plain", args.steps, [])
        evaluation = ["--validation_split", "0.34", "--validation_steps", str(args.every),
                      "--validation_prompt", "a photo of sks robot", "--num_validation_images", str(args.images),
                      "--validation_inference_steps", str(args.sample_steps), "--eval_metrics", "dino,clip_i,clip_t",
                      "--dino_model", str(evaluators["dino"]), "--clip_model", str(evaluators["clip"])]
        evaluated, printed = train(model, root / "evaluated", args.steps, evaluation)
    match = _VALIDATION.search(printed)
    points = args.steps // args.every + 1  # the baseline at step 0, then every --every steps (the last included)
    print(f"tiny FLUX LoRA, {args.steps} steps, 64 px; validation every {args.every} steps ({points} points: "
          f"held-out loss on 2 images x 4 noise levels, {args.images} samples x {args.sample_steps} steps, "
          "DINO + CLIP-I + CLIP-T)")
    print(f"  without evaluation: {plain:8.1f} s  ({plain / args.steps:.3f} s per step)")
    print(f"  with evaluation:    {evaluated:8.1f} s  ({(evaluated - plain) / points:.1f} s more per validation point)")
    share = 100 * (evaluated - plain) / evaluated
    print(f"  overhead:           {evaluated - plain:8.1f} s  = {share:.1f}% of the run")
    if match:
        seconds, total = float(match.group(1)), float(match.group(2))
        print(f"  the trainer's own count: validation {seconds:.1f} s of {total:.1f} s ({100 * seconds / total:.1f}%), "
              f"{seconds / points:.2f} s per point = {seconds / points / (plain / args.steps):.1f} training steps")


if __name__ == "__main__":
    main_benchmark()
