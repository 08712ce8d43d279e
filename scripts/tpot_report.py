"""Render bench/tpot.py's JSON: a markdown TPOT table per batch size and a PNG figure.

Table columns follow the tables engines publish with such fixes: context, the ladder's
bucket (and hint, split count), TPOT per policy, the roofline floor, the ladder's speedup
over ``fixed-1``, its TPOT reduction and its ratio to the default ladder (marked where
both replay the same plan). Below the tables, the issue's targets at batch 1 and the tuned
ladder's target against the default ladder are checked against the numbers.

The figure has one column per batch size and three panels: TPOT against context (log
scales), each policy's TPOT over the ladder's (linear, the ladder is the 1.0 line) and the
ladder's speedup over ``fixed-1``. The table needs only the standard library; the figure
needs matplotlib (``python3 -m pip install matplotlib``).

A run over several cache formats (``bench/tpot.py --kv-cache bf16 fp8-tensor fp8-v32``)
gets the tables and targets once per format, then the fp8 breakdown: per batch and context,
the ladder's TPOT with each fp8 cache against bf16, the attention (KV) bytes one step no
longer reads, and what those bytes take at the run's copy bandwidth; the target is a TPOT
difference at least that large at 100K, batch 1. Its figure shows every format: the
ladder's and fixed-1's TPOT with each format's floor, each fp8 ladder's TPOT over bf16's
(beside what its KV bytes saved predict), and each format's speedup over fixed-1. Files
without ``kv_cache`` in their rows are one format (the meta's).

Every figure's title names the model (heads, layers), the cache formats, the q_len, the
batch sizes, the GPU and the date; every line and band is in its legend.

Verify-step runs (``bench/tpot.py --q-len 1 2 4``) are rendered one q_len at a time
(``--q-len``, default 1; other values write ``<json stem>-q<N>.md``); a run with several
formats and q_lens gets the per-format sections and the fp8 breakdown for that q_len.

Outputs default to the JSON's name with ``.md`` / ``.png``; an existing file is only
replaced with ``--force``:

    python3 scripts/tpot_report.py --json bench/results/h200-tpot.json --force
    python3 scripts/tpot_report.py --json r/h200-tpot.json --out-md /tmp/t.md --no-png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphbucket import fp8  # noqa: E402
from graphbucket.ladder import Bucket  # noqa: E402

# "ladder" is the runner's choice (the shipped tuned ladder of the GPU when there is one);
# "default-ladder" the field's five buckets.
POLICIES = ("eager", "fixed-1", "fixed-max", "balanced-only", "default-ladder", "ladder")

# One line per policy, for the figure's footnote and the markdown's glossary.
POLICY_TEXT = {
    "eager": "no CUDA graphs; every step is planned from the live lengths and run eagerly",
    "fixed-1": "one graph per batch size, planned for 1 token (1 KV split at any context)",
    "fixed-max": "one graph per batch size, planned for max_model_len (the most KV "
                 "splits at any context)",
    "balanced-only": "one balanced split-KV graph per batch size (device-partitioned equal "
                     "chunks of the batch's tokens, at any context)",
    "default-ladder": "one graph per batch size and bucket of the default ladder "
                      "(<=64, 4K, 16K, 64K, max; each planned for its top)",
    "ladder": "one graph per batch size and bucket of the ladder tuned for this GPU "
              "(the runner's default; the default ladder where none is shipped)",
}

# Older files name the cache by its dtype in meta["kv_cache"]: the format a cache of that
# dtype is read as.
FORMAT_OF_DTYPE = {str(d).removeprefix("torch."): f.name for f in fp8.CACHE_FORMATS.values()
                   for d in f.stored_dtypes}
# The fp8 rows' targets: the ladder at least this many times faster than fixed-1 at 100K.
FP8_LADDER_SPEEDUP = 30.0

# Two runs of the same captured plan differ by up to ~1 % (same-plan rows of the H200 runs).
NOISE = 0.01
# The short-context range where the ladder must not be slower than fixed-1.
SHORT = 2048

# matplotlib style per policy: colour, marker, line style, line width.
STYLE = {
    "eager": ("0.55", "x", "-", 1.2),
    "fixed-1": ("tab:orange", "s", "-", 1.4),
    "fixed-max": ("tab:green", "^", "--", 1.4),
    "balanced-only": ("tab:red", "v", "-.", 1.4),
    "default-ladder": ("tab:purple", "D", ":", 1.6),
    "ladder": ("tab:blue", "o", "-", 2.4),
}
# Upper edge of the linear ratio panel: policies above it leave the panel at its top.
RATIO_TOP = 1.08
# Contexts whose speedup over fixed-1 is written next to its point (and the headline's).
LABELLED = (256, 1024, 2048, 4096, 16384)
# The headline speedup is read at the measured context nearest this.
HEADLINE = 100_000
# Legend labels the panels share.
FLOOR_LABEL = "roofline floor (see note below)"
NOISE_LABEL = f"\u00b1{100 * NOISE:.0f} % run-to-run spread of one plan"
SPEEDUP_LABEL = "ladder speedup over fixed-1"
FORMAT_COLOR = {"bf16": "tab:blue", "fp8-tensor": "tab:green", "fp8-v32": "tab:red"}
INSTALL = "python3 -m pip install matplotlib"


def fmt_context(n: int) -> str:
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}K"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}K"
    return str(n)


def bucket_label(ladder: list[dict] | None, context: int, splits: int | None,
                 batch: int = 1) -> str:
    if not ladder:
        return "-"
    lower = 0
    for b in ladder:
        if context <= b["max_len"]:
            bucket = Bucket(b["max_len"], b["hint"], batch_hints={
                int(k): v for k, v in b.get("batch_hints", {}).items()})
            tail = "" if splits is None else f", {splits} split{'s' * (splits != 1)}"
            return (f"{fmt_context(lower + 1)}-{fmt_context(b['max_len'])} "
                    f"(hint {fmt_context(bucket.hint_for(batch))}{tail})")
        lower = b["max_len"]
    return "above the ladder"


def row_format(row: dict, meta: dict) -> str:
    """The cache format of a row: its ``kv_cache``, else the file's (older files: bf16 or
    the meta's dtype)."""
    if "kv_cache" in row:
        return row["kv_cache"]
    fmt = meta.get("kv_cache") or fp8.DEFAULT_FORMAT
    return FORMAT_OF_DTYPE.get(fmt, fmt)


