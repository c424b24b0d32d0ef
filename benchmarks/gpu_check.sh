#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py, whose docstring says what it measures): on one H100 / H200 with the
# project's environment (nothing is installed), six minutes at most; the table goes to gpu_check.md, or to
# --table PATH. PYTHON picks the interpreter (default: python on the PATH). The check keeps to its own budget of
# 330 s; the timeout is the backstop, and interrupts it (the table keeps every row finished before).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="$here/../src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
exec timeout --signal=INT --kill-after=15 360 "${PYTHON:-python}" "$here/gpu_check.py" "$@"
