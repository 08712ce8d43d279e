"""A tiny MLA-shaped decode forward for tests: per layer, a projection to q, paged MLA
decode through ``ctx.attend`` and an output projection with a residual (2 layers)."""

from __future__ import annotations

import math

import numpy as np
import torch

from graphbucket.batch import DecodeBatch
from graphbucket.context import DecodeContext
from graphbucket.ladder import Bucket, BucketLadder
from graphbucket.spec import BufferSpec, InputSpec

HEADS, RANK, ROPE, HIDDEN, PAGE = 16, 64, 16, 32, 16
# Planned on one SM (few splits keep the interpreter quick): bucket 0 plans one split and
# the others more; at batch >= 2 the SM budget caps buckets 1 and 2 alike, so they alias.
NUM_SMS = 1
LADDER = BucketLadder([Bucket(32, 32), Bucket(64, 64), Bucket(320, 320)], 320)


class ToyMLA:
    def __init__(self, *, num_pages: int = 64, num_layers: int = 2, dtype=torch.float32,
                 device="cpu", seed: int = 0, heads: int = HEADS, rank: int = RANK,
                 rope: int = ROPE, hidden: int = HIDDEN, page: int = PAGE) -> None:
        g = torch.Generator().manual_seed(seed)
        d = rank + rope
        self.heads, self.rank, self.d, self.hidden = heads, rank, d, hidden

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)

        self.w_q = [rand(hidden, heads * d, scale=1 / math.sqrt(hidden)) for _ in range(num_layers)]
        self.w_o = [rand(heads * rank, hidden, scale=1 / math.sqrt(heads * rank))
                    for _ in range(num_layers)]
        self.kv = [rand(num_pages, page, d) for _ in range(num_layers)]
        self.calls = 0

    def __call__(self, ctx: DecodeContext) -> torch.Tensor:
        self.calls += 1
        x = ctx.inputs["hidden"]
        bs = x.shape[0]
        for w_q, w_o, kv in zip(self.w_q, self.w_o, self.kv, strict=True):
            q = (x @ w_q).view(bs, self.heads, self.d)
            attn = torch.empty(bs, self.heads, self.rank, dtype=x.dtype, device=x.device)
            ctx.attend(q, kv, attn)
            x = x + attn.view(bs, -1) @ w_o
        return x


def toy_spec(*, max_pages: int = 20, num_pages: int = 64, dtype=torch.float32, device="cpu",
             page: int = PAGE, hidden: int = HIDDEN, heads: int = HEADS) -> BufferSpec:
    return BufferSpec(max_pages_per_seq=max_pages, num_pages=num_pages, page_size=page,
                      num_heads=heads, output_shape=(hidden,), output_dtype=dtype,
                      inputs=(InputSpec("hidden", (hidden,), dtype),), device=device)


def toy_batch(seq_lens, *, rng: np.random.Generator, max_pages: int = 20, num_pages: int = 64,
              dtype=torch.float32, hidden: int = HIDDEN, page: int = PAGE,
              input_device="cpu") -> DecodeBatch:
    """Random block tables (distinct pages per row) and hidden states for ``seq_lens``."""
    bs = len(seq_lens)
    table = np.stack([rng.permutation(num_pages)[:max_pages] for _ in range(bs)])
    cols = max(1, -(-max(seq_lens) // page))
    hidden_states = torch.from_numpy(rng.standard_normal((bs, hidden))).to(dtype)
    return DecodeBatch(list(seq_lens), table[:, :cols].astype(np.int32),
                       {"hidden": hidden_states.to(input_device)})


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def toy_reference(model: ToyMLA, batch: DecodeBatch, *, sm_scale: float,
                  device: str = "cpu") -> torch.Tensor:
    """The toy forward in float64 with ``graphbucket.reference`` attention, on ``device``.

    The reference widens only each request's own pages, so on "cuda" a step against a
    large cache costs milliseconds where copying the cache to the CPU would cost seconds.
    """
    from graphbucket.reference import mla_decode_reference

    x = batch.inputs["hidden"].to(device, torch.float64)
    lens = torch.as_tensor(np.asarray(batch.seq_lens_cpu), dtype=torch.int32)
    table = torch.as_tensor(np.asarray(batch.block_table_cpu)).to(device)
    bs = x.shape[0]
    for w_q, w_o, kv in zip(model.w_q, model.w_o, model.kv, strict=True):
        q = (x @ w_q.to(device, torch.float64)).view(bs, model.heads, model.d)
        out, _ = mla_decode_reference(q, kv.to(device), table, lens,
                                      kv_lora_rank=model.rank, sm_scale=sm_scale)
        x = x + out.reshape(bs, -1) @ w_o.to(device, torch.float64)
    return x
