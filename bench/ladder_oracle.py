"""How far is the ladder from the best graph it could have captured? Same run, out of sample.

For every capture size, at contexts the tuner did not measure (a quarter and three
quarters of the way between powers of two, geometrically, and odd lengths, 2 ..
max_model_len - 1) and on the ragged mixes of
bench/ragged.py scaled to the batch (one long request among 1K ones, lengths spread over
1..max_model_len and over 1..8K), this times:

- ``ladder``: the plan the ladder's graph replays, chosen as the runner chooses it
  (``GraphSelector.choose`` then ``graphs.plan_for_key`` on the Triton backend, balanced
  keys included);
- ``oracle``: the fastest of an exhaustive set, timed in the same run: every distinct
  split-KV plan a hint in 1..max_model_len captures at that batch (every split count the
  planner can produce, with its stream and merge), and the balanced plan (q_len 1);
- ``fixed-max``: the plan hinted at max_model_len (the simplest one-graph policy).

Timing as the tuner's (``graphbucket.tuning.measure``: cold L2, CUDA-graph replays). The
oracle is the fastest of many noisy times, so a first pass overstates how far the ladder is
from it (the minimum of N samples sits below its plan's true time). A row above 1.02 whose
ladder plan differs from the oracle's is therefore timed again, only those two plans, on
fresh tables with more samples: ``confirmed_ladder_us`` / ``confirmed_oracle_us`` /
``ladder_over_oracle_confirmed`` (an independent measurement of a chosen pair, free of that
selection). Rows carry ``heads``, ``kv_format``, ``q_len``, ``batch``, ``context`` (the
longest length), ``mix``, ``ladder_us``, ``oracle_us``, ``ladder_plan``, ``oracle_plan``,
``fixed_max_us`` and ``ladder_over_oracle``. ``--out DIR`` writes
h200-ladder-oracle.{json,md,png}; a second run (other heads, format or q_len) into the same
DIR adds its rows to the JSON with ``--append``.

    python3 bench/ladder_oracle.py --heads 16 --out OUT            # the shipped ladder
    python3 bench/ladder_oracle.py --heads 128 --ladder OUT/h200-h128.json --out OUT
    python3 bench/ladder_oracle.py --dry-run                       # count and estimate
    python3 bench/ladder_oracle.py --sparse --out OUT              # the sparse decoder's

``--sparse`` checks the sparse decoder's ladder (DeepSeek-V3.2, ``--topk``; default: the
one shipped for this GPU, else ``sparse_ladder``): its oracle is every distinct
``plan_sparse_decode`` plan a hint captures (no balanced topology), each timed as one
sparse decode layer (``graphbucket.tuning.measure_sparse``); it writes
h200-ladder-oracle-sparse.{json,md,png}.
    python3 bench/ladder_oracle.py --cpu-smoke                     # interpreter, toy sizes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

if "--cpu-smoke" in sys.argv:  # before triton is imported: it reads the flag then
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphbucket.ladder import BucketLadder, default_ladder  # noqa: E402
from graphbucket.plan import LaunchPlan  # noqa: E402
from graphbucket.select import GraphSelector  # noqa: E402
from graphbucket.tuning.grid import candidate_hints, hints_to_measure  # noqa: E402

CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
MAX_MODEL_LEN = 131072
FLAG_ABOVE = 1.02  # the target: ladder / oracle <= 1.02
NAME = "h200-ladder-oracle"


# ---- host logic: the grid, the mixes, the plans and the rows ---------------------------


def oracle_contexts(max_model_len: int, tuned: list[int] | tuple[int, ...] = ()) -> list[int]:
    """Out-of-sample lengths: round(2^(k + 1/4)), round(2^(k + 3/4)) and 2^k + 1 for
    k >= 1, and max_model_len - 1, none of them in ``tuned`` (the tuner's measured
    contexts: its grid is the powers of two, their midpoints 2^(k + 1/2) and each + 1)."""
    grid = {round(2 ** (k + f)) for k in range(1, max_model_len.bit_length())
            for f in (0.25, 0.75)}
    grid |= {(1 << k) + 1 for k in range(1, max_model_len.bit_length())}
    grid.add(max_model_len - 1)
    return sorted(c for c in grid if 1 < c < max_model_len and c not in set(tuned))


def ragged_mixes(batch: int, max_model_len: int) -> list[tuple[str, list[int]]]:
    """bench/ragged.py's mixes at ``batch`` requests (none at one request)."""
    if batch < 2:
        return []
    short = min(1024, max_model_len)
    mixes = [("long-among-short", [max_model_len] + [short] * (batch - 1)),
             (f"spread-{max_model_len // 1024}k" if max_model_len >= 1024 else "spread",
              np.linspace(1, max_model_len, batch).astype(int).tolist())]
    if batch >= 4 and max_model_len > 8192:
        mixes.append(("spread-8k", np.linspace(1, 8192, batch).astype(int).tolist()))
    return mixes


