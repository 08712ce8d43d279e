"""scripts/tpot_report.py on a synthetic result file: table, ratios, targets, outputs, plot."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.host  # the fast lane: no kernel launches

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tpot_report.py"

TIMES = {1: {"eager": 1.5, "fixed-1": 0.40, "fixed-max": 0.45, "default-ladder": 0.402,
             "ladder": 0.401},
         2048: {"eager": 1.6, "fixed-1": 0.80, "fixed-max": 0.42, "default-ladder": 0.44,
                "ladder": 0.40},
         100_000: {"eager": 2.0, "fixed-1": 40.0, "fixed-max": 0.594, "default-ladder": 0.60,
                   "ladder": 0.60}}
FLOOR = {1: 0.3, 2048: 0.31, 100_000: 0.4}


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("tpot_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def result_data() -> dict:
    rows = [{"policy": p, "context": c, "batch": 1, "tpot_ms": t, "floor_ms": FLOOR[c],
             "splits": 1} for c, by in TIMES.items() for p, t in by.items()]
    meta = {"gpu": "NVIDIA H200", "model": "deepseek-v3-tp8", "layers": 4, "copy_gbps": 4270,
            "date": "2026-11-29", "torch": "2.11", "triton": "3.6", "command": "x",
            "weights_mb": 689.6,
            "ladder": [{"max_len": 64, "hint": 64}, {"max_len": 131072, "hint": 131072}]}
    return {"meta": meta, "rows": rows}


def result_file(tmp_path: Path) -> Path:
    path = tmp_path / "h200-tpot.json"
    path.write_text(json.dumps(result_data()))
    return path


@pytest.fixture
def no_matplotlib(monkeypatch):
    """Imports of matplotlib fail as if it were not installed."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_markdown_table_speedup_and_targets(report, tmp_path):
    path = result_file(tmp_path)
    assert report.main(["--json", str(path), "--out-md", str(tmp_path / "t.md"),
                        "--no-png"]) == 0
    text = (tmp_path / "t.md").read_text()
    assert ("| 100K | 65-128K (hint 128K, 1 split) | 2.000 | 40.000 | 0.594 | 0.600 | 0.600 "
            "| 0.400 | 66.67x | 98.5 % | 1.000 (same plan) |") in text
    assert "- PASS: ladder 66.67x faster than fixed-1 at 100K" in text
    assert "- PASS: ladder at most +0.25 % against fixed-1 at every context <= 2K (worst 1;" \
        in text
    assert "- PASS: ladder at most 1.010x the fastest policy (worst 100K" in text
    assert "- FAIL: ladder 1.50x floor_ms at 100K" in text
    # The floor is explained with the run's numbers, and no figure is linked without one.
    assert "689.6 MB" in text and "4270.0 GB/s" in text
    assert "![" not in text


def test_ratios_to_the_ladder(report):
    by_ctx = report.table(result_data()["rows"])[1]
    ratios = report.ratio_series(by_ctx)
    assert set(ratios) == {"eager", "fixed-1", "fixed-max", "default-ladder"}
    assert [c for c, _ in ratios["fixed-max"]] == [1, 2048, 100_000]
    assert [r for _, r in ratios["fixed-max"]] == pytest.approx(
        [0.45 / 0.401, 0.42 / 0.40, 0.594 / 0.60])
    assert [r for _, r in ratios["fixed-1"]] == pytest.approx([0.40 / 0.401, 2.0, 40 / 0.6])
    # Against another reference the ladder is one of the series.
    assert dict(report.ratio_series(by_ctx, reference="fixed-1")["ladder"]) == \
        pytest.approx({1: 0.401 / 0.40, 2048: 0.5, 100_000: 0.6 / 40})


