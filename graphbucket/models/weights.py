"""Seeded random weights for ``MLADecoder`` (nothing is downloaded).

Every matrix is drawn N(0, 1/fan_in), so a product with an O(1) input stays O(1); the
RMSNorms in front of every block keep activations O(1) through any number of layers.
Linear weights are stored ``[out_features, in_features]`` as ``torch.nn.functional.linear``
expects; the absorbed MLA matrices are per head: ``w_uk [H, qk_nope, kv_lora_rank]`` maps a
query's nope part into the latent space, ``w_uv [H, kv_lora_rank, v_head]`` maps the
attention output back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from graphbucket.models.config import MLAConfig


@dataclass(slots=True)
class MLALayerWeights:
    """One decoder layer (shapes for hidden D, heads H, q_lora Q, latent R + rope P)."""

    attn_norm: torch.Tensor   # [D]
    w_qkv_a: torch.Tensor     # [Q + R + P, D]: q_a and kv_a fused, one read of the input
    q_a_norm: torch.Tensor    # [Q]
    w_q_b: torch.Tensor       # [H * (nope + P), Q]
    kv_a_norm: torch.Tensor   # [R]
    w_uk: torch.Tensor        # [H, nope, R]
    w_uv: torch.Tensor        # [H, R, v_head]
    w_o: torch.Tensor         # [D, H * v_head]
    mlp_norm: torch.Tensor    # [D]
    w_gate_up: torch.Tensor   # [2 * I, D]: gate rows first, then up
    w_down: torch.Tensor      # [D, I]

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def to(self, dtype: torch.dtype) -> MLALayerWeights:
        return MLALayerWeights(*(t.to(dtype) for t in self.tensors()))


class WeightDraw:
    """Seeded random weights on one device and dtype (scaled by fan-in), drawn in order."""

    def __init__(self, seed: int, device: torch.device, dtype: torch.dtype) -> None:
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.device, self.dtype = device, dtype

    def matrix(self, *shape: int, fan_in: int) -> torch.Tensor:
        w = torch.randn(*shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return w.mul_(1.0 / math.sqrt(fan_in)).to(self.dtype)

    def norm(self, n: int) -> torch.Tensor:
        w = torch.randn(n, generator=self.gen, device=self.device, dtype=torch.float32)
        return w.mul_(0.1).add_(1.0).to(self.dtype)


def random_layer(cfg: MLAConfig, draw: WeightDraw) -> MLALayerWeights:
    d, h, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
    return MLALayerWeights(
        attn_norm=draw.norm(d),
        w_qkv_a=draw.matrix(cfg.q_lora_rank + cfg.kv_dim, d, fan_in=d),
        q_a_norm=draw.norm(cfg.q_lora_rank),
        w_q_b=draw.matrix(h * cfg.qk_head_dim, cfg.q_lora_rank, fan_in=cfg.q_lora_rank),
        kv_a_norm=draw.norm(r),
        w_uk=draw.matrix(h, cfg.qk_nope_dim, r, fan_in=cfg.qk_nope_dim),
        w_uv=draw.matrix(h, r, cfg.v_head_dim, fan_in=r),
        w_o=draw.matrix(d, h * cfg.v_head_dim, fan_in=h * cfg.v_head_dim),
        mlp_norm=draw.norm(d),
        w_gate_up=draw.matrix(2 * cfg.intermediate_size, d, fan_in=d),
        w_down=draw.matrix(d, cfg.intermediate_size, fan_in=cfg.intermediate_size),
    )


def random_weights(cfg: MLAConfig, *, seed: int, device: torch.device | str,
                   dtype: torch.dtype) -> tuple[list[MLALayerWeights], torch.Tensor]:
    """(per-layer weights, final norm weight [D]) drawn from one seeded generator on
    ``device`` (the same seed gives the same weights on the same device type)."""
    draw = WeightDraw(seed, torch.device(device), dtype)
    layers = [random_layer(cfg, draw) for _ in range(cfg.num_layers)]
    return layers, draw.norm(cfg.hidden_size)
