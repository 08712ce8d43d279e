from __future__ import annotations

import configparser
import os
from pathlib import Path

import pytest
import torch

import graphbucket

ROOT = Path(__file__).resolve().parents[1]


def test_version_matches_setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert graphbucket.__version__ == cfg["metadata"]["version"]


def test_interpreter_enabled_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: kernels compile natively")
    assert os.environ.get("TRITON_INTERPRET") == "1"


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