def rows_by_format(data: dict) -> dict[str, list[dict]]:
    """format -> its rows, in the order bf16, fp8-tensor, fp8-v32 (others after them)."""
    out: dict[str, list[dict]] = {}
    for r in data["rows"]:
        out.setdefault(row_format(r, data["meta"]), []).append(r)
    order = fp8.KV_CACHE_FORMATS
    return dict(sorted(out.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order
                       else len(order)))


def ladder_of(meta: dict, fmt: str) -> list[dict] | None:
    """The ladder buckets the format's ladder policy captured (None: no bucket column)."""
    ladder = meta.get("per_format", {}).get(fmt, {}).get("ladder", meta.get("ladder"))
    if not (isinstance(ladder, list) and all(isinstance(b, dict) for b in ladder)):
        return None  # another script's layout
    return ladder


def table(rows: list[dict]) -> dict[int, dict[int, dict[str, dict]]]:
    """batch -> context -> policy -> row."""
    out: dict[int, dict[int, dict[str, dict]]] = {}
    for r in rows:
        out.setdefault(r["batch"], {}).setdefault(r["context"], {})[r["policy"]] = r
    return out


def _ms(row: dict | None) -> str:
    return f"{row['tpot_ms']:.3f}" if row else "-"


def _floor(cells: dict[str, dict]) -> float | None:
    return next((r["floor_ms"] for r in cells.values() if "floor_ms" in r), None)


# --- the numbers the figure and the targets share ---------------------------------------

def ratio_series(by_ctx: dict[int, dict[str, dict]],
                 reference: str = "ladder") -> dict[str, list[tuple[int, float]]]:
    """policy -> [(context, policy TPOT / reference TPOT)], contexts ascending.

    Above 1 the policy is slower than the reference; the reference itself is left out.
    """
    out: dict[str, list[tuple[int, float]]] = {}
    for context in sorted(by_ctx):
        cells = by_ctx[context]
        if reference not in cells:
            continue
        ref = cells[reference]["tpot_ms"]
        for policy in POLICIES:
            if policy != reference and policy in cells:
                out.setdefault(policy, []).append((context, cells[policy]["tpot_ms"] / ref))
    return out


def speedup_series(by_ctx: dict[int, dict[str, dict]], slow: str = "fixed-1",
                   fast: str = "ladder") -> list[tuple[int, float]]:
    """[(context, slow TPOT / fast TPOT)]: how many times faster ``fast`` is."""
    return [(c, by_ctx[c][slow]["tpot_ms"] / by_ctx[c][fast]["tpot_ms"])
            for c in sorted(by_ctx) if slow in by_ctx[c] and fast in by_ctx[c]]


def ladder_over_best(by_ctx: dict[int, dict[str, dict]]) -> dict[int, float]:
    """context -> ladder TPOT / the fastest policy's TPOT at that context (>= 1)."""
    return {c: v["ladder"]["tpot_ms"] / min(r["tpot_ms"] for r in v.values())
            for c, v in sorted(by_ctx.items()) if "ladder" in v}


def ladder_over_best_paired(cells: dict[str, dict]) -> tuple[float, float, float] | None:
    """The ladder's time over the fastest other policy's (by median), taken round by round
    (rows with ``step_ms_rounds``: each round timed every policy once, so a round's ratio
    cancels the clock's drift): (median, lower quartile, upper quartile) of those ratios;
    above 1 the ladder is slower. None without rounds."""
    lad = cells.get("ladder", {}).get("step_ms_rounds")
    others = [r for p, r in cells.items() if p != "ladder" and r.get("step_ms_rounds")]
    if not lad or not others:
        return None
    best = min(others, key=lambda r: r["tpot_ms"])["step_ms_rounds"]
    ratios = sorted(a / b for a, b in zip(lad, best, strict=False))
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else \
        [ratios[0]] * 3
    return q[1], q[0], q[2]


