"""Per-tensor fp8 latent cache: the scale rule, quantize and dequantize (torch ops).

Format ("fp8-tensor"): every 576-wide cache row (latent then rope) in ``float8_e4m3fn``,
576 bytes per token, and one float32 scale for the whole cache, on the device:
``value = stored * kv_scale``. Storing rounds ``value / kv_scale`` to the nearest e4m3
number (torch's cast) after saturating at +-448, e4m3's largest finite value (the format
has no infinity). A calibrated scale is ``amax / 448`` over the values the cache will
hold (``scale_for``); the decode kernels read fp8 tiles, convert them to q's dtype and
apply the scale once to the scores and once to the output.
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
