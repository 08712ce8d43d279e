"""Balanced split-KV MLA decode: equal chunks of the batch's tiles, partitioned on the device.

Algorithm: FlashInfer-style balanced chunking (persistent programs over variable-length
work items), planned by a kernel instead of the host, so a CUDA graph replays it with
any lengths. Split-KV gives every request the same split count, so one long request
among short ones sets the step time; here every work item has about the same size.

1. ``plan_work_items_kernel`` (one program) reads ``seq_lens[B]`` (0 = padding row)::

       tiles_b     = cdiv(len_b, BLOCK_N)
       chunk_tiles = max(MIN_CHUNK_TILES, cdiv(sum_b tiles_b, G))
       items_b     = cdiv(tiles_b, chunk_tiles)               # 0 for padding rows
       item_indptr = [0, items_0, items_0 + items_1, ...]     # B + 1 entries

   It also lists the requests the merge writes (``_store_merge_rows``)::

       merge_rows  = [count, b_0, b_1, ...]   # requests of other than one item, in order

   chunk_tiles >= total / G bounds the item count by G + B (the workspace's size). A
   program strided over G + B items runs two where the count passes G; with ``FIT_ITEMS``
   the planner bisects for the smallest chunk whose items fit in G (where the live
   requests are at most G) and takes it if it is at most 1.5x the plain chunk, so every
   program runs at most one.
2. ``balanced_stage1_kernel`` runs G persistent programs per head block; program g
   takes items g, g + G, ...; item i of request b covers tokens
   [(i - indptr[b]) * chunk, min(+chunk, len_b)) with chunk = chunk_tiles * BLOCK_N.
   A request with one item gets its final output (and LSE) here; otherwise the item
   writes a float32 partial (output, log2 LSE) to slot i.
3. ``balanced_merge_kernel`` merges slots indptr[b] .. indptr[b + 1] of the requests in
   ``merge_rows``: those of two or more items, and padding rows (no items: zeros and LSE
   -inf); stage 1 wrote a one-item request's output already. Its programs are
   persistent over (listed request, head block, dv block) units, so a step whose requests
   are mostly whole costs no program time per idle row, and no unit searches for its
   request.

Plans with ``tile_ranges`` cut the batch differently for the Gluon seesaw
(``plan_tile_ranges_kernel``): each persistent program takes an equal range of the
step's tiles across request boundaries, and a work item is a (request, program) segment;
with a ``CHARGE`` it cuts the same ranges by work, each request charged a few
tiles more than it holds. The merge is the same.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from graphbucket.kernels.attend import attend_tokens
from graphbucket.kernels.merge import (
    merge_partials,
    merge_partials_heads,
    merge_units_prefetched,
    store_merged,
    store_merged_heads,
)
from graphbucket.kernels.tiles import load_q, store_final


@triton.jit
def _total_tiles(SEQ_LENS, batch, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """The batch's tiles of BLOCK_N tokens (padding rows have none)."""
    total = 0
    for b0 in range(0, batch, BLOCK_B):
        offs = b0 + tl.arange(0, BLOCK_B)
        lens = tl.load(SEQ_LENS + offs, mask=offs < batch, other=0)
        total += tl.sum(tl.cdiv(lens, BLOCK_N), 0)
    return total