def exhaustive_plans(backend, batch: int, num_heads: int, max_model_len: int, *,
                     q_len: int = 1) -> dict[str, LaunchPlan]:
    """Every distinct plan a graph of ``batch`` rows could capture, by ``describe()``:
    split-KV at every hint that plans differently, and at q_len 1 balanced with each
    balanced kernel the backend offers (below 64 heads: the Triton stage 1's rows and the
    seesaw's 64-row programs)."""
    hints = hints_to_measure(candidate_hints(max_model_len), max_model_len)
    plans = {p.describe(): p for p in (backend.plan(batch, num_heads * q_len, h)
                                        for h in hints)}
    if q_len == 1:
        for kernel in backend.balanced_kernels(num_heads):
            balanced = backend.plan_balanced(batch, num_heads, kernel)
            plans[balanced.describe()] = balanced
    return plans


def ladder_plan(selector: GraphSelector, backend, num_heads: int, lens: list[int],
                q_len: int = 1) -> LaunchPlan:
    """The plan the runner's graph replays for these host lengths."""
    from graphbucket.graphs import balanced_kernel_of, plan_for_key

    key = selector.choose(lens, q_len)
    return plan_for_key(backend, key, num_heads, balanced_kernel_of(selector, key))


def oracle_row(times: dict[str, float], *, ladder: LaunchPlan, fixed_max: LaunchPlan,
               **config) -> dict:
    """One result row from ``{plan label: us}`` (the oracle: their minimum, ties to the
    first label in sort order)."""
    oracle_plan, oracle_us = min(sorted(times.items()), key=lambda kv: kv[1])
    ladder_us = times[ladder.describe()]
    return {**config, "ladder_us": round(ladder_us, 3), "oracle_us": round(oracle_us, 3),
            "ladder_plan": ladder.describe(), "oracle_plan": oracle_plan,
            "fixed_max_us": round(times[fixed_max.describe()], 3),
            "ladder_over_oracle": round(ladder_us / oracle_us, 4),
            "fixed_max_over_oracle": round(times[fixed_max.describe()] / oracle_us, 4)}


CONFIRM_REPS = 15  # samples per plan when a flagged row is timed again


def needs_confirming(row: dict) -> bool:
    """A row whose first pass puts the ladder above the target with another plan than the
    oracle's (the same plan is the same graph: its ratio is noise by construction)."""
    return row["ladder_over_oracle"] > FLAG_ABOVE and row["ladder_plan"] != row["oracle_plan"]


def confirmed(row: dict, times: dict[str, float]) -> dict:
    """``row`` with the second, independent timing of its ladder and oracle plans."""
    ladder_us, oracle_us = times[row["ladder_plan"]], times[row["oracle_plan"]]
    return {**row, "confirmed_ladder_us": round(ladder_us, 3),
            "confirmed_oracle_us": round(oracle_us, 3),
            "ladder_over_oracle_confirmed": round(ladder_us / oracle_us, 4)}


def settled_ratio(row: dict) -> float:
    """The ladder / oracle a row stands at: confirmed where it was timed again."""
    return row.get("ladder_over_oracle_confirmed", row["ladder_over_oracle"])


def shapes(batches: list[int], max_model_len: int, tuned: list[int], q_len: int
           ) -> list[tuple[int, str, list[int]]]:
    """(batch, mix, lengths) of every row: uniform at the out-of-sample grid, then the mixes
    (q_len 1 only: the balanced topology decodes one token)."""
    grid = [c for c in oracle_contexts(max_model_len, tuned) if c >= q_len]
    out = []
    for batch in batches:
        out += [(batch, "uniform", [c] * batch) for c in grid]
        if q_len == 1:
            out += [(batch, mix, lens) for mix, lens in ragged_mixes(batch, max_model_len)]
    return out


