"""graphbucket ships its type information (PEP 561): a built wheel holds py.typed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.host


def test_the_wheel_ships_py_typed_and_the_ladders(tmp_path):
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools")
    assert (ROOT / "graphbucket" / "py.typed").is_file()
    # Built from a copy, so that no build/ or egg-info lands in the checkout; without build
    # isolation, so that nothing is downloaded.
    src = tmp_path / "src"
    shutil.copytree(ROOT / "graphbucket", src / "graphbucket",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "setup.cfg", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    dist = tmp_path / "dist"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                           "--no-build-isolation", "--no-index", "-q", "-w", str(dist)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = dist.glob("graphbucket-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "graphbucket/py.typed" in names, sorted(names)
    assert "graphbucket/key.py" in names
    assert "graphbucket/ladders/default.json" in names
