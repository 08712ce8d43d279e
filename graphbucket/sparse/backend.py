"""Sparse MLA decode behind graphbucket's plan / capture / replay path.

``SparseBackend`` plans ``SparsePlan``s (``plan_sparse_decode``) for the graph table and
the runner exactly where the dense backends plan ``LaunchPlan``s: ``plan(batch, heads x
q_len, hint)`` (the protocol's folded head count) becomes a plan of batch x q_len flat
rows (``kernels.verify.flatten_verify``: the sparse decode gives each query token its own
index set). Keys whose whole plans are equal alias one graph: the attention saturates at
top-k, so buckets above it differ only where the indexer's split count does, and the
indexer's budget caps that count too (for one row at 132 SMs: 512 splits from 128K).

The model calls ``ctx.attend(q, kv_cache, out, index=IndexInputs(...))`` like any
backend's: the indexer's inputs travel as ``index``. ``default_ladder`` gives the ``ladder``
policy's buckets for this backend: the sparse ladder tuned for the GPU where one ships,
else ``sparse_ladder``, doubling bounds from top-k up, where each bucket buys the indexer
more splits. There is no balanced topology.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from graphbucket.backends.triton import device_num_sms
from graphbucket.bucket import DEFAULT_BALANCED_KERNEL
from graphbucket.kernels.verify import flatten_verify
from graphbucket.ladder import Bucket, BucketLadder
from graphbucket.policies import tuned_device_ladder
from graphbucket.sparse.decode import SparseWorkspace, sparse_mla_decode
from graphbucket.sparse.plan import DEFAULT_TOPK, SparsePlan, plan_sparse_decode
from graphbucket.sparse.topk import TopkScratch
from graphbucket.spec import BufferSpec


@dataclass(frozen=True, slots=True)
class IndexInputs:
    """What the sparse decode reads beside the latent cache, one row per query token:
    q [T, 64, 128] and weights [T, 64] float32 of the indexer, and the layer's index cache
    (e4m3 [num_pages, page_size, 128]) with its scales (float32 [num_pages, page_size])."""

    q: torch.Tensor
    weights: torch.Tensor
    cache: torch.Tensor
    scales: torch.Tensor


@dataclass(frozen=True, slots=True)
class SparseWorkspaceSpec:
    """A ``SparseWorkspace`` for ``max_rows`` query rows of contexts up to ``max_len``."""

    max_rows: int
    num_heads: int
    max_len: int
    topk: int
    max_splits: int
    kv_lora_rank: int = 512

    @property
    def nbytes(self) -> int:
        rows = self.max_rows
        split = rows * self.num_heads * self.max_splits * (self.kv_lora_rank + 1)
        return (4 * (rows * self.max_len + rows * self.topk + rows + split)
                + TopkScratch.nbytes(rows, self.max_len))

    def allocate(self, device: torch.device | str) -> SparseWorkspace:
        return SparseWorkspace.allocate(self.max_rows, self.num_heads, self.max_len,
                                        topk=self.topk, max_splits=self.max_splits,
                                        device=device, kv_lora_rank=self.kv_lora_rank)


class SparseBackend:
    """DeepSeek-V3.2 sparse MLA decode (indexer -> top-k -> sparse attention) for runners.

    ``num_heads``: attention heads per query token (the plan unfolds the protocol's
    q_len x heads); ``max_len``: the longest context (the indexer's logits row width);
    ``num_sms`` defaults to the CUDA device's count, else the H200's 132 (pass a small
    value in CPU tests to keep split counts low).
    """

    name = "sparse"

    def __init__(self, *, num_heads: int, max_len: int, topk: int = DEFAULT_TOPK,
                 kv_lora_rank: int = 512, qk_rope_dim: int = 64, num_sms: int | None = None,
                 device: torch.device | str | None = None) -> None:
        if num_heads < 1 or max_len < 1 or topk < 1:
            raise ValueError(f"num_heads, max_len and topk must be >= 1, got {num_heads}, "
                             f"{max_len} and {topk}")
        self.num_heads, self.max_len, self.topk = num_heads, max_len, topk
        self.kv_lora_rank, self.qk_rope_dim = kv_lora_rank, qk_rope_dim
        self.num_sms = num_sms if num_sms is not None else device_num_sms(device)

    def __repr__(self) -> str:
        return (f"SparseBackend(num_heads={self.num_heads}, max_len={self.max_len}, "
                f"topk={self.topk}, num_sms={self.num_sms})")

    def plan(self, batch_size: int, num_heads: int, hint: int) -> SparsePlan:
        """``batch_size`` requests of ``num_heads // self.num_heads`` query tokens each,
        planned at context ``hint``. Pure host arithmetic."""
        q_len, rest = divmod(num_heads, self.num_heads)
        if rest or q_len < 1:
            raise ValueError(f"num_heads={num_heads} is not q_len x {self.num_heads} (the "
                             "backend's heads per token); build it with the model's heads")
        return plan_sparse_decode(batch_size * q_len, self.num_heads, hint, topk=self.topk,
                                  num_sms=self.num_sms)

    def balanced_kernels(self, num_heads: int) -> tuple[str, ...]:
        return ()  # no balanced topology

    def plan_balanced(self, batch_size: int, num_heads: int,
                      kernel: str = DEFAULT_BALANCED_KERNEL) -> SparsePlan:
        raise ValueError("the ladder asks for a balanced graph (a bucket with "
                         "balanced_imbalance, e.g. policy 'balanced-only') but sparse decode "
                         "has no balanced topology; use a ladder whose buckets set "
                         "balanced_imbalance=0 (e.g. policy 'ladder')")

    def default_ladder(self, max_model_len: int, spec: BufferSpec | None = None
                       ) -> BucketLadder:
        """The sparse ladder tuned for ``spec``'s GPU, heads, cache format and this top-k
        when one ships (``h200-h16-sparse.json``: ``tune_ladder.py --sparse``), else
        ``sparse_ladder`` at this backend's top-k."""
        tuned = None if spec is None else tuned_device_ladder(spec, max_model_len,
                                                              sparse_topk=self.topk)
        return tuned if tuned is not None else sparse_ladder(max_model_len, topk=self.topk)

    def default_q_ladder(self, max_model_len: int, spec: BufferSpec | None, q_len: int
                         ) -> BucketLadder | None:
        """The sparse ladder tuned for verify steps of ``q_len`` tokens at this top-k when
        one ships, else None."""
        return None if spec is None else tuned_device_ladder(
            spec, max_model_len, sparse_topk=self.topk, q_len=q_len)

    def workspace_spec(self, plans: Iterable[SparsePlan]) -> SparseWorkspaceSpec:
        """One workspace for every plan: the most rows and attention splits."""
        plans = list(plans)
        if not plans:
            raise ValueError("workspace_spec needs at least one SparsePlan")
        return SparseWorkspaceSpec(max(p.num_rows for p in plans), self.num_heads,
                                   self.max_len, self.topk,
                                   max(p.attention_splits for p in plans), self.kv_lora_rank)

    def partitions_once(self, plan) -> bool:
        return False  # each layer indexes its own positions

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, out: torch.Tensor, workspace: SparseWorkspace, *,
            plan: SparsePlan, sm_scale: float, lse: torch.Tensor | None = None,
            q_len: int = 1, index: IndexInputs | None = None, **inputs: Any) -> torch.Tensor:
        """The protocol's launch (``ctx.attend``): q [B, q_len x H, 576] folded or
        [B x q_len, H, 576], out likewise with 512 columns; ``index`` the indexer's
        inputs. See ``run_sparse``. Graph-safe."""
        if not isinstance(index, IndexInputs) or inputs or lse is not None:
            got = ", ".join([f"index={type(index).__name__}", *map(repr, inputs)]
                            + (["lse"] if lse is not None else []))
            raise TypeError(f"the sparse backend takes index=IndexInputs(...) and no lse or "
                            f"other inputs, got {got}; pass the indexer's q, weights, index "
                            "cache and scales as ctx.attend(q, kv_cache, out, "
                            "index=IndexInputs(...))")
        heads = self.num_heads
        self.run_sparse(q.reshape(-1, heads, q.shape[-1]), kv_cache, index.q, index.weights,
                        index.cache, index.scales, block_table, seq_lens,
                        out.view(-1, heads, out.shape[-1]), workspace, plan=plan,
                        sm_scale=sm_scale, q_len=q_len)
        return out

    def run_sparse(self, q: torch.Tensor, kv_cache: torch.Tensor, index_q: torch.Tensor,
                   index_weights: torch.Tensor, index_cache: torch.Tensor,
                   index_scales: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, out: torch.Tensor, workspace: SparseWorkspace, *,
                   plan: SparsePlan, sm_scale: float, q_len: int = 1) -> torch.Tensor:
        """Sparse decode of B x q_len query tokens (row b * q_len + j: request b's token j),
        each input passed by name (``run`` takes them as ``IndexInputs``).

        q [B * q_len, H, 576], index_q [B * q_len, 64, 128], index_weights [B * q_len, 64]
        float32, out [B * q_len, H, 512]; block_table [B, pages] and seq_lens [B] per
        request (the q_len new tokens counted), flattened to one row per token here.
        See ``sparse.sparse_mla_decode``. Graph-safe: fixed-shape ops and launches only.
        """
        if q_len > 1:
            bs = q.shape[0] // q_len
            q, block_table, seq_lens = flatten_verify(q.view(bs, -1, q.shape[-1]), block_table,
                                                      seq_lens[:bs], q_len)
        return sparse_mla_decode(q, kv_cache, index_q, index_weights, index_cache,
                                 index_scales, block_table, seq_lens, out, workspace,
                                 plan=plan, sm_scale=sm_scale)


def sparse_ladder(max_model_len: int, *, topk: int = DEFAULT_TOPK) -> BucketLadder:
    """Buckets ..topk/4, ..topk, then doubling to ``max_model_len``, each hinted at its top.

    Below top-k the attention's splits still grow with the context; from top-k on only the
    indexer's do (one more power of two per doubling until its budget is spent, where
    neighbouring buckets plan alike and alias)."""
    bounds = {max(1, topk // 4), topk}
    bound = 2 * topk
    while bound < max_model_len:
        bounds.add(bound)
        bound *= 2
    tops = sorted(b for b in bounds if b < max_model_len) + [max_model_len]
    return BucketLadder(tuple(Bucket(max_len=b, hint=b) for b in tops), max_model_len,
                        meta={"source": "sparse_ladder", "topk": topk})
