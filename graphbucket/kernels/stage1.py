"""The split-KV stage-1 kernel of MLA decode: one program per (request, head block, KV split)
streams its share of the request's tokens and writes the final output (one split), or a
normalised partial and its log-sum-exp for the merge kernel to combine (with a fused
merge, the request's last split to finish combines them itself).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from graphbucket.kernels.attend import attend_tokens
from graphbucket.kernels.merge import merge_head_block, merge_head_block_chunked
from graphbucket.kernels.tiles import (
    active_splits,
    load_q,
    split_range,
    store_final,
    store_padding,
)

# Flash-decoding over a paged latent KV cache (DeepSeek-V3 / Kimi shapes). With one split
# there is no merge launch. A fused merge (few splits per request) needs no second kernel
# either: an atomic per (request, head block) in the workspace counts the finished splits,
# and the last one merges the partials and resets the counter, so the next launch or graph
# replay starts from zero. Rows with ``seq_len == 0`` (padding) produce zeros.


@triton.jit
def mla_decode_stage1_kernel(
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
    start, end = split_range(seq_len, split, num_kv_splits, BLOCK_N)

    if start < end:
        q_nope, q_rope = load_q(Q, bid, offs_h, mask_h, stride_q_b, stride_q_h,
                                KV_LORA_RANK, ROPE_DIM)
        kv_scale = 1.0
        if SCALED:
            kv_scale = tl.load(KV_SCALE)
        # Rows are query tokens x heads (q_len 1: heads); token j of a verify step sees
        # the positions before seq_len - q_len + j + 1.
        row_limit = seq_len - q_len + 1 + offs_h // heads_per_token
        acc, l_i, m_i = attend_tokens(
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
            store_final(o_ptr, lse_ptr, out, lse_log2, mask_h, WRITE_LSE)
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
                if done == active_splits(seq_len, num_kv_splits, BLOCK_N) - 1:
                    tl.store(counter, 0)  # ready for the next launch (or graph replay)
                    if MERGE_CHUNKS > 1:
                        merge_head_block_chunked(
                            PART_O + bid * stride_po_b, PART_LSE + bid * stride_pl_b,
                            OUT + bid * stride_o_b, lse_ptr, offs_h, mask_h, stride_po_h,
                            stride_po_s, stride_pl_h, stride_o_h,
                            active_splits(seq_len, num_kv_splits, BLOCK_N), KV_LORA_RANK,
                            MERGE_CHUNKS, WRITE_LSE)
                    else:
                        merged, merged_lse = merge_head_block(
                            PART_O + bid * stride_po_b, PART_LSE + bid * stride_pl_b, offs_h,
                            mask_h, stride_po_h, stride_po_s, stride_pl_h,
                            active_splits(seq_len, num_kv_splits, BLOCK_N), KV_LORA_RANK)
                        store_final(o_ptr, lse_ptr, merged, merged_lse, mask_h, WRITE_LSE)
    elif ONE_SPLIT:
        store_padding(o_ptr, lse_ptr, mask_h, BLOCK_H, KV_LORA_RANK, WRITE_LSE)
    elif FUSED_MERGE:
        if seq_len == 0:
            if split == 0:
                store_padding(o_ptr, lse_ptr, mask_h, BLOCK_H, KV_LORA_RANK, WRITE_LSE)
