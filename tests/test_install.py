"""scripts/_install.sh: which torch, triton and numpy it installs, keeps or leaves alone, and
that the set-up works offline.

The planner cases run against a made-up environment: fake ``torch`` (a module with
``cuda.is_available``), ``triton`` and ``numpy`` distributions put ahead of the real ones on
PYTHONPATH. The offline cases run the set-up steps of scripts/test.sh and scripts/demo.sh in a
throwaway virtual environment of fake packages, with pip pointed at an index that refuses
connections and every pip call recorded. Nothing is installed outside ``tmp_path``.
"""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def plan(tmp_path: Path, torch: str | None = None, pin: str = "", cuda: bool = False,
         triton: str | None = None, numpy: str | None = None, pin_name: str = "triton",
         extra: dict[str, str] | None = None, mode: str = "") -> tuple[str, str]:
    """Run the planner with the given fake versions (None: not installed); (stdout, stderr).

    ``pin``: the specifier with which the fake torch requires ``pin_name`` (a CUDA build).
    ``mode``: the planner's argument ("newest": the bounds to upgrade within).
    """
    site = tmp_path / "site"
    site.mkdir()

    def dist(name: str, version: str | None, requires: str = "") -> None:
        # No version: found ahead of the real distribution, so that one counts as missing.
        info = site / f"{name.replace('-', '_')}-{version or '0'}.dist-info"
        info.mkdir()
        meta = f"Metadata-Version: 2.1\nName: {name}\n"
        if version:
            meta += f"Version: {version}\n"
        if requires:
            meta += f"Requires-Dist: {requires}\n"
        (info / "METADATA").write_text(meta)

    pkg = site / "torch"
    pkg.mkdir()
    if torch is None:
        (pkg / "__init__.py").write_text("raise ImportError('no torch')\n")
    else:
        dist("torch", torch, f'{pin_name}{pin}; platform_system == "Linux"' if pin else "")
        (pkg / "__init__.py").write_text(
            f"__version__ = {torch!r}\n"
            f"class cuda:\n    is_available = staticmethod(lambda: {cuda})\n")
    dist("triton", triton)
    dist("numpy", numpy)
    for name, version in (extra or {}).items():
        dist(name, version)
    env = dict(os.environ, PYTHONPATH=str(site))
    script = f'source scripts/_install.sh; PY="{sys.executable}"; _runtime_plan {mode}'
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True, timeout=60)
    return out.stdout.strip(), out.stderr


def test_cpu_keeps_a_usable_set(tmp_path):
    assert plan(tmp_path, "2.13.0+cpu", triton="3.6.0", numpy="2.3.5") == ("", "")


def test_no_torch_installs_the_cpu_build(tmp_path):
    assert plan(tmp_path, None, triton="3.6.0", numpy="2.3.5")[0] == "torch==2.13.0"


def test_cpu_replaces_numpy_that_breaks_the_triton_36_interpreter(tmp_path):
    assert plan(tmp_path, "2.13.0+cpu", triton="3.6.0", numpy="2.4.6")[0] == "numpy>=1.26,<2.4"


def test_cpu_keeps_numpy_24_with_a_newer_triton(tmp_path):
    assert plan(tmp_path, "2.13.0+cpu", triton="3.9.0", numpy="2.4.6")[0] == ""


@pytest.mark.parametrize("triton", ["3.5.1", "3.10.0"])
def test_cpu_replaces_an_untested_triton(tmp_path, triton):
    assert plan(tmp_path, "2.13.0+cpu", triton=triton, numpy="2.3.5")[0] == "triton>=3.6,<3.10"


def test_cuda_keeps_its_pinned_triton_and_numpy(tmp_path):
    # The H200 image: torch 2.11 pins triton 3.6.0; numpy 2.5 is fine where CUDA runs kernels.
    got = plan(tmp_path, "2.11.0+cu130", pin="==3.6.0", cuda=True, triton="3.6.0",
               numpy="2.5.2")
    assert got == ("", "")


def test_cuda_never_replaces_its_pinned_triton(tmp_path):
    out, err = plan(tmp_path, "2.16.0+cu130", pin="~=3.10.0", cuda=True, triton="3.10.0",
                    numpy="2.5.2")
    assert out == ""
    assert "pinned by torch" in err and "outside the tested" in err


