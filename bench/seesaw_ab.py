"""The Gluon seesaw stage 1 against the Triton 64-row stage 1 at 128 heads (H200, same run,
cold L2, CUDA-graph replays): the planned seesaw plan against the same plan with
``seesaw=False``, each checked against the other first.

    python3 bench/seesaw_ab.py
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import inputs, random_cache  # noqa: E402
from bench.gpu_timing import time_replays  # noqa: E402
from graphbucket.kernels import SplitWorkspace, default_sm_scale, mla_decode  # noqa: E402
from graphbucket.plan import plan_mla_decode  # noqa: E402

HEADS = 128
SHAPES = [(1, 4096), (1, 131072), (8, 65536), (8, 131072), (64, 4096)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Prints one line per shape; writes nothing.")
    ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("seesaw_ab.py times CUDA-graph replays on a Hopper GPU and needs CUDA")
    cache = random_cache(max(b * -(-c // 64) for b, c in SHAPES))
    sm_scale = default_sm_scale()
    for batch, context in SHAPES:
        tables, q, out, seq_lens = inputs([context] * batch, cache, HEADS)
        plan = plan_mla_decode(batch, HEADS, context)
        ws = SplitWorkspace.allocate(batch, HEADS, plan.num_kv_splits, 512, "cuda")
        triton_plan = replace(plan, seesaw=False)
        ref = torch.empty_like(out[0])
        mla_decode(q[0], cache, tables[0], seq_lens, ref, ws, plan=triton_plan,
                   sm_scale=sm_scale)
        mla_decode(q[0], cache, tables[0], seq_lens, out[0], ws, plan=plan, sm_scale=sm_scale)
        err = ((out[0].float() - ref.float()).norm() / ref.float().norm()).item()
        times = {}
        for name, p in (("triton", triton_plan), ("seesaw", plan)):
            def call(p=p):
                for r in range(tables.shape[0]):
                    mla_decode(q[r], cache, tables[r], seq_lens, out[r], ws, plan=p,
                               sm_scale=sm_scale)
            times[name] = time_replays(call, calls_per_graph=tables.shape[0])
        print(f"{batch:3d} x {context:6d}: triton {times['triton']:8.1f} us  seesaw "
              f"{times['seesaw']:8.1f} us  ({times['triton'] / times['seesaw']:.2f}x)  "
              f"rel diff {err:.1e}  [{plan.describe()}]", flush=True)


if __name__ == "__main__":
    main()