def same_plan_as_best(cells: dict[str, dict]) -> bool:
    """Whether the ladder replays the plan of the fastest other policy (rows with ``plan``):
    then their ratio is the harness's noise, not a choice of the ladder's."""
    lad = cells.get("ladder", {}).get("plan")
    others = [r for p, r in cells.items() if p != "ladder"]
    return bool(lad and others and min(others, key=lambda r: r["tpot_ms"]).get("plan") == lad)


def worst_short(by_ctx: dict[int, dict[str, dict]], limit: int = SHORT
                ) -> tuple[int, float] | None:
    """(context, ladder TPOT / fixed-1 TPOT) at its largest over contexts <= ``limit``."""
    short = [(c, r) for c, r in speedup_series(by_ctx, slow="ladder", fast="fixed-1")
             if c <= limit]
    return max(short, key=lambda cr: cr[1]) if short else None


def model_config_line(meta: dict) -> str:
    """A user's model (``bench/tpot.py --model``): its factory, versions and config."""
    config = ", ".join(f"{k} {v}" for k, v in meta["hf_config"].items()
                       if not isinstance(v, dict))
    return (f"Model: `{meta.get('model_factory')}` (transformers {meta.get('transformers')}); "
            f"{config}; {meta.get('weights_note', '')}.")


def floor_text(meta: dict) -> str:
    """What the floor is, with the run's numbers."""
    weights = f"weights, {meta['weights_mb']:.1f} MB" if meta.get("weights_mb") else "weights"
    gbps = f"{meta['copy_gbps']:.1f} GB/s" if meta.get("copy_gbps") else "the copy bandwidth"
    return (f"floor: a roofline lower bound for one decode step: the bytes the step must read "
            f"({weights}; the KV cache rows of every layer for batch x context "
            f"tokens; the activations) divided by the device-to-device copy bandwidth "
            f"measured in the same run ({gbps}, bytes read + written). Split-KV partials "
            f"are not counted.")


# --- markdown ---------------------------------------------------------------------------

def markdown_batch(batch: int, by_ctx: dict[int, dict[str, dict]], ladder) -> list[str]:
    policies = [p for p in POLICIES if any(p in v for v in by_ctx.values())]
    paired = any(ladder_over_best_paired(v) for v in by_ctx.values())
    head = ["context", "bucket (hint, splits)", *(f"{p} ms" for p in policies), "floor ms",
            "ladder vs fixed-1", "TPOT reduction", "ladder / default-ladder",
            *(["ladder / best, per round (quartiles)"] if paired else [])]
    lines = [f"### batch {batch}", "", "| " + " | ".join(head) + " |",
             "|" + "|".join(["---:", "---"] + ["---:"] * (len(head) - 2)) + "|"]
    for context in sorted(by_ctx):
        cells = by_ctx[context]
        ladder_row, fixed_row = cells.get("ladder"), cells.get("fixed-1")
        speed = red = vs_default = "-"
        if ladder_row and fixed_row:
            f, lad = fixed_row["tpot_ms"], ladder_row["tpot_ms"]
            speed, red = f"{f / lad:.2f}x", f"{100 * (f - lad) / f:.1f} %"
        default_row = cells.get("default-ladder")
        if ladder_row and default_row:
            same = ladder_row.get("splits") == default_row.get("splits")
            vs_default = (f"{ladder_row['tpot_ms'] / default_row['tpot_ms']:.3f}"
                          + (" (same plan)" if same else ""))
        splits = ladder_row.get("splits") if ladder_row else None
        floor = _floor(cells)
        rounds = ladder_over_best_paired(cells) if paired else None
        extra = [] if not paired else [
            "-" if rounds is None else f"{rounds[0]:.3f} ({rounds[1]:.3f}-{rounds[2]:.3f})"
            + (" (same plan)" if same_plan_as_best(cells) else "")]
        lines.append("| " + " | ".join([fmt_context(context), bucket_label(ladder, context,
                                                                          splits, batch),
                                        *(_ms(cells.get(p)) for p in policies),
                                        "-" if floor is None else f"{floor:.3f}", speed, red,
                                        vs_default, *extra]) + " |")
    return lines + [""]


def check_targets(by_ctx: dict[int, dict[str, dict]]) -> list[str]:
    """The issue's batch-1 targets, each as a PASS/FAIL line with the measured number."""
    out = []

    def ms(ctx, policy):
        return by_ctx.get(ctx, {}).get(policy, {}).get("tpot_ms")

    if ms(100_000, "ladder") and ms(100_000, "fixed-1"):
        s = ms(100_000, "fixed-1") / ms(100_000, "ladder")
        out.append(f"{'PASS' if s >= 3 else 'FAIL'}: ladder {s:.2f}x faster than fixed-1 at "
                   "100K (target >= 3x)")
    worst = worst_short(by_ctx)
    if worst:
        # One-sided: the ladder must not regress short contexts; being faster is no failure.
        d = 100 * (worst[1] - 1)
        out.append(f"{'PASS' if d <= 1 else 'FAIL'}: ladder at most {d:+.2f} % against "
                   f"fixed-1 at every context <= {fmt_context(SHORT)} (worst "
                   f"{fmt_context(worst[0])}; target +1 %)")
    ratios = ladder_over_best(by_ctx)
    if ratios:
        c = max(ratios, key=ratios.get)
        out.append(f"{'PASS' if ratios[c] <= 1.02 else 'FAIL'}: ladder at most {ratios[c]:.3f}x "
                   f"the fastest policy (worst {fmt_context(c)}; target 1.02x)")
    row = by_ctx.get(100_000, {}).get("ladder")
    if row and row.get("floor_ms"):
        f = row["tpot_ms"] / row["floor_ms"]
        out.append(f"{'PASS' if f <= 1.3 else 'FAIL'}: ladder {f:.2f}x floor_ms at 100K "
                   "(target 1.3x)")
    return [f"- {line}" for line in out]


