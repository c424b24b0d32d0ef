"""How fast the dashboard reads a long run's scalars. Writes N steps of loss, lr, grad_norm and loss_scale
with the trainer's own logger (train.log + TensorBoard events), then times:
- the dashboard's first full read of train.log, and a refresh after 100 more steps (with smoothing and
  decimation to the 4000 points the page receives);
- the reference: TensorBoard's own event loader on the same event file, per step.

    python benchmarks/dashboard_scalars.py --steps 100000
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

from dreamstep.dashboard.scalars import RunScalars, decimate
from dreamstep.engine.logging import TrainingLogger


def write_steps(logger: TrainingLogger, start: int, count: int) -> None:
    for step in range(start, start + count):
        logger.log(step, {"loss": 0.5 + 0.1 * math.sin(step / 50), "lr": 1e-4, "grad_norm": 1.0, "loss_scale": 1.0})


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--reference_steps", type=int, default=5_000,
                        help="steps read with TensorBoard's loader (it is slow: about 1 ms per step)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        big, small = Path(tmp) / "big", Path(tmp) / "small"
        logger = TrainingLogger(big, report_to="none")
        write_steps(logger, 1, args.steps)
        scalars = RunScalars(big)
        _, first = timed(scalars.refresh)
        write_steps(logger, args.steps + 1, 100)

        def refresh_and_decimate():
            loss = scalars.refresh()["loss"]
            return decimate(loss.steps, loss.values, 4000), decimate(loss.steps, loss.smoothed, 4000)

        (raw, smoothed), refresh = timed(refresh_and_decimate)
        logger.close()

        reference_logger = TrainingLogger(small)
        write_steps(reference_logger, 1, args.reference_steps)
        reference_logger.close()
        (small / "train.log").unlink()  # make RunScalars fall back to the event files
        _, reference = timed(RunScalars(small).refresh)

        size = (big / "train.log").stat().st_size
        print(f"{args.steps + 100} steps, 4 scalars each; train.log {size / 1e6:.1f} MB")
        print(f"first read of train.log:        {first:.2f} s  ({first / args.steps * 1e6:.1f} us/step)")
        print(f"refresh after 100 more steps:   {refresh * 1000:.0f} ms (with smoothing, decimated to "
              f"{len(raw[0])} + {len(smoothed[0])} points)")
        print(f"TensorBoard loader, reference:  {reference / args.reference_steps * 1e6:.1f} us/step "
              f"({args.reference_steps} steps in {reference:.2f} s)")
        ratio = reference / args.reference_steps / (first / args.steps)
        print(f"ratio per step, TensorBoard / train.log: {ratio:.0f}x")


if __name__ == "__main__":
    main()
