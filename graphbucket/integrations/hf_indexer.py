"""transformers' DeepSeek-V3.2 indexer as the inputs of graphbucket's sparse decode.

Per new token (``DeepseekV32Indexer``'s modules, run as they are)::

    k_idx = index_rope(k_norm(wk(h)))                  -> e4m3 index cache + scale per token
    q_idx = index_rope(wq_b(q_resid) [T, I, K])        # q_resid = q_a_layernorm(q_a_proj(h))
    w_idx = weights_proj(h) x I^-0.5 x K^-0.5          # float32 [T, I]

``index_rope`` rotates the first qk_rope_head_dim dims of each vector in half-split pairs
(transformers' indexer uses ``rotate_half`` even where its attention interleaves), with the
model's rope table. The kernel scores ``sum_h w_idx[h] relu(q_idx[h] . k_t)``: transformers
multiplies the dot by the softmax scale K^-0.5 inside the relu, which is the same for a
positive scale, so the scale is folded into the head weights.

Precision: transformers' indexer scores in the model dtype (no Hadamard rotation, no fp8);
graphbucket's index cache holds e4m3 keys with a per-token scale (``sparse.index_cache``).
``round_new_index_keys`` makes a transformers cache keep its index keys rounded the same
way, so a reference and this decode rank the same keys. The indexer's q is passed as
computed (``SparsePlan.indexer_fp8_q`` False) unless the adapter asks for the kernel's
per-head e4m3 rounding.

Graph safety: fixed-shape torch ops; padding rows store their keys in one scratch row
past the cache, chosen on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from graphbucket.context import DecodeContext
from graphbucket.models.sparse_mla import rope_first
from graphbucket.sparse.backend import IndexInputs, SparseBackend
from graphbucket.sparse.index_cache import (
    INDEX_DIM,
    dequantize_index_keys,
    quantize_index_keys,
    store_index_keys,
)
from graphbucket.sparse.plan import SparsePlan

SLOT_INPUT = "slot_mapping"


def index_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., K] with its first P dims rotated in half-split pairs; cos_sin [T, P]."""
    return rope_first(x, cos_sin)


def round_new_index_keys(cache):
    """Make a transformers cache store each new index key as graphbucket's e4m3 index cache
    reads it back (``stored x scale``); returns the cache. For references: transformers'
    own indexer then ranks the values the sparse kernels rank."""
    update = cache.update_indexer

    def rounded(keys: torch.Tensor, layer_idx: int, *args, **kwargs) -> torch.Tensor:
        stored, scales = quantize_index_keys(keys)
        return update(dequantize_index_keys(stored, scales, keys.dtype), layer_idx,
                      *args, **kwargs)

    cache.update_indexer = rounded
    return cache


class ExactQSparseBackend(SparseBackend):
    """``SparseBackend`` whose plans pass the indexer's q unrounded (``indexer_fp8_q``
    False), as transformers scores it."""

    def plan(self, batch_size: int, num_heads: int, hint: int) -> SparsePlan:
        return replace(super().plan(batch_size, num_heads, hint), indexer_fp8_q=False)


@dataclass(frozen=True, slots=True)
class IndexCache:
    """One layer's paged index keys: rows e4m3 [num_slots + 1, 128] and scales float32
    [num_slots + 1], the last row a scratch row for padding; ``cache`` / ``scales`` are
    the [num_pages, page_size, ...] views the kernels read."""

    rows: torch.Tensor
    row_scales: torch.Tensor
    cache: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def allocate(cls, num_pages: int, page_size: int, device: torch.device) -> IndexCache:
        slots = num_pages * page_size
        rows = torch.zeros(slots + 1, INDEX_DIM, dtype=torch.float8_e4m3fn, device=device)
        row_scales = torch.ones(slots + 1, device=device)
        return cls(rows, row_scales, rows[:slots].view(num_pages, page_size, INDEX_DIM),
                   row_scales[:slots].view(num_pages, page_size))

    @property
    def num_slots(self) -> int:
        return self.rows.shape[0] - 1

    def store(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """keys [N, 128] at slots [N] int64 (distinct, in [0, num_slots])."""
        store_index_keys(keys, slots, self.rows.view(-1, 1, INDEX_DIM),
                         self.row_scales.view(-1, 1))


@dataclass(frozen=True, slots=True)
class IndexerDecode:
    """A ``DeepseekV32Indexer``'s decode: store the new keys, return the kernel's inputs."""

    module: nn.Module
    weight_scale: float  # index_n_heads^-0.5 x index_head_dim^-0.5

    @classmethod
    def from_module(cls, indexer: nn.Module) -> IndexerDecode:
        if indexer.head_dim != INDEX_DIM:
            raise ValueError(f"index_head_dim {indexer.head_dim}: the sparse kernels take "
                             f"{INDEX_DIM} (DeepSeek-V3.2)")
        return cls(indexer, indexer.n_heads ** -0.5 * float(indexer.softmax_scale))

    def __call__(self, h: torch.Tensor, q_resid: torch.Tensor, cos_sin: torch.Tensor,
                 ctx: DecodeContext, cache: IndexCache) -> IndexInputs:
        m = self.module
        keys = index_rope(m.k_norm(m.wk(h)), cos_sin)                   # [T, K]
        slots = ctx.inputs[SLOT_INPUT]
        lens = ctx.seq_lens[:, None].expand(-1, ctx.q_len).reshape(-1)
        valid = (slots >= 0) & (slots < cache.num_slots) & (lens > 0)
        cache.store(keys, torch.where(valid, slots, cache.num_slots))
        q = m.wq_b(q_resid).view(h.shape[0], m.n_heads, m.head_dim)
        weights = m.weights_proj(h.to(m.weights_proj.weight.dtype)).float() * self.weight_scale
        return IndexInputs(index_rope(q, cos_sin).contiguous(), weights.contiguous(),
                           cache.cache, cache.scales)
