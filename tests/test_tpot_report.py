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


# ---- several cache formats in one file --------------------------------------------------

FP8_TIMES = {"bf16": {1: (0.40, 0.401), 100_000: (40.0, 0.60)},
             "fp8-tensor": {1: (0.41, 0.41), 100_000: (20.0, 0.52)},
             "fp8-v32": {1: (0.42, 0.42), 100_000: (15.0, 0.58)}}
ROW_BYTES = {"bf16": 1152, "fp8-tensor": 576, "fp8-v32": 656}


def fp8_data() -> dict:
    rows = [{"policy": p, "context": c, "batch": 1, "tpot_ms": t, "floor_ms": 0.3, "splits": 1,
             "kv_cache": fmt, "kv_mb": c * 4 * ROW_BYTES[fmt] / 1e6}
            for fmt, by in FP8_TIMES.items() for c, ts in by.items()
            for p, t in zip(("fixed-1", "ladder"), ts, strict=True)]
    meta = {**result_data()["meta"], "kv_cache": "bf16", "kv_caches": list(FP8_TIMES),
            "per_format": {f: {"ladder": [{"max_len": 131072, "hint": 16384}],
                               "ladder_source": "tuned for bf16 (no fp8-v32 ladder ships)"
                               if f == "fp8-v32" else f"tuned for {f}"} for f in FP8_TIMES}}
    return {"meta": meta, "rows": rows}


def test_fp8_rows_get_their_sections_and_the_breakdown(report):
    data = fp8_data()
    data["rows"] = data["rows"][::-1]  # the file's order does not matter: bf16 comes first
    text = report.render_markdown(data)
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    assert heads == ["## bf16 cache (ladder: tuned for bf16)",
                     "## fp8-tensor cache (ladder: tuned for fp8-tensor)",
                     "## fp8-v32 cache (ladder: tuned for bf16 (no fp8-v32 ladder ships))",
                     "## fp8 caches against bf16 (ladder policy)"]
    assert "Latent cache formats: bf16, fp8-tensor, fp8-v32" in text
    # Each format's own table: fp8-tensor's ladder row at 100K.
    assert "| 100K | 1-128K (hint 16K, 1 split) | 20.000 | 0.520 | 0.300 | 38.46x |" in text
    # Breakdown: 460.8 MB of bf16 rows against 230.4 (fp8-tensor), 262.4 (fp8-v32).
    assert ("| fp8-tensor | 1 | 100K | 0.600 | 0.520 | +0.080 | 460.8 -> 230.4 | 230.4 | "
            "0.054 | 1.48 |") in text
    assert ("| fp8-v32 | 1 | 100K | 0.600 | 0.580 | +0.020 | 460.8 -> 262.4 | 198.4 | "
            "0.046 | 0.43 |") in text
    assert "- PASS: fp8-tensor ladder 0.080 ms below bf16 at 100K" in text
    assert "- FAIL: fp8-v32 ladder 0.020 ms below bf16 at 100K" in text
    assert "- PASS: fp8-tensor ladder 38.46x faster than fixed-1 at 100K (target >= 30x)" in text
    assert "- FAIL: fp8-v32 ladder 25.86x faster than fixed-1 at 100K" in text
    # The bf16 targets are still checked, once per format.
    assert text.count("### targets (batch 1)") == 3


def test_files_before_fp8_rows_read_as_one_format(report):
    data = result_data()
    assert list(report.rows_by_format(data)) == ["bf16"]
    text = report.render_markdown(data)
    assert "\n## " not in text and "Latent cache formats" not in text
    data["meta"]["kv_cache"] = "float8_e4m3fn"  # bench/tpot.py --kv-cache fp8-tensor, before
    assert list(report.rows_by_format(data)) == ["fp8-tensor"]
    assert "Latent cache formats: fp8-tensor" in report.render_markdown(data)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed")
