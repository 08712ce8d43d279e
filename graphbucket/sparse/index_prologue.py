"""The indexer's per-token prologue in two Triton kernels (DeepSeek-V3.2 sparse decode).

``store_index_prologue``, one program per token, from the fused projection
``kw = h @ W_ikw`` [T, 128 + 64]::

    key      = rotary64(RMSNorm(kw[:, :128]))   -> e4m3 row + float32 scale at the slot
    weights  = kw[:, 128:] / sqrt(64 x 128)     -> float32 [T, 64]

``rope_index_q_``, one program per token and 16 heads: the rotary of the first 64 dims of
each of the 64 index heads of ``q_a @ W_iq`` [T, 64 x 128], in place.

Both keep the rounding points of the torch path they replace (``models.sparse_mla``'s
``rope_first`` over ``models.ops.rms_norm``, then ``index_cache.quantize_index_keys``):
the norm's output and the rotary (float32, no fused multiply-adds: torch's separate
multiplies and adds) are rounded to the model dtype, then the key
is quantized in float32 with correctly rounded divisions (torch's), ``scale = max(amax /
448, 2**-126)``, ``clamp(key / scale, +-448)`` rounded to the nearest e4m3. They replace
~35 small torch kernels a layer: inside a CUDA graph each costs a few microseconds of
dependency latency, more than the bytes they move.

On the GPU the compiled ``ops.rms_norm`` folds one step of its sum of squares into a fused
multiply-add, which this kernel (compiled without them, for the rotary's sake) does not:
a key can then differ from the torch path by one rounding of the model dtype, rarely,
and so by one e4m3 step. In the interpreter both paths agree bit for bit (tested).

Rotary: half-split pairs over the first 64 dims, the model's rope table (cos halves, then
sin halves), positions clamped to the table on the device (``models.ops.rope_row``); the
padding rule is ``models.ops.token_slot``, the latent store's. Graph safety: host metadata
checks only; slots, lengths and positions are read on the device; nothing allocates but
the returned weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphbucket.fp8 import FP8_DTYPE, FP8_MAX, V32_MIN_SCALE
from graphbucket.sparse.index_cache import INDEX_DIM
from graphbucket.sparse.rounding import round_to, round_to_e4m3
from graphbucket.token_rows import rope_row, token_slot

ROPE_DIM = 64       # rotated dims of each index vector (the model's qk_rope_dim)
Q_HEADS_BLOCK = 16  # index-q heads per program


@triton.jit
def _normed(row, NORM_W, offs, inv):
    """RMSNorm of row[offs] (inv = 1 / rms of the row), rounded by the same plain cast as
    ``ops.rms_norm`` (the interpreter truncates to bfloat16 there too)."""
    x = tl.load(row + offs).to(tl.float32)
    y = x * inv * tl.load(NORM_W + offs).to(tl.float32)
    return y.to(row.dtype.element_ty).to(tl.float32)


@triton.jit
def _rotary(x1, x2, cs_row, offs_h, HALF: tl.constexpr, DTYPE: tl.constexpr):
    c = tl.load(cs_row + offs_h)
    s = tl.load(cs_row + HALF + offs_h)
    return (round_to(x1 * c - x2 * s, DTYPE).to(tl.float32),
            round_to(x2 * c + x1 * s, DTYPE).to(tl.float32))


@triton.jit
def _store_e4m3(dst, offs, k, scale, FP8_MAX: tl.constexpr):
    q = tl.minimum(tl.maximum(tl.math.div_rn(k, scale), -FP8_MAX), FP8_MAX)
    tl.store(dst + offs, round_to_e4m3(q).to(tl.float8e4nv))


@triton.jit
def _index_prologue_kernel(KW, NORM_W, ROPE, POS, SLOT, SEQ_LENS, ROWS, ROW_SCALES, WEIGHTS,
                           stride_kw, stride_rope, stride_w, num_slots, max_pos, q_len, eps,
                           weight_scale,
                           DIM: tl.constexpr, HALF: tl.constexpr, NUM_WEIGHTS: tl.constexpr,
                           FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    t = tl.program_id(0)
    row = KW + t * stride_kw
    # Padding tokens store at the scratch row past the cache.
    slot, valid = token_slot(SLOT, SEQ_LENS, t, q_len, num_slots)
    slot = tl.where(valid, slot, num_slots)
    # the row's rms over the whole key, reduced as ops.rms_norm reduces it
    x = tl.load(row + tl.arange(0, DIM)).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / DIM + eps)
    offs_h = tl.arange(0, HALF)
    offs_p = 2 * HALF + tl.arange(0, DIM - 2 * HALF)
    k1, k2 = _rotary(_normed(row, NORM_W, offs_h, inv), _normed(row, NORM_W, HALF + offs_h, inv),
                     rope_row(ROPE, POS, t, stride_rope, max_pos), offs_h, HALF,
                     KW.dtype.element_ty)
    kp = _normed(row, NORM_W, offs_p, inv)
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(k1), 0), tl.max(tl.abs(k2), 0)),
                      tl.max(tl.abs(kp), 0))
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)
    dst = ROWS + slot * DIM
    _store_e4m3(dst, offs_h, k1, scale, FP8_MAX)
    _store_e4m3(dst, HALF + offs_h, k2, scale, FP8_MAX)
    _store_e4m3(dst, offs_p, kp, scale, FP8_MAX)
    tl.store(ROW_SCALES + slot, scale)
    offs_w = tl.arange(0, NUM_WEIGHTS)
    w = tl.load(row + DIM + offs_w).to(tl.float32)
    tl.store(WEIGHTS + t * stride_w + offs_w, w * weight_scale)


def store_index_prologue(kw: torch.Tensor, k_norm: torch.Tensor, rope: torch.Tensor,
                         positions: torch.Tensor, slot_mapping: torch.Tensor,
                         seq_lens: torch.Tensor, index_rows: torch.Tensor,
                         index_row_scales: torch.Tensor, *, eps: float, q_len: int = 1
                         ) -> torch.Tensor:
    """Store each token's index key and return the indexer's head weights.

    kw [T, 128 + I] (the fused key | head-weight projection, model dtype, rows may be
    strided), k_norm [128], rope [max_position, 64] float32, positions [T] int64,
    slot_mapping [T] int64, seq_lens [T / q_len] int32; index_rows e4m3 [S + 1, 128] and
    index_row_scales float32 [S + 1]: the S cache rows (page * page_size + offset) and one
    scratch row. Tokens whose slot is negative or >= S, or whose request's seq_len is 0
    (padding), store at the scratch row. Returns weights float32 [T, I] =
    ``kw[:, 128:] * (I * 128) ** -0.5``. Graph-safe.
    """
    tokens, width = kw.shape
    num_weights = width - INDEX_DIM
    if index_rows.dtype != FP8_DTYPE or index_rows.dim() != 2 or index_rows.shape[1] != INDEX_DIM:
        raise ValueError(f"index_rows must be {FP8_DTYPE} [slots + 1, {INDEX_DIM}], got "
                         f"{index_rows.dtype} {tuple(index_rows.shape)}")
    if index_row_scales.dtype != torch.float32 or index_row_scales.shape != index_rows.shape[:1]:
        raise ValueError(f"index_row_scales must be float32 [{index_rows.shape[0]}], got "
                         f"{index_row_scales.dtype} {tuple(index_row_scales.shape)}")
    if num_weights < 1 or num_weights & (num_weights - 1) or rope.shape[1] != ROPE_DIM:
        raise ValueError(f"kw must be [T, {INDEX_DIM} + a power of two] and rope "
                         f"[max_position, {ROPE_DIM}], got {tuple(kw.shape)} and "
                         f"{tuple(rope.shape)}")
    assert kw.stride(1) == 1 and index_rows.is_contiguous() and rope.stride(1) == 1, \
        "rows must be dense"
    weights = torch.empty(tokens, num_weights, dtype=torch.float32, device=kw.device)
    _index_prologue_kernel[(tokens,)](
        kw, k_norm, rope, positions, slot_mapping, seq_lens, index_rows, index_row_scales,
        weights, kw.stride(0), rope.stride(0), weights.stride(0), index_rows.shape[0] - 1,
        rope.shape[0], q_len, eps, (num_weights * INDEX_DIM) ** -0.5,
        DIM=INDEX_DIM, HALF=ROPE_DIM // 2, NUM_WEIGHTS=num_weights, FP8_MAX=FP8_MAX,
        MIN_SCALE=V32_MIN_SCALE, num_warps=4, enable_fp_fusion=False)
    return weights


@triton.jit
def _rope_q_kernel(Q, ROPE, POS, stride_q, stride_rope, max_pos,
                   DIM: tl.constexpr, HALF: tl.constexpr, HEADS: tl.constexpr):
    t = tl.program_id(0)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    offs_h = tl.arange(0, HALF)
    src = Q + t * stride_q + heads[:, None] * DIM + offs_h[None, :]
    x1 = tl.load(src).to(tl.float32)
    x2 = tl.load(src + HALF).to(tl.float32)
    cs_row = rope_row(ROPE, POS, t, stride_rope, max_pos)
    c = tl.load(cs_row + offs_h)[None, :]
    s = tl.load(cs_row + HALF + offs_h)[None, :]
    tl.store(src, round_to(x1 * c - x2 * s, Q.dtype.element_ty))
    tl.store(src + HALF, round_to(x2 * c + x1 * s, Q.dtype.element_ty))


def rope_index_q_(q: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor
                  ) -> torch.Tensor:
    """Rotate the first 64 dims of each 128-wide head of q [T, H x 128] in place (model
    dtype, rows may be strided, heads dense) -> the view [T, H, 128]. H a multiple of 16;
    rope and positions as ``store_index_prologue``. Graph-safe."""
    tokens, width = q.shape
    heads = width // INDEX_DIM
    if width % INDEX_DIM or heads % Q_HEADS_BLOCK or rope.shape[1] != ROPE_DIM:
        raise ValueError(f"q must be [T, H x {INDEX_DIM}] with H a multiple of "
                         f"{Q_HEADS_BLOCK} and rope [max_position, {ROPE_DIM}], got "
                         f"{tuple(q.shape)} and {tuple(rope.shape)}")
    assert q.stride(1) == 1 and rope.stride(1) == 1, "rows must be dense"
    _rope_q_kernel[(tokens, heads // Q_HEADS_BLOCK)](
        q, rope, positions, q.stride(0), rope.stride(0), rope.shape[0],
        DIM=INDEX_DIM, HALF=ROPE_DIM // 2, HEADS=Q_HEADS_BLOCK, num_warps=4,
        enable_fp_fusion=False)
    return q.view(tokens, heads, INDEX_DIM)
