"""Steps issued while earlier steps still run, as an engine that overlaps its host work with
the GPU issues them: every output equals the same step issued alone after a sync.

The scheduler below grows every request a token a step (a page appended where it needs
one), retires the last request now and then and admits new ones, short or long, so that
batches change size and cross buckets. The GPU is held back (``torch.cuda._sleep``) every
few steps so that the host runs ahead of it and the staging ring wraps while its slots are
still being read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from graphbucket import DecodeBatch, GraphBucketRunner, get_backend
from tests._toy import ToyMLA, rel_l2, toy_spec

pytestmark = pytest.mark.gpu

MML, PAGE, PAGES, HIDDEN, SIZES = 16384, 64, 2048, 256, (1, 2, 8)
STEPS, HOLD_EVERY, HOLD_CYCLES = 120, 8, 4_000_000  # about 2 ms of GPU sleep per hold


@dataclass
class Step:
    lens: list[int]
    ops: list[tuple]  # BlockTable verbs, applied in order before the step
    hidden: torch.Tensor  # host input rows
    table: np.ndarray  # the rows' pages after the verbs (the eager reference's table)


def schedule(rng: np.random.Generator, steps: int) -> list[Step]:
    """Short requests alone for the first third of the steps (the lower buckets), then
    short and long ones (the batch's longest request in the top buckets)."""
    rows: list[list] = []  # [pages, length of the next step]
    out = []
    for k in range(steps):
        ops: list[tuple] = []
        for i, row in enumerate(rows):
            row[1] += 1
            if row[1] > len(row[0]) * PAGE:
                page = int(rng.integers(PAGES))
                row[0].append(page)
                ops.append(("append", i, [page]))
        draw = rng.random()
        if len(rows) > 1 and (draw < 0.15 or len(rows) == max(SIZES)):
            rows.pop()
            ops.append(("release", len(rows)))
        elif draw < 0.4 or not rows:
            short = k < steps // 3 or rng.random() < 0.5
            length = int(rng.integers(1, 60) if short else rng.integers(1000, MML - steps))
            pages = rng.integers(PAGES, size=-(-length // PAGE)).tolist()
            ops.append(("assign", len(rows), pages))
            rows.append([pages, length])
        lens = [row[1] for row in rows]
        cols = -(-max(lens) // PAGE)
        table = np.zeros((len(rows), cols), np.int32)
        for i, (pages, _) in enumerate(rows):
            table[i, :len(pages)] = pages
        hidden = torch.from_numpy(rng.standard_normal((len(rows), HIDDEN))).to(torch.bfloat16)
        out.append(Step(lens, ops, hidden, table))
    return out


def run(runner: GraphBucketRunner, steps: list[Step], *, ahead: bool) -> list[torch.Tensor]:
    """Every step's output (cloned on the stream); ``ahead``: no sync between steps, the
    GPU held back every few steps; else a sync after each."""
    table = runner.block_table
    for row in range(table.num_rows):
        table.release(row)
    outs = []
    for i, step in enumerate(steps):
        if ahead and i % HOLD_EVERY == 0:
            torch.cuda._sleep(HOLD_CYCLES)
        for verb, *args in step.ops:
            getattr(table, verb)(*args)
        outs.append(runner.step(DecodeBatch(step.lens, table, {"hidden": step.hidden})).clone())
        if not ahead:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return outs


@pytest.fixture(scope="module")
def model():
    return ToyMLA(num_pages=PAGES, dtype=torch.bfloat16, device="cuda", rank=512, rope=64,
                  hidden=HIDDEN, page=PAGE)


def runner_of(model, policy: str, **kw) -> GraphBucketRunner:
    spec = toy_spec(max_pages=MML // PAGE, num_pages=PAGES, dtype=torch.bfloat16,
                    device="cuda", page=PAGE, hidden=HIDDEN)
    runner = GraphBucketRunner.for_policy(
        policy, model, spec=spec, batch_sizes=list(SIZES), max_model_len=MML,
        sm_scale=0.125, backend=get_backend("triton", device="cuda"), progress=False, **kw)
    runner.capture()
    return runner


@pytest.mark.parametrize("copy", [
    pytest.param({}, id="copy-kernel"),
    pytest.param({"copy_kernel": False}, id="memcpy-node"),
    pytest.param({"copy_in_graph": False}, id="stage-copies"),
    pytest.param({"max_table_changes": 1}, id="whole-row-copies")])
def test_steps_issued_ahead_equal_steps_issued_alone(model, copy):
    steps = schedule(np.random.default_rng(7), STEPS)
    runner = runner_of(model, "ladder", **copy)
    eager = runner_of(model, "eager")
    try:
        waits = runner.stats().staging_waits
        ahead = run(runner, steps, ahead=True)
        assert runner.stats().staging_waits > waits  # the ring wrapped under a held GPU
        alone = run(runner, steps, ahead=False)
        for i, (a, b) in enumerate(zip(ahead, alone, strict=True)):
            assert torch.equal(a, b), (i, steps[i].lens)
        for i in range(0, STEPS, 6):
            step = steps[i]
            want = eager.step(DecodeBatch(step.lens, step.table, {"hidden": step.hidden}))
            assert rel_l2(alone[i], want) < 1e-2, (i, step.lens)
        stats = runner.stats()
        assert stats.errors == 0 and stats.eager_fallbacks == 0
        assert len({key.bucket for key in stats.replays}) >= 2
        assert len({key.batch_size for key in stats.replays}) >= 2
    finally:
        runner.close()
        eager.close()
