"""Gluon names that moved between the Triton releases ``setup.cfg`` allows, picked once here.

Gluon is experimental and renames freely; the kernels call these names, not Triton's, so a
rename is one line here rather than an edit in every kernel. Each entry says which releases
have which name.

``tma_async_load(desc, coord, barrier, smem)``: the TMA copy of a box from global into
shared memory. Triton 3.6 and 3.7 call it ``tma.async_copy_global_to_shared``; 3.8 adds
``tma.async_load`` and keeps the old name as an alias of it; 3.9 keeps the old name only to
raise an error naming the new one. Both emit the same op, so 3.6's code is unchanged.

``PUBLIC_REINTERPRET``: a shared-memory view seen with another shape or layout is
``view.reinterpret(...)`` on 3.9 and ``view._reinterpret(...)`` on 3.6 to 3.8.
"""

from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import shared_memory_descriptor as _smem
from triton.experimental.gluon.language.nvidia.hopper import tma as _tma

tma_async_load = getattr(_tma, "async_load", None) or _tma.async_copy_global_to_shared

# Whether a shared-memory view's reinterpret is public (3.9) or ``_reinterpret`` (3.6-3.8):
# the caller branches on it in its own kernel code, as 3.6 cannot pass a layout through a
# call.
PUBLIC_REINTERPRET = gl.constexpr(hasattr(_smem, "reinterpret"))


__all__ = ["PUBLIC_REINTERPRET", "tma_async_load"]
