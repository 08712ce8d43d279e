"""fp8 latent caches: the scale rules, quantize / dequantize and pack / unpack (torch ops).

Two formats. Per-tensor (``quantize`` / ``dequantize``) and DeepSeek-V3.2's per-token
groups (``pack_v32`` / ``unpack_v32``).

Per-tensor format ("fp8-tensor"): every 576-wide cache row (latent then rope) in ``float8_e4m3fn``,
576 bytes per token, and one float32 scale for the whole cache, on the device:
``value = stored * kv_scale``. Storing rounds ``value / kv_scale`` to the nearest e4m3
number (torch's cast) after saturating at +-448, e4m3's largest finite value (the format
has no infinity). A calibrated scale is ``amax / 448`` over the values the cache will
hold (``scale_for``); the decode kernels read fp8 tiles, convert them to q's dtype and
apply the scale once to the scores and once to the output.

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
decode kernels read a V3.2 cache directly: the latent tile as e4m3, times its group's
scale, in q's dtype; the rope in bf16.
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
