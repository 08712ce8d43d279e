"""The Triton split-KV stage 1 and merge kernels compile for sm_90 on any machine (no GPU
needed), with their launchers' arguments: CPU runs otherwise only interpret them, which
checks no layout, no inline PTX and no shared-memory budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_stage1_and_merge_compile_for_sm90():
    # In a fresh process: Triton's interpreter, on in CPU test runs, does not compile.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-m", "tests.triton_compile"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = {r["name"]: r for r in map(json.loads, done.stdout.strip().splitlines())}
    assert set(reports) == {"stage1-bf16", "stage1-e4m3", "stage1-v32", "merge"}, reports
    for name, report in reports.items():
        assert report["shared_bytes"] <= 227 * 1024, report
        constexprs = report["constexprs"]
        if name == "merge":
            assert report["wait_dependency"] > 0 or not constexprs.get("USE_GDC"), report
            continue
        assert report["mma"] > 0, report
        assert report["launch_dependents"] > 0 or not constexprs.get("USE_GDC"), report
        if constexprs["REG_PREFETCH"]:  # the tile's e4m3 -> f16 inline PTX was emitted
            key = {"bits": "e4m3_bits", "cvt": "e4m3_cvt"}.get(constexprs["DEQUANT"])
            assert key is None or report[key] > 0, report
    assert reports["stage1-e4m3"]["constexprs"]["KV_FORMAT"] == "dense"
    assert reports["stage1-v32"]["constexprs"]["KV_FORMAT"] == "v32"
