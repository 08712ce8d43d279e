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

The balanced topology serves the batches whose imbalance, longest x live / total tokens,
reaches the bucket's threshold (a threshold of 1 takes uniform batches too). After choosing
the buckets the tuner times the chosen split-KV plan against the balanced one on ragged
mixes of its own at every capture size from 2, in each length range of the longest request
(from ``--balanced-from``, 1024 tokens, to 4096 at powers of two; the buckets above 4096
cut at powers of two), and picks
a threshold per range and capture size (``graphbucket.tuning.ragged``; a bucket a range edge
falls inside is cut there, with its hints; ``--balanced-imbalance X`` sets one threshold
instead, 0 off); ``bench/ladder_oracle.py`` checks it on other mixes. ``--q-len N`` tunes for verify
steps (q_len x heads query rows, as the runner plans them; balanced graphs decode one
token per request, so no mixes are timed).

``--from-times REPORT`` re-chooses from a saved report's timing table, without a GPU (and
re-plots it: ``--from-times R.json --plot R.png --force``). An output that exists is only
replaced with ``--force``.
``--kv-cache fp8-tensor|fp8-v32`` times the kernel over a cache in that format (fewer bytes
per token move the best split count per context); the shipped name of such a ladder is
``graphbucket/ladders/h200-h16-fp8-v32.json`` (``graphbucket.tuning.shipped``).
``--sparse`` tunes the sparse decoder's ladder (DeepSeek-V3.2: ``--topk``, default 2048):
each hint's ``plan_sparse_decode`` plan, timed as one sparse decode layer (indexer, top-k,
sparse attention and merge: ``graphbucket.tuning.measure_sparse``) against
``sparse_ladder``; no balanced topology (threshold 0). Shipped as ``h200-h16-sparse.json``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import itertools
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphbucket.bucket import DEFAULT_BALANCED_KERNEL  # noqa: E402
from graphbucket.ladder import (  # noqa: E402
    BALANCED_ABOVE,
    BALANCED_FROM,
    DEFAULT_BALANCED_IMBALANCE,
    default_ladder,
)
from graphbucket.plan import H200_NUM_SMS  # noqa: E402
from graphbucket.tuning.choose import choose_ladder, choose_per_batch  # noqa: E402
from graphbucket.tuning.grid import (  # noqa: E402
    bounds_with_edges,
    edge_contexts,
    hint_plans,
    hints_to_measure,
    plan_splits,
    plan_variants,
    plans_to_measure,
    refine_contexts,
    sparse_hint_plans,
    timed_plans,
    times_from_rows,
    times_to_rows,
    tuning_contexts,
)
from graphbucket.tuning.held_out import (  # noqa: E402
    KERNEL_REACHES,
    MISS,
    choose_kernel_reach,
    second_length,
    switched_ladder,
)
from graphbucket.tuning.ragged import (  # noqa: E402
    KERNEL_NEIGHBOUR_RANGES,
    KERNEL_SCORE,
    KERNEL_SCORES,
    RaggedSample,
    choose_switches,
    ragged_ranges,
    tuner_mixes,
)
from graphbucket.tuning.report import (  # noqa: E402, F401 (plot_figure: tests draw it)
    plot_figure,
    render_png,
    report_markdown,
    summary_table,
    switches_text,
)
from graphbucket.tuning.shipped import KV_CACHE_FORMATS, SPARSE_DECODER  # noqa: E402

