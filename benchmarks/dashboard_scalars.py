"""How fast the dashboard reads a long run's scalars. Writes N steps of loss, lr, grad_norm and loss_scale
with the trainer's own logger (train.log + TensorBoard events), then times:
- the dashboard's first full read of train.log, and a refresh after 100 more steps (with smoothing and
  decimation to the 4000 points the page receives);
- the reference: TensorBoard's own event loader on the same event file, per step;
- a long run's log of about 100 MB (``--long_run_steps``) through the server's own run index: the first
  request, the next ones, and how much the process's memory grew. Figure to hold (2 cores, CPU): the
  server grows by under 350 MiB for a 1.4M-step, 119 MB train.log (1.36 GiB before the scalars were
  packed), and requests after the first take under 0.1 s.

    python benchmarks/dashboard_scalars.py --steps 100000
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

from measure import process_status_mib

from dreamstep.dashboard.runs import RunIndex
from dreamstep.dashboard.scalars import RunScalars, decimate
from dreamstep.engine.logging import TrainingLogger


def write_steps(logger: TrainingLogger, start: int, count: int) -> None:
    for step in range(start, start + count):
        logger.log(step, {"loss": 0.5 + 0.1 * math.sin(step / 50), "lr": 1e-4, "grad_norm": 1.0, "loss_scale": 1.0})


def write_long_log(folder: Path, steps: int) -> None:
    """A train.log as the trainer writes it, without the logger's per-line cost (it would take minutes)."""
    folder.mkdir(parents=True)
    with open(folder / "train.log", "w") as f:
        for step in range(1, steps + 1):
            f.write(f"2026-11-25 08:30:01.123 step {step} loss={0.5 + 0.1 * math.sin(step / 50):.6g} lr=0.0001 "
                    "grad_norm=1 loss_scale=1\n")


def long_run_requests(root: Path, steps: int) -> None:
    write_long_log(root / "long", steps)
    size = (root / "long" / "train.log").stat().st_size
    index = RunIndex([root])
    before = process_status_mib("VmRSS")
    times = []
    for _ in range(3):
        run, t0 = next(iter(index.runs().values())), time.perf_counter()
        run.detail()
        times.append(time.perf_counter() - t0)
    grown = process_status_mib("VmRSS") - before
    print(f"long run, train.log {size / 1e6:.0f} MB ({steps} steps): first request {times[0]:.1f} s, next "
          f"{max(times[1:]) * 1000:.0f} ms; the process grew by {grown:.0f} MiB")


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--reference_steps", type=int, default=5_000,
                        help="steps read with TensorBoard's loader (it is slow: about 1 ms per step)")
    parser.add_argument("--long_run_steps", type=int, default=1_400_000,
                        help="steps of the long run's train.log read through the server (0: skip)")
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
        if args.long_run_steps:
            long_run_requests(Path(tmp) / "runs", args.long_run_steps)


if __name__ == "__main__":
    main()
