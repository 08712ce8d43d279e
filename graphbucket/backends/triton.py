"""The default backend: graphbucket's Triton split-KV MLA decode kernels.

Plans come from ``plan_mla_decode`` with the device's SM count, and from
``plan_balanced_mla_decode`` for balanced graphs (``plan_balanced``, or every plan with
``balanced=True``); the workspace is one
``SplitWorkspace`` sized for the largest (batch, split count, work items) over all plans.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from graphbucket.backends.base import check_balanced_kernel
from graphbucket.bucket import DEFAULT_BALANCED_KERNEL
from graphbucket.kernels import SplitWorkspace, mla_decode, mla_decode_balanced
from graphbucket.ladder import BucketLadder, default_ladder
from graphbucket.plan import (
    H200_NUM_SMS,
    MAX_KV_SPLITS,
    LaunchPlan,
    head_block_size,
    plan_balanced_mla_decode,
    plan_mla_decode,
)
from graphbucket.plan_streams import SEESAW_STREAM
from graphbucket.policies import device_ladder, tuned_device_ladder
from graphbucket.spec import BufferSpec

_PLAN_CACHE_SIZE = 8192
# Balanced plans on the Gluon seesaw's 64-row programs below 64 heads (rows past the heads
# unstored); from 64 heads the default balanced plan is the seesaw's already.
SEESAW_BALANCED_KERNEL = "seesaw"
# The seesaw on one persistent program per SM over equal tile ranges (``tile_ranges``).
RANGES_BALANCED_KERNEL = "seesaw-ranges"
# The seesaw over work items whose chunk the device fits to the programs (``fit_items``).
FITTED_BALANCED_KERNEL = "seesaw-fitted"
# The seesaw over tile ranges cut by work, each request charged a few tiles
# (``charged_ranges``).
CHARGED_BALANCED_KERNEL = "seesaw-charged"


def device_num_sms(device: torch.device | str | None = None, default: int = H200_NUM_SMS) -> int:
    """Multiprocessor count of a CUDA ``device``; ``default`` when CUDA is absent."""
    if not torch.cuda.is_available():
        return default
    if device is not None and torch.device(device).type != "cuda":
        return default
    return torch.cuda.get_device_properties(device or torch.cuda.current_device()
                                            ).multi_processor_count


def split_kv_q_ladder(max_model_len: int, spec: BufferSpec | None, q_len: int
                      ) -> BucketLadder | None:
    """The split-KV backends' ladder for verify steps of ``q_len`` tokens: the one tuned
    for ``spec``'s GPU, heads, cache format and q_len when one ships, else None."""
    return None if spec is None else tuned_device_ladder(spec, max_model_len, q_len=q_len)


def split_kv_ladder(max_model_len: int, spec: BufferSpec | None = None) -> BucketLadder:
    """The default ladder of the split-KV backends: the one tuned for ``spec``'s GPU, heads
    and cache format when one ships (``policies.device_ladder``), else
    ``ladder.default_ladder``."""
    return device_ladder(spec, max_model_len) if spec is not None else \
        default_ladder(max_model_len)


@dataclass(frozen=True, slots=True)
class SplitWorkspaceSpec:
    """Split partials for up to ``max_batch`` requests x ``max_splits`` splits (float32),
    and, for balanced plans, partials of ``max_items`` work items plus the item index."""

    max_batch: int
    num_heads: int
    max_splits: int
    kv_lora_rank: int
    max_items: int = 0

    @property
    def nbytes(self) -> int:
        split = 0
        if self.max_splits > 1:
            split = 4 * self.max_batch * self.num_heads * self.max_splits * (self.kv_lora_rank + 1)
        if self.max_items <= 0:
            return split
        items = 4 * self.max_items * self.num_heads * (self.kv_lora_rank + 1)
        # + the indptrs, chunk_tiles and the merge's list
        return split + items + 4 * (3 * self.max_batch + 4)

    def allocate(self, device: torch.device | str) -> SplitWorkspace | None:
        if self.max_splits <= 1 and self.max_items <= 0:
            return None  # every plan is one-split: stage 2 never runs
        return SplitWorkspace.allocate(self.max_batch, self.num_heads, self.max_splits,
                                       self.kv_lora_rank, device, max_items=self.max_items)


