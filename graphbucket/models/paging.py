"""Host helpers around the paged latent cache: scattered block tables, slot mappings,
random prefill, and a ``DecodeBatch`` for ``MLADecoder``.

Benchmarks need no real prefill: a decode step reads the context's cache rows, whatever
they hold, so random rows (N(0, 1), like a normalised latent) give the same traffic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from graphbucket import fp8
from graphbucket.batch import DecodeBatch
from graphbucket.block_table import BlockTable

if TYPE_CHECKING:
    from graphbucket.models.mla import MLADecoder


def random_block_table(num_requests: int, pages_per_request: int, num_pages: int,
                       rng: np.random.Generator) -> np.ndarray:
    """int32 [num_requests, pages_per_request] of distinct pages scattered over the cache."""
    need = num_requests * pages_per_request
    if need > num_pages:
        raise ValueError(f"{num_requests} requests x {pages_per_request} pages = {need} pages, "
                         f"but the cache has {num_pages}; allocate more pages")
    pages = rng.permutation(num_pages)[:need].astype(np.int32)
    return pages.reshape(num_requests, pages_per_request)


def slot_mapping_for(block_table: np.ndarray, positions, page_size: int) -> np.ndarray:
    """int64 [B] cache slot (page * page_size + offset) of the token at each position;
    -1 where the position is negative (a row that stores nothing)."""
    pos = np.asarray(positions, dtype=np.int64)
    safe = np.maximum(pos, 0)
    pages = np.asarray(block_table)[np.arange(pos.shape[0]), safe // page_size].astype(np.int64)
    return np.where(pos >= 0, pages * page_size + safe % page_size, -1)


_PREFILL_CHUNK_PAGES = 1024


def prefill_random(model: MLADecoder, block_table: np.ndarray, seq_lens, *,
                   seed: int = 0) -> None:
    """Fill every page the first ``seq_lens`` tokens of each request use, in every layer,
    with seeded N(0, 1) rows (whole pages; a stand-in for a real prefill)."""
    page = model.page_size
    used = [np.asarray(block_table)[b, : -(-int(n) // page)] for b, n in enumerate(seq_lens)]
    pages = np.unique(np.concatenate(used + [np.zeros(0, np.int32)]))
    if pages.size == 0:
        return
    idx = torch.from_numpy(pages.astype(np.int64)).to(model.device)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    fmt = fp8.get_cache_format(model.kv_cache_format)
    for cache in model.kv_caches:
        # Chunks of pages: a long batch's rows at once would need twice the cache in float32.
        for start in range(0, idx.numel(), _PREFILL_CHUNK_PAGES):
            chunk = idx[start:start + _PREFILL_CHUNK_PAGES]
            rows = torch.randn(chunk.numel(), page, model.config.kv_dim, generator=gen,
                               device=model.device)
            target = cache
            # fp8 caches: stored as their store op would (index_copy_ has no fp8 kernel on
            # the CPU: copy the bytes)
            if fmt.quantized:
                rows = torch.cat([fmt.store(rows[i:i + 256], model.kv_scale)
                                  for i in range(0, len(rows), 256)]).view(torch.uint8)
                target = cache.view(torch.uint8)
            target.index_copy_(0, chunk, rows.to(target.dtype))


def decode_batch(model: MLADecoder, seq_lens, block_table: np.ndarray | BlockTable,
                 hidden: torch.Tensor, *, q_len: int = 1) -> DecodeBatch:
    """A ``DecodeBatch`` decoding the token at position seq_len - 1 of each request, or
    with ``q_len`` > 1 a verify step of the tokens at seq_len - q_len .. seq_len - 1.

    seq_lens [B] ints >= 0 (the new tokens included; 0 = a padding row that stores
    nothing), block_table int [B, cols] (enough columns for every length) or the runner's
    ``BlockTable`` (rows [0, B) give the slots; the batch then carries it), hidden
    [B * q_len, D] (host or device tensor, the model dtype; row b * q_len + j is request
    b's token j). The slot mapping (one slot per token) is derived on the host; the rest
    is checked by the runner's step.
    """
    lens = np.asarray(seq_lens)
    paged = block_table if isinstance(block_table, BlockTable) else None
    table = paged.table[:lens.shape[0]] if paged is not None else np.asarray(block_table)
    if lens.ndim != 1 or lens.dtype.kind not in "iu":
        raise TypeError(f"seq_lens must be 1-D integers, got shape {lens.shape} "
                        f"dtype {lens.dtype}")
    if table.ndim != 2 or table.dtype.kind not in "iu" or table.shape[0] != lens.shape[0]:
        raise ValueError(f"block_table must be integers [B={lens.shape[0]}, cols], got shape "
                         f"{table.shape} dtype {table.dtype}")
    capacity = table.shape[1] * model.page_size
    if lens.size and (lens.min() < 0 or lens.max() > capacity):
        row = int(np.argmax((lens < 0) | (lens > capacity)))
        raise ValueError(f"seq_lens[{row}] = {int(lens[row])} is outside [0, {capacity}]: "
                         f"block_table has {table.shape[1]} columns of {model.page_size} "
                         "tokens. Give each request enough pages (or a shorter length)")
    if isinstance(q_len, bool) or not isinstance(q_len, int) or q_len < 1:
        raise ValueError(f"q_len must be a positive int, got {q_len!r}")
    short = (lens > 0) & (lens < q_len)
    if short.any():
        row = int(np.argmax(short))
        raise ValueError(f"seq_lens[{row}] = {int(lens[row])} is below q_len {q_len}: a "
                         "verify step's lengths count its q_len new tokens")
    lens = lens.astype(np.int64)
    if q_len == 1:
        slots = slot_mapping_for(table.astype(np.int32), lens - 1, model.page_size)
    else:  # token j at seq_len - q_len + j; padding rows (length 0) store nothing
        positions = lens[:, None] - q_len + np.arange(q_len)
        positions = np.where(lens[:, None] > 0, positions, -1).reshape(-1)
        slots = slot_mapping_for(np.repeat(table.astype(np.int32), q_len, axis=0), positions,
                                 model.page_size)
    carried = paged if paged is not None else table.astype(np.int32, copy=False)
    return DecodeBatch(lens.astype(np.int32), carried,
                       {"hidden": hidden, "slot_mapping": torch.from_numpy(slots)},
                       q_len=q_len)