def test_figure_of_a_multi_format_file_shows_every_format(report, tmp_path):
    path = tmp_path / "h200-tpot-fp8.json"
    path.write_text(json.dumps(fp8_data()))
    assert report.main(["--json", str(path)]) == 0
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "](h200-tpot-fp8.png)" in path.with_suffix(".md").read_text()
    plt = report.load_pyplot()
    fig = report.plot_figure(fp8_data(), plt)
    title, labels = fig_text(fig)
    assert "bf16 / fp8-tensor / fp8-v32 caches" in title
    for fmt in FP8_TIMES:
        assert {f"{fmt}: ladder", f"{fmt}: fixed-1", f"{fmt}: roofline floor",
                f"{fmt}: ladder speedup over fixed-1"} <= labels
    # Each fp8 ladder over bf16's: fp8-tensor's 0.52 ms against 0.60 at 100K.
    mid = fig.axes[1]
    tensor = next(line for line in mid.get_lines() if line.get_label() == "fp8-tensor: ladder")
    assert tensor.get_ydata()[-1] == pytest.approx(0.52 / 0.60)
    assert "fp8-tensor: expected from the KV bytes it saves" in labels
    # The headline speedup of every format is written in the bottom panel.
    notes = " ".join(t.get_text() for t in fig.axes[2].texts)
    for fmt, by in FP8_TIMES.items():
        fixed, ladder = by[100_000]
        assert f"100K: ladder {fixed / ladder:.1f}x faster than fixed-1 ({fmt})" in notes
    plt.close(fig)


def fig_text(fig) -> tuple[str, set[str]]:
    """A figure's title and every label of its legend."""
    (legend,) = fig.legends
    return fig._suptitle.get_text(), {t.get_text() for t in legend.get_texts()}


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed")
def test_figure_names_what_it_shows_and_every_line_is_in_the_legend(report):
    data = result_data()
    plt = report.load_pyplot()
    fig = report.plot_figure(data, plt)
    title, labels = fig_text(fig)
    # The preset's heads when the file predates meta["num_heads"].
    assert title.startswith("TPOT per policy: deepseek-v3-tp8 (16 heads, 4 layers), bf16 "
                            "cache, q_len 1, batch 1\nNVIDIA H200, 2026-11-29")
    for ax in fig.axes:
        for artist in [*ax.get_lines(), *ax.patches]:
            assert artist.get_label() in labels, artist.get_label()
    measured = {r["policy"] for r in data["rows"]}
    assert measured <= set(report.POLICIES)
    assert {*measured, report.FLOOR_LABEL, report.NOISE_LABEL, report.SPEEDUP_LABEL} <= labels
    plt.close(fig)
    data["meta"].update(num_heads=128, model="deepseek-v3-dp")
    fig = report.plot_figure(data, plt)
    assert "deepseek-v3-dp (128 heads, 4 layers)" in fig_text(fig)[0]
    plt.close(fig)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed")
def test_headline_speedup_at_the_context_nearest_100k(report):
    # Contexts in powers of two (the 128-head run): 102400 stands for 100K.
    data = result_data()
    data["rows"] = [{**r, "context": 102400} if r["context"] == 100_000 else r
                    for r in data["rows"]]
    assert report.headline_context([1, 2048, 65536, 102400, 131072]) == 102400
    plt = report.load_pyplot()
    fig = report.plot_figure(data, plt)
    notes = " ".join(t.get_text() for t in fig.axes[2].texts)
    assert f"100K: ladder {40.0 / 0.60:.1f}x faster than fixed-1" in notes
    plt.close(fig)


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


def test_fp8_verify_step_rows_get_their_breakdown_per_token(report, tmp_path):
    data = fp8_data()
    # The same runs at q_len 2: half the step time per token, the same KV bytes per step.
    verify = [{**r, "q_len": 2, "tpot_ms": r["tpot_ms"] / 2} for r in data["rows"]]
    path = tmp_path / "h200-tpot-fp8-mtp.json"
    path.write_text(json.dumps({"meta": data["meta"], "rows": data["rows"] + verify}))
    assert report.main(["--json", str(path), "--no-png", "--q-len", "2"]) == 0
    text = (tmp_path / "h200-tpot-fp8-mtp-q2.md").read_text()
    assert "## fp8 caches against bf16 (ladder policy)" in text
    # 230.4 MB saved per step, 0.027 ms per token at q_len 2; 0.040 ms saved per token.
    assert ("| fp8-tensor | 1 | 100K | 0.300 | 0.260 | +0.040 | 460.8 -> 230.4 | 230.4 | "
            "0.027 | 1.48 |") in text


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed")
def test_balanced_only_rows_get_a_line_and_a_column(report):
    data = result_data()
    data["rows"] += [{**r, "policy": "balanced-only", "tpot_ms": r["tpot_ms"] * 1.1}
                     for r in data["rows"] if r["policy"] == "ladder"]
    plt = report.load_pyplot()
    fig = report.plot_figure(data, plt)
    assert "balanced-only" in fig_text(fig)[1]
    plt.close(fig)
    assert "balanced-only ms" in report.render_markdown(data)


