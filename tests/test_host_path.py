"""bench/experiments/host_path.py runs without a GPU: every phase of a BlockTable step is
timed, and the steps it times are valid ones (the selector's key covers every length)."""

from __future__ import annotations

import pytest

from tests.script_modules import load_experiment

pytestmark = pytest.mark.host


def test_host_path_times_every_phase_of_valid_steps():
    exp = load_experiment("host_path")
    parts = exp.build("default")
    row = exp.cell(parts, 8, 122000, 128000, 30)
    med = row["us_median"]
    assert set(med) == set(exp.PHASES) and all(v > 0 for v in med.values())
    assert med["total"] >= max(med[p] for p in exp.PHASES if p != "total")
    _, selector, _, table, _ = parts
    # The trajectory's requests grew inside their rows' pages and the top bucket.
    assert all(table.page_counts[:8] * 64 >= 122000)
    assert selector.choose([128000] * 8).bucket == len(selector.ladder) - 1
    meta = {"date": "d", "cpu": "c", "cores": 2, "python": "3", "torch": "t", "numpy": "n",
            "core": 0, "steps": 30, "command": "x"}
    text = exp.markdown(meta, {"default": [row]})
    assert "| 8 | 122000-128000 |" in text
