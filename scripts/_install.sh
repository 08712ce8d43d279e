# Shared install steps for scripts/test.sh and scripts/demo.sh (and any wrapper that needs
# them). Source it from the repository root; do not run it. Then:
#
#   use_python          # sets PY: the project environment .venv/, made on first use
#   install_runtime     # torch, triton, numpy at versions the kernels are known to work with
#   upgrade_runtime     # triton and numpy: the newest in range where torch pins no triton
#   install_test        # pytest, pytest-benchmark, ruff (ruff may be skipped offline),
#                       # transformers (optional: skipped offline)
#   install_plot        # matplotlib (not installed by the two set-up commands)
#   install_package     # this checkout, editable, without pip (a .pth file)
#   setup_demo          # what scripts/demo.sh runs: use_python, runtime, package
#   setup_test          # what scripts/test.sh runs: the above, the upgrade and the test tools
#
# Where it installs: by default into .venv/ in the repository root, made with
# --system-site-packages so that a torch that is already importable (a CUDA machine's own)
# is reused, not downloaded again; nothing outside the checkout is changed. PYTHON=/path/to/python
# installs into that interpreter's environment instead (another venv, a conda env, or the
# system's python3) and makes no .venv.
#
# Each step installs only what is missing or at a version it cannot use, so reruns are quick,
# and calls pip only then: where everything fits, the set-up works without a network. Before
# a pip call the package index is probed (a few seconds at most), so that offline a missing
# package fails with one clear line rather than pip's retries.
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
# `_runtime_plan newest` (once they are usable) prints the bounds of triton and numpy, to
# upgrade to the newest within them, or nothing where torch pins its triton.
_runtime_plan() {
    (cd / && "$PY" - "$OLDPWD/setup.cfg" "${1:-fit}") <<'PYEOF'
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

# A CUDA (or ROCm) torch pins the triton it was built with (ROCm's is named
# pytorch-triton-rocm); never replace that one.
try:
    torch_requires = md.requires("torch") or []
except md.PackageNotFoundError:
    torch_requires = []
pin = next((m.groups() for r in torch_requires
            if (m := re.match(r"((?:pytorch-)?triton[\w-]*)\s*([^;]*)", r))), None)
if sys.argv[2] == "newest":  # metadata only: no torch import (seconds) to say this
    if not pin:
        print(bounds["triton"], bounds["numpy"], sep="\n")
    sys.exit()

# torch: keep any importable one (a CUDA machine's own); otherwise the CPU build.
warnings.simplefilter("ignore")  # torch's "Failed to initialize NumPy" before numpy is in
try:
    import torch
except ImportError:
    print("torch==2.13.0")
    sys.exit()
if not holds(version("torch"), bounds["torch"]):
    warn(f"torch {torch.__version__} is outside the tested {bounds['torch']}; keeping it")

# triton: the one torch pins, else any in range.
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

# Exit status 0 when the package index pip would use answers. INDEX_STATUS says which index
# and, when it does not answer, why. Probed once a run, without pip (an offline pip retries).
_index_reachable() {
    if [[ -z "${_INDEX_OK:-}" ]]; then
        _INDEX_OK=0
        INDEX_STATUS="$( (cd / && "$PY" - 2>&1) <<'PYEOF'
import os, ssl, sys, urllib.error, urllib.parse, urllib.request

def unreachable(why):
    print(why)
    sys.exit(1)

try:  # pip's own reading of its config files and PIP_* variables, in this process
    from pip._internal.configuration import Configuration
    conf = Configuration(isolated=False)
    conf.load()
    items = dict(conf.items())
except Exception:  # no pip here, or its internals moved: the environment alone
    items = {}

def option(name):
    env = os.environ.get("PIP_" + name.upper().replace("-", "_"))
    if env is not None:
        return env
    return items.get(f"install.{name}", items.get(f"global.{name}"))

if (option("no-index") or "").lower() in ("1", "true", "yes", "on"):
    unreachable("no-index is set")
index = (option("index-url") or "https://pypi.org/simple").split()[0].rstrip("/")
url = index + "/triton/"
if url.startswith("file:"):
    path = urllib.request.url2pathname(urllib.parse.urlparse(url).path)
    if not os.path.isdir(path):
        unreachable(f"{index}: no such folder")
    print(index)
    sys.exit()
try:
    cafile = option("cert")
    if not cafile:
        try:
            from pip._vendor import certifi
            cafile = certifi.where()
        except ImportError:
            cafile = None
    with urllib.request.urlopen(url, timeout=5, context=ssl.create_default_context(cafile=cafile)):
        pass
except urllib.error.HTTPError:  # it answered (a mirror without triton, say): reachable
    pass
except Exception as e:  # refused, no name resolution, timeout, TLS
    unreachable(f"{index}: {getattr(e, 'reason', e)}")
print(index)
PYEOF
        )" && _INDEX_OK=1
    fi
    [[ "$_INDEX_OK" == 1 ]]
}

