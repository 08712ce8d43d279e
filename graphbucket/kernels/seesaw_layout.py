"""The Gluon seesaw's shared-memory layout (``kernels/seesaw.py``): tile and box sizes,
the barrier slots and the row-statistics slots its warpgroups and loader hand off through,
and the allocation of one program's shared state.

A tile has nine 64-column boxes: eight of values (latent columns 0..511) and the rope box
(then P). With 64-column PVs (``PV_COLS`` 64) they are one allocation ``kv_s``, slot s's
box c at index s * 9 + c (``rope_s`` is ``kv_s``). With 256-column PVs (the default) the
value boxes have their own allocation, slot s's box c at s * 8 + c, and the rope boxes
theirs (``rope_s``, index s): four consecutive value boxes are, byte for byte, one
[64, 256] operand in the same 128-byte swizzle (each box one 128-byte column block of it),
and only a power-of-two allocation lets every Triton release the project allows take that
view (``value_halves``)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from graphbucket.kernels.gluon_compat import PUBLIC_REINTERPRET

ROWS = gl.constexpr(64)         # query rows (heads) per program
TILE = gl.constexpr(64)         # tokens per tile (one page)
BOX = gl.constexpr(64)          # columns per TMA box and shared-memory chunk (128 bytes)
CHUNKS = gl.constexpr(9)        # 576 / BOX: latent (8) + rope (1)
HALF_CHUNKS = gl.constexpr(4)   # value chunks per warpgroup: 256 / BOX
VALUE_BOXES = gl.constexpr(8)   # value chunks per tile: 512 / BOX (the ninth box is rope)
TILE_BYTES = gl.constexpr(9 * 64 * 64 * 2)

# Barrier slots. Every 64-column box of a tile has its own ready barrier, so the QK of a
# box starts as soon as it lands; a slot is released in two halves, each by the warpgroup
# that reads it last, so the loader refills part of it while the step is still running.
B_Q = gl.constexpr(0)
B_READY = gl.constexpr(1)        # + slot * CHUNKS + box
B_FREE_OWN = gl.constexpr(19)    # + slot: its warpgroup's value half
B_FREE_CROSS = gl.constexpr(21)  # + slot: the other half and the rope box (then P), read
                                 # last by the other warpgroup
B_MA = gl.constexpr(23)
B_PB = gl.constexpr(24)
B_PA = gl.constexpr(25)
B_QFREE = gl.constexpr(26)       # both warpgroups' last QK of a range's segment is done:
                                 # the loader may bring the next request's Q (count 2)
B_DESC = gl.constexpr(27)        # + slot: the loader wrote a range segment's descriptor
B_MB = gl.constexpr(29)          # the one-rescale step: WG1's m_B, which WG0's P_A needs
NUM_BARRIERS = gl.constexpr(30)
BOX_BYTES = gl.constexpr(64 * 64 * 2)
# Row-statistics slots (float32 [64] each), two sets: step s uses set s % 2, so a
# warpgroup one step ahead never overwrites what the other has still to read.
S_MA = gl.constexpr(0)
S_ALPHA_A = gl.constexpr(1)
S_ALPHA_B = gl.constexpr(2)
S_MB = gl.constexpr(3)
S_SUM_B = gl.constexpr(4)
S_SUM_A = gl.constexpr(5)
NUM_STATS = gl.constexpr(6)


@gluon.jit
def shared_state(q_layout: gl.constexpr, kv_layout: gl.constexpr, PV_COLS: gl.constexpr = 64,
                 DTYPE: gl.constexpr = gl.bfloat16):
    """Q, the two KV tiles (value boxes ``kv_s`` and rope boxes ``rope_s``, laid out for
    ``PV_COLS``: module docstring) in ``DTYPE`` (bf16, or float16 for an fp8 cache's
    converted tiles), the row statistics and the barriers (initialised) of a program."""
    q_s = gl.allocate_shared_memory(DTYPE, [CHUNKS, ROWS, BOX], q_layout)
    if PV_COLS == 256:
        kv_s = gl.allocate_shared_memory(DTYPE, [2 * VALUE_BOXES, TILE, BOX], kv_layout)
        rope_s = gl.allocate_shared_memory(DTYPE, [2, TILE, BOX], kv_layout)
    else:
        kv_s = gl.allocate_shared_memory(DTYPE, [2 * CHUNKS, TILE, BOX], kv_layout)
        rope_s = kv_s
    stats_s = gl.allocate_shared_memory(
        gl.float32, [2 * NUM_STATS, ROWS],
        gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BARRIERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(B_QFREE):
        mbarrier.init(bars.index(i), count=1)
    mbarrier.init(bars.index(B_QFREE), count=2)
    for i in gl.static_range(B_DESC, NUM_BARRIERS):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    return q_s, kv_s, rope_s, stats_s, bars


@gluon.jit
def value_box(kv_s, slot, box, PV_COLS: gl.constexpr):
    """Value box ``box`` (0..7; 8, the rope box, too where ``PV_COLS`` is 64) of the tile in
    ``slot``."""
    if PV_COLS == 256:
        return kv_s.index(slot * VALUE_BOXES + box)
    else:
        return kv_s.index(slot * CHUNKS + box)


@gluon.jit
def rope_box(kv_s, rope_s, slot, PV_COLS: gl.constexpr):
    """The rope box (then P) of the tile in ``slot``."""
    if PV_COLS == 256:
        return rope_s.index(slot)
    else:
        return kv_s.index(slot * CHUNKS + VALUE_BOXES)


@gluon.jit
def value_halves(kv_s):
    """The value boxes of the 256-column layout as [4, 64, 256]: index slot * 2 + h is
    slot's value columns [256 h, 256 h + 256), the B operand of one m64n256k16 PV."""
    if PUBLIC_REINTERPRET:
        return kv_s.reinterpret(kv_s.dtype, [4, 64, 256], kv_s.layout)
    else:
        return kv_s._reinterpret(kv_s.dtype, [4, 64, 256], kv_s.layout)
