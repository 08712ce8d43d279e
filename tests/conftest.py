"""Shared test set-up: Triton interpreter on CPU-only machines, GPU skips, seeds."""

from __future__ import annotations

import os

import pytest
import torch

# Must run before anything imports triton: the interpreter flag is read at import time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Each machine runs what it can: GPU tests need CUDA; interpreter tests launch Triton on
    # CPU tensors, which only works when the interpreter was switched on at import (no CUDA).
    if HAS_CUDA:
        skip, marker = pytest.mark.skip(reason="runs Triton on CPU tensors: needs the "
                                        "interpreter, which is off where CUDA is"), "interpreter"
    else:
        skip, marker = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is "
                                        "False)"), "gpu"
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """The device tests should allocate on: "cuda" when available, else "cpu"."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def seeded(request: pytest.FixtureRequest) -> int:
    """Seed torch with a fresh seed for this test and return it.

    The seed is printed (shown in the captured output of a failing test) and recorded in
    the test's user_properties (e.g. for --junitxml). Reproduce with GRAPHBUCKET_SEED=<seed>.
    """
    env = os.environ.get("GRAPHBUCKET_SEED")
    seed = int(env) if env else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed} (rerun with GRAPHBUCKET_SEED={seed})")
    return seed
