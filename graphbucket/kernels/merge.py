"""Merging stage-1 partials by their log-sum-exps: the split-KV merge kernel (stage 2, a
blocked merge of BLOCK_S splits per step), and the merge steps that the balanced merge
kernel and a fused stage 1 reuse.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from graphbucket.kernels.tiles import active_splits


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
def merge_head_block(part_o, part_lse, offs_h, mask_h, stride_po_h, stride_po_s,
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
def merge_head_block_chunked(part_o, part_lse, out_row, lse_ptr, offs_h, mask_h, stride_po_h,
                             stride_po_s, stride_pl_h, stride_o_h, num_active,
                             KV_LORA_RANK: tl.constexpr, MERGE_CHUNKS: tl.constexpr,
                             WRITE_LSE: tl.constexpr):
    """``merge_head_block`` and its store, MERGE_CHUNKS column blocks at a time: one pass
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
def merge_partials(o_row, lse_row, stride_o_s, stride_lse_s, num_active, offs_dv,
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
def merge_partials_heads(o_row, lse_row, stride_o_s, stride_o_h, stride_lse_s, num_active,
                         offs_h, mask_h, offs_dv, BLOCK_S: tl.constexpr):
    """``merge_partials`` for a block of heads at once: [BLOCK_S, heads, BLOCK_DV] partials
    per step, so one chain of dependent loads serves every head of the block. Returns the
    unnormalised (acc [heads, BLOCK_DV], l [heads], m [heads])."""
    m_i = tl.full(offs_h.shape, float("-inf"), dtype=tl.float32)
    l_i = tl.zeros(offs_h.shape, dtype=tl.float32)
    acc = tl.zeros([offs_h.shape[0], offs_dv.shape[0]], dtype=tl.float32)
    for s0 in range(0, num_active, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        live = (offs_s < num_active)[:, None] & mask_h[None, :]
        lse = tl.load(lse_row + offs_s[:, None] * stride_lse_s + offs_h[None, :], mask=live,
                      other=float("-inf"))
        m_new = tl.maximum(m_i, tl.max(lse, 0))
        # Guard -inf - -inf: a block of only masked splits must not produce NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        w = tl.exp2(lse - m_safe[None, :])
        part = tl.load(o_row + offs_s[:, None, None] * stride_o_s
                       + offs_h[None, :, None] * stride_o_h + offs_dv[None, None, :],
                       mask=live[:, :, None], other=0.0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * part, 0)
        l_i = l_i * alpha + tl.sum(w, 0)
        m_i = m_new
    return acc, l_i, m_i


# LSEs read per load of the prefetched merge's first pass (most requests have fewer items).
PREFETCH_LSE_BLOCK = tl.constexpr(16)


@triton.jit
def merge_partials_heads_prefetched(o_row, lse_row, stride_o_s, stride_o_h, stride_lse_s,
                                    num_active, offs_h, mask_h, offs_dv,
                                    BLOCK_S: tl.constexpr):
    """``merge_partials_heads`` with the next step's loads issued before this step is
    weighed: the first BLOCK_S partials are requested with the LSEs, one pass over the
    LSEs (PREFETCH_LSE_BLOCK per load) gives each head's max, and the weighted sum then
    needs no rescale, so a unit's loads overlap instead of each waiting on the last.
    Returns the unnormalised (acc [heads, BLOCK_DV], l [heads], m [heads]); l == 0 when
    nothing was live."""
    offs_s = tl.arange(0, BLOCK_S)
    o_ptrs = (o_row + offs_s[:, None, None] * stride_o_s + offs_h[None, :, None] * stride_o_h
              + offs_dv[None, None, :])
    lse_ptrs = lse_row + offs_s[:, None] * stride_lse_s + offs_h[None, :]
    live = (offs_s < num_active)[:, None] & mask_h[None, :]
    part = tl.load(o_ptrs, mask=live[:, :, None], other=0.0)
    lse = tl.load(lse_ptrs, mask=live, other=float("-inf"))
    m_i = tl.full(offs_h.shape, float("-inf"), dtype=tl.float32)
    for s0 in range(0, num_active, PREFETCH_LSE_BLOCK):
        offs_l = s0 + tl.arange(0, PREFETCH_LSE_BLOCK)
        block = tl.load(lse_row + offs_l[:, None] * stride_lse_s + offs_h[None, :],
                        mask=(offs_l < num_active)[:, None] & mask_h[None, :],
                        other=float("-inf"))
        m_i = tl.maximum(m_i, tl.max(block, 0))
    # A row whose every partial is empty (LSE -inf) keeps -inf out of the exponents.
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    acc = tl.zeros([offs_h.shape[0], offs_dv.shape[0]], dtype=tl.float32)
    l_i = tl.zeros(offs_h.shape, dtype=tl.float32)
    for s0 in range(0, num_active, BLOCK_S):
        ahead = ((s0 + BLOCK_S + offs_s) < num_active)[:, None] & mask_h[None, :]
        next_part = tl.load(o_ptrs + (s0 + BLOCK_S) * stride_o_s, mask=ahead[:, :, None],
                            other=0.0)
        next_lse = tl.load(lse_ptrs + (s0 + BLOCK_S) * stride_lse_s, mask=ahead,
                           other=float("-inf"))
        w = tl.exp2(lse - m_safe[None, :])
        acc += tl.sum(w[:, :, None] * part, 0)
        l_i += tl.sum(w, 0)
        part, lse = next_part, next_lse
    return acc, l_i, m_i


@triton.jit
def merge_units_prefetched(PART_O, PART_LSE, ITEM_INDPTR, MERGE_ROWS, OUT, LSE, num_heads,
                           stride_po_i, stride_po_h, stride_pl_i, stride_o_b, stride_o_h,
                           stride_lse_b, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
                           DV_BLOCKS: tl.constexpr, WRITE_LSE: tl.constexpr,
                           BLOCK_HM: tl.constexpr):
    """The balanced merge's unit loop (``balanced_merge_kernel``) with the index chain
    loaded ahead: a unit's item range was requested one unit earlier and its request two
    units earlier, so a unit starts with its partials' loads; each unit then merges by
    ``merge_partials_heads_prefetched``."""
    per_request = tl.cdiv(num_heads, BLOCK_HM) * DV_BLOCKS
    units = tl.load(MERGE_ROWS) * per_request
    stride = tl.num_programs(0)
    start = tl.program_id(0)
    bid = tl.load(MERGE_ROWS + 1 + start // per_request, mask=start < units, other=0)
    first = tl.load(ITEM_INDPTR + bid, mask=start < units, other=0)
    end = tl.load(ITEM_INDPTR + bid + 1, mask=start < units, other=0)
    next_bid = tl.load(MERGE_ROWS + 1 + (start + stride) // per_request,
                       mask=start + stride < units, other=0)
    offs_h = tl.arange(0, BLOCK_HM)
    for unit in range(start, units, stride):
        # Requested now, used one and two units on.
        later = unit + 2 * stride
        after_bid = tl.load(MERGE_ROWS + 1 + later // per_request, mask=later < units,
                            other=0)
        next_first = tl.load(ITEM_INDPTR + next_bid, mask=unit + stride < units, other=0)
        next_end = tl.load(ITEM_INDPTR + next_bid + 1, mask=unit + stride < units, other=0)
        head = (unit % per_request) // DV_BLOCKS * BLOCK_HM
        dv_block = unit % DV_BLOCKS
        offs_dv = dv_block * BLOCK_DV + tl.arange(0, BLOCK_DV)
        mask_h = head + offs_h < num_heads
        acc, l_i, m_i = merge_partials_heads_prefetched(
            PART_O + first.to(tl.int64) * stride_po_i + head * stride_po_h,
            PART_LSE + first.to(tl.int64) * stride_pl_i + head, stride_po_i, stride_po_h,
            stride_pl_i, end - first, offs_h, mask_h, offs_dv, BLOCK_S)
        store_merged_heads(OUT + bid * stride_o_b + head * stride_o_h,
                           LSE + bid * stride_lse_b + head, stride_o_h, acc, l_i, m_i, offs_h,
                           mask_h, offs_dv, dv_block, WRITE_LSE)
        bid, first, end, next_bid = next_bid, next_first, next_end, after_bid


@triton.jit
def store_merged_heads(o_ptr, lse_ptr, stride_o_h, acc, l_i, m_i, offs_h, mask_h, offs_dv,
                       dv_block, WRITE_LSE: tl.constexpr):
    """``store_merged`` for a block of heads (``o_ptr``, ``lse_ptr`` at its first head)."""
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = tl.where(l_i[:, None] > 0.0, acc / l_safe[:, None], 0.0)
    tl.store(o_ptr + offs_h[:, None] * stride_o_h + offs_dv[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mask_h[:, None])
    if WRITE_LSE:
        if dv_block == 0:
            lse_out = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * 0.6931471805599453,
                               float("-inf"))
            tl.store(lse_ptr + offs_h, lse_out, mask=mask_h)


@triton.jit
def store_merged(o_ptr, lse_ptr, acc, l_i, m_i, dv_block, WRITE_LSE: tl.constexpr):
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
def mla_decode_merge_kernel(
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
    num_active = active_splits(seq_len, num_kv_splits, BLOCK_N)

    if USE_GDC:
        gdc_wait()  # stage 1's partials are complete and visible past this point
    acc, l_i, m_i = merge_partials(
        PART_O + bid * stride_po_b + head * stride_po_h,
        PART_LSE + bid * stride_pl_b + head * stride_pl_h,
        stride_po_s, 1, num_active, offs_dv, BLOCK_S, BLOCK_DV)
    store_merged(OUT + bid * stride_o_b + head * stride_o_h + offs_dv,
                 LSE + bid * stride_lse_b + head, acc, l_i, m_i, dv_block, WRITE_LSE)
