"""scripts/_install.sh: which torch, triton and numpy it installs, keeps or leaves alone.

Each case runs the script's planner against a made-up environment: fake ``torch`` (a module
with ``cuda.is_available``), ``triton`` and ``numpy`` distributions put ahead of the real ones
on PYTHONPATH. Nothing is installed.
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
         extra: dict[str, str] | None = None) -> tuple[str, str]:
    """Run the planner with the given fake versions (None: not installed); (stdout, stderr).

    ``pin``: the specifier with which the fake torch requires ``pin_name`` (a CUDA build).
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
    script = f'source scripts/_install.sh; PY="{sys.executable}"; _runtime_plan'
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