def test_rocm_keeps_its_pinned_triton(tmp_path):
    # ROCm torch asks for pytorch-triton-rocm, which provides the triton module.
    got = plan(tmp_path, "2.11.0+rocm7.1", pin="==3.6.0", pin_name="pytorch-triton-rocm",
               cuda=True, triton=None, numpy="2.3.5", extra={"pytorch-triton-rocm": "3.6.0"})
    assert got == ("", "")


def test_cuda_torch_gets_the_triton_it_pins(tmp_path):
    assert plan(tmp_path, "2.11.0+cu130", pin="==3.6.0", cuda=True, triton=None,
                numpy="2.3.5")[0] == "triton==3.6.0"


def test_setup_cfg_bounds_are_one_requirement_a_line():
    """The planner reads install_requires line by line; keep each bound on its package's line."""
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "setup.cfg")
    reqs = [r.strip() for r in cfg["options"]["install_requires"].splitlines() if r.strip()]
    assert sorted(re.match(r"[\w-]+", r).group(0) for r in reqs) == ["numpy", "torch", "triton"]
    assert all(re.fullmatch(r"[\w-]+(\s*(>=|<|==)\s*[\d.]+,?)+", r) for r in reqs), reqs


def test_newest_upgrades_triton_and_numpy_within_bounds_where_torch_pins_none(tmp_path):
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "setup.cfg")
    reqs = {re.match(r"[\w-]+", r).group(0): r.strip()
            for r in cfg["options"]["install_requires"].splitlines() if r.strip()}
    out, _ = plan(tmp_path, "2.13.0+cpu", triton="3.6.0", numpy="2.3.5", mode="newest")
    assert out.splitlines() == [reqs["triton"], reqs["numpy"]]


def test_newest_leaves_a_pinned_triton_alone(tmp_path):
    assert plan(tmp_path, "2.11.0+cu130", pin="==3.6.0", cuda=True, triton="3.6.0",
                numpy="2.5.2", mode="newest") == ("", "")


# The offline set-up. An environment where everything fits: the versions a fresh CPU
# install resolves (module name -> distribution name, version).
FITS = {"torch": ("torch", "2.13.0+cpu"), "triton": ("triton", "3.9.0"),
        "numpy": ("numpy", "2.4.6"), "pytest": ("pytest", "9.0.0"),
        "pytest_benchmark": ("pytest-benchmark", "5.1.0"), "ruff": ("ruff", "0.15.0"),
        "transformers": ("transformers", "5.24.0")}
UNREACHABLE = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple"}  # the discard port: refused