def check_tuned(by_batch: dict[int, dict[int, dict[str, dict]]]) -> list[str]:
    """Where the tuned and default ladders plan different launches, the tuned one must not be
    slower; where they plan the same launch, the spread between the two runs is noise."""
    differ, same = [], []
    for batch, by_ctx in by_batch.items():
        for context, cells in by_ctx.items():
            lad, default = cells.get("ladder"), cells.get("default-ladder")
            if lad and default:
                ratio = lad["tpot_ms"] / default["tpot_ms"]
                (same if lad.get("splits") == default.get("splits") else differ).append(
                    (ratio, batch, context))
    out = []
    if same:
        r, b, c = max(same)
        out.append(f"same plan at {len(same)} (batch, context) points: run-to-run spread up "
                   f"to {100 * (r - 1):+.2f} % (batch {b}, {fmt_context(c)})")
    if differ:
        r, b, c = max(differ)
        best = min(differ)
        out.append(f"{'PASS' if r <= 1.0 + NOISE else 'FAIL'}: where the plans differ "
                   f"({len(differ)} points) the tuned ladder is at worst {r:.3f}x the default "
                   f"(batch {b}, {fmt_context(c)}) and at best {best[0]:.3f}x (batch "
                   f"{best[1]}, {fmt_context(best[2])}); target: never slower (beyond "
                   f"{100 * NOISE:.1f} % noise)")
    return [f"- {line}" for line in out]


def format_sections(rows: list[dict], ladder: list[dict] | None) -> list[str]:
    """One format's tables per batch, its batch-1 targets and the tuned-ladder check."""
    by_batch, lines = table(rows), []
    for batch in sorted(by_batch):
        lines += markdown_batch(batch, by_batch[batch], ladder)
    if 1 in by_batch:
        lines += ["### targets (batch 1)", "", *check_targets(by_batch[1]), ""]
    tuned = check_tuned(by_batch)
    if tuned:
        lines += ["### tuned ladder against the default ladder (every batch size)", "",
                  *tuned, ""]
    return lines


