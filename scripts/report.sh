#!/usr/bin/env bash
# Install the plot dependency (matplotlib) and render a TPOT report. Args go to
# scripts/tpot_report.py, e.g.: bash scripts/report.sh --json bench/results/h200-tpot.json --force
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_install.sh

use_python
install_runtime
install_plot
install_package

exec "$PY" scripts/tpot_report.py "$@"
