"""The Gluon seesaw (``kernels/seesaw.py``) over balanced partitions of the step's tiles.

Two partitions, both computed on the device per step and merged by the balanced merge
(a work item writes a float32 partial, log2 LSE; a request's only item, its output):

- ``seesaw_balanced_stage1_kernel``: one program per work item (``kernels/balanced.py``'s
  chunks of a request); the hardware hands the next item to the SM that frees first.
- ``seesaw_range_stage1_kernel``: one persistent program per SM over an equal range of
  the batch's tiles in request order, across request boundaries
  (``plan_tile_ranges_kernel``); a work item is a (request, program) segment. Its loader
  brings the next segment's Q and tiles while the warpgroups finish the last one's, so a
  program streams pages without a gap between requests, and no program starts or ends
  mid-step; with ``CHARGED`` the ranges are a charged cut's (equal in tiles plus a charge
  per request, ``plan_tile_ranges_kernel`` with a ``CHARGE``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.language.extra.cuda import gdc_launch_dependents

from graphbucket.kernels.seesaw import tile_loader
from graphbucket.kernels.seesaw_fp8 import fp8_shared_state, fp8_tile_converter
from graphbucket.kernels.seesaw_layout import B_DESC, B_QFREE, ROWS, TILE, shared_state
from graphbucket.kernels.seesaw_step import warpgroup_compute


@gluon.jit
def _item_owner(ITEM_INDPTR, item, batch, BLOCK_B: gl.constexpr):
    """The request owning work ``item``: #{j in 1..B : indptr[j] <= item}."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    owner = 0
    for b0 in range(0, batch, BLOCK_B):
        offs = b0 + gl.arange(0, BLOCK_B, layout)
        ends = gl.load(ITEM_INDPTR + 1 + offs, mask=offs < batch, other=2147483647)
        owner += gl.sum((ends <= item).to(gl.int32), axis=0)
    return owner


@gluon.jit
def seesaw_balanced_stage1_kernel(q_desc, kv_desc, BLOCK_TABLE, SEQ_LENS, ITEM_INDPTR,
                                  CHUNK_TILES, PART_O, PART_LSE, OUT, LSE, batch, num_heads,
                                  qk_scale_log2, stride_bt_b, stride_po_i, stride_po_h,
                                  stride_pl_i, stride_o_b, stride_o_h, stride_lse_b,
                                  PAGE_SIZE: gl.constexpr, BLOCK_B: gl.constexpr,
                                  WRITE_LSE: gl.constexpr = False, PV_COLS: gl.constexpr = 256,
                                  KV_FP8: gl.constexpr = 0, Q=None, KV8=None, KV_SCALE=None,
                                  q_rows=0, LAZY_RESCALE: gl.constexpr = False):
    """The seesaw over balanced work items (``kernels/balanced.py``'s partition of the
    step's tiles, computed on the device): grid (head blocks, most items), program i takes
    item i when the step has that many. A request of one item gets its output in OUT (and
    with ``WRITE_LSE`` its LSE in LSE) here, which the merge then leaves alone; every other
    item writes a float32 partial (log2 LSE) for the balanced merge. ``PV_COLS``: the PV
    width (``seesaw_step``); ``LAZY_RESCALE``: ``seesaw_lazy``'s step (the launchers' default
    over bf16).
    ``KV_FP8``: an fp8 cache, as ``seesaw_range_stage1_kernel`` takes it."""
    head_block = gl.program_id(0)
    item = gl.program_id(1)
    if item < gl.load(ITEM_INDPTR + batch):
        bid = _item_owner(ITEM_INDPTR, item, batch, BLOCK_B)
        chunk = gl.load(CHUNK_TILES) * TILE
        start = (item - gl.load(ITEM_INDPTR + bid)) * chunk
        end = gl.minimum(start + chunk, gl.load(SEQ_LENS + bid))  # items are non-empty
        num_steps = gl.cdiv(gl.cdiv(end - start, TILE), 2)
        h0 = head_block * ROWS
        o_ptr = PART_O + item * stride_po_i + h0 * stride_po_h
        lse_ptr = PART_LSE + item * stride_pl_i + h0
        num_rows = gl.minimum(num_heads - h0, ROWS)
        whole = (gl.load(ITEM_INDPTR + bid + 1) - gl.load(ITEM_INDPTR + bid) == 1).to(gl.int32)
        out_ptr = OUT + bid * stride_o_b + h0 * stride_o_h
        out_lse_ptr = LSE + bid * stride_lse_b + h0
        q_s, kv_s, rope_s, stats_s, bars = _shared_state(q_desc, kv_desc, PV_COLS, KV_FP8)
        pv: gl.constexpr = 256 if KV_FP8 else PV_COLS
        gl.warp_specialize([
            (_item_even, (q_s, kv_s, rope_s, stats_s, bars, start, end, num_steps,
                          qk_scale_log2, o_ptr, lse_ptr, stride_po_h, num_rows, whole, out_ptr,
                          out_lse_ptr, stride_o_h, WRITE_LSE, pv, KV_SCALE, LAZY_RESCALE)),
            (_item_odd, (q_s, kv_s, rope_s, stats_s, bars, start, end, num_steps,
                         qk_scale_log2, o_ptr, lse_ptr, stride_po_h, num_rows, whole, out_ptr,
                         out_lse_ptr, stride_o_h, WRITE_LSE, pv, KV_SCALE, LAZY_RESCALE)),
            (tile_source, (q_desc, kv_desc, Q, KV8, BLOCK_TABLE + bid * stride_bt_b, q_s,
                           kv_s, rope_s, bars, bid * num_heads + h0, q_rows, start, end,
                           num_steps, PAGE_SIZE, 0, pv, KV_FP8)),
        ], [4, 4], [208, 96] if KV_FP8 else [240, 24])  # fp8: the converter's registers


