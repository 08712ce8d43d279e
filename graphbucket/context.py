"""The explicit context a captured decode forward receives (no module globals).

A forward is called as ``forward(ctx)``; its attention layers call ``ctx.attend(q, kv, out)``
(or ``ctx.backend.run(..., plan=ctx.plan)``), so every launch uses the plan the graph was
captured with and the static buffers every graph shares.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from graphbucket.backends.base import DecodeBackend
from graphbucket.plan import LaunchPlan


@dataclass(frozen=True, slots=True)
class DecodeContext:
    """Static views for one padded batch plus the frozen plan it runs with.

    seq_lens [bs] int32, block_table [bs, max_pages] int32, positions [bs] int64 and
    ``inputs`` (name -> [bs, *shape]) are views of the shared static buffers; ``workspace``
    is the backend's persistent workspace. Graph-safe: views never depend on live lengths.
    """

    batch_size: int
    plan: LaunchPlan
    backend: DecodeBackend
    sm_scale: float
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    positions: torch.Tensor
    inputs: Mapping[str, torch.Tensor]
    workspace: Any

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor | None = None,
               kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Paged MLA decode of q [bs, H, D] over ``kv_cache`` into out [bs, H, R]
        (``kv_scale``: an fp8 cache's per-tensor scale, ``graphbucket.fp8``)."""
        extra = {} if kv_scale is None else {"kv_scale": kv_scale}
        return self.backend.run(q, kv_cache, self.block_table, self.seq_lens, out,
                                self.workspace, plan=self.plan, sm_scale=self.sm_scale, lse=lse,
                                **extra)