def fp8_breakdown(by_format: dict[str, list[dict]], meta: dict) -> list[str]:
    """Each fp8 format's ladder TPOT against bf16's, with the attention bytes saved."""
    if "bf16" not in by_format or len(by_format) < 2:
        return []
    gbps, base = meta.get("copy_gbps"), table(by_format["bf16"])
    lines = ["## fp8 caches against bf16 (ladder policy)", "",
             "Attention bytes saved: the KV rows one step reads (every layer, batch x context "
             "tokens) with a bf16 cache minus with the fp8 one. Predicted: those bytes at "
             f"the run's copy bandwidth ({gbps} GB/s, as the floor), per token for verify "
             "steps (/ q_len, as TPOT). Measured / predicted above 1: the step saved more "
             "than the bytes alone explain.", "",
             "| format | batch | context | bf16 ms | fp8 ms | TPOT saved ms | KV MB bf16 -> "
             "fp8 | attention MB saved | predicted ms | measured / predicted |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    targets = []
    for fmt, rows in by_format.items():
        if fmt == "bf16":
            continue
        by_batch = table(rows)
        for batch in sorted(by_batch):
            for context in sorted(by_batch[batch]):
                a = base.get(batch, {}).get(context, {}).get("ladder")
                b = by_batch[batch][context].get("ladder")
                if not (a and b):
                    continue
                saved = a["tpot_ms"] - b["tpot_ms"]
                mb = (a["kv_mb"] - b["kv_mb"]) if "kv_mb" in a and "kv_mb" in b else None
                # Per token, as tpot_ms: a verify step reads the rows once for q_len tokens.
                pred = mb / gbps / b.get("q_len", 1) if mb is not None and gbps else None
                lines.append(
                    f"| {fmt} | {batch} | {fmt_context(context)} | {a['tpot_ms']:.3f} | "
                    f"{b['tpot_ms']:.3f} | {saved:+.3f} | "
                    + (f"{a['kv_mb']:.1f} -> {b['kv_mb']:.1f} | {mb:.1f}" if mb is not None
                       else "- | -")
                    + (f" | {pred:.3f} | {saved / pred:.2f}" if pred else " | - | -") + " |")
                if batch == 1 and context == 100_000 and pred:
                    targets.append(
                        f"{'PASS' if saved >= pred else 'FAIL'}: {fmt} ladder {saved:.3f} ms "
                        f"below bf16 at 100K ({b['tpot_ms']:.3f} against {a['tpot_ms']:.3f} "
                        f"ms); the {mb:.1f} MB of attention bytes saved take {pred:.3f} ms "
                        "(target: at least that)")
        fixed = by_batch.get(1, {}).get(100_000, {}).get("fixed-1")
        lad = by_batch.get(1, {}).get(100_000, {}).get("ladder")
        if fixed and lad:
            x = fixed["tpot_ms"] / lad["tpot_ms"]
            targets.append(f"{'PASS' if x >= FP8_LADDER_SPEEDUP else 'FAIL'}: {fmt} ladder "
                           f"{x:.2f}x faster than fixed-1 at 100K (target >= "
                           f"{FP8_LADDER_SPEEDUP:g}x)")
    lines.append("")
    if targets:
        lines += ["### fp8 targets (batch 1)", "", *(f"- {t}" for t in targets), ""]
    return lines


def render_markdown(data: dict, png_link: str | None = None) -> str:
    """The report; ``png_link`` (a path relative to the markdown) adds the figure."""
    meta, by_format = data["meta"], rows_by_format(data)
    policies = [p for p in POLICIES if any(r["policy"] == p for r in data["rows"])]
    has_floor = any("floor_ms" in r for r in data["rows"])
    lines = [f"# TPOT per policy: {meta.get('model')}, {meta.get('layers')} layers "
             f"({meta.get('gpu')})", "",
             f"{meta.get('date')}, torch {meta.get('torch')}, triton {meta.get('triton')}, "
             f"copy bandwidth {meta.get('copy_gbps')} GB/s (read + write). "
             f"Command: `{meta.get('command')}`", "",
             *([model_config_line(meta), ""] if meta.get("hf_config") else []),
             "TPOT: one full decode step (graph replay, or the eager forward), milliseconds. "
             "Context counts the decoded token."
             + ("" if list(by_format) == ["bf16"] else
                f" Latent cache formats: {', '.join(by_format)} (graphbucket.fp8)."), "",
             *(f"- {p}: {POLICY_TEXT[p]}" for p in policies),
             *([f"- {floor_text(meta)}"] if has_floor else []), ""]
    if png_link and len(by_format) == 1:
        lines += [f"![TPOT per policy, ratios to the ladder, speedup over fixed-1]({png_link})",
                  "", "Figure: top, TPOT per policy (log scales); middle, each policy's TPOT "
                  "over the ladder's (the ladder is the 1.0 line; the grey band, "
                  f"{100 * NOISE:.0f} % either side, is the spread between two runs of one "
                  "plan); bottom, the ladder's speedup over fixed-1.", ""]
    elif png_link:
        lines += [f"![TPOT per cache format, fp8 against bf16, speedup over fixed-1]"
                  f"({png_link})", "", "Figure: top, TPOT of the ladder (solid) and fixed-1 "
                  "(dashed) per cache format, with each format's roofline floor (dotted; log "
                  "scales); middle, each fp8 format's ladder TPOT over bf16's (linear; "
                  "dashed: bf16's TPOT less the KV bytes the format saves at the copy "
                  f"bandwidth; the grey band, {100 * NOISE:.0f} % either side, is the spread "
                  "between two runs of one plan); bottom, each format's ladder speedup over "
                  "fixed-1.", ""]
    if len(by_format) == 1:
        fmt, rows = next(iter(by_format.items()))
        lines += format_sections(rows, ladder_of(meta, fmt))
        return "\n".join(lines)
    for fmt, rows in by_format.items():
        source = meta.get("per_format", {}).get(fmt, {}).get("ladder_source")
        lines += [f"## {fmt} cache" + (f" (ladder: {source})" if source else ""), "",
                  *format_sections(rows, ladder_of(meta, fmt))]
    lines += fp8_breakdown(by_format, meta)
    return "\n".join(lines)


# --- figure -----------------------------------------------------------------------------

def load_pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _context_axis(ax, contexts: list[int]) -> None:
    ax.set_xscale("log")
    ticks = [c for c in (1, 64, 256, 1024, 4096, 16384, 131072)
             if contexts[0] <= c <= contexts[-1]]
    ax.set_xticks(ticks, [fmt_context(c) for c in ticks])
    ax.set_xticks([], minor=True)
    ax.grid(True, which="major", alpha=0.3)


def _plot_kw(policy: str, **extra) -> dict:
    color, marker, ls, lw = STYLE[policy]
    return {"color": color, "marker": marker, "ls": ls, "lw": lw, "ms": 4,
            "zorder": 5 if policy == "ladder" else 3, "label": policy, **extra}


def headline_context(contexts) -> int | None:
    """The measured context nearest 100K, where the headline speedup is read (a run over
    1 .. 128K in powers of two has 102400 there, not 100000)."""
    return min(contexts, key=lambda c: abs(c - HEADLINE)) if contexts else None


def num_heads(meta: dict) -> int | None:
    """Attention heads of the run's model: its meta's, else its preset's (older files)."""
    if meta.get("num_heads"):
        return meta["num_heads"]
    from graphbucket.models import PRESETS

    preset = PRESETS.get(meta.get("model"))
    return preset().num_heads if preset else None


def figure_title(data: dict) -> str:
    """What a figure shows: model (heads, layers), cache formats, q_len, batches, GPU, date."""
    meta, by_format = data["meta"], rows_by_format(data)
    heads = num_heads(meta)
    model = (f"{meta.get('model')} ({f'{heads} heads, ' if heads else ''}"
             f"{meta.get('layers')} layers)")
    q_lens = sorted({r.get("q_len", 1) for r in data["rows"]})
    batches = " and ".join(str(b) for b in sorted({r["batch"] for r in data["rows"]}))
    what = ("TPOT per policy" if len(by_format) == 1 else
            "TPOT per cache format (ladder and fixed-1)")
    caches = " / ".join(by_format) + (" cache" if len(by_format) == 1 else " caches")
    return (f"{what}: {model}, {caches}, q_len {', '.join(map(str, q_lens))}, batch "
            f"{batches}\n{meta.get('gpu')}, {meta.get('date')}")


def _headline_text(speed: list[tuple[int, float]], name: str = "") -> str | None:
    at = dict(speed)
    c = headline_context(list(at))
    if c is None:
        return None
    return (f"{fmt_context(c)}: ladder {at[c]:.1f}x faster than fixed-1"
            + (f" ({name})" if name else ""))


def _speedup_axis(ax, speeds: list[list[tuple[int, float]]]) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.axhline(1.0, color="0.4", lw=0.8, label="1x: as fast as fixed-1")
    ax.set_yscale("log")
    top_s = max((s for speed in speeds for _, s in speed), default=1.0)
    ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200) if t <= top_s * 1.5]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_ylim(0.8, top_s * 2)
    ax.set_ylabel("fixed-1 TPOT / ladder TPOT (log)\nthe ladder's speedup over fixed-1")
    ax.set_xlabel("context (tokens, log scale)")


