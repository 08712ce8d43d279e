"""``DeepseekDecoder``: a transformers DeepSeek-V3 / V3.2 causal LM decoded by graphbucket.

Wrap a ``DeepseekV3ForCausalLM`` or ``DeepseekV32ForCausalLM`` (a random config or a
checkpoint; its weights are used, not copied, except the absorbed ones) and run its decode
steps through ``GraphBucketRunner``: one graph per (batch size, context bucket), a paged
latent cache, and for V3.2 a paged e4m3 index cache::

    decoder = DeepseekDecoder(model, num_pages=256, page_size=64)
    runner = GraphBucketRunner.for_model(decoder, max_model_len=4096, batch_sizes=[1, 8])
    logits, _ = decoder.prefill(prompt_ids, pages)   # the model's own forward
    runner.capture()
    logits = runner.step(decoder.decode_batch(seq_lens, pages_table, next_ids))

A decode step (``forward(ctx)``), per layer, with the model's own modules::

    h = input_layernorm(x)
    o = absorbed MLA of h over the paged latent cache (``hf_mla.LatentAttention``):
        dense split-KV for V3 (``TritonBackend``); for V3.2 the indexer's keys stored and
        its inputs passed to the sparse decode (``hf_indexer``, ``SparseBackend``)
    x = x + o_proj(o);  x = x + mlp(post_attention_layernorm(x))

then ``lm_head(norm(x))``: logits [B, vocab]. Rope scaling, the softmax scale (yarn mscale
included) and MoE routing are the model's. Dense MLPs, the MoE router and the shared
experts run as they are; the routed experts run through transformers' ``batched_mm``
experts function (each token's experts' weights gathered, fixed shapes), because the
default implementation loops over the experts a batch hits, which reads the routing on
the host.

Prefill is the model's own forward with its own cache (``prefill``), copied into the
pages (``load_cache``); transformers' cache rows are already this cache's layout.

Graph safety: ``forward`` launches fixed-shape work only (no ``.item()``, ``nonzero`` or
host reads); the attention uses ``ctx.plan``. Needs ``pip install 'graphbucket[hf]'``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from graphbucket.integrations import MIN_TRANSFORMERS, check_transformers_version

try:
    import transformers
    from transformers import DynamicCache
    from transformers.integrations.moe import batched_mm_experts_forward
except ImportError as e:  # the optional extra
    raise ImportError("graphbucket.integrations.transformers needs transformers: pip install "
                      f"'graphbucket[hf]' (or transformers>={MIN_TRANSFORMERS})") from e

from graphbucket.backends.triton import TritonBackend
from graphbucket.batch import DecodeBatch
from graphbucket.block_table import BlockTable
from graphbucket.context import DecodeContext
from graphbucket.integrations.hf_indexer import (
    ExactQSparseBackend,
    IndexCache,
    IndexerDecode,
)
from graphbucket.integrations.hf_mla import SLOT_INPUT, LatentAttention, rope_table
from graphbucket.kernels import kernel_device_error
from graphbucket.kernels.launch import cpu_dtype_error
from graphbucket.models.config import MLAConfig
from graphbucket.models.paging import slot_mapping_for
from graphbucket.sparse.backend import SparseBackend
from graphbucket.sparse.plan import INDEX_HEADS
from graphbucket.spec import BufferSpec, InputSpec

check_transformers_version(transformers.__version__)

TOKEN_INPUT = "input_ids"
SPARSE_WIDTHS = (512, 64)  # kv_lora_rank, qk_rope_head_dim the sparse kernels take


@dataclass(frozen=True, slots=True)
class TransformersMLAConfig(MLAConfig):
    """The attention shapes of a wrapped model, with its softmax scale (which under yarn
    is not 1/sqrt(qk_head_dim)); ``intermediate_size`` is the dense MLP's."""

    softmax_scale: float = 0.0
    sparse: bool = False

    @property
    def sm_scale(self) -> float:
        return self.softmax_scale


