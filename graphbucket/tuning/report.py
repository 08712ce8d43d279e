"""The ladder tuner's report: the summary table, the markdown beside the report JSON and
the tuning figure (``scripts/tune_ladder.py``; matplotlib only when a figure is drawn).

Pure host code over a report dict (``meta``, ``ladder``, ``default_ladder``, ``summary``,
``rows`` and, where ragged mixes were timed, ``ragged``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from graphbucket.tuning.choose import TuneResult


def summary_table(result: TuneResult) -> str:
    lines = [f"tuned: {result.ladder!r}",
             "context batch | oracle us (splits) | tuned us (splits) x | default us (splits) x"]
    for r in result.rows:
        lines.append(f"{r['context']:>7} {r['batch']:>5} | {r['oracle_us']:9.2f} "
                     f"({r['oracle_splits']:>3}) | {r['tuned_us']:9.2f} ({r['tuned_splits']:>3}) "
                     f"{r['tuned_over_oracle']:.3f} | {r['default_us']:9.2f} "
                     f"({r['default_splits']:>3}) {r['default_over_oracle']:.3f}")
    lines.append(", ".join(f"{k} {v}" for k, v in result.summary.items()))
    return "\n".join(lines)


def bucket_text(bucket: dict) -> str:
    """``<=4096: hint 4096 (batch >= 8: 2048)`` from a bucket's JSON."""
    extra = "".join(f", batch >= {b}: {h}" for b, h in bucket.get("batch_hints", {}).items())
    return f"<={bucket['max_len']}: hint {bucket['hint']}" + (f" ({extra[2:]})" if extra else "")


def by_batch_text(summary: dict) -> str:
    changes = summary.get("batch_imbalance") or {}
    return "".join(f", from batch {b}: {t or 'off'}" for b, t in changes.items())


def single_text(summary: dict) -> str:
    if "single_threshold" not in summary:
        return ""
    return (f"one threshold for every batch size, {summary['single_threshold'] or 'off'}: "
            f"{summary['single_worst_over_best']:.3f}; ")


def switches_text(summary: dict) -> str:
    """Each length range's switch, e.g. '(4096, 8192]: 2.3, from batch 64: off'; a
    summary without ranges (one threshold for every length): its threshold."""
    if "switches" not in summary:
        return f"{summary['balanced_imbalance'] or 'off'}{by_batch_text(summary)}"
    return "; ".join(f"({sw['lo']}, {sw['hi']}]: {sw['balanced_imbalance'] or 'off'}"
                     f"{by_batch_text(sw)}" for sw in summary["switches"])


def reach_text(summary: dict) -> str:
    """The sentence on the kernel reach ``--kernel-neighbours auto`` chose, or ""."""
    chosen = summary.get("kernel_neighbours")
    if not chosen:
        return ""
    counts = "; ".join(f"{n} range(s): {f['above']} of {f['mixes']} (mean {f['mean']})"
                       for n, f in chosen["held_out_by_length"].items())
    return (f" Each range's balanced kernel is chosen from its own mixes and those of "
            f"{chosen['chosen']} range(s) on each side, the reach with the fewest mixes "
            f"above 1.02 when each mix length is replayed under the switch chosen from the "
            f"other (`--kernel-neighbours auto`): {counts}.")


def report_markdown(report: dict) -> str:
    """The report as a short markdown table (written beside the report JSON)."""
    meta, summary = report["meta"], report["summary"]
    bounds = ", ".join(bucket_text(b) for b in report["ladder"]["buckets"])
    fmt = meta.get("kv_cache", "bf16")
    q_len = meta.get("q_len", 1)
    lines = [f"# Tuned ladder, {meta['num_heads']} heads" + decoder_text(meta)
             + ("" if fmt == "bf16" else f", {fmt} cache")
             + ("" if q_len == 1 else f", q_len {q_len}") + f" ({meta['gpu']})", "",
             f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}. "
             f"Command: `{meta['command']}`", "", *cost_lines(meta), f"Tuned buckets: {bounds}",
             "",
             f"Time over the best measured split count (mean / worst): tuned "
             f"{summary['tuned_mean_over_oracle']:.3f} / {summary['tuned_max_over_oracle']:.3f},"
             f" default ladder {summary['default_mean_over_oracle']:.3f} / "
             f"{summary['default_max_over_oracle']:.3f}"
             + (f"; one hint shared by all batch sizes (same bucket limit) "
                f"{summary['shared_mean_over_oracle']:.3f} / "
                f"{summary['shared_max_over_oracle']:.3f}" if "shared_mean_over_oracle" in
                summary else "") + ".", "",
             "| context | batch | oracle us (splits) | tuned us (splits) | tuned x | "
             "default us (splits) | default x |", "|---|---|---|---|---|---|---|"]
    ragged = report.get("ragged")
    if ragged:
        best = ragged["summary"]
        one = (f"one switch for every length: {best['balanced_imbalance'] or 'off'}"
               f"{by_batch_text(best)}, {best['one_switch_worst_over_best']:.3f}; "
               if "switches" in best else single_text(best))
        lines[-2:-2] = [
            f"Balanced threshold (longest x live / total tokens) by the longest request's "
            f"length: {switches_text(best)}; chosen from {len(ragged['samples'])} ragged "
            f"mixes: worst {best['worst_over_best']:.3f} over the faster of split-KV and "
            f"balanced per mix ({one}balanced off: "
            f"{best['off_worst_over_best']:.3f}, always: "
            f"{best['always_worst_over_best']:.3f})"
            + (f"; over the fastest plan timed per mix (any balanced kernel): worst "
               f"{best['worst_over_fastest']:.3f}, mean {best['mean_over_fastest']:.4f}"
               if "worst_over_fastest" in best else "") + "." + reach_text(best), "",
            "| batch | mix | longest | imbalance | split-KV us | balanced us |",
            "|---|---|---|---|---|---|",
            *(f"| {r['batch']} | {r['mix']} | {max(r['lens'])} | {r['imbalance']:.2f} | "
              f"{r['split_us']:.1f} | {r['balanced_us']:.1f} |" for r in ragged["samples"]),
            ""]
    for r in report["rows"]:
        lines.append(f"| {r['context']} | {r['batch']} | {r['oracle_us']:.1f} "
                     f"({r['oracle_splits']}) | {r['tuned_us']:.1f} ({r['tuned_splits']}) | "
                     f"{r['tuned_over_oracle']:.3f} | {r['default_us']:.1f} "
                     f"({r['default_splits']}) | {r['default_over_oracle']:.3f} |")
    return "\n".join(lines) + "\n"


