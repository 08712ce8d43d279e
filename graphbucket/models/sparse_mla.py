"""``SparseMLADecoder``: DeepSeek-V3.2-shaped decode, dense MLA projections + sparse attention.

Per layer, on top of ``MLADecoder``'s projections (h = RMSNorm(x), q_a | kv_a, q_b, the
absorbed W_UK / W_UV, o_proj, SwiGLU MLP)::

    k_idx   = rotary64(RMSNorm(h @ W_ik))            -> index cache (fp8 + scale per token)
    w_idx   = (h @ W_iw) / sqrt(64 heads x 128)      # float32 head weights
    q_idx   = rotary64((RMSNorm(q_a) @ W_iq) [T, 64, 128])
    o       = sparse MLA over the top-k positions of sum_h w_idx relu(q_idx . k_idx)

W_ik and W_iw are one fused [128 + 64, D] projection. ``rotary64`` rotates the first
``qk_rope_dim`` (64) dims of each 128-wide index vector (half-split pairs, the model's
rope table), as DeepSeek-V3.2's indexer ropes its first 64 dims. Simplifications, stated:
the key's LayerNorm is an RMSNorm, and the Hadamard rotation DeepSeek applies to q_idx
and k_idx before fp8 is left out (it is orthogonal: the logits are the same in exact
arithmetic, only the fp8 rounding of the keys differs); q_idx is projected in the model
dtype and the indexer kernel rounds it to e4m3 per head (``graphbucket.sparse.indexer``).

The indexer's prologue (key norm, rotary, fp8 store, head weights; q_idx's rotary) runs
in two kernels (``graphbucket.sparse.index_prologue``); ``rope_first`` over
``ops.rms_norm`` and ``store_index_keys`` is the torch path they reproduce. The new
tokens' latent rows and index keys are stored before attention (``seq_lens`` counts
them). Padding rows (seq_len 0 or a negative slot) store nothing: their index keys go to
one scratch row past the cache (the index cache is a view of the first num_pages x
page_size rows of a buffer one row longer).

Graph safety: as ``MLADecoder``; the attention launches through ``ctx.attend`` (a
``SparseBackend``, the indexer's inputs as ``index``) with ``ctx.plan`` and ``ctx.workspace``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from graphbucket.context import DecodeContext
from graphbucket.models.config import MLAConfig
from graphbucket.models.mla import SLOT_INPUT, MLADecoder
from graphbucket.models.ops import assemble_q, rms_norm, store_kv
from graphbucket.models.paging import prefill_random
from graphbucket.models.weights import WeightDraw
from graphbucket.sparse.backend import IndexInputs, SparseBackend
from graphbucket.sparse.index_cache import (
    INDEX_DIM,
    dequantize_index_keys,
    store_index_keys,
)
from graphbucket.sparse.index_prologue import rope_index_q_, store_index_prologue
from graphbucket.sparse.plan import DEFAULT_TOPK, INDEX_HEADS


@dataclass(frozen=True, slots=True)
class SparseMLAConfig(MLAConfig):
    """An ``MLAConfig`` plus the lightning indexer: ``index_heads`` x ``index_dim`` query
    heads, one ``index_dim`` key per token, ``index_topk`` positions attended per token."""

    index_heads: int = INDEX_HEADS
    index_dim: int = INDEX_DIM
    index_topk: int = DEFAULT_TOPK

    def layer_params(self) -> int:
        dense = MLAConfig.layer_params(self)
        return dense + (self.index_heads * self.index_dim * self.q_lora_rank
                        + (self.index_dim + self.index_heads) * self.hidden_size
                        + self.index_dim)


def deepseek_v32_tp8(num_layers: int = 4, *, topk: int = DEFAULT_TOPK) -> SparseMLAConfig:
    """DeepSeek-V3.2 per rank at TP8: DeepSeek-V3's MLA (16 of 128 heads, hidden 7168,
    dense MLP 2304) plus the indexer (64 heads x 128, replicated), top-k 2048."""
    return SparseMLAConfig(name="deepseek-v32-tp8", num_heads=16, hidden_size=7168,
                           q_lora_rank=1536, qk_nope_dim=128, qk_rope_dim=64,
                           kv_lora_rank=512, v_head_dim=128, intermediate_size=2304,
                           num_layers=num_layers, index_topk=topk)


def tiny_sparse(num_layers: int = 2, *, topk: int = 16) -> SparseMLAConfig:
    """A CPU-test model: the kernels' fixed widths (latent 512 + 64, indexer 64 x 128),
    everything else small, top-k 16."""
    return SparseMLAConfig(name="tiny-sparse", num_heads=4, hidden_size=64, q_lora_rank=32,
                           qk_nope_dim=16, qk_rope_dim=64, kv_lora_rank=512, v_head_dim=16,
                           intermediate_size=96, num_layers=num_layers, max_position=4096,
                           index_topk=topk)


@dataclass(slots=True)
class IndexerWeights:
    """One layer's indexer (Q = q_lora_rank, D = hidden, I = index heads, K = index dim)."""

    w_iq: torch.Tensor    # [I * K, Q]
    w_ikw: torch.Tensor   # [K + I, D]: key rows, then head-weight rows
    k_norm: torch.Tensor  # [K]

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]


