"""Benchmark suites: the Triton interpreter on CPU-only machines (set before triton loads)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
