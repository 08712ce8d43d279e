"""The Gluon seesaw's compute warpgroups (``kernels/seesaw.py``): a step's QK over the
boxes as they land, the softmax hand-offs between the two warpgroups, the PVs and the
epilogue, in the default order or the one-rescale order (slower, kept to compare), for one
query token or a verify step's q_len tokens per request.

A warpgroup's O (64 rows x its 256 value columns, float32) is a tuple of accumulators
``PV_COLS`` wide: four of 64 columns, each PV four m64n64k16 per 16 tokens; or (256, the
default) one, each PV one m64n256k16 over the four boxes read as one operand
(``seesaw_layout.value_halves``), so P is read once instead of four times."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from graphbucket.kernels.seesaw_handoff import (
    publish_tile_a,
    publish_tile_b,
    tile_a_max,
    tile_b_stats,
)
from graphbucket.kernels.seesaw_layout import (
    B_FREE_CROSS,
    B_FREE_OWN,
    B_MA,
    B_MB,
    B_PA,
    B_PB,
    B_Q,
    B_QFREE,
    B_READY,
    BOX,
    CHUNKS,
    HALF_CHUNKS,
    NUM_STATS,
    ROWS,
    S_MA,
    S_MB,
    S_SUM_A,
    S_SUM_B,
    TILE,
    VALUE_BOXES,
    rope_box,
    value_box,
)
from graphbucket.kernels.seesaw_lazy import lazy_step
from graphbucket.kernels.seesaw_pv import finite_max, o_scale, pv, pv_pair


@gluon.jit
def _qk_boxes(q_s, kv_s, bars, slot, phase, s, FIRST: gl.constexpr, COUNT: gl.constexpr,
              PV_COLS: gl.constexpr):
    # A loop, not an unrolled sequence: unrolled, the shared-memory descriptors were hoisted
    # out of the step loop and spilled.
    for i in range(COUNT):
        box = FIRST + i
        mbarrier.wait(bars.index(B_READY + slot * CHUNKS + box), phase)
        s = warpgroup_mma(q_s.index(box), value_box(kv_s, slot, box, PV_COLS).permute((1, 0)),
                          s, is_async=True)
    return s


@gluon.jit
def _qk_rope(q_s, rope_s, bars, slot, phase, s):
    """The rope box's QK where it has its own allocation (``PV_COLS`` 256)."""
    mbarrier.wait(bars.index(B_READY + slot * CHUNKS + VALUE_BOXES), phase)
    return warpgroup_mma(q_s.index(VALUE_BOXES), rope_s.index(slot).permute((1, 0)), s,
                         is_async=True)