def _note(ax, lines: list[str]) -> None:
    if lines:
        ax.text(0.02, 0.96, "\n".join(lines), transform=ax.transAxes, va="top", fontsize=9,
                bbox={"facecolor": "white", "edgecolor": "0.7", "alpha": 0.9})


def _short_band(ax, ctxs: list[int]) -> None:
    ax.axvspan(ctxs[0] / 1.3, SHORT * 1.15, color="tab:orange", alpha=0.07, zorder=0,
               label=f"\u2264 {fmt_context(SHORT)}: the ladder must not be slower than fixed-1")


def _policy_column(axes_col, by_ctx: dict[int, dict[str, dict]], batch: int) -> None:
    """One batch size of a one-format figure: TPOT per policy, ratios, speedup."""
    ctxs = sorted(by_ctx)
    top, mid, bottom = axes_col

    for policy in POLICIES:
        pts = [(c, by_ctx[c][policy]["tpot_ms"]) for c in ctxs if policy in by_ctx[c]]
        if pts:
            top.plot(*zip(*pts, strict=True), **_plot_kw(policy))
    floor = [(c, f) for c in ctxs if (f := _floor(by_ctx[c])) is not None]
    if floor:
        top.plot(*zip(*floor, strict=True), color="k", ls="--", lw=1.2, label=FLOOR_LABEL)
    top.set_yscale("log")
    top.set_ylabel("TPOT, ms (log)")
    top.set_title(f"batch {batch}", fontsize=13, fontweight="bold")
    top.grid(True, which="minor", axis="y", alpha=0.15)

    # Each policy over the ladder, linear.
    ratios = ratio_series(by_ctx)
    mid.axhspan(1 - NOISE, 1 + NOISE, color="0.85", zorder=0, label=NOISE_LABEL)
    mid.axhline(1.0, **{k: v for k, v in _plot_kw("ladder").items()
                        if k not in ("marker", "ms")})
    for policy, pts in ratios.items():
        mid.plot(*zip(*pts, strict=True), **_plot_kw(policy))
    lows = [r for pts in ratios.values() for _, r in pts]
    mid.set_ylim(min(0.975, min(lows, default=1) - 0.005), RATIO_TOP)
    mid.set_ylabel("TPOT / ladder TPOT (linear)\nabove 1.0: slower than the ladder")
    off = [f"{p} {min(r for _, r in pts):.1f}-{max(r for _, r in pts):.1f}x"
           for p, pts in ratios.items() if min(r for _, r in pts) > RATIO_TOP]
    leaves = [f"{p} from {fmt_context(next(c for c, r in pts if r > RATIO_TOP))}"
              for p, pts in ratios.items()
              if min(r for _, r in pts) <= RATIO_TOP < max(r for _, r in pts)]
    best = ladder_over_best(by_ctx)
    note = []
    if best:
        wc = max(best, key=best.get)
        note.append(f"ladder \u2264 {best[wc]:.3f}x the fastest policy at every context "
                    f"(worst {fmt_context(wc)})")
    if leaves or off:
        note.append("above the panel: " + ", ".join(leaves + off))
    _note(mid, note)

    # The ladder's speedup over fixed-1.
    speed = speedup_series(by_ctx)
    _speedup_axis(bottom, [speed])
    if speed:
        _short_band(bottom, ctxs)
        bottom.plot(*zip(*speed, strict=True), color="tab:blue", marker="o", lw=2.0, ms=4,
                    label=SPEEDUP_LABEL)
        labelled = {*LABELLED, headline_context([c for c, _ in speed])}
        for c, s in speed:
            if c in labelled:
                bottom.annotate(f"{s:.1f}x" if s < 10 else f"{s:.0f}x", (c, s),
                                textcoords="offset points", xytext=(-5, 5), ha="right",
                                fontsize=8.5)
        worst = worst_short(by_ctx)
        lines = []
        if worst:
            lines.append(f"\u2264 {fmt_context(SHORT)} (shaded): ladder at worst "
                         f"{100 * (worst[1] - 1):+.2f} % against fixed-1 "
                         f"(at {fmt_context(worst[0])})")
        lines += [t for t in [_headline_text(speed)] if t]
        _note(bottom, lines)
    for ax in axes_col:
        _context_axis(ax, ctxs)