def test_speedup_and_the_claims_it_backs(report):
    by_ctx = report.table(result_data()["rows"])[1]
    assert dict(report.speedup_series(by_ctx)) == pytest.approx(
        {1: 0.40 / 0.401, 2048: 2.0, 100_000: 40 / 0.6})
    context, ratio = report.worst_short(by_ctx)
    assert context == 1 and ratio == pytest.approx(0.401 / 0.40)
    assert report.worst_short(by_ctx, limit=0) is None
    assert report.ladder_over_best(by_ctx) == pytest.approx(
        {1: 0.401 / 0.40, 2048: 1.0, 100_000: 0.60 / 0.594})
    # A context where the ladder was not measured has no ratio instead of a crash.
    del by_ctx[2048]["ladder"]
    assert 2048 not in report.ladder_over_best(by_ctx)
    assert 2048 not in dict(report.speedup_series(by_ctx))


def test_outputs_next_to_the_json_are_not_overwritten_without_force(report, tmp_path,
                                                                    capsys):
    path = result_file(tmp_path)
    md = path.with_suffix(".md")
    assert report.main(["--json", str(path), "--no-png"]) == 0
    assert f"wrote {md}" in capsys.readouterr().out
    md.write_text("committed")
    with pytest.raises(SystemExit) as e:
        report.main(["--json", str(path), "--no-png"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert str(md) in err and "--force" in err
    assert md.read_text() == "committed"
    assert report.main(["--json", str(path), "--no-png", "--force"]) == 0
    assert md.read_text().startswith("# TPOT per policy")


def test_refuses_before_writing_anything(report, tmp_path):
    # The PNG exists, the markdown does not: neither is written.
    path = result_file(tmp_path)
    png = tmp_path / "f.png"
    png.write_bytes(b"old")
    with pytest.raises(SystemExit):
        report.main(["--json", str(path), "--out-md", str(tmp_path / "t.md"),
                     "--out-png", str(png)])
    assert not (tmp_path / "t.md").exists() and png.read_bytes() == b"old"


def test_table_without_matplotlib(report, tmp_path, capsys, no_matplotlib):
    path = result_file(tmp_path)
    md, png = tmp_path / "t.md", tmp_path / "t.png"
    assert report.main(["--json", str(path), "--out-md", str(md), "--out-png", str(png)]) == 1
    err = capsys.readouterr().err
    assert "python3 -m pip install matplotlib" in err and str(png) in err
    assert "| 100K |" in md.read_text() and not png.exists()
    # Asking for the table only is no error.
    assert report.main(["--json", str(path), "--out-md", str(md), "--no-png", "--force"]) == 0


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json", "cannot read it as JSON"),
    ('{"meta": {}, "rows": []}', "non-empty 'rows'"),
])
def test_bad_json_is_a_usage_error(report, tmp_path, capsys, content, message):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as e:
        report.main(["--json", str(path), "--no-png", "--out-md", str(tmp_path / "t.md")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err
    assert not (tmp_path / "t.md").exists()


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed")
def test_figure_is_written_and_linked(report, tmp_path):
    path = result_file(tmp_path)
    md, png = tmp_path / "t.md", tmp_path / "fig" / "t.png"
    assert report.main(["--json", str(path), "--out-md", str(md), "--out-png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](fig/t.png)" in md.read_text()


def test_context_labels(report):
    assert [report.fmt_context(n) for n in (1, 512, 1024, 100_000, 131072)] == \
        ["1", "512", "1K", "100K", "128K"]


def test_q_len_selects_the_verify_step_rows(report, tmp_path):
    data = result_data()
    verify = [{**r, "q_len": 2, "tpot_ms": r["tpot_ms"] / 2 + 0.0123} for r in data["rows"]]
    path = tmp_path / "h200-tpot-mtp.json"
    path.write_text(json.dumps({"meta": data["meta"], "rows": data["rows"] + verify}))
    assert report.main(["--json", str(path), "--no-png"]) == 0
    assert report.main(["--json", str(path), "--no-png", "--q-len", "2"]) == 0
    one, two = (tmp_path / "h200-tpot-mtp.md").read_text(), \
        (tmp_path / "h200-tpot-mtp-q2.md").read_text()
    halved = f"{0.6 / 2 + 0.0123:.3f}"  # the ladder at 100K, per token at q_len 2
    assert halved in two and halved not in one
    with pytest.raises(SystemExit):
        report.main(["--json", str(path), "--no-png", "--q-len", "4"])