def random_indexers(cfg: SparseMLAConfig, *, seed: int, device: torch.device | str,
                    dtype: torch.dtype) -> list[IndexerWeights]:
    draw = WeightDraw(seed, torch.device(device), dtype)
    heads, dim = cfg.index_heads, cfg.index_dim
    return [IndexerWeights(
        w_iq=draw.matrix(heads * dim, cfg.q_lora_rank, fan_in=cfg.q_lora_rank),
        w_ikw=draw.matrix(dim + heads, cfg.hidden_size, fan_in=cfg.hidden_size),
        k_norm=draw.norm(dim)) for _ in range(cfg.num_layers)]


def rope_first(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., K] with its first P dims rotated (half-split pairs); cos_sin [T, P]
    (cos halves, then sin halves, ``ops.rope_cache`` rows). Computed in float32; the
    torch model of ``index_prologue``'s rotary."""
    p = cos_sin.shape[1]
    half = p // 2
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos_sin[:, :half].reshape(shape), cos_sin[:, half:].reshape(shape)
    x1, x2 = x[..., :half].float(), x[..., half:p].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., p:].float()],
                     dim=-1).to(x.dtype)


class SparseMLADecoder(MLADecoder):
    """Seeded random DeepSeek-V3.2-shaped decoder: a bf16 (or ``dtype``) latent cache and
    an fp8 index cache + scales per layer, both paged with one block table.

    index_caches[l] e4m3 [num_pages, page_size, 128], index_scales[l] float32 [num_pages,
    page_size]. Run it through ``GraphBucketRunner.for_model`` (``decode_backend`` gives
    the ``SparseBackend``, whose ``default_ladder`` is ``sparse_ladder``).
    """

    def __init__(self, config: SparseMLAConfig, *, num_pages: int, page_size: int = 64,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 seed: int = 0, projections: str = "auto") -> None:
        if not isinstance(config, SparseMLAConfig):
            raise TypeError(f"config must be a SparseMLAConfig, got {type(config).__name__}")
        widths = (config.kv_lora_rank, config.qk_rope_dim, config.index_dim)
        if widths != (512, 64, INDEX_DIM) or config.index_heads != INDEX_HEADS:
            raise ValueError(f"kv_lora_rank, qk_rope_dim, index_dim = {widths} and "
                             f"index_heads = {config.index_heads}: the sparse kernels take "
                             f"(512, 64, {INDEX_DIM}) and {INDEX_HEADS} (DeepSeek-V3.2)")
        super().__init__(config, num_pages=num_pages, page_size=page_size, dtype=dtype,
                         device=device, seed=seed, projections=projections)
        self.indexers = random_indexers(config, seed=seed + 1, device=self.device, dtype=dtype)
        slots = num_pages * page_size
        self._index_rows = [torch.zeros(slots + 1, INDEX_DIM, dtype=torch.float8_e4m3fn,
                                        device=self.device) for _ in range(config.num_layers)]
        self._index_row_scales = [torch.ones(slots + 1, device=self.device)
                                  for _ in range(config.num_layers)]
        self.index_caches = [r[:slots].view(num_pages, page_size, INDEX_DIM)
                             for r in self._index_rows]
        self.index_scales = [s[:slots].view(num_pages, page_size)
                             for s in self._index_row_scales]

    # ---- runner wiring -------------------------------------------------------------------

    def decode_backend(self, max_model_len: int, *, num_sms: int | None = None
                       ) -> SparseBackend:
        return SparseBackend(num_heads=self.config.num_heads, max_len=max_model_len,
                             topk=self.config.index_topk, num_sms=num_sms, device=self.device)

    # ---- decode --------------------------------------------------------------------------

    def forward(self, ctx: DecodeContext) -> torch.Tensor:
        """One decode step -> final hidden states [B x q_len, D] in the model dtype."""
        if self._kernel_error:
            raise ValueError(self._kernel_error)
        if not isinstance(ctx.backend, SparseBackend):
            raise TypeError(f"SparseMLADecoder runs on a SparseBackend, got {ctx.backend!r}; "
                            "build the runner with GraphBucketRunner.for_model(model, ...)")
        return self._layers(ctx, lambda i, h: self._sparse_attention(i, h, ctx))

    def _sparse_attention(self, i: int, h: torch.Tensor, ctx: DecodeContext) -> torch.Tensor:
        cfg, layer, ix, cache = self.config, self.layers[i], self.indexers[i], self.kv_caches[i]
        tokens, q_lora = h.shape[0], cfg.q_lora_rank
        qkv_a = self._linear(h, layer.w_qkv_a)                       # [T, Q + R + P]
        store_kv(qkv_a[:, q_lora:], layer.kv_a_norm, self.rope, ctx.positions,
                 ctx.inputs[SLOT_INPUT], ctx.seq_lens, cache, cfg.rms_eps, q_len=ctx.q_len)
        kw = self._linear(h, ix.w_ikw)                               # [T, K + I]
        weights = store_index_prologue(kw, ix.k_norm, self.rope, ctx.positions,
                                       ctx.inputs[SLOT_INPUT], ctx.seq_lens,
                                       self._index_rows[i], self._index_row_scales[i],
                                       eps=cfg.rms_eps, q_len=ctx.q_len)  # [T, I] float32
        q_a = rms_norm(qkv_a[:, :q_lora], layer.q_a_norm, cfg.rms_eps)
        index_q = rope_index_q_(self._linear(q_a, ix.w_iq), self.rope, ctx.positions)
        q_b = self._linear(q_a, layer.w_q_b)                         # [T, H * (nope + P)]
        q_nope = q_b.view(tokens, cfg.num_heads, cfg.qk_head_dim)[..., :cfg.qk_nope_dim]
        q_latent = self._bmm(q_nope.transpose(0, 1), layer.w_uk)     # [H, T, R]
        q = assemble_q(q_latent, q_b, self.rope, ctx.positions, nope_dim=cfg.qk_nope_dim)
        attn = torch.empty(tokens, cfg.num_heads, cfg.kv_lora_rank, dtype=h.dtype,
                           device=h.device)
        ctx.attend(q, cache, attn, index=IndexInputs(index_q, weights, self.index_caches[i],
                                                     self.index_scales[i]))
        o = self._bmm(attn.transpose(0, 1), layer.w_uv)              # [H, T, v_head]
        return self._linear(o.transpose(0, 1).reshape(tokens, -1), layer.w_o)

    # ---- prefill and float reference (tests, benchmarks) ---------------------------------

    def prefill_random(self, block_table: np.ndarray, seq_lens, *, seed: int = 0) -> None:
        """Seeded N(0, 1) latent rows (``paging.prefill_random``) and index keys (stored
        fp8 with their scales) on every page the first ``seq_lens`` tokens use."""
        prefill_random(self, block_table, seq_lens, seed=seed)
        page = self.page_size
        used = [np.asarray(block_table)[b, : -(-int(n) // page)] for b, n in enumerate(seq_lens)]
        pages = np.unique(np.concatenate(used + [np.zeros(0, np.int32)]))
        if pages.size == 0:
            return
        slots = (pages.astype(np.int64)[:, None] * page + np.arange(page)).reshape(-1)
        slots = torch.from_numpy(slots).to(self.device)
        gen = torch.Generator(device=self.device).manual_seed(seed + 1)
        for rows, scales in zip(self._index_rows, self._index_row_scales, strict=True):
            keys = torch.randn(slots.numel(), INDEX_DIM, generator=gen, device=self.device)
            store_index_keys(keys, slots, rows.view(-1, 1, INDEX_DIM), scales.view(-1, 1))

    def reference_index_caches(self, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
        """Every layer's index keys as read back (stored x scale), [pages, page_size, 128]."""
        return [dequantize_index_keys(c, s, dtype)
                for c, s in zip(self.index_caches, self.index_scales, strict=True)]

    def forward_reference(self, hidden, *, positions, seq_lens, block_table, slot_mapping,
                          caches: list[torch.Tensor] | None = None,
                          index_caches: list[torch.Tensor] | None = None,
                          dtype: torch.dtype = torch.float64, q_len: int = 1) -> torch.Tensor:
        """The same step in plain torch ``dtype`` (``models.sparse_reference``); writes the
        new rows into ``caches`` / ``index_caches`` (default: fresh copies)."""
        from graphbucket.models.sparse_reference import sparse_decode_reference

        return sparse_decode_reference(
            self.config, self.layers, self.indexers, self.final_norm, hidden,
            positions=positions, seq_lens=seq_lens, block_table=block_table,
            slot_mapping=slot_mapping,
            caches=self.reference_caches(dtype) if caches is None else caches,
            index_caches=(self.reference_index_caches(dtype) if index_caches is None
                          else index_caches), dtype=dtype, q_len=q_len)

    # ---- accounting ------------------------------------------------------------------------

    def weight_bytes(self) -> int:
        index = sum(t.numel() * t.element_size() for ix in self.indexers for t in ix.tensors())
        return super().weight_bytes() + index

    def kv_row_bytes(self) -> int:
        """Bytes of one token's latent and index rows over all layers (128 + 4 a layer)."""
        return super().kv_row_bytes() + self.config.num_layers * (INDEX_DIM + 4)
