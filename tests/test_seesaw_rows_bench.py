"""bench/experiments/seesaw_rows.py's host parts: the L2-resident tables and the table of
ratios (the timing itself needs a Hopper GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.script_modules import load_experiment

pytestmark = pytest.mark.host


def test_resident_tables_read_the_first_pages_of_one_request_over_and_over():
    exp = load_experiment("seesaw_rows")
    tables = torch.randperm(3 * 4 * 100).int().reshape(3, 4, 100)
    got = exp.resident(tables, pages=64)
    assert got.shape == tables.shape and got.is_contiguous()
    first = tables[0, 0, :64]
    for r in range(3):
        for b in range(4):
            assert torch.equal(got[r, b, :64], first)
            assert torch.equal(got[r, b, 64:], first[:36])
    assert len(set(got.flatten().tolist())) == 64


def test_resident_tables_narrower_than_the_page_count_keep_their_width():
    exp = load_experiment("seesaw_rows")
    tables = torch.arange(2 * 3 * 5).int().reshape(2, 3, 5)
    got = exp.resident(tables, pages=64)
    assert torch.equal(got, tables[0, 0].expand(2, 3, 5))


def test_markdown_gives_ratios_where_both_variants_were_timed():
    exp = load_experiment("seesaw_rows")
    meta = {"gpu": "GPU", "date": "d", "torch": "t", "triton": "tr", "command": "c"}
    rows = [{"batch": 64, "context": 4096, "plan": "p", "q1_us": 100.0, "q4_us": 150.0,
             "q1-l2_us": 60.0, "q4-l2_us": 75.0},
            {"batch": 8, "context": 16384, "plan": "p", "q1_us": 80.0, "q4_us": 96.0}]
    text = exp.markdown(meta, rows)
    header = next(line for line in text.splitlines() if line.startswith("| batch"))
    assert "| q1 | q4 | q1-l2 | q4-l2 |" in header and "eager |" in header
    assert "q2 |" not in header.split("q4 / q1")[0]  # q2 was timed in no row
    first, second = [line for line in text.splitlines() if line.startswith(("| 64", "| 8 "))]
    assert first.endswith("| 1.500 | 1.250 | - | 0.600 |")
    assert second.endswith("| 1.200 | - | - | - |")
    assert "| 80.0 | 96.0 | - | - | 1.200 |" in second  # untimed cells are dashes
