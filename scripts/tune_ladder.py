"""Tune a bucket ladder on this GPU: measure the decode kernel, choose buckets, write JSON.

Times the Triton MLA decode kernel (cold L2, graph replays) at every context x capture size
(default 1, 2, 4, ..., 128) for each distinct plan a hint can capture there
(``plans_to_measure``: the plan itself, so a fused merge or a page-ahead stream is timed
as captured), refines the context grid where the best split count changes, and chooses at
most ``--max-buckets`` buckets with per-batch hints minimising time relative to the best
plan per (context, batch) (graphbucket.tuning). Writes the ladder (BucketLadder.load reads
it), a report with the raw timing table, and a plot. ``--dry-run`` prints the plans, the
measurement count and the estimated GPU time, and exits.

    python3 scripts/tune_ladder.py --heads 16 --max-buckets 6 --max-model-len 131072 \
        --out OUT/h200-h16.json --report OUT/h200-ladder-tune.json \
        --plot OUT/h200-ladder-tune.png

The balanced topology serves ragged batches only (the selector replays it where a batch's
imbalance, longest x live / total tokens, reaches the bucket's threshold; a uniform batch
never does). After choosing the buckets the tuner times the chosen split-KV plan against
the balanced one on ragged mixes of its own at every capture size from 2 and picks the
threshold (``graphbucket.tuning.ragged``; ``--balanced-imbalance X`` sets it instead, 0
off); ``bench/ladder_oracle.py`` checks it on other mixes. ``--q-len N`` tunes for verify
steps (q_len x heads query rows, as the runner plans them; balanced graphs decode one
token per request, so no mixes are timed).

``--from-times REPORT`` re-chooses from a saved report's timing table, without a GPU (and
re-plots it: ``--from-times R.json --plot R.png --force``). An output that exists is only
replaced with ``--force``.
``--kv-cache fp8-tensor|fp8-v32`` times the kernel over a cache in that format (fewer bytes
per token move the best split count per context); the shipped name of such a ladder is
``graphbucket/ladders/h200-h16-fp8-v32.json`` (``graphbucket.tuning.shipped``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import itertools
import json
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphbucket.ladder import (  # noqa: E402
    BALANCED_ABOVE,
    DEFAULT_BALANCED_IMBALANCE,
    default_ladder,
)
from graphbucket.plan import H200_NUM_SMS  # noqa: E402
from graphbucket.tuning.choose import TuneResult, choose_ladder, choose_per_batch  # noqa: E402
from graphbucket.tuning.grid import (  # noqa: E402
    bounds_with_edges,
    edge_contexts,
    hint_plans,
    hints_to_measure,
    plan_splits,
    plan_variants,
    plans_to_measure,
    refine_contexts,
    timed_plans,
    times_from_rows,
    times_to_rows,
)
from graphbucket.tuning.ragged import (  # noqa: E402
    RaggedSample,
    choose_by_batch,
    tuner_mixes,
)
from graphbucket.tuning.shipped import KV_CACHE_FORMATS  # noqa: E402

CONTEXTS = [1, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 102400, 131072]
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]  # the runner's capture sizes by default
REFINE = 8  # most contexts added where the best split count changes


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def imbalance_arg(text: str) -> str | float:
    """argparse type: "auto" or a number (0: off, else > 1)."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, 0 or a number > 1, got {text!r}"
                                         ) from None
    if value != 0 and not value > 1:
        raise argparse.ArgumentTypeError(f"{value}: use auto, 0 (off) or a number > 1 (a "
                                         "uniform batch has imbalance 1)")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=positive_int, default=None,
                    help="attention heads per GPU (16)")
    ap.add_argument("--batches", type=positive_int, nargs="+", default=None,
                    help="capture batch sizes to tune for, each measured (default: "
                         f"{' '.join(map(str, CAPTURE_SIZES))})")
    ap.add_argument("--q-len", type=positive_int, default=1,
                    help="query tokens per request (verify steps: q_len x heads query "
                         "rows, planned and timed as the runner captures them; default 1)")
    ap.add_argument("--refine", type=int, default=REFINE, metavar="N",
                    help="measure at most N more contexts, geometric midpoints where the "
                         "best split count changes between measured ones (default: "
                         "%(default)s; 0: the grid only)")
    ap.add_argument("--no-edges", action="store_true",
                    help="do not also measure each context + 1 (the first length above a "
                    "bound); bounds may then fall anywhere and go unscored above")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plans, the measurement count and the estimated GPU time, "
                         "then exit (no GPU needed; 132 SMs without one)")
    ap.add_argument("--contexts", type=positive_int, nargs="+", default=None,
                    help="context lengths to measure (default: 1 .. 128K, 14 points, and "
                         "--max-model-len)")
    ap.add_argument("--max-buckets", type=positive_int, default=6,
                    help="most buckets the ladder may have (default: %(default)s)")
    ap.add_argument("--max-model-len", type=positive_int, default=131072,
                    help="longest context the ladder covers; its last bucket ends here "
                         "(default: %(default)s)")
    ap.add_argument("--out", type=Path, help="ladder JSON to write")
    ap.add_argument("--report", type=Path, help="report JSON to write (keeps the timing table)")
    ap.add_argument("--plot", type=Path, help="PNG plot to write (needs matplotlib)")
    ap.add_argument("--from-times", type=Path, metavar="REPORT",
                    help="choose from this report's timing table instead of measuring")
    ap.add_argument("--shared-hints", action="store_true",
                    help="one hint per bucket for every batch size (default: each measured "
                         "batch size gets its own hint; bounds are shared either way)")
    ap.add_argument("--balanced-imbalance", type=imbalance_arg, default="auto",
                    help="ragged batches (longest x live / total tokens at least this) in "
                         f"buckets above {BALANCED_ABOVE} tokens replay a balanced graph; 0: "
                         "never; auto (default): chosen from ragged mixes timed after the "
                         f"buckets (from the report's with --from-times; "
                         f"{DEFAULT_BALANCED_IMBALANCE} where none were timed)")
    ap.add_argument("--kv-cache", choices=KV_CACHE_FORMATS, default=None,
                    help="latent cache format to time (default: bf16; with --from-times, "
                         "the report's)")
    ap.add_argument("--quiet", action="store_true", help="no progress line per measurement")
    ap.add_argument("--force", action="store_true",
                    help="replace output files (--out, --report and its .md, --plot) that "
                         "already exist")
    args = ap.parse_args(argv)
    report = "a report JSON this script wrote with --report (e.g. " \
             "bench/results/h200-ladder-tune.json)"
    if args.from_times is not None:
        if not args.from_times.is_file():
            ap.error(f"--from-times {args.from_times}: not a file; pass {report}")
        try:
            json.loads(args.from_times.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            ap.error(f"--from-times {args.from_times}: not readable as JSON ({e}); pass "
                     f"{report}")
    too_long = [c for c in args.contexts or [] if c > args.max_model_len]
    if too_long:
        ap.error(f"--contexts {too_long} above --max-model-len {args.max_model_len}")
    for flag in ("out", "report", "plot"):
        path = getattr(args, flag)
        if path is not None and path.is_dir():
            ap.error(f"--{flag} {path} is a directory; pass a file path")
    if args.refine < 0:
        ap.error(f"--refine {args.refine}: pass 0 (no refinement) or more")
    if args.q_len > min(args.contexts or [args.max_model_len]) and args.contexts:
        ap.error(f"--contexts {args.contexts} has lengths below --q-len {args.q_len}; a "
                 "verify step's length counts its q_len tokens")
    if args.report is not None and args.report.suffix == ".md":
        ap.error(f"--report {args.report}: pass a .json path (its .md is written beside it)")
    outputs = [args.out, args.report, args.report and args.report.with_suffix(".md"), args.plot]
    existing = [str(p) for p in outputs if p is not None and p.exists()]
    if existing and not args.force:
        ap.error(f"{', '.join(existing)} already exist{'s' * (len(existing) == 1)}; pass "
                 "--force to replace, or other paths to write elsewhere")
    return args


def measurement_plan(args: argparse.Namespace, num_sms: int) -> dict:
    """What the tuner will time (host arithmetic): contexts, plans per batch, the count of
    measurements and their estimated GPU seconds, refinement included at its most."""
    from graphbucket.tuning.measure import PAGE_SIZE, estimate_seconds

    heads, q_len = args.heads or 16, args.q_len
    batches = sorted(args.batches or CAPTURE_SIZES)
    contexts = sorted({c for c in args.contexts or CONTEXTS if q_len <= c <= args.max_model_len}
                      | ({args.max_model_len} if args.contexts is None else set()))
    if not args.no_edges:
        contexts = sorted(set(contexts) | set(edge_contexts(contexts, args.max_model_len)))
    plan_for = hint_plans(heads, num_sms=num_sms, q_len=q_len)
    hints = hints_to_measure(contexts, args.max_model_len,
                             ladders=[default_ladder(args.max_model_len)])
    plans = plans_to_measure(batches, plan_for, hints)
    num_pages = -(-contexts[-1] * batches[-1] // PAGE_SIZE)
    kv_cache, rows = args.kv_cache or "bf16", heads * q_len
    shapes = [(c, b, len(plans[b])) for c in contexts for b in batches]
    # Refinement points are geometric midpoints of the grid: at most, the costliest ones.
    mids = sorted(({round((lo * hi) ** 0.5) for lo, hi in itertools.pairwise(contexts)}
                   - set(contexts)), reverse=True)[: args.refine]
    extra = [(c, b, len(plans[b])) for c in mids for b in batches]
    # One Triton compile per kernel configuration, whatever the batch.
    compiles = len({replace(p, batch_size=1) for by in plans.values() for p in by.values()})
    est = estimate_seconds(shapes, rows, kv_cache, num_pages=num_pages, compiles=compiles)
    est_extra = estimate_seconds(extra, rows, kv_cache, num_pages=num_pages)
    return {"heads": heads, "q_len": q_len, "batches": batches, "contexts": contexts,
            "kv_cache": kv_cache, "plans": plans, "plan_for": plan_for,
            "count": sum(n for *_, n in shapes), "refine_count": sum(n for *_, n in extra),
            "estimate_s": est, "refine_estimate_s": est_extra}


def print_plan(todo: dict, gpu: str, num_sms: int) -> None:
    print(f"{gpu} ({num_sms} SMs), {todo['heads']} heads, q_len {todo['q_len']}, "
          f"{todo['kv_cache']} cache: {len(todo['contexts'])} contexts "
          f"{todo['contexts']}", flush=True)
    for batch, plans in todo["plans"].items():
        print(f"  batch {batch}: {len(plans)} plans, splits "
              f"{[p.num_kv_splits for p in plans.values()]}")
    print(f"{todo['count']} measurements, about {todo['estimate_s']:.0f} s of GPU time; "
          f"refinement: at most {todo['refine_count']} more, about "
          f"{todo['refine_estimate_s']:.0f} s", flush=True)


def measure(args: argparse.Namespace) -> tuple[dict, dict]:
    """Time the plans hints capture on this GPU; returns (timing table, measurement meta).
    The grid is refined where the best split count changes (``refine_contexts``)."""
    import torch

    from bench.gpu_timing import run_meta
    from graphbucket.tuning.measure import PlanTimer, Progress, estimate_seconds

    if not torch.cuda.is_available():
        sys.exit("measuring needs a CUDA GPU; without one pass --from-times REPORT "
                 "(or --dry-run to count the measurements)")
    meta = run_meta()
    todo = measurement_plan(args, meta["num_sms"])
    print_plan(todo, meta["gpu"], meta["num_sms"])
    batches, plan_for, plans = todo["batches"], todo["plan_for"], todo["plans"]
    rows, kv_cache = todo["heads"] * todo["q_len"], todo["kv_cache"]
    max_splits = max(plan_for(b, args.max_model_len).num_kv_splits for b in batches)
    timer = PlanTimer(todo["contexts"][-1], batches[-1], todo["heads"], q_len=todo["q_len"],
                      kv_cache=kv_cache, max_splits=max_splits)
    progress = Progress(todo["count"], todo["estimate_s"], enabled=not args.quiet)
    times: dict = {}

    def run(contexts: list[int], by_batch: dict) -> None:
        for context in contexts:
            for batch in batches:
                if not by_batch[batch]:
                    continue
                one = estimate_seconds([(context, batch, 1)], rows, kv_cache,
                                       num_pages=timer.problem.num_pages)
                for label, us in timer.time(context, batch, by_batch[batch]).items():
                    times[(context, batch, label)] = us
                    progress.step(f"ctx={context} b={batch} {label}: {us:.2f} us", one)

    run(todo["contexts"], plans)
    contexts, left = list(todo["contexts"]), args.refine
    while left > 0:
        new = [c for c in refine_contexts(times, left) if c not in contexts]
        if not new:
            break
        if not args.no_edges:
            new = sorted(set(new) | set(edge_contexts(new, args.max_model_len)) - set(contexts))
        contexts = sorted(contexts + new)
        hints = hints_to_measure(contexts, args.max_model_len,
                                 ladders=[default_ladder(args.max_model_len)])
        grown = plans_to_measure(batches, plan_for, hints)
        # A plan only the new contexts' hints capture is timed at every context.
        added = {b: {k: p for k, p in grown[b].items() if k not in plans[b]} for b in batches}
        progress.total += len(new) * sum(map(len, grown.values())) + (
            len(contexts) - len(new)) * sum(map(len, added.values()))
        print(f"refining at {new}", flush=True)
        run(new, grown)
        run([c for c in contexts if c not in new], added)
        plans, left = grown, left - len(new)
    meta.update(num_heads=todo["heads"], q_len=todo["q_len"], batches=batches,
                contexts=contexts, kv_cache=kv_cache, timed="plans", edges=not args.no_edges,
                estimate_s=round(todo["estimate_s"] + todo["refine_estimate_s"], 1),
                measured_s=round(time.perf_counter() - progress.start, 1))
    return times, meta


def measure_ragged(args: argparse.Namespace, ladder, meta: dict) -> list[RaggedSample]:
    """Time the tuned ladder's split-KV plan against the balanced plan on the tuner's ragged
    mixes at every measured batch size from 2 (``tuner_mixes``)."""
    from graphbucket.plan import plan_balanced_mla_decode
    from graphbucket.tuning.measure import PlanTimer, Progress, time_ragged

    heads, num_sms = meta["num_heads"], meta["num_sms"]
    mixes = [(b, name, lens) for b in meta["batches"]
             for name, lens in tuner_mixes(b, args.max_model_len, above=BALANCED_ABOVE)]
    if not mixes:
        return []
    plan_for = hint_plans(heads, num_sms=num_sms)

    def split_for(batch: int, lens: list[int]):
        return plan_for(batch, ladder.hints_for(batch)[ladder.bucket_for(max(lens))])

    def balanced_for(batch: int):
        return plan_balanced_mla_decode(batch, heads, num_sms=num_sms)

    top = max(b for b, _, _ in mixes)
    timer = PlanTimer(-(-max(sum(lens) for *_, lens in mixes) // top), top, heads,
                      kv_cache=meta["kv_cache"],
                      max_splits=max(split_for(b, lens).num_kv_splits for b, _, lens in mixes),
                      max_items=max(balanced_for(b).max_work_items for b, _, _ in mixes))
    print(f"ragged mixes: {len(mixes)} at batches {sorted({b for b, _, _ in mixes})}, split "
          "against balanced", flush=True)
    try:
        return time_ragged(timer, mixes, split_for, balanced_for,
                           progress=Progress(len(mixes), 0.3 * len(mixes),
                                             enabled=not args.quiet))
    except ValueError as e:  # a format the balanced kernels do not decode
        print(f"balanced plans cannot run here ({e}); the balanced topology stays off",
              flush=True)
        return []


def ragged_switch(args: argparse.Namespace, ladder, meta: dict, saved: list[RaggedSample]
                  ) -> tuple[float, dict[int, float], dict | None]:
    """The ladder's balanced threshold, its changes by batch size, and the report's ragged
    section (or None)."""
    if args.balanced_imbalance != "auto":
        return float(args.balanced_imbalance), {}, None
    samples = saved
    if not samples and not args.from_times and meta.get("q_len", 1) == 1:
        samples = measure_ragged(args, ladder, meta)
    if not samples:
        print(f"no ragged mixes timed: balanced threshold {DEFAULT_BALANCED_IMBALANCE} "
              "(the default)")
        return DEFAULT_BALANCED_IMBALANCE, {}, None
    threshold, by_batch, summary = choose_by_batch(samples)
    print(f"balanced threshold {threshold or 'off'}, from batch sizes {by_batch or '-'}: worst "
          f"{summary['worst_over_best']} over the faster plan per mix (one threshold for "
          f"every batch, {summary['single_threshold'] or 'off'}: "
          f"{summary['single_worst_over_best']}; off: {summary['off_worst_over_best']}, "
          f"always: {summary['always_worst_over_best']})", flush=True)
    return threshold, by_batch, {"samples": [s.to_dict() for s in samples], "summary": summary}


def load_times(args: argparse.Namespace) -> tuple[dict, dict]:
    """The timing table and meta of a saved report, narrowed to ``--batches``/``--contexts``."""
    data = json.loads(args.from_times.read_text())
    if "times" not in data or "meta" not in data:
        sys.exit(f"{args.from_times} has no 'times'/'meta'; pass a report this script wrote")
    meta, times = dict(data["meta"]), times_from_rows(data["times"])
    meta["ragged_samples"] = data.get("ragged", {}).get("samples", [])
    if timed_plans(data["times"]):
        meta["timed"] = "plans"
    if args.q_len != meta.setdefault("q_len", 1):
        sys.exit(f"{args.from_times} was measured at q_len {meta['q_len']}, not --q-len "
                 f"{args.q_len}; re-measure on the GPU for another q_len")
    if args.heads is not None and args.heads != meta["num_heads"]:
        sys.exit(f"{args.from_times} was measured with {meta['num_heads']} heads, not "
                 f"--heads {args.heads}; re-measure on the GPU for another head count")
    measured = meta.setdefault("kv_cache", "bf16")  # reports before fp8 ladders: bf16
    if args.kv_cache is not None and args.kv_cache != measured:
        sys.exit(f"{args.from_times} was measured over a {measured} cache, not --kv-cache "
                 f"{args.kv_cache}; re-measure on the GPU for another cache format")
    keep_b, keep_c = set(args.batches or meta["batches"]), set(args.contexts or meta["contexts"])
    missing = (keep_b - set(meta["batches"])) | (keep_c - set(meta["contexts"]))
    if missing:
        sys.exit(f"{args.from_times} has no measurements for {sorted(missing)}")
    times = {k: us for k, us in times.items() if k[1] in keep_b and k[0] in keep_c}
    meta.update(batches=sorted(keep_b), contexts=sorted(keep_c),
                measured_with=meta.get("measured_with", meta["command"]),
                measured_date=meta.get("measured_date", meta["date"]),
                command=shlex.join(["python3", *sys.argv]),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    return times, meta


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


def report_markdown(report: dict) -> str:
    """The report as a short markdown table (written beside the report JSON)."""
    meta, summary = report["meta"], report["summary"]
    bounds = ", ".join(bucket_text(b) for b in report["ladder"]["buckets"])
    fmt = meta.get("kv_cache", "bf16")
    q_len = meta.get("q_len", 1)
    lines = [f"# Tuned ladder, {meta['num_heads']} heads"
             + ("" if fmt == "bf16" else f", {fmt} cache")
             + ("" if q_len == 1 else f", q_len {q_len}") + f" ({meta['gpu']})", "",
             f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}. "
             f"Command: `{meta['command']}`", "", f"Tuned buckets: {bounds}", "",
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
        lines[-2:-2] = [
            f"Balanced threshold {best['balanced_imbalance'] or 'off'} (longest x live / "
            f"total tokens){by_batch_text(best)}, chosen from {len(ragged['samples'])} ragged "
            f"mixes: worst {best['worst_over_best']:.3f} over the faster of split-KV and "
            f"balanced per mix ({single_text(best)}balanced off: "
            f"{best['off_worst_over_best']:.3f}, always: "
            f"{best['always_worst_over_best']:.3f}).", "",
            "| batch | mix | imbalance | split-KV us | balanced us |", "|---|---|---|---|---|",
            *(f"| {r['batch']} | {r['mix']} | {r['imbalance']:.2f} | {r['split_us']:.1f} | "
              f"{r['balanced_us']:.1f} |" for r in ragged["samples"]), ""]
    for r in report["rows"]:
        lines.append(f"| {r['context']} | {r['batch']} | {r['oracle_us']:.1f} "
                     f"({r['oracle_splits']}) | {r['tuned_us']:.1f} ({r['tuned_splits']}) | "
                     f"{r['tuned_over_oracle']:.3f} | {r['default_us']:.1f} "
                     f"({r['default_splits']}) | {r['default_over_oracle']:.3f} |")
    return "\n".join(lines) + "\n"


def figure_title(meta: dict) -> str:
    """What a tuning figure shows: the kernel shape, heads, cache format, q_len, batches,
    the GPU and when it was measured."""
    batches = " and ".join(str(b) for b in meta["batches"])
    return (f"Ladder tuning: MLA decode attention (576/512), {meta['num_heads']} heads, "
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        num_sms = H200_NUM_SMS
        if importlib.util.find_spec("torch") is not None:
            import torch

            if torch.cuda.is_available():
                num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        todo = measurement_plan(args, num_sms)
        print_plan(todo, "dry run", num_sms)
        return
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: --plot will be skipped (the report keeps the "
              "timing table; install it with `python3 -m pip install matplotlib` and "
              "re-plot with --from-times)", file=sys.stderr)
    times, meta = load_times(args) if args.from_times else measure(args)
    saved = [RaggedSample.from_dict(r) for r in meta.pop("ragged_samples", [])]
    too_long = [c for c in meta["contexts"] if c > args.max_model_len]
    if too_long:
        sys.exit(f"measured contexts {too_long} are above --max-model-len "
                 f"{args.max_model_len}; raise it or pass --contexts up to it")
    q_len = meta.setdefault("q_len", 1)
    if meta.get("timed") == "plans":  # keyed by the plan each hint captures
        splits_for = plan_variants(hint_plans(meta["num_heads"], num_sms=meta["num_sms"],
                                              q_len=q_len))
    else:  # reports before 2026-12: split counts forced on each context's plan
        splits_for = plan_splits(meta["num_heads"], num_sms=meta["num_sms"])
    ladder_meta = {"device": meta["gpu"], "num_sms": meta["num_sms"],
                   "num_heads": meta["num_heads"],
                   "date": meta.get("measured_date", meta["date"])}
    if meta["kv_cache"] != "bf16":  # bf16 ladders keep their meta as before
        ladder_meta["kv_cache"] = meta["kv_cache"]
    if q_len != 1:
        ladder_meta["q_len"] = q_len
    # Where each context + 1 was measured, buckets end only where their next length was.
    bounds = bounds_with_edges(meta["contexts"]) if meta.get("edges") else None
    result = choose_ladder(times, splits_for, max_model_len=args.max_model_len,
                           max_buckets=args.max_buckets, meta=ladder_meta,
                           per_batch_hints=not args.shared_hints, bounds_at=bounds)
    print(summary_table(result), flush=True)
    if not args.shared_hints:  # what per-batch hints buy over one hint per bucket
        shared = choose_ladder(times, splits_for, max_model_len=args.max_model_len,
                               max_buckets=args.max_buckets, per_batch_hints=False,
                               bounds_at=bounds)
        result.summary.update(
            shared_mean_over_oracle=shared.summary["tuned_mean_over_oracle"],
            shared_max_over_oracle=shared.summary["tuned_max_over_oracle"])
        print(f"one shared hint per bucket: {shared.ladder!r} mean x "
              f"{shared.summary['tuned_mean_over_oracle']} max x "
              f"{shared.summary['tuned_max_over_oracle']}")
    per_batch = choose_per_batch(times, splits_for, max_model_len=args.max_model_len,
                                 max_buckets=args.max_buckets, meta=ladder_meta,
                                 bounds_at=bounds)
    for batch, alone in per_batch.items():
        print(f"batch {batch} alone: {alone.ladder!r} mean x "
              f"{alone.summary['tuned_mean_over_oracle']} max x "
              f"{alone.summary['tuned_max_over_oracle']}")
    meta.update(max_model_len=args.max_model_len, max_buckets=args.max_buckets)
    threshold, by_batch, ragged = ragged_switch(args, result.ladder, meta, saved)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result.ladder.with_balanced_topology(threshold, by_batch=by_batch).save(args.out)
        print(f"wrote {args.out}")
    report = {"meta": meta, **result.to_dict(), **({"ragged": ragged} if ragged else {}),
              "per_batch": {str(b): {"ladder": r.ladder.to_dict(), "summary": r.summary}
                            for b, r in per_batch.items()},
              "times": times_to_rows(times)}
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=1) + "\n")
        args.report.with_suffix(".md").write_text(report_markdown(report))
        print(f"wrote {args.report} and its .md")
    if args.plot and render_png(report, args.plot):
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
