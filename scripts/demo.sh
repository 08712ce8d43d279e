#!/usr/bin/env bash
# Install the runtime dependencies and run the demo. Extra args go to scripts/demo.py.
# Installs into .venv/ in the repository root; PYTHON=/path/to/python uses that instead
# (see scripts/_install.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_install.sh

use_python
install_runtime
install_package

exec "$PY" scripts/demo.py "$@"
