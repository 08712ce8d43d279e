"""The Gluon seesaw over fp8 caches (sm_90; ``seesaw_route.runs_seesaw_over_fp8`` routes seesaw
plans to it): stage 1 with a converting warpgroup in place of the TMA loader, over a
per-tensor cache ("fp8-tensor") or a V3.2 one ("fp8-v32"), for split-KV (this module's
kernel, verify steps included) and, through ``fp8_tile_converter``, for the work items and
tile ranges of ``seesaw_balanced``.

fp8 wgmma reads only K-major operands. K (the tile's rows, contiguous per token) is one,
but V (the tile's latent columns, token-major) is not, so the tiles are converted for a
float16 MMA instead: the converter loads a tile's fp8 rows from global memory into
registers (16-byte loads), converts them to float16 (exact: every e4m3 number is a float16
one) and stores them into the boxes the bf16 kernel's TMA fills, arriving on the same ready
barriers in the same order; Q is converted once from bf16. The two compute warpgroups are
the bf16 kernel's (``seesaw_step``) on float16 boxes. A per-tensor scale multiplies the
scores and the output there (``kv_scale_ptr``), so those boxes hold the stored codes; a
V3.2 tile's codes are multiplied by their group's scale in the converter, in float16 as the
Triton kernels do, and its bf16 rope is converted. Register loads keep less in flight than
TMA, so each step first asks L2 for a later step's two pages (``PREFETCH_AHEAD`` steps
ahead, the next by default; one bulk prefetch of the whole contiguous page each): the
converter's loads then wait on L2, not on HBM.

Shared memory is the bf16 kernel's (the boxes hold float16). Registers: the converter holds
up to two tile halves in flight and takes its registers from the compute warpgroups, which
run with 256-column PVs only (64-column PVs spill at fewer registers).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from graphbucket.kernels.seesaw import program_outputs, split_bounds, store_empty_request
from graphbucket.kernels.seesaw_layout import (
    B_FREE_CROSS,
    B_FREE_OWN,
    B_Q,
    B_READY,
    BOX,
    CHUNKS,
    HALF_CHUNKS,
    ROWS,
    TILE,
    VALUE_BOXES,
    shared_state,
    value_halves,
)
from graphbucket.kernels.seesaw_step import warpgroup_even, warpgroup_odd

ROW = gl.constexpr(576)         # values per row of q and of a per-tensor cache (latent, rope)
V32_ROW = gl.constexpr(656)     # bytes per token of a V3.2 cache (``graphbucket.fp8``)
V32_SCALES = gl.constexpr(512)  # byte offset of its 4 float32 group scales
V32_ROPE = gl.constexpr(528)    # byte offset of its 64 bf16 rope values
# A V3.2 tile half as [tokens, 16-value chunks, 16]: a thread's 16 values share a scale.
HALF3 = gl.constexpr(gl.BlockedLayout([1, 1, 16], [2, 16, 1], [4, 1, 1], [2, 1, 0]))
# One bulk L2 prefetch of a 64-token page (36,864 bytes per-tensor, 41,984 V3.2), from one
# thread of the partition ($2 == 0) where the page is live ($3).
_PREFETCH = "{ .reg .pred p, v; setp.ne.s32 v, $3, 0; setp.eq.and.s32 p, $2, 0, v; " \
    "@p cp.async.bulk.prefetch.L2.global [$1], %d; mov.b32 $0, 0; }"
PREFETCH_TENSOR = gl.constexpr(_PREFETCH % (64 * 576))
PREFETCH_V32 = gl.constexpr(_PREFETCH % (64 * 656))


@gluon.jit
def _prefetch_page(KV8, page, valid, V32: gl.constexpr):
    """Ask L2 for a page's bytes (one bulk prefetch, from one thread; none where not
    ``valid``)."""
    lanes: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    lane = gl.arange(0, 128, lanes)
    flag = lane * 0 + valid.to(gl.int32)
    if V32:
        ptr = KV8 + page.to(gl.int64) * (TILE * V32_ROW) + lane * 0
        gl.inline_asm_elementwise(PREFETCH_V32, "=r,l,r,r", [ptr, lane, flag],
                                  dtype=gl.int32, is_pure=False, pack=1)
    else:
        ptr = KV8 + page.to(gl.int64) * (TILE * ROW) + lane * 0
        gl.inline_asm_elementwise(PREFETCH_TENSOR, "=r,l,r,r", [ptr, lane, flag],
                                  dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _prefetch_step(KV8, bt_row, tok, end, PAGE_SIZE: gl.constexpr, V32: gl.constexpr):
    """Ask L2 for the two pages of the step whose first tile starts at token ``tok``."""
    _prefetch_page(KV8, gl.load(bt_row + tok // PAGE_SIZE, mask=tok < end, other=0), tok < end,
                   V32)
    _prefetch_page(KV8, gl.load(bt_row + (tok + TILE) // PAGE_SIZE, mask=tok + TILE < end,
                                other=0), tok + TILE < end, V32)


@gluon.jit
def _load_half_v32(KV8, row, col0):
    """A V3.2 tile half's codes (uint8 [64, 16, 16], ``HALF3``) from latent column
    ``col0``, and each 16-value chunk's group scale (float32 [64, 16])."""
    chunks: gl.constexpr = gl.SliceLayout(2, HALF3)
    tok = gl.arange(0, TILE, gl.SliceLayout(1, chunks))
    chunk = gl.arange(0, 16, gl.SliceLayout(0, chunks))
    within = gl.arange(0, 16, gl.SliceLayout(0, gl.SliceLayout(1, HALF3)))
    base = KV8 + (row + tok.to(gl.int64)) * V32_ROW
    codes = gl.load(base[:, None, None] + col0 + chunk[None, :, None] * 16
                    + within[None, None, :])
    scales = (base[:, None] + V32_SCALES + ((col0 + chunk * 16) // 128)[None, :] * 4).to(
        gl.pointer_type(gl.float32), bitcast=True)
    return codes, gl.load(scales)


@gluon.jit
def _load_rope_v32(KV8, row):
    """A V3.2 tile's rope values (bf16 [64, 64])."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    tok = gl.arange(0, TILE, gl.SliceLayout(1, layout))
    col = gl.arange(0, BOX, gl.SliceLayout(0, layout))
    base = (KV8 + (row + tok.to(gl.int64)) * V32_ROW + V32_ROPE).to(
        gl.pointer_type(gl.bfloat16), bitcast=True)
    return gl.load(base[:, None] + col[None, :])


@gluon.jit
def _load_half(KV8, row, half, V32: gl.constexpr):
    if V32:
        return _load_half_v32(KV8, row, half * 256)
    else:
        return _load_rows(KV8, row, half * 256, 256)


@gluon.jit
def _load_rope(KV8, row, V32: gl.constexpr):
    if V32:
        return _load_rope_v32(KV8, row)
    else:
        return _load_rows(KV8, row, 512, 64)


@gluon.jit
def _store_any_half(x, kv_s, bars, slot, half, V32: gl.constexpr):
    """``_store_half`` of a loaded half: a V3.2 half's codes times their scales, in
    float16 (as the Triton kernels dequantize V3.2 tiles)."""
    if V32:
        codes, scales = x
        values = codes.to(gl.float8e4nv, bitcast=True).to(gl.float16) \
            * scales.to(gl.float16)[:, :, None]
        _store_half(gl.reshape(values, [TILE, 256]), kv_s, bars, slot, half)
    else:
        _store_half(x, kv_s, bars, slot, half)


@gluon.jit
def _load_rows(KV8, row, col0, COLS: gl.constexpr):
    """The tile's 64 rows from ``row``, columns [col0, col0 + COLS), as fp8 registers."""
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // COLS, COLS // 16], [4, 1],
                                            [1, 0])
    tok = gl.arange(0, TILE, gl.SliceLayout(1, layout))
    col = gl.arange(0, COLS, gl.SliceLayout(0, layout))
    return gl.load(KV8 + (row + tok.to(gl.int64))[:, None] * ROW + col0 + col[None, :])


