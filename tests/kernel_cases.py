"""Random paged-MLA decode problems shared by the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphbucket.plan import cdiv

KV_LORA_RANK = 512
ROPE_DIM = 64
SM_SCALE = 1.0 / (192 ** 0.5)


@dataclass
class DecodeCase:
    q: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor


def make_case(seq_lens: list[int], num_heads: int, *, page_size: int, dtype: torch.dtype,
              device: str, spare_pages: int = 3, gen: torch.Generator | None = None,
              kv_lora_rank: int = KV_LORA_RANK, rope_dim: int = ROPE_DIM) -> DecodeCase:
    """Fresh random q and cache; every request's pages are a random scatter of page ids.

    The cache holds a few pages nobody owns (filled with large values) so that a kernel
    reading outside its pages shows up in the error, not only in a crash.
    """
    max_pages = max(1, max(cdiv(n, page_size) for n in seq_lens))
    needed = sum(cdiv(n, page_size) for n in seq_lens)
    num_pages = needed + spare_pages
    dim = kv_lora_rank + rope_dim
    kv = torch.randn(num_pages, page_size, dim, generator=gen, dtype=torch.float32)
    q = torch.randn(len(seq_lens), num_heads, dim, generator=gen, dtype=torch.float32)
    perm = torch.randperm(num_pages, generator=gen)
    owned = perm[:needed]
    kv[perm[needed:]] = 50.0  # pages no request owns: poison
    table = torch.zeros(len(seq_lens), max_pages, dtype=torch.int32)
    table.fill_(int(perm[-1]))  # unused slots point at a poisoned page
    at = 0
    for b, n in enumerate(seq_lens):
        k = cdiv(n, page_size)
        table[b, :k] = owned[at:at + k].to(torch.int32)
        at += k
    return DecodeCase(q.to(dtype).to(device), kv.to(dtype).to(device), table.to(device),
                      torch.tensor(seq_lens, dtype=torch.int32, device=device))


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error in float64 on the CPU (``got`` may live on the GPU)."""
    ref = ref.double().cpu()
    denom = ref.norm().item() or 1.0
    return (got.double().cpu() - ref).norm().item() / denom
