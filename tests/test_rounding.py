"""The arithmetic round-to-nearest-even casts of ``graphbucket.sparse.rounding`` against
torch's casts, bit for bit (interpreter on the CPU, compiled on the GPU)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphbucket.fp8 import FP8_DTYPE
from graphbucket.sparse.rounding import round_to_e4m3


@triton.jit
def _to_e4m3_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + offs, mask=mask, other=0.0)
    tl.store(Y + offs, round_to_e4m3(x).to(tl.float8e4nv), mask=mask)


def test_round_to_e4m3_matches_torch_bit_for_bit(device, seeded):
    e4m3 = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    finite = e4m3[torch.isfinite(e4m3)]
    # every code, the midpoints between neighbours (ties), values that round to zero from
    # either side (-0 included), and random magnitudes across the range
    ordered = finite.unique()
    mids = (ordered[1:] + ordered[:-1]) / 2
    tiny = torch.tensor([0.0, -0.0, 1e-8, -1e-8, 2.0 ** -10, -(2.0 ** -10), 2.0 ** -11,
                         -(2.0 ** -11), 3 * 2.0 ** -11, -3 * 2.0 ** -11])
    rand = (torch.rand(4096) * 2 - 1) * 448 * torch.rand(4096) ** 6
    x = torch.cat([finite, mids, tiny, rand]).clamp(-448, 448).float().to(device)
    got = torch.empty(x.shape, dtype=FP8_DTYPE, device=device)
    _to_e4m3_kernel[(triton.cdiv(x.numel(), 1024),)](x, got, x.numel(), BLOCK=1024)
    want = x.to(FP8_DTYPE)
    diff = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero().flatten()
    assert diff.numel() == 0, [(x[i].item(), got[i].float().item(), want[i].float().item())
                               for i in diff[:8].tolist()]