@gluon.jit
def _item_even(q_s, kv_s, rope_s, stats_s, bars, start, end, num_steps, qk_scale_log2, o_ptr,
               lse_ptr, stride_po_h, num_rows, whole, out_ptr, out_lse_ptr, stride_o_h,
               WRITE_LSE: gl.constexpr, PV_COLS: gl.constexpr, kv_scale_ptr=None,
               LAZY_RESCALE: gl.constexpr = False):
    warpgroup_compute(q_s, kv_s, rope_s, stats_s, bars, start, end, num_steps, qk_scale_log2,
                      o_ptr, lse_ptr, stride_po_h, 1, num_rows, False, False, 0, final=whole,
                      out_ptr=out_ptr, out_lse_ptr=out_lse_ptr, stride_out_h=stride_o_h,
                      FINAL=True, WRITE_OUT_LSE=WRITE_LSE, PV_COLS=PV_COLS,
                      kv_scale_ptr=kv_scale_ptr, LAZY_RESCALE=LAZY_RESCALE)


@gluon.jit
def _item_odd(q_s, kv_s, rope_s, stats_s, bars, start, end, num_steps, qk_scale_log2, o_ptr,
              lse_ptr, stride_po_h, num_rows, whole, out_ptr, out_lse_ptr, stride_o_h,
              WRITE_LSE: gl.constexpr, PV_COLS: gl.constexpr, kv_scale_ptr=None,
              LAZY_RESCALE: gl.constexpr = False):
    warpgroup_compute(q_s, kv_s, rope_s, stats_s, bars, start, end, num_steps, qk_scale_log2,
                      o_ptr, lse_ptr, stride_po_h, 1, num_rows, False, False, 1, final=whole,
                      out_ptr=out_ptr, out_lse_ptr=out_lse_ptr, stride_out_h=stride_o_h,
                      FINAL=True, WRITE_OUT_LSE=WRITE_LSE, PV_COLS=PV_COLS,
                      kv_scale_ptr=kv_scale_ptr, LAZY_RESCALE=LAZY_RESCALE)


@gluon.jit
def _shared_state(q_desc, kv_desc, PV_COLS: gl.constexpr, KV_FP8: gl.constexpr):
    """A program's shared state: the descriptors' layouts for a bf16 cache, the fp8
    converter's float16 boxes for an fp8 one."""
    if KV_FP8:
        state = fp8_shared_state()
    else:
        q_layout: gl.constexpr = q_desc.layout
        kv_layout: gl.constexpr = kv_desc.layout
        state = shared_state(q_layout, kv_layout, PV_COLS)
    return state


@gluon.jit
def tile_source(q_desc, kv_desc, Q, KV8, bt_row, q_s, kv_s, rope_s, bars, q_row, q_rows, start,
                end, num_steps, PAGE_SIZE: gl.constexpr, g0, PV_COLS: gl.constexpr,
                KV_FP8: gl.constexpr):
    """Q and the tiles of tokens [start, end) into shared memory: by the TMA loader
    (``seesaw.tile_loader``) from a bf16 cache, or by the fp8 converter
    (``seesaw_fp8.fp8_tile_converter``; ``KV_FP8`` 1 per-tensor, 2 V3.2)."""
    if KV_FP8:
        fp8_tile_converter(Q, KV8, bt_row, q_s, kv_s, rope_s, bars, q_row, q_rows, start, end,
                           num_steps, PAGE_SIZE, KV_FP8 == 2, g0)
    else:
        tile_loader(q_desc, kv_desc, bt_row, q_s, kv_s, rope_s, bars, q_row, start, end,
                    num_steps, PAGE_SIZE, g0, PV_COLS)