def cost_lines(meta: dict) -> list[str]:
    """What the tuning cost on the GPU (wall seconds of each timing phase, compiles
    included), as a paragraph; none for a report that did not record it."""
    if meta.get("measured_s") is None:
        return []
    parts = [f"split-KV table {meta['measured_s']:.0f} s (estimated {meta['estimate_s']:.0f})"]
    total = meta["measured_s"]
    for key, what in (("ragged_measured_s", "ragged mixes"), ("step_ties_s", "step ties")):
        if meta.get(key) is not None:
            parts.append(f"{what} {meta[key]:.0f} s")
            total += meta[key]
    return [f"Timing cost: {', '.join(parts)}; {total:.0f} s in all (goal: 300 s per "
            "ladder).", ""]


def decoder_text(meta: dict) -> str:
    """', sparse decode (top-k 2048)' for a sparse decoder's report, else ''."""
    return f", sparse decode (top-k {meta['topk']})" if meta.get("decoder") == "sparse" else ""


def figure_title(meta: dict) -> str:
    """What a tuning figure shows: the kernel shape, heads, cache format, q_len, batches,
    the GPU and when it was measured."""
    batches = " and ".join(str(b) for b in meta["batches"])
    what = (f"sparse MLA decode (indexer, top-k {meta['topk']}, attention)"
            if meta.get("decoder") == "sparse" else "MLA decode attention (576/512)")
    return (f"Ladder tuning: {what}, {meta['num_heads']} heads, "
            f"{meta.get('kv_cache', 'bf16')} cache, q_len {meta.get('q_len', 1)}, batch {batches}\n"
            f"{meta['gpu']}, measured {meta.get('measured_date', meta['date'])}")


def plot_figure(report: dict, plt):
    """The tuning figure of a report (``--report``'s JSON): per batch, kernel time against
    context (oracle, tuned and default ladders) and each ladder's time over the oracle's."""
    meta, rows = report["meta"], report["rows"]
    bounds = [b["max_len"] for b in report["ladder"]["buckets"]][:-1]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(2, len(batches), figsize=(6 * len(batches), 7.6), squeeze=False,
                             sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    styles = {"oracle": ("k", "o", "oracle: the best measured split count per context"),
              "tuned": ("tab:blue", "s",
                        f"tuned ladder ({len(report['ladder']['buckets'])} buckets)"),
              "default": ("tab:orange", "^", f"default ladder "
                          f"({len(report['default_ladder']['buckets'])} buckets)")}
    for col, batch in enumerate(batches):
        mine = [r for r in rows if r["batch"] == batch]
        ctx = [r["context"] for r in mine]
        top, bottom = axes[0][col], axes[1][col]
        for name, (color, marker, label) in styles.items():
            top.loglog(ctx, [r[f"{name}_us"] for r in mine], color=color, marker=marker,
                       label=label, lw=1.2, ms=4)
            if name != "oracle":
                bottom.semilogx(ctx, [r[f"{name}_over_oracle"] for r in mine], color=color,
                                marker=marker, lw=1.2, ms=4)
        for i, bound in enumerate(bounds):
            for ax in (top, bottom):
                ax.axvline(bound, color="tab:blue", alpha=0.45, lw=1.0, ls="-.",
                           label="tuned bucket bounds" if i == 0 and ax is top else None)
        bottom.axhline(1.03, color="grey", ls="--", lw=0.8, label="3 % above the oracle")
        top.set_title(f"batch {batch}")
        top.set_ylabel("decode attention, us (log)")
        bottom.set_ylabel("time / oracle time")
        bottom.set_xlabel("context length (tokens)")
        for ax in (top, bottom):  # minor x lines would look like bucket bounds
            ax.grid(True, which="major", alpha=0.3)
            ax.grid(True, which="minor", axis="y", alpha=0.15)
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    fig.suptitle(figure_title(meta))
    fig.legend(list(handles.values()), list(handles), loc="upper center", ncol=3,
               bbox_to_anchor=(0.5, 0.925), frameon=False, fontsize=9)
    fig.subplots_adjust(left=0.07, right=0.985, bottom=0.075, top=0.80, hspace=0.06,
                        wspace=0.18)
    return fig


def render_png(report: dict, path: Path) -> bool:
    """Write the tuning figure; False (and a note on stderr) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipped the PNG plot (pip install matplotlib; "
              "re-plot later with --from-times)", file=sys.stderr)
        return False
    fig = plot_figure(report, plt)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
