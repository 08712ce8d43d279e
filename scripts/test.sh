#!/usr/bin/env bash
# Install what the tests need, lint, and run the test suite. Extra args go to pytest.
# Installs into .venv/ in the repository root; PYTHON=/path/to/python uses that instead
# (see scripts/_install.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    cat <<'USAGE'
usage: bash scripts/test.sh [PYTEST_ARGS...]

Installs what the tests need (pytest, pytest-benchmark, ruff, and transformers for the model
adapter's equivalence tests, which skip without it), lints with ruff, then runs the host-only
tests (pytest -m host)
and everything else (Triton's interpreter where there is no GPU; tests marked gpu need CUDA).
Extra arguments go to both pytest runs.

Installs into .venv/ in the repository root (made with --system-site-packages, so an
installed torch is reused); PYTHON=/path/to/python uses that interpreter's environment.
Where torch pins no triton (a CPU build) and the package index answers, triton and numpy are
upgraded to the newest releases within setup.cfg's bounds, as a fresh install resolves them;
a triton that a CUDA torch pins is never replaced. Offline, nothing is downloaded: what is
installed is tested if it fits, the lint is skipped if ruff is missing and the adapter's
tests if transformers is.
USAGE
    exit 0
fi

source scripts/_install.sh
setup_test

if ((LINT)); then
    "$PY" -m ruff check .
fi
# Fast lane first: host logic only, no kernel launches (seconds). Then everything else,
# the Triton kernels included (through the interpreter where there is no GPU).
"$PY" -m pytest -q -m host tests "$@"
"$PY" -m pytest -q -m "not host" tests bench/test_tpot.py bench/test_tpot_sparse.py \
    --benchmark-disable "$@"
