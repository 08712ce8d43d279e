"""Sparse MLA decode (DeepSeek-V3.2): indexer logits -> top-k -> sparse attention.

``sparse_mla_decode`` launches the three steps (four kernels with the attention merge)
on fixed grids from a frozen ``SparsePlan``, into a ``SparseWorkspace`` allocated once.
Every step reads the live lengths on the device, so a CUDA graph captured with any plan
replays correctly for any lengths up to the workspace's ``max_len``.

Rows are query tokens (the flat spec-as-decode form, ``graphbucket.kernels.verify.
flatten_verify``): row r has its own q, block-table row and causal limit ``seq_lens[r]``
(the positions it may see: 0 .. seq_lens[r] - 1; 0 for padding rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphbucket.fp8 import FP8_DTYPE, cache_format_of
from graphbucket.kernels.launch import SplitWorkspace
from graphbucket.sparse.attention import launch_sparse_attention
from graphbucket.sparse.index_cache import INDEX_DIM
from graphbucket.sparse.indexer import launch_indexer_logits
from graphbucket.sparse.plan import SparsePlan
from graphbucket.sparse.topk import TopkScratch, launch_topk

KV_LORA_RANK, ROPE_DIM = 512, 64


@dataclass(frozen=True, slots=True)
class SparseWorkspace:
    """Static buffers of sparse decode, sized once for the largest plan.

    logits:      [max_rows, max_len] float32, the indexer's output (entries past a
                 row's length are stale and never read)
    indices:     [max_rows, topk] int32, the selected positions (-1 padding)
    sparse_lens: [max_rows] int32, min(length, topk) per row
    split:       the attention's split partials (``SplitWorkspace``)
    topk:        the top-k's histograms and counts (``TopkScratch``)
    """

    logits: torch.Tensor
    indices: torch.Tensor
    sparse_lens: torch.Tensor
    split: SplitWorkspace
    topk: TopkScratch

    @classmethod
    def allocate(cls, max_rows: int, num_heads: int, max_len: int, *, topk: int,
                 max_splits: int, device: torch.device | str,
                 kv_lora_rank: int = KV_LORA_RANK) -> SparseWorkspace:
        return cls(torch.empty(max_rows, max_len, dtype=torch.float32, device=device),
                   torch.full((max_rows, topk), -1, dtype=torch.int32, device=device),
                   torch.zeros(max_rows, dtype=torch.int32, device=device),
                   SplitWorkspace.allocate(max_rows, num_heads, max_splits, kv_lora_rank,
                                           device),
                   TopkScratch.allocate(max_rows, max_len, device))

    @property
    def max_len(self) -> int:
        return self.logits.shape[1]

    def fits(self, plan: SparsePlan) -> bool:
        rows, heads, splits, _ = self.split.partial_o.shape
        return (plan.num_rows <= min(rows, self.indices.shape[0])
                and plan.num_heads == heads and plan.topk == self.indices.shape[1]
                and (plan.attention_splits == 1 or plan.attention_splits <= splits))


def _fail(name: str, got, expected: str, fix: str) -> None:
    raise ValueError(f"{name}: got {got}, expected {expected}. {fix}")


def _check_tensor(name: str, t, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        _fail(f"{name}.device", t.device, str(device), "Keep every input on one device.")


def check_sparse_args(q, kv_cache, index_q, index_weights, index_cache, index_scales,
                      block_table, seq_lens, out, workspace, plan: SparsePlan,
                      lse=None) -> None:
    """Shapes, dtypes and devices against the plan (host metadata only, no sync)."""
    rows, heads = plan.num_rows, plan.num_heads
    named = (("q", q), ("kv_cache", kv_cache), ("index_q", index_q),
             ("index_weights", index_weights), ("index_cache", index_cache),
             ("index_scales", index_scales), ("block_table", block_table),
             ("seq_lens", seq_lens), ("out", out))
    for name, t in named:
        _check_tensor(name, t, q.device)
    if not isinstance(workspace, SparseWorkspace):
        raise TypeError(f"workspace must be a SparseWorkspace, got {type(workspace).__name__}")
    if not workspace.fits(plan):
        _fail("workspace", f"indices {tuple(workspace.indices.shape)}, partials "
              f"{tuple(workspace.split.partial_o.shape)}", f"room for {plan.describe()}",
              "Allocate a SparseWorkspace covering every plan you will launch.")
    if workspace.logits.device != q.device:
        _fail("workspace.device", workspace.logits.device, str(q.device),
              "Allocate the workspace on the inputs' device.")
    dim = KV_LORA_RANK + ROPE_DIM
    if tuple(q.shape) != (rows, heads, dim) or q.stride(2) != 1:
        _fail("q", tuple(q.shape), f"{(rows, heads, dim)} with a contiguous last dimension",
              "Pass one row per query token (flatten verify steps with flatten_verify).")
    fmt = cache_format_of(kv_cache)
    if fmt.kernel_tag == "v32":
        fmt.check_rows(kv_cache, kv_lora_rank=KV_LORA_RANK, qk_rope_dim=ROPE_DIM)
        if q.dtype not in (torch.bfloat16, torch.float16):
            _fail("q.dtype", q.dtype, "bfloat16 or float16 for a V3.2 (uint8) cache",
                  "Cast q to bf16.")
    elif kv_cache.dim() != 3 or kv_cache.shape[2] != dim or kv_cache.dtype != q.dtype \
            or kv_cache.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        _fail("kv_cache", f"{kv_cache.dtype} {tuple(kv_cache.shape)}",
              f"[num_pages, page_size, {dim}] of q's dtype ({q.dtype}), or a uint8 V3.2 cache",
              "Pass the latent cache (bf16, or fp8 V3.2 rows from graphbucket.fp8.pack_v32).")
    if tuple(out.shape) != (rows, heads, KV_LORA_RANK) or out.stride(2) != 1:
        _fail("out.shape", tuple(out.shape), str((rows, heads, KV_LORA_RANK)),
              "Allocate out as [rows, heads, kv_lora_rank].")
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != (rows, heads)):
        _fail("lse", f"{lse.dtype} {tuple(lse.shape)}", f"float32 {(rows, heads)}",
              "Pass lse=None or a float32 [rows, heads] tensor.")
    _check_indexer_args(index_q, index_weights, index_cache, index_scales, kv_cache, plan)
    if block_table.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] < rows:
        _fail("block_table", f"{block_table.dtype} {tuple(block_table.shape)}",
              f"int32 [>= {rows}, max_pages]", "One table row per query row.")
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1 or seq_lens.shape[0] < rows:
        _fail("seq_lens", f"{seq_lens.dtype} {tuple(seq_lens.shape)}", f"int32 [>= {rows}]",
              "Pass int32 causal limits, one per query row.")


def _check_indexer_args(index_q, index_weights, index_cache, index_scales, kv_cache,
                        plan: SparsePlan) -> None:
    shape = (plan.num_rows, plan.index_heads, INDEX_DIM)
    if tuple(index_q.shape) != shape or index_q.stride(2) != 1 or index_q.dtype not in (
            torch.bfloat16, torch.float16, torch.float32):
        _fail("index_q", f"{index_q.dtype} {tuple(index_q.shape)}",
              f"bf16 / fp16 / fp32 {shape}, contiguous last dimension",
              "Pass the indexer's query heads, one row per query token.")
    if index_weights.dtype != torch.float32 or tuple(index_weights.shape) != shape[:2]:
        _fail("index_weights", f"{index_weights.dtype} {tuple(index_weights.shape)}",
              f"float32 {shape[:2]}", "Pass the indexer's head weights as float32.")
    if index_cache.dtype != FP8_DTYPE or index_cache.dim() != 3 \
            or index_cache.shape[2] != INDEX_DIM or index_cache.stride(2) != 1:
        _fail("index_cache", f"{index_cache.dtype} {tuple(index_cache.shape)}",
              f"{FP8_DTYPE} [num_pages, page_size, {INDEX_DIM}]",
              "Store keys with graphbucket.sparse.store_index_keys.")
    if index_cache.shape[:2] != kv_cache.shape[:2]:
        _fail("index_cache.shape", tuple(index_cache.shape[:2]),
              f"the latent cache's pages {tuple(kv_cache.shape[:2])}",
              "The index cache is paged like the latent cache (one block table for both).")
    if index_scales.dtype != torch.float32 or index_scales.shape != index_cache.shape[:2] \
            or index_scales.stride(1) != 1:
        _fail("index_scales", f"{index_scales.dtype} {tuple(index_scales.shape)}",
              f"float32 {tuple(index_cache.shape[:2])}", "One float32 scale per cached token.")


def select_tokens(index_q: torch.Tensor, index_weights: torch.Tensor,
                  index_cache: torch.Tensor, index_scales: torch.Tensor,
                  block_table: torch.Tensor, seq_lens: torch.Tensor,
                  workspace: SparseWorkspace, *, plan: SparsePlan) -> None:
    """The indexer's logits, then the top-k: ``workspace.indices`` [R, topk] positions
    (-1 padding) and ``workspace.sparse_lens`` [R] = min(seq_lens, topk). Unchecked
    (``check_sparse_args``). Graph-safe: fixed grids, no host reads."""
    launch_indexer_logits(index_q, index_weights, index_cache, index_scales, block_table,
                          seq_lens, workspace.logits, plan=plan)
    launch_topk(workspace.logits, seq_lens, workspace.indices, workspace.sparse_lens,
                workspace.topk, num_rows=plan.num_rows, block=plan.topk_block)


def sparse_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, index_q: torch.Tensor,
                      index_weights: torch.Tensor, index_cache: torch.Tensor,
                      index_scales: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, out: torch.Tensor, workspace: SparseWorkspace,
                      *, plan: SparsePlan, sm_scale: float, lse: torch.Tensor | None = None,
                      check: bool = True) -> torch.Tensor:
    """DeepSeek-V3.2 sparse MLA decode of ``plan.num_rows`` query rows.

    q [R, H, 576] (bf16 / fp16 / fp32), kv_cache [num_pages, page_size, 576] of q's dtype
    or uint8 [num_pages, page_size, 656] (V3.2 fp8 rows), index_q [R, 64, 128] (bf16 /
    fp16 / fp32), index_weights [R, 64] float32, index_cache e4m3 [num_pages, page_size,
    128] and index_scales float32 [num_pages, page_size] (``store_index_keys``),
    block_table [>= R, max_pages] int32 (both caches), seq_lens [>= R] int32 causal limits
    (<= workspace.max_len), out [R, H, 512]; lse [R, H] float32 (natural log) if given.
    Leaves the selected positions in ``workspace.indices`` (first min(len, topk) slots,
    then -1). Rows of length 0 give zeros.
    Graph-safe: no device reads, no allocation; the plan fixes every grid.
    """
    if check:
        check_sparse_args(q, kv_cache, index_q, index_weights, index_cache, index_scales,
                          block_table, seq_lens, out, workspace, plan, lse)
    select_tokens(index_q, index_weights, index_cache, index_scales, block_table, seq_lens,
                  workspace, plan=plan)
    launch_sparse_attention(q, kv_cache, block_table, workspace.indices, workspace.sparse_lens,
                            out, workspace.split, plan=plan, sm_scale=sm_scale, lse=lse)
    return out
