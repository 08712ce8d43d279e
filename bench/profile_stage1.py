"""One stage-1 launch per operand order at batch 1, 128K tokens, for Nsight Compute.

Prints each variant's registers, spills and shared memory (Triton's metadata), then
launches it a few times so ``ncu`` can read occupancy, memory throughput and stall
reasons:

    ncu --kernel-name regex:stage1 --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats python3 bench/profile_stage1.py
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphbucket.kernels import SplitWorkspace, default_sm_scale  # noqa: E402
from graphbucket.kernels.launch import launch_stage1  # noqa: E402
from graphbucket.plan import plan_mla_decode  # noqa: E402
from graphbucket.timing import Problem  # noqa: E402

CONTEXT, BATCH, HEADS = 131072, 1, 16


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("profile_stage1.py needs a CUDA GPU")
    problem = Problem(CONTEXT * BATCH)
    tables, q, out, seq_lens = problem.inputs(CONTEXT, BATCH)
    base = plan_mla_decode(BATCH, HEADS, CONTEXT)
    ws = SplitWorkspace.for_plans([base], "cuda")
    for swap in (False, True):
        plan = dataclasses.replace(base, swap_ab=swap)
        for _ in range(3):  # the first launch compiles; ncu skips it
            k = launch_stage1(q[0], problem.cache, tables[0], seq_lens, out[0], ws, plan=plan,
                              sm_scale=default_sm_scale(), lse=None)
        torch.cuda.synchronize()
        print(f"{plan.describe()}: regs {getattr(k, 'n_regs', None)}, spills "
              f"{getattr(k, 'n_spills', None)}, shared {k.metadata.shared} B", flush=True)


if __name__ == "__main__":
    main()
