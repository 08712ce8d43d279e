"""scripts/tpot_report.py on a synthetic result file: table, speedups, targets, plot."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tpot_report.py"


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("tpot_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def result_file(tmp_path: Path) -> Path:
    times = {1: {"eager": 1.5, "fixed-1": 0.40, "fixed-max": 0.45, "ladder": 0.401},
             100_000: {"eager": 2.0, "fixed-1": 40.0, "fixed-max": 0.60, "ladder": 0.60}}
    floor = {1: 0.3, 100_000: 0.4}
    rows = [{"policy": p, "context": c, "batch": 1, "tpot_ms": t, "floor_ms": floor[c],
             "splits": 1} for c, by in times.items() for p, t in by.items()]
    meta = {"gpu": "NVIDIA H200", "model": "deepseek-v3-tp8", "layers": 4, "copy_gbps": 4270,
            "date": "2026-11-29", "torch": "2.11", "triton": "3.6", "command": "x",
            "ladder": [{"max_len": 64, "hint": 64}, {"max_len": 131072, "hint": 131072}]}
    path = tmp_path / "h200-tpot.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    return path


def test_markdown_table_speedup_and_targets(report, tmp_path):
    path = result_file(tmp_path)
    report.main(["--json", str(path), "--out-png", str(tmp_path / "p.png")])
    text = path.with_suffix(".md").read_text()
    assert "| 100K | 65-128K (hint 128K, 1 split) | 2.000 | 40.000 | 0.600 | 0.600 |" in text
    assert "66.67x | 98.5 %" in text
    assert "- PASS: ladder 66.67x faster than fixed-1 at 100K" in text
    assert "- PASS: ladder at most +0.25 % against fixed-1" in text
    assert "- FAIL: ladder 1.50x floor_ms at 100K" in text
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "p.png").stat().st_size > 0


def test_context_labels(report):
    assert [report.fmt_context(n) for n in (1, 512, 1024, 100_000, 131072)] == \
        ["1", "512", "1K", "100K", "128K"]
