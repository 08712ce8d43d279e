"""Fused Triton helpers of the MLA decoder: RMSNorm (+residual), latent-cache store, query
assembly, SwiGLU gate. One program per row (or per row and head); fp32 math, model dtype out.

They exist to keep a decode step at ~16 kernels per layer: a graph replays every kernel
with a few microseconds of dependency latency, and at short contexts those add up to
more than the weights take to stream.

Graph safety: every launcher reads tensor metadata only (shapes, strides) and launches a
fixed grid; masks, lengths and slots are read on the device. Nothing allocates except the
returned outputs (which a captured forward allocates from the graph's pool).

Rotary embedding: half-split ("neox") pairs (x[i], x[i + P/2]) with a precomputed fp32
table ``rope_cache [max_position, P]`` = cos | sin. DeepSeek's checkpoints pair adjacent
channels instead; that is a fixed permutation of the rope channels and costs the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphbucket import fp8
from graphbucket.token_rows import rope_row, token_slot


def rope_cache(rope_dim: int, max_position: int, theta: float, *,
               device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[max_position, rope_dim] table: cos of each half-pair angle, then its sin (fp64 math)."""
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device=device, dtype=dtype)


@triton.jit
def _rms_norm_kernel(X, DELTA, RES, OUT, W, stride_x, stride_d, stride_r, stride_o, n, eps,
                     BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x += tl.load(DELTA + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(RES + row * stride_r + offs, x.to(RES.dtype.element_ty), mask=mask)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + offs, (x * inv * w).to(OUT.dtype.element_ty), mask=mask)


def _norm_launch(x, delta, res, out, weight, eps):
    n = x.shape[1]
    assert x.stride(1) == 1 and out.stride(1) == 1 and weight.numel() == n, "rows must be dense"
    block = triton.next_power_of_2(n)
    d, r = (delta, res) if delta is not None else (x, x)
    _rms_norm_kernel[(x.shape[0],)](x, d, r, out, weight, x.stride(0), d.stride(0),
                                    r.stride(0), out.stride(0), n, eps, BLOCK=block,
                                    HAS_DELTA=delta is not None,
                                    num_warps=8 if block >= 4096 else 4)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [B, N] (rows may be strided) -> new dense [B, N]."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm_launch(x, None, None, out, weight, eps)
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)) for x, delta [B, N]: the residual add fused in."""
    res = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty_like(res)
    _norm_launch(x, delta, res, out, weight, eps)
    return res, out


@triton.jit
def _rotate(src, cs_row, offs_h, HALF: tl.constexpr, mask):
    x1 = tl.load(src + offs_h, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs_h, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cs_row + offs_h, mask=mask, other=0.0)
    s = tl.load(cs_row + HALF + offs_h, mask=mask, other=0.0)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _kv_store_kernel(KV, W, ROPE, POS, SLOT, SEQ_LENS, CACHE, KV_SCALE, stride_kv, stride_rope,
                     stride_page, stride_tok, num_slots, max_pos, eps, q_len,
                     R: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_H: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     SCALED: tl.constexpr = False, FP8_MAX: tl.constexpr = 448.0,
                     V32: tl.constexpr = False, V32_GROUP: tl.constexpr = 128,
                     V32_MIN_SCALE: tl.constexpr = 2.0 ** -126):
    b = tl.program_id(0)
    slot, valid = token_slot(SLOT, SEQ_LENS, b, q_len, num_slots)
    slot = tl.where(valid, slot, 0)  # address arithmetic only; every store is masked
    offs_r = tl.arange(0, BLOCK_R)
    offs_h = tl.arange(0, BLOCK_H)
    mask_r = offs_r < R
    mask_h = offs_h < HALF
    lat = tl.load(KV + b * stride_kv + offs_r, mask=mask_r, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(lat * lat, axis=0) / R + eps)
    lat = lat * inv * tl.load(W + offs_r, mask=mask_r, other=0.0).to(tl.float32)
    k1, k2 = _rotate(KV + b * stride_kv + R, rope_row(ROPE, POS, b, stride_rope, max_pos),
                     offs_h, HALF, mask_h)
    row = CACHE + (slot // PAGE_SIZE) * stride_page + (slot % PAGE_SIZE) * stride_tok
    if V32:
        # DeepSeek-V3.2 row in a uint8 cache (graphbucket.fp8: R = 512 is a power of two,
        # strides in bytes): per group of 128, scale = max(amax / 448, 2^-126); e4m3 latent
        # at byte 0, float32 scales at byte R, bf16 rope after them. Round-to-nearest
        # divisions, as torch divides in pack_v32.
        GROUPS: tl.constexpr = R // V32_GROUP
        groups = tl.reshape(lat, [GROUPS, V32_GROUP])
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(groups), axis=1), FP8_MAX),
                           V32_MIN_SCALE)
        stored = tl.math.div_rn(groups, tl.broadcast_to(scale[:, None], [GROUPS, V32_GROUP]))
        stored = tl.reshape(tl.minimum(tl.maximum(stored, -FP8_MAX), FP8_MAX), [R])
        offs_g = tl.arange(0, GROUPS)
        tl.store(row.to(tl.pointer_type(tl.float8e4nv)) + offs_r, stored.to(tl.float8e4nv),
                 mask=tl.where(valid, mask_r, False))
        tl.store((row + R).to(tl.pointer_type(tl.float32)) + offs_g, scale,
                 mask=tl.where(valid, offs_g < GROUPS, False))
        rope = (row + R + 4 * GROUPS).to(tl.pointer_type(tl.bfloat16))
        tl.store(rope + offs_h, k1.to(tl.bfloat16), mask=tl.where(valid, mask_h, False))
        tl.store(rope + HALF + offs_h, k2.to(tl.bfloat16), mask=tl.where(valid, mask_h, False))
    else:
        ty = CACHE.dtype.element_ty
        if SCALED:  # fp8 cache: value / scale, saturated (graphbucket.fp8's rule)
            inv_scale = 1.0 / tl.load(KV_SCALE)
            lat = tl.minimum(tl.maximum(lat * inv_scale, -FP8_MAX), FP8_MAX)
            k1 = tl.minimum(tl.maximum(k1 * inv_scale, -FP8_MAX), FP8_MAX)
            k2 = tl.minimum(tl.maximum(k2 * inv_scale, -FP8_MAX), FP8_MAX)
        # tl.where, not `mask & valid`: the interpreter makes a block & scalar bool int32,
        # which its store rejects from Triton 3.9 on.
        tl.store(row + offs_r, lat.to(ty), mask=tl.where(valid, mask_r, False))
        tl.store(row + R + offs_h, k1.to(ty), mask=tl.where(valid, mask_h, False))
        tl.store(row + R + HALF + offs_h, k2.to(ty), mask=tl.where(valid, mask_h, False))


def store_kv(kv_a: torch.Tensor, norm_weight: torch.Tensor, rope: torch.Tensor,
             positions: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
             kv_cache: torch.Tensor, eps: float, kv_scale: torch.Tensor | None = None,
             q_len: int = 1, *, kv_cache_format: str | None = None) -> None:
    """Write each row's [RMSNorm(latent) | rotary(k_rope)] into ``kv_cache`` at its slot, in
    the cache's format (``graphbucket.fp8``): as they are ("bf16"), quantized with
    ``kv_scale`` ("fp8-tensor") or as DeepSeek-V3.2 rows with per-token group scales
    ("fp8-v32", a uint8 cache [num_pages, page_size, 656]).

    kv_a [T, R + P] (rows may be strided), positions [T] int64, slot_mapping [T] int64
    (page * page_size + offset), seq_lens [T / q_len] int32, kv_cache [num_pages,
    page_size, width]: T = B x q_len rows, q_len new tokens per request (row b * q_len + j
    is request b's token j, stored at its own slot in every format). ``kv_cache_format``
    is the format the caller declares (default: the one the cache's dtype means); the
    cache and scale are checked against it before launch. Rows whose slot is negative or
    past the cache, or whose request's seq_len is 0 (padding), write nothing. Graph-safe:
    host metadata checks; the skip is a device-side mask.
    """
    num_pages, page_size, _ = kv_cache.shape
    r, dim = norm_weight.numel(), kv_a.shape[1]
    half = (dim - r) // 2
    fmt = fp8.get_cache_format(kv_cache_format or fp8.format_of(kv_cache))
    fmt.check_cache(kv_cache, kv_scale, kv_dim=dim)
    assert kv_a.stride(1) == 1 and kv_cache.stride(2) == 1, "rows must be dense"
    v32 = fmt.kernel_tag == "v32"  # the store kernel's V3.2 variant
    if v32 and (r, dim - r) != (fp8.V32_LATENT, fp8.V32_ROPE):
        raise ValueError(f"an {fmt.name} cache stores {fp8.V32_LATENT} latent and {fp8.V32_ROPE} "
                         f"rope values, got {r} and {dim - r}")
    if v32 and (kv_cache.stride(0) % 16 or kv_cache.stride(1) % 16 or kv_cache.data_ptr() % 16):
        raise ValueError(f"an {fmt.name} cache needs 16-byte aligned rows (float32 scales), got "
                         f"strides {kv_cache.stride()[:2]}; pass a contiguous cache")
    _kv_store_kernel[(kv_a.shape[0],)](
        kv_a, norm_weight, rope, positions, slot_mapping, seq_lens, kv_cache,
        seq_lens if kv_scale is None else kv_scale, kv_a.stride(0),
        rope.stride(0), kv_cache.stride(0), kv_cache.stride(1), num_pages * page_size,
        rope.shape[0], eps, q_len, R=r, HALF=half, BLOCK_R=triton.next_power_of_2(r),
        BLOCK_H=triton.next_power_of_2(half), PAGE_SIZE=page_size,
        SCALED=kv_scale is not None, V32=v32, num_warps=4)


@triton.jit
def _q_assemble_kernel(QL, QB, ROPE, POS, Q, stride_ql_h, stride_ql_b, stride_qb, stride_q_b,
                       stride_q_h, stride_rope, max_pos,
                       R: tl.constexpr, HALF: tl.constexpr, NOPE: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_R)
    offs_h = tl.arange(0, BLOCK_H)
    mask_r = offs_r < R
    mask_h = offs_h < HALF
    q = Q + b * stride_q_b + h * stride_q_h
    lat = tl.load(QL + h * stride_ql_h + b * stride_ql_b + offs_r, mask=mask_r, other=0.0)
    tl.store(q + offs_r, lat.to(Q.dtype.element_ty), mask=mask_r)
    src = QB + b * stride_qb + h * HEAD_DIM + NOPE
    q1, q2 = _rotate(src, rope_row(ROPE, POS, b, stride_rope, max_pos), offs_h, HALF, mask_h)
    tl.store(q + R + offs_h, q1.to(Q.dtype.element_ty), mask=mask_h)
    tl.store(q + R + HALF + offs_h, q2.to(Q.dtype.element_ty), mask=mask_h)


def assemble_q(q_latent: torch.Tensor, q_b: torch.Tensor, rope: torch.Tensor,
               positions: torch.Tensor, *, nope_dim: int) -> torch.Tensor:
    """The MLA kernel's query [B, H, R + P]: absorbed latent, then the roped rope part.

    q_latent [H, B, R] (the W_UK bmm's output), q_b [B, H * (nope + P)] (q_b's output;
    per head the nope part then the rope part), positions [B] int64. Graph-safe.
    """
    heads, batch, r = q_latent.shape
    head_dim = q_b.shape[1] // heads
    half = (head_dim - nope_dim) // 2
    q = torch.empty(batch, heads, r + 2 * half, dtype=q_latent.dtype, device=q_latent.device)
    assert q_latent.stride(2) == 1 and q_b.stride(1) == 1
    _q_assemble_kernel[(batch, heads)](
        q_latent, q_b, rope, positions, q, q_latent.stride(0), q_latent.stride(1),
        q_b.stride(0), q.stride(0), q.stride(1), rope.stride(0), rope.shape[0],
        R=r, HALF=half, NOPE=nope_dim, HEAD_DIM=head_dim, BLOCK_R=triton.next_power_of_2(r),
        BLOCK_H=triton.next_power_of_2(half), num_warps=4)
    return q


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_gu, stride_o, n, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(GU + b * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + b * stride_gu + n + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + b * stride_o + offs, (g * tl.sigmoid(g) * u).to(OUT.dtype.element_ty),
             mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate: gate_up [B, 2 * I] (gate, then up) -> silu(gate) * up [B, I]."""
    batch, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(batch, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(batch, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0),
                                                      out.stride(0), n, BLOCK=block)
    return out
