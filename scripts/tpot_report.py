"""Render bench/tpot.py's JSON: a markdown TPOT table per batch size and a PNG plot.

Table columns follow the tables engines publish with such fixes: context, the ladder's
bucket (and hint, split count), TPOT per policy, the roofline floor, the ladder's speedup
over ``fixed-1``, its TPOT reduction and its ratio to the default ladder (marked where
both replay the same plan). Below the tables, the issue's targets at batch 1 and the tuned
ladder's target against the default ladder are checked against the numbers.

    python3 scripts/tpot_report.py --json bench/results/h200-tpot.json \
        --out-md bench/results/h200-tpot.md --out-png bench/results/h200-tpot.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphbucket.ladder import Bucket  # noqa: E402

# "ladder" is the runner's choice (the shipped tuned ladder of the GPU when there is one);
# "default-ladder" the field's five buckets.
POLICIES = ("eager", "fixed-1", "fixed-max", "default-ladder", "ladder")


# Two runs of the same captured plan differ by up to ~1 % (same-plan rows of the H200 runs).
NOISE = 0.01


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


def table(rows: list[dict]) -> dict[int, dict[int, dict[str, dict]]]:
    """batch -> context -> policy -> row."""
    out: dict[int, dict[int, dict[str, dict]]] = {}
    for r in rows:
        out.setdefault(r["batch"], {}).setdefault(r["context"], {})[r["policy"]] = r
    return out


def _ms(row: dict | None) -> str:
    return f"{row['tpot_ms']:.3f}" if row else "-"


def markdown_batch(batch: int, by_ctx: dict[int, dict[str, dict]], ladder) -> list[str]:
    policies = [p for p in POLICIES if any(p in v for v in by_ctx.values())]
    head = ["context", "bucket (hint, splits)", *(f"{p} ms" for p in policies), "floor ms",
            "ladder vs fixed-1", "TPOT reduction", "ladder / default-ladder"]
    lines = [f"### batch {batch}", "", "| " + " | ".join(head) + " |",
             "|" + "|".join(["---:", "---"] + ["---:"] * (len(head) - 2)) + "|"]
    for context in sorted(by_ctx):
        cells = by_ctx[context]
        ladder_row, fixed_row = cells.get("ladder"), cells.get("fixed-1")
        any_row = next(iter(cells.values()))
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
        lines.append("| " + " | ".join([fmt_context(context), bucket_label(ladder, context,
                                                                          splits, batch),
                                        *(_ms(cells.get(p)) for p in policies),
                                        f"{any_row['floor_ms']:.3f}", speed, red,
                                        vs_default]) + " |")
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
    short = [c for c in by_ctx if c <= 2048 and ms(c, "ladder") and ms(c, "fixed-1")]
    if short:
        # One-sided: the ladder must not regress short contexts; being faster is no failure.
        worst = max(short, key=lambda c: ms(c, "ladder") / ms(c, "fixed-1"))
        d = 100 * (ms(worst, "ladder") / ms(worst, "fixed-1") - 1)
        out.append(f"{'PASS' if d <= 1 else 'FAIL'}: ladder at most {d:+.2f} % against "
                   f"fixed-1 at every context <= 2K (worst {fmt_context(worst)}; target "
                   "+1 %)")
    ratios = {c: ms(c, "ladder") / min(r["tpot_ms"] for r in v.values())
              for c, v in by_ctx.items() if ms(c, "ladder")}
    if ratios:
        c = max(ratios, key=ratios.get)
        out.append(f"{'PASS' if ratios[c] <= 1.02 else 'FAIL'}: ladder at most {ratios[c]:.3f}x "
                   f"the fastest policy (worst {fmt_context(c)}; target 1.02x)")
    row = by_ctx.get(100_000, {}).get("ladder")
    if row:
        f = row["tpot_ms"] / row["floor_ms"]
        out.append(f"{'PASS' if f <= 1.3 else 'FAIL'}: ladder {f:.2f}x floor_ms at 100K "
                   "(target 1.3x)")
    return [f"- {line}" for line in out]


def render_markdown(data: dict) -> str:
    meta, by_batch = data["meta"], table(data["rows"])
    lines = [f"# TPOT per policy: {meta.get('model')}, {meta.get('layers')} layers "
             f"({meta.get('gpu')})", "",
             f"{meta.get('date')}, torch {meta.get('torch')}, triton {meta.get('triton')}, "
             f"copy bandwidth {meta.get('copy_gbps')} GB/s (read + write). "
             f"Command: `{meta.get('command')}`", "",
             "TPOT: one full decode step (graph replay, or the eager forward), milliseconds. "
             "floor: bytes the step must read (weights, the context's KV, activations) over "
             "the copy bandwidth. Context counts the decoded token.", ""]
    ladder = meta.get("ladder")
    for batch in sorted(by_batch):
        lines += markdown_batch(batch, by_batch[batch], ladder)
    if 1 in by_batch:
        lines += ["### targets (batch 1)", "", *check_targets(by_batch[1]), ""]
    tuned = check_tuned(by_batch)
    if tuned:
        lines += ["### tuned ladder against the default ladder (every batch size)", "",
                  *tuned, ""]
    return "\n".join(lines)


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


def render_png(data: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipped the PNG plot (pip install matplotlib)",
              file=sys.stderr)
        return False
    by_batch = table(data["rows"])
    fig, axes = plt.subplots(1, len(by_batch), figsize=(6.5 * len(by_batch), 4.8),
                             squeeze=False)
    for ax, batch in zip(axes[0], sorted(by_batch), strict=True):
        by_ctx = by_batch[batch]
        ctxs = sorted(by_ctx)
        for policy in POLICIES:
            pts = [(c, by_ctx[c][policy]["tpot_ms"]) for c in ctxs if policy in by_ctx[c]]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", ms=3, label=policy)
        floor = [next(iter(by_ctx[c].values()))["floor_ms"] for c in ctxs]
        ax.plot(ctxs, floor, "k--", lw=1, label="floor")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="TPOT (ms)",
               title=f"batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    meta = data["meta"]
    fig.suptitle(f"{meta.get('model')}, {meta.get('layers')} layers, {meta.get('gpu')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="bench/results/h200-tpot.json", type=Path)
    ap.add_argument("--out-md", type=Path, default=None, help="default: the JSON's .md")
    ap.add_argument("--out-png", type=Path, default=None, help="default: the JSON's .png")
    args = ap.parse_args(argv)
    data = json.loads(args.json.read_text())
    md_path = args.out_md or args.json.with_suffix(".md")
    md_path.write_text(render_markdown(data))
    print(f"wrote {md_path}")
    png_path = args.out_png or args.json.with_suffix(".png")
    if render_png(data, png_path):
        print(f"wrote {png_path}")


if __name__ == "__main__":
    main()