@gluon.jit
def _scores(q_s, kv_s, rope_s, bars, phase, start, end, step, PARITY: gl.constexpr,
            layout: gl.constexpr, row_limit=None, low_limit=0, MULTI_TOKEN: gl.constexpr = False,
            PV_COLS: gl.constexpr = 64):
    """S of this warpgroup's tile (slot PARITY), unscaled, tokens past ``end`` at -inf;
    ``MULTI_TOKEN``: past each row's ``row_limit`` too (a verify step's causal limit; the
    smallest of them ``low_limit``).
    Boxes in the order the loader issues them: tile A's left half, then its right half and
    rope box; tile B's left half and rope box, then its right half (freed last, by WG1's
    own second PV), so WG1's first boxes are the ones that landed earliest. Where the rope
    box shares the value boxes' allocation (``PV_COLS`` 64) it is the loops' ninth box."""
    s = warpgroup_mma_init(gl.zeros([ROWS, TILE], gl.float32, layout))
    s = _qk_boxes(q_s, kv_s, bars, PARITY, phase, s, 0, HALF_CHUNKS, PV_COLS)
    if PV_COLS == 256:
        if PARITY == 0:
            s = _qk_boxes(q_s, kv_s, bars, PARITY, phase, s, HALF_CHUNKS, HALF_CHUNKS, PV_COLS)
            s = _qk_rope(q_s, rope_s, bars, PARITY, phase, s)
        else:
            s = _qk_rope(q_s, rope_s, bars, PARITY, phase, s)
            s = _qk_boxes(q_s, kv_s, bars, PARITY, phase, s, HALF_CHUNKS, HALF_CHUNKS, PV_COLS)
    elif PARITY == 0:
        s = _qk_boxes(q_s, kv_s, bars, PARITY, phase, s, HALF_CHUNKS, HALF_CHUNKS + 1, PV_COLS)
    else:
        s = _qk_boxes(q_s, kv_s, bars, PARITY, phase, s, 2 * HALF_CHUNKS, 1, PV_COLS)
        s = _qk_boxes(q_s, kv_s, bars, PARITY, phase, s, HALF_CHUNKS, HALF_CHUNKS, PV_COLS)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    first = start + (2 * step + PARITY) * TILE
    if MULTI_TOKEN:
        if first + TILE > gl.minimum(end, low_limit):
            tok = first + gl.arange(0, TILE, gl.SliceLayout(0, layout))
            s = gl.where((tok[None, :] < end) & (tok[None, :] < row_limit[:, None]), s,
                         float("-inf"))
    elif first + TILE > end:  # only a split's last tiles hold tokens past its end
        tok = first + gl.arange(0, TILE, gl.SliceLayout(0, layout))
        s = gl.where(tok[None, :] < end, s, float("-inf"))
    return s


@gluon.jit
def _zero_tail(kv_s, slot, valid, PV_COLS: gl.constexpr):
    """Zero the value rows at and past ``valid`` of the tile in ``slot``: P is 0 there, but
    0 x NaN is NaN, and a cache's unwritten rows may hold anything. Whole 128-byte rows, so
    the swizzle (within a row) does not matter."""
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    keep = gl.arange(0, TILE, gl.SliceLayout(1, rows_layout))[:, None] < valid
    for c in gl.static_range(VALUE_BOXES):
        box = value_box(kv_s, slot, c, PV_COLS)
        box.store(gl.where(keep, box.load(rows_layout), 0.0).to(box.dtype))
    fence_async_shared()  # the stores before the wgmma reads (and the loader's next TMA)


@gluon.jit
def _o_zeros(mma_o: gl.constexpr, PV_COLS: gl.constexpr):
    if PV_COLS == 256:
        return (gl.zeros([ROWS, HALF_CHUNKS * BOX], gl.float32, mma_o),)
    else:
        return (gl.zeros([ROWS, BOX], gl.float32, mma_o), gl.zeros([ROWS, BOX], gl.float32, mma_o),
                gl.zeros([ROWS, BOX], gl.float32, mma_o), gl.zeros([ROWS, BOX], gl.float32, mma_o))


