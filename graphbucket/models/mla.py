"""``MLADecoder``: absorbed-MLA decode over a paged latent KV cache, q_len tokens per request.

Per layer (D hidden, H heads, R = kv_lora_rank, P = qk_rope_dim)::

    h        = RMSNorm(x)
    q_a|kv_a = h @ [W_qa | W_kva]                       # one fused projection
    q        = RMSNorm(q_a) @ W_qb -> [B, H, nope | P]
    cache[slot_mapping] = [RMSNorm(kv_a[:R]) | rotary(kv_a[R:])]   # before attention
    q_mla    = [q_nope @ W_UK  | rotary(q_rope)]          # [B, H, R + P]
    o        = MLA(q_mla, cache, seq_lens) @ W_UV -> o_proj     # ctx.attend, frozen plan
    x        = x + o;  x = x + SwiGLU(RMSNorm(x))

then a final RMSNorm. The new token is stored before attention, so ``seq_lens`` counts it.
The forward reads ``ctx.inputs["hidden"]`` [B, D] (the new token's embedding) and
``ctx.inputs["slot_mapping"]`` [B] int64; rows with a negative slot or seq_len 0
(padding) store nothing.

A verify step (``ctx.q_len`` > 1: MTP / speculative decoding) runs B x q_len token rows
through every projection (row b * q_len + j is request b's token j, at position
seq_len - q_len + j); all q_len new rows are stored before attention, and token j
attends to the positions before seq_len - q_len + j + 1 (``ctx.attend``, folded).

Graph safety: ``forward(ctx)`` reads no device data on the host and launches a fixed
sequence of kernels whose shapes depend only on the batch size; the attention launch
uses ``ctx.plan``. Intermediates are allocated inside the forward, so a captured graph
takes them from its pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphbucket import fp8
from graphbucket.backends.triton import TritonBackend
from graphbucket.context import DecodeContext
from graphbucket.kernels import kernel_device_error
from graphbucket.kernels.launch import cpu_dtype_error
from graphbucket.models.config import MLAConfig
from graphbucket.models.gemv import MAX_ROWS, skinny_bmm
from graphbucket.models.ops import (
    add_rms_norm,
    assemble_q,
    rms_norm,
    rope_cache,
    silu_mul,
    store_kv,
)
from graphbucket.models.step_reference import decode_reference
from graphbucket.models.weights import MLALayerWeights, random_weights
from graphbucket.spec import BufferSpec, InputSpec

PROJECTIONS = ("auto", "skinny-bmm", "torch")
HIDDEN_INPUT = "hidden"
SLOT_INPUT = "slot_mapping"


class MLADecoder:
    """Seeded random MLA decoder with one paged latent cache per layer.

    ``dtype`` defaults to bfloat16 on CUDA; on the CPU, where the kernels run in Triton's
    interpreter and bfloat16 is refused (its ``tl.dot`` is wrong there), to float32, or
    float16 over an fp8 cache.
    kv_caches[l]: [num_pages, page_size, width] in the ``kv_cache_format``
    (``graphbucket.fp8``): "bf16", [.., R + P] in ``dtype`` (default); "fp8-tensor", [..,
    R + P] e4m3 with the per-tensor ``kv_scale`` (value = stored x kv_scale); "fp8-v32",
    uint8 [.., 656], DeepSeek-V3.2's rows (R = 512, P = 64). Both fp8 formats need a bf16 or
    fp16 model; ``kv_cache_dtype=torch.float8_e4m3fn`` is the older spelling of
    "fp8-tensor". On ``device`` (default: CUDA
    when available, else the CPU, where the kernels need ``TRITON_INTERPRET=1``). Call the model
    as ``model(ctx)``; it is the ``forward`` a ``GraphBucketRunner`` captures. ``weights``
    (per-layer weights, final norm [D]) replaces the seeded draw, e.g. a tensor-parallel shard.
    """

    def __init__(self, config: MLAConfig, *, num_pages: int, page_size: int = 64,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 seed: int = 0,
                 weights: tuple[list[MLALayerWeights], torch.Tensor] | None = None,
                 projections: str = "auto", kv_cache_dtype: torch.dtype | None = None,
                 kv_scale: float | None = None, kv_cache_format: str | None = None) -> None:
        if projections not in PROJECTIONS:
            raise ValueError(f"projections must be one of {PROJECTIONS}, got {projections!r}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype is None:
            dtype = _default_dtype(device, kv_cache_format, kv_cache_dtype)
        # Raised by forward, not here: a model without runnable kernels is still good for
        # its weights, shards and float reference.
        self._kernel_error = kernel_device_error(device) or cpu_dtype_error(device, dtype)
        self.config, self.num_pages, self.page_size = config, num_pages, page_size
        # "skinny-bmm": the per-head absorbed products through models/gemv.py (1.1-1.2x
        # faster than torch.bmm on the H200, bench/NOTES.md), F.linear for the rest (cuBLAS
        # was faster there); "torch": F.linear / torch.bmm; "auto": skinny-bmm on CUDA.
        self.projections = projections if projections != "auto" else (
            "skinny-bmm" if torch.device(device).type == "cuda" else "torch")
        self.dtype, self.device = dtype, torch.device(device)
        if weights is None:
            weights = random_weights(config, seed=seed, device=self.device, dtype=dtype)
        self.layers, self.final_norm = weights
        fmt = _cache_format(kv_cache_format, kv_cache_dtype, dtype)
        self.kv_cache_format = fmt.name
        if (fmt.scale == "per-tensor") != (kv_scale is not None):
            raise ValueError(f"a per-tensor cache ({fp8.per_tensor_names()}) takes a kv_scale "
                             "(graphbucket.fp8: value = stored x kv_scale, e.g. amax / 448); "
                             f"other caches take none, got kv_cache_format {fmt.name!r} and "
                             f"kv_scale {kv_scale!r}")
        if fmt.quantized and dtype not in fp8.FP8_Q_DTYPES:
            raise ValueError(f"an fp8 cache needs a bf16 or fp16 model, got {dtype}")
        self.kv_scale = None if kv_scale is None else torch.tensor(
            [float(kv_scale)], dtype=torch.float32, device=self.device)
        width, self.kv_cache_dtype = fmt.cache_row(config.kv_dim, dtype)
        self.kv_caches = [torch.zeros(num_pages, page_size, width,
                                      dtype=self.kv_cache_dtype, device=self.device)
                          for _ in range(config.num_layers)]
        self.rope = rope_cache(config.qk_rope_dim, config.max_position, config.rope_theta,
                                   device=self.device)

    def __call__(self, ctx: DecodeContext) -> torch.Tensor:
        return self.forward(ctx)

    # ---- what the runner needs --------------------------------------------------------

    def decode_backend(self, max_model_len: int, *, num_sms: int | None = None
                       ) -> TritonBackend:
        """The backend ``GraphBucketRunner.for_model`` runs this model on: Triton split-KV
        decode of its latent widths on its device (``max_model_len``: unused here; the
        sparse model's indexer sizes its rows by it)."""
        return TritonBackend(kv_lora_rank=self.config.kv_lora_rank,
                             qk_rope_dim=self.config.qk_rope_dim, num_sms=num_sms,
                             device=self.device)

    def input_specs(self) -> tuple[InputSpec, ...]:
        return (InputSpec(HIDDEN_INPUT, (self.config.hidden_size,), self.dtype),
                InputSpec(SLOT_INPUT, (), torch.int64))

    def buffer_spec(self, max_model_len: int) -> BufferSpec:
        """Static-buffer geometry for a runner serving contexts up to ``max_model_len``."""
        if max_model_len > self.config.max_position:
            raise ValueError(f"max_model_len={max_model_len} exceeds the rotary table "
                             f"(max_position={self.config.max_position}); build the config "
                             "with a larger max_position")
        return BufferSpec(max_pages_per_seq=-(-max_model_len // self.page_size),
                          num_pages=self.num_pages, page_size=self.page_size,
                          num_heads=self.config.num_heads,
                          output_shape=(self.config.hidden_size,), output_dtype=self.dtype,
                          inputs=self.input_specs(), device=self.device,
                          kv_cache_format=self.kv_cache_format)

    # ---- decode ---------------------------------------------------------------------

    def forward(self, ctx: DecodeContext) -> torch.Tensor:
        """One decode step -> final hidden states [B x q_len, D] in the model dtype."""
        if self._kernel_error:
            raise ValueError(self._kernel_error)
        self.check_caches()
        return self._layers(ctx, lambda i, h: self._attention(self.layers[i],
                                                              self.kv_caches[i], h, ctx))

    def _layers(self, ctx: DecodeContext, attention) -> torch.Tensor:
        """The decoder stack with ``attention(layer index, normed hidden)`` per layer."""
        cfg = self.config
        x = ctx.inputs[HIDDEN_INPUT]
        h = rms_norm(x, self.layers[0].attn_norm, cfg.rms_eps)
        for i, layer in enumerate(self.layers):
            o = self._all_reduce(attention(i, h))
            x, h = add_rms_norm(x, o, layer.mlp_norm, cfg.rms_eps)
            d = self._all_reduce(self._linear(silu_mul(self._linear(h, layer.w_gate_up)),
                                              layer.w_down))
            next_norm = (self.layers[i + 1].attn_norm if i + 1 < len(self.layers)
                         else self.final_norm)
            x, h = add_rms_norm(x, d, next_norm, cfg.rms_eps)
        return h

    def check_caches(self) -> None:
        """Every layer's cache and the scale hold ``kv_cache_format`` rows, else ValueError
        (host metadata only; runs before the forward launches anything, so a bad cache
        leaves every cache as it was)."""
        for i, cache in enumerate(self.kv_caches):
            try:
                fp8.check_cache(cache, self.kv_cache_format, self.kv_scale,
                                kv_dim=self.config.kv_dim)
            except ValueError as e:
                raise ValueError(f"kv_caches[{i}]: {e}") from None

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    def _bmm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.projections == "skinny-bmm" and x.shape[1] <= MAX_ROWS:
            return skinny_bmm(x, w)
        return torch.bmm(x, w)

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel projection's output (o_proj, MLP down) over tensor-parallel
        ranks; one rank holds the whole sum (``models.tp.TPMLADecoder`` overrides this)."""
        return partial

    def _attention(self, layer: MLALayerWeights, cache: torch.Tensor, h: torch.Tensor,
                   ctx: DecodeContext) -> torch.Tensor:
        cfg = self.config
        bs, q_lora = h.shape[0], cfg.q_lora_rank
        qkv_a = self._linear(h, layer.w_qkv_a)                      # [B, Q + R + P]
        store_kv(qkv_a[:, q_lora:], layer.kv_a_norm, self.rope, ctx.positions,
                     ctx.inputs[SLOT_INPUT], ctx.seq_lens, cache, cfg.rms_eps,
                     kv_scale=self.kv_scale, q_len=ctx.q_len,
                     kv_cache_format=self.kv_cache_format)
        q_b = self._linear(rms_norm(qkv_a[:, :q_lora], layer.q_a_norm, cfg.rms_eps),
                           layer.w_q_b)                             # [B, H * (nope + P)]
        q_nope = q_b.view(bs, cfg.num_heads, cfg.qk_head_dim)[..., :cfg.qk_nope_dim]
        q_latent = self._bmm(q_nope.transpose(0, 1), layer.w_uk)    # [H, B, R]
        q = assemble_q(q_latent, q_b, self.rope, ctx.positions, nope_dim=cfg.qk_nope_dim)
        attn = torch.empty(bs, cfg.num_heads, cfg.kv_lora_rank, dtype=h.dtype, device=h.device)
        ctx.attend(q, cache, attn, kv_scale=self.kv_scale)
        o = self._bmm(attn.transpose(0, 1), layer.w_uv)             # [H, B, v_head]
        return self._linear(o.transpose(0, 1).reshape(bs, -1), layer.w_o)

    # ---- float reference (tests) -----------------------------------------------------

    def reference_caches(self, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
        """Copies of every layer's cache as values [num_pages, page_size, R + P] in ``dtype``
        (an fp8 cache dequantized), for ``forward_reference`` to update."""
        return [fp8.dequantize_cache(cache, self.kv_scale, dtype) for cache in self.kv_caches]

    def forward_reference(self, hidden, *, positions, seq_lens, block_table, slot_mapping,
                          caches: list[torch.Tensor] | None = None,
                          dtype: torch.dtype = torch.float64, q_len: int = 1,
                          store_new_rows: bool = True) -> torch.Tensor:
        """The same step in plain torch ``dtype`` (see ``models.step_reference``); writes its new
        rows into ``caches`` (default: fresh copies of the model's caches), unless
        ``store_new_rows`` is False (``caches`` read back after this model's step)."""
        caches = self.reference_caches(dtype) if caches is None else caches
        return decode_reference(self.config, self.layers, self.final_norm, hidden,
                                positions=positions, seq_lens=seq_lens,
                                block_table=block_table, slot_mapping=slot_mapping,
                                caches=caches, dtype=dtype, kv_scale=self.kv_scale,
                                kv_cache_format=self.kv_cache_format, q_len=q_len,
                                store_new_rows=store_new_rows)

    # ---- accounting (for roofline floors) ---------------------------------------------

    def weight_bytes(self) -> int:
        tensors = [t for layer in self.layers for t in layer.tensors()] + [self.final_norm]
        return sum(t.numel() * t.element_size() for t in tensors)

    def kv_row_bytes(self) -> int:
        """Bytes of one token's cache rows over all layers (per layer: 1152 for bf16 576-wide
        rows, 576 for fp8-tensor, 656 for fp8-v32)."""
        return self.config.num_layers * fp8.row_bytes(self.kv_cache_format, self.config.kv_dim,
                                                      self.dtype)


def _default_dtype(device: torch.device | str, kv_cache_format: str | None,
                   kv_cache_dtype: torch.dtype | None) -> torch.dtype:
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    named = kv_cache_format is not None and fp8.get_cache_format(kv_cache_format).quantized
    stored = kv_cache_dtype is not None and any(
        f.quantized and kv_cache_dtype in f.stored_dtypes for f in fp8.CACHE_FORMATS.values())
    return torch.float16 if named or stored else torch.float32


def _cache_format(kv_cache_format: str | None, kv_cache_dtype: torch.dtype | None,
                  dtype: torch.dtype) -> fp8.CacheFormat:
    """The format named by ``kv_cache_format``, or by the older ``kv_cache_dtype`` (the
    format that stores a ``dtype`` model's rows as it)."""
    by_dtype = None
    if kv_cache_dtype is not None:
        by_dtype = next((f for f in fp8.CACHE_FORMATS.values()
                         if f.stored_dtype(dtype) == kv_cache_dtype), None)
        if by_dtype is None:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype} is not a cache of a {dtype} "
                             f"model; name the format instead: kv_cache_format one of "
                             f"{fp8.KV_CACHE_FORMATS}")
    if kv_cache_format is None:
        return by_dtype or fp8.get_cache_format(fp8.DEFAULT_FORMAT)
    fmt = fp8.get_cache_format(kv_cache_format)
    if by_dtype is not None and by_dtype != fmt:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype} means {by_dtype.name!r}, but "
                         f"kv_cache_format={kv_cache_format!r}; pass only kv_cache_format")
    return fmt
