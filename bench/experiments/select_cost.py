"""What choosing between a bucket's two balanced graphs costs the host, per step.

Times ``GraphSelector.key_for`` (the runner's selection call, lengths already validated)
per step of a decode run (every length one token longer each step, a request swapped
every 16 steps) from ragged and uniform batches at the shipped ladders' capture sizes:
the ladder as shipped with its picks remembered (the default), the same with the cost model
run on every weighed step, and the ladder with its alternate kernels dropped (one balanced
graph per bucket); pinned to one core; median, p99 and max microseconds, and how many
steps the remembered pick differs from the model's.

    python3 bench/experiments/select_cost.py --out DIR     # host only, about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from graphbucket.ladder import BucketLadder  # noqa: E402
from graphbucket.select import GraphSelector  # noqa: E402

LADDERS = {16: "graphbucket/ladders/h200-h16.json", 128: "graphbucket/ladders/h200-h128.json"}
SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def mixes(batch: int, top: int) -> dict[str, np.ndarray]:
    return {"uniform": np.full(batch, top - 7),
            "spread": np.array([1 + (top - 1) * i // max(1, batch - 1) for i in range(batch)]),
            "half-long": np.array([top] * (batch // 2) + [4096] * (batch - batch // 2)),
            "one-long": np.array([top] + [700] * (batch - 1))}


def one_graph(ladder: BucketLadder) -> BucketLadder:
    return BucketLadder(tuple(replace(b, alternate_kernels=()) for b in ladder.buckets),
                        ladder.max_model_len, meta=ladder.meta)


def decode_run(batch_lens: np.ndarray, steps: int, swap_every: int = 16) -> list[np.ndarray]:
    """A run of decode steps from ``batch_lens``: every length grows one token a step, and
    every ``swap_every`` steps one request retires and a 1000-token one takes its row."""
    lens, run = batch_lens.astype(np.int64).copy(), []
    for step in range(steps):
        if step and step % swap_every == 0:
            lens[(step // swap_every) % lens.size] = 1000
        run.append(lens.copy())
        lens += 1
    return run


def step_us(sel: GraphSelector, run: list[np.ndarray]) -> tuple[np.ndarray, list]:
    """Per step, the microseconds of ``key_for`` and its key."""
    times, keys = [], []
    for lens in run:
        lo, hi, n = int(lens.min()), int(lens.max()), len(lens)
        t0 = time.perf_counter_ns()
        key = sel.key_for(n, lo, hi, lens)
        times.append(time.perf_counter_ns() - t0)
        keys.append(key)
    return np.array(times) / 1e3, keys


def worst_ratio(sel: GraphSelector, run: list[np.ndarray], picked: list, best: list
                ) -> float:
    """The cost model's time of the remembered pick over its own pick, worst step."""
    worst = 1.0
    for lens, a, b in zip(run, picked, best, strict=True):
        if a != b:
            kernels = dict(zip((False, True), sel.alternate_kernels(b), strict=True))
            worst = max(worst, sel.ladder.balanced_cost.predict(kernels[a.alternate],
                                                                 b.batch_size, lens)
                        / sel.ladder.balanced_cost.predict(kernels[b.alternate],
                                                           b.batch_size, lens))
    return round(worst, 4)


def summary(times: np.ndarray) -> dict[str, float]:
    return {"median": round(float(np.median(times)), 2),
            "p99": round(float(np.percentile(times, 99)), 2),
            "max": round(float(times.max()), 2)}