@gluon.jit
def _one_rescale_step(s, kv_s, rope_s, stats_s, bars, phase, st, m_i, l_i, o, qk_scale_log2,
                      PARITY: gl.constexpr, mma: gl.constexpr, mma_o: gl.constexpr,
                      MULTI_TOKEN: gl.constexpr = False, PV_COLS: gl.constexpr = 64):
    """A step with both tiles' P against the step's final max m_B, so that each warpgroup
    rescales O once, by 2^(m - m_B), and issues its two PVs back to back. WG0
    exponentiates S_A against m_A at once (while WG1's QK may still run), then scales P_A
    by WG1's 2^(m_A - m_B): 64 columns in registers instead of a second pass over O's 256.
    Hand-offs: m_A (WG0 -> WG1), m_B (WG1 -> WG0), P_A and its row sum, P_B and its row
    sum, through mbarriers as in the two-rescale step."""
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    rows: gl.constexpr = gl.SliceLayout(1, mma)
    p_box = rope_box(kv_s, rope_s, PARITY, PV_COLS)
    if PARITY == 0:
        # A holds a live token (for every row but a verify step's early ones).
        m_a = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale_log2)
        stats_s.index(st + S_MA).store(m_a)
        mbarrier.arrive(bars.index(B_MA))
        m_ae = finite_max(m_a) if MULTI_TOKEN else m_a
        p32 = gl.exp2(s * qk_scale_log2 - m_ae[:, None])
        mbarrier.wait(bars.index(B_MB), phase)
        m_b = stats_s.index(st + S_MB).load(rows)
        m_e = finite_max(m_b) if MULTI_TOKEN else m_b
        p32 = p32 * gl.exp2(m_a - m_e)[:, None]
    else:
        mbarrier.wait(bars.index(B_MA), phase)
        m_a = stats_s.index(st + S_MA).load(rows)
        # Tile B may lie past the end (all -inf): then m_b = m_a.
        m_b = gl.maximum(m_a, gl.max(s, axis=1) * qk_scale_log2)
        stats_s.index(st + S_MB).store(m_b)
        mbarrier.arrive(bars.index(B_MB))
        m_e = finite_max(m_b) if MULTI_TOKEN else m_b
        p32 = gl.exp2(s * qk_scale_log2 - m_e[:, None])
    own_sum = gl.sum(p32, axis=1)
    p = p32.to(kv_s.dtype)
    p_box.store(p)
    stats_s.index(st + S_SUM_A + PARITY * (S_SUM_B - S_SUM_A)).store(own_sum)
    fence_async_shared()
    mbarrier.arrive(bars.index(B_PA + PARITY * (B_PB - B_PA)))
    alpha = gl.exp2(m_i - m_e)
    o = o_scale(o, alpha, mma_o, PV_COLS)
    if PARITY == 0:
        mbarrier.wait(bars.index(B_PB), phase)
        other_sum = stats_s.index(st + S_SUM_B).load(rows)
        o = pv_pair(gl.convert_layout(p, a_op), rope_box(kv_s, rope_s, 1, PV_COLS), kv_s, o, 0,
                     PV_COLS)
        mbarrier.arrive(bars.index(B_FREE_OWN + 0))
        mbarrier.arrive(bars.index(B_FREE_CROSS + 1))
    else:
        mbarrier.wait(bars.index(B_PA), phase)
        other_sum = stats_s.index(st + S_SUM_A).load(rows)
        o = pv_pair(rope_box(kv_s, rope_s, 0, PV_COLS), gl.convert_layout(p, a_op), kv_s, o,
                     HALF_CHUNKS, PV_COLS)
        mbarrier.arrive(bars.index(B_FREE_CROSS + 0))
        mbarrier.arrive(bars.index(B_FREE_OWN + 1))
    l_i = l_i * alpha + own_sum + other_sum
    return m_b, l_i, o