def _format_column(axes_col, by_format: dict[str, dict[int, dict[str, dict]]], batch: int,
                   gbps: float | None) -> None:
    """One batch size of a several-format figure: TPOT of the ladder and fixed-1 per format
    with its floor, each fp8 ladder over bf16's (and what its bytes predict), speedups."""
    top, mid, bottom = axes_col
    ctxs = sorted({c for by_ctx in by_format.values() for c in by_ctx})
    for i, (fmt, by_ctx) in enumerate(by_format.items()):
        color = FORMAT_COLOR.get(fmt, f"C{i + 3}")
        mine = sorted(by_ctx)
        for policy, ls, marker, lw in (("ladder", "-", "o", 2.2), ("fixed-1", "--", "s", 1.2)):
            pts = [(c, by_ctx[c][policy]["tpot_ms"]) for c in mine if policy in by_ctx[c]]
            if pts:
                top.plot(*zip(*pts, strict=True), color=color, ls=ls, marker=marker, lw=lw,
                         ms=4, label=f"{fmt}: {policy}")
        floor = [(c, f) for c in mine if (f := _floor(by_ctx[c])) is not None]
        if floor:
            top.plot(*zip(*floor, strict=True), color=color, ls=":", lw=1.2,
                     label=f"{fmt}: roofline floor")
    top.set_yscale("log")
    top.set_ylabel("TPOT, ms (log)")
    top.set_title(f"batch {batch}", fontsize=13, fontweight="bold")
    top.grid(True, which="minor", axis="y", alpha=0.15)

    base = by_format.get("bf16", {})
    mid.axhspan(1 - NOISE, 1 + NOISE, color="0.85", zorder=0, label=NOISE_LABEL)
    mid.axhline(1.0, color=FORMAT_COLOR["bf16"], lw=2.2, label="bf16: ladder")
    note = []
    for i, (fmt, by_ctx) in enumerate(by_format.items()):
        if fmt == "bf16":
            continue
        color = FORMAT_COLOR.get(fmt, f"C{i + 3}")
        measured, predicted = [], []
        for c in sorted(by_ctx):
            a, b = base.get(c, {}).get("ladder"), by_ctx[c].get("ladder")
            if not (a and b):
                continue
            measured.append((c, b["tpot_ms"] / a["tpot_ms"]))
            if gbps and "kv_mb" in a and "kv_mb" in b:
                saved = (a["kv_mb"] - b["kv_mb"]) / gbps / b.get("q_len", 1)
                predicted.append((c, (a["tpot_ms"] - saved) / a["tpot_ms"]))
        if measured:
            mid.plot(*zip(*measured, strict=True), color=color, marker="o", lw=2.0, ms=4,
                     label=f"{fmt}: ladder")
            c, r = measured[-1]
            note.append(f"{fmt} at {fmt_context(c)}: {r:.3f}x bf16's TPOT")
        if predicted:
            mid.plot(*zip(*predicted, strict=True), color=color, ls="--", lw=1.0,
                     label=f"{fmt}: expected from the KV bytes it saves")
    mid.set_ylabel("ladder TPOT / bf16 ladder TPOT\n(linear; below 1.0: faster than bf16)")
    _note(mid, note)

    speeds = {fmt: speedup_series(by_ctx) for fmt, by_ctx in by_format.items()}
    _speedup_axis(bottom, list(speeds.values()))
    _short_band(bottom, ctxs)
    lines = []
    for i, (fmt, speed) in enumerate(speeds.items()):
        if speed:
            bottom.plot(*zip(*speed, strict=True), color=FORMAT_COLOR.get(fmt, f"C{i + 3}"),
                        marker="o", lw=1.8, ms=4, label=f"{fmt}: {SPEEDUP_LABEL}")
            lines += [t for t in [_headline_text(speed, fmt)] if t]
    _note(bottom, lines)
    for ax in axes_col:
        _context_axis(ax, ctxs)


