"""The seesaw's step with lazy rescaling (``kernels/seesaw_step.py``; the launchers' default
over bf16 caches): a row's running max moves only when a tile's max passes it by more than
``LAZY_BOUND`` (log2 units), so in a long request most steps leave every row's max where it
was and skip the O rescale, and a warpgroup then issues its two PVs back to back.

Exact, not an approximation: P = 2^(S - m) against a stale max is at most 2^LAZY_BOUND, which
the float32 row sums and accumulators hold, and O / l and the LSE m + log2 l do not depend on
which max was used. The hand-offs are the default order's (m_A, alpha_A, P_A from WG0;
m_B, alpha_B, P_B from WG1). Whether a rescale is due is one decision per warpgroup and
tile (the smallest alpha of its 64 rows below 1), so the branch is uniform across the
wgmma's warps. 256-column PVs only: a PV is then one wgmma group, so waiting for all but
the last group means the first tile's PV is done and its slot can be released."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_wait

from graphbucket.kernels.seesaw_handoff import (
    publish_tile_a,
    publish_tile_b,
    tile_a_max,
    tile_b_stats,
)
from graphbucket.kernels.seesaw_layout import (
    B_FREE_CROSS,
    B_FREE_OWN,
    B_PA,
    HALF_CHUNKS,
    S_SUM_A,
    rope_box,
)
from graphbucket.kernels.seesaw_pv import o_scale, pv_issue, pv_wait

# How far a tile's row max may pass the running one before the running one moves (log2
# units): P and the accumulators grow by at most 2^8 meanwhile.
LAZY_BOUND: gl.constexpr = gl.constexpr(8.0)


@gluon.jit
def _lazy_max(m_old, s, qk_scale_log2):
    """The row max a tile's P is taken against: the old one unless the tile's passes it by
    more than LAZY_BOUND (the tile's then; -inf stays -inf for a row that saw no token)."""
    top = gl.max(s, axis=1) * qk_scale_log2
    return gl.where(top > m_old + LAZY_BOUND, top, m_old)


@gluon.jit
def _due(alpha):
    """Whether any of the warpgroup's rows needs O rescaled by ``alpha``."""
    return gl.min(alpha, axis=0) < 1.0


@gluon.jit
def _second_pv(p, kv_s, o, alpha, release, FIRST_CHUNK: gl.constexpr, mma_o: gl.constexpr):
    """The step's second PV (tile B) after the first (tile A, issued, not waited on): with a
    rescale due, the first is waited on, tile A's slot part released, O rescaled, then the
    second issued; else the second is queued behind the first, and tile A is released once
    only the second is in flight. Returns O with both done."""
    # Each branch ends waited on: a branch may not leave O as an in-flight accumulator.
    if _due(alpha):
        first = pv_wait(o, 256)
        mbarrier.arrive(release)
        both = pv_wait(pv_issue(p, kv_s, 1, o_scale(first, alpha, mma_o, 256), FIRST_CHUNK,
                                256), 256)
    else:
        queued = pv_issue(p, kv_s, 1, o, FIRST_CHUNK, 256)
        queued = (warpgroup_mma_wait(num_outstanding=1, deps=(queued[0],)),)
        mbarrier.arrive(release)
        both = pv_wait(queued, 256)
    return both


@gluon.jit
def lazy_step(s, p_box, kv_s, rope_s, stats_s, bars, phase, st, m_i, l_i, o, qk_scale_log2,
              PARITY: gl.constexpr, mma: gl.constexpr, mma_o: gl.constexpr,
              MULTI_TOKEN: gl.constexpr = False):
    """One two-tile step of warpgroup PARITY (the default order's hand-offs) -> (m, l, O)."""
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    rows: gl.constexpr = gl.SliceLayout(1, mma)
    if PARITY == 0:
        m_a = _lazy_max(m_i, s, qk_scale_log2)
        alpha_a, sum_a, p = publish_tile_a(s, m_i, m_a, p_box, stats_s, bars, st,
                                           qk_scale_log2, MULTI_TOKEN)
        if _due(alpha_a):  # O is complete here: the last step waited on its PVs
            o = o_scale(o, alpha_a, mma_o, 256)
        o = pv_issue(gl.convert_layout(p, a_op), kv_s, 0, o, 0, 256)
        alpha_b, m_b, sum_b = tile_b_stats(stats_s, bars, st, phase, rows)
        o = _second_pv(rope_box(kv_s, rope_s, 1, 256), kv_s, o, alpha_b,
                       bars.index(B_FREE_OWN + 0), 0, mma_o)
        mbarrier.arrive(bars.index(B_FREE_CROSS + 1))
    else:
        m_a, alpha_a = tile_a_max(stats_s, bars, st, phase, rows)
        m_b = _lazy_max(m_a, s, qk_scale_log2)
        alpha_b, sum_b, p = publish_tile_b(s, m_a, m_b, p_box, stats_s, bars, st,
                                           qk_scale_log2, MULTI_TOKEN)
        mbarrier.wait(bars.index(B_PA), phase)
        sum_a = stats_s.index(st + S_SUM_A).load(rows)
        if _due(alpha_a):
            o = o_scale(o, alpha_a, mma_o, 256)
        o = pv_issue(rope_box(kv_s, rope_s, 0, 256), kv_s, 0, o, HALF_CHUNKS, 256)
        o = _second_pv(gl.convert_layout(p, a_op), kv_s, o, alpha_b,
                       bars.index(B_FREE_CROSS + 0), HALF_CHUNKS, mma_o)
        mbarrier.arrive(bars.index(B_FREE_OWN + 1))
    l_i = l_i * alpha_a * alpha_b + sum_a * alpha_b + sum_b
    return m_b, l_i, o