def test_a_users_model_gets_its_config_line(report, tmp_path):
    data = result_data()
    data["meta"].update(model="transformers DeepseekV3ForCausalLM",
                        model_factory="bench.hf_tpot:deepseek_v3", transformers="5.24.0",
                        hf_config={"hidden_size": 7168, "num_attention_heads": 16,
                                   "rope_parameters": {"rope_type": "yarn"}},
                        weights_note="parameters one token reads")
    path = tmp_path / "h200-tpot-transformers.json"
    path.write_text(json.dumps(data))
    assert report.main(["--json", str(path), "--no-png"]) == 0
    text = (tmp_path / "h200-tpot-transformers.md").read_text()
    assert ("Model: `bench.hf_tpot:deepseek_v3` (transformers 5.24.0); hidden_size 7168, "
            "num_attention_heads 16; parameters one token reads.") in text
    plain = tmp_path / "plain"
    plain.mkdir()
    assert report.main(["--json", str(result_file(plain)), "--no-png"]) == 0
    assert "Model:" not in (plain / "h200-tpot.md").read_text()


def test_the_ladder_over_the_best_policy_round_by_round(report):
    # fixed-max is faster by median; round by round the ladder trails it by 2-4 % while the
    # clock drifts 20 % over the rounds (both policies alike).
    drift = [1.0, 1.1, 1.2, 1.05, 0.95]
    lad = [0.5 * d * r for d, r in zip(drift, [1.02, 1.03, 1.04, 1.03, 1.02], strict=True)]
    cells = {"ladder": {"tpot_ms": 0.52, "step_ms_rounds": lad},
             "fixed-max": {"tpot_ms": 0.50, "step_ms_rounds": [0.5 * d for d in drift]},
             "fixed-1": {"tpot_ms": 0.9, "step_ms_rounds": [0.9 * d for d in drift]}}
    med, lo, hi = report.ladder_over_best_paired(cells)
    assert med == pytest.approx(1.03) and lo == pytest.approx(1.02) and hi == pytest.approx(1.03)
    assert report.ladder_over_best_paired({"ladder": {"tpot_ms": 1.0}}) is None
    lines = report.markdown_batch(8, {4096: cells}, None)
    assert lines[2].endswith("| ladder / best, per round (quartiles) |")
    assert lines[4].endswith("| 1.030 (1.020-1.030) |")
    # Files without rounds keep their columns.
    old = report.markdown_batch(8, {4096: {p: {"tpot_ms": r["tpot_ms"]} for p, r in
                                           cells.items()}}, None)
    assert "per round" not in old[2]


def test_a_ratio_between_two_runs_of_one_plan_is_marked(report):
    # The ladder replays fixed-max's plan: their ratio is the harness's noise.
    rounds = [0.50, 0.52, 0.51]
    cells = {"ladder": {"tpot_ms": 0.51, "step_ms_rounds": [0.51, 0.52, 0.52],
                        "plan": "splits=2 seesaw"},
             "fixed-max": {"tpot_ms": 0.50, "step_ms_rounds": rounds, "plan": "splits=2 seesaw"},
             "fixed-1": {"tpot_ms": 0.9, "step_ms_rounds": [0.9] * 3, "plan": "splits=1"}}
    assert report.same_plan_as_best(cells)
    assert report.markdown_batch(8, {4096: cells}, None)[4].endswith("(same plan) |")
    # Another plan, or rows without plans (files before the field): no mark.
    cells["fixed-max"]["plan"] = "splits=4 seesaw"
    assert not report.same_plan_as_best(cells)
    assert not report.markdown_batch(8, {4096: cells}, None)[4].endswith("(same plan) |")
    bare = {p: {k: v for k, v in r.items() if k != "plan"} for p, r in cells.items()}
    assert not report.same_plan_as_best(bare)
