"""Latent cache formats: one ``CacheFormat`` object per way a cache stores a token's row,
and the fp8 scale rules, quantize / dequantize and pack / unpack (torch ops) they use.

The registry (``CACHE_FORMATS``; by name ``get_cache_format``, by a cache tensor's dtype
``cache_format_of``) is the one place a format is defined: its row width and stored
dtype, its scale kind, the tag the decode kernels switch on (``KV_FORMAT``), its tile
rule, how a row is stored and read back, and the checks a cache must pass. Callers ask
the format; the name ("bf16", "fp8-tensor", "fp8-v32") is what the model, the buffer
spec, the benchmarks and the tuner take. A new format is a ``CacheFormat`` here, its
kernel variant (the ``KV_FORMAT`` it names) and its tests.

"bf16": unquantized rows in the model's dtype (bf16 in every benchmark; the CPU tests'
fp16 / fp32 models keep theirs).

Per-tensor format ("fp8-tensor"): every 576-wide cache row (latent then rope) in ``float8_e4m3fn``,
576 bytes per token, and one float32 scale for the whole cache, on the device:
``value = stored * kv_scale``. Storing rounds ``value / kv_scale`` to the nearest e4m3
number (torch's cast) after saturating at +-448, e4m3's largest finite value (the format
has no infinity). A calibrated scale is ``amax / 448`` over the values the cache will
hold (``scale_for``); the decode kernels read fp8 tiles as float16 (exact: every e4m3
number is one), multiply in float16 with q converted once, and apply the scale once to
the scores and once to the output.

V3.2 format ("fp8-v32", FlashMLA's layout): a uint8 cache [num_pages, page_size, 656],
656 bytes per token::

    bytes   0 .. 511   the 512 latent values, float8_e4m3fn
    bytes 512 .. 527   4 float32 scales, one per group of 128 latent values
                       (latent value c = stored[c] * scale[c // 128])
    bytes 528 .. 655   the 64 rope values, bfloat16 (not quantized)

Scale rule, per token and group: ``scale = max(amax(|group|) / 448, 2**-126)``, 2**-126
being float32's smallest normal number. The group's largest magnitude is stored as +-448;
a group of zeros (or of values below ~2**-135) gets scale 2**-126 and stores zeros, so
zeros round-trip to 0 and no scale is 0, subnormal, inf or nan for finite inputs. Values
are ``value / scale`` saturated at +-448 and rounded to the nearest e4m3 number (torch's
cast). Multi-byte fields are little-endian (the host's and the GPU's byte order). The
decode kernels read a V3.2 cache directly: the latent tile as e4m3 times its group's
scale in float16 (so latent magnitudes must stay within float16's 65504, and a scale's
float16 rounding adds at most 2**-11 relative error), the rope in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def scale_for(amax: float | torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """The per-tensor scale for values up to ``amax`` in magnitude: float32 [1]."""
    amax = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
    if not bool((amax > 0).all()) or not bool(torch.isfinite(amax).all()):
        raise ValueError(f"amax must be a positive finite number, got {amax.item()}")
    return (amax / FP8_MAX).to(device)


def quantize(values: torch.Tensor, kv_scale: torch.Tensor) -> torch.Tensor:
    """``values / kv_scale`` saturated at +-448 and rounded to e4m3 (same shape)."""
    return (values.float() / kv_scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(stored: torch.Tensor, kv_scale: torch.Tensor,
               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``stored * kv_scale`` in ``dtype`` (float64 for the reference)."""
    if stored.dtype != FP8_DTYPE:
        raise TypeError(f"expected a {FP8_DTYPE} tensor, got {stored.dtype}")
    return stored.to(dtype) * kv_scale.to(device=stored.device, dtype=dtype)


# ---- DeepSeek-V3.2 per-token, per-128-group format ("fp8-v32") ------------------------------

