# Shared install steps for scripts/test.sh and scripts/demo.sh. Source it; do not run it.
# Each step installs only what is missing or at an unsuitable version, so reruns are quick.

PY="${PYTHON:-python3}"

_pip() {
    "$PY" -m pip install --quiet --disable-pip-version-check "$@"
}

# Exit status 0 when module $1 imports (outside the repo, so cwd does not shadow anything)
# and, when $2 is given, the Python expression $2 over `v` (its version tuple) holds.
_have() {
    local module="$1" check="${2:-True}"
    (cd / && "$PY" - "$module" "$check" >/dev/null 2>&1) <<'PYEOF'
import importlib, importlib.metadata as md, re, sys
module, check = sys.argv[1], sys.argv[2]
importlib.import_module(module)
dist = {"pytest_benchmark": "pytest-benchmark"}.get(module, module)
v = tuple(int(x) for x in re.findall(r"\d+", md.version(dist))[:3])
sys.exit(0 if eval(check, {"v": v}) else 1)
PYEOF
}

install_runtime() {
    # torch==2.13.0 is the CPU build on local disk here; a CUDA machine keeps its own torch.
    if ! _have torch; then
        echo "install: torch==2.13.0"
        _pip torch==2.13.0
    fi
    local want=()
    # Keep a newer triton that a CUDA torch may have pinned; only fill in a missing/old one.
    _have triton "v >= (3, 6)" || want+=("triton==3.6.0")
    # numpy>=2.4 breaks the Triton 3.6 interpreter on loops with loaded bounds.
    _have numpy "v < (2, 4)" || want+=("numpy<2.4")
    if ((${#want[@]})); then
        echo "install: ${want[*]}"
        _pip "${want[@]}"
    fi
}

install_test() {
    local want=()
    _have pytest || want+=(pytest)
    _have pytest_benchmark || want+=(pytest-benchmark)
    _have ruff || want+=(ruff)
    if ((${#want[@]})); then
        echo "install: ${want[*]}"
        _pip "${want[@]}"
    fi
}

# Editable install of this checkout, skipped when it is already the one imported.
install_package() {
    local root
    root="$(pwd -P)"
    if (cd / && "$PY" -I -c "import graphbucket, os, sys; \
sys.exit(os.path.dirname(os.path.dirname(os.path.realpath(graphbucket.__file__))) != sys.argv[1])" \
        "$root") >/dev/null 2>&1; then
        return
    fi
    echo "install: graphbucket (editable, $root)"
    _pip --no-deps -e .
}
