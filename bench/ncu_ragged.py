"""Eager launches of one ragged step for Nsight Compute to split into kernels: batch 64,
one 131072-token request among 63 of 1024 (``--mix spread-8k``: lengths spread evenly over
1..8192), under each balanced kernel the backend offers (planner, stage 1 and merge are
separate kernels), and the split-KV plan over a uniform batch of about the same tiles (at
128 heads the one-split seesaw) as the per-tile yardstick. Each launched twice; 128 heads,
then 16 (``--heads`` picks).

    ncu --section SpeedOfLight --section LaunchStats python3 bench/ncu_ragged.py [--mix spread-8k]

Nsight Compute locks the SM clock: read the kernels' shares of a step, not its times.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import inputs, random_cache  # noqa: E402
from bench.kernel_sweep import balanced_variants  # noqa: E402
from graphbucket.kernels import SplitWorkspace, default_sm_scale, mla_decode  # noqa: E402
from graphbucket.plan import plan_mla_decode  # noqa: E402

BATCH, LONG, SHORT = 64, 131072, 1024
MIXES = {"long-among-short": [LONG] + [SHORT] * (BATCH - 1),
         "spread-8k": np.linspace(1, 8192, BATCH).astype(int).tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Run it under ncu; it writes nothing itself.")
    ap.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    ap.add_argument("--mix", choices=sorted(MIXES), default="long-among-short")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ncu_ragged.py launches CUDA kernels and needs a CUDA GPU")
    ragged = MIXES[args.mix]
    # The yardstick: a uniform batch of about the mix's 64-token tiles.
    uniform = -(-sum(-(-n // 64) for n in ragged) // BATCH) * 64
    cache = random_cache(sum(-(-n // 64) for n in ragged))
    scale = default_sm_scale()
    for heads in args.heads:
        for plan, launch in balanced_variants(BATCH, heads):
            print(heads, plan.describe(), flush=True)
            tables, q, out, seq_lens = inputs(ragged, cache, heads)
            ws = SplitWorkspace.allocate(BATCH, heads, 1, 512, "cuda",
                                         max_items=plan.max_work_items)
            for _ in range(2):
                launch(q[0], cache, tables[0], seq_lens, out[0], ws, plan=plan, sm_scale=scale)
            torch.cuda.synchronize()
        tables, q, out, seq_lens = inputs([uniform] * BATCH, cache, heads)
        plan = plan_mla_decode(BATCH, heads, uniform)
        print(heads, plan.describe(), flush=True)
        ws = SplitWorkspace.allocate(BATCH, heads, plan.num_kv_splits, 512, "cuda")
        for _ in range(2):
            mla_decode(q[0], cache, tables[0], seq_lens, out[0], ws, plan=plan, sm_scale=scale)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