@gluon.jit
def _store_half(x, kv_s, bars, slot, half):
    """A converted value half into its four boxes (one [64, 256] view), then their ready
    barriers."""
    value_halves(kv_s).index(slot * 2 + half).store(x.to(gl.float16))
    fence_async_shared()
    for i in gl.static_range(HALF_CHUNKS):
        mbarrier.arrive(bars.index(B_READY + slot * CHUNKS + half * HALF_CHUNKS + i))


@gluon.jit
def _store_rope(x, rope_s, bars, slot):
    rope_s.index(slot).store(x.to(gl.float16))
    fence_async_shared()
    mbarrier.arrive(bars.index(B_READY + slot * CHUNKS + VALUE_BOXES))


@gluon.jit
def _convert_q(Q, q_s, bars, q_row, q_rows):
    """Q's 64 rows from ``q_row`` (bf16 [rows, 576]; rows past ``q_rows`` as zeros) into
    its float16 boxes."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    r = q_row + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    col = gl.arange(0, BOX, gl.SliceLayout(0, layout))
    ptrs = Q + r.to(gl.int64)[:, None] * ROW + col[None, :]
    live = (r < q_rows)[:, None]
    for c in gl.static_range(CHUNKS):
        q_s.index(c).store(gl.load(ptrs + c * BOX, mask=live, other=0.0).to(gl.float16))
    fence_async_shared()
    mbarrier.arrive(bars.index(B_Q))


@gluon.jit
def fp8_shared_state():
    """The bf16 kernel's shared state with float16 boxes (the converter fills them) and
    256-column PVs: ``seesaw_layout.shared_state``'s tuple."""
    box: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BOX], gl.float16)
    return shared_state(box, box, 256, gl.float16)


