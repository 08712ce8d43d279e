from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graphbucket

ROOT = Path(__file__).resolve().parents[1]


def test_version_matches_setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert graphbucket.__version__ == cfg["metadata"]["version"]


def test_importing_graphbucket_changes_no_environment_and_exports_the_api():
    code = ("import os; before = dict(os.environ); import graphbucket, graphbucket.models; "
            "assert dict(os.environ) == before, 'import changed the environment'; "
            "from graphbucket import GraphBucketRunner, BucketLadder, GraphSelector, DecodeBatch; "
            "print(sorted(graphbucket.__all__))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "GraphBucketRunner" in done.stdout and "default_ladder" in done.stdout


def test_public_api_has_docstrings():
    for name in graphbucket.__all__:
        obj = getattr(graphbucket, name)
        if callable(obj):
            assert (obj.__doc__ or "").strip(), f"graphbucket.{name} has no docstring"


def test_cpu_model_without_the_interpreter_says_how_to_fix_it():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: kernels compile natively")
    code = ("from graphbucket.models import MLADecoder, tiny; "
            "MLADecoder(tiny(), num_pages=4, device='cpu')(None)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "TRITON_INTERPRET=1" in done.stderr, done.stderr


def test_seeded_fixture_seeds_torch(seeded, request):
    assert ("seed", seeded) in request.node.user_properties
    first = torch.rand(4)
    torch.manual_seed(seeded)
    assert torch.equal(first, torch.rand(4))


def test_device_fixture(device):
    assert device == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.gpu
def test_gpu_marker_runs_only_with_cuda():
    assert torch.cuda.is_available()


def test_no_import_cycles_between_graphbucket_modules():
    import ast

    deps = {}
    for path in (ROOT / "graphbucket").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        deps[name] = {n.module for n in ast.walk(ast.parse(path.read_text()))
                      if isinstance(n, ast.ImportFrom) and n.module
                      and n.module.startswith("graphbucket")}

    def cycle_from(module, stack):
        for dep in deps.get(module, ()):
            if dep in stack:
                return stack[stack.index(dep):] + [dep]
            found = cycle_from(dep, stack + [dep])
            if found:
                return found
        return None

    for module in deps:
        assert cycle_from(module, [module]) is None, cycle_from(module, [module])


@pytest.mark.host
def test_the_transformers_adapter_refuses_a_release_below_the_hf_extra():
    # An older transformers leaves the cache passed as ``cache=`` empty: the adapter must
    # refuse it at import, naming the requirement, and agree with setup.cfg's extra.
    from graphbucket.integrations import MIN_TRANSFORMERS, check_transformers_version

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert f"transformers>={MIN_TRANSFORMERS}," in cfg["options.extras_require"]["hf"]
    for ok in (MIN_TRANSFORMERS + ".0", "5.24.0.dev0", "5.30.1", "6.0.0+local"):
        check_transformers_version(ok)
    for old in ("5.17.0", "5.23.9", "4.57.1"):
        with pytest.raises(ImportError, match=f"transformers>={MIN_TRANSFORMERS}, found {old}"):
            check_transformers_version(old)