CONTEXTS = tuning_contexts(131072)  # with --max-model-len other than this: its own grid
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]  # the runner's capture sizes by default
REFINE = 24  # most contexts added where the best split count changes (each with its edge)


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
                    help="context lengths to measure (default: 1, the powers of two from 4 "
                         "and their geometric midpoints up to --max-model-len, and "
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
    ap.add_argument("--retime-ragged", action="store_true",
                    help="with --from-times: keep the report's split-KV table but time the "
                         "ragged mixes again on this GPU (CUDA; after a balanced kernel or "
                         "mix change, in seconds rather than the whole grid's minutes)")
    ap.add_argument("--shared-hints", action="store_true",
                    help="one hint per bucket for every batch size (default: each measured "
                         "batch size gets its own hint; bounds are shared either way)")
    ap.add_argument("--balanced-imbalance", type=imbalance_arg, default="auto",
                    help="ragged batches (longest x live / total tokens at least this) in "
                         f"buckets above {BALANCED_ABOVE} tokens replay a balanced graph; 0: "
                         "never; auto (default): chosen from ragged mixes timed after the "
                         f"buckets (from the report's with --from-times; "
                         f"{DEFAULT_BALANCED_IMBALANCE} where none were timed)")
    ap.add_argument("--balanced-from", type=int, default=None, metavar="TOKENS",
                    help="choose the ragged switch for longest requests from this length "
                         f"(default {BALANCED_FROM}; below {BALANCED_ABOVE} in power-of-two "
                         "ranges, each with its own mixes, the uniform one included); "
                         f"{BALANCED_ABOVE} times the mixes of the ladders tuned before it")
    ap.add_argument("--mix-lengths", type=int, choices=(1, 2), default=1,
                    help="lengths of the longest request per range the ragged mixes are "
                         "timed at: 1, at 3/4 of the range's top (default), or 2, also at "
                         "15/16 of it (twice the mixes)")
    ap.add_argument("--kernel-neighbours", type=kernel_reach_arg, default=KERNEL_NEIGHBOUR_RANGES,
                    metavar="N|auto",
                    help="choose each length range's balanced kernels over its own ragged "
                         "mixes and those of N ranges on each side (default "
                         f"{KERNEL_NEIGHBOUR_RANGES}; 0: its own alone); the threshold from "
                         "its own. auto: whichever of "
                         f"{' and '.join(map(str, KERNEL_REACHES))} misses fewer mixes held "
                         "out by length (mixes timed at two lengths; else the default)")
    ap.add_argument("--kernel-score", choices=KERNEL_SCORES, default=KERNEL_SCORE,
                    help="rank each balanced kernel option over those mixes by its worst "
                         "ratio to the fastest plan timed, then the mean, or the other way "
                         f"round (default {KERNEL_SCORE})")
    ap.add_argument("--one-balanced-kernel", action="store_true",
                    help="one balanced graph per capture size and length range (default: a "
                         "second one where the fitted cost model's pick between the two "
                         "beats the best kernel alone on the timed mixes)")
    ap.add_argument("--kv-cache", choices=KV_CACHE_FORMATS, default=None,
                    help="latent cache format to time (default: bf16; with --from-times, "
                         "the report's)")
    ap.add_argument("--sparse", action="store_true",
                    help="tune the sparse decoder's ladder (DeepSeek-V3.2: indexer, top-k, "
                         "sparse attention; no balanced topology; with --from-times, the "
                         "report's)")
    ap.add_argument("--topk", type=positive_int, default=None,
                    help="positions the sparse decoder attends per token (--sparse only; "
                         "default 2048)")
    ap.add_argument("--step-ties", action="store_true",
                    help="re-rank near-ties of long, wide cells by timing their plans in a "
                         "whole decode step (graphbucket.tuning.step_ties; CUDA, a 2-layer "
                         "decoder); with --from-times the report's step timings are replayed "
                         "without it")
    ap.add_argument("--step-ties-from", type=positive_int, nargs=2, default=None,
                    metavar=("BATCH", "CONTEXT"),
                    help="cells re-ranked from this capture size and bucket top (default "
                         "32 16385)")
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
    if args.balanced_from is not None:
        if args.balanced_from < 1:
            ap.error(f"--balanced-from {args.balanced_from}: a length of at least 1 token")
        if args.from_times is not None and not args.retime_ragged:
            ap.error("--balanced-from sets where the mixes are timed; a saved report's mixes "
                     "keep their ranges: add --retime-ragged to time them again")
    if args.mix_lengths != 1 and args.from_times is not None and not args.retime_ragged:
        ap.error("--mix-lengths sets which mixes are timed; a saved report's mixes are kept: "
                 "add --retime-ragged to time them again")
    if args.retime_ragged and args.from_times is None:
        ap.error("--retime-ragged re-times the mixes of a saved report: pass --from-times "
                 f"({report}); without it every mix is timed anyway")
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
    if args.step_ties and args.sparse:
        ap.error("--step-ties times dense decode steps; the sparse decoder has none")
    if args.topk is not None and not args.sparse:
        ap.error(f"--topk {args.topk} applies to the sparse decoder; pass --sparse too")
    if args.sparse and args.kv_cache not in (None, "bf16", "fp8-v32"):
        ap.error(f"--kv-cache {args.kv_cache}: the sparse decoder reads bf16 or fp8-v32 "
                 "latent caches")
    if args.sparse and args.balanced_imbalance not in ("auto", 0):
        ap.error(f"--balanced-imbalance {args.balanced_imbalance}: sparse decode has no "
                 "balanced topology; leave it out (the ladder has it off)")
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
    from graphbucket.tuning.measure import PAGE_SIZE

    heads, q_len = args.heads or 16, args.q_len
    batches = sorted(args.batches or CAPTURE_SIZES)
    # The default grid's shortest context is the shortest a q_len step can have (1 is
    # raised to q_len, not dropped): the first bucket's hint must be timed where it is short.
    grid = args.contexts or [max(q_len, c) for c in tuning_contexts(args.max_model_len)]
    contexts = sorted({c for c in grid if q_len <= c <= args.max_model_len}
                      | ({args.max_model_len} if args.contexts is None else set()))
    if not args.no_edges:
        contexts = sorted(set(contexts) | set(edge_contexts(contexts, args.max_model_len)))
    num_pages = -(-contexts[-1] * batches[-1] // PAGE_SIZE)
    kv_cache = args.kv_cache or "bf16"
    kind = (sparse_kind if args.sparse else dense_kind)(args, num_sms, kv_cache, num_pages)
    plan_for = kind["plan_for"]
    hints = hints_to_measure(contexts, args.max_model_len, ladders=[kind["baseline"]])
    plans = plans_to_measure(batches, plan_for, hints)
    shapes = [(c, b, len(plans[b])) for c in contexts for b in batches]
    # Refinement points are geometric midpoints of the grid: at most, the costliest ones.
    mids = sorted(({round((lo * hi) ** 0.5) for lo, hi in itertools.pairwise(contexts)}
                   - set(contexts)), reverse=True)[: args.refine]
    extra = [(c, b, len(plans[b])) for c in mids for b in batches]
    # One Triton compile per kernel configuration, whatever the batch.
    compiles = len({kind["compile_key"](p) for by in plans.values() for p in by.values()})
    est = kind["estimate"](shapes, compiles=compiles)
    return {"heads": heads, "q_len": q_len, "batches": batches, "contexts": contexts,
            "kv_cache": kv_cache, "plans": plans, **kind,
            "count": sum(n for *_, n in shapes), "refine_count": sum(n for *_, n in extra),
            "estimate_s": est, "refine_estimate_s": kind["estimate"](extra)}


def dense_kind(args: argparse.Namespace, num_sms: int, kv_cache: str, num_pages: int) -> dict:
    """What tuning the split-KV decoder times: its plans, the ladder compared with, the
    GPU-time estimate, the timer and the largest plan's split count."""
    from graphbucket.tuning.measure import PlanTimer, estimate_seconds

    heads, q_len = args.heads or 16, args.q_len
    plan_for = hint_plans(heads, num_sms=num_sms, q_len=q_len)
    return {"plan_for": plan_for, "baseline": default_ladder(args.max_model_len),
            "estimate": functools.partial(estimate_seconds, num_heads=heads * q_len,
                                          kv_cache=kv_cache, num_pages=num_pages),
            "compile_key": lambda p: replace(p, batch_size=1),
            "splits": lambda p: p.num_kv_splits, "workspace_splits": lambda p: p.num_kv_splits,
            "timer": functools.partial(PlanTimer, num_heads=heads, q_len=q_len,
                                       kv_cache=kv_cache), "meta": {}}


def sparse_kind(args: argparse.Namespace, num_sms: int, kv_cache: str, num_pages: int) -> dict:
    """``dense_kind`` for the sparse decoder: ``plan_sparse_decode`` per hint against
    ``sparse_ladder``, timed as one sparse decode layer."""
    from graphbucket.sparse.backend import sparse_ladder
    from graphbucket.sparse.plan import DEFAULT_TOPK
    from graphbucket.tuning.measure_sparse import SparsePlanTimer, estimate_sparse_seconds

    heads, q_len, topk = args.heads or 16, args.q_len, args.topk or DEFAULT_TOPK
    return {"plan_for": sparse_hint_plans(heads, topk=topk, num_sms=num_sms, q_len=q_len),
            "baseline": sparse_ladder(args.max_model_len, topk=topk),
            "estimate": functools.partial(estimate_sparse_seconds, num_heads=heads, topk=topk,
                                          q_len=q_len, kv_cache=kv_cache, num_pages=num_pages),
            "compile_key": lambda p: replace(p, num_rows=1),
            "splits": lambda p: (p.indexer_splits, p.attention_splits),
            "workspace_splits": lambda p: p.attention_splits,
            "timer": functools.partial(SparsePlanTimer, num_heads=heads, topk=topk,
                                       q_len=q_len, kv_cache=kv_cache),
            "meta": {"decoder": SPARSE_DECODER, "topk": topk}}


def print_plan(todo: dict, gpu: str, num_sms: int) -> None:
    sparse = f", sparse decode (top-k {todo['meta']['topk']})" if todo["meta"] else ""
    print(f"{gpu} ({num_sms} SMs), {todo['heads']} heads, q_len {todo['q_len']}, "
          f"{todo['kv_cache']} cache{sparse}: {len(todo['contexts'])} contexts "
          f"{todo['contexts']}", flush=True)
    for batch, plans in todo["plans"].items():
        print(f"  batch {batch}: {len(plans)} plans, splits "
              f"{[todo['splits'](p) for p in plans.values()]}")
    print(f"{todo['count']} measurements, about {todo['estimate_s']:.0f} s of GPU time; "
          f"refinement: at most {todo['refine_count']} more, about "
          f"{todo['refine_estimate_s']:.0f} s", flush=True)


def measure(args: argparse.Namespace) -> tuple[dict, dict]:
    """Time the plans hints capture on this GPU; returns (timing table, measurement meta).
    The grid is refined where the best split count changes (``refine_contexts``)."""
    import torch

    from bench.gpu_timing import run_meta
    from graphbucket.tuning.measure import Progress

    if not torch.cuda.is_available():
        sys.exit("measuring needs a CUDA GPU; without one pass --from-times REPORT "
                 "(or --dry-run to count the measurements)")
    meta = run_meta()
    todo = measurement_plan(args, meta["num_sms"])
    print_plan(todo, meta["gpu"], meta["num_sms"])
    batches, plan_for, plans = todo["batches"], todo["plan_for"], todo["plans"]
    # Split counts grow with the hint: the top one plans the most partials to hold.
    max_splits = max(todo["workspace_splits"](plan_for(b, args.max_model_len))
                     for b in batches)
    timer = todo["timer"](todo["contexts"][-1], batches[-1], max_splits=max_splits)
    progress = Progress(todo["count"], todo["estimate_s"], enabled=not args.quiet)
    times: dict = {}

    def run(contexts: list[int], by_batch: dict) -> None:
        for context in contexts:
            for batch in batches:
                if not by_batch[batch]:
                    continue
                one = todo["estimate"]([(context, batch, 1)])
                for label, us in timer.time(context, batch, by_batch[batch]).items():
                    times[(context, batch, label)] = us
                    progress.step(f"ctx={context} b={batch} {label}: {us:.2f} us", one)

    run(todo["contexts"], plans)
    plans_now = [plans]

    def measure(new: list[int], contexts: list[int]) -> None:
        hints = hints_to_measure(contexts, args.max_model_len, ladders=[todo["baseline"]])
        grown = plans_to_measure(batches, plan_for, hints)
        # A plan only the new contexts' hints capture is timed at every context.
        added = {b: {k: p for k, p in grown[b].items() if k not in plans_now[0][b]}
                 for b in batches}
        progress.total += len(new) * sum(map(len, grown.values())) + (
            len(contexts) - len(new)) * sum(map(len, added.values()))
        print(f"refining at {new}", flush=True)
        run(new, grown)
        run([c for c in contexts if c not in new], added)
        plans_now[0] = grown

    edges = None if args.no_edges else (lambda new: edge_contexts(new, args.max_model_len))
    contexts = refinement_rounds(times, todo["contexts"], args.refine, edges, measure)
    meta.update(num_heads=todo["heads"], q_len=todo["q_len"], batches=batches,
                contexts=contexts, kv_cache=todo["kv_cache"], **todo["meta"], timed="plans",
                edges=not args.no_edges,
                estimate_s=round(todo["estimate_s"] + todo["refine_estimate_s"], 1),
                measured_s=round(time.perf_counter() - progress.start, 1))
    return times, meta


def measure_ragged(args: argparse.Namespace, ladder, meta: dict) -> list[RaggedSample]:
    """Time the tuned ladder's split-KV plan against each balanced kernel's plan on the
    tuner's ragged mixes at every measured batch size from 2 (``tuner_mixes``)."""
    from graphbucket.backends.triton import TritonBackend
    from graphbucket.tuning.measure import PlanTimer, Progress, time_ragged

    heads, num_sms = meta["num_heads"], meta["num_sms"]
    # Each length range the switch is chosen for gets its own mixes, longest request in it.
    meta["balanced_from"] = args.balanced_from or BALANCED_FROM
    meta["mix_lengths"] = args.mix_lengths
    mixes = [(b, name, lens) for lo, hi in switch_ranges(ladder, meta)
             for b in meta["batches"]
             for name, lens in tuner_mixes(b, hi, above=lo, lengths=args.mix_lengths)]
    if not mixes:
        return []
    plan_for = hint_plans(heads, num_sms=num_sms)

    def split_for(batch: int, lens: list[int]):
        return plan_for(batch, ladder.hints_for(batch)[ladder.bucket_for(max(lens))])

    backend = TritonBackend(num_sms=num_sms)
    # Every balanced kernel runs over fp8 caches too (the fp8 seesaw's converter).
    kernels = backend.balanced_kernels(heads)

    def balanced_for(batch: int):
        return {k: backend.plan_balanced(batch, heads, k) for k in kernels}

    top = max(b for b, _, _ in mixes)
    start = time.perf_counter()
    timer = PlanTimer(-(-max(sum(lens) for *_, lens in mixes) // top), top, heads,
                      kv_cache=meta["kv_cache"],
                      max_splits=max(split_for(b, lens).num_kv_splits for b, _, lens in mixes),
                      max_items=max(p.max_work_items for b, _, _ in mixes
                                    for p in balanced_for(b).values()))
    print(f"ragged mixes: {len(mixes)} at batches {sorted({b for b, _, _ in mixes})}, split "
          f"against balanced ({', '.join(kernels)})", flush=True)
    try:
        samples = time_ragged(timer, mixes, split_for, balanced_for,
                              progress=Progress(len(mixes), 0.3 * len(mixes),
                                                enabled=not args.quiet))
        meta["ragged_measured_s"] = round(time.perf_counter() - start, 1)
        return samples
    except ValueError as e:  # a format the balanced kernels do not decode
        print(f"balanced plans cannot run here ({e}); the balanced topology stays off",
              flush=True)
        return []


def switch_ranges(ladder, meta: dict) -> list[tuple[int, int]]:
    """The length ranges the switch is chosen for, from the length the mixes were timed
    from (a report written before ``--balanced-from`` timed them from BALANCED_ABOVE)."""
    return ragged_ranges(ladder.bounds, BALANCED_ABOVE,
                         start=meta.get("balanced_from", BALANCED_ABOVE))


def ragged_switch(args: argparse.Namespace, ladder, meta: dict, saved: list[RaggedSample]
                  ) -> tuple[object, dict | None]:
    """The tuned ladder with its balanced topology, and the report's ragged section (or
    None): a switch per length range chosen from timed mixes (``choose_switches``), or
    one threshold everywhere above the balanced bound (``--balanced-imbalance``, the
    default without mixes; off for the sparse decoder)."""
    if meta.get("decoder") == SPARSE_DECODER:  # no balanced topology to switch to
        if args.balanced_imbalance not in ("auto", 0):
            sys.exit(f"--balanced-imbalance {args.balanced_imbalance}: the report is the sparse"
                     " decoder's, which has no balanced topology; leave it out")
        return ladder.with_balanced_topology(0.0), None
    if args.balanced_imbalance != "auto":
        return ladder.with_balanced_topology(float(args.balanced_imbalance)), None
    samples = saved
    fresh = args.retime_ragged or (not samples and not args.from_times)
    if fresh and meta.get("q_len", 1) == 1:
        import torch

        if not torch.cuda.is_available():
            sys.exit("timing the ragged mixes needs a CUDA GPU; without --retime-ragged the "
                     "report's own mixes are used")
        samples = measure_ragged(args, ladder, meta)
        if args.from_times:  # the split-KV table is the report's, the mixes are new
            from bench.gpu_timing import run_meta

            now = run_meta()
            meta["ragged_retimed"] = {k: now[k] for k in ("date", "gpu", "torch", "triton",
                                                          "command")}
    if not samples:
        print(f"no ragged mixes timed: balanced threshold {DEFAULT_BALANCED_IMBALANCE} "
              "(the default)")
        return ladder.with_balanced_topology(DEFAULT_BALANCED_IMBALANCE), None
    ranges = switch_ranges(ladder, meta)
    model = balanced_cost_model(samples, meta) if not args.one_balanced_kernel else None
    reach, held_out = kernel_neighbours(args, ladder, samples, ranges, meta)
    switches, summary = choose_switches(samples, ranges, model, neighbours=reach,
                                        score=args.kernel_score)
    if held_out is not None:
        summary["kernel_neighbours"] = {"chosen": reach, "held_out_by_length": held_out}
    samples = [s.with_kernel(replayed_kernel(switch_of(switches, s), s, model))
               for s in samples]
    print(f"ragged switch by length: {switches_text(summary)}: worst "
          f"{summary['worst_over_best']} over the faster of split-KV and the balanced plan "
          f"replayed per mix (one switch for every length: "
          f"{summary['one_switch_worst_over_best']}; off: {summary['off_worst_over_best']}, "
          f"always: {summary['always_worst_over_best']}); over the fastest plan timed, any "
          f"balanced kernel: worst {summary['worst_over_fastest']}, mean "
          f"{summary['mean_over_fastest']}", flush=True)
    if any(sw.kernels for sw in switches):
        print("balanced kernel by capture size: " + "; ".join(
            f"({sw.lo}, {sw.hi}]: {dict(sw.kernels) or DEFAULT_BALANCED_KERNEL}"
            for sw in switches), flush=True)
    if any(sw.alternates for sw in switches):
        print("second balanced kernel by capture size (the cost model picks per step): "
              + "; ".join(f"({sw.lo}, {sw.hi}]: {dict(sw.alternates)}"
                          for sw in switches if sw.alternates), flush=True)
    tuned = switched_ladder(ladder, switches, ranges[0][0], model)
    if "balanced_cost" in tuned.meta:
        summary["balanced_cost"] = tuned.meta["balanced_cost"]
    return tuned, {"samples": [s.to_dict() for s in samples], "summary": summary}


MIN_COST_MIXES = 16


def step_ties(args: argparse.Namespace, ladder, times: dict, splits_for, meta: dict):
    """The near-ties of long, wide cells re-ranked in a decode step (``--step-ties``, or
    the saved report's step timings with ``--from-times``): (ladder, records)."""
    from graphbucket.tuning import step_ties as ties

    saved = meta.pop("step_ties_saved", [])
    if not args.step_ties and not saved:
        return ladder, []
    batch, context = args.step_ties_from or (ties.FROM_BATCH, ties.FROM_CONTEXT)
    cells = ties.tie_cells(ladder, times, splits_for, batches=meta["batches"],
                           from_batch=batch, from_context=context)
    print(f"step ties: {len(cells)} cells with near-ties from batch {batch}, bucket tops "
          f"from {context}", flush=True)
    if not cells:
        return ladder, []
    timer = None
    import torch

    if args.step_ties and torch.cuda.is_available():
        from graphbucket.tuning.measure_step import StepTimer

        torch.cuda.empty_cache()
        timer = StepTimer(meta["num_heads"], max_context=max(c.context for c in cells),
                          max_batch=max(c.batch for c in cells),
                          max_model_len=args.max_model_len, kv_cache=meta["kv_cache"],
                          q_len=meta["q_len"])
    elif args.step_ties and not saved:
        print("step ties: no CUDA GPU and no saved step timings; the ladder keeps its hints",
              file=sys.stderr)
    start = time.perf_counter()
    try:
        step_ms = timer if timer is not None else ties.saved_step_ms(saved)
        ladder, records = ties.retime(ladder, cells, step_ms, batches=meta["batches"],
                                      progress=None if args.quiet else print)
    finally:
        if timer is not None:
            timer.close()
    if timer is not None:  # saved step timings cost no GPU time here
        meta["step_ties_s"] = round(time.perf_counter() - start, 1)
    return ladder, records


def kernel_reach_arg(text: str) -> int | str:
    """argparse type: "auto" or a number of ranges (0 or more)."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: 0 ranges or more, or auto")
    return int(text)


def kernel_neighbours(args: argparse.Namespace, ladder, samples: list[RaggedSample],
                      ranges, meta: dict) -> tuple[int, dict | None]:
    """(the ``neighbours`` for ``choose_switches``, the held-out counts behind an "auto"
    choice or None)."""
    if args.kernel_neighbours != "auto":
        return args.kernel_neighbours, None
    if len({second_length(s) for s in samples}) < 2:
        print(f"--kernel-neighbours auto: the mixes were timed at one length, nothing to "
              f"hold out: {KERNEL_NEIGHBOUR_RANGES} (the default)", flush=True)
        return KERNEL_NEIGHBOUR_RANGES, None

    def fit(mixes):
        return None if args.one_balanced_kernel else balanced_cost_model(mixes, meta)
    reach, found = choose_kernel_reach(ladder, samples, ranges, fit, score=args.kernel_score)
    print("--kernel-neighbours auto, each length's mixes replayed under the switch chosen "
          "from the other's: " + "; ".join(
              f"{n}: {f['above']} of {f['mixes']} above {MISS}, mean {f['mean']}, worst "
              f"{f['worst']}" for n, f in found.items()) + f" -> {reach}", flush=True)
    return reach, {str(n): f for n, f in found.items()}


def balanced_cost_model(samples: list[RaggedSample], meta: dict):
    """The cost model of every balanced kernel timed on every mix, fitted on all of them,
    with each kernel's partition at every measured capture size (None with one kernel)."""
    from graphbucket.backends.triton import TritonBackend
    from graphbucket.balanced_cost import partition_of
    from graphbucket.tuning.kernel_pairs import fit_cost_model

    # Four coefficients per kernel: with few mixes (or one kernel) one graph per size stays.
    if len({k for s in samples for k in s.kernel_us()}) < 2 or len(samples) < MIN_COST_MIXES:
        return None
    backend = TritonBackend(num_sms=meta["num_sms"])
    heads = meta["num_heads"]
    return fit_cost_model(
        samples, lambda k, b: partition_of(backend.plan_balanced(b, heads, k), meta["num_sms"]),
        meta["batches"])


def replayed_kernel(switch, sample: RaggedSample, model) -> str:
    """The balanced kernel the selector replays for the sample under ``switch``."""
    from graphbucket.tuning.kernel_pairs import faster_kernel

    main, alt = switch.kernel_for(sample.batch), switch.alternate_for(sample.batch) or ""
    return faster_kernel(model, sample.batch, sample.lens, main, alt)


def switch_of(switches, sample: RaggedSample):
    """The switch whose range holds the sample's longest request (the last if none does)."""
    n = max(sample.lens)
    return next((sw for sw in switches if sw.lo < n <= sw.hi), switches[-1])


def load_times(args: argparse.Namespace) -> tuple[dict, dict]:
    """The timing table and meta of a saved report, narrowed to ``--batches``/``--contexts``."""
    data = json.loads(args.from_times.read_text())
    if "times" not in data or "meta" not in data:
        sys.exit(f"{args.from_times} has no 'times'/'meta'; pass a report this script wrote")
    meta, times = dict(data["meta"]), times_from_rows(data["times"])
    meta["ragged_samples"] = data.get("ragged", {}).get("samples", [])
    meta["step_ties_saved"] = data.get("step_ties", [])
    if timed_plans(data["times"]):
        meta["timed"] = "plans"
    if args.q_len != meta.setdefault("q_len", 1):
        sys.exit(f"{args.from_times} was measured at q_len {meta['q_len']}, not --q-len "
                 f"{args.q_len}; re-measure on the GPU for another q_len")
    if args.heads is not None and args.heads != meta["num_heads"]:
        sys.exit(f"{args.from_times} was measured with {meta['num_heads']} heads, not "
                 f"--heads {args.heads}; re-measure on the GPU for another head count")
    sparse = meta.get("decoder") == SPARSE_DECODER
    if args.sparse and not sparse:
        sys.exit(f"{args.from_times} times the dense decoder, not --sparse; re-measure on the "
                 "GPU with --sparse")
    if args.topk is not None and args.topk != meta.get("topk"):
        sys.exit(f"{args.from_times} was measured at top-k {meta['topk']}, not --topk "
                 f"{args.topk}; re-measure on the GPU for another top-k")
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


def refinement_rounds(times: dict, contexts: list[int], budget: int,
                      edges: Callable[[list[int]], list[int]] | None,
                      measure: Callable[[list[int], list[int]], None]) -> list[int]:
    """Refine the measured contexts in rounds until ``budget`` refined contexts are spent or
    no gap asks for one: each round adds ``refine_contexts``' midpoints (and, with ``edges``,
    each one's edge, which the budget does not count), then ``measure(new, contexts)`` times
    them into ``times``, so the next round sees the crossings the last one found."""
    contexts, left = sorted(contexts), budget
    while left > 0:
        new = [c for c in refine_contexts(times, left) if c not in contexts]
        if not new:
            break
        left -= len(new)
        if edges is not None:
            new = sorted(set(new) | set(edges(new)) - set(contexts))
        contexts = sorted(contexts + new)
        measure(new, contexts)
    return contexts


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
    sparse, baseline = meta.get("decoder") == SPARSE_DECODER, None
    if sparse:  # keyed by the sparse plan each hint captures, compared with sparse_ladder
        from graphbucket.sparse.backend import sparse_ladder

        splits_for = plan_variants(sparse_hint_plans(meta["num_heads"], topk=meta["topk"],
                                                     num_sms=meta["num_sms"], q_len=q_len))
        baseline = sparse_ladder(args.max_model_len, topk=meta["topk"])
    elif meta.get("timed") == "plans":  # keyed by the plan each hint captures
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
    if sparse:
        ladder_meta.update(decoder=SPARSE_DECODER, topk=meta["topk"])
    # Where each context + 1 was measured, buckets end only where their next length was.
    bounds = bounds_with_edges(meta["contexts"]) if meta.get("edges") else None
    result = choose_ladder(times, splits_for, max_model_len=args.max_model_len,
                           max_buckets=args.max_buckets, meta=ladder_meta, baseline=baseline,
                           per_batch_hints=not args.shared_hints, bounds_at=bounds)
    print(summary_table(result), flush=True)
    if not args.shared_hints:  # what per-batch hints buy over one hint per bucket
        shared = choose_ladder(times, splits_for, max_model_len=args.max_model_len,
                               max_buckets=args.max_buckets, per_batch_hints=False,
                               baseline=baseline, bounds_at=bounds)
        result.summary.update(
            shared_mean_over_oracle=shared.summary["tuned_mean_over_oracle"],
            shared_max_over_oracle=shared.summary["tuned_max_over_oracle"])
        print(f"one shared hint per bucket: {shared.ladder!r} mean x "
              f"{shared.summary['tuned_mean_over_oracle']} max x "
              f"{shared.summary['tuned_max_over_oracle']}")
    per_batch = choose_per_batch(times, splits_for, max_model_len=args.max_model_len,
                                 max_buckets=args.max_buckets, meta=ladder_meta,
                                 baseline=baseline, bounds_at=bounds)
    for batch, alone in per_batch.items():
        print(f"batch {batch} alone: {alone.ladder!r} mean x "
              f"{alone.summary['tuned_mean_over_oracle']} max x "
              f"{alone.summary['tuned_max_over_oracle']}")
    meta.update(max_model_len=args.max_model_len, max_buckets=args.max_buckets)
    ladder, step_records = step_ties(args, result.ladder, times, splits_for, meta)
    tuned, ragged = ragged_switch(args, ladder, meta, saved)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tuned.save(args.out)
        print(f"wrote {args.out}")
    report = {"meta": meta, **result.to_dict(), **({"ragged": ragged} if ragged else {}),
              **({"step_ties": step_records} if step_records else {}),
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
