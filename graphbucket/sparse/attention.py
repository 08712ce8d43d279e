"""Sparse MLA attention over top-k token positions: split stage 1 + the dense decode's merge.

Row r (one query token, flat spec-as-decode form) attends to the positions
``indices[r, :sparse_lens[r]]`` of its request (written by the top-k: all < its causal
limit), gathering each latent row from the paged cache through the block table
(position -> page ``block_table[r, p // page_size]``, slot ``p % page_size``)::

    out[r, h] = softmax_j(q[r, h] . kv[idx_j] * sm_scale) . kv[idx_j, :kv_lora_rank]

Work partition, on the device: split s of row r takes the slots of [0, sparse_lens[r])
that ``graphbucket.kernels.tiles.split_range`` gives it (the grid is fixed by the
plan: rows x head blocks x splits; splits past a row's tiles exit at once), so the
partition follows the live sparse lengths min(len, topk) with no host read. With one
split stage 1 writes the output; otherwise it writes float32 partials and log2 LSEs to a
``SplitWorkspace`` and ``mla_decode_merge_kernel`` (given the sparse lengths and this
kernel's tile) merges them. A -1 below a row's length is skipped like the padding after
it; rows with no position (length 0, or -1 in every slot) give zeros.

Each tile's rows hang off a chain of dependent loads: positions, then their block-table
entries, then the rows. Loaded where they are used, all three wait on one another, and
Triton's pipeliner copies the rows with one buffer, issued only after the previous tile's
math. ``GATHER_AHEAD`` (``SparsePlan.gather_ahead``) carries the chain across iterations:
while tile i is processed, the pages of tile i+1 are looked up from positions loaded one
iteration earlier, and the positions of tile i+2 are loaded. The row copy then depends
on no load of its own iteration, so it gets num_stages - 1 buffers (sm_90 compile at 3
stages: tile i+1 in flight during tile i's math) behind a single synchronous table load.
Carrying the rows two tiles ahead instead stops the pipeliner from copying them
asynchronously at all.

Cache formats as in the dense decode (``KV_FORMAT``): bf16 / fp16 / fp32 rows, or
DeepSeek-V3.2's 656-byte fp8 rows (uint8 cache, ``graphbucket.fp8.pack_v32``), read by
``load_kv_rows`` (the dense kernels' loader, here with gathered row offsets).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphbucket.fp8 import cache_format_of
from graphbucket.kernels.attend import softmax_tile
from graphbucket.kernels.launch import LOG2E, SplitWorkspace
from graphbucket.kernels.merge import mla_decode_merge_kernel
from graphbucket.kernels.tiles import (
    load_kv_rows,
    load_q,
    split_range,
    store_final,
    store_padding,
)
from graphbucket.plan import merge_block_s
from graphbucket.sparse.plan import SparsePlan


@triton.jit
def _load_positions(idx_row, slot0, end, BLOCK_N: tl.constexpr):
    """Positions in slots slot0 .. slot0 + BLOCK_N; -1 at or past ``end`` (slot0 may be
    past it: the look-ahead beyond a split's last tiles loads nothing)."""
    offs_n = slot0 + tl.arange(0, BLOCK_N)
    return tl.load(idx_row + offs_n, mask=offs_n < end, other=-1)


@triton.jit
def _slot_rows(bt_row, pos, stride_kv_page, stride_kv_tok, PAGE_SIZE: tl.constexpr):
    """Cache row offsets of positions ``pos`` and which are live: -1 (the top-k's padding,
    or past the split) addresses row 0 and loads nothing."""
    live = pos >= 0
    pos = tl.maximum(pos, 0)
    page = tl.load(bt_row + pos // PAGE_SIZE, mask=live, other=0).to(tl.int64)
    return page * stride_kv_page + (pos % PAGE_SIZE) * stride_kv_tok, live


@triton.jit
def _sparse_attention_kernel(
    Q, KV, BLOCK_TABLE, INDICES, SPARSE_LENS, OUT, LSE, PART_O, PART_LSE,
    num_splits, num_heads, qk_scale_log2,
    stride_q_r, stride_q_h,
    stride_kv_page, stride_kv_tok,
    stride_bt_r, stride_i_r,
    stride_o_r, stride_o_h, stride_lse_r,
    stride_po_r, stride_po_h, stride_po_s,
    stride_pl_r, stride_pl_h,
    PAGE_SIZE: tl.constexpr,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    GATHER_AHEAD: tl.constexpr,
):
    row = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_c = tl.arange(0, KV_LORA_RANK)
    o_ptr = OUT + row * stride_o_r + offs_h[:, None] * stride_o_h + offs_c[None, :]
    lse_ptr = LSE + row * stride_lse_r + offs_h

    n = tl.load(SPARSE_LENS + row)
    start, end = split_range(n, split, num_splits, BLOCK_N)
    if start < end:
        q_nope, q_rope = load_q(Q, row, offs_h, mask_h, stride_q_r, stride_q_h,
                                KV_LORA_RANK, ROPE_DIM)
        bt_row = BLOCK_TABLE + row * stride_bt_r
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, KV_LORA_RANK], dtype=tl.float32)
        idx_row = INDICES + row * stride_i_r
        if GATHER_AHEAD:
            next_row, next_live = _slot_rows(bt_row, _load_positions(idx_row, start, end,
                                                                     BLOCK_N),
                                             stride_kv_page, stride_kv_tok, PAGE_SIZE)
            next_pos = _load_positions(idx_row, start + BLOCK_N, end, BLOCK_N)
        for slot0 in range(start, end, BLOCK_N):
            if GATHER_AHEAD:
                kv_row, live = next_row, next_live
                next_row, next_live = _slot_rows(bt_row, next_pos, stride_kv_page,
                                                 stride_kv_tok, PAGE_SIZE)
                next_pos = _load_positions(idx_row, slot0 + 2 * BLOCK_N, end, BLOCK_N)
            else:
                kv_row, live = _slot_rows(bt_row, _load_positions(idx_row, slot0, end, BLOCK_N),
                                          stride_kv_page, stride_kv_tok, PAGE_SIZE)
            kv, k_rope = load_kv_rows(KV, kv_row, live, KV_LORA_RANK, ROPE_DIM, BLOCK_N,
                                      KV_FORMAT)
            kv, k_rope = kv.to(q_nope.dtype), k_rope.to(q_nope.dtype)
            # A tile may hold only -1 slots (padding): its rows may have no live token.
            acc, l_i, m_i = softmax_tile(q_nope, q_rope, kv, k_rope, kv, live[None, :], acc,
                                         l_i, m_i, qk_scale_log2, DOT_PRECISION,
                                         MAY_BE_EMPTY=True)
        # A split whose slots are all -1 gives zeros and LSE -inf: the merge weighs it 0.
        lse_log2 = m_i + tl.log2(l_i)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if ONE_SPLIT:
            store_final(o_ptr, lse_ptr, out, lse_log2, mask_h, WRITE_LSE)
        else:
            tl.store(PART_O + row * stride_po_r + offs_h[:, None] * stride_po_h
                     + split * stride_po_s + offs_c[None, :], out, mask=mask_h[:, None])
            tl.store(PART_LSE + row * stride_pl_r + offs_h * stride_pl_h + split, lse_log2,
                     mask=mask_h)
    elif ONE_SPLIT:
        store_padding(o_ptr, lse_ptr, mask_h, BLOCK_H, KV_LORA_RANK, WRITE_LSE)


