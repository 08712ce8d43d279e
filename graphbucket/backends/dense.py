"""Dense backend: paged MLA decode in plain torch float32 math, for tests.

It plans exactly like the Triton backend (same keys, same aliasing), but ``run`` ignores
the split count: ``graphbucket.reference.masked_mla_decode`` gathers all ``max_pages``
pages of every row and masks tokens past ``seq_lens`` on the device. Every shape is
static, so it captures into a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

import torch

from graphbucket import fp8
from graphbucket.backends.base import NoWorkspace, check_balanced_kernel
from graphbucket.backends.triton import split_kv_ladder, split_kv_q_ladder
from graphbucket.bucket import DEFAULT_BALANCED_KERNEL
from graphbucket.kernels import check_mla_decode_args
from graphbucket.kernels.launch import check_q_len
from graphbucket.kernels.verify import flatten_verify
from graphbucket.ladder import BucketLadder
from graphbucket.plan import (
    H200_NUM_SMS,
    LaunchPlan,
    plan_balanced_mla_decode,
    plan_mla_decode,
)
from graphbucket.reference import masked_mla_decode
from graphbucket.spec import BufferSpec


class DenseBackend:
    """Torch float32 MLA decode behind the ``DecodeBackend`` protocol (slow, exact-ish);
    verify steps (``q_len`` > 1) too."""

    name = "dense"

    def __init__(self, *, kv_lora_rank: int = 512, qk_rope_dim: int = 64,
                 num_sms: int = H200_NUM_SMS) -> None:
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_dim = qk_rope_dim
        self.num_sms = num_sms
        self._plan = functools.lru_cache(maxsize=8192)(self._plan_uncached)

    def __repr__(self) -> str:
        return f"DenseBackend(kv_lora_rank={self.kv_lora_rank}, num_sms={self.num_sms})"

    def plan(self, batch_size: int, num_heads: int, hint: int) -> LaunchPlan:
        return self._plan(batch_size, num_heads, hint)

    def plan_balanced(self, batch_size: int, num_heads: int,
                      kernel: str = DEFAULT_BALANCED_KERNEL) -> LaunchPlan:
        """Planned like the Triton backend's balanced graphs (``run`` ignores it)."""
        check_balanced_kernel(self.name, kernel, self.balanced_kernels(num_heads))
        return plan_balanced_mla_decode(batch_size, num_heads, num_sms=self.num_sms,
                                        kv_lora_rank=self.kv_lora_rank,
                                        qk_rope_dim=self.qk_rope_dim)

    def balanced_kernels(self, num_heads: int) -> tuple[str, ...]:
        return (DEFAULT_BALANCED_KERNEL,)

    def default_ladder(self, max_model_len: int, spec: BufferSpec | None = None
                       ) -> BucketLadder:
        """As the Triton backend's (``backends.triton.split_kv_ladder``)."""
        return split_kv_ladder(max_model_len, spec)

    def default_q_ladder(self, max_model_len: int, spec: BufferSpec | None, q_len: int
                         ) -> BucketLadder | None:
        """As the Triton backend's (``backends.triton.split_kv_q_ladder``)."""
        return split_kv_q_ladder(max_model_len, spec, q_len)

    def _plan_uncached(self, batch_size: int, num_heads: int, hint: int) -> LaunchPlan:
        return plan_mla_decode(batch_size, num_heads, hint, num_sms=self.num_sms,
                               kv_lora_rank=self.kv_lora_rank, qk_rope_dim=self.qk_rope_dim)

    def workspace_spec(self, plans: Iterable[LaunchPlan]) -> NoWorkspace:
        return NoWorkspace()

    def partitions_once(self, plan) -> bool:
        return False  # the reference plans nothing on the device

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, out: torch.Tensor, workspace: None = None, *,
            plan: LaunchPlan, sm_scale: float, lse: torch.Tensor | None = None,
            kv_scale: torch.Tensor | None = None, q_len: int = 1) -> torch.Tensor:
        """Same contract as the Triton backend; the split count does not change the math.
        A verify step (q_len > 1) runs in the flat form (``kernels.verify.flatten_verify``:
        one row per query token with its own causal limit)."""
        # Shape checks only: a one-split view of the plan needs no workspace.
        one_split = dataclasses.replace(plan, num_kv_splits=1, persistent_programs=0,
                                        fused_merge=False)
        check_mla_decode_args(q, kv_cache, block_table, seq_lens, out, one_split, None, lse,
                              kv_scale)
        check_q_len(one_split, q_len)
        # An fp8 cache, dequantized whole (static shapes).
        if fp8.cache_format_of(kv_cache).quantized:
            kv_cache = fp8.dequantize_cache(kv_cache, kv_scale, torch.float32)
        if q_len > 1:
            q, block_table, seq_lens = flatten_verify(q, block_table, seq_lens[:q.shape[0]],
                                                      q_len)
        o, l_ = masked_mla_decode(q, kv_cache, block_table, seq_lens,
                                  kv_lora_rank=plan.kv_lora_rank, sm_scale=sm_scale)
        out.copy_(o.view(out.shape))
        if lse is not None:
            lse.copy_(l_.view(lse.shape))
        return out
