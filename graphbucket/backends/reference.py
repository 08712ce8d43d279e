"""Reference backend: paged MLA decode in plain torch float32 math, for tests.

It plans exactly like the Triton backend (same keys, same aliasing), but ``run`` ignores
the split count: it gathers all ``max_pages`` pages of every row and masks tokens past
``seq_lens`` on the device. Every shape is static, so it captures into a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

import torch

from graphbucket.backends.base import NoWorkspace
from graphbucket.kernels import check_mla_decode_args
from graphbucket.plan import H200_NUM_SMS, LaunchPlan, plan_mla_decode


def masked_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, *, kv_lora_rank: int, sm_scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense masked decode over every page in ``block_table``; returns float32 (out, lse).

    q [B, H, D]; block_table [B, max_pages] int32 (entries are clamped into the cache, so
    stale pages past a row's length are harmless); seq_lens [B] int32. Rows with length 0
    give out = 0 and lse = -inf. Graph-safe: static shapes, no host reads.
    """
    batch = q.shape[0]
    num_pages, page_size, dim = kv_cache.shape
    pages = block_table[:batch].long().clamp(0, num_pages - 1)
    kv = kv_cache[pages].reshape(batch, -1, dim).float()  # [B, max_pages * page_size, D]
    scores = torch.einsum("bhd,btd->bht", q.float(), kv) * sm_scale
    tokens = torch.arange(kv.shape[1], device=q.device)
    live = tokens[None, :] < seq_lens[:batch, None]
    scores = scores.masked_fill(~live[:, None, :], float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    out = (probs @ kv[..., :kv_lora_rank]) / denom.clamp_min(torch.finfo(torch.float32).tiny)
    lse = torch.where(denom > 0, denom.log() + row_max, torch.full_like(denom, float("-inf")))
    return out, lse.squeeze(-1)


class ReferenceBackend:
    """Torch float32 MLA decode behind the ``DecodeBackend`` protocol (slow, exact-ish)."""

    name = "reference"

    def __init__(self, *, kv_lora_rank: int = 512, qk_rope_dim: int = 64,
                 num_sms: int = H200_NUM_SMS) -> None:
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_dim = qk_rope_dim
        self.num_sms = num_sms
        self._plan = functools.lru_cache(maxsize=8192)(self._plan_uncached)

    def __repr__(self) -> str:
        return f"ReferenceBackend(kv_lora_rank={self.kv_lora_rank}, num_sms={self.num_sms})"

    def plan(self, batch_size: int, num_heads: int, hint: int) -> LaunchPlan:
        return self._plan(batch_size, num_heads, hint)

    def _plan_uncached(self, batch_size: int, num_heads: int, hint: int) -> LaunchPlan:
        return plan_mla_decode(batch_size, num_heads, hint, num_sms=self.num_sms,
                               kv_lora_rank=self.kv_lora_rank, qk_rope_dim=self.qk_rope_dim)

    def workspace_spec(self, plans: Iterable[LaunchPlan]) -> NoWorkspace:
        return NoWorkspace()

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, out: torch.Tensor, workspace: None = None, *,
            plan: LaunchPlan, sm_scale: float, lse: torch.Tensor | None = None) -> torch.Tensor:
        """Same contract as the Triton backend; the split count does not change the math."""
        # Shape checks only: a one-split view of the plan needs no workspace.
        check_mla_decode_args(q, kv_cache, block_table, seq_lens, out,
                              dataclasses.replace(plan, num_kv_splits=1), None, lse)
        o, l_ = masked_mla_decode(q, kv_cache, block_table, seq_lens,
                                  kv_lora_rank=plan.kv_lora_rank, sm_scale=sm_scale)
        out.copy_(o)
        if lse is not None:
            lse.copy_(l_)
        return out
