"""One transformers DeepSeek attention layer as graphbucket's absorbed latent path.

transformers' ``DeepseekV3Attention`` (and V3.2's) expands the cached latent with
``kv_b_proj`` into per-head keys and values and runs full attention. Decode here keeps the
latent, as an engine does when it loads the checkpoint: ``kv_b_proj`` [H x (nope + v), R]
is split per head into W_UK [H, nope, R], folded into the query (q_nope @ W_UK), and
W_UV [H, R, v], applied after attention; the kernel attends over [R + P] cache rows
(``ctx.attend``), with the module's softmax scale (qk_head_dim^-0.5, times mscale^2 under
yarn: ``softmax_scale``).

Rope layout: with ``config.rope_interleave`` transformers rotates adjacent pairs (x0, x1),
(x2, x3), ... and returns them de-interleaved (rotated evens, then rotated odds): the
half-split layout graphbucket's kernels rotate. With the rope rows of q_b and kv_a
permuted to evens-then-odds (``rope_channel_order``), the kernels' half-split rotation
gives transformers' values, and the latent cache rows are laid out as transformers' own
cache holds them ([normed latent | roped key]).

The rope table (``rope_table``) is the model's own rotary embedding (rope type, yarn
frequencies, attention factor) evaluated once at every position.

Graph safety: the decode helpers launch fixed-shape torch ops and graphbucket's store /
query kernels; positions, slots and lengths are read on the device only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from graphbucket.context import DecodeContext
from graphbucket.models.ops import assemble_q, store_kv

# Rope types whose frequencies change with the sequence length: a table computed once
# cannot hold them.
SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")
SLOT_INPUT = "slot_mapping"


def rope_channel_order(rope_dim: int, interleaved: bool) -> torch.Tensor:
    """The order of a head's rope channels that makes transformers' rotation half-split:
    evens then odds for interleaved pairs, else as they are."""
    if not interleaved:
        return torch.arange(rope_dim)
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def softmax_scale(attention: nn.Module) -> float:
    """The attention's softmax scale, as the module computed it from the config."""
    return float(attention.scaling)


def absorb_kv_b(kv_b_weight: torch.Tensor, num_heads: int, nope_dim: int, v_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight [H * (nope + v), R] -> (W_UK [H, nope, R], W_UV [H, R, v])."""
    per_head = kv_b_weight.view(num_heads, nope_dim + v_dim, -1)
    return (per_head[:, :nope_dim].contiguous(),
            per_head[:, nope_dim:].transpose(1, 2).contiguous())


def rope_table(rotary_emb: nn.Module, max_position: int, *, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """float32 [max_position, P]: the cos of each pair's angle, then its sin, from the
    model's rotary embedding, rounded to ``dtype`` as transformers rounds them."""
    rope_type = str(getattr(rotary_emb, "rope_type", "default"))
    if any(kind in rope_type for kind in SEQUENCE_DEPENDENT_ROPE):
        raise ValueError(f"rope_type {rope_type!r} changes its frequencies with the sequence "
                         "length, which one table per model cannot follow; use a model with "
                         "'default' or 'yarn' rope")
    positions = torch.arange(max_position, device=device)[None]
    probe = torch.empty(0, dtype=dtype, device=device)  # read for its device and dtype only
    with torch.no_grad():
        cos, sin = rotary_emb(probe, positions)
    half = cos.shape[-1] // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).float().contiguous()


@dataclass(frozen=True, slots=True)
class LatentAttention:
    """One layer's absorbed decode weights (D hidden, H heads, Q q_lora_rank, R latent,
    P rope), derived from a transformers DeepSeek attention module, whose q_a_proj,
    q_a_layernorm, kv_a_layernorm and o_proj run as they are.

    w_q [H * (nope + P), Q] (q_b_proj's, or q_proj's [.., D]) and w_kv_a [R + P, D]
    (+ b_kv_a) have their rope rows in half-split order; w_uk [H, nope, R], w_uv [H, R, v].
    """

    module: nn.Module
    w_q: torch.Tensor
    w_kv_a: torch.Tensor
    b_kv_a: torch.Tensor | None
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    sm_scale: float

    @classmethod
    def from_module(cls, attention: nn.Module, *, interleaved: bool) -> LatentAttention:
        heads, nope = attention.num_heads, attention.qk_nope_head_dim
        rope, latent = attention.qk_rope_head_dim, attention.kv_lora_rank
        order = rope_channel_order(rope, interleaved).to(attention.kv_b_proj.weight.device)
        with torch.no_grad():
            q_proj = attention.q_b_proj if attention.q_lora_rank is not None else attention.q_proj
            w_q = q_proj.weight.view(heads, nope + rope, -1)
            w_q = torch.cat([w_q[:, :nope], w_q[:, nope:][:, order]], dim=1)
            kv_a = attention.kv_a_proj_with_mqa
            rows = torch.cat([torch.arange(latent, device=order.device), latent + order])
            bias = None if kv_a.bias is None else kv_a.bias.detach()[rows].contiguous()
            w_uk, w_uv = absorb_kv_b(attention.kv_b_proj.weight.detach(), heads, nope,
                                     attention.v_head_dim)
            return cls(attention, w_q.reshape(heads * (nope + rope), -1).detach().contiguous(),
                       kv_a.weight.detach()[rows].contiguous(), bias, w_uk, w_uv,
                       softmax_scale(attention))

    @property
    def num_heads(self) -> int:
        return self.w_uk.shape[0]

    def query_input(self, h: torch.Tensor) -> torch.Tensor:
        """What w_q projects: RMSNorm(q_a_proj(h)) [T, Q] (V3.2's indexer reads it too),
        or h itself for a model without q_lora_rank."""
        m = self.module
        if m.q_lora_rank is None:
            return h
        return m.q_a_layernorm(m.q_a_proj(h))

    def store_latent(self, h: torch.Tensor, rope: torch.Tensor, ctx: DecodeContext,
                     cache: torch.Tensor) -> None:
        """[kv_a_layernorm(latent) | rotary(k_rope)] of each new token into its cache slot
        (padding rows store nothing: ``models.ops.store_kv``)."""
        norm = self.module.kv_a_layernorm
        store_kv(F.linear(h, self.w_kv_a, self.b_kv_a), norm.weight, rope, ctx.positions,
                 ctx.inputs[SLOT_INPUT], ctx.seq_lens, cache, norm.variance_epsilon,
                 q_len=ctx.q_len)

    def query(self, q_in: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor
              ) -> torch.Tensor:
        """The kernel's query [T, H, R + P]: q_nope @ W_UK, then the roped rope part."""
        nope = self.w_uk.shape[1]
        q = F.linear(q_in, self.w_q)                               # [T, H * (nope + P)]
        q_nope = q.view(q.shape[0], self.num_heads, -1)[..., :nope]
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk)    # [H, T, R]
        return assemble_q(q_latent, q, rope, positions, nope_dim=nope)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """attn [T, H, R] (softmax-weighted latents) -> o_proj(attn @ W_UV) [T, D]."""
        o = torch.bmm(attn.transpose(0, 1), self.w_uv)             # [H, T, v]
        return self.module.o_proj(o.transpose(0, 1).reshape(attn.shape[0], -1))
