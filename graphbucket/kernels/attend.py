"""The online softmax of one request's query rows over a range of its cached tokens: the loop
both stage-1 kernels (split-KV and balanced) run, and the tile step the sparse kernel runs
over gathered rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphbucket.kernels.tiles import (
    E4M3_UNIT_BITS,
    dequantize_tile,
    load_latent,
    load_raw_tile,
    load_tile,
    load_tile_rows,
    tile_pages,
)

# Absorbed MLA: K is the whole cache row and V its first kv_lora_rank columns, so each KV
# tile is loaded once and feeds both dots; all heads share the one latent KV head, so
# BLOCK_H heads ride one tile. float32 caches multiply in IEEE float32 (the launchers pass
# ``DOT_PRECISION="ieee"``), not TF32: a float32 cache is chosen for its precision, which
# TF32's 10-bit mantissa would throw away.


@triton.jit
def softmax_tile(q_nope, q_rope, kv, k_rope, kv_v, live, acc, l_i, m_i, qk_scale_log2,
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
def attend_tokens(
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
        next_kv, next_rope = dequantize_tile(
            load_raw_tile(KV, tile_pages(bt_row, start, end, PAGE_SIZE, BLOCK_N, TILE_IN_PAGE),
                          start, end, stride_kv_page, stride_kv_tok, PAGE_SIZE, KV_LORA_RANK,
                          ROPE_DIM, BLOCK_N, KV_FORMAT, RAW_VEC),
            q_nope.dtype, q_rope.dtype, BLOCK_N, KV_LORA_RANK, KV_FORMAT, DEQUANT)
    elif PAGE_AHEAD:
        next_pages = tile_pages(bt_row, start, end, PAGE_SIZE, BLOCK_N, TILE_IN_PAGE)

    for tok0 in range(start, end, BLOCK_N):
        if REG_PREFETCH:
            # The next tile's bytes are loaded now and dequantized after this tile's dots,
            # so the load overlaps them and the loop carries the converted tile (packed
            # 16-bit values; carrying the raw bytes kept one register per byte).
            kv, k_rope = next_kv, next_rope
            kv_v = kv
            mask_n = tok0 + tl.arange(0, BLOCK_N) < end
            next_raw = load_raw_tile(
                KV, tile_pages(bt_row, tok0 + BLOCK_N, end, PAGE_SIZE, BLOCK_N, TILE_IN_PAGE,
                               PAST_END=True),
                tok0 + BLOCK_N, end, stride_kv_page, stride_kv_tok, PAGE_SIZE, KV_LORA_RANK,
                ROPE_DIM, BLOCK_N, KV_FORMAT, RAW_VEC)
        else:
            if PAGE_AHEAD:
                pages = next_pages
                next_pages = tile_pages(bt_row, tok0 + BLOCK_N, end, PAGE_SIZE, BLOCK_N,
                                        TILE_IN_PAGE, PAST_END=True)
            else:
                pages = tile_pages(bt_row, tok0, end, PAGE_SIZE, BLOCK_N, TILE_IN_PAGE)
            kv, k_rope, mask_n = load_tile_rows(KV, pages, tok0, end, stride_kv_page,
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
                kv_v = load_latent(KV, row, offs_n < end, KV_LORA_RANK, BLOCK_N, KV_FORMAT,
                                   "evict_first").to(q_nope.dtype)
            kv, k_rope = kv.to(q_nope.dtype), k_rope.to(q_nope.dtype)
        if MULTI_TOKEN:
            live = mask_n[None, :] & ((tok0 + tl.arange(0, BLOCK_N))[None, :]
                                      < row_limit[:, None])
        else:
            live = mask_n[None, :]
        # Every tile holds a live token for every row unless rows have their own limits.
        acc, l_i, m_i = softmax_tile(q_nope, q_rope, kv, k_rope, kv_v, live, acc, l_i, m_i,
                                     qk_scale_log2, DOT_PRECISION, MAY_BE_EMPTY=MULTI_TOKEN)
        if REG_PREFETCH:
            next_kv, next_rope = dequantize_tile(next_raw, q_nope.dtype, q_rope.dtype, BLOCK_N,
                                                 KV_LORA_RANK, KV_FORMAT, DEQUANT)
    if F16_TILES and KV_FORMAT == "dense" and DEQUANT == "bits":
        acc = acc * (1.0 / E4M3_UNIT_BITS)  # the values' 2^-8 out of the output
    return acc, l_i, m_i


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
    """``attend_tokens`` with tokens as the dots' rows (see there); same result."""
    q_nope_t = tl.trans(q_nope)  # [R, BLOCK_H]
    q_rope_t = tl.trans(q_rope)  # [ROPE_DIM, BLOCK_H]
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_t = tl.zeros([KV_LORA_RANK, BLOCK_H], dtype=tl.float32)

    for tok0 in range(start, end, BLOCK_N):
        kv, k_rope, mask_n = load_tile(KV, bt_row, tok0, end, stride_kv_page, stride_kv_tok,
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
