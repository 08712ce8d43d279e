"""AITER sparse backend (ROCm): graphbucket's indexer and top-k, AITER's MLA decode.

``AiterSparseBackend`` keeps ``SparseBackend``'s contract (``plan`` / ``workspace_spec``
/ ``run_sparse``) and changes only the last step: the attention over the selected tokens
runs in ``aiter.mla.mla_decode_fwd``, persistent mode. Untested on ROCm (no machine here);
the index building is tested on CPU.

One step, all of it captured in the graph:

1. ``select_tokens``: Triton indexer logits and top-k -> ``indices`` [R, topk] positions
   (-1 padding), ``sparse_lens`` [R] = min(len, topk).
2. ``fill_sparse_kv_indices``: every query row is its own AITER "batch" of one query
   token (``qo_indptr = arange``) over a one-token-page view of the cache
   (``kv_last_page_lens = 1``); ``kv_indptr`` = prefix sum of ``sparse_lens`` and
   ``kv_indices`` [R * topk] the selected tokens' slots ``block_table[r, pos // page] *
   page + pos % page``, row r compacted at ``kv_indptr[r]``.
3. ``get_mla_metadata_v1(..., is_sparse work buffers)`` partitions the work on the device
   from those indptrs, then ``mla_decode_fwd`` runs stage 1 and the reduce.

Unlike vLLM's ROCm AITER sparse metadata builder (which fills the same buffers eagerly,
synchronizes the stream and keeps a CPU fingerprint of the lengths to skip unchanged
steps), nothing here reads lengths on the host or synchronizes: the metadata op is
replayed with the graph. Plans keep the indexer's hint-dependent split count; the
attention's splits are AITER's (``attention_splits = 1``), so attention buckets alias.

To check on a ROCm machine: zero-length rows in get_mla_metadata_v1 (their outputs are
zeroed after the decode); the seed caps ``max_split_per_batch`` by min(len, topk) / 128,
here AITER's default is kept; heads 16..128 in steps of 16 (vLLM pads fewer to 16).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from graphbucket.backends.aiter import (
    WORK_BUFFERS,
    BufferShapes,
    compact_rows,
    work_buffer_shapes,
)
from graphbucket.fp8 import cache_format_of
from graphbucket.kernels.verify import flatten_verify
from graphbucket.sparse.backend import SparseBackend, SparseWorkspaceSpec
from graphbucket.sparse.decode import SparseWorkspace, check_sparse_args, select_tokens
from graphbucket.sparse.plan import SparsePlan

_INSTALL_HINT = (
    "AiterSparseBackend needs AMD's AITER on a ROCm machine (MI300/MI355 class): "
    "`pip install aiter` or build it from AMD's ROCm/aiter repository; use "
    "SparseBackend (Triton) elsewhere"
)


def _load_aiter():
    try:
        from aiter import get_mla_metadata_info_v1, get_mla_metadata_v1
        from aiter.mla import mla_decode_fwd
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(_INSTALL_HINT) from exc
    return get_mla_metadata_info_v1, get_mla_metadata_v1, mla_decode_fwd


def fill_sparse_kv_indices(indices: torch.Tensor, sparse_lens: torch.Tensor,
                           block_table: torch.Tensor, *, page_size: int,
                           kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> None:
    """AITER's page-size-1 description of R rows' selected tokens, in persistent buffers.

    ``indices`` [R, K] int32 positions, the first ``sparse_lens[r]`` of row r live (then
    -1), ``block_table`` [R, C] int32 pages of ``page_size`` tokens -> ``kv_indptr``
    [R + 1] = exclusive prefix sum of ``sparse_lens``, ``kv_indices`` [R * K] the slots
    ``block_table[r, pos // page_size] * page_size + pos % page_size`` of row r at
    kv_indptr[r] .. kv_indptr[r + 1], zeros after the total.
    Graph-safe: fixed shapes, no host reads (padding positions are clamped, then dropped).
    """
    rows, k = indices.shape
    if (kv_indptr.shape != (rows + 1,) or kv_indices.shape != (rows * k,)
            or sparse_lens.shape != (rows,) or block_table.shape[0] != rows):
        raise ValueError(
            f"for {rows} rows of top-{k} expected sparse_lens [{rows}], block_table "
            f"[{rows}, C], kv_indptr [{rows + 1}], kv_indices [{rows * k}]; got "
            f"{tuple(sparse_lens.shape)}, {tuple(block_table.shape)}, "
            f"{tuple(kv_indptr.shape)}, {tuple(kv_indices.shape)}")
    pos = indices.to(torch.int64).clamp(min=0)
    cols = (pos // page_size).clamp(max=block_table.shape[1] - 1)
    pages = block_table.to(torch.int64).gather(1, cols)
    compact_rows(pages * page_size + pos % page_size, sparse_lens, kv_indptr=kv_indptr,
                 kv_indices=kv_indices)


@dataclass(frozen=True, slots=True)
class AiterSparseWorkspace:
    """Static buffers of one AITER sparse step, sized once for ``max_rows`` rows.

    sparse:            the indexer / top-k buffers (``SparseWorkspace``; its split
                       partials have width 0: AITER keeps its own)
    qo_indptr:         [max_rows + 1] int32, arange (one query token per row)
    kv_indptr:         [max_rows + 1] int32
    kv_indices:        [max_rows * topk] int32 token slots
    kv_last_page_lens: [max_rows] int32, ones (one-token pages)
    work:              AITER's six persistent work buffers (``WORK_BUFFERS`` order)
    """

    sparse: SparseWorkspace
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_lens: torch.Tensor
    work: tuple[torch.Tensor, ...]

    def views(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                        torch.Tensor]:
        """qo_indptr, kv_indptr, kv_indices, kv_last_page_lens for ``rows`` rows."""
        k = self.sparse.indices.shape[1]
        return (self.qo_indptr[: rows + 1], self.kv_indptr[: rows + 1],
                self.kv_indices[: rows * k], self.kv_last_page_lens[:rows])


@dataclass(frozen=True, slots=True)
class AiterSparseWorkspaceSpec:
    """An ``AiterSparseWorkspace``: the indexer's buffers plus AITER's, worst case."""

    max_rows: int
    num_heads: int
    max_len: int
    topk: int
    work: BufferShapes

    @property
    def index_spec(self) -> SparseWorkspaceSpec:
        return SparseWorkspaceSpec(self.max_rows, self.num_heads, self.max_len, self.topk,
                                   max_splits=1, kv_lora_rank=0)

    @property
    def nbytes(self) -> int:
        rows = self.max_rows
        aiter = 4 * (2 * (rows + 1) + rows * self.topk + rows)
        work = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in self.work)
        return self.index_spec.nbytes + aiter + work

    def allocate(self, device: torch.device | str) -> AiterSparseWorkspace:
        rows, i32 = self.max_rows, torch.int32
        return AiterSparseWorkspace(
            self.index_spec.allocate(device),
            torch.arange(rows + 1, dtype=i32, device=device),
            torch.zeros(rows + 1, dtype=i32, device=device),
            torch.zeros(rows * self.topk, dtype=i32, device=device),
            torch.ones(rows, dtype=i32, device=device),
            tuple(torch.zeros(shape, dtype=dtype, device=device)
                  for _, shape, dtype in self.work))


class AiterSparseBackend(SparseBackend):
    """``SparseBackend`` with AITER's persistent MLA decode as the attention step.

    Same arguments as ``SparseBackend`` plus ``q_dtype`` / ``kv_dtype`` (default
    ``q_dtype``), which size AITER's work buffers. Needs ROCm + AITER at construction;
    takes a bf16 / fp16 latent cache (not the V3.2 uint8 one) and 16..128 heads in steps
    of 16.
    """

    def __init__(self, *, q_dtype: torch.dtype = torch.bfloat16,
                 kv_dtype: torch.dtype | None = None, **kwargs) -> None:
        self._info, self._metadata, self._decode = _load_aiter()
        super().__init__(**kwargs)
        if self.num_heads % 16 or not 16 <= self.num_heads <= 128:
            raise ValueError(f"AITER's sparse MLA decode takes 16..128 heads in steps of 16, "
                             f"got num_heads={self.num_heads}; pad q's heads to 16")
        self.q_dtype, self.kv_dtype = q_dtype, kv_dtype or q_dtype

    def __repr__(self) -> str:
        return "Aiter" + super().__repr__()

    def plan(self, batch_size: int, num_heads: int, hint: int) -> SparsePlan:
        """``SparseBackend.plan`` with one attention split: AITER partitions on device."""
        return replace(super().plan(batch_size, num_heads, hint), attention_splits=1)

    def workspace_spec(self, plans: Iterable[SparsePlan]) -> AiterSparseWorkspaceSpec:
        """The most rows of ``plans``; AITER's work buffers from get_mla_metadata_info_v1."""
        plans = list(plans)
        if not plans:
            raise ValueError("workspace_spec needs at least one SparsePlan")
        rows = max(p.num_rows for p in plans)
        info = self._info(rows, 1, self.num_heads, self.q_dtype, self.kv_dtype,
                          is_sparse=True, fast_mode=True)
        return AiterSparseWorkspaceSpec(rows, self.num_heads, self.max_len, self.topk,
                                        work_buffer_shapes(info))

    def run_sparse(self, q: torch.Tensor, kv_cache: torch.Tensor, index_q: torch.Tensor,
                   index_weights: torch.Tensor, index_cache: torch.Tensor,
                   index_scales: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, out: torch.Tensor,
                   workspace: AiterSparseWorkspace, *, plan: SparsePlan, sm_scale: float,
                   q_len: int = 1) -> torch.Tensor:
        """``SparseBackend.run_sparse`` with AITER's attention (shapes as there).
        Graph-safe: fixed-shape torch ops and launches only, no host reads."""
        if not isinstance(workspace, AiterSparseWorkspace):
            raise TypeError("workspace must come from AiterSparseBackend.workspace_spec(...)"
                            f".allocate(...), got {type(workspace).__name__}")
        if cache_format_of(kv_cache).kernel_tag != "dense" or q.dtype != self.q_dtype \
                or kv_cache.dtype != self.kv_dtype:
            raise TypeError(f"q {q.dtype} / kv_cache {kv_cache.dtype}: the work buffers were "
                            f"sized for {self.q_dtype} / {self.kv_dtype} (no V3.2 uint8 cache)")
        if q_len > 1:
            bs = q.shape[0] // q_len
            q, block_table, seq_lens = flatten_verify(q.view(bs, -1, q.shape[-1]), block_table,
                                                      seq_lens[:bs], q_len)
        ws, rows = workspace.sparse, plan.num_rows
        check_sparse_args(q, kv_cache, index_q, index_weights, index_cache, index_scales,
                          block_table, seq_lens, out, ws, plan)
        select_tokens(index_q, index_weights, index_cache, index_scales, block_table,
                      seq_lens, ws, plan=plan)
        qo_indptr, kv_indptr, kv_indices, last = workspace.views(rows)
        fill_sparse_kv_indices(ws.indices[:rows], ws.sparse_lens[:rows], block_table[:rows],
                               page_size=kv_cache.shape[1], kv_indptr=kv_indptr,
                               kv_indices=kv_indices)
        work = dict(zip(WORK_BUFFERS, workspace.work, strict=True))
        dtypes = {} if self.q_dtype == self.kv_dtype == torch.bfloat16 else {
            "dtype_q": self.q_dtype, "dtype_kv": self.kv_dtype}
        # Positional order is AITER's (as in graphbucket.backends.aiter).
        self._metadata(qo_indptr, kv_indptr, last, self.num_heads, 1, True,
                       work["work_meta_data"], work["work_info_set"], work["work_indptr"],
                       work["reduce_indptr"], work["reduce_final_map"],
                       work["reduce_partial_map"], page_size=1, kv_granularity=16,
                       max_seqlen_qo=1, uni_seqlen_qo=1, fast_mode=True, **dtypes)
        kv = kv_cache.view(-1, 1, 1, kv_cache.shape[-1])  # [token slots, 1, kv heads, D]
        self._decode(q, kv, out, qo_indptr, kv_indptr, kv_indices, last, 1,
                     page_size=1, nhead_kv=1, sm_scale=sm_scale, **work)
        out.masked_fill_((seq_lens[:rows] <= 0)[:, None, None], 0)
        return out
