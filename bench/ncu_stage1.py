"""One eager launch of each of five decode shapes, for Nsight Compute to profile stage 1:
per-tensor fp8 and bf16 caches at 16 heads, 8 x 128K, bf16 at 128 heads, 8 x 64K, and the
fp8 seesaw (per-tensor) at 128 heads, 8 x 64K, and at 16 heads on a 64-row plan, 8 x 128K
(each launched twice; profile the later one or both; ``-k regex:seesaw_fp8`` for the fp8
seesaw alone).

    ncu -k regex:stage1 -c 10 --section SpeedOfLight --section SchedulerStats \
        --section WarpStateStats --section LaunchStats --section Occupancy \
        python3 bench/ncu_stage1.py
    ncu -k regex:stage1 -c 1 --section MemoryWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Tables --section InstructionStats \
        python3 bench/ncu_stage1.py

Nsight Compute locks the SM clock (1.37 GHz on the H200), so its durations are longer
than the sweeps'; read its ratios and stall reasons, not its times.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import inputs, random_cache  # noqa: E402
from graphbucket import fp8  # noqa: E402
from graphbucket.kernels import SplitWorkspace, default_sm_scale, mla_decode  # noqa: E402
from graphbucket.plan import plan_mla_decode  # noqa: E402
from graphbucket.plan_streams import SEESAW_STREAM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Run it under ncu (the commands are in this file's docstring); it writes "
               "nothing itself.")
    ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ncu_stage1.py launches CUDA kernels and needs a CUDA GPU")
    bf16 = random_cache(8 * 2048)
    scale = fp8.scale_for(bf16.abs().amax().float().cpu()).cuda()
    packed = fp8.quantize(bf16, scale)
    sm_scale = default_sm_scale()
    for heads, batch, context, cache, extra, stream in (
            (16, 8, 131072, packed, {"kv_scale": scale}, {}), (16, 8, 131072, bf16, {}, {}),
            (128, 8, 65536, bf16, {}, {}), (128, 8, 65536, packed, {"kv_scale": scale}, {}),
            (16, 8, 131072, packed, {"kv_scale": scale}, {"stream": SEESAW_STREAM})):
        tables, q, out, seq_lens = inputs([context] * batch, bf16, heads)
        plan = plan_mla_decode(batch, heads, context, **stream)
        ws = SplitWorkspace.allocate(batch, heads, plan.num_kv_splits, 512, "cuda")
        for _ in range(2):
            mla_decode(q[0], cache, tables[0], seq_lens, out[0], ws, plan=plan,
                       sm_scale=sm_scale, **extra)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
