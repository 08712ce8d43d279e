"""The indexer's key cache (DeepSeek-V3.2 lightning indexer): fp8 keys, one scale per token.

Layout: ``index_cache`` float8_e4m3fn [num_pages, page_size, 128] and ``index_scales``
float32 [num_pages, page_size], paged like the latent cache (same page ids, same block
table, same page size): token t of a request lives at page ``block_table[t // page_size]``,
slot ``t % page_size``; 132 bytes per token. (DeepSeek-V3.2 packs the two into one uint8
page buffer; two tensors keep the kernels' pointer arithmetic plain and read the same bytes.)

Scale rule, per token: ``scale = max(amax(|key|) / 448, 2**-126)``; the stored key is
``key / scale`` saturated at +-448 and rounded to the nearest e4m3 number (torch's cast),
so a token's largest magnitude is stored as +-448 and zero keys stay zero. The value read
back is ``stored * scale``. The indexer applies the scale after the dot:
``relu(q . (s k)) = s relu(q . k)`` for s > 0.
"""

from __future__ import annotations

import torch

from graphbucket.fp8 import FP8_DTYPE, FP8_MAX, V32_MIN_SCALE

INDEX_DIM = 128  # index head dim (DeepSeek-V3.2)


def quantize_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [..., 128] (any float dtype) -> (e4m3 [..., 128], float32 scales [...])."""
    if keys.shape[-1] != INDEX_DIM or not keys.is_floating_point():
        raise ValueError(f"index keys must be float [..., {INDEX_DIM}], got {keys.dtype} "
                         f"{tuple(keys.shape)}")
    k = keys.float()
    scales = (k.abs().amax(-1) / FP8_MAX).clamp_min(V32_MIN_SCALE)
    stored = (k / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return stored, scales


def dequantize_index_keys(stored: torch.Tensor, scales: torch.Tensor,
                          dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``stored * scale`` per token, in ``dtype`` (float64 for the references)."""
    if stored.dtype != FP8_DTYPE:
        raise TypeError(f"expected a {FP8_DTYPE} tensor, got {stored.dtype}")
    return stored.to(dtype) * scales.to(device=stored.device, dtype=dtype)[..., None]


def allocate_index_cache(num_pages: int, page_size: int, device: torch.device | str
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (index_cache e4m3 [num_pages, page_size, 128], index_scales float32
    [num_pages, page_size]); zero keys with scale 1 give logits 0."""
    cache = torch.zeros(num_pages, page_size, INDEX_DIM, dtype=FP8_DTYPE, device=device)
    scales = torch.ones(num_pages, page_size, dtype=torch.float32, device=device)
    return cache, scales


def store_index_keys(keys: torch.Tensor, slots: torch.Tensor, index_cache: torch.Tensor,
                     index_scales: torch.Tensor) -> None:
    """Quantize keys [N, 128] and write them at cache slots [N] (int64, page * page_size +
    offset, distinct). Graph-safe: torch ops on fixed shapes, no host reads."""
    if index_cache.dtype != FP8_DTYPE or index_cache.shape[-1] != INDEX_DIM:
        raise ValueError(f"index_cache must be {FP8_DTYPE} [num_pages, page_size, "
                         f"{INDEX_DIM}], got {index_cache.dtype} {tuple(index_cache.shape)}")
    if index_scales.dtype != torch.float32 or index_scales.shape != index_cache.shape[:2]:
        raise ValueError(f"index_scales must be float32 {tuple(index_cache.shape[:2])}, got "
                         f"{index_scales.dtype} {tuple(index_scales.shape)}")
    if slots.dim() != 1 or slots.shape[0] != keys.shape[0]:
        raise ValueError(f"slots must be [N] for keys {tuple(keys.shape)}, got "
                         f"{tuple(slots.shape)}")
    stored, scales = quantize_index_keys(keys)
    slots = slots.to(torch.int64)
    # as bytes: index_copy_ has no float8 kernel on every device
    index_cache.view(torch.uint8).view(-1, INDEX_DIM).index_copy_(0, slots,
                                                                  stored.view(torch.uint8))
    index_scales.view(-1).index_copy_(0, slots, scales)
