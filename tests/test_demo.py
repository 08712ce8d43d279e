"""scripts/demo.py: the CPU demo's printed numbers (every step against float64, the buckets,
the splits each policy's graph replays) and the GPU demo's comparison lines."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_demo():
    spec = importlib.util.spec_from_file_location("demo", ROOT / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


demo = load_demo()
STEP_LINE = re.compile(r"^  (\[[\d, ]+\])\s+<=(\d+)\s.*?(\S+) / (\S+) / (\S+)$", re.M)


def bucket_of(lens: list[int]) -> int:
    return min(b.max_len for b in demo.CPU_LADDER if b.max_len >= max(lens))


@pytest.mark.interpreter
def test_cpu_demo_steps_match_float64_in_every_policy(capsys):
    records = demo.cpu_demo()
    printed = STEP_LINE.findall(capsys.readouterr().out)
    assert len(printed) == len(records) == 6
    backend = demo.get_backend("triton", num_sms=8, kv_lora_rank=demo.tiny().kv_lora_rank,
                               qk_rope_dim=demo.tiny().qk_rope_dim)
    for record, (lens, bucket, *errors) in zip(records, printed, strict=True):
        assert lens == str(record["lens"]) and int(bucket) == record["bucket"]
        assert record["bucket"] == bucket_of(record["lens"])
        for policy, error in zip(demo.SHOWN, errors, strict=True):
            # float32 through the interpreter: a real difference from float64, and a small one
            assert 1e-9 < record[policy]["error"] < 1e-4, (record, policy)
            assert float(error) == pytest.approx(record[policy]["error"], rel=0.06)
        padded = 1 if len(record["lens"]) == 1 else 2
        want = {"fixed-1": 1, "fixed-max": demo.CPU_MAX_LEN, "ladder": record["bucket"]}
        for policy, hint in want.items():
            plan = backend.plan(padded, demo.tiny().num_heads, hint)
            assert record[policy]["splits"] == plan.num_kv_splits, (record, policy)
    walk = [r["bucket"] for r in records[:4]]
    assert len(set(walk)) == 2 and walk == sorted(walk), "the walk crosses one bucket bound"
    assert records[-1]["ladder"]["splits"] > 1 == records[-1]["fixed-1"]["splits"]
    assert records[0]["fixed-max"]["splits"] > 1 == records[0]["ladder"]["splits"]


def rows(batch: int, **by_policy: list[tuple[int, float, str]]) -> list[dict]:
    return [{"policy": policy.replace("_", "-"), "batch": batch, "context": context,
             "tpot_ms": ms, "splits": int(graph.split()[0]) if graph[0].isdigit() else 1,
             "graph": graph}
            for policy, points in by_policy.items() for context, ms, graph in points]


def test_differences_name_each_policys_worst_context_and_why():
    one = rows(1, fixed_1=[(1, 0.375, "1 split (no merge)"), (131072, 25.1, "1 split (no merge)")],
               fixed_max=[(1, 0.400, "64 splits + merge"), (131072, 0.549, "64 splits + merge")],
               ladder=[(1, 0.373, "1 split (no merge)"), (131072, 0.549, "256 splits + merge")])
    many = rows(64, fixed_1=[(1, 0.5, "1 split (no merge)"), (131072, 200.0, "1 split (no merge)")],
                fixed_max=[(1, 0.5, "2 splits + merge"), (131072, 9.56, "2 splits + merge")],
                ladder=[(1, 0.5, "1 split (no merge)"), (131072, 11.04, "balanced + merge")])
    lines = demo.differences(one + many)
    assert len(lines) == 6
    assert lines[0].startswith("batch 1: fixed-1 takes 45.72x the ladder's time at context 131072")
    assert lines[1].startswith("batch 1: fixed-max takes 1.07x the ladder's time at context 1:")
    assert "64 splits + merge" in lines[1]
    assert lines[2].startswith("batch 1: the ladder is within 2 % of the faster")
    assert lines[3].startswith("batch 64: fixed-1 takes 18.12x")
    assert lines[4] == "batch 64: fixed-max is never more than 2 % slower than the ladder"
    assert lines[5].startswith("batch 64: the ladder takes 1.15x fixed-max's time at context "
                               "131072")
    assert "balanced + merge and fixed-max's 2 splits + merge" in lines[5]


def test_differences_leave_gaps_between_equal_graphs_unexplained():
    # The same graph under every policy: a 1.3x gap is noise, not a topology effect.
    same = rows(8, fixed_1=[(64, 0.3, "1 split (no merge)")],
                fixed_max=[(64, 0.4, "1 split (no merge)")],
                ladder=[(64, 0.52, "1 split (no merge)")])
    assert demo.differences(same) == [
        "batch 8: fixed-1 is never more than 2 % slower than the ladder",
        "batch 8: fixed-max is never more than 2 % slower than the ladder",
        "batch 8: the ladder is within 2 % of the faster of the two wherever their graphs "
        "differ: each bucket replays the graph planned for it"]


def test_gpu_table_row_shows_every_policy_and_the_ratios():
    row = {r["policy"]: r for r in rows(1, fixed_1=[(4096, 1.2, "1 split (no merge)")],
                                        fixed_max=[(4096, 0.399, "64 splits + merge")],
                                        ladder=[(4096, 0.4, "balanced + merge")])}
    line = demo.table_row(4096, row)
    assert line.split() == ["4096", "1.200", "(1)", "0.399", "(64)", "0.400", "(bal)",
                            "3.00x", "1.00x"]
