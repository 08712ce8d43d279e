"""How a bf16 decoder's output moves when its attention is computed another way (CPU).

DeepSeek-V3-shaped decoder (bf16, torch on the CPU) whose MLA attention is emulated in
torch as the Triton kernels compute it in bf16 (fp32 scores, P rounded to bf16 for the
PV dot, fp32 accumulators and partials, fp32 LSE merge, bf16 output), once per partition
of each request's tokens: eager's split-KV plan, the ladder's graph plan, one split, the
balanced plan's chunks; and float64 attention rounded to bf16, with and without a 1e-6
relative perturbation. Each output against the model's float64 forward, against eager
and against the float64-attention variant.

    python3 bench/experiments/bf16_sensitivity.py --seed 0 --lens 9000,300,700,1200,90,2500,400,60
"""

from __future__ import annotations

import argparse

LOG2E = 1.4426950408889634


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunk_attend(torch, q, k, v, start, end, block_n, sm_scale, round_p=True):
    """Online softmax over tokens [start, end) in tiles of block_n, as ``attend.softmax_tile``:
    (normalised out fp32 [H, R], log2 LSE [H])."""
    s = (q @ k[start:end].T) * (sm_scale * LOG2E)
    tiles, pad = cdiv(end - start, block_n), -(end - start) % block_n
    s = torch.nn.functional.pad(s, (0, pad), value=float("-inf")).view(s.shape[0], tiles, -1)
    vt = torch.nn.functional.pad(v[start:end], (0, 0, 0, pad)).view(tiles, block_n, -1)
    m_run = torch.cummax(s.amax(-1), dim=1).values      # the running max after each tile
    p = torch.exp2(s - m_run[:, :, None])
    pv = p.to(torch.bfloat16).float() if round_p else p
    scale = torch.exp2(m_run - m_run[:, -1:])           # the alphas applied since
    acc = (torch.einsum("htn,tnr->htr", pv, vt) * scale[:, :, None]).sum(1)
    l_sum = (p.sum(-1) * scale).sum(1)
    return acc / l_sum[:, None], m_run[:, -1] + torch.log2(l_sum)