class DeepseekDecoder:
    """A transformers DeepSeek-V3 (or V3.2) causal LM as a ``GraphBucketRunner`` forward.

    ``model``: the ``*ForCausalLM`` (its device and dtype are used; float32 or float16 on
    the CPU, where the kernels run in Triton's interpreter). ``num_pages`` x ``page_size``
    token rows of latent cache per layer: kv_caches[l] [num_pages, page_size, R + P] in the
    model dtype; V3.2 adds index_caches[l] (e4m3 keys + float32 scales, paged alike).
    ``fp8_index_q``: V3.2 only: round the indexer's q to e4m3 per head in the kernel (as
    DeepSeek's kernels do); default False: q as computed, as transformers scores it.
    Call it as ``decoder(ctx)``: inputs ``input_ids`` [B] int64 and ``slot_mapping`` [B]
    int64; output logits [B, vocab] in the model dtype.
    """

    def __init__(self, model: nn.Module, *, num_pages: int, page_size: int = 64,
                 fp8_index_q: bool = False) -> None:
        cfg = model.config
        self.model, self.hf_config = model, cfg
        self.device, self.dtype = model.device, model.dtype
        # Raised by forward, not here: prefill, the cache copy and the shapes need no kernel.
        self._kernel_error = (kernel_device_error(self.device)
                              or cpu_dtype_error(self.device, self.dtype))
        self.num_pages, self.page_size, self.fp8_index_q = num_pages, page_size, fp8_index_q
        self.decoder_layers = list(model.model.layers[:cfg.num_hidden_layers])
        attentions = [layer.self_attn for layer in self.decoder_layers]
        interleaved = bool(getattr(cfg, "rope_interleave", True))
        self.layers = [LatentAttention.from_module(a, interleaved=interleaved)
                       for a in attentions]
        self.indexers = ([IndexerDecode.from_module(a.indexer) for a in attentions]
                         if hasattr(attentions[0], "indexer") else None)
        self.config = self._shapes(cfg)
        if self.indexers is not None:
            self._check_sparse(cfg)
        self.rope = rope_table(model.model.rotary_emb, cfg.max_position_embeddings,
                               dtype=self.dtype, device=self.device)
        rows = (num_pages, page_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_caches = [torch.zeros(rows, dtype=self.dtype, device=self.device)
                          for _ in self.layers]
        self.index_caches = ([] if self.indexers is None else
                             [IndexCache.allocate(num_pages, page_size, self.device)
                              for _ in self.layers])

    def _shapes(self, cfg) -> TransformersMLAConfig:
        scales = {layer.sm_scale for layer in self.layers}
        assert len(scales) == 1, f"layers disagree on the softmax scale: {scales}"
        return TransformersMLAConfig(
            name=cfg.model_type, num_heads=cfg.num_attention_heads,
            hidden_size=cfg.hidden_size, q_lora_rank=cfg.q_lora_rank or cfg.hidden_size,
            qk_nope_dim=cfg.qk_nope_head_dim, qk_rope_dim=cfg.qk_rope_head_dim,
            kv_lora_rank=cfg.kv_lora_rank, v_head_dim=cfg.v_head_dim,
            intermediate_size=cfg.intermediate_size, num_layers=len(self.layers),
            rms_eps=cfg.rms_norm_eps,
            rope_theta=float(cfg.rope_parameters.get("rope_theta", 10000.0)),
            max_position=cfg.max_position_embeddings, softmax_scale=scales.pop(),
            sparse=self.indexers is not None)

    def _check_sparse(self, cfg) -> None:
        widths = (cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        if widths != SPARSE_WIDTHS or cfg.index_n_heads != INDEX_HEADS:
            raise ValueError(f"kv_lora_rank, qk_rope_head_dim = {widths} and index_n_heads = "
                             f"{cfg.index_n_heads}: the sparse kernels take {SPARSE_WIDTHS} "
                             f"and {INDEX_HEADS} (DeepSeek-V3.2's)")

    def __call__(self, ctx: DecodeContext) -> torch.Tensor:
        return self.forward(ctx)

    # ---- what the runner needs ------------------------------------------------------------

    def decode_backend(self, max_model_len: int, *, num_sms: int | None = None):
        """V3: Triton split-KV decode of the model's latent widths; V3.2: the sparse decode
        at the config's ``index_topk`` (``ExactQSparseBackend`` unless ``fp8_index_q``)."""
        cfg = self.config
        if not cfg.sparse:
            return TritonBackend(kv_lora_rank=cfg.kv_lora_rank, qk_rope_dim=cfg.qk_rope_dim,
                                 num_sms=num_sms, device=self.device)
        kind = SparseBackend if self.fp8_index_q else ExactQSparseBackend
        return kind(num_heads=cfg.num_heads, max_len=max_model_len,
                    topk=self.hf_config.index_topk, num_sms=num_sms, device=self.device)

    def input_specs(self) -> tuple[InputSpec, ...]:
        return (InputSpec(TOKEN_INPUT, (), torch.int64), InputSpec(SLOT_INPUT, (), torch.int64))

    def buffer_spec(self, max_model_len: int) -> BufferSpec:
        """Static-buffer geometry for contexts up to ``max_model_len``."""
        if max_model_len > self.rope.shape[0]:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={self.rope.shape[0]}")
        return BufferSpec(max_pages_per_seq=-(-max_model_len // self.page_size),
                          num_pages=self.num_pages, page_size=self.page_size,
                          num_heads=self.config.num_heads,
                          output_shape=(self.hf_config.vocab_size,), output_dtype=self.dtype,
                          inputs=self.input_specs(), device=self.device)

    # ---- decode ---------------------------------------------------------------------------

    def forward(self, ctx: DecodeContext) -> torch.Tensor:
        """One decode step -> logits [B x q_len, vocab] in the model dtype."""
        if self._kernel_error:
            raise ValueError(self._kernel_error)
        with torch.no_grad():
            x = self.model.model.embed_tokens(ctx.inputs[TOKEN_INPUT])
            cos_sin = None
            if self.indexers is not None:
                cos_sin = self.rope[ctx.positions.clamp(0, self.rope.shape[0] - 1)]
            for i, layer in enumerate(self.decoder_layers):
                x = x + self._attention(i, layer.input_layernorm(x), ctx, cos_sin)
                x = x + mlp_forward(layer.mlp, layer.post_attention_layernorm(x))
            return self.model.lm_head(self.model.model.norm(x))

    def _attention(self, i: int, h: torch.Tensor, ctx: DecodeContext,
                   cos_sin: torch.Tensor | None) -> torch.Tensor:
        attention, cache = self.layers[i], self.kv_caches[i]
        q_in = attention.query_input(h)
        attention.store_latent(h, self.rope, ctx, cache)
        q = attention.query(q_in, self.rope, ctx.positions)
        out = torch.empty(h.shape[0], attention.num_heads, self.config.kv_lora_rank,
                          dtype=h.dtype, device=h.device)
        if self.indexers is None:
            ctx.attend(q, cache, out)
        else:
            ctx.attend(q, cache, out,
                       index=self.indexers[i](h, q_in, cos_sin, ctx, self.index_caches[i]))
        return attention.output(out)

    # ---- prefill and steps ----------------------------------------------------------------

    def prefill(self, token_ids, pages, *, cache=None) -> tuple[torch.Tensor, object]:
        """Run the model's own forward over one request's prompt ``token_ids`` [S] and copy
        its cache into ``pages`` (the request's page ids, enough for S tokens) ->
        (logits [vocab] of the last prompt token, the transformers cache, which the
        model's own decoding can continue). ``cache``: a transformers cache to fill
        (default: a new ``DynamicCache``)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).view(1, -1)
        if cache is None:
            cache = DynamicCache(config=self.hf_config)
        with torch.no_grad():
            out = self.model(ids, cache=cache, use_cache=True)
        self.load_cache(cache, pages)
        return out.logits[0, -1], cache

    def load_cache(self, cache, pages, *, row: int = 0) -> None:
        """Copy row ``row`` of a transformers cache (positions 0 .. S-1) into ``pages``:
        latent rows for every layer and, for V3.2, index keys rounded to e4m3."""
        pages = np.asarray(pages, dtype=np.int32).reshape(-1)
        first = cache.layers[0].keys
        length = first.shape[2]
        if length > pages.size * self.page_size:
            raise ValueError(f"{length} cached tokens need {-(-length // self.page_size)} "
                             f"pages of {self.page_size}, got {pages.size}")
        table = np.broadcast_to(pages, (length, pages.size))
        slots = torch.from_numpy(slot_mapping_for(table, np.arange(length), self.page_size))
        slots = slots.to(self.device)
        with torch.no_grad():
            for i, cached in enumerate(cache.layers[:len(self.layers)]):
                rows = torch.cat([cached.keys[row, 0], cached.values[row, 0]], dim=-1)
                flat = self.kv_caches[i].view(-1, rows.shape[-1])
                flat.index_copy_(0, slots, rows.to(self.dtype))
                if self.indexers is not None:
                    self.index_caches[i].store(cached.indexer_keys[row], slots)

    def decode_batch(self, seq_lens, block_table: np.ndarray | BlockTable,
                     token_ids) -> DecodeBatch:
        """A step decoding ``token_ids`` [B] at position seq_len - 1 of each request
        (seq_lens count them; 0: a padding row). ``block_table``: int [B, cols] or the
        runner's ``BlockTable``. The runner's step checks the rest."""
        lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        paged = isinstance(block_table, BlockTable)
        table = block_table.table[:lens.size] if paged else np.asarray(block_table, np.int32)
        capacity = table.shape[1] * self.page_size
        if lens.size and (lens.min() < 0 or lens.max() > capacity):
            raise ValueError(f"seq_lens {lens.tolist()} must lie in [0, {capacity}]: the block "
                             f"table has {table.shape[1]} pages of {self.page_size} tokens")
        slots = slot_mapping_for(table, lens - 1, self.page_size)
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        return DecodeBatch(lens.astype(np.int32), block_table if paged else table,
                           {TOKEN_INPUT: ids, SLOT_INPUT: torch.from_numpy(slots)})


def mlp_forward(mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A layer's MLP on h [T, D]: a dense MLP as it is; a DeepSeek MoE as its own
    ``forward`` computes it, with the routed experts through ``batched_mm``."""
    if not (hasattr(mlp, "experts") and hasattr(mlp, "gate")):
        return mlp(h)
    _, weights, experts = mlp.gate(h)
    routed = batched_mm_experts_forward(mlp.experts, h, experts, weights)
    return routed + mlp.shared_experts(h)