def plot_figure(data: dict, plt):
    """The report's figure: one column per batch size. One cache format: TPOT per policy,
    each policy over the ladder, the ladder's speedup over fixed-1. Several: the same three
    panels per format (the ladder and fixed-1), the middle one over bf16's ladder."""
    meta, by_format = data["meta"], rows_by_format(data)
    tables = {fmt: table(rows) for fmt, rows in by_format.items()}
    batches = sorted({b for t in tables.values() for b in t})
    fig, axes = plt.subplots(3, len(batches), figsize=(6.8 * len(batches) + 0.6, 13.5),
                             squeeze=False, sharex="col",
                             gridspec_kw={"height_ratios": [1.35, 1.15, 1.0], "hspace": 0.12,
                                          "wspace": 0.22})
    for col, batch in enumerate(batches):
        if len(tables) == 1:
            _policy_column(axes[:, col], next(iter(tables.values()))[batch], batch)
        else:
            _format_column(axes[:, col], {f: t.get(batch, {}) for f, t in tables.items()},
                           batch, meta.get("copy_gbps"))
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    order = [p for p in POLICIES if p in handles] + [k for k in handles if k not in POLICIES]
    fig.suptitle(figure_title(data), fontsize=14, y=0.997)
    ncol = 3 if len(order) <= 12 else 4
    fig.legend([handles[k] for k in order], order, loc="upper center", ncol=ncol,
               bbox_to_anchor=(0.5, 0.958), frameon=False, fontsize=9.5)
    policies = sorted({r["policy"] for r in data["rows"]}, key=POLICIES.index)
    foot = [f"{p}: {POLICY_TEXT[p]}." for p in policies]
    if any("floor" in k for k in handles):
        foot.append(floor_text(meta))
    foot = "\n".join(textwrap.fill(t, 150, subsequent_indent="    ") for t in foot)
    fig.text(0.02, 0.005, foot, fontsize=8.5, va="bottom", ha="left")
    # Room for the legend's rows above the panels and the footnote's lines below them.
    legend_rows = -(-len(order) // ncol)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.92 - 0.0135 * legend_rows,
                        bottom=0.045 + 0.0112 * (foot.count("\n") + 1))
    return fig


def render_png(data: dict, path: Path, plt) -> None:
    fig = plot_figure(data, plt)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- command line -----------------------------------------------------------------------

def read_result(ap: argparse.ArgumentParser, path: Path) -> dict:
    what = "the JSON bench/tpot.py writes (e.g. bench/results/h200-tpot.json)"
    if not path.is_file():
        ap.error(f"--json {path}: no such file; pass {what}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        ap.error(f"--json {path}: cannot read it as JSON ({e}); pass {what}")
    if not (isinstance(data, dict) and isinstance(data.get("meta"), dict)
            and isinstance(data.get("rows"), list) and data["rows"]
            and all(isinstance(r, dict) and {"policy", "context", "batch", "tpot_ms"} <= set(r)
                    for r in data["rows"])):
        ap.error(f"--json {path}: no 'meta' and non-empty 'rows' with policy, context, batch "
                 f"and tpot_ms; pass {what}")
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Outputs default to the JSON's path with .md / .png. Existing files are not "
               "replaced unless --force is given.")
    ap.add_argument("--json", default=Path("bench/results/h200-tpot.json"), type=Path,
                    help="result file written by bench/tpot.py (default: %(default)s)")
    ap.add_argument("--out-md", type=Path, default=None,
                    help="markdown table to write (default: the JSON's path with .md)")
    ap.add_argument("--out-png", type=Path, default=None,
                    help="PNG figure to write, needs matplotlib (default: the JSON's path "
                         "with .png)")
    ap.add_argument("--no-png", action="store_true",
                    help="write only the markdown table (no matplotlib needed)")
    ap.add_argument("--force", action="store_true",
                    help="replace output files that already exist")
    ap.add_argument("--q-len", type=int, default=1,
                    help="render the rows of this q_len (verify steps, bench/tpot.py --q-len; "
                         "default 1; other values name the outputs <json stem>-q<N>)")
    args = ap.parse_args(argv)
    if args.no_png and args.out_png:
        ap.error("--out-png and --no-png contradict each other; pass one of them")
    data = read_result(ap, args.json)
    rows = [r for r in data["rows"] if r.get("q_len", 1) == args.q_len]
    if not rows:
        ap.error(f"--json {args.json} has no rows at q_len {args.q_len}")
    data = {**data, "rows": rows}
    stem = args.json if args.q_len == 1 else args.json.with_name(
        f"{args.json.stem}-q{args.q_len}{args.json.suffix}")
    md_path = args.out_md or stem.with_suffix(".md")
    png_path = None if args.no_png else (args.out_png or stem.with_suffix(".png"))
    outputs = [p for p in (md_path, png_path) if p is not None]
    if len({p.resolve() for p in outputs}) < len(outputs):
        ap.error(f"--out-md and --out-png are the same file ({md_path})")
    for p in outputs:
        if p.resolve() == args.json.resolve():
            ap.error(f"{p} is the input --json; choose another output path")
        if p.exists() and p.is_dir():
            ap.error(f"{p} is a directory; pass a file path")
    existing = [str(p) for p in outputs if p.exists()]
    if existing and not args.force:
        ap.error(f"{', '.join(existing)} already exist{'s' * (len(existing) == 1)}; pass "
                 "--force to replace, or --out-md/--out-png to write elsewhere")

    plt = load_pyplot() if png_path else None
    link = None
    if plt is not None:
        link = os.path.relpath(png_path.resolve(), md_path.resolve().parent)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(render_markdown(data, png_link=link))
    print(f"wrote {md_path}")
    if png_path is None:
        return 0
    if plt is None:
        print(f"error: matplotlib is not installed, so the figure {png_path} was not written "
              f"(the table {md_path} was). Install it with `{INSTALL}`, or pass --no-png to "
              "write only the table.", file=sys.stderr)
        return 1
    png_path.parent.mkdir(parents=True, exist_ok=True)
    render_png(data, png_path, plt)
    print(f"wrote {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
