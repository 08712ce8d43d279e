"""Load a script under ``scripts/`` or ``bench/experiments/`` as a module, so tests call its
functions directly."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
EXPERIMENTS = ROOT / "bench" / "experiments"


def load_script(name: str, folder: Path = SCRIPTS) -> ModuleType:
    """``<folder>/<name>.py`` (``scripts/`` by default) as a fresh module (not cached: each
    call re-executes it)."""
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_experiment(name: str) -> ModuleType:
    """``bench/experiments/<name>.py`` as a fresh module."""
    return load_script(name, EXPERIMENTS)
