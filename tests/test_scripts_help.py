"""Every script under scripts/ and bench/ answers --help: exit 0 and a usage line, with CUDA
hidden, and nothing in the checkout written or changed.

The scripts are found by globbing, so a new one is covered without editing this file; the
few files there that are not commands are listed with what they are instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.host  # subprocesses that print their usage: no kernel launches

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("scripts", "bench")
NOT_COMMANDS = {
    "scripts/_install.sh": "sourced by the other shell scripts for its functions, not run",
    "bench/__init__.py": "makes bench/ a package",
    "bench/conftest.py": "pytest set-up of the benchmark suites",
    "bench/common.py": "what the kernel benches import, not run",
    "bench/tpot_model.py": "the TPOT suite's entry for a user's model, imported by bench/tpot.py",
    "bench/hf_tpot.py": "a TpotModel factory (transformers' DeepSeek-V3), named by --model",
}
# pytest suites (bench/test_*.py) are run by pytest, not as commands.
SUITE = re.compile(r"test_.*\.py")
# Written by any Python run or by tools, never part of a script's output.
UNTRACKED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache",
                  ".benchmarks"}
# Each --help imports torch (about 2 s of CPU): run them side by side, a few per core.
WORKERS = min(16, 3 * (os.cpu_count() or 2))


def commands() -> list[str]:
    """Every script under scripts/ and bench/, as a path from the repository root."""
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            rel = path.relative_to(ROOT).as_posix()
            if (path.suffix in (".py", ".sh") and path.is_file()
                    and not UNTRACKED_DIRS & set(path.parts) and rel not in NOT_COMMANDS
                    and not SUITE.fullmatch(path.name)):
                found.append(rel)
    return found


def tree_state() -> dict[str, tuple[int, int]]:
    """path -> (size, mtime) of every file in the checkout but caches and environments."""
    state = {}
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in UNTRACKED_DIRS and not d.endswith(".egg-info")]
        for name in files:
            path = Path(top, name)
            st = path.stat()
            state[path.relative_to(ROOT).as_posix()] = (st.st_size, st.st_mtime_ns)
    return state


def run_help(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONDONTWRITEBYTECODE": "1",
           # The shell scripts' interpreter: this one, so no environment is made for them.
           "PYTHON": sys.executable}
    launcher = ["bash"] if script.endswith(".sh") else [sys.executable]
    return subprocess.run([*launcher, script, "--help"], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=300)


def test_every_script_answers_help_without_a_gpu_or_side_effects():
    scripts = commands()
    assert "bench/tpot.py" in scripts and "scripts/demo.sh" in scripts, scripts
    before = tree_state()
    with ThreadPoolExecutor(WORKERS) as pool:
        results = dict(zip(scripts, pool.map(run_help, scripts), strict=True))
    after = tree_state()
    failed = [f"{s}: exit {r.returncode}, no usage line\n{(r.stdout + r.stderr)[-1500:]}"
              if r.returncode == 0 else f"{s}: exit {r.returncode}\n{r.stderr[-1500:]}"
              for s, r in results.items()
              if r.returncode != 0 or not re.search(r"^usage:", r.stdout, re.M | re.I)]
    assert not failed, "\n\n".join(failed)
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    assert not changed, f"--help wrote or changed files in the checkout: {changed}"


def test_files_that_are_not_commands_exist():
    # A stale entry would hide nothing today but would skip a new script of that name.
    missing = [path for path in NOT_COMMANDS if not (ROOT / path).is_file()]
    assert not missing, f"NOT_COMMANDS lists files that do not exist: {missing}"