@gluon.jit
def _requests_meeting(TILE_INDPTR, first, last, batch, BLOCK_B: gl.constexpr):
    """How many requests have tiles in [first, last): the range's segments. Requests with
    no tiles (padding) lie between others without being one."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    count = 0
    for b0 in range(0, batch, BLOCK_B):
        offs = b0 + gl.arange(0, BLOCK_B, layout)
        live = offs < batch
        starts = gl.load(TILE_INDPTR + offs, mask=live, other=0)
        ends = gl.load(TILE_INDPTR + 1 + offs, mask=live, other=0)
        count += gl.sum(((starts < last) & (ends > first) & (ends > starts)).to(gl.int32),
                        axis=0)
    return count


@gluon.jit
def _segment(TILE_INDPTR, SEQ_LENS, t, last, batch, BLOCK_B: gl.constexpr):
    """The segment of a tile range that starts at tile ``t``: its request, that request's
    first tile, the segment's tokens [start, end) and its steps."""
    bid = _item_owner(TILE_INDPTR, t, batch, BLOCK_B)
    request_first = gl.load(TILE_INDPTR + bid)
    segment_last = gl.minimum(last, gl.load(TILE_INDPTR + bid + 1))
    start = (t - request_first) * TILE
    end = gl.minimum((segment_last - request_first) * TILE, gl.load(SEQ_LENS + bid))
    return bid, request_first, segment_last, start, end, gl.cdiv(segment_last - t, 2)


# A segment's descriptor, written by the loader into one of two shared-memory slots: the
# warpgroups read it there instead of walking the segments themselves, so their step loop
# carries no state of the segment loop.
D_START = gl.constexpr(0)
D_END = gl.constexpr(1)
D_STEPS = gl.constexpr(2)
D_ITEM = gl.constexpr(3)
D_G0 = gl.constexpr(4)
D_FINAL = gl.constexpr(5)  # 1 where the segment is its request's only one
D_BID = gl.constexpr(6)    # the segment's request
DESC_WORDS = gl.constexpr(8)


@gluon.jit
def _range_loader(q_desc, kv_desc, BLOCK_TABLE, SEQ_LENS, TILE_INDPTR, ITEM_INDPTR,
                  FIRST_PROGRAM, q_s, kv_s, rope_s, bars, desc_s, first, last, segments, per,
                  program, batch, num_heads, h0, stride_bt_b, PAGE_SIZE: gl.constexpr,
                  BLOCK_B: gl.constexpr, CHARGED: gl.constexpr, PV_COLS: gl.constexpr,
                  KV_FP8: gl.constexpr, Q, KV8, q_rows):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    words = gl.arange(0, DESC_WORDS, layout)
    t = first
    g0 = 0
    for seg in range(segments):
        bid, request_first, segment_last, start, end, num_steps = _segment(
            TILE_INDPTR, SEQ_LENS, t, last, batch, BLOCK_B)
        # Partials of a request are its segments in program order (the planner's count).
        if CHARGED:
            item = gl.load(ITEM_INDPTR + bid) + program - gl.load(FIRST_PROGRAM + bid)
        else:
            item = gl.load(ITEM_INDPTR + bid) + program - request_first // per
        # Slot seg % 2 was last read at segment seg - 2, whose steps the loads below wait on.
        desc = gl.where(words == D_START, start, gl.where(words == D_END, end, gl.where(
            words == D_STEPS, num_steps, gl.where(words == D_ITEM, item, g0))))
        # A request left whole (one segment) gets its output here, not a partial.
        whole = (gl.load(ITEM_INDPTR + bid + 1) - gl.load(ITEM_INDPTR + bid) == 1)
        desc = gl.where(words == D_FINAL, whole.to(gl.int32),
                        gl.where(words == D_BID, bid, desc))
        desc_s.index(seg % 2).store(desc)
        mbarrier.arrive(bars.index(B_DESC + seg % 2))
        if seg > 0:  # the next request's Q once both warpgroups' last QK has read this one
            mbarrier.wait(bars.index(B_QFREE), (seg - 1) & 1)
        tile_source(q_desc, kv_desc, Q, KV8, BLOCK_TABLE + bid * stride_bt_b, q_s, kv_s,
                    rope_s, bars, bid * num_heads + h0, q_rows, start, end, num_steps,
                    PAGE_SIZE, g0, PV_COLS, KV_FP8)
        g0 += num_steps
        t = segment_last