@triton.jit
def _item_count(SEQ_LENS, batch, chunk_tiles, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """The step's work items at ``chunk_tiles`` tiles per item."""
    items = 0
    for b0 in range(0, batch, BLOCK_B):
        offs = b0 + tl.arange(0, BLOCK_B)
        lens = tl.load(SEQ_LENS + offs, mask=offs < batch, other=0)
        items += tl.sum(tl.cdiv(tl.cdiv(lens, BLOCK_N), chunk_tiles), 0)
    return items


@triton.jit
def _fitted_chunk(SEQ_LENS, batch, num_programs, lo, BLOCK_N: tl.constexpr,
                  BLOCK_B: tl.constexpr):
    """The smallest chunk >= ``lo`` giving at most ``num_programs`` items, if it is at most
    1.5 ``lo``; else ``lo`` (and ``lo`` where no chunk fits: more live requests than
    programs). A longer fitted chunk makes every program's one item nearly as long as a
    request and leaves the SMs idle as the short ones finish, which costs more than the
    second items it removes. At a chunk of the longest request's tiles every live request
    is one item, so the search stays below that."""
    longest = 0
    for b0 in range(0, batch, BLOCK_B):
        offs = b0 + tl.arange(0, BLOCK_B)
        lens = tl.load(SEQ_LENS + offs, mask=offs < batch, other=0)
        longest = tl.maximum(longest, tl.max(tl.cdiv(lens, BLOCK_N), 0))
    plain = lo
    hi = tl.maximum(lo, longest)
    chunk = lo
    if _item_count(SEQ_LENS, batch, lo, BLOCK_N, BLOCK_B) > num_programs:
        if _item_count(SEQ_LENS, batch, hi, BLOCK_N, BLOCK_B) <= num_programs:
            # items(lo) > G >= items(hi); items is non-increasing in the chunk
            while lo + 1 < hi:
                mid = (lo + hi) // 2
                if _item_count(SEQ_LENS, batch, mid, BLOCK_N, BLOCK_B) <= num_programs:
                    hi = mid
                else:
                    lo = mid
            if 2 * hi <= 3 * plain:
                chunk = hi
    return chunk


@triton.jit
def _store_merge_rows(MERGE_ROWS, offs, mask, items, listed):
    """Appends this block's requests that the merge writes (those of other than one item)
    to MERGE_ROWS[1 + listed ...]; returns the new count. MERGE_ROWS[0] takes the count
    once the last block is listed."""
    merged = (mask & (items != 1)).to(tl.int32)
    tl.store(MERGE_ROWS + listed + tl.cumsum(merged, 0), offs, mask=merged != 0)
    return listed + tl.sum(merged, 0)


@triton.jit
def plan_work_items_kernel(SEQ_LENS, ITEM_INDPTR, CHUNK_TILES, MERGE_ROWS, batch, num_programs,
                           BLOCK_N: tl.constexpr, MIN_CHUNK_TILES: tl.constexpr,
                           BLOCK_B: tl.constexpr, FIT_ITEMS: tl.constexpr = False):
    total_tiles = _total_tiles(SEQ_LENS, batch, BLOCK_N, BLOCK_B)
    chunk_tiles = tl.maximum(tl.cdiv(total_tiles, num_programs), MIN_CHUNK_TILES)
    if FIT_ITEMS:
        chunk_tiles = _fitted_chunk(SEQ_LENS, batch, num_programs, chunk_tiles, BLOCK_N,
                                    BLOCK_B)
    tl.store(CHUNK_TILES, chunk_tiles)
    tl.store(ITEM_INDPTR, 0)
    carry = 0
    listed = 0
    for b0 in range(0, batch, BLOCK_B):
        offs = b0 + tl.arange(0, BLOCK_B)
        mask = offs < batch
        lens = tl.load(SEQ_LENS + offs, mask=mask, other=0)
        items = tl.cdiv(tl.cdiv(lens, BLOCK_N), chunk_tiles)
        tl.store(ITEM_INDPTR + 1 + offs, carry + tl.cumsum(items, 0), mask=mask)
        carry += tl.sum(items, 0)
        listed = _store_merge_rows(MERGE_ROWS, offs, mask, items, listed)
    tl.store(MERGE_ROWS, listed)


@triton.jit
def plan_tile_ranges_kernel(SEQ_LENS, TILE_INDPTR, ITEM_INDPTR, RANGE_TILES, RANGE_BOUNDS,
                            FIRST_PROGRAM, MERGE_ROWS, batch, num_programs,
                            BLOCK_N: tl.constexpr, MIN_RANGE_TILES: tl.constexpr,
                            BLOCK_B: tl.constexpr, CHARGE: tl.constexpr = 0,
                            BLOCK_P: tl.constexpr = 1, BOUNDS: tl.constexpr = False):
    """The partition of the Gluon seesaw over tile ranges: the batch's tiles in request
    order, each live request b counting ``units_b = CHARGE + tiles_b`` (its charge first,
    then its tiles), program p taking units [p * per, (p + 1) * per) with per =
    max(MIN_RANGE_TILES, cdiv(total units, G)). A request's segments are the programs from
    the one holding its first tile's unit to the one holding its last, so its partials are
    slots indptr[b] .. indptr[b + 1] as the balanced merge reads them::

        tile_indptr     = [0, tiles_0, tiles_0 + tiles_1, ...]
        first_program_b = (unit_start_b + CHARGE) // per
        segments_b      = (unit_end_b - 1) // per - first_program_b + 1   (0 if empty)
        item_indptr     = [0, segments_0, segments_0 + segments_1, ...]

    ``CHARGE`` 0 (equal tile ranges): program p runs tiles [p * per, (p + 1) * per), and
    ``per`` goes to RANGE_TILES. ``BOUNDS`` (a cut by work, ``charged_ranges``, any CHARGE): a unit
    x maps to the tile it reaches (the owner request's first tile plus x - its first unit -
    CHARGE, clamped to the request; a boundary inside a charge falls on the request's first
    tile, and the program before it may be empty); program p runs tiles [RANGE_BOUNDS[p],
    RANGE_BOUNDS[p + 1]) and FIRST_PROGRAM[b] numbers b's segments. Each program boundary
    inside a request's tiles adds one segment: at most G + (live requests) - 1. The
    merge's list takes the requests of other than one segment."""
    total_tiles = 0
    live = 0
    for b0 in range(0, batch, BLOCK_B):
        offs = b0 + tl.arange(0, BLOCK_B)
        tiles = tl.cdiv(tl.load(SEQ_LENS + offs, mask=offs < batch, other=0), BLOCK_N)
        total_tiles += tl.sum(tiles, 0)
        live += tl.sum((tiles > 0).to(tl.int32), 0)
    total_units = total_tiles + CHARGE * live
    per = tl.maximum(tl.cdiv(total_units, num_programs), MIN_RANGE_TILES)
    tl.store(RANGE_TILES, per)
    tl.store(TILE_INDPTR, 0)
    tl.store(ITEM_INDPTR, 0)
    tile_carry = 0
    unit_carry = 0
    item_carry = 0
    listed = 0
    for b0 in range(0, batch, BLOCK_B):
        offs = b0 + tl.arange(0, BLOCK_B)
        mask = offs < batch
        tiles = tl.cdiv(tl.load(SEQ_LENS + offs, mask=mask, other=0), BLOCK_N)
        units = tl.where(tiles > 0, tiles + CHARGE, 0)
        unit_ends = unit_carry + tl.cumsum(units, 0)
        first = (unit_ends - units + CHARGE) // per
        segments = tl.where(tiles > 0, (unit_ends - 1) // per - first + 1, 0)
        tl.store(TILE_INDPTR + 1 + offs, tile_carry + tl.cumsum(tiles, 0), mask=mask)
        tl.store(ITEM_INDPTR + 1 + offs, item_carry + tl.cumsum(segments, 0), mask=mask)
        if BOUNDS:
            tl.store(FIRST_PROGRAM + offs, tl.where(tiles > 0, first, 0), mask=mask)
        tile_carry += tl.sum(tiles, 0)
        unit_carry += tl.sum(units, 0)
        item_carry += tl.sum(segments, 0)
        listed = _store_merge_rows(MERGE_ROWS, offs, mask, segments, listed)
    tl.store(MERGE_ROWS, listed)
    if BOUNDS:
        # Programs x requests at once: a narrower scan keeps the tile in registers.
        _charged_bounds(SEQ_LENS, RANGE_BOUNDS, batch, num_programs, per, total_tiles,
                        total_units, BLOCK_N, CHARGE, 32, BLOCK_P)


@triton.jit
def _charged_bounds(SEQ_LENS, RANGE_BOUNDS, batch, num_programs, per, total_tiles,
                    total_units, BLOCK_N: tl.constexpr, CHARGE: tl.constexpr,
                    BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr):
    """RANGE_BOUNDS[p] for p in 0..G: the tile unit p * per reaches, found by its owner (the
    first request whose units end past it) through the largest unit and tile ends before it
    and the smallest tile end after it."""
    for p0 in range(0, num_programs + 1, BLOCK_P):
        progs = p0 + tl.arange(0, BLOCK_P)
        x = tl.minimum(progs * per, total_units)
        owner_unit = tl.zeros([BLOCK_P], dtype=tl.int32)
        owner_first_tile = tl.zeros([BLOCK_P], dtype=tl.int32)
        owner_end_tile = tl.full([BLOCK_P], 2147483647, dtype=tl.int32)
        tile_carry = 0
        unit_carry = 0
        for b0 in range(0, batch, BLOCK_B):
            offs = b0 + tl.arange(0, BLOCK_B)
            tiles = tl.cdiv(tl.load(SEQ_LENS + offs, mask=offs < batch, other=0), BLOCK_N)
            units = tl.where(tiles > 0, tiles + CHARGE, 0)
            unit_ends = unit_carry + tl.cumsum(units, 0)
            tile_ends = tile_carry + tl.cumsum(tiles, 0)
            before = unit_ends[None, :] <= x[:, None]
            after = (offs[None, :] < batch) & ~before
            owner_unit = tl.maximum(owner_unit,
                                    tl.max(tl.where(before, unit_ends[None, :], 0), 1))
            owner_first_tile = tl.maximum(owner_first_tile,
                                          tl.max(tl.where(before, tile_ends[None, :], 0), 1))
            owner_end_tile = tl.minimum(owner_end_tile, tl.min(
                tl.where(after, tile_ends[None, :], 2147483647), 1))
            tile_carry += tl.sum(tiles, 0)
            unit_carry += tl.sum(units, 0)
        into = tl.minimum(tl.maximum(x - owner_unit - CHARGE, 0),
                          owner_end_tile - owner_first_tile)
        bounds = tl.where(x >= total_units, total_tiles, owner_first_tile + into)
        tl.store(RANGE_BOUNDS + progs, bounds, mask=progs <= num_programs)


@triton.jit
def _find_request(ITEM_INDPTR, item, batch, BLOCK_B: tl.constexpr):
    """The request that owns ``item``: the count of requests whose items all precede it,
    #{j in 1..B : indptr[j] <= item} (requests with no items are skipped over)."""
    owner = 0
    for b0 in range(0, batch, BLOCK_B):
        offs = b0 + tl.arange(0, BLOCK_B)
        ends = tl.load(ITEM_INDPTR + 1 + offs, mask=offs < batch, other=2147483647)
        owner += tl.sum((ends <= item).to(tl.int32), 0)
    return owner


@triton.jit
def balanced_stage1_kernel(
    Q, KV, BLOCK_TABLE, SEQ_LENS, ITEM_INDPTR, CHUNK_TILES, OUT, LSE, PART_O, PART_LSE,
    KV_SCALE,
    batch, num_programs, num_heads, qk_scale_log2,
    stride_q_b, stride_q_h,
    stride_kv_page, stride_kv_tok,
    stride_bt_b,
    stride_o_b, stride_o_h,
    stride_lse_b,
    stride_po_i, stride_po_h,
    stride_pl_i,
    PAGE_SIZE: tl.constexpr,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr = "tf32",
    TOKEN_MAJOR: tl.constexpr = False,
    PAGE_AHEAD: tl.constexpr = False,
    SCALED: tl.constexpr = False,
    KV_FORMAT: tl.constexpr = "dense",
    REG_PREFETCH: tl.constexpr = False,
    DEQUANT: tl.constexpr = "float",
    RAW_VEC: tl.constexpr = 0,
):
    program = tl.program_id(0)
    head_block = tl.program_id(1)
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_c = tl.arange(0, KV_LORA_RANK)

    num_items = tl.load(ITEM_INDPTR + batch)
    chunk = tl.load(CHUNK_TILES) * BLOCK_N
    kv_scale = 1.0
    if SCALED:
        kv_scale = tl.load(KV_SCALE)
    for item in range(program, num_items, num_programs):
        bid = _find_request(ITEM_INDPTR, item, batch, BLOCK_B)
        first = tl.load(ITEM_INDPTR + bid)
        request_items = tl.load(ITEM_INDPTR + bid + 1) - first
        # Every item is non-empty: items_b = cdiv(tiles_b, chunk_tiles).
        start = (item - first) * chunk
        end = tl.minimum(start + chunk, tl.load(SEQ_LENS + bid))

        q_nope, q_rope = load_q(Q, bid, offs_h, mask_h, stride_q_b, stride_q_h,
                                KV_LORA_RANK, ROPE_DIM)
        acc, l_i, m_i = attend_tokens(
            q_nope, q_rope, KV, BLOCK_TABLE + bid * stride_bt_b, start, end,
            qk_scale_log2 * kv_scale,
            stride_kv_page, stride_kv_tok, PAGE_SIZE, KV_LORA_RANK, ROPE_DIM, BLOCK_H,
            BLOCK_N, TILE_IN_PAGE, DOT_PRECISION, TOKEN_MAJOR, PAGE_AHEAD, KV_FORMAT,
            REG_PREFETCH=REG_PREFETCH, DEQUANT=DEQUANT, RAW_VEC=RAW_VEC)
        lse_log2 = m_i + tl.log2(l_i)
        out = acc * (kv_scale / l_i)[:, None]  # kv_scale: see the split-KV stage 1
        if request_items == 1:
            store_final(OUT + bid * stride_o_b + offs_h[:, None] * stride_o_h + offs_c[None, :],
                        LSE + bid * stride_lse_b + offs_h, out, lse_log2, mask_h, WRITE_LSE)
        else:
            tl.store(PART_O + item * stride_po_i + offs_h[:, None] * stride_po_h
                     + offs_c[None, :], out, mask=mask_h[:, None])
            tl.store(PART_LSE + item * stride_pl_i + offs_h, lse_log2, mask=mask_h)


@triton.jit
def balanced_merge_kernel(
    PART_O, PART_LSE, ITEM_INDPTR, MERGE_ROWS, OUT, LSE,
    num_heads,
    stride_po_i, stride_po_h,
    stride_pl_i,
    stride_o_b, stride_o_h,
    stride_lse_b,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DV_BLOCKS: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    BLOCK_HM: tl.constexpr = 1,
    USE_GDC: tl.constexpr = False,
    MERGE_PREFETCH: tl.constexpr = False,
):
    """Persistent programs over the step's merge units (a request of the planner's
    ``MERGE_ROWS`` list, a block of BLOCK_HM heads, a block of BLOCK_DV columns), unit u by
    program u mod G: only requests with something to merge cost a program's time, however
    many rows the graph was captured for. A unit is a chain of dependent loads (list,
    indptr, LSEs, partials); BLOCK_HM > 1 lets one chain serve several heads; MERGE_PREFETCH
    loads the next unit's indices and each step's partials ahead of their use
    (``merge.merge_units_prefetched``)."""
    if USE_GDC:
        # Stage 1's partials are complete and visible past this point. Every program waits,
        # those with nothing to merge too: the grid then ends after stage 1, whose outputs
        # the kernels after the merge read.
        gdc_wait()
    if MERGE_PREFETCH:
        merge_units_prefetched(PART_O, PART_LSE, ITEM_INDPTR, MERGE_ROWS, OUT, LSE, num_heads,
                               stride_po_i, stride_po_h, stride_pl_i, stride_o_b, stride_o_h,
                               stride_lse_b, BLOCK_S, BLOCK_DV, DV_BLOCKS, WRITE_LSE,
                               BLOCK_HM)
        return
    head_blocks = tl.cdiv(num_heads, BLOCK_HM)
    per_request = head_blocks * DV_BLOCKS
    for unit in range(tl.program_id(0), tl.load(MERGE_ROWS) * per_request,
                      tl.num_programs(0)):
        bid = tl.load(MERGE_ROWS + 1 + unit // per_request)
        head = (unit % per_request) // DV_BLOCKS * BLOCK_HM
        dv_block = unit % DV_BLOCKS
        offs_dv = dv_block * BLOCK_DV + tl.arange(0, BLOCK_DV)
        first = tl.load(ITEM_INDPTR + bid)
        items = tl.load(ITEM_INDPTR + bid + 1) - first
        o_row = PART_O + first.to(tl.int64) * stride_po_i + head * stride_po_h
        lse_row = PART_LSE + first.to(tl.int64) * stride_pl_i + head
        # No items (padding): the merge of nothing gives zeros and LSE -inf.
        if BLOCK_HM == 1:
            acc, l_i, m_i = merge_partials(o_row, lse_row, stride_po_i, stride_pl_i, items,
                                           offs_dv, BLOCK_S, BLOCK_DV)
            store_merged(OUT + bid * stride_o_b + head * stride_o_h + offs_dv,
                         LSE + bid * stride_lse_b + head, acc, l_i, m_i, dv_block, WRITE_LSE)
        else:
            offs_h = tl.arange(0, BLOCK_HM)
            mask_h = head + offs_h < num_heads
            acc, l_i, m_i = merge_partials_heads(o_row, lse_row, stride_po_i, stride_po_h,
                                                 stride_pl_i, items, offs_h, mask_h, offs_dv,
                                                 BLOCK_S)
            store_merged_heads(OUT + bid * stride_o_b + head * stride_o_h,
                               LSE + bid * stride_lse_b + head, stride_o_h, acc, l_i, m_i,
                               offs_h, mask_h, offs_dv, dv_block, WRITE_LSE)