@gluon.jit
def warpgroup_compute(q_s, kv_s, rope_s, stats_s, bars, start, end, num_steps, qk_scale_log2,
             o_ptr, lse_ptr, stride_o_h, stride_lse_h, num_rows, WRITE_LSE: gl.constexpr,
             ONE_SPLIT: gl.constexpr, PARITY: gl.constexpr, g0=0, q_phase=0,
             RANGE: gl.constexpr = False, final=0, out_ptr=None, out_lse_ptr=None,
             stride_out_h=0, FINAL: gl.constexpr = False, WRITE_OUT_LSE: gl.constexpr = False,
             ONE_RESCALE: gl.constexpr = False, MULTI_TOKEN: gl.constexpr = False,
             first_limit=0, row0=0, rows_per_token=1, PV_COLS: gl.constexpr = 64,
             kv_scale_ptr=None, LAZY_RESCALE: gl.constexpr = False):
    """One split, item or segment: tokens [start, end) against the Q in shared memory
    (its ``q_phase``-th load), after ``g0`` earlier steps of this program. ``RANGE``: the
    last QK releases Q for the next segment's request. ``FINAL``: where ``final`` holds (a
    request that is this one segment), the output goes to ``out_ptr`` (and, with
    ``WRITE_OUT_LSE``, the natural-log LSE to ``out_lse_ptr``) instead of a partial.
    ``ONE_RESCALE``: each step in ``_one_rescale_step``'s order; ``LAZY_RESCALE``: in
    ``seesaw_lazy.lazy_step``'s (256-column PVs). ``MULTI_TOKEN``: the
    rows are a verify step's query tokens x heads from row ``row0`` of the request, token
    j's rows (``rows_per_token`` each) seeing the positions before ``first_limit`` + j; a
    row that sees none here gets zeros and LSE -inf. ``PV_COLS``: the width of O's
    accumulators and PV instructions, 64 or 256 (module docstring). ``kv_scale_ptr``: a
    per-tensor fp8 cache's scale (its tiles hold the stored codes): the scores and the
    output are scaled by it."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 64, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, PV_COLS, 16])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    rows: gl.constexpr = gl.SliceLayout(1, mma)
    kv_scale = 1.0
    if kv_scale_ptr is not None:
        kv_scale = gl.load(kv_scale_ptr)
        qk_scale_log2 = qk_scale_log2 * kv_scale
    m_i = gl.full([ROWS], float("-inf"), gl.float32, rows)
    l_i = gl.zeros([ROWS], gl.float32, rows)
    o = _o_zeros(mma_o, PV_COLS)
    row_limit = first_limit + (row0 + gl.arange(0, ROWS, rows)) // rows_per_token
    low_limit = first_limit + row0 // rows_per_token
    mbarrier.wait(bars.index(B_Q), q_phase)
    for step in range(num_steps):
        phase = (g0 + step) & 1
        s = _scores(q_s, kv_s, rope_s, bars, phase, start, end, step, PARITY, mma, row_limit,
                    low_limit, MULTI_TOKEN, PV_COLS)
        if RANGE:
            if step == num_steps - 1:
                mbarrier.arrive(bars.index(B_QFREE))
        valid = end - (start + (2 * step + PARITY) * TILE)  # live rows of this tile
        if valid < TILE:
            _zero_tail(kv_s, PARITY, valid, PV_COLS)
        st = phase * NUM_STATS  # this step's set of row statistics
        # Each tile's P goes to its rope box, free once its QK is done.
        p_box = rope_box(kv_s, rope_s, PARITY, PV_COLS)
        if LAZY_RESCALE:
            m_i, l_i, o = lazy_step(s, p_box, kv_s, rope_s, stats_s, bars, phase, st, m_i,
                                    l_i, o, qk_scale_log2, PARITY, mma, mma_o, MULTI_TOKEN)
        elif ONE_RESCALE:
            m_i, l_i, o = _one_rescale_step(
                s, kv_s, rope_s, stats_s, bars, phase, st, m_i, l_i, o, qk_scale_log2,
                PARITY, mma, mma_o, MULTI_TOKEN, PV_COLS)
        elif PARITY == 0:
            # Row maxima in log2 units (scaling a row's max = the max of the scaled row),
            # so the scale folds into the exponent's multiply-add.
            # A holds a live token (for every row but a verify step's early ones).
            m_a = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale_log2)
            alpha_a, sum_a, p = publish_tile_a(s, m_i, m_a, p_box, stats_s, bars, st,
                                               qk_scale_log2, MULTI_TOKEN)
            o = o_scale(o, alpha_a, mma_o, PV_COLS)
            o = pv(gl.convert_layout(p, a_op), kv_s, 0, o, 0, PV_COLS)
            mbarrier.arrive(bars.index(B_FREE_OWN + 0))
            alpha_b, m_b, sum_b = tile_b_stats(stats_s, bars, st, phase, rows)
            o = o_scale(o, alpha_b, mma_o, PV_COLS)
            o = pv(rope_box(kv_s, rope_s, 1, PV_COLS), kv_s, 1, o, 0, PV_COLS)
            mbarrier.arrive(bars.index(B_FREE_CROSS + 1))
        else:
            m_a, alpha_a = tile_a_max(stats_s, bars, st, phase, rows)
            # Tile B may lie past the end (all -inf): then m_b = m_a.
            m_b = gl.maximum(m_a, gl.max(s, axis=1) * qk_scale_log2)
            alpha_b, sum_b, p = publish_tile_b(s, m_a, m_b, p_box, stats_s, bars, st,
                                               qk_scale_log2, MULTI_TOKEN)
            mbarrier.wait(bars.index(B_PA), phase)
            sum_a = stats_s.index(st + S_SUM_A).load(rows)
            o = o_scale(o, alpha_a, mma_o, PV_COLS)
            o = pv(rope_box(kv_s, rope_s, 0, PV_COLS), kv_s, 0, o, HALF_CHUNKS, PV_COLS)
            mbarrier.arrive(bars.index(B_FREE_CROSS + 0))
            o = o_scale(o, alpha_b, mma_o, PV_COLS)
            o = pv(gl.convert_layout(p, a_op), kv_s, 1, o, HALF_CHUNKS, PV_COLS)
            mbarrier.arrive(bars.index(B_FREE_OWN + 1))
        if not ONE_RESCALE and not LAZY_RESCALE:
            l_i = l_i * alpha_a * alpha_b + sum_a * alpha_b + sum_b
            m_i = m_b
    # This warpgroup's 256 columns of O / l, and (warpgroup 0) the LSE (a row that saw no
    # token: O 0, l 0, m -inf, so zeros and LSE -inf).
    inv_l = 1.0 / (gl.where(l_i > 0.0, l_i, 1.0) if MULTI_TOKEN else l_i)
    if kv_scale_ptr is not None:
        inv_l = inv_l * kv_scale
    if FINAL:
        if final:
            _store_rows(out_ptr, stride_out_h, 1, o, inv_l, m_i, l_i, num_rows, PARITY,
                        WRITE_OUT_LSE, True, mma, mma_o, PV_COLS, out_lse_ptr)
        else:
            _store_rows(o_ptr, stride_o_h, stride_lse_h, o, inv_l, m_i, l_i, num_rows,
                        PARITY, True, False, mma, mma_o, PV_COLS, lse_ptr)
    else:
        # A split's partial LSE always (the merge weighs by it); the final one when asked.
        _store_rows(o_ptr, stride_o_h, stride_lse_h, o, inv_l, m_i, l_i, num_rows, PARITY,
                    WRITE_LSE or not ONE_SPLIT, ONE_SPLIT, mma, mma_o, PV_COLS, lse_ptr)


@gluon.jit
def _store_rows(o_ptr, stride_o_h, stride_lse_h, o, inv_l, m_i, l_i, num_rows,
                PARITY: gl.constexpr, STORE_LSE: gl.constexpr, NATURAL_LSE: gl.constexpr,
                mma: gl.constexpr, mma_o: gl.constexpr, PV_COLS: gl.constexpr, lse_ptr=None):
    """A warpgroup's 256 columns of O / l at ``o_ptr`` (in its element type), and, from
    warpgroup 0 with ``STORE_LSE``, the LSE at ``lse_ptr``: log2 units between the stages
    (the merge's), the natural log as a final LSE (``NATURAL_LSE``)."""
    rows: gl.constexpr = gl.SliceLayout(1, mma)
    # Rows past num_rows (fewer than 64 heads) are other requests' q or TMA's zero fill:
    # each row's scores and output depend on that row alone, so they are only not stored.
    if PV_COLS == 256:
        rows_o: gl.constexpr = gl.SliceLayout(1, mma_o)
        offs_h = gl.arange(0, ROWS, rows_o)
        offs_c = gl.arange(0, HALF_CHUNKS * BOX, gl.SliceLayout(0, mma_o))
        base = o_ptr + offs_h[:, None] * stride_o_h + PARITY * HALF_CHUNKS * BOX \
            + offs_c[None, :]
        inv = gl.convert_layout(inv_l, rows_o)
        gl.store(base, (o[0] * inv[:, None]).to(o_ptr.dtype.element_ty),
                 mask=(offs_h < num_rows)[:, None])
    else:
        offs_h = gl.arange(0, ROWS, rows)
        offs_c = gl.arange(0, BOX, gl.SliceLayout(0, mma))
        base = o_ptr + offs_h[:, None] * stride_o_h + PARITY * HALF_CHUNKS * BOX \
            + offs_c[None, :]
        real = (offs_h < num_rows)[:, None]
        gl.store(base, (o[0] * inv_l[:, None]).to(o_ptr.dtype.element_ty), mask=real)
        gl.store(base + BOX, (o[1] * inv_l[:, None]).to(o_ptr.dtype.element_ty), mask=real)
        gl.store(base + 2 * BOX, (o[2] * inv_l[:, None]).to(o_ptr.dtype.element_ty),
                 mask=real)
        gl.store(base + 3 * BOX, (o[3] * inv_l[:, None]).to(o_ptr.dtype.element_ty),
                 mask=real)
    if PARITY == 0 and STORE_LSE and lse_ptr is not None:
        offs_r = gl.arange(0, ROWS, rows)
        lse = m_i + gl.log2(l_i)
        if NATURAL_LSE:
            lse = lse * 0.6931471805599453
        gl.store(lse_ptr + offs_r * stride_lse_h, lse, mask=offs_r < num_rows)


# One entry per partition (PARITY fixed). Passing PARITY straight to warpgroup_compute in
# warp_specialize compiles too, to differently scheduled code (not measured).
@gluon.jit
def warpgroup_even(q_s, kv_s, rope_s, stats_s, bars, start, end, num_steps, qk_scale_log2,
                    o_ptr, lse_ptr, stride_o_h, stride_lse_h, num_rows, WRITE_LSE: gl.constexpr,
                    ONE_SPLIT: gl.constexpr, ONE_RESCALE: gl.constexpr,
                    MULTI_TOKEN: gl.constexpr = False, first_limit=0, row0=0,
                    rows_per_token=1, PV_COLS: gl.constexpr = 64, kv_scale_ptr=None,
                    LAZY_RESCALE: gl.constexpr = False):
    warpgroup_compute(q_s, kv_s, rope_s, stats_s, bars, start, end, num_steps, qk_scale_log2,
             o_ptr, lse_ptr, stride_o_h, stride_lse_h, num_rows, WRITE_LSE, ONE_SPLIT, 0,
             ONE_RESCALE=ONE_RESCALE, MULTI_TOKEN=MULTI_TOKEN, first_limit=first_limit,
             row0=row0, rows_per_token=rows_per_token, PV_COLS=PV_COLS,
             kv_scale_ptr=kv_scale_ptr, LAZY_RESCALE=LAZY_RESCALE)


@gluon.jit
def warpgroup_odd(q_s, kv_s, rope_s, stats_s, bars, start, end, num_steps, qk_scale_log2,
                   o_ptr, lse_ptr, stride_o_h, stride_lse_h, num_rows, WRITE_LSE: gl.constexpr,
                   ONE_SPLIT: gl.constexpr, ONE_RESCALE: gl.constexpr,
                   MULTI_TOKEN: gl.constexpr = False, first_limit=0, row0=0,
                   rows_per_token=1, PV_COLS: gl.constexpr = 64, kv_scale_ptr=None,
                   LAZY_RESCALE: gl.constexpr = False):
    warpgroup_compute(q_s, kv_s, rope_s, stats_s, bars, start, end, num_steps, qk_scale_log2,
             o_ptr, lse_ptr, stride_o_h, stride_lse_h, num_rows, WRITE_LSE, ONE_SPLIT, 1,
             ONE_RESCALE=ONE_RESCALE, MULTI_TOKEN=MULTI_TOKEN, first_limit=first_limit,
             row0=row0, rows_per_token=rows_per_token, PV_COLS=PV_COLS,
             kv_scale_ptr=kv_scale_ptr, LAZY_RESCALE=LAZY_RESCALE)
