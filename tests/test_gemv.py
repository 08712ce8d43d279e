"""Skinny products (decode-batch projections) against float64 torch, through the Triton
interpreter on CPU (fp16 / fp32) and natively on CUDA (bf16 too)."""

from __future__ import annotations

import pytest
import torch

from graphbucket.models.gemv import skinny_bmm

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16, torch.float32]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b, m, k, n", [(1, 1, 300, 40), (2, 8, 64, 16), (3, 16, 520, 33)])
def test_bmm_with_k_contiguous_weights_matches_float64(seeded, dtype, b, m, k, n):
    # w stored [B, N, K] and viewed [B, K, N]: the long-K tile shape
    x = torch.randn(b, m, k, device=DEVICE).to(dtype)
    w = torch.randn(b, n, k, device=DEVICE).to(dtype).transpose(1, 2)
    y = skinny_bmm(x, w)
    assert y.shape == (b, m, n) and y.dtype == dtype
    assert rel_l2(y, torch.bmm(x.double(), w.double())) < TOL[dtype]


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
    w = torch.zeros(1, 8, 4)
    with pytest.raises(ValueError, match="1..16"):
        skinny_bmm(torch.zeros(1, 17, 8), w)
    with pytest.raises(TypeError, match="cast"):
        skinny_bmm(torch.zeros(1, 2, 8).half(), w)
    with pytest.raises(ValueError, match=r"x \[B, M, K\]"):
        skinny_bmm(torch.zeros(2, 8), w)
    with pytest.raises(ValueError, match="expects 6"):
        skinny_bmm(torch.zeros(2, 3, 5), torch.zeros(2, 6, 4))