@gluon.jit
def _word(desc, words, which: gl.constexpr):
    return gl.max(gl.where(words == which, desc, -2147483647), axis=0)


@gluon.jit
def _range_compute(q_s, kv_s, rope_s, stats_s, bars, desc_s, PART_O, PART_LSE, OUT, LSE, segments,
                   num_heads, qk_scale_log2, stride_po_i, stride_po_h, stride_pl_i, stride_o_b,
                   stride_o_h, stride_lse_b, PARITY: gl.constexpr,
                   WRITE_LSE: gl.constexpr, PV_COLS: gl.constexpr, kv_scale_ptr,
                   LAZY_RESCALE: gl.constexpr = False):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    words = gl.arange(0, DESC_WORDS, layout)
    for seg in range(segments):
        mbarrier.wait(bars.index(B_DESC + seg % 2), (seg // 2) & 1)
        desc = desc_s.index(seg % 2).load(layout)
        h0 = gl.program_id(0) * ROWS
        item = _word(desc, words, D_ITEM)
        o_ptr = PART_O + item * stride_po_i + h0 * stride_po_h
        lse_ptr = PART_LSE + item * stride_pl_i + h0
        num_rows = gl.minimum(num_heads - h0, ROWS)
        # A request left whole (D_FINAL): its output and LSE, not a partial.
        bid = _word(desc, words, D_BID)
        warpgroup_compute(q_s, kv_s, rope_s, stats_s, bars, _word(desc, words, D_START),
                          _word(desc, words, D_END), _word(desc, words, D_STEPS),
                          qk_scale_log2, o_ptr, lse_ptr, stride_po_h, 1, num_rows, False,
                          False, PARITY, _word(desc, words, D_G0), seg & 1, True,
                          _word(desc, words, D_FINAL),
                          OUT + bid * stride_o_b + h0 * stride_o_h,
                          LSE + bid * stride_lse_b + h0, stride_o_h, True, WRITE_LSE,
                          PV_COLS=PV_COLS, kv_scale_ptr=kv_scale_ptr,
                          LAZY_RESCALE=LAZY_RESCALE)


@gluon.jit
def _range_even(q_s, kv_s, rope_s, stats_s, bars, desc_s, PART_O, PART_LSE, OUT, LSE, segments,
                num_heads, qk_scale_log2, stride_po_i, stride_po_h, stride_pl_i, stride_o_b,
                stride_o_h, stride_lse_b, WRITE_LSE: gl.constexpr,
                PV_COLS: gl.constexpr, kv_scale_ptr=None, LAZY_RESCALE: gl.constexpr = False):
    _range_compute(q_s, kv_s, rope_s, stats_s, bars, desc_s, PART_O, PART_LSE, OUT, LSE, segments,
                   num_heads, qk_scale_log2, stride_po_i, stride_po_h, stride_pl_i, stride_o_b,
                   stride_o_h, stride_lse_b, 0, WRITE_LSE, PV_COLS,
                   kv_scale_ptr, LAZY_RESCALE)


@gluon.jit
def _range_odd(q_s, kv_s, rope_s, stats_s, bars, desc_s, PART_O, PART_LSE, OUT, LSE, segments,
               num_heads, qk_scale_log2, stride_po_i, stride_po_h, stride_pl_i, stride_o_b,
               stride_o_h, stride_lse_b, WRITE_LSE: gl.constexpr,
               PV_COLS: gl.constexpr, kv_scale_ptr=None, LAZY_RESCALE: gl.constexpr = False):
    _range_compute(q_s, kv_s, rope_s, stats_s, bars, desc_s, PART_O, PART_LSE, OUT, LSE, segments,
                   num_heads, qk_scale_log2, stride_po_i, stride_po_h, stride_pl_i, stride_o_b,
                   stride_o_h, stride_lse_b, 1, WRITE_LSE, PV_COLS,
                   kv_scale_ptr, LAZY_RESCALE)


@gluon.jit
def seesaw_range_stage1_kernel(q_desc, kv_desc, BLOCK_TABLE, SEQ_LENS, TILE_INDPTR,
                               ITEM_INDPTR, RANGE_TILES, RANGE_BOUNDS, FIRST_PROGRAM, PART_O,
                               PART_LSE, OUT, LSE, batch, num_heads, qk_scale_log2,
                               stride_bt_b, stride_po_i, stride_po_h, stride_pl_i, stride_o_b,
                               stride_o_h, stride_lse_b, PAGE_SIZE: gl.constexpr,
                               BLOCK_B: gl.constexpr, CHARGED: gl.constexpr = False,
                               WRITE_LSE: gl.constexpr = False, PV_COLS: gl.constexpr = 256,
                               KV_FP8: gl.constexpr = 0, Q=None, KV8=None, KV_SCALE=None,
                               q_rows=0, LAZY_RESCALE: gl.constexpr = False):
    """The seesaw on persistent programs over equal ranges of the step's tiles
    (``kernels.balanced.plan_tile_ranges_kernel``): grid (head blocks, programs); program p
    takes the batch's 64-token tiles [p * per, (p + 1) * per) in request order, across
    request boundaries, one partial per (request, program) segment; a request the cut
    leaves whole (one segment) gets its output in OUT (and with ``WRITE_LSE`` its LSE in
    LSE) here, which the merge then leaves alone. The loader brings the next segment's
    tiles while the warpgroups finish the last one's, so the stream of pages does not stop
    between requests; the balanced merge combines the partials. ``CHARGED``: the ranges of
    a charged cut (``plan_tile_ranges_kernel`` with a ``CHARGE``), program p's tiles
    [RANGE_BOUNDS[p], RANGE_BOUNDS[p + 1]) and a request's first program in
    FIRST_PROGRAM. ``PV_COLS``: the PV width (``seesaw_step``); ``LAZY_RESCALE``:
    ``seesaw_lazy``'s step (the launchers' default over bf16). ``KV_FP8``: an fp8 cache, 1
    per-tensor (KV_SCALE its scale), 2 V3.2, read by ``seesaw_fp8``'s converter from Q (bf16,
    q_rows rows) and KV8 instead of the descriptors (None), with 256-column PVs."""
    head_block = gl.program_id(0)
    program = gl.program_id(1)
    if CHARGED:
        # The merge (a programmatic dependent launch) may start its programs now: they wait
        # on the device for this grid's partials instead of behind a kernel boundary.
        gdc_launch_dependents()
    per = gl.load(RANGE_TILES)  # unused by a charged cut: FIRST_PROGRAM numbers segments
    if CHARGED:
        first = gl.load(RANGE_BOUNDS + program)
        last = gl.load(RANGE_BOUNDS + program + 1)
    else:
        first = program * per
        last = gl.minimum(first + per, gl.load(TILE_INDPTR + batch))
    if first < last:
        segments = _requests_meeting(TILE_INDPTR, first, last, batch, BLOCK_B)
        q_s, kv_s, rope_s, stats_s, bars = _shared_state(q_desc, kv_desc, PV_COLS, KV_FP8)
        desc_s = gl.allocate_shared_memory(
            gl.int32, [2, DESC_WORDS],
            gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
        h0 = head_block * ROWS
        pv: gl.constexpr = 256 if KV_FP8 else PV_COLS
        gl.warp_specialize([
            (_range_even, (q_s, kv_s, rope_s, stats_s, bars, desc_s, PART_O, PART_LSE, OUT, LSE,
                           segments, num_heads, qk_scale_log2, stride_po_i, stride_po_h,
                           stride_pl_i, stride_o_b, stride_o_h, stride_lse_b, WRITE_LSE,
                           pv, KV_SCALE, LAZY_RESCALE)),
            (_range_odd, (q_s, kv_s, rope_s, stats_s, bars, desc_s, PART_O, PART_LSE, OUT, LSE,
                          segments, num_heads, qk_scale_log2, stride_po_i, stride_po_h,
                          stride_pl_i, stride_o_b, stride_o_h, stride_lse_b, WRITE_LSE,
                          pv, KV_SCALE, LAZY_RESCALE)),
            (_range_loader, (q_desc, kv_desc, BLOCK_TABLE, SEQ_LENS, TILE_INDPTR, ITEM_INDPTR,
                             FIRST_PROGRAM, q_s, kv_s, rope_s, bars, desc_s, first, last,
                             segments, per, program, batch, num_heads, h0, stride_bt_b, PAGE_SIZE,
                             BLOCK_B, CHARGED, pv, KV_FP8, Q, KV8, q_rows)),
        ], [4, 4], [208, 96] if KV_FP8 else [240, 24])  # fp8: the converter's registers
