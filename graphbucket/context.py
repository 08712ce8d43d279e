"""The explicit context a captured decode forward receives (no module globals).

A forward is called as ``forward(ctx)``; its attention layers call ``ctx.attend(q, kv, out)``
(or ``ctx.backend.run(..., plan=ctx.plan)``), so every launch uses the plan the graph was
captured with and the static buffers every graph shares.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from graphbucket.backends.base import DecodeBackend, Plan


@dataclass(frozen=True, slots=True)
class DecodeContext:
    """Static views for one padded batch plus the frozen plan it runs with.

    seq_lens [bs] int32 and block_table [bs, max_pages] int32 (one row per request),
    positions [bs * q_len] int64 and ``inputs`` (name -> [bs * q_len, *shape]; one row per
    query token, token j of request b at row b * q_len + j) are views of the shared static
    buffers; ``workspace`` is the backend's persistent workspace. ``q_len``: query tokens
    per request (1: plain decode; more: a verify step, planned with q_len x heads rows).
    Graph-safe: views never depend on live lengths.

    One step's layers share its partition: after ``begin_step()`` (the runner calls it
    before each forward it runs or captures), the first layer of a plan the backend
    partitions on the device (``partitions_once``: a balanced plan) writes the partition
    and the later layers over caches of the same dtype skip the planner. Without
    ``begin_step`` every layer plans (an engine driving the context itself).
    """

    batch_size: int
    plan: Plan
    backend: DecodeBackend
    sm_scale: float
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    positions: torch.Tensor
    inputs: Mapping[str, torch.Tensor]
    workspace: Any
    q_len: int = 1
    # [None]: no step begun (every layer plans); [False]: begun, nothing planned yet;
    # [dtype]: the partition was planned this step over a cache of that dtype.
    _partitioned: list = field(default_factory=lambda: [None], repr=False, compare=False)

    def begin_step(self) -> None:
        """A new step starts: its first layer partitions it again."""
        self._partitioned[0] = False

    def _partition_ready(self, kv_cache: torch.Tensor) -> bool:
        state = self._partitioned[0]
        if state is None or not self.backend.partitions_once(self.plan):
            return False
        if state == kv_cache.dtype:
            return True
        self._partitioned[0] = kv_cache.dtype
        return False

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor | None = None,
               kv_scale: torch.Tensor | None = None, **inputs: Any) -> torch.Tensor:
        """Paged MLA decode of q [bs * q_len, H, D] over ``kv_cache`` into out [bs * q_len,
        H, R] (``lse`` [bs * q_len, H]; ``kv_scale``: an fp8 cache's per-tensor scale,
        ``graphbucket.fp8``; ``inputs``: what else the backend reads, e.g. the sparse
        backend's ``index``). With q_len > 1, token j of each request sees the positions
        before seq_len - q_len + j + 1; the tokens run folded into the rows (a view, q and
        out must be contiguous over tokens and heads)."""
        extra = inputs if kv_scale is None else {**inputs, "kv_scale": kv_scale}
        q_len = self.q_len
        if q_len == 1:
            if self._partition_ready(kv_cache):
                extra = {**extra, "partition_ready": True}
            return self.backend.run(q, kv_cache, self.block_table, self.seq_lens, out,
                                    self.workspace, plan=self.plan, sm_scale=self.sm_scale,
                                    lse=lse, **extra)
        bs = self.batch_size
        folded = out.view(bs, -1, out.shape[-1])
        self.backend.run(q.view(bs, -1, q.shape[-1]), kv_cache, self.block_table,
                         self.seq_lens, folded, self.workspace, plan=self.plan,
                         sm_scale=self.sm_scale, q_len=q_len,
                         lse=None if lse is None else lse.view(bs, -1), **extra)
        return out
