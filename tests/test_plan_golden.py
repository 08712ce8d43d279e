"""Plans and their launch settings over a grid of shapes, against recorded values.

``tests/data/plan_golden.json`` holds, for every (batch, heads x q_len, hint, SM count),
the split-KV and balanced plans' ``describe()``, fields and derived launch geometry, and
per cache format the stage-1 tile tokens, warps and register prefetch. A change to the
planner or to how a launch reads a plan shows up here as a named difference. Regenerate
(only for an intended change, with the reason in the commit) with
``python tests/test_plan_golden.py --write``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from graphbucket.kernels import launch
from graphbucket.plan import plan_balanced_mla_decode, plan_mla_decode
from graphbucket.sparse.plan import plan_sparse_decode

pytestmark = pytest.mark.host

GOLDEN = Path(__file__).parent / "data" / "plan_golden.json"
BATCHES = (1, 2, 3, 8, 16, 33, 64, 128)
HEADS = (8, 16, 32, 64, 128)
Q_LENS = (1, 2, 4)
HINTS = (1, 63, 256, 1000, 2048, 4096, 16384, 131072)
NUM_SMS = (132, 8)
# (element size, V3.2 rows) of the cache formats: bf16 / fp16, fp32, fp8-tensor, fp8-v32.
FORMATS = {"bf16": (2, False), "fp32": (4, False), "fp8-tensor": (1, False),
           "fp8-v32": (1, True)}


def _fields(plan) -> str:
    return " ".join(f"{f.name}={str(getattr(plan, f.name)).replace(' ', '')}"
                    for f in dataclasses.fields(plan))


def _geometry(plan) -> dict:
    return {"describe": plan.describe(), "fields": _fields(plan),
            "geometry": f"grid={plan.grid} merge_grid={plan.merge_grid} "
                        f"workspace={plan.workspace_shape} items={plan.max_work_items} "
                        f"stage2={plan.use_stage2} fused={plan.merges_in_stage1} "
                        f"merge_kernel={plan.merge_kernel} kv_buffers={plan.kv_buffers} "
                        f"pdl_requested={plan.merge_kernel and plan.dependent_merge}"}


def _launch(plan) -> str:
    """Per cache format: tile tokens / stage-1 warps / register prefetch."""
    return " ".join(f"{fmt}:{launch.tile_tokens(plan, size, v32=v32)}/"
                    f"{launch.stage1_warps(plan, size)}/"
                    f"{int(launch.register_prefetch(plan, size))}"
                    for fmt, (size, v32) in FORMATS.items())


def record() -> dict:
    table: dict[str, dict] = {}
    rows = sorted({h * q for h in HEADS for q in Q_LENS})  # a verify step folds q_len x heads
    for sms in NUM_SMS:
        for batch in BATCHES:
            for heads in HEADS:
                bal = plan_balanced_mla_decode(batch, heads, num_sms=sms)
                table[f"balanced b={batch} h={heads} sms={sms}"] = {
                    **_geometry(bal), "launch": _launch(bal)}
            for heads in rows:
                for hint in HINTS:
                    plan = plan_mla_decode(batch, heads, hint, num_sms=sms)
                    table[f"split b={batch} h={heads} hint={hint} sms={sms}"] = {
                        **_geometry(plan), "launch": _launch(plan)}
    for num_rows in sorted({b * q for b in BATCHES for q in Q_LENS}):
        for heads in (8, 16, 64):
            for hint in HINTS:
                sp = plan_sparse_decode(num_rows, heads, hint, topk=2048)
                table[f"sparse rows={num_rows} h={heads} hint={hint}"] = {
                    "describe": sp.describe(), "fields": _fields(sp)}
    return table


def _differs(part: str, got: str | None, want: str) -> bool:
    if part != "fields" or got is None:
        return got != want
    # Every recorded field keeps its value; a plan may gain fields.
    have = dict(kv.split("=", 1) for kv in got.split(" "))
    return any(have.get(k) != v for k, v in (kv.split("=", 1) for kv in want.split(" ")))


@pytest.fixture(scope="module")
def recorded() -> tuple[dict, dict]:
    return json.loads(GOLDEN.read_text()), record()


def test_every_recorded_shape_is_planned():
    want, got = json.loads(GOLDEN.read_text()), record()
    assert sorted(got) == sorted(want)


@pytest.mark.parametrize("part", ["describe", "fields", "geometry", "launch"])
def test_plans_and_launch_settings_match_the_record(recorded, part):
    want, got = recorded
    diffs = [f"{key}: {part} {got[key].get(part)!r} != recorded {entry[part]!r}"
             for key, entry in want.items()
             if part in entry and _differs(part, got[key].get(part), entry[part])]
    assert not diffs, f"{len(diffs)} shapes differ, e.g.\n" + "\n".join(diffs[:5])


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_plan_golden.py --write  (rewrites the record)")
    GOLDEN.write_text(json.dumps(record(), sort_keys=True, indent=0) + "\n")
    print(f"wrote {GOLDEN}")
