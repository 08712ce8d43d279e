"""The seesaw's softmax hand-offs between its two warpgroups (``kernels/seesaw_step.py``'s
default order and ``kernels/seesaw_lazy.py``'s): each publishes its tile's row max and
rescale factor and its P with the row sums through shared memory and mbarriers, whatever
rule chose the max."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from graphbucket.kernels.seesaw_layout import (
    B_MA,
    B_PA,
    B_PB,
    S_ALPHA_A,
    S_ALPHA_B,
    S_MA,
    S_MB,
    S_SUM_A,
    S_SUM_B,
)
from graphbucket.kernels.seesaw_pv import finite_max


@gluon.jit
def publish_tile_a(s, m_i, m_a, p_box, stats_s, bars, st, qk_scale_log2,
                   MULTI_TOKEN: gl.constexpr):
    """Warpgroup 0, tile A against the max ``m_a``: m_A and alpha_A = 2^(m - m_A) to the
    statistics (then B_MA), P_A unscaled into the tile's rope box and its row sum (then
    B_PA): WG1 rescales by alpha_B itself, so tile A is released after both warpgroups'
    first PV. -> (alpha_A, row sum of P_A, P_A)."""
    m_ae = finite_max(m_a) if MULTI_TOKEN else m_a
    alpha_a = gl.exp2(m_i - m_ae)
    stats_s.index(st + S_MA).store(m_a)
    stats_s.index(st + S_ALPHA_A).store(alpha_a)
    mbarrier.arrive(bars.index(B_MA))
    p32 = gl.exp2(s * qk_scale_log2 - m_ae[:, None])
    sum_a = gl.sum(p32, axis=1)
    p = p32.to(p_box.dtype)
    p_box.store(p)
    stats_s.index(st + S_SUM_A).store(sum_a)
    fence_async_shared()
    mbarrier.arrive(bars.index(B_PA))
    return alpha_a, sum_a, p


@gluon.jit
def publish_tile_b(s, m_a, m_b, p_box, stats_s, bars, st, qk_scale_log2,
                   MULTI_TOKEN: gl.constexpr):
    """Warpgroup 1, tile B against the max ``m_b``: P_B into the tile's rope box, then
    alpha_B = 2^(m_A - m_B), m_B and the row sum to the statistics (then B_PB).
    -> (alpha_B, row sum of P_B, P_B)."""
    m_be = finite_max(m_b) if MULTI_TOKEN else m_b
    alpha_b = gl.exp2(m_a - m_be)
    p32 = gl.exp2(s * qk_scale_log2 - m_be[:, None])
    sum_b = gl.sum(p32, axis=1)
    p = p32.to(p_box.dtype)
    p_box.store(p)
    stats_s.index(st + S_ALPHA_B).store(alpha_b)
    stats_s.index(st + S_MB).store(m_b)
    stats_s.index(st + S_SUM_B).store(sum_b)
    fence_async_shared()
    mbarrier.arrive(bars.index(B_PB))
    return alpha_b, sum_b, p


@gluon.jit
def tile_b_stats(stats_s, bars, st, phase, rows: gl.constexpr):
    """Warpgroup 0 once P_B is published: (alpha_B, m_B, row sum of P_B)."""
    mbarrier.wait(bars.index(B_PB), phase)
    return (stats_s.index(st + S_ALPHA_B).load(rows), stats_s.index(st + S_MB).load(rows),
            stats_s.index(st + S_SUM_B).load(rows))


@gluon.jit
def tile_a_max(stats_s, bars, st, phase, rows: gl.constexpr):
    """Warpgroup 1 once m_A is published: (m_A, alpha_A)."""
    mbarrier.wait(bars.index(B_MA), phase)
    return stats_s.index(st + S_MA).load(rows), stats_s.index(st + S_ALPHA_A).load(rows)