def markdown(meta: dict, rows: list[dict]) -> str:
    """The weighed runs as a table, and a line over all of them."""
    weighed = [r for r in rows if r["steps_weighed"]]
    lines = [f"# The selector's host cost with two balanced graphs per bucket: remembered "
             f"picks ({meta.get('gpu', 'CPU')} host)", "",
             f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}, one core "
             f"({meta['core']}). Command: `{meta['command']}`.", "",
             f"`GraphSelector.key_for` per step of a {meta['steps']}-step decode run from each "
             "batch (every length one token longer each step, a request swapped for a "
             "1000-token one every 16 steps), shipped H200 ladders, microseconds. "
             "*remembered*: the default selector (a fresh one per run); *every step*: "
             "`remember_picks=False`; *one graph*: the ladder without its alternate kernels. "
             "*weighed*: steps whose key has a second balanced graph; *model runs*: steps the "
             "remembered selector ran the model on; *differ*: steps whose remembered pick is "
             "not the model's, and the model's predicted time of the remembered pick over its "
             "own, worst step. Runs with no weighed step are left out.", "",
             "| heads | batch | context | mix | weighed | model runs | remembered median / "
             "p99 us | every step median us | one graph median us | differ | predicted, "
             "worst |", "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in weighed:
        lines.append(f"| {r['heads']} | {r['batch']} | {r['context']} | {r['mix']} | "
                     f"{r['steps_weighed']} | {r['model_runs_remembered']} | "
                     f"{r['remembered_us']['median']:.2f} / {r['remembered_us']['p99']:.1f} | "
                     f"{r['every_step_us']['median']:.1f} | {r['one_graph_us']['median']:.2f} "
                     f"| {r['picks_differing']} | {r['worst_predicted_ratio']:.3f} |")
    if weighed:
        med = [r["remembered_us"]["median"] for r in weighed]
        every = [r["every_step_us"]["median"] for r in weighed]
        lines += ["", f"Over the {len(weighed)} weighed runs: remembered median "
                  f"{min(med):.2f}-{max(med):.2f} us, every step {min(every):.1f}-"
                  f"{max(every):.1f} us; model runs "
                  f"{sum(r['model_runs_remembered'] for r in weighed)} of "
                  f"{sum(r['steps_weighed'] for r in weighed)} weighed steps; picks differing "
                  f"{sum(r['picks_differing'] for r in weighed)}, predicted "
                  f"{max(r['worst_predicted_ratio'] for r in weighed):.3f}x at worst."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="directory for h200-select-cost.json")
    p.add_argument("--steps", type=int, default=400, help="decode steps per mix")
    p.add_argument("--core", type=int, default=os.cpu_count() - 1)
    args = p.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.core})
    rows = []
    for heads, path in LADDERS.items():
        ladder = BucketLadder.load(path)
        for batch in (8, 32, 64, 128):
            for top in (16384, 98304):
                for mix, lens in mixes(batch, top).items():
                    run = decode_run(np.minimum(lens, top - args.steps), args.steps)
                    # The three interleaved twice (warm code paths); the remembered picks
                    # from a fresh selector each pass, as a run starts with none.
                    make = {"remembered": lambda: GraphSelector(ladder, SIZES),
                            "every_step": lambda: GraphSelector(ladder, SIZES,
                                                                remember_picks=False),
                            "one_graph": lambda: GraphSelector(one_graph(ladder), SIZES)}
                    timed = {name: [] for name in make}
                    for name in [*make, *reversed(make)]:
                        sel = make[name]()
                        times, keys = step_us(sel, run)
                        timed[name].append(times)
                        if name == "remembered":
                            remembered, remembered_keys = sel, keys
                        elif name == "every_step":
                            model, model_keys = sel, keys
                    weighed = [k for k in model_keys if model.alternate_kernels(k) is not None]
                    row = {"heads": heads, "batch": batch, "context": top, "mix": mix,
                           "steps": len(run), "steps_weighed": len(weighed),
                           "steps_alternate": sum(bool(k.alternate) for k in model_keys),
                           "picks_differing": sum(a != b for a, b in
                                                  zip(remembered_keys, model_keys, strict=True)),
                           "worst_predicted_ratio": worst_ratio(model, run, remembered_keys,
                                                                model_keys),
                           "model_runs_remembered": len(remembered._picks)}
                    for name, runs in timed.items():
                        # The second pass: warm code paths.
                        row[f"{name}_us"] = summary(runs[1])
                    rows.append(row)
                    print(f"{heads:>3} heads b={batch:<3} {mix:<9} {top:>6}: weighed "
                          f"{row['steps_weighed']:>3}/{len(run)}, remembered "
                          f"{row['remembered_us']['median']:6.2f} / p99 "
                          f"{row['remembered_us']['p99']:7.2f} us, every step "
                          f"{row['every_step_us']['median']:7.2f}, one graph "
                          f"{row['one_graph_us']['median']:5.2f}; picks differing "
                          f"{row['picks_differing']} (predicted "
                          f"{row['worst_predicted_ratio']:.3f}x at worst)", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        from bench.gpu_timing import run_meta

        meta = {**run_meta(), "command": "python3 bench/experiments/select_cost.py "
                                         f"--out {args.out}", "core": args.core,
                "steps": args.steps}
        (args.out / "h200-select-cost.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        (args.out / "h200-select-cost.md").write_text(markdown(meta, rows))


if __name__ == "__main__":
    main()
