"""The seesaw's value-side helpers (``kernels/seesaw_step.py``, ``kernels/seesaw_lazy.py``):
a row max made finite for the exponentials, O scaled per row, and the PV wgmmas issued,
waited on, or both, over one tile or two back to back."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from graphbucket.kernels.seesaw_layout import HALF_CHUNKS, value_box, value_halves


@gluon.jit
def finite_max(m):
    """0 where a row's max is -inf (a verify step's row that saw no token yet), so the
    exponentials give 0 there rather than NaN."""
    return gl.where(m == float("-inf"), 0.0, m)


@gluon.jit
def o_scale(o, alpha, mma_o: gl.constexpr, PV_COLS: gl.constexpr):
    """O x alpha per row (alpha in the score rows' layout)."""
    if PV_COLS == 256:
        a = gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))
        return (o[0] * a[:, None],)
    else:
        return (o[0] * alpha[:, None], o[1] * alpha[:, None], o[2] * alpha[:, None],
                o[3] * alpha[:, None])


@gluon.jit
def pv_issue(p, kv_s, slot, o, FIRST_CHUNK: gl.constexpr, PV_COLS: gl.constexpr):
    """O += P V over the tile in ``slot``'s value boxes from FIRST_CHUNK, issued, not
    waited on; p: registers in the A-operand layout, or a shared-memory P."""
    if PV_COLS == 256:
        half = value_halves(kv_s).index(slot * 2 + FIRST_CHUNK // HALF_CHUNKS)
        return (warpgroup_mma(p, half, o[0], is_async=True),)
    else:
        return (warpgroup_mma(p, value_box(kv_s, slot, FIRST_CHUNK + 0, PV_COLS), o[0],
                              is_async=True),
                warpgroup_mma(p, value_box(kv_s, slot, FIRST_CHUNK + 1, PV_COLS), o[1],
                              is_async=True),
                warpgroup_mma(p, value_box(kv_s, slot, FIRST_CHUNK + 2, PV_COLS), o[2],
                              is_async=True),
                warpgroup_mma(p, value_box(kv_s, slot, FIRST_CHUNK + 3, PV_COLS), o[3],
                              is_async=True))


@gluon.jit
def pv_wait(o, PV_COLS: gl.constexpr):
    if PV_COLS == 256:
        return (warpgroup_mma_wait(num_outstanding=0, deps=(o[0],)),)
    else:
        o0, o1, o2, o3 = warpgroup_mma_wait(num_outstanding=0, deps=(o[0], o[1], o[2], o[3]))
        return (o0, o1, o2, o3)


@gluon.jit
def pv(p, kv_s, slot, o, FIRST_CHUNK: gl.constexpr, PV_COLS: gl.constexpr):
    """O += P V over the tile in ``slot`` (``pv_issue``), then waited on."""
    return pv_wait(pv_issue(p, kv_s, slot, o, FIRST_CHUNK, PV_COLS), PV_COLS)


@gluon.jit
def pv_pair(p_a, p_b, kv_s, o, FIRST_CHUNK: gl.constexpr, PV_COLS: gl.constexpr):
    """O += P_A V_A + P_B V_B over both tiles' value boxes from FIRST_CHUNK: issued back to
    back and one wait, so the tensor pipe is not drained between the tiles."""
    o = pv_issue(p_a, kv_s, 0, o, FIRST_CHUNK, PV_COLS)
    o = pv_issue(p_b, kv_s, 1, o, FIRST_CHUNK, PV_COLS)
    return pv_wait(o, PV_COLS)
