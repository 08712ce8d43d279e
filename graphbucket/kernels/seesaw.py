"""64-row MLA decode stage 1 with two warpgroups in a seesaw (Gluon, sm_90).

Why: the Triton 64-row kernel splits every dot's columns across its two warpgroups, so
each KV tile they meet at CTA barriers to exchange the row max and P (Nsight Compute: 33 %
of the cycles between instructions are such waits, bench/NOTES.md 2026-12-01 04:10).

Here each warpgroup owns whole rows of S for its own tile and half of O's columns. A step
takes two 64-token tiles, A (even) and B (odd):

    WG0: S_A = Q K_A^T                   WG1: S_B = Q K_B^T              (concurrently)
    WG0: m_A = max(m, rowmax S_A) -> smem, alpha_A = 2^(m - m_A)
    WG0: P_A = 2^(S_A - m_A) -> smem     WG1: m_B = max(m_A, rowmax S_B),
                                              P_B = 2^(S_B - m_B) -> smem,
                                              alpha_B = 2^(m_A - m_B)
    WG0: O_L = O_L alpha_A + P_A V_A,L   WG1: O_R = O_R alpha_A + P_A V_A,R  (P_A from smem)
    WG0: O_L = O_L alpha_B + P_B V_B,L   WG1: O_R = O_R alpha_B + P_B V_B,R
         (P_B from smem)

so the only hand-offs are m_A, P_A (WG0 -> WG1) and P_B (WG1 -> WG0), through mbarriers;
each tile's P goes into that tile's rope box, whose QK is done by then. A 4-warp loader
partition brings Q once and the tiles by TMA, 9 boxes of 64 x 64 each with a ready barrier
per box (a box's QK starts when it lands). A slot is released in two parts, each by the
warpgroup that reads it last: its own warpgroup's value half, then the other half with
the rope box (P). Tile A is free after both warpgroups' first PV, so its next load runs
while the step's second PVs do. The row statistics are double-buffered by step parity
(WG0 may run a step ahead).

Shared memory: Q 72 KB + two tiles 144 KB + row statistics 3 KB: 219 KB (of 227).
The grid is (head blocks, batch, splits): a request's head blocks read its pages side by
side, the second from L2. Same split formula and partials as the Triton stage 1
(``tiles.split_range``, BLOCK_N 64), so the Triton merge kernel combines the splits.
``kernels/seesaw_balanced.py`` runs the same partitions over balanced work items instead
of splits (one long request among short ones), merged by the balanced merge.
Requirements (``seesaw_route.runs_seesaw``): sm_90, bf16 q and cache, 64-token pages, heads a
multiple of 64 or fewer than 64 (one program's 64 rows then hold the request's heads and
rows no one stores: the wgmma's M is 64 whatever the head count), q contiguous. Value
rows past a request's length are zeroed in shared memory before the PV (unwritten cache
rows may hold NaN).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from graphbucket.kernels.gluon_compat import tma_async_load
from graphbucket.kernels.seesaw_layout import (
    B_FREE_CROSS,
    B_FREE_OWN,
    B_Q,
    B_READY,
    BOX,
    BOX_BYTES,
    CHUNKS,
    HALF_CHUNKS,
    ROWS,
    TILE,
    TILE_BYTES,
    VALUE_BOXES,
    rope_box,
    shared_state,
    value_box,
)
from graphbucket.kernels.seesaw_step import warpgroup_even, warpgroup_odd


@gluon.jit
def _load_boxes(kv_desc, row, kv_s, rope_s, bars, slot, FIRST: gl.constexpr,
                COUNT: gl.constexpr, PV_COLS: gl.constexpr):
    for i in gl.static_range(COUNT):
        box = slot * CHUNKS + FIRST + i
        mbarrier.expect(bars.index(B_READY + box), BOX_BYTES)
        if FIRST + i == VALUE_BOXES:
            dest = rope_box(kv_s, rope_s, slot, PV_COLS)
        else:
            dest = value_box(kv_s, slot, FIRST + i, PV_COLS)
        tma_async_load(kv_desc, [row, (FIRST + i) * BOX], bars.index(B_READY + box), dest)


@gluon.jit
def tile_loader(q_desc, kv_desc, bt_row, q_s, kv_s, rope_s, bars, q_row, start, end,
                num_steps, PAGE_SIZE: gl.constexpr, g0=0, PV_COLS: gl.constexpr = 64):
    """Q, then the tiles of tokens [start, end) in steps of two. ``g0``: the steps this
    program ran before (a range's earlier segments), which set the barrier phases.
    ``PV_COLS``: the tiles' shared-memory layout (``seesaw_layout``)."""
    mbarrier.expect(bars.index(B_Q), TILE_BYTES)
    for c in gl.static_range(CHUNKS):
        tma_async_load(q_desc, [q_row, c * BOX], bars.index(B_Q), q_s.index(c))
    for step in range(num_steps):
        # A tile past the split's end (the second of an odd count) loads page 0's rows; its
        # warpgroup masks its scores and zeroes its values.
        tok_a = start + 2 * step * TILE
        tok_b = tok_a + TILE
        row_a = gl.load(bt_row + tok_a // PAGE_SIZE) * PAGE_SIZE + tok_a % PAGE_SIZE
        row_b = gl.load(bt_row + tok_b // PAGE_SIZE, mask=tok_b < end, other=0) * PAGE_SIZE \
            + tok_b % PAGE_SIZE
        g = g0 + step
        # In the order the parts are released: tile A after both warpgroups' first PV, then
        # B's left half and rope box (WG0's second PV), then B's right half (WG1's).
        if g > 0:
            mbarrier.wait(bars.index(B_FREE_OWN + 0), (g - 1) & 1)
        _load_boxes(kv_desc, row_a, kv_s, rope_s, bars, 0, 0, HALF_CHUNKS, PV_COLS)
        if g > 0:
            mbarrier.wait(bars.index(B_FREE_CROSS + 0), (g - 1) & 1)
        _load_boxes(kv_desc, row_a, kv_s, rope_s, bars, 0, HALF_CHUNKS, HALF_CHUNKS + 1,
                    PV_COLS)
        if g > 0:
            mbarrier.wait(bars.index(B_FREE_CROSS + 1), (g - 1) & 1)
        _load_boxes(kv_desc, row_b, kv_s, rope_s, bars, 1, 0, HALF_CHUNKS, PV_COLS)
        _load_boxes(kv_desc, row_b, kv_s, rope_s, bars, 1, 2 * HALF_CHUNKS, 1, PV_COLS)
        if g > 0:
            mbarrier.wait(bars.index(B_FREE_OWN + 1), (g - 1) & 1)
        _load_boxes(kv_desc, row_b, kv_s, rope_s, bars, 1, HALF_CHUNKS, HALF_CHUNKS,
                    PV_COLS)


@gluon.jit
def seesaw_stage1_kernel(q_desc, kv_desc, BLOCK_TABLE, SEQ_LENS, OUT, LSE, PART_O, PART_LSE,
                         num_kv_splits, num_heads, qk_scale_log2,
                         stride_bt_b, stride_o_b, stride_o_h, stride_lse_b,
                         stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h,
                         PAGE_SIZE: gl.constexpr, ONE_SPLIT: gl.constexpr,
                         WRITE_LSE: gl.constexpr, ONE_RESCALE: gl.constexpr = False,
                         Q_LEN: gl.constexpr = 1, rows_per_token=1,
                         PV_COLS: gl.constexpr = 256, LAZY_RESCALE: gl.constexpr = False):
    # Grid (head blocks, batch, splits): the programs of one request's head blocks launch
    # together and read the same pages about together, the second from L2.
    head_block = gl.program_id(0)
    bid = gl.program_id(1)
    split = gl.program_id(2)
    seq_len, start, end = split_bounds(SEQ_LENS, bid, split, num_kv_splits)
    if start < end:
        num_steps = gl.cdiv(gl.cdiv(end - start, TILE), 2)
        q_layout: gl.constexpr = q_desc.layout
        kv_layout: gl.constexpr = kv_desc.layout
        q_s, kv_s, rope_s, stats_s, bars = shared_state(q_layout, kv_layout, PV_COLS)
        h0 = head_block * ROWS
        o_ptr, stride_rows, lse_ptr, stride_lse_rows = program_outputs(
            OUT, LSE, PART_O, PART_LSE, bid, h0, split, stride_o_b, stride_o_h, stride_lse_b,
            stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, ONE_SPLIT)
        num_rows = gl.minimum(num_heads - h0, ROWS)
        gl.warp_specialize([
            (warpgroup_even, (q_s, kv_s, rope_s, stats_s, bars, start, end, num_steps,
                               qk_scale_log2, o_ptr, lse_ptr, stride_rows, stride_lse_rows,
                               num_rows, WRITE_LSE, ONE_SPLIT, ONE_RESCALE, Q_LEN > 1,
                               seq_len - Q_LEN + 1, h0, rows_per_token, PV_COLS, None,
                               LAZY_RESCALE)),
            (warpgroup_odd, (q_s, kv_s, rope_s, stats_s, bars, start, end, num_steps,
                              qk_scale_log2, o_ptr, lse_ptr, stride_rows, stride_lse_rows,
                              num_rows, WRITE_LSE, ONE_SPLIT, ONE_RESCALE, Q_LEN > 1,
                              seq_len - Q_LEN + 1, h0, rows_per_token, PV_COLS, None,
                              LAZY_RESCALE)),
            (tile_loader, (q_desc, kv_desc, BLOCK_TABLE + bid * stride_bt_b, q_s, kv_s,
                           rope_s, bars, bid * num_heads + h0, start, end, num_steps,
                           PAGE_SIZE, 0, PV_COLS)),
        ], [4, 4], [240, 24])
    elif ONE_SPLIT:
        store_empty_request(OUT, LSE, bid, head_block, num_heads, stride_o_b, stride_o_h,
                            stride_lse_b, WRITE_LSE)


@gluon.jit
def split_bounds(SEQ_LENS, bid, split, num_kv_splits):
    """Request ``bid``'s length and split ``split``'s tokens [start, end): the Triton stage
    1's split of 64-token tiles (``tiles.split_range``), so the merge kernel combines them."""
    seq_len = gl.load(SEQ_LENS + bid)
    per = gl.cdiv(gl.cdiv(seq_len, TILE), num_kv_splits)
    start = split * per * TILE
    return seq_len, start, gl.minimum(start + per * TILE, seq_len)


@gluon.jit
def program_outputs(OUT, LSE, PART_O, PART_LSE, bid, h0, split, stride_o_b, stride_o_h,
                    stride_lse_b, stride_po_b, stride_po_h, stride_po_s, stride_pl_b,
                    stride_pl_h, ONE_SPLIT: gl.constexpr):
    """Where a split-KV program's rows go: (O pointer, its row stride, LSE pointer, its row
    stride), the output itself for one split, else the split's partials."""
    if ONE_SPLIT:
        return (OUT + bid * stride_o_b + h0 * stride_o_h, stride_o_h,
                LSE + bid * stride_lse_b + h0, 1)
    else:
        return (PART_O + bid * stride_po_b + h0 * stride_po_h + split * stride_po_s,
                stride_po_h, PART_LSE + bid * stride_pl_b + h0 * stride_pl_h + split,
                stride_pl_h)


@gluon.jit
def store_empty_request(OUT, LSE, bid, head_block, num_heads, stride_o_b, stride_o_h,
                        stride_lse_b, WRITE_LSE: gl.constexpr):
    """An empty request's (seq_len 0) rows of one head block: zeros, LSE -inf."""
    pad: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    offs_h = head_block * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, pad))
    offs_c = gl.arange(0, 8 * BOX, gl.SliceLayout(0, pad))
    gl.store(OUT + bid * stride_o_b + offs_h[:, None] * stride_o_h + offs_c[None, :],
             gl.zeros([ROWS, 8 * BOX], OUT.dtype.element_ty, pad),
             mask=(offs_h < num_heads)[:, None])
    if WRITE_LSE:
        gl.store(LSE + bid * stride_lse_b + offs_h,
                 gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, pad)),
                 mask=offs_h < num_heads)


def box_layout() -> gl.NVMMASharedLayout:
    """The shared layout of a 64 x 64 bf16 box: the 128-byte swizzle wgmma reads."""
    return gl.NVMMASharedLayout.get_default_for([ROWS.value, BOX.value], gl.bfloat16)


def descriptors(q: torch.Tensor, kv_cache: torch.Tensor):
    """TMA descriptors of q [B, H, 576] (as [B H, 576]) and the cache [pages, page, 576] (as
    [pages page, 576]), 64 x 64 boxes in ``box_layout``."""
    rows, tile, box = ROWS.value, TILE.value, BOX.value
    layout = box_layout()
    q2 = q.reshape(-1, q.shape[-1])
    kv2 = kv_cache.reshape(-1, kv_cache.shape[-1])
    return (TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [rows, box], layout),
            TensorDescriptor(kv2, list(kv2.shape), list(kv2.stride()), [tile, box], layout))
