"""Float reference of ``SparseMLADecoder``'s decode step: plain torch in float64, no Triton.

The dense parts are written out as in ``models.step_reference``; per layer the indexer's
logits are summed over the dequantized keys (the new keys quantized to e4m3 as the store
does), each query token keeps the positions of its ``index_topk`` largest logits
(``torch.topk``: exact ties may pick other positions than the kernels, so tests use
random inputs without ties) and attends over them (``sparse.reference``). Reads lengths
and slots on the host: for tests, not for the replay path.
"""

from __future__ import annotations

import torch

from graphbucket.models.step_reference import rms_norm_ref, rotary_ref, step_tokens
from graphbucket.models.weights import MLALayerWeights
from graphbucket.reference import gather_request_kv
from graphbucket.sparse.index_cache import dequantize_index_keys, quantize_index_keys
from graphbucket.sparse.reference import indexer_q_values, sparse_attention_reference


def _rope_first_ref(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float
                    ) -> torch.Tensor:
    return torch.cat([rotary_ref(x[..., :rope_dim], positions, theta), x[..., rope_dim:]], -1)


def top_positions(index_q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                  block_table: torch.Tensor, limits: list[int], topk: int) -> list[list[int]]:
    """Per token row: the positions of its ``topk`` largest logits sum_h w_h relu(q_h . k_t)
    over t < limit (all of them when the limit is at most topk), q rounded to e4m3 per
    head as the indexer kernel does (``sparse.reference.indexer_q_values``)."""
    q_rows = indexer_q_values(index_q, fp8_q=True).to(index_q.dtype)
    chosen = []
    for r, n in enumerate(limits):
        k = gather_request_kv(keys, block_table[r], n)                   # [n, K]
        logits = ((q_rows[r] @ k.T).clamp_min(0) * weights[r][:, None]).sum(0)
        chosen.append(sorted(torch.topk(logits, min(topk, n)).indices.tolist()))
    return chosen


def sparse_decode_reference(config, layers: list[MLALayerWeights], indexers, final_norm,
                            hidden, *, positions, seq_lens, block_table, slot_mapping,
                            caches: list[torch.Tensor], index_caches: list[torch.Tensor],
                            dtype: torch.dtype = torch.float64, q_len: int = 1
                            ) -> torch.Tensor:
    """One decode step of a ``SparseMLAConfig`` model in ``dtype``; writes the new rows into
    ``caches`` ([pages, page_size, 576]) and ``index_caches`` ([pages, page_size, 128],
    dequantized keys). Arguments as ``models.step_reference.decode_reference``. Returns
    the final hidden states [B * q_len, D]."""
    cfg, dev = config, caches[0].device
    x, positions, slots, live, limits, token_table = step_tokens(
        hidden, positions, seq_lens, block_table, slot_mapping, caches[0], dtype, q_len)
    tokens, heads, r = x.shape[0], cfg.num_heads, cfg.kv_lora_rank
    p, theta = cfg.qk_rope_dim, cfg.rope_theta
    for layer, ix, cache, keys in zip(layers, indexers, caches, index_caches, strict=True):
        w = type(layer)(*(t.to(device=dev, dtype=dtype) for t in layer.tensors()))
        w_iq, w_ikw, k_norm = (t.to(device=dev, dtype=dtype) for t in ix.tensors())
        h = rms_norm_ref(x, w.attn_norm, cfg.rms_eps)
        q_a, kv = (h @ w.w_qkv_a.T).split([cfg.q_lora_rank, cfg.kv_dim], dim=-1)
        row = torch.cat([rms_norm_ref(kv[:, :r], w.kv_a_norm, cfg.rms_eps),
                         rotary_ref(kv[:, r:], positions, theta)], dim=-1)
        cache.view(-1, cfg.kv_dim)[slots[live]] = row[live]
        kw = h @ w_ikw.T
        k = _rope_first_ref(rms_norm_ref(kw[:, :cfg.index_dim], k_norm, cfg.rms_eps),
                            positions, p, theta)
        stored = dequantize_index_keys(*quantize_index_keys(k), dtype=dtype)
        keys.view(-1, cfg.index_dim)[slots[live]] = stored[live]
        weights = kw[:, cfg.index_dim:] * (cfg.index_heads * cfg.index_dim) ** -0.5
        q_a = rms_norm_ref(q_a, w.q_a_norm, cfg.rms_eps)
        index_q = _rope_first_ref((q_a @ w_iq.T).view(tokens, cfg.index_heads, cfg.index_dim),
                                  positions, p, theta)
        chosen = top_positions(index_q, weights, keys, token_table, limits.tolist(),
                               cfg.index_topk)
        q = (q_a @ w.w_q_b.T).view(tokens, heads, -1)
        q_nope, q_rope = q.split([cfg.qk_nope_dim, p], dim=-1)
        q_mla = torch.cat([torch.einsum("bhn,hnr->bhr", q_nope, w.w_uk),
                           rotary_ref(q_rope, positions, theta)], dim=-1)
        attn, _ = sparse_attention_reference(q_mla, cache, token_table, chosen,
                                             kv_lora_rank=r, sm_scale=cfg.sm_scale)
        o = torch.einsum("bhr,hrv->bhv", attn.to(device=dev, dtype=dtype),
                         w.w_uv).reshape(tokens, -1) @ w.w_o.T
        x = x + o
        g, u = (rms_norm_ref(x, w.mlp_norm, cfg.rms_eps) @ w.w_gate_up.T).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(g) * u) @ w.w_down.T
    return rms_norm_ref(x, final_norm.to(device=dev, dtype=dtype), cfg.rms_eps)
