# Shared install steps for scripts/test.sh and scripts/demo.sh (and any wrapper that needs
# them). Source it from the repository root; do not run it. Then:
#
#   use_python          # sets PY: the project environment .venv/, made on first use
#   install_runtime     # torch, triton, numpy at versions the kernels are known to work with
#   install_test        # pytest, pytest-benchmark, ruff
#   install_plot        # matplotlib (not installed by the two set-up commands)
#   install_package     # this checkout, editable, without dependencies
#
# Where it installs: by default into .venv/ in the repository root, made with
# --system-site-packages so that a torch that is already importable (a CUDA machine's own)
# is reused, not downloaded again; nothing outside the checkout is changed. PYTHON=/path/to/python
# installs into that interpreter's environment instead (another venv, a conda env, or the
# system's python3) and makes no .venv.
#
# Each step installs only what is missing or at a version it cannot use, so reruns are quick.
# The version bounds are read from setup.cfg's install_requires.

_pip() {
    "$PY" -m pip install --quiet --disable-pip-version-check "$@"
}

use_python() {
    if [[ -n "${PYTHON:-}" ]]; then
        PY="$PYTHON"
        if ! "$PY" -c "" >/dev/null 2>&1; then
            echo "install: PYTHON=$PYTHON does not run" >&2
            return 1
        fi
        return
    fi
    local venv
    venv="$(pwd -P)/.venv"
    PY="$venv/bin/python"
    if "$PY" -c "" >/dev/null 2>&1; then
        return
    fi
    if [[ -e "$venv" && ! -f "$venv/pyvenv.cfg" ]]; then
        echo "install: $venv exists and is not a virtual environment; move it away," \
             "or name an interpreter with PYTHON=" >&2
        return 1
    fi
    # Missing, or broken (its base python went away): make it anew.
    echo "install: virtual environment $venv (--system-site-packages)"
    if ! python3 -m venv --clear --system-site-packages "$venv"; then
        # No ensurepip (Debian without python3-venv): borrow the base interpreter's pip.
        python3 -m venv --clear --without-pip --system-site-packages "$venv" &&
            "$PY" -m pip --version >/dev/null 2>&1 || {
            echo "install: could not make $venv with a working pip; install python3-venv," \
                 "or name an interpreter with PYTHON=" >&2
            return 1
        }
    fi
    # --system-site-packages reaches the base installation only. When python3 is itself a
    # virtual environment's (a GPU image's torch often lives in one), see its packages too.
    local outer
    outer="$(python3 -c 'import site, sys
if sys.prefix != sys.base_prefix: print("\n".join(site.getsitepackages()))')"
    if [[ -n "$outer" ]]; then
        echo "$outer" >"$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_outer_env.pth"
    fi
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

# Prints the requirements of the first runtime step that needs an install (torch, then
# triton, then numpy), one a line, or nothing when all three are usable. Warnings go to stderr.
_runtime_plan() {
    (cd / && "$PY" - "$OLDPWD/setup.cfg") <<'PYEOF'
import configparser, importlib.metadata as md, re, sys, warnings

def vtuple(text):
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])

def version(dist):
    try:
        v = md.version(dist)
    except md.PackageNotFoundError:
        return None
    return vtuple(v) if v else None

def holds(v, spec):  # spec: "name>=a,<b" with the operators >=, <, ==, ~=
    if v is None:
        return False
    for op, want in re.findall(r"(>=|<=|==|~=|<|>)\s*([\d.]+)", spec):
        w = vtuple(want)
        n = max(len(v), len(w))
        a, b = v + (0,) * (n - len(v)), w + (0,) * (n - len(w))
        ok = {">=": a >= b, "<=": a <= b, "<": a < b, ">": a > b,
              "==": a == b, "~=": a >= b and a[:len(w) - 1] == b[:len(w) - 1]}[op]
        if not ok:
            return False
    return True

def warn(msg):
    print(f"install: warning: {msg}", file=sys.stderr)

cfg = configparser.ConfigParser(interpolation=None)
cfg.read(sys.argv[1])
bounds = {re.match(r"[\w-]+", r).group(0): r
          for r in cfg["options"]["install_requires"].split("\n") if r.strip()}
py = cfg["options"]["python_requires"]
if not holds(sys.version_info[:3], py):
    sys.exit(f"install: {sys.executable} is Python {sys.version.split()[0]}; graphbucket needs {py}")

# torch: keep any importable one (a CUDA machine's own); otherwise the CPU build.
warnings.simplefilter("ignore")  # torch's "Failed to initialize NumPy" before numpy is in
try:
    import torch
except ImportError:
    print("torch==2.13.0")
    sys.exit()
if not holds(version("torch"), bounds["torch"]):
    warn(f"torch {torch.__version__} is outside the tested {bounds['torch']}; keeping it")

# triton: a CUDA (or ROCm) torch pins the triton it was built with (ROCm's is named
# pytorch-triton-rocm); never replace that one.
pin = next((m.groups() for r in md.requires("torch") or []
            if (m := re.match(r"((?:pytorch-)?triton[\w-]*)\s*([^;]*)", r))), None)
dist = pin[0] if pin else "triton"
triton = version(dist)
if not holds(triton, bounds["triton"]):
    if pin and triton is None:
        print("".join(pin).replace(" ", ""))  # the one this torch asks for
        sys.exit()
    if pin:
        warn(f"{dist} {'.'.join(map(str, triton))} (pinned by torch {torch.__version__}) is "
             f"outside the tested {bounds['triton']}; keeping it")
    else:
        print(bounds["triton"])
        sys.exit()

# numpy: Triton 3.6's interpreter (used where CUDA is not) breaks on numpy >= 2.4.
spec = bounds["numpy"]
if triton is not None and triton < (3, 7) and not torch.cuda.is_available():
    spec = re.sub(r",\s*<\s*[\d.]+", "", spec) + ",<2.4"
if not holds(version("numpy"), spec):
    print(spec)
PYEOF
}

install_runtime() {
    local i want
    for i in 1 2 3 4; do
        want="$(_runtime_plan)" || return 1
        if [[ -z "$want" ]]; then
            return
        fi
        echo "install:" $want
        # shellcheck disable=SC2086  # one requirement a line, none with spaces
        _pip $want
    done
    echo "install: torch, triton and numpy did not settle; see the warnings above" >&2
    return 1
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

# For the plotting scripts (scripts/tpot_report.py, scripts/tune_ladder.py --plot).
install_plot() {
    if ! _have matplotlib; then
        echo "install: matplotlib"
        _pip matplotlib
    fi
}

# Editable install of this checkout (the project .venv lives inside it, so the two go away
# together), skipped when it is already the one imported.
install_package() {
    local root
    root="$(pwd -P)"
    if (cd / && "$PY" -I -c "import graphbucket, os, sys; \
sys.exit(os.path.dirname(os.path.dirname(os.path.realpath(graphbucket.__file__))) != sys.argv[1])" \
        "$root") >/dev/null 2>&1; then
        return
    fi
    echo "install: graphbucket (editable, $root)"
    # Build with the setuptools already there when it is new enough: quicker, and offline.
    if _have setuptools "v >= (70, 1)"; then
        _pip --no-deps --no-build-isolation -e .
    else
        _pip --no-deps -e .
    fi
}
