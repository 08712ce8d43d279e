"""fp8 latent caches: the scale rules, quantize / dequantize and pack / unpack (torch ops).

Two formats. Per-tensor (``quantize`` / ``dequantize``) and DeepSeek-V3.2's per-token
groups (``pack_v32`` / ``unpack_v32``). By name (``KV_CACHE_FORMATS``, what the model, the
buffer spec, the benchmarks and the tuner take): "bf16" (unquantized, the model's dtype),
"fp8-tensor" and "fp8-v32"; ``cache_row`` / ``row_bytes`` give a format's row,
``check_cache`` checks a cache and scale against it, ``as_stored`` / ``dequantize_cache``
are what the float reference stores and reads.

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


# ---- cache formats by name ------------------------------------------------------------------

# "bf16": unquantized rows in the model's dtype (bf16 in every benchmark; the CPU tests'
# fp16 / fp32 models keep theirs); "fp8-tensor" and "fp8-v32": the module docstring.
KV_CACHE_FORMATS = ("bf16", "fp8-tensor", "fp8-v32")


def check_format(kv_cache_format: str) -> str:
    """``kv_cache_format`` if it names a format (``KV_CACHE_FORMATS``), else ValueError."""
    if kv_cache_format not in KV_CACHE_FORMATS:
        raise ValueError(f"kv_cache_format must be one of {KV_CACHE_FORMATS}, got "
                         f"{kv_cache_format!r}")
    return kv_cache_format


def cache_row(kv_cache_format: str, kv_dim: int, dtype: torch.dtype
              ) -> tuple[int, torch.dtype]:
    """(row width, element dtype) of a cache of this format for ``kv_dim``-wide rows of a
    ``dtype`` model: (kv_dim, dtype), (kv_dim, e4m3) or (656, uint8)."""
    check_format(kv_cache_format)
    if kv_cache_format == "bf16":
        return kv_dim, dtype
    if kv_cache_format == "fp8-tensor":
        return kv_dim, FP8_DTYPE
    if kv_dim != V32_LATENT + V32_ROPE:
        raise ValueError(f"the fp8-v32 format holds {V32_LATENT} latent and {V32_ROPE} rope "
                         f"values per token (kv_dim {V32_LATENT + V32_ROPE}), got kv_dim "
                         f"{kv_dim}; use fp8-tensor for other shapes")
    return V32_BYTES, torch.uint8


def row_bytes(kv_cache_format: str, kv_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's row in one layer's cache (bf16 576-wide: 1152, 576, 656)."""
    width, elt = cache_row(kv_cache_format, kv_dim, dtype)
    return width * elt.itemsize


def format_of(kv_cache: torch.Tensor) -> str:
    """The format a cache's dtype means to the kernels: uint8 -> fp8-v32, e4m3 ->
    fp8-tensor, anything else unquantized ("bf16")."""
    if kv_cache.dtype == torch.uint8:
        return "fp8-v32"
    return "fp8-tensor" if kv_cache.dtype == FP8_DTYPE else "bf16"


UNQUANTIZED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_cache(kv_cache: torch.Tensor, kv_cache_format: str, kv_scale: torch.Tensor | None,
                *, kv_dim: int) -> None:
    """A cache [num_pages, page_size, width] and scale that hold ``kv_cache_format`` rows
    ``kv_dim`` values wide (host metadata only, no sync), else ValueError naming the
    received and expected values. "bf16" is any unquantized float cache (bf16, fp16,
    fp32); fp8-tensor takes a float32 [1] ``kv_scale`` on the cache's device; the other
    formats take none."""
    width, elt = cache_row(kv_cache_format, kv_dim, kv_cache.dtype)
    if kv_cache_format == "bf16" and elt not in UNQUANTIZED_DTYPES:
        elt = torch.bfloat16  # an fp8 / uint8 cache declared unquantized: name the usual one
    if kv_cache.dim() != 3 or kv_cache.dtype != elt or kv_cache.shape[2] != width:
        raise ValueError(f"the {kv_cache_format} format needs a {elt} cache [num_pages, "
                         f"page_size, {width}], got {kv_cache.dtype} {tuple(kv_cache.shape)}. "
                         "Allocate it for the "
                         f"declared format (graphbucket.fp8.cache_row) or declare the format "
                         f"it holds ({format_of(kv_cache)})")
    if kv_cache_format != "fp8-tensor":
        if kv_scale is not None:
            raise ValueError(f"kv_scale: got a tensor, expected None for a {kv_cache_format} "
                             "cache (only fp8-tensor takes a per-tensor scale)")
        return
    if not isinstance(kv_scale, torch.Tensor) or kv_scale.dtype != torch.float32 \
            or tuple(kv_scale.shape) != (1,) or kv_scale.device != kv_cache.device:
        got = None if not isinstance(kv_scale, torch.Tensor) else \
            f"{kv_scale.dtype} {tuple(kv_scale.shape)} on {kv_scale.device}"
        raise ValueError(f"kv_scale: got {got}, expected float32 [1] on {kv_cache.device}. "
                         "An fp8-tensor cache needs its scale (value = stored x kv_scale, "
                         "e.g. graphbucket.fp8.scale_for(amax))")


def as_stored(rows: torch.Tensor, kv_cache_format: str, kv_scale: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Rows [..., kv_dim] as a cache of this format gives them back: quantized and
    dequantized (fp8), else unchanged; in ``dtype`` (the float reference's store)."""
    check_format(kv_cache_format)
    if kv_cache_format == "fp8-tensor":
        return dequantize(quantize(rows, kv_scale.to(rows.device)), kv_scale, dtype)
    if kv_cache_format == "fp8-v32":
        return unpack_v32(pack_v32(rows.float())).to(dtype)
    return rows.to(dtype)


def dequantize_cache(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None = None,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A whole cache of any format as values [num_pages, page_size, kv_dim] in ``dtype``
    (a copy; the format from the cache's dtype, ``format_of``)."""
    kind = format_of(kv_cache)
    if kind == "fp8-v32":
        return unpack_v32(kv_cache).to(dtype)
    if kind == "fp8-tensor":
        return dequantize(kv_cache, kv_scale, dtype)
    return kv_cache.to(dtype, copy=True)