# Exit status 0 when the index answers; else says that $1 is needed and cannot be had.
_online_for() {
    _index_reachable && return
    echo "install: $1 needed, and the package index is unreachable ($INDEX_STATUS);" \
         "install it by hand, or run where the index is reachable" >&2
    return 1
}

_versions() {
    (cd / && "$PY" -c 'import importlib.metadata as m
print(", ".join(f"{d} {m.version(d)}" for d in ("triton", "numpy")))')
}

install_runtime() {
    local i want
    for i in 1 2 3 4; do
        want="$(_runtime_plan)" || return 1
        if [[ -z "$want" ]]; then
            return
        fi
        _online_for "$(echo $want)" || return 1
        echo "install:" $want
        # shellcheck disable=SC2086  # one requirement a line, none with spaces
        _pip $want || return 1
    done
    echo "install: torch, triton and numpy did not settle; see the warnings above" >&2
    return 1
}

# The newest triton and numpy within setup.cfg's bounds, as a fresh pip install resolves
# them, so that the tests meet what a new user gets even where an older triton is installed.
# Only where torch pins no triton (a CPU build); offline, what is installed is kept.
upgrade_runtime() {
    local specs before after
    specs="$(_runtime_plan newest)" || return 1
    if [[ -z "$specs" ]]; then
        return
    fi
    before="$(_versions)"
    if ! _index_reachable; then
        echo "install: package index unreachable ($INDEX_STATUS); keeping $before"
        return
    fi
    # shellcheck disable=SC2086  # one requirement a line, none with spaces
    _pip --upgrade $specs || return 1
    install_runtime || return 1  # numpy back under 3.6's bound, were 3.6 the newest here
    after="$(_versions)"
    if [[ "$after" == "$before" ]]; then
        echo "install: $after, the newest in range"
    else
        echo "install: the newest in range: $before -> $after"
    fi
}

# Sets LINT=0 when ruff is missing and cannot be had (offline): the tests still run, and the
# lint runs where the index answers (CI). pytest and pytest-benchmark are required.
install_test() {
    local want=()
    LINT=1
    _have pytest || want+=(pytest)
    _have pytest_benchmark || want+=(pytest-benchmark)
    _have ruff || want+=(ruff)
    if ((${#want[@]})) && ! _index_reachable; then
        if [[ "${want[*]}" != ruff ]]; then
            _online_for "${want[*]}"
            return 1
        fi
        echo "install: ruff is missing and the package index is unreachable" \
             "($INDEX_STATUS): lint skipped"
        LINT=0
        want=()
    fi
    if ((${#want[@]})); then
        echo "install: ${want[*]}"
        _pip "${want[@]}" || return 1
    fi
    _install_adapter_reference
}

# transformers, the independent implementation the model adapter's equivalence tests compare
# against (setup.cfg's extra hf). Optional: without it those tests skip, so offline (or when
# pip cannot install it) it is left out with one line, never a failure.
_install_adapter_reference() {
    if _have transformers "v >= (5, 24) and v < (6,)"; then
        return
    fi
    if ! _index_reachable; then
        echo "install: transformers is missing and the package index is unreachable" \
             "($INDEX_STATUS): the transformers adapter's tests skip"
        return
    fi
    echo "install: transformers (the adapter's equivalence tests)"
    _pip "transformers>=5.24,<6" || echo "install: transformers did not install: the" \
        "adapter's tests skip"
}

# For the plotting scripts (scripts/tpot_report.py, scripts/tune_ladder.py --plot).
install_plot() {
    if ! _have matplotlib; then
        _online_for matplotlib || return 1
        echo "install: matplotlib"
        _pip matplotlib || return 1
    fi
}

# Exit status 0 when graphbucket would be imported from this checkout (found, not imported:
# finding it needs none of its dependencies).
_package_is_here() {
    local root
    root="$(pwd -P)"
    (cd / && "$PY" -I - "$root") >/dev/null 2>&1 <<'PYEOF'
import importlib.util, os, sys
spec = importlib.util.find_spec("graphbucket")
here = os.path.dirname(os.path.dirname(os.path.realpath(spec.origin)))
sys.exit(here != os.path.realpath(sys.argv[1]))
PYEOF
}

# Editable install of this checkout without pip or a build (offline-safe): a .pth file in the
# environment's site-packages that puts the checkout on sys.path, with the dist-info that
# importlib.metadata and pip read (PEP 610 marks it editable; `pip uninstall graphbucket`
# removes both). Skipped when this checkout is already the one imported; another graphbucket
# is uninstalled first. The project .venv lives inside the checkout: the two go away together.
install_package() {
    local root
    root="$(pwd -P)"
    if _package_is_here; then
        return
    fi
    if (cd / && "$PY" -c 'import importlib.metadata as m; m.version("graphbucket")') \
        >/dev/null 2>&1; then
        echo "install: uninstalling the graphbucket installed elsewhere"
        "$PY" -m pip uninstall --quiet --yes graphbucket || return 1
    fi
    echo "install: graphbucket (editable, $root)"
    (cd / && "$PY" - "$root") <<'PYEOF' || return 1
import configparser, json, os, pathlib, sys, sysconfig

root = pathlib.Path(sys.argv[1])
site = pathlib.Path(sysconfig.get_path("purelib"))
if not os.access(site, os.W_OK):
    sys.exit(f"install: cannot write to {site}; name an interpreter of an environment you "
             "own with PYTHON=, or use the default .venv")
cfg = configparser.ConfigParser(interpolation=None)
cfg.read(root / "setup.cfg")
meta = cfg["metadata"]
info = site / f"graphbucket-{meta['version']}.dist-info"
info.mkdir(exist_ok=True)
requires = [r.strip() for r in cfg["options"]["install_requires"].splitlines() if r.strip()]
files = {
    site / "graphbucket.pth": f"{root}\n",
    info / "METADATA": "".join([f"Metadata-Version: 2.1\nName: {meta['name']}\n",
                                f"Version: {meta['version']}\nSummary: {meta['description']}\n",
                                f"Requires-Python: {cfg['options']['python_requires']}\n",
                                *(f"Requires-Dist: {r}\n" for r in requires)]),
    info / "INSTALLER": "graphbucket scripts/_install.sh\n",
    info / "direct_url.json": json.dumps({"url": root.as_uri(), "dir_info": {"editable": True}}),
}
for path, text in files.items():
    path.write_text(text)
record = [f"{p.relative_to(site)},," for p in files] + [f"{info.name}/RECORD,,"]
(info / "RECORD").write_text("\n".join(record) + "\n")
PYEOF
    if ! _package_is_here; then
        echo "install: graphbucket still imports from elsewhere after the install; see" \
             "'$PY -c \"import graphbucket; print(graphbucket.__file__)\"'" >&2
        return 1
    fi
}

setup_demo() {
    use_python && install_runtime && install_package
}

setup_test() {
    use_python && install_runtime && upgrade_runtime && install_test && install_package
}
