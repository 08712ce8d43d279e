"""Tile-level building blocks of the MLA decode kernels: each split's token range, the page
lookup, the loads of q and of cache rows in every cache format (fp8 dequantization
included), and the stores of a request's final output.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Each program derives its token range from ``seq_lens`` on the device, so the split count
# is a runtime argument and a graph captured with any plan stays correct at any live length:
#
#     tiles_per_split = cdiv(cdiv(seq_len, BLOCK_N), num_kv_splits)
#     start(s) = s * tiles_per_split * BLOCK_N
#     split s covers [start(s), min(start(s) + tiles_per_split * BLOCK_N, seq_len))
#
# Splits that get no tokens exit at once; the merges recompute the same formula
# (``active_splits``), so they read only partials that stage 1 wrote.


@triton.jit
def split_range(seq_len, split, num_kv_splits, BLOCK_N: tl.constexpr):
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_kv_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    return start, end


@triton.jit
def active_splits(seq_len, num_kv_splits, BLOCK_N: tl.constexpr):
    """How many splits get tokens (the others exit at once and write nothing)."""
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_kv_splits), 1)
    return tl.cdiv(num_tiles, tiles_per_split)


@triton.jit
def tile_pages(bt_row, tok0, end, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
               TILE_IN_PAGE: tl.constexpr, PAST_END: tl.constexpr = False):
    """Cache pages of tokens tok0 .. tok0 + BLOCK_N: one scalar when the tile sits in one
    page (TILE_IN_PAGE), else one per token. Entries at or past ``end`` read as page 0
    (their rows are masked); PAST_END: tok0 may be past ``end`` (the lookup ahead of the
    last tile), so the scalar lookup is masked too."""
    if TILE_IN_PAGE:
        # Tiles start at multiples of BLOCK_N, so the whole tile sits in one page:
        # one scalar table load, and the tile is one contiguous run of cache rows.
        if PAST_END:
            page = tl.load(bt_row + tok0 // PAGE_SIZE, mask=tok0 < end, other=0)
        else:
            page = tl.load(bt_row + tok0 // PAGE_SIZE)
    else:
        offs_n = tok0 + tl.arange(0, BLOCK_N)
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=offs_n < end, other=0)
    return page.to(tl.int64)


@triton.jit
def load_q(Q, bid, offs_h, mask_h, stride_q_b, stride_q_h,
           KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr):
    q_row = Q + bid * stride_q_b + offs_h[:, None] * stride_q_h
    q_nope = tl.load(q_row + tl.arange(0, KV_LORA_RANK)[None, :], mask=mask_h[:, None],
                     other=0.0)
    q_rope = tl.load(q_row + KV_LORA_RANK + tl.arange(0, ROPE_DIM)[None, :],
                     mask=mask_h[:, None], other=0.0)
    return q_nope, q_rope


# Cache formats (the KV_FORMAT constexpr); a cache row is [kv_lora_rank latent | qk_rope_dim
# rope]. "dense": rows of the cache's dtype (bf16 / fp16 / fp32, or per-tensor fp8 e4m3
# whose scale the stage-1 kernels apply to scores and output). "v32": DeepSeek-V3.2's
# 656-byte rows in a uint8 cache (``graphbucket.fp8``: e4m3 latent at bytes 0..511, one
# float32 scale per 128 latent values at 512..527, bf16 rope at 528..655), read through
# reinterpreted pointers (strides in bytes, multiples of 16: the launcher checks) and
# dequantized by their group scales before the dots.
V32_GROUP = tl.constexpr(128)  # latent values per float32 scale in a "v32" row


@triton.jit
def load_latent(KV, row, mask_n, KV_LORA_RANK: tl.constexpr, BLOCK_N: tl.constexpr,
                KV_FORMAT: tl.constexpr, EVICTION: tl.constexpr):
    """The latent [BLOCK_N, R] of cache rows at element offsets ``row`` (masked rows: zeros).
    "dense": the cache's dtype; "v32": float32, the e4m3 values times their group scales."""
    offs_c = tl.arange(0, KV_LORA_RANK)
    if KV_FORMAT == "v32":
        kv = tl.load(KV.to(tl.pointer_type(tl.float8e4nv)) + row[:, None] + offs_c[None, :],
                     mask=mask_n[:, None], other=0.0, eviction_policy=EVICTION)
        GROUPS: tl.constexpr = KV_LORA_RANK // V32_GROUP
        # float32 scales at byte R: row offsets in float32 units (rows are 16-byte aligned).
        scale_row = tl.multiple_of(row // 4, 4)
        scale = tl.load((KV + KV_LORA_RANK).to(tl.pointer_type(tl.float32))
                        + scale_row[:, None] + tl.arange(0, GROUPS)[None, :],
                        mask=mask_n[:, None], other=0.0, eviction_policy=EVICTION)
        kv = tl.reshape(kv.to(tl.float32), [BLOCK_N, GROUPS, V32_GROUP]) * scale[:, :, None]
        kv = tl.reshape(kv, [BLOCK_N, KV_LORA_RANK])
    else:
        kv = tl.load(KV + row[:, None] + offs_c[None, :], mask=mask_n[:, None], other=0.0,
                     eviction_policy=EVICTION)
    return kv


@triton.jit
def load_kv_rows(KV, row, mask_n, KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
                 BLOCK_N: tl.constexpr, KV_FORMAT: tl.constexpr = "dense"):
    """Cache rows at element offsets ``row`` (any rows: a tile or a gather): (latent
    [BLOCK_N, R], rope [BLOCK_N, ROPE_DIM]); masked rows load as zeros."""
    kv = load_latent(KV, row, mask_n, KV_LORA_RANK, BLOCK_N, KV_FORMAT, "")
    if KV_FORMAT == "v32":
        # bf16 rope after the latent and the scales: row offsets in bf16 units.
        rope_row = tl.multiple_of(row // 2, 8)
        k_rope = tl.load((KV + KV_LORA_RANK + 4 * (KV_LORA_RANK // V32_GROUP))
                         .to(tl.pointer_type(tl.bfloat16))
                         + rope_row[:, None] + tl.arange(0, ROPE_DIM)[None, :],
                         mask=mask_n[:, None], other=0.0)
    else:
        k_rope = tl.load(KV + row[:, None] + KV_LORA_RANK + tl.arange(0, ROPE_DIM)[None, :],
                         mask=mask_n[:, None], other=0.0)
    return kv, k_rope


@triton.jit
def load_tile_rows(KV, pages, tok0, end, stride_kv_page, stride_kv_tok,
                   PAGE_SIZE: tl.constexpr, KV_LORA_RANK: tl.constexpr,
                   ROPE_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   KV_FORMAT: tl.constexpr = "dense"):
    """Tokens tok0 .. tok0 + BLOCK_N on ``pages`` (``tile_pages``): (latent [BLOCK_N, R],
    rope [BLOCK_N, ROPE_DIM], live mask); rows at or past ``end`` load as zeros. A "v32"
    cache gives the dequantized latent in float32 and the rope in bf16."""
    offs_n = tok0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    row = pages * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_tok
    kv, k_rope = load_kv_rows(KV, row, mask_n, KV_LORA_RANK, ROPE_DIM, BLOCK_N, KV_FORMAT)
    return kv, k_rope, mask_n


@triton.jit
def load_tile(KV, bt_row, tok0, end, stride_kv_page, stride_kv_tok,
              PAGE_SIZE: tl.constexpr, KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
              BLOCK_N: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
              KV_FORMAT: tl.constexpr = "dense"):
    """Tokens tok0 .. tok0 + BLOCK_N of one request: (latent [BLOCK_N, R], rope
    [BLOCK_N, ROPE_DIM], live mask); rows at or past ``end`` load as zeros."""
    pages = tile_pages(bt_row, tok0, end, PAGE_SIZE, BLOCK_N, TILE_IN_PAGE)
    return load_tile_rows(KV, pages, tok0, end, stride_kv_page, stride_kv_tok, PAGE_SIZE,
                          KV_LORA_RANK, ROPE_DIM, BLOCK_N, KV_FORMAT)


@triton.jit
def load_raw_tile(KV, pages, tok0, end, stride_kv_page, stride_kv_tok,
                  PAGE_SIZE: tl.constexpr, KV_LORA_RANK: tl.constexpr,
                  ROPE_DIM: tl.constexpr, BLOCK_N: tl.constexpr, KV_FORMAT: tl.constexpr,
                  RAW_VEC: tl.constexpr = 0):
    """The stored bytes of tokens tok0 .. tok0 + BLOCK_N (zeros at or past ``end``):
    (latent [BLOCK_N, R] in e4m3, group scales [BLOCK_N, R / 128] ("v32"; else a
    placeholder), rope [BLOCK_N, ROPE_DIM] as stored)."""
    offs_n = tok0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    row = pages * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_tok
    offs_c = tl.arange(0, KV_LORA_RANK)
    if RAW_VEC > 0:
        offs_c = tl.max_contiguous(offs_c, RAW_VEC)
    if KV_FORMAT == "v32":
        raw = tl.load(KV.to(tl.pointer_type(tl.float8e4nv)) + row[:, None] + offs_c[None, :],
                      mask=mask_n[:, None], other=0.0)
        scale = tl.load((KV + KV_LORA_RANK).to(tl.pointer_type(tl.float32))
                        + tl.multiple_of(row // 4, 4)[:, None]
                        + tl.arange(0, KV_LORA_RANK // V32_GROUP)[None, :],
                        mask=mask_n[:, None], other=0.0)
        rope = tl.load((KV + KV_LORA_RANK + 4 * (KV_LORA_RANK // V32_GROUP))
                       .to(tl.pointer_type(tl.bfloat16))
                       + tl.multiple_of(row // 2, 8)[:, None] + tl.arange(0, ROPE_DIM)[None, :],
                       mask=mask_n[:, None], other=0.0)
    else:
        raw = tl.load(KV + row[:, None] + offs_c[None, :], mask=mask_n[:, None], other=0.0)
        scale = 0.0
        rope = tl.load(KV + row[:, None] + KV_LORA_RANK + tl.arange(0, ROPE_DIM)[None, :],
                       mask=mask_n[:, None], other=0.0)
    return raw, scale, rope


# e4m3 -> fp16 on the integer pipe (DEQUANT "bits"): four bytes of a 32-bit register
# become two f16x2 registers. Each byte b is placed at bits 14..7 of its half (prmt moves it
# to bits 15..8, the shift to 14..7), then the sign is carried from bit 14 to bit 15 by
# adding the half's bit 14 to itself. The half is then sign | 0 eeee | mmm 0000000: the
# e4m3 value times 2^-8 exactly, subnormals included (both formats put the subnormal
# binade at their exponent field 0); e4m3's NaN code (never written by graphbucket's
# saturating quantizer) reads as 480. Eight integer instructions a word, against the
# e4m3 -> f32 -> bf16 conversions' two conversion-pipe instructions per value.
_BITS = """
prmt.b32 a, $2, 0, 0x1404;
prmt.b32 b, $2, 0, 0x3424;
shr.b32 a, a, 1;
shr.b32 b, b, 1;
and.b32 $0, a, 0x40004000;
and.b32 $1, b, 0x40004000;
add.u32 $0, a, $0;
add.u32 $1, b, $1;"""
# The same on the conversion pipe (DEQUANT "cvt", sm_89+): exact e4m3 values, one
# instruction per two values.
_CVT = """
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;"""
# Then times a per-value f16 scale (the "v32" group scales, broadcast).
_SCALE = """
mul.rn.f16x2 $0, $0, $3;
mul.rn.f16x2 $1, $1, $4;"""
_BITS_REGS, _CVT_REGS = "{\n.reg .b32 a, b;", "{\n.reg .b16 lo, hi;"
E4M3_BITS_TO_F16 = tl.constexpr(_BITS_REGS + _BITS + "\n}")
E4M3_BITS_TO_F16_SCALED = tl.constexpr(_BITS_REGS + _BITS + _SCALE + "\n}")
E4M3_CVT_TO_F16 = tl.constexpr(_CVT_REGS + _CVT + "\n}")
E4M3_CVT_TO_F16_SCALED = tl.constexpr(_CVT_REGS + _CVT + _SCALE + "\n}")
# What one stored e4m3 unit reads as in f16 in the "bits" mode.
E4M3_UNIT_BITS = tl.constexpr(1.0 / 256.0)


@triton.jit
def e4m3_to_f16(raw, DEQUANT: tl.constexpr, scale=None):
    """e4m3 values (any tensor of float8e4nv / uint8) as float16: the stored value times
    the mode's unit ("bits": 2^-8, "cvt": 1), times ``scale`` (float16, raw's shape) if
    given."""
    bits = raw.to(tl.uint8, bitcast=True)
    if scale is None:
        out = tl.inline_asm_elementwise(
            E4M3_BITS_TO_F16 if DEQUANT == "bits" else E4M3_CVT_TO_F16, "=r,=r,r", [bits],
            dtype=tl.float16, is_pure=True, pack=4)
    else:
        out = tl.inline_asm_elementwise(
            E4M3_BITS_TO_F16_SCALED if DEQUANT == "bits" else E4M3_CVT_TO_F16_SCALED,
            "=r,=r,r,r,r", [bits, scale], dtype=tl.float16, is_pure=True, pack=4)
    return out


@triton.jit
def _dequantize(raw, scale, BLOCK_N: tl.constexpr, KV_LORA_RANK: tl.constexpr,
                KV_FORMAT: tl.constexpr, DEQUANT: tl.constexpr = "float"):
    """``load_raw_tile``'s latent as values ("v32": times the group scales; a per-tensor
    scale is applied by the caller). DEQUANT "float": float32 through the conversion
    instructions (the interpreter's path). "bits" / "cvt": float16 from ``e4m3_to_f16``
    (per-tensor: in that mode's unit; "v32": the values themselves, the unit folded into
    the scales; latent values must then lie within float16's range, |v| <= 65504)."""
    if DEQUANT == "float":
        kv = raw.to(tl.float32)
        if KV_FORMAT == "v32":
            GROUPS: tl.constexpr = KV_LORA_RANK // V32_GROUP
            kv = tl.reshape(kv, [BLOCK_N, GROUPS, V32_GROUP]) * scale[:, :, None]
            kv = tl.reshape(kv, [BLOCK_N, KV_LORA_RANK])
    elif KV_FORMAT == "v32":
        GROUPS: tl.constexpr = KV_LORA_RANK // V32_GROUP
        unit: tl.constexpr = E4M3_UNIT_BITS if DEQUANT == "bits" else 1.0
        scale16 = (scale * (1.0 / unit)).to(tl.float16)
        raw3 = tl.reshape(raw, [BLOCK_N, GROUPS, V32_GROUP])
        kv = e4m3_to_f16(raw3, DEQUANT,
                         tl.broadcast_to(scale16[:, :, None], [BLOCK_N, GROUPS, V32_GROUP]))
        kv = tl.reshape(kv, [BLOCK_N, KV_LORA_RANK])
    else:
        kv = e4m3_to_f16(raw, DEQUANT)
    return kv


@triton.jit
def dequantize_tile(raw_tile, dtype, rope_dtype, BLOCK_N: tl.constexpr,
                    KV_LORA_RANK: tl.constexpr, KV_FORMAT: tl.constexpr,
                    DEQUANT: tl.constexpr):
    """``load_raw_tile``'s (latent, scales, rope) as the dots' operands: (latent in
    ``dtype``, rope in ``rope_dtype``), per ``_dequantize``."""
    raw, scale, rope = raw_tile
    kv = _dequantize(raw, scale, BLOCK_N, KV_LORA_RANK, KV_FORMAT, DEQUANT).to(dtype)
    if DEQUANT != "float" and KV_FORMAT == "dense":
        k_rope = e4m3_to_f16(rope, DEQUANT)
    else:
        k_rope = rope.to(rope_dtype)
    return kv, k_rope


@triton.jit
def store_final(o_ptr, lse_ptr, out, lse_log2, mask_h, WRITE_LSE: tl.constexpr):
    """The request's output [BLOCK_H, R] at o_ptr and, if asked, its natural-log LSE."""
    tl.store(o_ptr, out.to(o_ptr.dtype.element_ty), mask=mask_h[:, None])
    if WRITE_LSE:
        # LSEs stay in log2 units between the stages; 0.693.. = ln 2 converts the final one.
        tl.store(lse_ptr, lse_log2 * 0.6931471805599453, mask=mask_h)


@triton.jit
def store_padding(o_ptr, lse_ptr, mask_h, BLOCK_H: tl.constexpr, KV_LORA_RANK: tl.constexpr,
                  WRITE_LSE: tl.constexpr):
    """A padding row (seq_len == 0): zeros and an empty-sum LSE."""
    tl.store(o_ptr, tl.zeros([BLOCK_H, KV_LORA_RANK], dtype=o_ptr.dtype.element_ty),
             mask=mask_h[:, None])
    if WRITE_LSE:
        tl.store(lse_ptr, tl.full([BLOCK_H], float("-inf"), dtype=tl.float32), mask=mask_h)