def launch_sparse_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                            indices: torch.Tensor, sparse_lens: torch.Tensor, out: torch.Tensor,
                            workspace: SplitWorkspace | None, *, plan: SparsePlan,
                            sm_scale: float, lse: torch.Tensor | None = None) -> None:
    """Stage 1 and (for several splits) the merge, unchecked. Graph-safe: no device
    reads, no allocation."""
    kv_lora_rank = out.shape[2]
    rope_dim = q.shape[2] - kv_lora_rank
    one_split = plan.attention_splits == 1
    if one_split:
        part_o, part_lse, po_strides, pl_strides = out, out, (0, 0, 0), (0, 0)
    else:
        part_o, part_lse = workspace.partial_o, workspace.partial_lse
        po_strides, pl_strides = part_o.stride()[:3], part_lse.stride()[:2]
    lse_arg = out if lse is None else lse
    lse_stride = 0 if lse is None else lse.stride(0)
    grid = (plan.num_rows, plan.num_head_blocks, plan.attention_splits)
    _sparse_attention_kernel[grid](
        q, kv_cache, block_table, indices, sparse_lens, out, lse_arg, part_o, part_lse,
        plan.attention_splits, plan.num_heads, sm_scale * LOG2E,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0), indices.stride(0),
        out.stride(0), out.stride(1), lse_stride,
        *po_strides, *pl_strides,
        PAGE_SIZE=kv_cache.shape[1], KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope_dim,
        BLOCK_H=plan.block_h, BLOCK_N=plan.attention_block_n, ONE_SPLIT=one_split,
        WRITE_LSE=lse is not None,
        DOT_PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
        KV_FORMAT=cache_format_of(kv_cache).kernel_tag, GATHER_AHEAD=plan.gather_ahead,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if not one_split:
        mla_decode_merge_kernel[(plan.num_rows, plan.num_heads,
                                 triton.cdiv(kv_lora_rank, plan.merge_block_dv))](
            part_o, part_lse, sparse_lens, out, lse_arg,
            plan.attention_splits,
            *po_strides, *pl_strides,
            out.stride(0), out.stride(1), lse_stride,
            BLOCK_N=plan.attention_block_n, BLOCK_S=merge_block_s(plan.attention_splits),
            BLOCK_DV=plan.merge_block_dv, WRITE_LSE=lse is not None, num_warps=4,
        )
