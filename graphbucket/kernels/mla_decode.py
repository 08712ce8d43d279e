"""Split-KV MLA decode over a paged latent KV cache (absorbed MLA, DeepSeek-V3 / Kimi shapes).

Algorithm: flash-decoding. Stage 1 runs one program per (request, head block, KV split);
each program streams its share of the request's tokens through an online softmax and
writes a normalised partial output plus its log-sum-exp. Stage 2 merges the partials of
a request with a blocked LSE merge (BLOCK_S splits per step, not one split at a time).
With one split, stage 1 writes the final output and stage 2 is not launched. With a fused
merge (few splits per request) there is no stage 2 either: each request's last split to
finish, counted by an atomic per (request, head block) in the workspace, merges the
partials itself and resets the counter for the next launch.

MLA specifics: the cache row is [kv_lora_rank latent | qk_rope_dim rope]; K is the whole
row and V is its first kv_lora_rank columns, so each KV tile is loaded once and used for
both dots. All heads share the single latent KV head, so BLOCK_H heads ride one tile. float32
caches multiply in IEEE float32 (``DOT_PRECISION="ieee"``), not TF32: a float32 cache is
asked for precision, and TF32 gave ~1e-3 relative error against float64 on the H200.

Cache formats (the KV_FORMAT constexpr): "dense" rows of the cache's dtype (bf16 / fp16 /
fp32, or per-tensor fp8 e4m3 whose scale the stage-1 kernels apply to scores and output),
and "v32", DeepSeek-V3.2's 656-byte rows in a uint8 cache (``graphbucket.fp8``: e4m3
latent at bytes 0..511, one float32 scale per 128 latent values at 512..527, bf16 rope at
528..655). A "v32" tile is read through reinterpreted pointers (strides in bytes, multiples
of 16: the launcher checks) and its latent is dequantized by its group scales before the
dots.

The split count is a runtime argument: a graph captured with any plan stays correct for
any live length. Each program derives its token range from ``seq_lens`` on the device:

    tiles_per_split = cdiv(cdiv(seq_len, BLOCK_N), num_kv_splits)
    start(s) = s * tiles_per_split * BLOCK_N
    split s covers [start(s), min(start(s) + tiles_per_split * BLOCK_N, seq_len))

Splits that get no tokens exit at once; stage 2 recomputes the same formula, so it only
reads partials that stage 1 wrote. Rows with ``seq_len == 0`` (padding) produce zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _split_range(seq_len, split, num_kv_splits, BLOCK_N: tl.constexpr):
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_kv_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    return start, end


@triton.jit
def _active_splits(seq_len, num_kv_splits, BLOCK_N: tl.constexpr):
    """How many splits get tokens (the others exit at once and write nothing)."""
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_kv_splits), 1)
    return tl.cdiv(num_tiles, tiles_per_split)


@triton.jit
def _load_q(Q, bid, offs_h, mask_h, stride_q_b, stride_q_h,
            KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr):
    q_row = Q + bid * stride_q_b + offs_h[:, None] * stride_q_h
    q_nope = tl.load(q_row + tl.arange(0, KV_LORA_RANK)[None, :], mask=mask_h[:, None],
                     other=0.0)
    q_rope = tl.load(q_row + KV_LORA_RANK + tl.arange(0, ROPE_DIM)[None, :],
                     mask=mask_h[:, None], other=0.0)
    return q_nope, q_rope


@triton.jit
def _softmax_tile(q_nope, q_rope, kv, k_rope, kv_v, live, acc, l_i, m_i, qk_scale_log2,
                  DOT_PRECISION: tl.constexpr, MAY_BE_EMPTY: tl.constexpr):
    """One tile of the online softmax, head-major, in log2 units: the scores of the
    ``live`` (row, token) pairs (a mask that broadcasts to [rows, BLOCK_N]), then (acc, l,
    m) carried over. MAY_BE_EMPTY: a row may have no live token yet; its max stays -inf
    and is kept out of the exponents (its acc and l stay 0)."""
    qk = tl.dot(q_nope, tl.trans(kv), input_precision=DOT_PRECISION)
    qk += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
    qk = tl.where(live, qk * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if MAY_BE_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(kv_v.dtype), kv_v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_tokens(
    q_nope, q_rope, KV, bt_row, start, end, qk_scale_log2,
    stride_kv_page, stride_kv_tok,
    PAGE_SIZE: tl.constexpr,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TOKEN_MAJOR: tl.constexpr = False,
    PAGE_AHEAD: tl.constexpr = False,
    KV_FORMAT: tl.constexpr = "dense",
    row_limit=None,
    MULTI_TOKEN: tl.constexpr = False,
    REG_PREFETCH: tl.constexpr = False,
    DEQUANT: tl.constexpr = "float",
    RAW_VEC: tl.constexpr = 0,
):
    """Online softmax over tokens [start, end) of one request (start < end, start a
    multiple of BLOCK_N). Returns the unnormalised (acc [BLOCK_H, R], l, m) in log2 units.

    MULTI_TOKEN: the rows are query tokens x heads, each row attending to the tokens
    before its own ``row_limit`` (causal among a verify step's tokens); a row may see no
    token of this range (then l = 0, m = -inf, acc = 0).

    TOKEN_MAJOR computes the transposed products, S^T = KV Q^T and O^T += KV^T P^T: the
    tile's token dimension becomes the dots' row dimension (64 rows, where the heads give
    only 16), so on Hopper both dots run as warpgroup MMAs that read the KV tile straight
    from shared memory, and the compiler double-buffers the tile's asynchronous copy. The
    head-major form reads the transposed tile from shared memory as well (ldmatrix).

    How many tiles are in flight is set by the page lookup, not by the layout: Triton's
    pipeliner splits the num_stages - 1 iterations of lookahead between the two dependent
    loads (block-table entry, then the tile it addresses), so num_stages 2-4 give one tile
    buffer (the copy of tile i+1 waits for tile i's math) and 5 gives two, with the
    table entries copied asynchronously as well. PAGE_AHEAD looks the pages of tile i+1 up
    while tile i is loaded (a loop-carried value, not a dependent load), so the tile gets
    num_stages - 1 buffers; the lookup itself is then a synchronous load before each
    tile's copy is issued.

    REG_PREFETCH (fp8 caches, head-major): the raw bytes of tile i+1 are loaded into
    registers while tile i is multiplied, then dequantized once into the 16-bit tile that
    both dots read from shared memory and that the loop carries to the next iteration.
    Without it the fp8 tile is copied to shared memory as is and the value dot reads it
    transposed, which for 1-byte elements is one shared-memory load per byte (sm_90 has
    no 8-bit ldmatrix.trans).
    DEQUANT (with REG_PREFETCH): "float" converts through float32 into q's dtype; "bits" /
    "cvt" read the tile as float16 (``_dequantize``), q is converted to float16 once and
    both dots run in float16 (exact for every e4m3 value; p in [0, 1] keeps 11 bits).
    """
    if TOKEN_MAJOR:
        return _attend_tokens_token_major(
            q_nope, q_rope, KV, bt_row, start, end, qk_scale_log2, stride_kv_page,
            stride_kv_tok, PAGE_SIZE, KV_LORA_RANK, ROPE_DIM, BLOCK_H, BLOCK_N, TILE_IN_PAGE,
            DOT_PRECISION, KV_FORMAT)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, KV_LORA_RANK], dtype=tl.float32)
    F16_TILES: tl.constexpr = REG_PREFETCH and DEQUANT != "float"
    if F16_TILES:
        q_nope = q_nope.to(tl.float16)
        if KV_FORMAT == "dense":  # the rope is e4m3 too ("v32" keeps it in bf16)
            q_rope = q_rope.to(tl.float16)
            if DEQUANT == "bits":  # tiles read as value * 2^-8: scores 2^8 x too small
                qk_scale_log2 = qk_scale_log2 * (1.0 / E4M3_UNIT_BITS)
    if REG_PREFETCH:
        next_kv, next_rope = _dequantize_tile(
            _load_raw_tile(KV, _tile_pages(bt_row, start, end, PAGE_SIZE, BLOCK_N, TILE_IN_PAGE),
                           start, end, stride_kv_page, stride_kv_tok, PAGE_SIZE, KV_LORA_RANK,
                           ROPE_DIM, BLOCK_N, KV_FORMAT, RAW_VEC),
            q_nope.dtype, q_rope.dtype, BLOCK_N, KV_LORA_RANK, KV_FORMAT, DEQUANT)
    elif PAGE_AHEAD:
        next_pages = _tile_pages(bt_row, start, end, PAGE_SIZE, BLOCK_N, TILE_IN_PAGE)

    for tok0 in range(start, end, BLOCK_N):
        if REG_PREFETCH:
            # The next tile's bytes are loaded now and dequantized after this tile's dots,
            # so the load overlaps them and the loop carries the converted tile (packed
            # 16-bit values; carrying the raw bytes kept one register per byte).
            kv, k_rope = next_kv, next_rope
            kv_v = kv
            mask_n = tok0 + tl.arange(0, BLOCK_N) < end
            next_raw = _load_raw_tile(
                KV, _tile_pages(bt_row, tok0 + BLOCK_N, end, PAGE_SIZE, BLOCK_N, TILE_IN_PAGE,
                                PAST_END=True),
                tok0 + BLOCK_N, end, stride_kv_page, stride_kv_tok, PAGE_SIZE, KV_LORA_RANK,
                ROPE_DIM, BLOCK_N, KV_FORMAT, RAW_VEC)
        else:
            if PAGE_AHEAD:
                pages = next_pages
                next_pages = _tile_pages(bt_row, tok0 + BLOCK_N, end, PAGE_SIZE, BLOCK_N,
                                         TILE_IN_PAGE, PAST_END=True)
            else:
                pages = _tile_pages(bt_row, tok0, end, PAGE_SIZE, BLOCK_N, TILE_IN_PAGE)
            kv, k_rope, mask_n = _load_tile_rows(KV, pages, tok0, end, stride_kv_page,
                                                 stride_kv_tok, PAGE_SIZE, KV_LORA_RANK,
                                                 ROPE_DIM, BLOCK_N, KV_FORMAT)
            # An fp8 cache dequantizes on the way in (a per-tensor scale is applied by
            # the caller, V3.2 group scales by the loader); a no-op for q's dtype.
            kv_v = kv.to(q_nope.dtype)
            if KV.dtype.element_ty != q_nope.dtype and KV_FORMAT == "dense":
                # A converted tile feeding two dots stays in registers (no shared-memory
                # pipeline); reading it once per dot lets each copy be pipelined.
                # (A different cache hint keeps the compiler from merging the two loads.)
                # Not for "v32": its scaled tile is not a plain conversion, so each read kept
                # a float32 tile in registers (sm_90 compile, 64-token tiles at 3 stages:
                # 2312 bytes of spills); read once, both dots share one dequantized bf16 tile
                # in shared memory and nothing spills.
                offs_n = tok0 + tl.arange(0, BLOCK_N)
                row = pages * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_tok
                kv_v = _load_latent(KV, row, offs_n < end, KV_LORA_RANK, BLOCK_N, KV_FORMAT,
                                    "evict_first").to(q_nope.dtype)
            kv, k_rope = kv.to(q_nope.dtype), k_rope.to(q_nope.dtype)
        if MULTI_TOKEN:
            live = mask_n[None, :] & ((tok0 + tl.arange(0, BLOCK_N))[None, :]
                                      < row_limit[:, None])
        else:
            live = mask_n[None, :]
        # Every tile holds a live token for every row unless rows have their own limits.
        acc, l_i, m_i = _softmax_tile(q_nope, q_rope, kv, k_rope, kv_v, live, acc, l_i, m_i,
                                      qk_scale_log2, DOT_PRECISION, MAY_BE_EMPTY=MULTI_TOKEN)
        if REG_PREFETCH:
            next_kv, next_rope = _dequantize_tile(next_raw, q_nope.dtype, q_rope.dtype, BLOCK_N,
                                                  KV_LORA_RANK, KV_FORMAT, DEQUANT)
    if F16_TILES and KV_FORMAT == "dense" and DEQUANT == "bits":
        acc = acc * (1.0 / E4M3_UNIT_BITS)  # the values' 2^-8 out of the output
    return acc, l_i, m_i


@triton.jit
def _tile_pages(bt_row, tok0, end, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
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


V32_GROUP = tl.constexpr(128)  # latent values per float32 scale in a "v32" row


@triton.jit
def _load_latent(KV, row, mask_n, KV_LORA_RANK: tl.constexpr, BLOCK_N: tl.constexpr,
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
def _load_raw_tile(KV, pages, tok0, end, stride_kv_page, stride_kv_tok,
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
def _e4m3_to_f16(raw, DEQUANT: tl.constexpr, scale=None):
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
    """``_load_raw_tile``'s latent as values ("v32": times the group scales; a per-tensor
    scale is applied by the caller). DEQUANT "float": float32 through the conversion
    instructions (the interpreter's path). "bits" / "cvt": float16 from ``_e4m3_to_f16``
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
        kv = _e4m3_to_f16(raw3, DEQUANT,
                          tl.broadcast_to(scale16[:, :, None], [BLOCK_N, GROUPS, V32_GROUP]))
        kv = tl.reshape(kv, [BLOCK_N, KV_LORA_RANK])
    else:
        kv = _e4m3_to_f16(raw, DEQUANT)
    return kv


@triton.jit
def _dequantize_tile(raw_tile, dtype, rope_dtype, BLOCK_N: tl.constexpr,
                     KV_LORA_RANK: tl.constexpr, KV_FORMAT: tl.constexpr,
                     DEQUANT: tl.constexpr):
    """``_load_raw_tile``'s (latent, scales, rope) as the dots' operands: (latent in
    ``dtype``, rope in ``rope_dtype``), per ``_dequantize``."""
    raw, scale, rope = raw_tile
    kv = _dequantize(raw, scale, BLOCK_N, KV_LORA_RANK, KV_FORMAT, DEQUANT).to(dtype)
    if DEQUANT != "float" and KV_FORMAT == "dense":
        k_rope = _e4m3_to_f16(rope, DEQUANT)
    else:
        k_rope = rope.to(rope_dtype)
    return kv, k_rope


@triton.jit
def _load_tile_rows(KV, pages, tok0, end, stride_kv_page, stride_kv_tok,
                    PAGE_SIZE: tl.constexpr, KV_LORA_RANK: tl.constexpr,
                    ROPE_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                    KV_FORMAT: tl.constexpr = "dense"):
    """Tokens tok0 .. tok0 + BLOCK_N on ``pages`` (``_tile_pages``): (latent [BLOCK_N, R],
    rope [BLOCK_N, ROPE_DIM], live mask); rows at or past ``end`` load as zeros. A "v32"
    cache gives the dequantized latent in float32 and the rope in bf16."""
    offs_n = tok0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    row = pages * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_tok
    kv, k_rope = _load_kv_rows(KV, row, mask_n, KV_LORA_RANK, ROPE_DIM, BLOCK_N, KV_FORMAT)
    return kv, k_rope, mask_n


@triton.jit
def _load_kv_rows(KV, row, mask_n, KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
                  BLOCK_N: tl.constexpr, KV_FORMAT: tl.constexpr = "dense"):
    """Cache rows at element offsets ``row`` (any rows: a tile or a gather): (latent
    [BLOCK_N, R], rope [BLOCK_N, ROPE_DIM]); masked rows load as zeros."""
    kv = _load_latent(KV, row, mask_n, KV_LORA_RANK, BLOCK_N, KV_FORMAT, "")
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
def _load_tile(KV, bt_row, tok0, end, stride_kv_page, stride_kv_tok,
               PAGE_SIZE: tl.constexpr, KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
               BLOCK_N: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
               KV_FORMAT: tl.constexpr = "dense"):
    """Tokens tok0 .. tok0 + BLOCK_N of one request: (latent [BLOCK_N, R], rope
    [BLOCK_N, ROPE_DIM], live mask); rows at or past ``end`` load as zeros."""
    pages = _tile_pages(bt_row, tok0, end, PAGE_SIZE, BLOCK_N, TILE_IN_PAGE)
    return _load_tile_rows(KV, pages, tok0, end, stride_kv_page, stride_kv_tok, PAGE_SIZE,
                           KV_LORA_RANK, ROPE_DIM, BLOCK_N, KV_FORMAT)


@triton.jit
def _attend_tokens_token_major(
    q_nope, q_rope, KV, bt_row, start, end, qk_scale_log2,
    stride_kv_page, stride_kv_tok,
    PAGE_SIZE: tl.constexpr,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr = "dense",
):
    """``_attend_tokens`` with tokens as the dots' rows (see there); same result."""
    q_nope_t = tl.trans(q_nope)  # [R, BLOCK_H]
    q_rope_t = tl.trans(q_rope)  # [ROPE_DIM, BLOCK_H]
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_t = tl.zeros([KV_LORA_RANK, BLOCK_H], dtype=tl.float32)

    for tok0 in range(start, end, BLOCK_N):
        kv, k_rope, mask_n = _load_tile(KV, bt_row, tok0, end, stride_kv_page, stride_kv_tok,
                                        PAGE_SIZE, KV_LORA_RANK, ROPE_DIM, BLOCK_N,
                                        TILE_IN_PAGE, KV_FORMAT)
        kv, k_rope = kv.to(q_nope.dtype), k_rope.to(q_nope.dtype)
        s_t = tl.dot(kv, q_nope_t, input_precision=DOT_PRECISION)
        s_t += tl.dot(k_rope, q_rope_t, input_precision=DOT_PRECISION)
        s_t = tl.where(mask_n[:, None], s_t * qk_scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        alpha = tl.exp2(m_i - m_new)
        p_t = tl.exp2(s_t - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p_t, 0)
        acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(kv), p_t.to(kv.dtype),
                                                input_precision=DOT_PRECISION)
        m_i = m_new
    return tl.trans(acc_t), l_i, m_i


@triton.jit
def _store_final(o_ptr, lse_ptr, out, lse_log2, mask_h, WRITE_LSE: tl.constexpr):
    """The request's output [BLOCK_H, R] at o_ptr and, if asked, its natural-log LSE."""
    tl.store(o_ptr, out.to(o_ptr.dtype.element_ty), mask=mask_h[:, None])
    if WRITE_LSE:
        # LSEs stay in log2 units between the stages; 0.693.. = ln 2 converts the final one.
        tl.store(lse_ptr, lse_log2 * 0.6931471805599453, mask=mask_h)


@triton.jit
def _store_padding(o_ptr, lse_ptr, mask_h, BLOCK_H: tl.constexpr, KV_LORA_RANK: tl.constexpr,
                   WRITE_LSE: tl.constexpr):
    """A padding row (seq_len == 0): zeros and an empty-sum LSE."""
    tl.store(o_ptr, tl.zeros([BLOCK_H, KV_LORA_RANK], dtype=o_ptr.dtype.element_ty),
             mask=mask_h[:, None])
    if WRITE_LSE:
        tl.store(lse_ptr, tl.full([BLOCK_H], float("-inf"), dtype=tl.float32), mask=mask_h)


@triton.jit
def _mla_decode_stage1_kernel(
    Q, KV, BLOCK_TABLE, SEQ_LENS, OUT, LSE, PART_O, PART_LSE, MERGE_COUNTERS, KV_SCALE,
    num_kv_splits, num_heads, q_len, heads_per_token, stride_mc_b, qk_scale_log2,
    stride_q_b, stride_q_h,
    stride_kv_page, stride_kv_tok,
    stride_bt_b,
    stride_o_b, stride_o_h,
    stride_lse_b,
    stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h,
    PAGE_SIZE: tl.constexpr,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr = "tf32",
    USE_GDC: tl.constexpr = False,
    TOKEN_MAJOR: tl.constexpr = False,
    FUSED_MERGE: tl.constexpr = False,
    PAGE_AHEAD: tl.constexpr = False,
    MERGE_CHUNKS: tl.constexpr = 1,
    SCALED: tl.constexpr = False,
    MULTI_TOKEN: tl.constexpr = False,
    KV_FORMAT: tl.constexpr = "dense",
    REG_PREFETCH: tl.constexpr = False,
    DEQUANT: tl.constexpr = "float",
    RAW_VEC: tl.constexpr = 0,
):
    bid = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    if USE_GDC:
        # Let the merge grid launch now (programmatic dependent launch): its programs wait
        # for this grid's stores on the device instead of behind a kernel boundary.
        gdc_launch_dependents()

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_c = tl.arange(0, KV_LORA_RANK)
    o_ptr = OUT + bid * stride_o_b + offs_h[:, None] * stride_o_h + offs_c[None, :]
    lse_ptr = LSE + bid * stride_lse_b + offs_h

    seq_len = tl.load(SEQ_LENS + bid)
    start, end = _split_range(seq_len, split, num_kv_splits, BLOCK_N)

    if start < end:
        q_nope, q_rope = _load_q(Q, bid, offs_h, mask_h, stride_q_b, stride_q_h,
                                 KV_LORA_RANK, ROPE_DIM)
        kv_scale = 1.0
        if SCALED:
            kv_scale = tl.load(KV_SCALE)
        # Rows are query tokens x heads (q_len 1: heads); token j of a verify step sees
        # the positions before seq_len - q_len + j + 1.
        row_limit = seq_len - q_len + 1 + offs_h // heads_per_token
        acc, l_i, m_i = _attend_tokens(
            q_nope, q_rope, KV, BLOCK_TABLE + bid * stride_bt_b, start, end,
            qk_scale_log2 * kv_scale,
            stride_kv_page, stride_kv_tok, PAGE_SIZE, KV_LORA_RANK, ROPE_DIM, BLOCK_H,
            BLOCK_N, TILE_IN_PAGE, DOT_PRECISION, TOKEN_MAJOR, PAGE_AHEAD, KV_FORMAT,
            row_limit, MULTI_TOKEN, REG_PREFETCH, DEQUANT, RAW_VEC)
        lse_log2 = m_i + tl.log2(l_i)
        if MULTI_TOKEN:  # rows that saw no token here: zeros, LSE -inf
            l_i = tl.where(l_i > 0.0, l_i, 1.0)
        # A scaled (fp8) cache: q.(s k) = s (q.k) above, sum p (s v) = s sum p v here.
        out = acc * (kv_scale / l_i)[:, None]
        if ONE_SPLIT:
            _store_final(o_ptr, lse_ptr, out, lse_log2, mask_h, WRITE_LSE)
        else:
            po_ptr = (PART_O + bid * stride_po_b + offs_h[:, None] * stride_po_h
                      + split * stride_po_s + offs_c[None, :])
            tl.store(po_ptr, out, mask=mask_h[:, None])
            tl.store(PART_LSE + bid * stride_pl_b + offs_h * stride_pl_h + split, lse_log2,
                     mask=mask_h)
            if FUSED_MERGE:
                # The request's last split to finish merges (no second kernel). Every
                # thread's partial stores precede the barrier; the release half of the
                # atomic publishes them, its acquire half lets the last one read all.
                tl.debug_barrier()
                counter = MERGE_COUNTERS + bid * stride_mc_b + head_block
                done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if done == _active_splits(seq_len, num_kv_splits, BLOCK_N) - 1:
                    tl.store(counter, 0)  # ready for the next launch (or graph replay)
                    if MERGE_CHUNKS > 1:
                        _merge_head_block_chunked(
                            PART_O + bid * stride_po_b, PART_LSE + bid * stride_pl_b,
                            OUT + bid * stride_o_b, lse_ptr, offs_h, mask_h, stride_po_h,
                            stride_po_s, stride_pl_h, stride_o_h,
                            _active_splits(seq_len, num_kv_splits, BLOCK_N), KV_LORA_RANK,
                            MERGE_CHUNKS, WRITE_LSE)
                    else:
                        merged, merged_lse = _merge_head_block(
                            PART_O + bid * stride_po_b, PART_LSE + bid * stride_pl_b, offs_h,
                            mask_h, stride_po_h, stride_po_s, stride_pl_h,
                            _active_splits(seq_len, num_kv_splits, BLOCK_N), KV_LORA_RANK)
                        _store_final(o_ptr, lse_ptr, merged, merged_lse, mask_h, WRITE_LSE)
    elif ONE_SPLIT:
        _store_padding(o_ptr, lse_ptr, mask_h, BLOCK_H, KV_LORA_RANK, WRITE_LSE)
    elif FUSED_MERGE:
        if seq_len == 0:
            if split == 0:
                _store_padding(o_ptr, lse_ptr, mask_h, BLOCK_H, KV_LORA_RANK, WRITE_LSE)


@triton.jit
def _lse_step(m_i, lse):
    """One partial's step of an LSE merge: (new max, rescale of the sum so far, weight of
    the partial). A q_len > 1 row may see no position of a split, or none at all (seq_len
    < q_len): its LSE is -inf, and a max still at -inf is kept out of the exponents (an
    exp2 of -inf - -inf is NaN), so such a row merges to zeros and LSE -inf."""
    m_new = tl.maximum(m_i, lse)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, tl.exp2(m_i - m_ref), tl.exp2(lse - m_ref)


@triton.jit
def _merge_head_block(part_o, part_lse, offs_h, mask_h, stride_po_h, stride_po_s,
                      stride_pl_h, num_active, KV_LORA_RANK: tl.constexpr):
    """LSE merge of one request's ``num_active`` partials for the heads ``offs_h``:
    (normalised output [BLOCK_H, R], log2 LSE); rows with no live token give zeros and
    -inf. Loads bypass L1 (other SMs wrote them)."""
    offs_c = tl.arange(0, KV_LORA_RANK)
    lse = tl.load(part_lse + offs_h * stride_pl_h, mask=mask_h, other=0.0, cache_modifier=".cg")
    m_i = lse
    l_i = tl.full(lse.shape, 1.0, dtype=tl.float32)
    acc = tl.load(part_o + offs_h[:, None] * stride_po_h + offs_c[None, :],
                  mask=mask_h[:, None], other=0.0, cache_modifier=".cg")
    for s in range(1, num_active):
        lse = tl.load(part_lse + offs_h * stride_pl_h + s, mask=mask_h, other=0.0,
                      cache_modifier=".cg")
        part = tl.load(part_o + offs_h[:, None] * stride_po_h + s * stride_po_s
                       + offs_c[None, :], mask=mask_h[:, None], other=0.0, cache_modifier=".cg")
        m_i, alpha, w = _lse_step(m_i, lse)
        acc = acc * alpha[:, None] + w[:, None] * part
        l_i = l_i * alpha + w
    # l == 0 only for a row with no live token (its partials are zeros).
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    return acc / l_safe[:, None], m_i + tl.log2(l_i)


@triton.jit
def _merge_head_block_chunked(part_o, part_lse, out_row, lse_ptr, offs_h, mask_h, stride_po_h,
                              stride_po_s, stride_pl_h, stride_o_h, num_active,
                              KV_LORA_RANK: tl.constexpr, MERGE_CHUNKS: tl.constexpr,
                              WRITE_LSE: tl.constexpr):
    """``_merge_head_block`` and its store, MERGE_CHUNKS column blocks at a time: one pass
    over the LSEs gives every split's weight, then each block of R / MERGE_CHUNKS columns
    sums the weighted partials and is stored. Holds a [BLOCK_H, R / MERGE_CHUNKS] float32
    tile instead of two [BLOCK_H, R] ones (the registers of the program that merges)."""
    m_i = tl.load(part_lse + offs_h * stride_pl_h, mask=mask_h, other=0.0,
                  cache_modifier=".cg")
    l_i = tl.full(m_i.shape, 1.0, dtype=tl.float32)
    for s in range(1, num_active):
        lse = tl.load(part_lse + offs_h * stride_pl_h + s, mask=mask_h, other=0.0,
                      cache_modifier=".cg")
        m_i, alpha, w = _lse_step(m_i, lse)
        l_i = l_i * alpha + w
    lse_log2 = m_i + tl.log2(l_i)
    # A row with no live token (LSE -inf): every weight below is 0, not exp2(NaN).
    lse_ref = tl.where(lse_log2 == float("-inf"), 0.0, lse_log2)
    BLOCK_C: tl.constexpr = KV_LORA_RANK // MERGE_CHUNKS
    for c in tl.static_range(MERGE_CHUNKS):
        offs_c = c * BLOCK_C + tl.arange(0, BLOCK_C)
        acc = tl.zeros([offs_h.shape[0], BLOCK_C], dtype=tl.float32)
        for s in range(0, num_active):
            lse = tl.load(part_lse + offs_h * stride_pl_h + s, mask=mask_h, other=0.0,
                          cache_modifier=".cg")
            part = tl.load(part_o + offs_h[:, None] * stride_po_h + s * stride_po_s
                           + offs_c[None, :], mask=mask_h[:, None], other=0.0,
                           cache_modifier=".cg")
            acc += tl.exp2(lse - lse_ref)[:, None] * part
        tl.store(out_row + offs_h[:, None] * stride_o_h + offs_c[None, :],
                 acc.to(out_row.dtype.element_ty), mask=mask_h[:, None])
    if WRITE_LSE:
        tl.store(lse_ptr, lse_log2 * 0.6931471805599453, mask=mask_h)


@triton.jit
def _merge_partials(o_row, lse_row, stride_o_s, stride_lse_s, num_active, offs_dv,
                    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Blocked LSE merge of ``num_active`` partials (log2 LSEs), BLOCK_S per step.
    Returns the unnormalised (acc [BLOCK_DV], l, m); l == 0 when nothing was live."""
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s0 in range(0, num_active, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mask_s = offs_s < num_active
        lse = tl.load(lse_row + offs_s * stride_lse_s, mask=mask_s, other=float("-inf"))
        m_new = tl.maximum(m_i, tl.max(lse, 0))
        # Guard -inf - -inf: a block of only masked splits must not produce NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        w = tl.exp2(lse - m_safe)
        part = tl.load(o_row + offs_s[:, None] * stride_o_s + offs_dv[None, :],
                       mask=mask_s[:, None], other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * part, 0)
        l_i = l_i * alpha + tl.sum(w, 0)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _store_merged(o_ptr, lse_ptr, acc, l_i, m_i, dv_block, WRITE_LSE: tl.constexpr):
    """Normalise a merge into o_ptr (zeros when nothing was live); the LSE when asked
    (once per head: by the program of the first dv block)."""
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = tl.where(l_i > 0.0, acc / l_safe, 0.0)
    tl.store(o_ptr, out.to(o_ptr.dtype.element_ty))
    if WRITE_LSE:
        if dv_block == 0:
            lse_out = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * 0.6931471805599453,
                               float("-inf"))
            tl.store(lse_ptr, lse_out)


@triton.jit
def _mla_decode_merge_kernel(
    PART_O, PART_LSE, SEQ_LENS, OUT, LSE,
    num_kv_splits,
    stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h,
    stride_o_b, stride_o_h,
    stride_lse_b,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    bid = tl.program_id(0)
    head = tl.program_id(1)
    dv_block = tl.program_id(2)
    offs_dv = dv_block * BLOCK_DV + tl.arange(0, BLOCK_DV)

    seq_len = tl.load(SEQ_LENS + bid)
    # Same formula as stage 1: splits past this count got no tokens and wrote nothing.
    num_active = _active_splits(seq_len, num_kv_splits, BLOCK_N)

    if USE_GDC:
        gdc_wait()  # stage 1's partials are complete and visible past this point
    acc, l_i, m_i = _merge_partials(
        PART_O + bid * stride_po_b + head * stride_po_h,
        PART_LSE + bid * stride_pl_b + head * stride_pl_h,
        stride_po_s, 1, num_active, offs_dv, BLOCK_S, BLOCK_DV)
    _store_merged(OUT + bid * stride_o_b + head * stride_o_h + offs_dv,
                  LSE + bid * stride_lse_b + head, acc, l_i, m_i, dv_block, WRITE_LSE)
