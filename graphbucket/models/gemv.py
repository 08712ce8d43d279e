"""Skinny matrix products for decode batch sizes: y = x W^T with x of at most 16 rows.

At batch 1-16 a decoder's projections are weight streams: every weight byte is read once
per step and each feeds at most 16 multiply-adds; library GEMMs pick tiles for larger M.
Here the weight is the MMA's M side: each program owns BLOCK_N output columns, streams
their weight rows through a pipelined loop over K, and multiplies them with the
(zero-padded) 16-row activation tile on the tensor cores.

Measured on the H200 (bench/results/archive/h200-projections.md, DeepSeek-V3 TP8 layer, cold L2):
the per-head absorbed products (16 x 128 x 512) run 1.1-1.2x faster than ``torch.bmm``
(~0.76 against ~0.64 TB/s); the large projections run 1.1-1.6x slower than cuBLAS
(1.3-2.2 against 1.6-3.1 TB/s: one 16-row program per SM and too few bytes in flight for
the 2112-column projection, a partial second wave for the 4608-column one). The model
therefore uses these for the absorbed products only (``MLADecoder(projections="auto")``).

``skinny_bmm(x, w)`` is ``torch.bmm(x, w)`` (one weight matrix per batch entry, e.g. per
head). It takes any strides, accumulates in float32, writes the input dtype, allocates only
its output and launches one kernel with a grid fixed by the shapes (graph-safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # the activation tile is the MMA's N side: 16 rows, zero-padded


@triton.jit
def _skinny_kernel(X, W, Y, M, N, K,
                   stride_xb, stride_xm, stride_xk,
                   stride_wb, stride_wn, stride_wk,
                   stride_yb, stride_ym, stride_yn,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n, mask_m = offs_n < N, offs_m < M
    w_ptr = W + b * stride_wb + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    x_ptr = X + b * stride_xb + offs_m[None, :] * stride_xm + offs_k[:, None] * stride_xk
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k + k0 < K
        w = tl.load(w_ptr, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_ptr, mask=mask_k[:, None] & mask_m[None, :], other=0.0)
        if IEEE:  # float32 weights: full precision, not TF32
            acc = tl.dot(w, x, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc)
        w_ptr += BLOCK_K * stride_wk
        x_ptr += BLOCK_K * stride_xk
    y_ptr = Y + b * stride_yb + offs_m[None, :] * stride_ym + offs_n[:, None] * stride_yn
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


def _blocks(n: int, k: int, k_contiguous: bool) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): long K runs per weight row when K is contiguous (16 rows x 512),
    wide N runs when N is (64 columns x 128)."""
    if k_contiguous:
        return 16, min(512, max(16, triton.next_power_of_2(k)))
    return 64, min(128, max(16, triton.next_power_of_2(k)))


def _launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, *, n: int, k: int,
            x_strides, w_strides, y_strides, batch: int) -> torch.Tensor:
    block_n, block_k = _blocks(n, k, w_strides[2] == 1)
    grid = (triton.cdiv(n, block_n), batch)
    _skinny_kernel[grid](x, w, y, x.shape[-2], n, k, *x_strides, *w_strides, *y_strides,
                         BLOCK_N=block_n, BLOCK_K=block_k, IEEE=w.dtype == torch.float32,
                         num_warps=4, num_stages=4)
    return y


def _check(name: str, x: torch.Tensor, w: torch.Tensor, rows: int, k_x: int, k_w: int) -> None:
    if x.dtype != w.dtype:
        raise TypeError(f"{name}: x is {x.dtype} but w is {w.dtype}; cast one of them")
    if x.device != w.device:
        raise ValueError(f"{name}: x is on {x.device} but w on {w.device}")
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"{name}: x has {rows} rows; skinny products take 1..{MAX_ROWS} "
                         "(use torch.matmul for larger batches)")
    if k_x != k_w:
        raise ValueError(f"{name}: x has {k_x} columns but w expects {k_w}")


def skinny_bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(x, w)`` for x [B, M <= 16, K], w [B, K, N]; returns [B, M, N]."""
    if x.dim() != 3 or w.dim() != 3 or x.shape[0] != w.shape[0]:
        raise ValueError(f"skinny_bmm takes x [B, M, K] and w [B, K, N], got "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")
    _check("skinny_bmm", x, w, x.shape[1], x.shape[2], w.shape[1])
    b, m, k = x.shape
    n = w.shape[2]
    y = torch.empty(b, m, n, dtype=x.dtype, device=x.device)
    sw = w.stride()
    return _launch(x, w, y, n=n, k=k, batch=b, x_strides=x.stride(),
                   w_strides=(sw[0], sw[2], sw[1]), y_strides=y.stride())
