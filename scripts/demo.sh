#!/usr/bin/env bash
# Install the runtime dependencies and run the demo. Extra args go to scripts/demo.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_install.sh

install_runtime
install_package

exec "$PY" scripts/demo.py "$@"