V32_LATENT = 512   # latent values per token (kv_lora_rank), e4m3, bytes 0 .. 511
V32_ROPE = 64      # rope values per token (qk_rope_dim), bf16
V32_GROUP = 128    # latent values per scale
V32_GROUPS = V32_LATENT // V32_GROUP
V32_SCALE_OFFSET = V32_LATENT                        # 4 float32 scales: bytes 512 .. 527
V32_ROPE_OFFSET = V32_SCALE_OFFSET + 4 * V32_GROUPS  # 64 bf16: bytes 528 .. 655
V32_BYTES = V32_ROPE_OFFSET + 2 * V32_ROPE           # 656 bytes per token
V32_MIN_SCALE = 2.0 ** -126  # float32's smallest normal number: the scale of a zero group


def v32_scales(latent: torch.Tensor) -> torch.Tensor:
    """Per-group scales of latent rows [..., 512]: float32 [..., 4] (the V3.2 rule)."""
    groups = latent.float().reshape(*latent.shape[:-1], V32_GROUPS, V32_GROUP)
    return (groups.abs().amax(-1) / FP8_MAX).clamp_min(V32_MIN_SCALE)


def pack_v32(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows [..., 576] (512 latent then 64 rope, any float dtype) as V3.2 bytes:
    uint8 [..., 656] (layout and scale rule: module docstring)."""
    if rows.shape[-1] != V32_LATENT + V32_ROPE or not rows.is_floating_point():
        raise ValueError(f"pack_v32 takes float rows [..., {V32_LATENT + V32_ROPE}], got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    lead = rows.shape[:-1]
    latent, rope = rows[..., :V32_LATENT].float(), rows[..., V32_LATENT:]
    scales = v32_scales(latent)
    groups = latent.reshape(*lead, V32_GROUPS, V32_GROUP) / scales[..., None]
    stored = groups.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(*lead, V32_LATENT)
    return torch.cat([stored.view(torch.uint8), scales.contiguous().view(torch.uint8),
                      rope.to(torch.bfloat16).contiguous().view(torch.uint8)], -1)


def unpack_v32(packed: torch.Tensor) -> torch.Tensor:
    """V3.2 bytes [..., 656] back to dequantized rows: float64 [..., 576] (latent =
    stored * group scale, rope = the bf16 values)."""
    if packed.dtype != torch.uint8 or packed.shape[-1] != V32_BYTES:
        raise ValueError(f"unpack_v32 takes uint8 [..., {V32_BYTES}], got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    lead = packed.shape[:-1]
    stored = packed[..., :V32_LATENT].contiguous().view(FP8_DTYPE)
    scales = packed[..., V32_SCALE_OFFSET:V32_ROPE_OFFSET].contiguous().view(torch.float32)
    rope = packed[..., V32_ROPE_OFFSET:].contiguous().view(torch.bfloat16)
    latent = stored.double().reshape(*lead, V32_GROUPS, V32_GROUP) * scales.double()[..., None]
    return torch.cat([latent.reshape(*lead, V32_LATENT), rope.double()], -1)


# ---- cache formats --------------------------------------------------------------------------

SCALE_KINDS = ("none", "per-tensor", "per-token-group")
UNQUANTIZED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# q (and out) dtypes that attend an fp8 cache.
FP8_Q_DTYPES = (torch.bfloat16, torch.float16)


def _fail(name: str, got, expected: str, fix: str) -> None:
    raise ValueError(f"{name}: got {got}, expected {expected}. {fix}")


@dataclass(frozen=True)
class CacheFormat:
    """One latent-cache format (this base: unquantized rows in the model's dtype).

    ``scale``: one of ``SCALE_KINDS``; ``kernel_tag``: the decode kernels' ``KV_FORMAT``
    constexpr; ``stored_dtypes``: the cache dtypes read as this format (``cache_format_of``).
    Host metadata only in every check: no device read, so they run before a capture.
    """

    name: str
    scale: str
    kernel_tag: str
    stored_dtypes: tuple[torch.dtype, ...]

    def __post_init__(self) -> None:
        if self.scale not in SCALE_KINDS:
            raise ValueError(f"scale must be one of {SCALE_KINDS}, got {self.scale!r}")

    @property
    def quantized(self) -> bool:
        return self.scale != "none"

    def stored_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The cache tensor's dtype for a ``dtype`` model."""
        return dtype

    def cache_row(self, kv_dim: int, dtype: torch.dtype) -> tuple[int, torch.dtype]:
        """(row width, element dtype) of a cache for ``kv_dim``-wide rows of a ``dtype``
        model."""
        return kv_dim, self.stored_dtype(dtype)

    def row_bytes(self, kv_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one token's row in one layer's cache (bf16 576-wide: 1152, 576, 656)."""
        width, elt = self.cache_row(kv_dim, dtype)
        return width * elt.itemsize

    def store(self, rows: torch.Tensor, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [..., kv_dim] as this cache stores them (the model's dtype: unchanged)."""
        return rows

    def dequantize(self, stored: torch.Tensor, kv_scale: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Stored rows back as values [..., kv_dim] in ``dtype`` (a copy)."""
        return stored.to(dtype, copy=True)

    def as_stored(self, rows: torch.Tensor, kv_scale: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Rows as a cache of this format gives them back, in ``dtype`` (the float
        reference's store)."""
        return rows.to(dtype)

    def tile_tokens(self, block_n: int, block_h: int, element_size: int) -> int:
        """Tokens per KV tile of a plan of ``block_n`` tokens and ``block_h`` rows, where
        the fp8 register prefetch does not run. Plans are tuned for 2-byte caches (bf16:
        64 x 576 x 2 B = 72 KB tiles, 94 KB of shared memory at 3 stages); a 64-token
        float32 tile needs 233 KB even unpipelined (H200: 227 KB per block), so wider
        elements stream tiles of the same bytes: fewer tokens."""
        return max(16, block_n * 2 // max(2, element_size))

    def check_cache(self, kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, *,
                    kv_dim: int) -> None:
        """A cache [num_pages, page_size, width] and scale that hold this format's rows
        ``kv_dim`` values wide, else ValueError naming the received and expected values.
        Unquantized is any float cache (bf16, fp16, fp32)."""
        width, elt = self.cache_row(kv_dim, kv_cache.dtype)
        if not self.quantized and elt not in UNQUANTIZED_DTYPES:
            elt = torch.bfloat16  # an fp8 / uint8 cache declared unquantized: name the usual one
        if kv_cache.dim() != 3 or kv_cache.dtype != elt or kv_cache.shape[2] != width:
            raise ValueError(f"the {self.name} format needs a {elt} cache [num_pages, "
                             f"page_size, {width}], got {kv_cache.dtype} "
                             f"{tuple(kv_cache.shape)}. Allocate it for the declared format "
                             f"(graphbucket.fp8.cache_row) or declare the format it holds "
                             f"({format_of(kv_cache)})")
        self._check_scale(kv_cache, kv_scale)

    def _check_scale(self, kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> None:
        if kv_scale is not None:
            raise ValueError(f"kv_scale: got a tensor, expected None for a {self.name} "
                             f"cache (only {per_tensor_names()} takes a per-tensor scale)")

    def check_launch(self, q: torch.Tensor, kv_cache: torch.Tensor,
                     kv_scale: torch.Tensor | None, *, kv_lora_rank: int,
                     qk_rope_dim: int) -> None:
        """What the decode kernels need of this cache, q and scale (ValueError)."""
        d_qk = kv_lora_rank + qk_rope_dim
        if kv_cache.dim() != 3 or kv_cache.shape[2] != d_qk:
            _fail("kv_cache.shape", tuple(kv_cache.shape), f"[num_pages, page_size, {d_qk}]",
                  "The cache row is the latent (kv_lora_rank) followed by the rope part.")
        self.check_dtypes(q, kv_cache, kv_scale)

    def check_dtypes(self, q: torch.Tensor, kv_cache: torch.Tensor,
                     kv_scale: torch.Tensor | None) -> None:
        """q and cache of one dtype, bf16 / fp16 / fp32, and no scale."""
        if kv_cache.dtype not in UNQUANTIZED_DTYPES or q.dtype != kv_cache.dtype:
            _fail("dtypes", f"q={q.dtype}, kv_cache={kv_cache.dtype}",
                  "equal dtypes, one of bfloat16/float16/float32, an fp8 (e4m3) cache, or a "
                  "V3.2 fp8 (uint8, 656-byte rows) cache",
                  "Cast q to the cache dtype.")
        if kv_scale is not None:
            _fail("kv_scale", "a tensor", "None for a bf16/fp16/fp32 cache",
                  "Only fp8 caches take a scale.")


@dataclass(frozen=True)
class PerTensorFp8(CacheFormat):
    """Every row (latent then rope) in e4m3 with one float32 scale for the whole cache."""

    def stored_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return FP8_DTYPE

    def store(self, rows: torch.Tensor, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        return quantize(rows, kv_scale.to(rows.device))

    def dequantize(self, stored: torch.Tensor, kv_scale: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return dequantize(stored, kv_scale, dtype)

    def as_stored(self, rows: torch.Tensor, kv_scale: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return dequantize(quantize(rows, kv_scale.to(rows.device)), kv_scale, dtype)

    def tile_tokens(self, block_n: int, block_h: int, element_size: int) -> int:
        # The latent tile is copied once per dot; 64 query rows also keep q in shared
        # memory, so half the tokens keep the copies within one SM's shared memory.
        if block_h >= 64:
            return max(16, block_n // 2)
        return super().tile_tokens(block_n, block_h, element_size)

    def _check_scale(self, kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> None:
        if not isinstance(kv_scale, torch.Tensor) or kv_scale.dtype != torch.float32 \
                or tuple(kv_scale.shape) != (1,) or kv_scale.device != kv_cache.device:
            got = None if not isinstance(kv_scale, torch.Tensor) else \
                f"{kv_scale.dtype} {tuple(kv_scale.shape)} on {kv_scale.device}"
            raise ValueError(f"kv_scale: got {got}, expected float32 [1] on {kv_cache.device}. "
                             f"An {self.name} cache needs its scale (value = stored x kv_scale, "
                             "e.g. graphbucket.fp8.scale_for(amax))")

    def check_dtypes(self, q: torch.Tensor, kv_cache: torch.Tensor,
                     kv_scale: torch.Tensor | None) -> None:
        """A bf16 / fp16 q and the cache's per-tensor scale."""
        if q.dtype not in FP8_Q_DTYPES:
            _fail("dtypes", f"q={q.dtype}, kv_cache={kv_cache.dtype}", "bf16 or fp16 q",
                  "An fp8 cache is attended with a bfloat16 or float16 q.")
        if kv_scale is None or not isinstance(kv_scale, torch.Tensor) \
                or kv_scale.dtype != torch.float32 or kv_scale.numel() != 1 \
                or kv_scale.device != kv_cache.device:
            got = None if not isinstance(kv_scale, torch.Tensor) else \
                f"{kv_scale.dtype} {tuple(kv_scale.shape)} on {kv_scale.device}"
            _fail("kv_scale", got, f"float32 [1] on {kv_cache.device}",
                  "An fp8 cache needs its per-tensor scale (value = stored * kv_scale).")


@dataclass(frozen=True)
class V32Fp8(CacheFormat):
    """DeepSeek-V3.2's uint8 rows: 512 e4m3 latent values, 4 float32 group scales and 64
    bf16 rope values per token (656 bytes; the module docstring)."""

    def stored_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    def cache_row(self, kv_dim: int, dtype: torch.dtype) -> tuple[int, torch.dtype]:
        if kv_dim != V32_LATENT + V32_ROPE:
            raise ValueError(f"the {self.name} format holds {V32_LATENT} latent and {V32_ROPE} "
                             f"rope values per token (kv_dim {V32_LATENT + V32_ROPE}), got "
                             f"kv_dim {kv_dim}; use {per_tensor_names()} for other shapes")
        return V32_BYTES, torch.uint8

    def store(self, rows: torch.Tensor, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        return pack_v32(rows)

    def dequantize(self, stored: torch.Tensor, kv_scale: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return unpack_v32(stored).to(dtype)

    def as_stored(self, rows: torch.Tensor, kv_scale: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return unpack_v32(pack_v32(rows.float())).to(dtype)

    def tile_tokens(self, block_n: int, block_h: int, element_size: int) -> int:
        """Half the plan's tokens: a V3.2 tile (656-byte rows, 0.57x a bf16 row) is
        dequantized into a bf16 tile in shared memory (and its transpose for the
        head-major layout), so it takes more than its bytes. sm_90 compile with half
        tiles, no spills: LONG 89 KB, LONG_PAGE_AHEAD 56 KB, WIDE 54 KB, TOKEN_STREAM
        56 KB, ROWS_STREAM 132 KB, each stream's programs per SM as planned; with the
        plan's tokens LONG needed 159 KB (one program per SM, not two), WIDE 89 KB and
        TOKEN_STREAM spilled 1232 bytes."""
        return max(16, block_n // 2)

    def check_launch(self, q: torch.Tensor, kv_cache: torch.Tensor,
                     kv_scale: torch.Tensor | None, *, kv_lora_rank: int,
                     qk_rope_dim: int) -> None:
        self.check_rows(kv_cache, kv_lora_rank=kv_lora_rank, qk_rope_dim=qk_rope_dim)
        self.check_dtypes(q, kv_cache, kv_scale)

    def check_rows(self, kv_cache: torch.Tensor, *, kv_lora_rank: int,
                   qk_rope_dim: int) -> None:
        """[num_pages, page_size, 656] for 512 latent and 64 rope values, 16-byte aligned
        rows (the kernels read float32 scales and bf16 rope through reinterpreted
        pointers)."""
        if kv_cache.dim() != 3 or kv_cache.shape[2] != V32_BYTES:
            _fail("kv_cache.shape", f"uint8 {tuple(kv_cache.shape)}",
                  f"[num_pages, page_size, {V32_BYTES}] for a uint8 cache",
                  f"A uint8 cache is DeepSeek-V3.2's fp8 format, {V32_BYTES} bytes per token "
                  f"({V32_LATENT} e4m3 latent, {V32_GROUPS} float32 scales, "
                  f"{V32_ROPE} bf16 rope; graphbucket.fp8.pack_v32); a per-tensor fp8 "
                  "cache is torch.float8_e4m3fn.")
        if (kv_lora_rank, qk_rope_dim) != (V32_LATENT, V32_ROPE):
            _fail("plan", f"kv_lora_rank={kv_lora_rank}, qk_rope_dim={qk_rope_dim}",
                  f"{V32_LATENT} and {V32_ROPE} for a V3.2 (uint8) cache",
                  "The V3.2 layout is fixed: 512 latent and 64 rope values per token.")
        if kv_cache.stride(0) % 16 or kv_cache.stride(1) % 16 or kv_cache.data_ptr() % 16:
            _fail("kv_cache strides", f"{kv_cache.stride()[:2]} at {kv_cache.data_ptr() % 16} "
                  "bytes past a 16-byte boundary", "multiples of 16 bytes, 16-byte aligned",
                  "Pass a contiguous V3.2 cache (656-byte rows).")

    def check_dtypes(self, q: torch.Tensor, kv_cache: torch.Tensor,
                     kv_scale: torch.Tensor | None) -> None:
        """A bf16 / fp16 q and no scale (the scales are in every row)."""
        if q.dtype not in FP8_Q_DTYPES:
            _fail("dtypes", f"q={q.dtype}, kv_cache={kv_cache.dtype}", "bf16 or fp16 q",
                  "A V3.2 fp8 (uint8) cache is attended with a bfloat16 or float16 q.")
        if kv_scale is not None:
            _fail("kv_scale", "a tensor", "None for a V3.2 (uint8) cache",
                  "A V3.2 cache carries its scales in every row (4 per token).")


# The first format is the default (unquantized) one; ``cache_format_of`` reads any dtype
# that no format stores as it.
CACHE_FORMATS: dict[str, CacheFormat] = {f.name: f for f in (
    CacheFormat("bf16", "none", "dense", UNQUANTIZED_DTYPES),
    PerTensorFp8("fp8-tensor", "per-tensor", "dense", (FP8_DTYPE,)),
    V32Fp8("fp8-v32", "per-token-group", "v32", (torch.uint8,)),
)}
KV_CACHE_FORMATS = tuple(CACHE_FORMATS)
DEFAULT_FORMAT = KV_CACHE_FORMATS[0]


def per_tensor_names() -> str:
    """The per-tensor formats' names, for messages ("fp8-tensor")."""
    return " / ".join(f.name for f in CACHE_FORMATS.values() if f.scale == "per-tensor")


def get_cache_format(name: str) -> CacheFormat:
    """The format named ``name`` (one of ``KV_CACHE_FORMATS``), else ValueError."""
    fmt = CACHE_FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ValueError(f"kv_cache_format must be one of {KV_CACHE_FORMATS}, got {name!r}")
    return fmt


def check_format(kv_cache_format: str) -> str:
    """``kv_cache_format`` if it names a format (``KV_CACHE_FORMATS``), else ValueError."""
    return get_cache_format(kv_cache_format).name


def format_of_dtype(dtype: torch.dtype) -> CacheFormat:
    """The format a cache of ``dtype`` is read as by the kernels: uint8 -> fp8-v32, e4m3 ->
    fp8-tensor, anything else unquantized."""
    return next((f for f in CACHE_FORMATS.values() if dtype in f.stored_dtypes),
                CACHE_FORMATS[DEFAULT_FORMAT])


def format_of_size(element_size: int, *, v32: bool = False) -> CacheFormat:
    """The format of a cache known only by its element size: V3.2 where ``v32``, else
    per-tensor fp8 at one byte, unquantized above."""
    if v32:
        return format_of_dtype(torch.uint8)
    return format_of_dtype(FP8_DTYPE if element_size == 1 else torch.bfloat16)


def cache_format_of(kv_cache: torch.Tensor) -> CacheFormat:
    """``format_of_dtype`` of a cache tensor."""
    return format_of_dtype(kv_cache.dtype)


def format_of(kv_cache: torch.Tensor) -> str:
    """The name of the format a cache's dtype means to the kernels (``cache_format_of``)."""
    return cache_format_of(kv_cache).name


def cache_row(kv_cache_format: str, kv_dim: int, dtype: torch.dtype
              ) -> tuple[int, torch.dtype]:
    """(row width, element dtype) of a cache of this format for ``kv_dim``-wide rows of a
    ``dtype`` model: (kv_dim, dtype), (kv_dim, e4m3) or (656, uint8)."""
    return get_cache_format(kv_cache_format).cache_row(kv_dim, dtype)


def row_bytes(kv_cache_format: str, kv_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's row in one layer's cache (bf16 576-wide: 1152, 576, 656)."""
    return get_cache_format(kv_cache_format).row_bytes(kv_dim, dtype)


def check_cache(kv_cache: torch.Tensor, kv_cache_format: str, kv_scale: torch.Tensor | None,
                *, kv_dim: int) -> None:
    """``CacheFormat.check_cache`` of the named format."""
    get_cache_format(kv_cache_format).check_cache(kv_cache, kv_scale, kv_dim=kv_dim)


def as_stored(rows: torch.Tensor, kv_cache_format: str, kv_scale: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Rows [..., kv_dim] as a cache of this format gives them back: quantized and
    dequantized (fp8), else unchanged; in ``dtype`` (the float reference's store)."""
    return get_cache_format(kv_cache_format).as_stored(rows, kv_scale, dtype)


def dequantize_cache(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None = None,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A whole cache of any format as values [num_pages, page_size, kv_dim] in ``dtype``
    (a copy; the format from the cache's dtype, ``cache_format_of``)."""
    return cache_format_of(kv_cache).dequantize(kv_cache, kv_scale, dtype)