def merge(torch, parts):
    outs, lses = torch.stack([o for o, _ in parts]), torch.stack([m for _, m in parts])
    w = torch.exp2(lses - lses.amax(0))
    return (outs * w[:, :, None]).sum(0) / w.sum(0)[:, None]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0, help="weights, cache and input seed")
    p.add_argument("--lens", default="9000,300,700,1200,90,2500,400,60",
                   help="comma-separated context lengths of the batch")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    args = p.parse_args()
    lens = [int(x) for x in args.lens.split(",")]

    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")  # the model's norm and rope kernels, on CPU
    import numpy as np
    import torch

    from graphbucket.kernels.launch import tile_tokens
    from graphbucket.models import (
        MLADecoder,
        decode_batch,
        deepseek_v3_tp8,
        prefill_random,
        random_block_table,
    )
    from graphbucket.plan import plan_balanced_mla_decode, plan_mla_decode

    page, bs = 64, len(lens)
    pages_per = cdiv(max(lens), page)
    model = MLADecoder(deepseek_v3_tp8(args.layers), num_pages=bs * pages_per + 4,
                       page_size=page, dtype=torch.bfloat16, device="cpu", seed=args.seed)
    model._kernel_error = None  # no Triton dot runs here: attention is emulated in torch
    rng = np.random.default_rng(args.seed)
    table = random_block_table(bs, pages_per, model.num_pages, rng)
    prefill_random(model, table, lens, seed=args.seed)
    hidden = torch.from_numpy(rng.standard_normal((bs, model.config.hidden_size))).to(
        torch.bfloat16)
    batch = decode_batch(model, lens, table, hidden)
    heads, sm_scale = model.config.num_heads, model.config.sm_scale

    def split_chunks(plan):
        block_n = tile_tokens(plan, 2)

        def chunks(n):
            per = cdiv(cdiv(n, block_n), plan.num_kv_splits) * block_n
            return [(s, min(s + per, n)) for s in range(0, n, per)], block_n
        return chunks

    def balanced_chunks(plan):
        block_n = tile_tokens(plan, 2)
        total = sum(cdiv(n, block_n) for n in lens)
        size = max(plan.min_chunk_tiles, cdiv(total, plan.persistent_programs)) * block_n
        return lambda n: ([(s, min(s + size, n)) for s in range(0, n, size)], block_n)

    def kernel(chunks, round_p=True):
        def attend(q, kv, b, n):
            r = model.config.kv_lora_rank
            bounds, block_n = chunks(n)
            parts = [chunk_attend(torch, q.float(), kv.float(), kv[:, :r].float(), s0, s1,
                                  block_n, sm_scale, round_p) for s0, s1 in bounds]
            return parts[0][0] if len(parts) == 1 else merge(torch, parts)
        return attend

    def exact(noise=0.0):
        def attend(q, kv, b, n):
            r = model.config.kv_lora_rank
            o = torch.softmax((q.double() @ kv.double().T) * sm_scale, -1) @ kv[:, :r].double()
            g = torch.Generator().manual_seed(b)
            return o * (1 + noise * torch.randn(o.shape, generator=g, dtype=torch.float64))
        return attend

    eager = plan_mla_decode(bs, heads, max(lens))
    variants = {"eager": kernel(split_chunks(eager)),
                "graph": kernel(split_chunks(plan_mla_decode(bs, heads, 16384))),
                "one-split": kernel(split_chunks(plan_mla_decode(bs, heads, 1))),
                "balanced": kernel(balanced_chunks(plan_balanced_mla_decode(bs, heads))),
                "eager exact P": kernel(split_chunks(eager), round_p=False),
                "f64 attention": exact(), "f64 x (1+1e-6 n)": exact(1e-6)}
    caches = [c.clone() for c in model.kv_caches]
    outs = {}
    for name, attend in variants.items():
        for c, c0 in zip(model.kv_caches, caches, strict=True):
            c.copy_(c0)
        outs[name] = model.forward(_Context(batch, attend, page)).clone()
    for c, c0 in zip(model.kv_caches, caches, strict=True):
        c.copy_(c0)
    ref = model.forward_reference(hidden, positions=np.asarray(lens) - 1, seq_lens=lens,
                                  block_table=table, slot_mapping=batch.inputs["slot_mapping"])
    print(f"{model.config.name} {args.layers} layers bf16, lens {lens}, seed {args.seed}")
    for name, out in outs.items():
        print(f"  {name:18s} to float64 {_rel(out, ref):.3e}  to eager "
              f"{_rel(out, outs['eager']):.3e}  to f64 attention "
              f"{_rel(out, outs['f64 attention']):.3e}")


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


class _Context:
    """What ``MLADecoder.forward`` reads of a ``DecodeContext``, with emulated attention."""

    def __init__(self, batch, attend, page: int) -> None:
        import torch

        self.lens = [int(n) for n in batch.seq_lens_cpu]
        self.table = torch.as_tensor(batch.block_table_cpu).long()
        self.seq_lens = torch.as_tensor(batch.seq_lens_cpu).to(torch.int32)
        self.positions = (self.seq_lens.long() - 1).clamp_min(0)
        self.inputs = dict(batch.inputs)
        self.q_len, self._attend, self._page = 1, attend, page

    def attend(self, q, kv_cache, out, lse=None, kv_scale=None):
        for b, n in enumerate(self.lens):
            pages = self.table[b, :cdiv(n, self._page)]
            kv = kv_cache[pages].reshape(-1, kv_cache.shape[-1])[:n]
            out[b] = self._attend(q[b], kv, b, n).to(out.dtype) if n else 0
        return out


if __name__ == "__main__":
    main()
