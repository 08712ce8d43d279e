"""AITER backend (ROCm): AMD's Gluon MLA decode behind graphbucket's protocol.

Imported only through ``get_backend("aiter")``; importing this module without AITER raises
an ImportError that says how to get it. The host hint becomes AITER's ``min_kv_seq_len``,
from which AITER picks its split count (a constexpr baked into the captured graph), so
each hint is its own plan: ``AiterLaunchPlan`` adds ``min_kv_seq_len`` to the key.

AITER's Gluon kernel addresses the cache one token per page, so ``run`` expands the
block table into a static token table held in the workspace (graph-safe tensor ops).
Not exercised in graphbucket's CI (no ROCm there); written against AITER's
``mla_decode_gluon(q_nope, q_pe, kv_c, o, page_table, seq_info, sm_scale, ...)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from graphbucket.plan import H200_NUM_SMS, LaunchPlan, plan_mla_decode

try:
    from aiter.ops.triton.gluon.mla_decode_gluon import mla_decode_gluon
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise ImportError(
        "the 'aiter' backend needs AMD's AITER on a ROCm machine (MI300/MI355 class): "
        "`pip install aiter` or build it from AMD's ROCm/aiter repository; use "
        "get_backend('triton') elsewhere"
    ) from exc


@dataclass(frozen=True, slots=True)
class AiterLaunchPlan(LaunchPlan):
    """A ``LaunchPlan`` plus the ``min_kv_seq_len`` AITER derives its split count from."""

    min_kv_seq_len: int = 1


@dataclass(frozen=True, slots=True)
class TokenTableSpec:
    """int32 [max_batch, max_pages * page_size] token table plus [page_size] offsets."""

    max_batch: int
    max_pages: int
    page_size: int

    @property
    def nbytes(self) -> int:
        return 4 * (self.max_batch * self.max_pages * self.page_size + self.page_size)

    def allocate(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        return {
            "token_table": torch.zeros(self.max_batch, self.max_pages * self.page_size,
                                       dtype=torch.int32, device=device),
            "page_offsets": torch.arange(self.page_size, dtype=torch.int32, device=device),
        }


class AiterBackend:
    """AITER Gluon MLA decode; ``page_size`` and ``max_pages`` size the token table."""

    name = "aiter"

    def __init__(self, *, page_size: int, max_pages: int, kv_lora_rank: int = 512,
                 qk_rope_dim: int = 64, num_sms: int = H200_NUM_SMS) -> None:
        self.page_size = page_size
        self.max_pages = max_pages
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_dim = qk_rope_dim
        self.num_sms = num_sms

    def plan(self, batch_size: int, num_heads: int, hint: int) -> AiterLaunchPlan:
        base = plan_mla_decode(batch_size, num_heads, hint, num_sms=self.num_sms,
                               kv_lora_rank=self.kv_lora_rank, qk_rope_dim=self.qk_rope_dim)
        fields = {name: getattr(base, name) for name in LaunchPlan.__dataclass_fields__}
        return AiterLaunchPlan(**fields, min_kv_seq_len=hint)

    def workspace_spec(self, plans: Iterable[LaunchPlan]) -> TokenTableSpec:
        return TokenTableSpec(max(p.batch_size for p in plans), self.max_pages, self.page_size)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, out: torch.Tensor, workspace: dict[str, torch.Tensor], *,
            plan: LaunchPlan, sm_scale: float, lse: torch.Tensor | None = None) -> torch.Tensor:
        """Expand pages to tokens, then AITER's decode with the frozen ``min_kv_seq_len``."""
        if lse is not None:
            raise NotImplementedError("the aiter backend does not return lse; pass lse=None")
        if not isinstance(plan, AiterLaunchPlan):
            raise TypeError(f"plan must come from AiterBackend.plan, got {type(plan).__name__}")
        bs, rank = plan.batch_size, plan.kv_lora_rank
        table = workspace["token_table"][:bs].view(bs, self.max_pages, self.page_size)
        pages = block_table[:bs, : self.max_pages].clamp(0, kv_cache.shape[0] - 1)
        torch.add(pages[:, :, None] * self.page_size, workspace["page_offsets"], out=table)
        mla_decode_gluon(q[..., :rank], q[..., rank:], kv_cache.view(-1, kv_cache.shape[-1]),
                         out, workspace["token_table"][:bs], seq_lens[:bs], sm_scale,
                         kv_pe_offset=rank, use_2d_view=True, min_kv_seq_len=plan.min_kv_seq_len)
        return out
