"""Sparse MLA decode (DeepSeek-V3.2): indexer logits, top-k and sparse attention kernels.

Modules: ``index_cache`` (the fp8 index-key cache), ``index_prologue`` (the per-token
key store, head weights and q rotary kernels), ``rounding`` (RNE casts that the
interpreter gets right), ``indexer`` (logits kernel),
``topk`` (radix-select kernel), ``attention`` (sparse attention + merge), ``plan``
(host decisions), ``decode`` (workspace, checks, the three steps), ``reference``
(float64 references).
"""

from __future__ import annotations

from graphbucket.sparse.decode import SparseWorkspace, check_sparse_args, sparse_mla_decode
from graphbucket.sparse.index_cache import (
    allocate_index_cache,
    dequantize_index_keys,
    quantize_index_keys,
    store_index_keys,
)
from graphbucket.sparse.plan import SparsePlan, plan_sparse_decode, seed_max_splits

__all__ = ["SparsePlan", "SparseWorkspace", "allocate_index_cache", "check_sparse_args",
           "dequantize_index_keys", "plan_sparse_decode", "quantize_index_keys",
           "seed_max_splits", "sparse_mla_decode", "store_index_keys"]
