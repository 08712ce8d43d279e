"""Skinny products (decode-batch projections) against float64 torch, through the Triton
interpreter on CPU (fp16 / fp32) and natively on CUDA (bf16 too)."""

from __future__ import annotations

import pytest
import torch

from graphbucket.models.gemv import skinny_bmm, skinny_linear

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16, torch.float32]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [(1, 40, 300), (8, 16, 64), (16, 33, 520), (3, 7, 5)])
def test_linear_matches_float64(seeded, dtype, m, n, k):
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    w = torch.randn(n, k, device=DEVICE).to(dtype)
    y = skinny_linear(x, w)
    assert y.shape == (m, n) and y.dtype == dtype
    assert rel_l2(y, x.double() @ w.double().T) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_on_a_column_slice(seeded, dtype):
    # the model feeds slices such as qkv_a[:, :q_lora]: row stride above the width
    wide = torch.randn(4, 96, device=DEVICE).to(dtype)
    x, w = wide[:, 10:74], torch.randn(48, 64, device=DEVICE).to(dtype)
    assert rel_l2(skinny_linear(x, w), x.double() @ w.double().T) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b, m, k, n", [(3, 5, 70, 50), (2, 1, 128, 512), (4, 16, 512, 24)])
def test_bmm_on_transposed_views_matches_float64(seeded, dtype, b, m, k, n):
    # x as the model builds it: [M, B, K] storage viewed as [B, M, K] (per-head products)
    x = torch.randn(m, b, k, device=DEVICE).to(dtype).transpose(0, 1)
    w = torch.randn(b, k, n, device=DEVICE).to(dtype)
    y = skinny_bmm(x, w)
    assert y.shape == (b, m, n)
    assert rel_l2(y, torch.bmm(x.double(), w.double())) < TOL[dtype]


def test_bad_inputs_raise_before_launch():
    x, w = torch.zeros(2, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="1..16"):
        skinny_linear(torch.zeros(17, 8), w)
    with pytest.raises(ValueError, match="expects 8"):
        skinny_linear(torch.zeros(2, 9), w)
    with pytest.raises(TypeError, match="cast"):
        skinny_linear(x.half(), w)
    with pytest.raises(ValueError, match=r"x \[B, M, K\]"):
        skinny_bmm(x, w)
    with pytest.raises(ValueError, match="expects 6"):
        skinny_bmm(torch.zeros(2, 3, 5), torch.zeros(2, 6, 4))
