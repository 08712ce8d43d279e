"""CPU smoke of bench/tpot_sparse.py: the tiny sparse model through every policy's runner.

Interpreter, fp32, batch 1, q_len 1 and 2 at one context above top-k: each policy's step
against the float64 reference, the seed baseline's plans, and the summary's checks on the
rows the bench writes. The GPU numbers come from ``python3 bench/tpot_sparse.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.tpot_sparse import (
    BENCH_POLICIES,
    SEED_POLICY,
    SparseTpotBench,
    markdown,
    row,
    summary,
)
from graphbucket.models.sparse_mla import tiny_sparse
from graphbucket.sparse.plan import seed_max_splits

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke; on CUDA run "
                                "bench/tpot_sparse.py")


@pytest.fixture(scope="module")
def bench():
    b = SparseTpotBench.build(tiny_sparse(), max_model_len=128, batches=[1], q_lens=[1, 2],
                              page_size=16, dtype=torch.float32, device="cpu", num_sms=8)
    yield b
    b.close()


def rel_l2(got, want) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("q_len", [1, 2])
def test_every_policy_matches_the_reference(bench, q_len):
    decode = bench.batch(100, 1, q_len)
    lens = np.asarray(decode.seq_lens_cpu)
    want = bench.model.forward_reference(
        decode.inputs["hidden"], positions=lens[0] - q_len + np.arange(q_len), seq_lens=lens,
        block_table=decode.block_table_cpu, slot_mapping=decode.inputs["slot_mapping"],
        q_len=q_len)
    for policy in BENCH_POLICIES:
        got = bench.runners[policy].step(decode)
        assert rel_l2(got, want) < 1e-4, (policy, q_len)
        plan = bench.plan(policy, 100, 1, q_len)
        assert plan.num_rows == q_len
    seed = bench.plan(SEED_POLICY, 100, 1)
    assert seed.indexer_splits == seed.attention_splits == seed_max_splits(128, 16, 8)


def test_summary_flags_what_the_issue_checks():
    rows = [row("s", p, c, 1, 1, ms) for p, c, ms in [
        ("fixed-1", 100_000, 9.0), ("ladder", 100_000, 2.0), ("fixed-max", 100_000, 2.5),
        (SEED_POLICY, 100_000, 3.0), ("ladder", 131072, 3.0), ("fixed-max", 131072, 2.0)]]
    dense = [row("d", "ladder", 131072, 1, 1, 6.0)]
    s = summary(rows, dense)
    assert s["ladder_over_fixed_1_at_100k"] == {"bs1-q1-ctx100000": 4.5}
    assert s["ladder_behind_fixed_max"] == ["bs1-q1-ctx131072"]
    assert s["seed_over_ladder"] == {"bs1-q1-ctx100000": 1.5}
    assert s["sparse_over_dense_128k"] == {"ladder-bs1-q1": 0.5}
    text = markdown({"meta": {"layers": 2}, "rows": rows, "dense_rows": dense, "summary": s})
    assert "| s | 1 | 1 | 100000 |" in text and "| d | 1 | 1 | 131072 |" in text
