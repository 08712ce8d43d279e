"""Float reference of ``MLADecoder``'s decode step: plain torch in float64, no Triton.

The math is written out again (RMSNorm, rotary from angles computed in float64, the
absorbed projections as einsums) and attention is ``graphbucket.reference``'s
``mla_decode_reference``, so it checks the fused kernels, the cache store and the MLA
kernel together. Reads lengths and slots on the host: for tests, not for the replay path.
"""

from __future__ import annotations

import numpy as np
import torch

from graphbucket import fp8
from graphbucket.models.config import MLAConfig
from graphbucket.models.weights import MLALayerWeights
from graphbucket.reference import mla_decode_reference


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(x.dtype)


def rotary_ref(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Half-split rotary of x [B, ..., P] at positions [B], angles in float64."""
    p = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, p, 2, dtype=torch.float64, device=x.device) / p)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]   # [B, P/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (p // 2,)
    cos, sin = angles.cos().view(shape).to(x.dtype), angles.sin().view(shape).to(x.dtype)
    x1, x2 = x[..., : p // 2], x[..., p // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _as(t, device, dtype=None) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(t) if not isinstance(t, torch.Tensor) else t)
    return t.to(device=device, dtype=dtype or t.dtype)


def step_tokens(hidden, positions, seq_lens, block_table, slot_mapping, cache: torch.Tensor,
                dtype: torch.dtype, q_len: int):
    """A step's per-token view on ``cache``'s device: (hidden in ``dtype``, positions,
    slots, the indices of tokens that store a row (live request, slot inside the cache),
    each token's causal limit (seq_len - q_len + j + 1; 0 for padding) and its request's
    block-table row)."""
    dev = cache.device
    x = _as(hidden, dev, dtype)
    positions, seq_lens = _as(positions, dev, torch.int64), _as(seq_lens, dev, torch.int32)
    block_table, slots = _as(block_table, dev, torch.int32), _as(slot_mapping, dev, torch.int64)
    num_slots = cache.shape[0] * cache.shape[1]
    request_lens = seq_lens.repeat_interleave(q_len)
    live = [t for t, (s, n) in enumerate(zip(slots.tolist(), request_lens.tolist(),
                                             strict=True)) if 0 <= s < num_slots and n > 0]
    offsets = torch.arange(q_len, device=dev, dtype=torch.int32).repeat(seq_lens.shape[0])
    limits = torch.where(request_lens > 0, (request_lens - q_len + 1 + offsets).clamp_min(0), 0)
    return x, positions, slots, live, limits, block_table.repeat_interleave(q_len, dim=0)


def decode_reference(config: MLAConfig, layers: list[MLALayerWeights],
                     final_norm: torch.Tensor, hidden, *, positions, seq_lens, block_table,
                     slot_mapping, caches: list[torch.Tensor],
                     dtype: torch.dtype = torch.float64,
                     kv_scale: torch.Tensor | None = None,
                     kv_cache_format: str | None = None, q_len: int = 1,
                     store_new_rows: bool = True) -> torch.Tensor:
    """One decode step of the model with ``config``, ``layers`` and ``final_norm`` in
    ``dtype``; writes the new rows into ``caches`` (one per layer, [num_pages, page_size,
    R + P] in ``dtype``, e.g. ``MLADecoder.reference_caches()``). The new rows are stored as
    a cache of ``kv_cache_format`` holds them (``graphbucket.fp8.as_stored``: fp8 formats
    quantized, then dequantized); the format defaults to "fp8-tensor" with ``kv_scale``,
    else "bf16" (rows as computed). ``store_new_rows`` False: ``caches`` already hold the
    step's new rows (read back from a model's caches after its step), and the step attends
    over them as they are: this checks everything but the store against rows that differ
    from the reference's own only by where fp8 rounding fell.

    A verify step (``q_len`` > 1) decodes q_len tokens per request: hidden [B * q_len, D],
    positions and slot_mapping [B * q_len] (row b * q_len + j is request b's token j),
    seq_lens [B] counting the q_len new tokens; every new row is stored first, then token j
    attends to the positions before seq_len - q_len + j + 1.

    hidden [B, D]; positions, seq_lens, slot_mapping [B]; block_table [B, cols] (tensors
    on any device, numpy arrays or lists). Returns the final hidden states [B * q_len, D].
    """
    cfg, dev = config, caches[0].device
    x, positions, slots, live, limits, token_table = step_tokens(
        hidden, positions, seq_lens, block_table, slot_mapping, caches[0], dtype, q_len)
    bs, heads, r = x.shape[0], cfg.num_heads, cfg.kv_lora_rank
    fmt = kv_cache_format or ("fp8-tensor" if kv_scale is not None else "bf16")
    for layer, cache in zip(layers, caches, strict=True):
        w = layer.to(dtype)
        w = type(w)(*(t.to(dev) for t in w.tensors()))
        h = rms_norm_ref(x, w.attn_norm, cfg.rms_eps)
        q_a, kv = (h @ w.w_qkv_a.T).split([cfg.q_lora_rank, cfg.kv_dim], dim=-1)
        row = torch.cat([rms_norm_ref(kv[:, :r], w.kv_a_norm, cfg.rms_eps),
                         rotary_ref(kv[:, r:], positions, cfg.rope_theta)], dim=-1)
        if store_new_rows:
            if fp8.get_cache_format(fmt).quantized:
                row = fp8.as_stored(row, fmt, kv_scale, dtype)
            cache.view(-1, cfg.kv_dim)[slots[live]] = row[live]
        q = (rms_norm_ref(q_a, w.q_a_norm, cfg.rms_eps) @ w.w_q_b.T).view(bs, heads, -1)
        q_nope, q_rope = q.split([cfg.qk_nope_dim, cfg.qk_rope_dim], dim=-1)
        q_mla = torch.cat([torch.einsum("bhn,hnr->bhr", q_nope, w.w_uk),
                           rotary_ref(q_rope, positions, cfg.rope_theta)], dim=-1)
        attn, _ = mla_decode_reference(q_mla, cache, token_table, limits, kv_lora_rank=r,
                                       sm_scale=cfg.sm_scale, dtype=dtype)
        o = torch.einsum("bhr,hrv->bhv", attn, w.w_uv).reshape(bs, -1) @ w.w_o.T
        x = x + o
        g, u = (rms_norm_ref(x, w.mlp_norm, cfg.rms_eps) @ w.w_gate_up.T).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(g) * u) @ w.w_down.T
    return rms_norm_ref(x, final_norm.to(device=dev, dtype=dtype), cfg.rms_eps)
