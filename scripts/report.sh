#!/usr/bin/env bash
# usage: bash scripts/report.sh --json RESULT.json [tpot_report options]
#
# Install the plot dependency (matplotlib) and render a TPOT report: the arguments go to
# scripts/tpot_report.py, e.g. bash scripts/report.sh --json bench/results/h200-tpot.json
# --force. It never replaces an existing table or figure without --force.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for arg in "$@"; do
    if [[ $arg == -h || $arg == --help ]]; then  # before any install step: --help changes nothing
        sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
        echo "Options: those of scripts/tpot_report.py (python3 scripts/tpot_report.py --help)."
        exit 0
    fi
done
source scripts/_install.sh

use_python
install_runtime
install_plot
install_package

exec "$PY" scripts/tpot_report.py "$@"
