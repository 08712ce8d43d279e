#!/usr/bin/env bash
# Install the runtime dependencies and run the demo. Extra args go to scripts/demo.py.
# Installs into .venv/ in the repository root; PYTHON=/path/to/python uses that instead
# (see scripts/_install.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    cat <<'USAGE'
usage: bash scripts/demo.sh [DEMO_ARGS...]

Installs the runtime dependencies (torch, triton, numpy) where they are missing or outside
setup.cfg's bounds, then runs scripts/demo.py with the extra arguments (its own options:
bash scripts/demo.sh -- --help).

Installs into .venv/ in the repository root (made with --system-site-packages, so an
installed torch is reused); PYTHON=/path/to/python uses that interpreter's environment.
Nothing is downloaded when everything fits, so it runs offline.
USAGE
    exit 0
fi
if [[ "${1:-}" == "--" ]]; then
    shift
fi

source scripts/_install.sh
setup_demo

exec "$PY" scripts/demo.py "$@"
