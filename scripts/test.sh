#!/usr/bin/env bash
# Install what the tests need, lint, and run the test suite. Extra args go to pytest.
# Installs into .venv/ in the repository root; PYTHON=/path/to/python uses that instead
# (see scripts/_install.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_install.sh

use_python
install_runtime
install_test
install_package

"$PY" -m ruff check .
"$PY" -m pytest -q tests bench/test_tpot.py --benchmark-disable "$@"