class TritonBackend:
    """Triton split-KV MLA decode (stage 1 + blocked merge, or the one-split fast path).

    ``num_sms`` defaults to the CUDA device's multiprocessor count, or to the H200's 132
    without CUDA (pass a small value in CPU tests to keep split counts low).
    ``balanced=True`` plans balanced split-KV (device-side partition; one plan per batch
    size whatever the hint) instead of split-KV.
    """

    name = "triton"

    def __init__(self, *, kv_lora_rank: int = 512, qk_rope_dim: int = 64,
                 num_sms: int | None = None, device: torch.device | str | None = None,
                 max_splits: int = MAX_KV_SPLITS, balanced: bool = False) -> None:
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_dim = qk_rope_dim
        self.num_sms = num_sms if num_sms is not None else device_num_sms(device)
        self.max_splits = max_splits
        self.balanced = balanced
        self._plan = functools.lru_cache(maxsize=_PLAN_CACHE_SIZE)(self._plan_uncached)
        self._plan_seesaw = functools.lru_cache(maxsize=256)(self._plan_seesaw_uncached)

    def __repr__(self) -> str:
        return (f"TritonBackend(kv_lora_rank={self.kv_lora_rank}, qk_rope_dim={self.qk_rope_dim}"
                f", num_sms={self.num_sms}{', balanced=True' if self.balanced else ''})")

    def plan(self, batch_size: int, num_heads: int, hint: int) -> LaunchPlan:
        """Pure host arithmetic, cached; see ``graphbucket.plan.plan_mla_decode``."""
        return self._plan(batch_size, num_heads, hint)

    def plan_balanced(self, batch_size: int, num_heads: int,
                      kernel: str = DEFAULT_BALANCED_KERNEL) -> LaunchPlan:
        """Balanced split-KV for any lengths (no hint); see ``plan_balanced_mla_decode``.
        ``kernel="seesaw"`` (below 64 heads): 64-row programs whose stage 1 the Gluon
        seesaw runs on Hopper (``kernels.seesaw_route.runs_seesaw``; elsewhere the Triton kernel
        runs the same plan, correct and slower). ``kernel="seesaw-ranges"``: the seesaw on
        one persistent program per SM over equal ranges of the step's tiles.
        ``kernel="seesaw-fitted"``: the seesaw over work items whose chunk the device
        grows until each program runs at most one (``fit_items``).
        ``kernel="seesaw-charged"``: the tile ranges cut equal in work, each request
        charged ``plan.RANGE_REQUEST_CHARGE_TILES`` tiles (``charged_ranges``)."""
        if kernel == DEFAULT_BALANCED_KERNEL:
            return self._plan(batch_size, num_heads, 0)
        check_balanced_kernel(self.name, kernel, self.balanced_kernels(num_heads))
        return self._plan_seesaw(batch_size, num_heads,
                                 kernel in (RANGES_BALANCED_KERNEL, CHARGED_BALANCED_KERNEL),
                                 kernel == FITTED_BALANCED_KERNEL,
                                 kernel == CHARGED_BALANCED_KERNEL)

    def balanced_kernels(self, num_heads: int) -> tuple[str, ...]:
        if head_block_size(num_heads) == SEESAW_STREAM.block_h:  # the default is the seesaw
            return (DEFAULT_BALANCED_KERNEL, RANGES_BALANCED_KERNEL, FITTED_BALANCED_KERNEL,
                    CHARGED_BALANCED_KERNEL)
        return (DEFAULT_BALANCED_KERNEL, SEESAW_BALANCED_KERNEL, RANGES_BALANCED_KERNEL,
                FITTED_BALANCED_KERNEL, CHARGED_BALANCED_KERNEL)

    def _plan_seesaw_uncached(self, batch_size: int, num_heads: int,
                              tile_ranges: bool = False, fit_items: bool = False,
                              charged_ranges: bool = False) -> LaunchPlan:
        return plan_balanced_mla_decode(batch_size, num_heads, num_sms=self.num_sms,
                                        kv_lora_rank=self.kv_lora_rank,
                                        qk_rope_dim=self.qk_rope_dim, stream=SEESAW_STREAM,
                                        tile_ranges=tile_ranges, fit_items=fit_items,
                                        charged_ranges=charged_ranges)

    def default_ladder(self, max_model_len: int, spec: BufferSpec | None = None
                       ) -> BucketLadder:
        """See ``split_kv_ladder``."""
        return split_kv_ladder(max_model_len, spec)

    def default_q_ladder(self, max_model_len: int, spec: BufferSpec | None, q_len: int
                         ) -> BucketLadder | None:
        """See ``split_kv_q_ladder``."""
        return split_kv_q_ladder(max_model_len, spec, q_len)

    def _plan_uncached(self, batch_size: int, num_heads: int, hint: int) -> LaunchPlan:
        if self.balanced or hint == 0:  # hint 0: plan_balanced's cache slot
            return plan_balanced_mla_decode(batch_size, num_heads, num_sms=self.num_sms,
                                            kv_lora_rank=self.kv_lora_rank,
                                            qk_rope_dim=self.qk_rope_dim)
        return plan_mla_decode(batch_size, num_heads, hint, num_sms=self.num_sms,
                               kv_lora_rank=self.kv_lora_rank, qk_rope_dim=self.qk_rope_dim,
                               max_splits=self.max_splits)

    def workspace_spec(self, plans: Iterable[LaunchPlan]) -> SplitWorkspaceSpec:
        """One workspace for every plan: the largest batch, head count (a verify step's
        plans fold q_len x heads rows), split count and work items. The kernels address
        it through its strides, so a plan with fewer heads uses part of each row."""
        plans = list(plans)
        if not plans:
            raise ValueError("workspace_spec needs at least one LaunchPlan")
        return SplitWorkspaceSpec(max(p.batch_size for p in plans),
                                  max(p.num_heads for p in plans),
                                  max(p.num_kv_splits for p in plans), self.kv_lora_rank,
                                  max(p.max_work_items for p in plans))

    def partitions_once(self, plan: LaunchPlan) -> bool:
        return plan.balanced

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, out: torch.Tensor, workspace: SplitWorkspace | None, *,
            plan: LaunchPlan, sm_scale: float, lse: torch.Tensor | None = None,
            kv_scale: torch.Tensor | None = None, q_len: int = 1,
            partition_ready: bool = False) -> torch.Tensor:
        """See ``graphbucket.kernels.mla_decode``. Graph-safe: launches only.
        ``partition_ready``: a balanced plan's partition of these lengths is in the
        workspace already (an earlier layer of the step planned it): the planner is skipped."""
        if plan.balanced:
            if q_len != 1:
                raise ValueError(f"q_len={q_len} with a balanced plan: balanced split-KV "
                                 "decodes one token per request; plan split-KV")
            return mla_decode_balanced(q, kv_cache, block_table, seq_lens, out, workspace,
                                       plan=plan, sm_scale=sm_scale, lse=lse, kv_scale=kv_scale,
                                       partition=not partition_ready)
        return mla_decode(q, kv_cache, block_table, seq_lens, out, workspace, plan=plan,
                          sm_scale=sm_scale, lse=lse, kv_scale=kv_scale, q_len=q_len)