def fake_environment(tmp_path: Path, packages: dict[str, tuple[str, str]]) -> Path:
    """A virtual environment without pip holding ``packages`` as empty modules with their
    dist-info, and a wrapper interpreter that records every ``-m pip`` call in pip.log
    (PATH gets pip and pip3 that do the same). Returns the wrapper."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path("
                                "'purelib'))"], capture_output=True, text=True, check=True,
                               timeout=60).stdout.strip())
    for module, (dist, version) in packages.items():
        (site / module).mkdir()
        init = f"__version__ = {version!r}\n"
        if module == "torch":
            init += "class cuda:\n    is_available = staticmethod(lambda: False)\n"
        (site / module / "__init__.py").write_text(init)
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    log = tmp_path / "pip.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "python"
    wrapper.write_text("#!/bin/sh\n"
                       f'for a in "$@"; do [ "$a" = pip ] && echo "python $*" >> {log}; done\n'
                       f'exec {python} "$@"\n')
    for name in ("pip", "pip3"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\nexit 1\n')
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    return wrapper


def set_up(wrapper: Path, steps: str, offline: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``steps`` of scripts/_install.sh with PYTHON=wrapper and the ``offline`` pip
    settings (no other PIP_* variable)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(offline, PYTHON=str(wrapper), PATH=f"{wrapper.parent}:{env['PATH']}")
    script = f'source scripts/_install.sh && {steps} && echo "LINT=${{LINT:-}}"'
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def pip_calls(wrapper: Path) -> str:
    log = wrapper.parent.parent / "pip.log"
    return log.read_text() if log.exists() else ""


def venv_python(wrapper: Path, code: str) -> str:
    done = subprocess.run([wrapper.parent.parent / "venv" / "bin" / "python", "-c", code],
                          cwd="/", capture_output=True, text=True, check=True, timeout=60)
    return done.stdout.strip()


@pytest.mark.parametrize("offline", [UNREACHABLE, {"PIP_NO_INDEX": "1"}],
                         ids=["refused", "no-index"])
def test_offline_test_set_up_calls_no_pip_when_everything_fits(tmp_path, offline):
    wrapper = fake_environment(tmp_path, FITS)
    done = set_up(wrapper, "setup_test", offline)
    assert done.returncode == 0, done.stdout + done.stderr
    assert pip_calls(wrapper) == ""
    lines = done.stdout.splitlines()
    # One line for the upgrade it could not check; the package linked without pip.
    said = [line for line in lines if "unreachable" in line]
    why = "no-index is set" if "PIP_NO_INDEX" in offline else UNREACHABLE["PIP_INDEX_URL"]
    assert len(said) == 1 and said[0].startswith(f"install: package index unreachable ({why}")
    assert said[0].endswith("keeping triton 3.9.0, numpy 2.4.6"), said
    assert f"install: graphbucket (editable, {ROOT})" in lines and lines[-1] == "LINT=1"
    found = venv_python(wrapper, "import importlib.util, importlib.metadata as m; "
                        "print(importlib.util.find_spec('graphbucket').origin, "
                        "m.version('graphbucket'))")
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "setup.cfg")
    assert found == f"{ROOT / 'graphbucket' / '__init__.py'} {cfg['metadata']['version']}"
    # A rerun only checks versions.
    again = set_up(wrapper, "setup_test", offline)
    assert again.returncode == 0 and "graphbucket" not in again.stdout, again.stdout
    assert pip_calls(wrapper) == ""


@pytest.mark.host
def test_offline_demo_set_up_calls_no_pip_and_probes_nothing(tmp_path):
    wrapper = fake_environment(tmp_path, {m: FITS[m] for m in ("torch", "triton", "numpy")})
    done = set_up(wrapper, "setup_demo", UNREACHABLE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert pip_calls(wrapper) == ""
    assert done.stdout.splitlines() == [f"install: graphbucket (editable, {ROOT})", "LINT="]


def test_offline_without_ruff_skips_the_lint_and_says_so(tmp_path):
    wrapper = fake_environment(tmp_path, {m: v for m, v in FITS.items() if m != "ruff"})
    done = set_up(wrapper, "setup_test", UNREACHABLE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert pip_calls(wrapper) == ""
    assert "install: ruff is missing and the package index is unreachable" in done.stdout
    assert done.stdout.splitlines()[-1] == "LINT=0"


@pytest.mark.host
@pytest.mark.parametrize("ruff", [True, False], ids=["with-ruff", "without-ruff"])
def test_offline_without_transformers_the_adapter_tests_skip_and_it_says_so(tmp_path, ruff):
    wrapper = fake_environment(tmp_path, {m: v for m, v in FITS.items()
                                          if m != "transformers" and (ruff or m != "ruff")})
    done = set_up(wrapper, "setup_test", UNREACHABLE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert pip_calls(wrapper) == ""
    said = [line for line in done.stdout.splitlines() if "transformers" in line]
    assert len(said) == 1 and "the transformers adapter's tests skip" in said[0], said
    assert done.stdout.splitlines()[-1] == ("LINT=1" if ruff else "LINT=0")


@pytest.mark.host
@pytest.mark.parametrize(("missing", "named"), [("pytest", "pytest"), ("torch", "torch==2.13.0")])
def test_offline_a_missing_package_fails_naming_it(tmp_path, missing, named):
    wrapper = fake_environment(tmp_path, {m: v for m, v in FITS.items() if m != missing})
    done = set_up(wrapper, "setup_test", UNREACHABLE)
    assert done.returncode != 0
    assert pip_calls(wrapper) == ""
    assert (f"install: {named} needed, and the package index is unreachable "
            f"({UNREACHABLE['PIP_INDEX_URL']}") in done.stderr, done.stderr
