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
# Fast lane first: host logic only, no kernel launches (seconds). Then everything else,
# the Triton kernels included (through the interpreter where there is no GPU).
"$PY" -m pytest -q -m host tests "$@"
"$PY" -m pytest -q -m "not host" tests bench/test_tpot.py bench/test_tpot_sparse.py \
    --benchmark-disable "$@"