def config_of(row: dict) -> tuple:
    return row["heads"], row["kv_format"], row["q_len"]


def merged(old: dict, new: dict) -> dict:
    """``new``'s rows added to ``old``'s, replacing the rows of any (heads, format, q_len)
    that ``new`` measured again; ``runs`` keeps the meta of every run whose rows remain."""
    again = {config_of(r) for r in new["rows"]}
    rows = [r for r in old["rows"] if config_of(r) not in again] + new["rows"]
    runs = old.get("runs") or [{**old["meta"],
                                "configs": sorted({config_of(r) for r in old["rows"]})}]
    runs = [{**m, "configs": [c for c in map(tuple, m["configs"]) if c not in again]}
            for m in runs]
    return {"meta": new["meta"], "runs": [m for m in runs if m["configs"]] + [new["meta"]],
            "rows": rows}


def markdown(result: dict) -> str:
    meta, rows = result["meta"], result["rows"]
    runs = result.get("runs", [meta])
    what = (f"Sparse decoder's ladder (top-k {meta['topk']})" if meta.get("decoder") == "sparse"
            else "Ladder")
    lines = [f"# {what} against the oracle ({meta['gpu']})", ""]
    for entry in runs:
        what = ", ".join(f"{h} heads {f} q_len {q}" for h, f, q in entry.get("configs", []))
        lines += [f"{entry['date']}, torch {entry['torch']}, triton "
                  f"{entry['triton']}{': ' + what if what else ''}. Command: "
                  f"`{entry['command']}`. Ladder: {entry['ladder_source']}.", ""]
    lines += [
             "Worst ladder / oracle per (heads, format, q_len, batch):", "",
             "| heads | format | q_len | batch | rows | worst ladder / oracle | at | "
             "worst, flagged rows timed again | worst fixed-max / oracle |",
             "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["heads"], r["kv_format"], r["q_len"], r["batch"]), []).append(r)
    for (heads, fmt, q_len, batch), mine in sorted(groups.items()):
        worst = max(mine, key=lambda r: r["ladder_over_oracle"])
        settled = max(mine, key=settled_ratio)
        lines.append(f"| {heads} | {fmt} | {q_len} | {batch} | {len(mine)} | "
                     f"{worst['ladder_over_oracle']:.3f} | {worst['mix']} {worst['context']} "
                     f"| {settled_ratio(settled):.3f} ({settled['mix']} {settled['context']}) "
                     f"| {max(r['fixed_max_over_oracle'] for r in mine):.3f} |")
    flagged = [r for r in rows if r["ladder_over_oracle"] > FLAG_ABOVE]
    settled = [r for r in rows if settled_ratio(r) > FLAG_ABOVE]
    retimed = [r for r in rows if "ladder_over_oracle_confirmed" in r]
    lines += ["", f"Rows above {FLAG_ABOVE}: {len(flagged)} of {len(rows)} in the first pass"
              + (f"; {len(settled)} after timing the {len(retimed)} flagged pairs of "
                 "different plans again (`x again`: only the ladder's and the oracle's "
                 "plan, fresh tables, more samples)." if retimed else "."), ""]
    if flagged:
        lines += ["| heads | format | q_len | batch | mix | context | ladder us | oracle us | "
                  "x | x again | ladder plan | oracle plan |", "|---" * 12 + "|"]
        lines += [f"| {r['heads']} | {r['kv_format']} | {r['q_len']} | {r['batch']} | "
                  f"{r['mix']} | {r['context']} | {r['ladder_us']:.1f} | {r['oracle_us']:.1f} | "
                  f"{r['ladder_over_oracle']:.3f} | "
                  + (f"{r['ladder_over_oracle_confirmed']:.3f}"
                     if "ladder_over_oracle_confirmed" in r else "-")
                  + f" | {r['ladder_plan']} | {r['oracle_plan']} |"
                  for r in flagged]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> bool:
    """Ladder / oracle (and fixed-max / oracle) over context, one panel per batch, uniform
    rows; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipped the figure", file=sys.stderr)
        return False
    rows = [r for r in result["rows"] if r["mix"] == "uniform"]
    batches = sorted({r["batch"] for r in rows})
    configs = sorted({(r["heads"], r["kv_format"], r["q_len"]) for r in rows})
    cols = -(-len(batches) // 2) if len(batches) > 4 else len(batches)
    grid_rows = -(-len(batches) // cols)
    fig, axes = plt.subplots(grid_rows, cols, figsize=(3.4 * cols, 2.9 * grid_rows + 1.2),
                             squeeze=False, sharey=True)
    # The y range shows the ladder's distance from the oracle; fixed-max, often far above,
    # leaves the panel at its top and its worst ratio is written in the panel.
    top = max(1.25, 1.03 * max(r["ladder_over_oracle"] for r in rows))
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(batches):]:
        ax.set_visible(False)
    for ax, batch in zip(flat[:len(batches)], batches, strict=True):
        for heads, fmt, q_len in configs:
            mine = sorted((r for r in rows if (r["batch"], r["heads"], r["kv_format"],
                                               r["q_len"]) == (batch, heads, fmt, q_len)),
                          key=lambda r: r["context"])
            ctx = [r["context"] for r in mine]
            tag = f"{heads} heads, {fmt}, q_len {q_len}"
            ax.semilogx(ctx, [r["ladder_over_oracle"] for r in mine], marker="o", ms=3,
                        label=f"ladder, {tag}")
            ax.semilogx(ctx, [r["fixed_max_over_oracle"] for r in mine], ls=":", lw=1,
                        label=f"fixed-max, {tag}")
        ax.axhline(FLAG_ABOVE, color="grey", ls="--", lw=0.8, label=f"{FLAG_ABOVE} target")
        mine = [r for r in rows if r["batch"] == batch]
        worst = max(mine, key=lambda r: r["ladder_over_oracle"])
        ax.text(0.03, 0.95, f"ladder worst {worst['ladder_over_oracle']:.3f} at "
                f"{worst['context']}\nfixed-max up to "
                f"{max(r['fixed_max_over_oracle'] for r in mine):.2f}x",
                transform=ax.transAxes, va="top", fontsize=7,
                bbox={"facecolor": "white", "edgecolor": "0.7", "alpha": 0.9})
        ax.set_ylim(0.97, top)
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("context (tokens)")
        ax.grid(True, alpha=0.3)
    for row in axes:
        row[0].set_ylabel("time / oracle time")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=3, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.93 if grid_rows > 1 else 0.90))
    title = "; ".join(f"{h} heads, {f} cache, q_len {q}" for h, f, q in configs)
    kernel = (f"sparse MLA decode, top-k {result['meta']['topk']}"
              if result["meta"].get("decoder") == "sparse" else "MLA decode 576/512")
    fig.suptitle(f"Ladder over the exhaustive oracle ({kernel}), uniform batches "
                 f"(ragged mixes: the table): {title}\n"
                 f"{result['meta']['gpu']}, {result['meta']['date']}")
    fig.subplots_adjust(top=0.70 if grid_rows == 1 else 0.84, bottom=0.14 / grid_rows,
                        left=0.06, right=0.99, wspace=0.08, hspace=0.45)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- timing -----------------------------------------------------------------------------


class Cases:
    """One cache (in the format timed) for every shape; scattered tables per shape, R
    rotations on the GPU (cold L2), one call on the CPU interpreter."""

    def __init__(self, max_tokens: int, rows: int, kv_cache: str, *, q_len: int,
                 max_batch: int, max_splits: int, max_items: int, device: str,
                 rank: int = 512, rope: int = 64, page: int = 64) -> None:
        import torch

        from graphbucket import fp8
        from graphbucket.kernels import SplitWorkspace, default_sm_scale

        self.torch, self.device, self.q_len, self.rows = torch, device, q_len, rows
        self.rank, self.dim, self.page, self.kv_cache = rank, rank + rope, page, kv_cache
        self.num_pages = -(-max_tokens // page) + max_batch
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.dtype, self.kv_scale = dtype, None
        if kv_cache == "bf16":
            self.cache = torch.randn(self.num_pages, page, self.dim, device=device,
                                     dtype=dtype)
        else:  # the tuner's fp8 rows and scale (CUDA)
            from graphbucket.tuning.measure import Problem

            problem = Problem(self.num_pages * page, rows, kv_cache)
            self.cache, self.kv_scale = problem.cache, problem.kv_scale
        self.row_bytes = fp8.row_bytes(kv_cache, self.dim, torch.bfloat16)
        self.ws = SplitWorkspace.allocate(max_batch, rows, max(1, max_splits), rank, device,
                                          max_items=max_items)
        self.scale = default_sm_scale(self.dim) if device != "cuda" else default_sm_scale()

    def time(self, lens: list[int], plans: dict[str, LaunchPlan], reps: int | None = None
             ) -> dict[str, float]:
        from graphbucket.kernels import mla_decode, mla_decode_balanced
        from graphbucket.tuning.measure import L2_FLUSH_BYTES, MAX_ROTATIONS

        torch, pages = self.torch, [-(-n // self.page) for n in lens]
        per_call = sum(pages)
        step_bytes = sum(lens) * self.row_bytes + len(lens) * self.rows * 2176
        rotations = 1 if self.device != "cuda" else max(1, min(
            MAX_ROTATIONS, L2_FLUSH_BYTES // step_bytes, self.num_pages // per_call))
        perm = torch.randperm(self.num_pages, device=self.device)[: rotations * per_call]
        tables = torch.zeros(rotations, len(lens), max(pages), dtype=torch.int32,
                             device=self.device)
        for r in range(rotations):
            for b, row in enumerate(perm[r * per_call:(r + 1) * per_call].split(pages)):
                tables[r, b, :row.numel()] = row.int()
        q = torch.randn(rotations, len(lens), self.rows, self.dim, dtype=self.dtype,
                        device=self.device)
        out = torch.empty(rotations, len(lens), self.rows, self.rank, dtype=self.dtype,
                          device=self.device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=self.device)
        calls = {}
        for label, plan in plans.items():
            def call(plan=plan):
                for r in range(rotations):
                    if plan.balanced:
                        mla_decode_balanced(q[r], self.cache, tables[r], seq_lens, out[r],
                                            self.ws, plan=plan, sm_scale=self.scale,
                                            kv_scale=self.kv_scale, check=False)
                    else:
                        mla_decode(q[r], self.cache, tables[r], seq_lens, out[r], self.ws,
                                   plan=plan, sm_scale=self.scale, kv_scale=self.kv_scale,
                                   q_len=self.q_len, check=False)
            calls[label] = call
        return self._time(calls, rotations, reps)

    def _time(self, calls: dict, rotations: int, reps: int | None = None) -> dict[str, float]:
        """``{label: us per call}``: interleaved graph replays on the GPU
        (``time_replays_paired``, ``reps`` samples each, default the tuner's), wall-clock
        calls on the interpreter."""
        if self.device == "cuda":
            from graphbucket.tuning.measure import SAMPLE_MS, TUNE_REPS, time_replays_paired

            return time_replays_paired(calls, calls_per_graph=rotations,
                                       reps=reps or TUNE_REPS, min_ms=SAMPLE_MS)
        return {label: self._wall_us(call) for label, call in calls.items()}

    @staticmethod
    def _wall_us(call) -> float:
        samples = []
        for _ in range(2):  # the interpreter: one call, wall clock (a smoke test)
            start = time.perf_counter()
            call()
            samples.append((time.perf_counter() - start) * 1e6)
        return statistics.median(samples)


def sparse_timer(args, per_batch: dict, max_tokens: int):
    """``time_lens(lens, plans)`` of the sparse decode layer over one pair of caches."""
    from graphbucket.tuning.measure_sparse import SparsePlanTimer

    timer = SparsePlanTimer(args.max_model_len, max(args.batches), args.heads, topk=args.topk,
                            q_len=args.q_len, kv_cache=args.kv_cache, max_tokens=max_tokens,
                            max_splits=max(p.attention_splits for ps in per_batch.values()
                                           for p in ps.values()))
    return timer.time_lens


def run(args, ladder: BucketLadder, backend, device: str, dims: dict) -> list[dict]:
    batches, heads, q_len = args.batches, args.heads, args.q_len
    tuned = ladder.meta.get("contexts", [])
    todo = shapes(batches, args.max_model_len, tuned, q_len)
    selector = GraphSelector(ladder, batches, q_lens=(q_len,))
    fixed = GraphSelector(BucketLadder.from_dict({"max_model_len": args.max_model_len,
                                                  "buckets": [{"max_len": args.max_model_len,
                                                               "hint": args.max_model_len}]}),
                          batches, q_lens=(q_len,))
    per_batch = {b: exhaustive_plans(backend, b, heads, args.max_model_len, q_len=q_len)
                 for b in batches}
    max_tokens = max(sum(lens) for _, _, lens in todo)
    if args.sparse:
        time_lens = sparse_timer(args, per_batch, max_tokens)
    else:
        max_splits = max(p.num_kv_splits for ps in per_batch.values() for p in ps.values())
        max_items = max(p.max_work_items for ps in per_batch.values() for p in ps.values())
        time_lens = Cases(max_tokens, heads * q_len, args.kv_cache, q_len=q_len,
                          max_batch=max(batches), max_splits=max_splits, max_items=max_items,
                          device=device, **dims).time
    rows, start = [], time.perf_counter()
    for i, (batch, mix, lens) in enumerate(todo):
        ladder_p = ladder_plan(selector, backend, heads, lens, q_len)
        fixed_p = ladder_plan(fixed, backend, heads, lens, q_len)
        plans = {**per_batch[batch], ladder_p.describe(): ladder_p,
                 fixed_p.describe(): fixed_p}
        r = oracle_row(time_lens(lens, plans), ladder=ladder_p, fixed_max=fixed_p,
                       heads=heads, kv_format=args.kv_cache, q_len=q_len, batch=batch,
                       context=max(lens), mix=mix)
        again = ""
        if needs_confirming(r):
            pair = {label: plans[label] for label in (r["ladder_plan"], r["oracle_plan"])}
            r = confirmed(r, time_lens(lens, pair, reps=CONFIRM_REPS))
            again = f", again x{r['ladder_over_oracle_confirmed']:.3f}"
        rows.append(r)
        elapsed = time.perf_counter() - start
        print(f"[{i + 1}/{len(todo)}] b={batch} {mix} {max(lens)}: ladder {r['ladder_us']:.1f}"
              f" oracle {r['oracle_us']:.1f} x{r['ladder_over_oracle']:.3f}{again} "
              f"({elapsed:.0f} s, ETA {elapsed / (i + 1) * (len(todo) - i - 1):.0f} s)",
              flush=True)
    return rows


def estimate(args, backend) -> tuple[int, float]:
    """(measurements, estimated GPU seconds) of a run: shapes x plans timed each."""
    from graphbucket.tuning.measure import estimate_seconds

    todo = shapes(args.batches, args.max_model_len, [], args.q_len)
    counts = {b: len(exhaustive_plans(backend, b, args.heads, args.max_model_len,
                                      q_len=args.q_len)) + 1 for b in args.batches}
    est = [(math.ceil(sum(lens) / b), b, counts[b]) for b, _, lens in todo]
    pages = -(-max(sum(lens) for *_, lens in todo) // 64)
    if args.sparse:
        from graphbucket.tuning.measure_sparse import estimate_sparse_seconds

        return sum(n for *_, n in est), estimate_sparse_seconds(
            est, args.heads, topk=args.topk, num_pages=pages, q_len=args.q_len,
            kv_cache=args.kv_cache)
    return sum(n for *_, n in est), estimate_seconds(
        est, args.heads * args.q_len, args.kv_cache, num_pages=pages)


def main(argv: list[str] | None = None) -> None:
    from bench.gpu_timing import add_out_argument, out_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(ap, f"{NAME}.json, .md and .png", smoke=True)
    ap.add_argument("--heads", type=int, default=16, help="attention heads (default 16)")
    ap.add_argument("--kv-cache", default="bf16", choices=("bf16", "fp8-tensor", "fp8-v32"),
                    help="cache format timed (default bf16)")
    ap.add_argument("--q-len", type=int, default=1, help="query tokens per request")
    ap.add_argument("--batches", type=int, nargs="+", default=CAPTURE_SIZES,
                    help="capture sizes (default: %(default)s)")
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    ap.add_argument("--ladder", metavar="PATH",
                    help="ladder JSON to check (default: the one shipped for this GPU, heads "
                         "and format; else default_ladder)")
    ap.add_argument("--sparse", action="store_true",
                    help="check the sparse decoder's ladder (DeepSeek-V3.2) against every "
                         "sparse plan a hint captures; writes h200-ladder-oracle-sparse.*")
    ap.add_argument("--topk", type=int, default=None,
                    help="the sparse decoder's top-k (--sparse only; default 2048)")
    ap.add_argument("--append", action="store_true",
                    help=f"add the rows to an existing {NAME}.json in --out")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the measurement count and estimated GPU time, then exit")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="a tiny run on the Triton interpreter (batches 1 2, 256 tokens)")
    args = ap.parse_args(argv)
    for name in ("heads", "q_len", "max_model_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.batches) < 1:
        ap.error(f"--batches must be >= 1, got {args.batches}")
    if args.sparse:
        from graphbucket.sparse.plan import DEFAULT_TOPK

        args.topk = args.topk or DEFAULT_TOPK
        if args.cpu_smoke or args.kv_cache == "fp8-tensor" or args.topk < 1:
            ap.error("--sparse times bf16 or fp8-v32 caches on a GPU, top-k >= 1 (no "
                     "--cpu-smoke, no fp8-tensor)")
    elif args.topk is not None:
        ap.error("--topk applies to the sparse decoder; pass --sparse too")
    import torch

    from graphbucket import get_backend

    dims: dict = {}
    if args.cpu_smoke:
        if args.kv_cache != "bf16":
            ap.error(f"--cpu-smoke times the bf16 path only, got --kv-cache {args.kv_cache}")
        args.batches, args.max_model_len, device = [1, 2], 256, "cpu"
        dims = {"rank": 64, "rope": 16, "page": 16}
        backend = get_backend("triton", num_sms=2, kv_lora_rank=64, qk_rope_dim=16)
    else:
        device = "cuda"
        num_sms = torch.cuda.get_device_properties(
            0).multi_processor_count if torch.cuda.is_available() else 132
        backend = get_backend("sparse", num_heads=args.heads, max_len=args.max_model_len,
                              topk=args.topk, num_sms=num_sms) if args.sparse else \
            get_backend("triton", num_sms=num_sms)
    if args.dry_run:
        count, seconds = estimate(args, backend)
        print(f"{count} measurements, about {seconds:.0f} s of GPU time")
        return
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("ladder_oracle.py times CUDA graph replays and needs a CUDA GPU; "
                 "--cpu-smoke runs a tiny version on the interpreter")
    ladder, source = load_ladder(args, device)
    out = out_dir(args.out, smoke=args.cpu_smoke)  # a bad --out fails before the run
    from bench.gpu_timing import run_meta

    if device == "cuda":
        count, seconds = estimate(args, backend)
        print(f"{count} measurements, about {seconds:.0f} s of GPU time", flush=True)
    torch.manual_seed(0)
    rows = run(args, ladder, backend, device, dims)
    sparse = {"decoder": "sparse", "topk": args.topk} if args.sparse else {}
    result = {"meta": {**run_meta(), "ladder_source": source, "ladder": ladder.to_dict(),
                       "configs": sorted({config_of(r) for r in rows}), **sparse},
              "rows": rows}
    path = os.path.join(out, NAME + "-sparse" * args.sparse) if out else None
    if path and args.append and os.path.exists(path + ".json"):
        with open(path + ".json") as f:
            result = merged(json.load(f), result)
    print(markdown(result))
    if path:
        with open(path + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(path + ".md", "w") as f:
            f.write(markdown(result))
        plot(result, path + ".png")
        print(f"wrote {path}.json, .md, .png")


def load_ladder(args, device: str) -> tuple[BucketLadder, str]:
    """The ladder to check and where it came from."""
    if args.ladder:
        ladder = BucketLadder.load(args.ladder)
        if ladder.max_model_len != args.max_model_len:
            sys.exit(f"--ladder {args.ladder} covers 1..{ladder.max_model_len}, not "
                     f"--max-model-len {args.max_model_len}")
        if args.sparse and any(b.balanced_imbalance or b.batch_imbalance for b in ladder):
            sys.exit(f"--ladder {args.ladder} has balanced buckets; the sparse decoder has no "
                     "balanced topology (tune it with scripts/tune_ladder.py --sparse)")
        return ladder, args.ladder
    if device == "cuda":
        import torch

        from graphbucket.tuning.shipped import find_tuned_ladder

        tuned = find_tuned_ladder(torch.cuda.get_device_name(0), args.heads,
                                  args.max_model_len, kv_cache_format=args.kv_cache,
                                  sparse_topk=args.topk if args.sparse else None)
        if tuned is not None:
            return tuned, "shipped for this GPU"
    if args.sparse:
        from graphbucket.sparse.backend import sparse_ladder

        return sparse_ladder(args.max_model_len, topk=args.topk), "sparse_ladder"
    return default_ladder(args.max_model_len), "default_ladder"


if __name__ == "__main__":
    main()
