#!/usr/bin/env bash
# GPU evidence in one call: GPU tests, kernel sweep, capture/dispatch bench, TPOT sweep.
# Usage (on a CUDA machine, from the repo root): OUT=/some/dir bash bench/run_gpu.sh [steps]
# steps: any of tests gputests sweep capture tpot (default: tests sweep capture).
# Logs and JSON go under $OUT. TPOT_LAYERS sets the tpot model's layer count (default 4).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=${*:-tests sweep capture}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for step in $steps; do
  case $step in
    tests) python3 -m pytest -q -x tests -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/tests.log" ;;
    gputests) python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/tests.log" ;;
    sweep) python3 bench/kernel_sweep.py --out "$OUT" > "$OUT/sweep.log" 2>&1; tail -40 "$OUT/sweep.log" ;;
    capture) python3 bench/capture_dispatch.py --out "$OUT" 2>&1 | tail -30 ;;
    tpot) python3 bench/tpot.py --layers "${TPOT_LAYERS:-4}" --out "$OUT" > "$OUT/tpot.log" 2>&1
          tail -5 "$OUT/tpot.log"
          python3 scripts/tpot_report.py --json "$OUT/h200-tpot.json" ;;
    *) echo "unknown step $step" ;;
  esac
done