@gluon.jit
def fp8_tile_converter(Q, KV8, bt_row, q_s, kv_s, rope_s, bars, q_row, q_rows, start, end,
                       num_steps, PAGE_SIZE: gl.constexpr, V32: gl.constexpr, g0=0,
                       PREFETCH_AHEAD: gl.constexpr = 1):
    """Q, then the tiles of tokens [start, end) in steps of two, converted in the order and
    under the barriers of ``seesaw.tile_loader`` (``g0``: the steps this program ran
    before, a range's earlier segments, which set the barrier phases). Each step asks L2
    for the pages ``PREFETCH_AHEAD`` steps ahead (the first step, for every step up to
    there)."""
    _convert_q(Q, q_s, bars, q_row, q_rows)
    for step in range(num_steps):
        g = g0 + step
        # A tile past the split's end (the second of an odd count) converts page 0's rows;
        # its warpgroup masks its scores and zeroes its values.
        tok_a = start + 2 * step * TILE
        tok_b = tok_a + TILE
        page_a = gl.load(bt_row + tok_a // PAGE_SIZE)
        page_b = gl.load(bt_row + tok_b // PAGE_SIZE, mask=tok_b < end, other=0)
        if PREFETCH_AHEAD > 1:
            if step == 0:
                for d in gl.static_range(1, PREFETCH_AHEAD):
                    _prefetch_step(KV8, bt_row, tok_a + 2 * d * TILE, end, PAGE_SIZE, V32)
        _prefetch_step(KV8, bt_row, tok_a + 2 * PREFETCH_AHEAD * TILE, end, PAGE_SIZE, V32)
        row_a = page_a.to(gl.int64) * PAGE_SIZE
        row_b = page_b.to(gl.int64) * PAGE_SIZE
        # At most two halves in registers (a third spills); each rope box is loaded once
        # its slot's left half is stored.
        left = _load_half(KV8, row_a, 0, V32)
        right = _load_half(KV8, row_a, 1, V32)
        if g > 0:
            mbarrier.wait(bars.index(B_FREE_OWN + 0), (g - 1) & 1)
        _store_any_half(left, kv_s, bars, 0, 0, V32)
        rope = _load_rope(KV8, row_a, V32)
        if g > 0:
            mbarrier.wait(bars.index(B_FREE_CROSS + 0), (g - 1) & 1)
        _store_any_half(right, kv_s, bars, 0, 1, V32)
        _store_rope(rope, rope_s, bars, 0)
        left = _load_half(KV8, row_b, 0, V32)
        right = _load_half(KV8, row_b, 1, V32)
        if g > 0:
            mbarrier.wait(bars.index(B_FREE_CROSS + 1), (g - 1) & 1)
        _store_any_half(left, kv_s, bars, 1, 0, V32)
        _store_rope(_load_rope(KV8, row_b, V32), rope_s, bars, 1)
        if g > 0:
            mbarrier.wait(bars.index(B_FREE_OWN + 1), (g - 1) & 1)
        _store_any_half(right, kv_s, bars, 1, 1, V32)


@gluon.jit
def _partitions(Q, KV8, KV_SCALE, bt_row, q_s, kv_s, rope_s, stats_s, bars, start, end,
                num_steps, qk_scale_log2, o_ptr, lse_ptr, stride_rows, stride_lse_rows,
                num_rows, q_row, q_rows, WRITE_LSE: gl.constexpr, ONE_SPLIT: gl.constexpr,
                PAGE_SIZE: gl.constexpr, V32: gl.constexpr, MULTI_TOKEN: gl.constexpr,
                first_limit, row0, rows_per_token, PREFETCH_AHEAD: gl.constexpr):
    """The two compute warpgroups and the converter of one program."""
    gl.warp_specialize([
        (warpgroup_even, (q_s, kv_s, rope_s, stats_s, bars, start, end, num_steps,
                           qk_scale_log2, o_ptr, lse_ptr, stride_rows, stride_lse_rows,
                           num_rows, WRITE_LSE, ONE_SPLIT, False, MULTI_TOKEN, first_limit,
                           row0, rows_per_token, 256, KV_SCALE)),
        (warpgroup_odd, (q_s, kv_s, rope_s, stats_s, bars, start, end, num_steps,
                          qk_scale_log2, o_ptr, lse_ptr, stride_rows, stride_lse_rows,
                          num_rows, WRITE_LSE, ONE_SPLIT, False, MULTI_TOKEN, first_limit,
                          row0, rows_per_token, 256, KV_SCALE)),
        (fp8_tile_converter, (Q, KV8, bt_row, q_s, kv_s, rope_s, bars, q_row, q_rows, start,
                              end, num_steps, PAGE_SIZE, V32, 0, PREFETCH_AHEAD)),
    ], [4, 4], [208, 96])  # the converter's registers come from the compute warpgroups


@gluon.jit
def seesaw_fp8_stage1_kernel(Q, KV8, KV_SCALE, BLOCK_TABLE, SEQ_LENS, OUT, LSE, PART_O,
                             PART_LSE, num_kv_splits, num_heads, q_rows, qk_scale_log2,
                             stride_bt_b, stride_o_b, stride_o_h, stride_lse_b,
                             stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h,
                             PAGE_SIZE: gl.constexpr, ONE_SPLIT: gl.constexpr,
                             WRITE_LSE: gl.constexpr, V32: gl.constexpr = False,
                             Q_LEN: gl.constexpr = 1, rows_per_token=1,
                             PREFETCH_AHEAD: gl.constexpr = 1):
    """``seesaw.seesaw_stage1_kernel`` over an fp8 cache (module docstring): same grid,
    splits, outputs and verify steps (``Q_LEN``); ``q_rows``: q's rows (batch x rows).
    Per-tensor: KV_SCALE, the cache's scale; ``V32``: a V3.2 cache (bytes, KV_SCALE
    None). ``PREFETCH_AHEAD``: the converter's L2 prefetch distance in steps (under
    trial)."""
    head_block = gl.program_id(0)
    bid = gl.program_id(1)
    split = gl.program_id(2)
    seq_len, start, end = split_bounds(SEQ_LENS, bid, split, num_kv_splits)
    if start < end:
        num_steps = gl.cdiv(gl.cdiv(end - start, TILE), 2)
        q_s, kv_s, rope_s, stats_s, bars = fp8_shared_state()
        h0 = head_block * ROWS
        o_ptr, stride_rows, lse_ptr, stride_lse_rows = program_outputs(
            OUT, LSE, PART_O, PART_LSE, bid, h0, split, stride_o_b, stride_o_h, stride_lse_b,
            stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, ONE_SPLIT)
        num_rows = gl.minimum(num_heads - h0, ROWS)
        # A verify step's causal limits; literals for one token, so the compute warpgroups
        # hold none of them.
        if Q_LEN > 1:
            _partitions(Q, KV8, KV_SCALE, BLOCK_TABLE + bid * stride_bt_b, q_s, kv_s, rope_s,
                        stats_s, bars, start, end, num_steps, qk_scale_log2, o_ptr, lse_ptr,
                        stride_rows, stride_lse_rows, num_rows, bid * num_heads + h0, q_rows,
                        WRITE_LSE, ONE_SPLIT, PAGE_SIZE, V32, True, seq_len - Q_LEN + 1, h0,
                        rows_per_token, PREFETCH_AHEAD)
        else:
            _partitions(Q, KV8, KV_SCALE, BLOCK_TABLE + bid * stride_bt_b, q_s, kv_s, rope_s,
                        stats_s, bars, start, end, num_steps, qk_scale_log2, o_ptr, lse_ptr,
                        stride_rows, stride_lse_rows, num_rows, bid * num_heads + h0, q_rows,
                        WRITE_LSE, ONE_SPLIT, PAGE_SIZE, V32, False, 0, 0, 1, PREFETCH_AHEAD)
    elif ONE_SPLIT:
        store_empty_request(OUT, LSE, bid, head_block, num_heads, stride_o_b, stride_o_h,
                            stride_lse_b, WRITE_LSE)


def runs_seesaw_fp8(q: torch.Tensor, kv_cache: torch.Tensor, kv_scale: torch.Tensor | None,
                    num_heads: int) -> bool:
    """The shapes this kernel takes (the caller checks the device): a per-tensor fp8 cache
    (576 wide, with its scale) or a V3.2 cache (656 bytes wide, no scale) of 64-token
    pages, bf16 q, both contiguous, heads a multiple of 64 or fewer than 64."""
    per_tensor = (kv_scale is not None and kv_cache.dtype == torch.float8_e4m3fn
                  and kv_cache.dim() == 3 and kv_cache.shape[2] == 576)
    v32 = (kv_scale is None and kv_cache.dtype == torch.uint8 and kv_cache.dim() == 3
           and kv_cache.shape[2] == 656)
    return ((per_tensor or v32) and q.dtype == torch.bfloat16 and kv_cache.shape[1] == 64
            and (num_heads % 64 == 0 or num_heads < 64)
            and q.is_contiguous() and kv_cache.is_contiguous())
