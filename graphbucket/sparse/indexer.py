"""Indexer logits (DeepSeek-V3.2 lightning indexer, decode): a Triton split pass.

For query row r (one query token) with live length ``len_r`` and every position t < len_r::

    logits[r, t] = scale_t * sum_h w[r, h] * relu(q[r, h] . k_t)

q [rows, 64, 128] bf16 / fp16 (fp32 for tests), w [rows, 64] float32 (the indexer's head
weights, softmax scale folded in), k_t the stored e4m3 key of token t and scale_t its
float32 scale (``graphbucket/sparse/index_cache.py``). The scale is applied after the head
sum (relu(s x) = s relu(x) for s > 0), so the dot is a plain [BLOCK_N, 128] x [128, 64]
product on the tensor cores with tokens as rows (the head sum stays within a row).

q precision (``SparsePlan.indexer_fp8_q``):

- fp8 (the default, as DeepSeek-V3.2's own indexer): each program quantizes its row's q
  to e4m3 once, one scale per head (amax / 448, the keys' rule; host model:
  ``graphbucket.sparse.reference.quantize_index_q``), folds the scale into w and runs an
  fp8 x fp8 dot (sm_90: warpgroup MMA, q from shared memory).
- bf16: q as given, the key tile converted exactly to q's dtype before the dot: the more
  exact path (q not rounded), at the cost of a conversion per key element and twice the
  tensor-core work.

Latency, not bytes, bounded the first version: one key tile in flight per program (the
block-table lookup took one of the pipeliner's stages) and a synchronous load of each
tile's scales. Here the pages and the scales of tile i + 1 are loaded while tile i is in
flight, so ``num_stages - 1`` tiles of keys are copied ahead per program.

Grid (rows, splits): split s of row r takes the tiles of [0, len_r) that
``graphbucket.kernels.tiles.split_range`` gives it, so any split count is correct
for any live length and splits past the row's tiles exit at once. Only positions below the
row's length are written; the rest of the row is left as it was (the top-k reads the
length). Lengths are clamped to the logits buffer's width on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphbucket.fp8 import FP8_MAX, V32_MIN_SCALE
from graphbucket.kernels.tiles import split_range, tile_pages
from graphbucket.sparse.plan import SparsePlan
from graphbucket.sparse.rounding import round_to_e4m3


@triton.jit
def _quantize_rows_e4m3(x, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """float32 x [H, D] -> (e4m3 [H, D], float32 scale [H]): ``scale = max(amax / 448,
    2**-126)``, ``x * (1 / scale)`` rounded to the nearest e4m3 (one multiply per element;
    ``graphbucket.sparse.reference.quantize_index_q`` is the host model)."""
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 1), FP8_MAX), MIN_SCALE)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    return round_to_e4m3(x * inv[:, None]).to(tl.float8e4nv), scale


@triton.jit
def _indexer_logits_kernel(
    Q, W, K, K_SCALE, BLOCK_TABLE, SEQ_LENS, LOGITS,
    num_splits, num_heads, max_len,
    stride_q_r, stride_q_h, stride_w_r,
    stride_k_page, stride_k_tok, stride_s_page,
    stride_bt_r, stride_l_r,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
    FP8_Q: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    seq_len = tl.minimum(tl.load(SEQ_LENS + row), max_len)
    start, end = split_range(seq_len, split, num_splits, BLOCK_N)
    if start < end:
        bt_row = BLOCK_TABLE + row * stride_bt_r
        # the first lookup before q's load and quantization: their latencies overlap
        next_pages = tile_pages(bt_row, start, end, PAGE_SIZE, BLOCK_N, TILE_IN_PAGE)
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < num_heads
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + row * stride_q_r + offs_h[:, None] * stride_q_h + offs_d[None, :],
                    mask=mask_h[:, None], other=0.0)
        w = tl.load(W + row * stride_w_r + offs_h, mask=mask_h, other=0.0)
        if FP8_Q:
            q, q_scale = _quantize_rows_e4m3(q.to(tl.float32), FP8_MAX, MIN_SCALE)
            w = w * q_scale
        out_row = LOGITS + row.to(tl.int64) * stride_l_r
        offs_first = start + tl.arange(0, BLOCK_N)
        next_scale = tl.load(K_SCALE + next_pages * stride_s_page + offs_first % PAGE_SIZE,
                             mask=offs_first < end, other=0.0)
        for tok0 in range(start, end, BLOCK_N):
            # The pages of tile i + 1 are looked up during tile i: the lookup is then no
            # stage of the pipeline, and the copies get num_stages - 1 buffers.
            pages = next_pages
            next_pages = tile_pages(bt_row, tok0 + BLOCK_N, end, PAGE_SIZE, BLOCK_N,
                                    TILE_IN_PAGE, PAST_END=True)
            offs_n = tok0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            slot = offs_n % PAGE_SIZE
            k_row = pages * stride_k_page + slot * stride_k_tok  # [BLOCK_N] either way
            k = tl.load(K + k_row[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            if not FP8_Q:
                k = k.to(q.dtype)
            # The scales of tile i + 1 are loaded into registers during tile i (one float
            # a thread): no tile waits on a synchronous scale load. (Making them an
            # operand of the dot, so that the pipeliner copies them with the keys, cost
            # ~350 instructions per tile: 1.5x slower at batch 8, bench/NOTES.md.)
            scale = next_scale
            offs_next = offs_n + BLOCK_N
            next_scale = tl.load(K_SCALE + next_pages * stride_s_page + offs_next % PAGE_SIZE,
                                 mask=offs_next < end, other=0.0)
            dots = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
            logit = tl.sum(tl.maximum(dots, 0.0) * w[None, :], 1) * scale
            tl.store(out_row + offs_n, logit, mask=mask_n)


def launch_indexer_logits(index_q: torch.Tensor, index_weights: torch.Tensor,
                          index_cache: torch.Tensor, index_scales: torch.Tensor,
                          block_table: torch.Tensor, seq_lens: torch.Tensor,
                          logits: torch.Tensor, *, plan: SparsePlan) -> None:
    """Writes ``logits[r, :seq_lens[r]]`` for the plan's rows (unchecked: see
    ``graphbucket.sparse.decode.check_sparse_args``). Graph-safe: no device reads."""
    page_size = index_cache.shape[1]
    block_n = plan.indexer_block_n
    _indexer_logits_kernel[(plan.num_rows, plan.indexer_splits)](
        index_q, index_weights, index_cache, index_scales, block_table, seq_lens, logits,
        plan.indexer_splits, plan.index_heads, logits.shape[1],
        index_q.stride(0), index_q.stride(1), index_weights.stride(0),
        index_cache.stride(0), index_cache.stride(1), index_scales.stride(0),
        block_table.stride(0), logits.stride(0),
        PAGE_SIZE=page_size, HEAD_DIM=index_q.shape[2],
        BLOCK_H=triton.next_power_of_2(plan.index_heads), BLOCK_N=block_n,
        TILE_IN_PAGE=page_size % block_n == 0, FP8_Q=plan.indexer_fp8_q,
        DOT_PRECISION="ieee" if index_q.dtype == torch.float32 else "tf32",
        FP8_MAX=FP8_MAX, MIN_SCALE=V32_MIN_SCALE, num_warps=4,
        num_stages=plan.indexer_stages,
    )
