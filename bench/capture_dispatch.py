"""Capture and dispatch costs of bucketed FULL graphs (H200): graphs, pool memory, host step.

Captures a small MLA-shaped decoder (token embedding, then per layer: q projection, paged
MLA decode through the Triton backend, output projection; heads 16, rank 512, rope 64,
bf16, page 64) for capture sizes 1..64, once with the default ladder and once with a
single bucket (hint = max_model_len), and measures:

- graphs captured / aliased, capture seconds, pool bytes of both captures;
- syncs on the replay path: steps under ``torch.cuda.set_sync_debug_mode("warn")``, with
  each warning's message, the Python line that triggered it and its stack (``sync_sites``);
- host time of one step (validate + select + stage + replay launch) with the GPU idle,
  as a median over random batch sizes and lengths, and its breakdown; medians per
  batch-size class and per bucket of the same steps; and a grid of fixed batch sizes x
  buckets, so a target can be read where it holds and where it does not;
- the headline host medians (``host_us_median_batch1``, ``host_us_median_batch64_128k``):
  decode trajectories (every request one token longer per step, a new page when it needs
  one) stepped through the full-table path (a fresh host table per step) and through the
  runner's ``BlockTable`` (the verbs that change it, timed with the step), alternating
  step by step in one call, pinned to one core; then syncs over 1000 such BlockTable steps.

    python3 bench/capture_dispatch.py --out bench/results      # CUDA: h200-capture.{json,md}
    python3 bench/capture_dispatch.py --cpu-smoke              # tiny CPU run, files to /tmp
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not torch.cuda.is_available():  # --cpu-smoke: the Triton kernels run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from graphbucket.backends import get_backend  # noqa: E402
from graphbucket.batch import BatchValidator, DecodeBatch  # noqa: E402
from graphbucket.block_table import BlockTable  # noqa: E402
from graphbucket.context import DecodeContext  # noqa: E402
from graphbucket.ladder import BucketLadder, default_ladder  # noqa: E402
from graphbucket.runner import GraphBucketRunner  # noqa: E402
from graphbucket.spec import BufferSpec, InputSpec  # noqa: E402

SEED = 0
TARGETS = {"syncs_on_replay": 0, "pool_ratio_max": 1.2, "step_host_us_median_max": 20.0,
           "host_us_batch1_max": 20.0, "host_us_batch64_128k_max": 40.0}
# Batch-size classes of the per-class host medians: (label, smallest, largest).
BATCH_CLASSES = (("1", 1, 1), ("2-8", 2, 8), ("9-64", 9, 64))
GRID_BATCH_SIZES, GRID_STEPS = (1, 8, 64), 40
AB_STEPS, SYNC_STEPS = 300, 1000  # per A/B cell (batch 1: per bucket); BlockTable sync count


@dataclass(frozen=True)
class Config:
    heads: int = 16
    rank: int = 512
    rope: int = 64
    hidden: int = 1024
    page: int = 64
    layers: int = 3
    max_model_len: int = 131072
    num_pages: int = 8192
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda"
    num_sms: int | None = None


SMOKE = Config(rank=64, rope=16, hidden=32, page=16, layers=2, max_model_len=320, num_pages=64,
               batch_sizes=(1, 2), dtype=torch.float32, device="cpu", num_sms=1)


class MLADecoder:
    """Embedding -> layers of (q projection, paged MLA decode, output projection) -> hidden."""

    def __init__(self, cfg: Config) -> None:
        g = torch.Generator(device=cfg.device).manual_seed(SEED)
        d = cfg.rank + cfg.rope

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=cfg.device) * scale).to(cfg.dtype)

        self.cfg = cfg
        self.embed = rand(1000, cfg.hidden)
        self.w_q = [rand(cfg.hidden, cfg.heads * d, scale=cfg.hidden ** -0.5)
                    for _ in range(cfg.layers)]
        self.w_o = [rand(cfg.heads * cfg.rank, cfg.hidden, scale=(cfg.heads * cfg.rank) ** -0.5)
                    for _ in range(cfg.layers)]
        self.kv = [rand(cfg.num_pages, cfg.page, d) for _ in range(cfg.layers)]

    def __call__(self, ctx: DecodeContext) -> torch.Tensor:
        cfg, bs = self.cfg, ctx.batch_size
        x = self.embed[ctx.inputs["token_ids"]]
        for w_q, w_o, kv in zip(self.w_q, self.w_o, self.kv, strict=True):
            q = (x @ w_q).view(bs, cfg.heads, cfg.rank + cfg.rope)
            attn = torch.empty(bs, cfg.heads, cfg.rank, dtype=x.dtype, device=x.device)
            ctx.attend(q, kv, attn)
            x = x + attn.view(bs, -1) @ w_o
        return x


def make_runner(cfg: Config, model: MLADecoder, ladder: BucketLadder, *,
                copy_in_graph: bool = True, copy_kernel: bool = True) -> GraphBucketRunner:
    spec = BufferSpec(max_pages_per_seq=cfg.max_model_len // cfg.page, num_pages=cfg.num_pages,
                      page_size=cfg.page, num_heads=cfg.heads, output_shape=(cfg.hidden,),
                      output_dtype=cfg.dtype, inputs=(InputSpec("token_ids", (), torch.int64),),
                      device=cfg.device)
    backend = get_backend("triton", kv_lora_rank=cfg.rank, qk_rope_dim=cfg.rope,
                          num_sms=cfg.num_sms, device=cfg.device)
    return GraphBucketRunner(model, spec=spec, batch_sizes=list(cfg.batch_sizes), ladder=ladder,
                             sm_scale=(cfg.rank + cfg.rope) ** -0.5, backend=backend,
                             copy_in_graph=copy_in_graph, copy_kernel=copy_kernel)


def random_batches(cfg: Config, ladder: BucketLadder, n: int, *, batch_size: int | None = None,
                   bucket: int | None = None, seed: int = SEED) -> list[DecodeBatch]:
    """Random batch size in 1..max, a random bucket, lengths uniform inside that bucket
    (``batch_size`` / ``bucket`` pin one of them)."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(n):
        bs = int(rng.integers(1, max(cfg.batch_sizes) + 1))
        lo, hi = ladder.ranges[int(rng.integers(len(ladder)))]
        if batch_size is not None:
            bs = batch_size
        if bucket is not None:
            lo, hi = ladder.ranges[bucket]
        lens = rng.integers(lo, hi + 1, size=bs).tolist()
        cols = -(-max(lens) // cfg.page)
        table = rng.integers(0, cfg.num_pages, size=(bs, cols), dtype=np.int32)
        tokens = torch.from_numpy(rng.integers(0, 1000, size=bs))
        batches.append(DecodeBatch(lens, table, {"token_ids": tokens}))
    return batches


def capture_record(runner: GraphBucketRunner) -> dict:
    summary = runner.capture()
    return {"graphs_captured": summary.graphs_captured, "graphs_aliased": summary.graphs_aliased,
            "capture_s": round(summary.capture_s, 3), "pool_bytes": summary.pool_bytes,
            "graphs": [{"batch_size": r.batch_size, "splits": r.plan.num_kv_splits,
                        "block_n": r.plan.block_n, "buckets": list(r.buckets),
                        "bytes": r.nbytes, "seconds": round(r.seconds, 4)}
                       for r in runner.records]}


_TORCH_DIR = os.path.dirname(torch.__file__)
_SYNC_MESSAGE = "called a synchronizing"  # c10::cuda::warn_or_error_on_sync


def _site(frame: traceback.FrameSummary) -> str:
    path = frame.filename
    if path.startswith(_TORCH_DIR):
        path = "torch/" + os.path.relpath(path, _TORCH_DIR)
    elif os.path.isabs(path):
        path = os.path.relpath(path)
    return f"{path}:{frame.lineno} {frame.name}"


def count_syncs(runner: GraphBucketRunner, batches: list[DecodeBatch], cuda: bool
                ) -> tuple[int, list[dict], int]:
    """Steps under sync debug mode "warn"; every synchronizing call warns once per call.

    Returns (syncs, sites, staging waits): each caught sync warning with its message, the
    Python file:line that triggered it, its stack (innermost last) and the step it came
    from, so a GPU run says where a sync comes from without a second run.
    """
    sites: list[dict] = []
    step = {"index": -1, "batch": None, "gc": False}

    def on_gc(phase: str, info: dict) -> None:  # a finalizer run by the collector can sync
        step["gc"] = True

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        text = str(message)
        if _SYNC_MESSAGE not in text:  # e.g. the mode's own "prototype feature" notice
            return
        stack = traceback.extract_stack()[:-1]  # drop this hook
        stack = [f for f in stack if not f.filename.endswith(("warnings.py",))]
        batch = step["batch"]
        sites.append({"message": text, "category": category.__name__,
                      "site": f"{filename}:{lineno}", "step": step["index"],
                      "batch_size": None if batch is None else len(batch.seq_lens_cpu),
                      "max_len": None if batch is None else int(max(batch.seq_lens_cpu)),
                      "gc_ran_this_step": step["gc"],
                      "stack": [_site(f) for f in stack[-14:]]})

    waits_before = runner.stats().staging_waits
    gc.callbacks.append(on_gc)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for i, batch in enumerate(batches):
                step["index"], step["batch"], step["gc"] = i, batch, False
                runner.step(batch)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
            gc.callbacks.remove(on_gc)
    return len(sites), sites, runner.stats().staging_waits - waits_before


def _batch_class(bs: int) -> str:
    return next(label for label, lo, hi in BATCH_CLASSES if lo <= bs <= hi)


def _summary(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": round(statistics.median(values), 2),
            "p90": round(float(np.percentile(values, 90)), 2)}


def _timed_steps(runner: GraphBucketRunner, batches: list[DecodeBatch], cuda: bool
                 ) -> list[float]:
    """Host microseconds of ``runner.step`` per batch, the GPU idle at each start."""
    times = []
    for batch in batches:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.step(batch)
        times.append((time.perf_counter() - t0) * 1e6)
    if cuda:
        torch.cuda.synchronize()
    return times


def host_times(runner: GraphBucketRunner, batches: list[DecodeBatch], cuda: bool) -> dict:
    """Host microseconds per step with the GPU idle at each start: overall, by phase, by
    batch-size class and by bucket of the same random steps."""
    graphs, ladder, buffers = runner.graphs, runner.ladder, runner.buffers
    validate, selector = BatchValidator(buffers.spec), runner.selector
    total = _timed_steps(runner, batches, cuda)
    check, stage, replay = [], [], []
    by_class: dict[str, list[float]] = {label: [] for label, _, _ in BATCH_CLASSES}
    by_bucket: dict[str, list[float]] = {str(b.max_len): [] for b in ladder}
    for batch, t in zip(batches, total, strict=True):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        host = validate(batch)
        key = selector.key_for(host.batch_size, host.min_len, host.max_len, host.lengths)
        t1 = time.perf_counter()
        slot = buffers.stage(host, key.batch_size, in_graph=graphs.copy_in_graph)
        t2 = time.perf_counter()
        graphs.replay(key, slot if graphs.copy_in_graph else None)
        t3 = time.perf_counter()
        check.append((t1 - t0) * 1e6)
        stage.append((t2 - t1) * 1e6)
        replay.append((t3 - t2) * 1e6)
        by_class[_batch_class(host.batch_size)].append(t)
        by_bucket[str(ladder[key.bucket].max_len)].append(t)
    if cuda:
        torch.cuda.synchronize()
    med = statistics.median
    return {"step_host_us_median": round(med(total), 2),
            "step_host_us_p90": round(float(np.percentile(total, 90)), 2),
            "step_host_us_breakdown_median": {"validate_select": round(med(check), 2),
                                              "stage": round(med(stage), 2),
                                              "replay_launch": round(med(replay), 2)},
            "step_host_us_by_batch_class": {k: _summary(v) for k, v in by_class.items()},
            "step_host_us_by_bucket": {k: _summary(v) for k, v in by_bucket.items()}}


def host_grid(cfg: Config, runner: GraphBucketRunner, ladder: BucketLadder, cuda: bool
              ) -> dict:
    """Median host step us for fixed batch sizes x buckets (GRID_STEPS random steps each),
    plus the two headline medians: batch 1 over every bucket, batch 64 in the top bucket."""
    steps = GRID_STEPS if cuda else 2  # the CPU smoke run only checks that this runs
    grid, batch1 = {}, []
    for bs in GRID_BATCH_SIZES:
        if bs > max(cfg.batch_sizes):
            continue
        row = {}
        for bucket, b in enumerate(ladder):
            batches = random_batches(cfg, ladder, steps, batch_size=bs, bucket=bucket,
                                     seed=SEED + 1 + bucket)
            _timed_steps(runner, batches[:2], cuda)  # first touches of this key
            times = _timed_steps(runner, batches, cuda)
            row[str(b.max_len)] = _summary(times)["median"]
            if bs == 1:
                batch1 += times
        grid[str(bs)] = row
    top = str(ladder.max_model_len)
    return {"step_host_us_grid_median": grid,
            "grid_host_us_median_batch1": _summary(batch1).get("median"),
            "grid_host_us_median_batch64_top": grid.get("64", {}).get(top)}


class Trajectory:
    """``bs`` requests decoding from lengths in [lo, hi): each step one token longer, a new
    random page when a request needs one. Keeps the full-path host table and the runners'
    ``BlockTable``s alike (the latter through their verbs, in ``advance_table``)."""

    def __init__(self, cfg: Config, table: BlockTable | list[BlockTable], bs: int, lo: int,
                 hi: int, rng: np.random.Generator) -> None:
        tables = table if isinstance(table, list) else [table]
        self.cfg, self.table, self.tables, self.rng = cfg, tables[0], tables, rng
        self.lens = rng.integers(lo, hi, size=bs)
        self.full = np.zeros((bs, cfg.max_model_len // cfg.page), np.int32)
        for b in range(bs):
            n = -(-int(self.lens[b]) // cfg.page)
            pages = rng.integers(0, cfg.num_pages, size=n, dtype=np.int32)
            self.full[b, :n] = pages
            for t in tables:
                t.assign(b, pages)
        self.tokens = torch.from_numpy(rng.integers(0, 1000, size=bs))
        self.grow, self.new_pages = np.zeros(0, np.int64), np.zeros(0, np.int32)

    def advance(self) -> list[int]:
        """The next step's lengths; the full table gets its new pages here (the scheduler's
        own bookkeeping, outside either path's timing)."""
        page = self.cfg.page
        self.grow = np.flatnonzero(self.lens % page == 0)
        self.new_pages = self.rng.integers(0, self.cfg.num_pages, size=self.grow.size,
                                           dtype=np.int32)
        self.full[self.grow, self.lens[self.grow] // page] = self.new_pages
        self.lens += 1
        return self.lens.tolist()

    def advance_table(self, table: BlockTable | None = None) -> None:
        """The same new pages through a BlockTable's verbs (timed with its step; default
        the first table)."""
        table = self.table if table is None else table
        if self.grow.size == 1:
            table.append(int(self.grow[0]), self.new_pages)
        elif self.grow.size:
            table.append_rows(self.grow, self.new_pages)

    def full_batch(self, lens: list[int]) -> DecodeBatch:
        cols = -(-max(lens) // self.cfg.page)
        return DecodeBatch(lens, self.full[:, :cols], {"token_ids": self.tokens})

    def table_batch(self, lens: list[int], table: BlockTable | None = None) -> DecodeBatch:
        return DecodeBatch(lens, self.table if table is None else table,
                           {"token_ids": self.tokens})


def _pinned_core() -> int:
    return max(os.sched_getaffinity(0))


AB_PATHS = ("full", "table", "table_memcpy", "table_copy")


def _ab_cell(cfg: Config, full: GraphBucketRunner, runners: dict[str, GraphBucketRunner],
             bs: int, lo: int, hi: int, steps: int, cuda: bool, seed: int) -> dict:
    """Host us per step of four paths, interleaved (the order rotates every step): the
    full table; the BlockTable with each graph copying its staging slot by the copy kernel
    (``table``) or by a memcpy node (``table_memcpy``); the BlockTable with the stage
    enqueueing the copy (``table_copy``, ``copy_in_graph=False``); and the outputs' worst
    relative difference against the full table."""
    for runner in runners.values():
        for row in range(runner.block_table.num_rows):
            runner.block_table.release(row)
    traj = Trajectory(cfg, [r.block_table for r in runners.values()], bs, lo, hi,
                      np.random.default_rng(seed))
    times: dict[str, list[float]] = {path: [] for path in AB_PATHS}
    worst = 0.0

    def timed(path: str, lens: list[int]) -> torch.Tensor:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if path == "full":
            out = full.step(traj.full_batch(lens))
        else:
            table = runners[path].block_table
            traj.advance_table(table)
            out = runners[path].step(traj.table_batch(lens, table))
        times[path].append((time.perf_counter() - t0) * 1e6)
        return out

    for step in range(steps):
        lens = traj.advance()
        k = step % len(AB_PATHS)
        order = AB_PATHS[k:] + AB_PATHS[:k]
        outs = {path: timed(path, lens) for path in order}
        if step % 25 == 0:
            a = outs["full"].float()
            for path in runners:
                b = outs[path].float()
                worst = max(worst, ((a - b).norm() / a.norm().clamp_min(1e-30)).item())
    skip = min(5, steps // 2)  # first touches of the cell's keys
    times = {path: t[skip:] for path, t in times.items()}
    return {"batch_size": bs, "lengths": [lo, hi], "steps": steps,
            "full_table": _summary(times["full"]), "block_table": _summary(times["table"]),
            "block_table_memcpy_node": _summary(times["table_memcpy"]),
            "block_table_stage_copies": _summary(times["table_copy"]),
            "max_rel_diff": worst, "_times": times}


def host_ab(cfg: Config, model: MLADecoder, full: GraphBucketRunner, ladder: BucketLadder,
            cuda: bool) -> dict:
    """Full-table path against the BlockTable paths (graphs copying their staging slot by
    the copy kernel or by a memcpy node, and the stage copying), interleaved, pinned to one
    core: batch 1 in every bucket, and the largest capture size in the top bucket (64 x 128K
    on CUDA)."""
    runners = {"table": make_runner(cfg, model, ladder),
               "table_memcpy": make_runner(cfg, model, ladder, copy_kernel=False),
               "table_copy": make_runner(cfg, model, ladder, copy_in_graph=False)}
    for runner in runners.values():
        runner.capture()
    inc = runners["table"]
    steps = AB_STEPS if cuda else 3
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    core = _pinned_core()
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)  # intra-op threads spinning on one core would time themselves
    try:
        batch1 = []
        for i, (lo, hi) in enumerate(ladder.ranges):
            n = min(steps, max(8, (hi - lo) // 2))  # the request stays in its bucket
            batch1.append(_ab_cell(cfg, full, runners, 1, lo, hi - n, n, cuda,
                                   SEED + 10 + i))
        big = max(cfg.batch_sizes)
        lo, hi = ladder.ranges[-1]
        top = _ab_cell(cfg, full, runners, big, lo, hi - steps, steps, cuda, SEED + 20)
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    syncs = _table_syncs(cfg, inc, big, lo, hi, SYNC_STEPS if cuda else 3, cuda)
    for runner in runners.values():
        runner.close()

    def pooled(cells: list[dict], path: str) -> float:
        # Every bucket's steps together, as the random grid's batch-1 median pools them.
        return round(statistics.median([t for c in cells for t in c["_times"][path]]), 2)

    headline = cuda and big == 64 and cfg.max_model_len == 131072
    medians = {"batch1": (pooled(batch1, "table"), pooled(batch1, "full"),
                          pooled(batch1, "table_copy"), pooled(batch1, "table_memcpy"))}
    for cell in (*batch1, top):
        del cell["_times"]
    return {
        "host_ab": {"pinned_core": core, "batch1_by_bucket": batch1, "top": top},
        "host_us_median_batch1": medians["batch1"][0],
        "host_us_median_batch1_full_table": medians["batch1"][1],
        "host_us_median_batch1_stage_copies": medians["batch1"][2],
        "host_us_median_batch1_memcpy_node": medians["batch1"][3],
        # The names; None on configurations without batch 64 or a 128K top.
        "host_us_median_batch64_128k": top["block_table"]["median"] if headline else None,
        "host_us_median_batch64_128k_full_table": top["full_table"]["median"]
        if headline else None,
        "host_us_median_batch64_128k_stage_copies":
        top["block_table_stage_copies"]["median"] if headline else None,
        "host_us_median_batch64_128k_memcpy_node":
        top["block_table_memcpy_node"]["median"] if headline else None,
        "block_table_syncs": syncs, "block_table_sync_steps": SYNC_STEPS if cuda else 3,
        "block_table_max_rel_diff": max(c["max_rel_diff"] for c in [*batch1, top]),
    }


def _table_syncs(cfg: Config, runner: GraphBucketRunner, bs: int, lo: int, hi: int,
                 steps: int, cuda: bool) -> int:
    """Synchronizing calls (sync debug mode "warn") over ``steps`` BlockTable steps."""
    for row in range(runner.block_table.num_rows):
        runner.block_table.release(row)
    traj = Trajectory(cfg, runner.block_table, bs, lo, hi - steps, np.random.default_rng(SEED))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                lens = traj.advance()
                traj.advance_table()
                runner.step(traj.table_batch(lens))
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    return sum(_SYNC_MESSAGE in str(w.message) for w in caught)


def max_error_vs_eager(cfg: Config, model: MLADecoder, runner: GraphBucketRunner,
                       batches: list[DecodeBatch]) -> float:
    eager = GraphBucketRunner.for_policy(
        "eager", model, spec=runner.spec, batch_sizes=runner.batch_sizes,
        max_model_len=cfg.max_model_len, sm_scale=(cfg.rank + cfg.rope) ** -0.5,
        backend=runner.backend)
    worst = 0.0
    for batch in batches:
        got = runner.step(batch).float().clone()
        want = eager.step(batch).float()
        worst = max(worst, ((got - want).norm() / want.norm()).item())
    eager.close()
    return worst


def run(cfg: Config, steps: int) -> dict:
    cuda = cfg.device == "cuda"
    model = MLADecoder(cfg)
    ladder = default_ladder(cfg.max_model_len) if cuda else BucketLadder.from_dict(
        {"max_model_len": cfg.max_model_len,
         "buckets": [{"max_len": 32, "hint": 32}, {"max_len": cfg.max_model_len,
                                                   "hint": cfg.max_model_len}]})
    single = BucketLadder.from_dict({"max_model_len": cfg.max_model_len, "buckets": [
        {"max_len": cfg.max_model_len, "hint": cfg.max_model_len}]})
    runner = make_runner(cfg, model, single)
    single_rec = capture_record(runner)
    runner.close()
    runner = make_runner(cfg, model, ladder)
    ladder_rec = capture_record(runner)
    batches = random_batches(cfg, ladder, steps)
    for batch in batches[:10]:  # first touches (pinned pages, caches) outside the timing
        runner.step(batch)
    syncs, sync_sites, sync_waits = count_syncs(runner, batches, cuda)
    result = {
        "buckets": [b.to_dict() for b in ladder],
        "batch_sizes": list(cfg.batch_sizes),
        **{k: ladder_rec[k] for k in ("graphs_captured", "graphs_aliased", "capture_s",
                                      "pool_bytes")},
        "pool_bytes_single_bucket": single_rec["pool_bytes"],
        "graphs_captured_single_bucket": single_rec["graphs_captured"],
        "slot_copy": runner.buffers.slot_copy_kind,
        "syncs_on_replay": syncs,
        "replay_steps": len(batches),
        "staging_waits_while_counting_syncs": sync_waits,
        **host_times(runner, batches, cuda),
        **host_grid(cfg, runner, ladder, cuda),
        **host_ab(cfg, model, runner, ladder, cuda),
        "staging_waits": runner.stats().staging_waits,
        "max_rel_l2_vs_eager": max_error_vs_eager(cfg, model, runner, batches[:20]),
        "sync_sites": sync_sites,
        "graphs": ladder_rec["graphs"],
        "config": {k: str(v) if isinstance(v, torch.dtype) else v
                   for k, v in cfg.__dict__.items()},
    }
    runner.close()
    ratio = result["pool_bytes"] / max(1, result["pool_bytes_single_bucket"])
    result["targets"] = {
        "zero_syncs": result["syncs_on_replay"] == TARGETS["syncs_on_replay"],
        "pool_ratio": round(ratio, 3),
        "pool_ratio_ok": ratio <= TARGETS["pool_ratio_max"],
        "step_host_us_ok": result["step_host_us_median"] <= TARGETS["step_host_us_median_max"],
        "host_us_batch1_ok": result["host_us_median_batch1"] <= TARGETS["host_us_batch1_max"],
        "host_us_batch64_128k_ok": None if result["host_us_median_batch64_128k"] is None
        else result["host_us_median_batch64_128k"] <= TARGETS["host_us_batch64_128k_max"],
        "zero_block_table_syncs": result["block_table_syncs"] == 0,
        "step_host_us_ok_by_batch_class": {
            k: v.get("median", 0.0) <= TARGETS["step_host_us_median_max"]
            for k, v in result["step_host_us_by_batch_class"].items()},
    }
    return result


def markdown(result: dict) -> str:
    t = result["targets"]
    rows = [
        ("buckets (max_len:hint)", " ".join(f"{b['max_len']}:{b['hint']}"
                                            for b in result["buckets"])),
        ("capture batch sizes", " ".join(map(str, result["batch_sizes"]))),
        ("graphs captured / aliased", f"{result['graphs_captured']} / {result['graphs_aliased']}"),
        ("capture seconds", f"{result['capture_s']:.2f}"),
        ("pool MiB (ladder / one bucket)", f"{result['pool_bytes'] / 2**20:.1f} / "
         f"{result['pool_bytes_single_bucket'] / 2**20:.1f} (x{t['pool_ratio']}, target <= 1.2)"),
        ("a slot's graph starts with", result["slot_copy"]),
        ("syncs on replay", f"{result['syncs_on_replay']} in {result['replay_steps']} steps "
         "(target 0)"),
        ("host step us median / p90 (random batches)", f"{result['step_host_us_median']} / "
         f"{result['step_host_us_p90']}"),
        ("host step us median, batch 1 (every bucket), BlockTable (copy kernel) / memcpy "
         "node / stage copying / full table, interleaved, "
         f"core {result['host_ab']['pinned_core']}",
         f"{result['host_us_median_batch1']} / {result['host_us_median_batch1_memcpy_node']}"
         f" / {result['host_us_median_batch1_stage_copies']}"
         f" / {result['host_us_median_batch1_full_table']} (target <= 20)"),
        ("host step us median, batch 64 at 128K, copy kernel / memcpy node / stage copying / "
         "full table, interleaved",
         f"{result['host_us_median_batch64_128k']} / "
         f"{result['host_us_median_batch64_128k_memcpy_node']} / "
         f"{result['host_us_median_batch64_128k_stage_copies']} / "
         f"{result['host_us_median_batch64_128k_full_table']} (target <= 40)"),
        ("host step us median, batch 1 by bucket, copy kernel / memcpy node / stage copying / "
         "full table",
         ", ".join(f"{c['lengths'][1]}: {c['block_table']['median']} / "
                   f"{c['block_table_memcpy_node']['median']} / "
                   f"{c['block_table_stage_copies']['median']} / {c['full_table']['median']}"
                   for c in result["host_ab"]["batch1_by_bucket"])),
        ("syncs in BlockTable steps", f"{result['block_table_syncs']} in "
         f"{result['block_table_sync_steps']} (target 0); outputs against the full table: "
         f"max rel diff {result['block_table_max_rel_diff']:.1e}"),
        ("host step us median, random grid, batch 1 / batch 64 top bucket (full table)",
         f"{result['grid_host_us_median_batch1']} / "
         f"{result['grid_host_us_median_batch64_top']}"),
        ("host step breakdown us", ", ".join(f"{k} {v}" for k, v in
                                           result["step_host_us_breakdown_median"].items())),
        ("host step us median by batch size", ", ".join(
            f"{k}: {v.get('median', '-')} (n={v['n']})"
            for k, v in result["step_host_us_by_batch_class"].items())),
        ("host step us median by bucket (max_len)", ", ".join(
            f"{k}: {v.get('median', '-')} (n={v['n']})"
            for k, v in result["step_host_us_by_bucket"].items())),
        *((f"host step us median, batch {bs}, by bucket", ", ".join(
            f"{k}: {v}" for k, v in row.items()))
          for bs, row in result["step_host_us_grid_median"].items()),
        ("sync sites", "; ".join(sorted({f"{s['site']} ({s['message'][:60]})"
                                         for s in result["sync_sites"]})) or "none"),
        ("max rel L2 vs eager", f"{result['max_rel_l2_vs_eager']:.2e}"),
    ]
    meta = result["meta"]
    head = (f"# Capture and dispatch ({meta['gpu']}, torch {meta['torch']}, triton "
            f"{meta['triton']}, {meta['date']})\n\n`{meta['command']}`\n\n")
    return head + "| metric | value |\n| --- | --- |\n" + "".join(
        f"| {k} | {v} |\n" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    from bench.gpu_timing import add_out_argument, out_dir, run_meta

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(parser, "h200-capture.{json,md} (cpu-smoke-capture.* with --cpu-smoke)",
                     smoke=True)
    parser.add_argument("--steps", type=int, default=1000, help="random decode steps")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny CPU run, no CUDA needed")
    args = parser.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("capture_dispatch needs CUDA (run with --cpu-smoke for a tiny CPU check)")
        return 0
    cfg = SMOKE if args.cpu_smoke else Config()
    steps = min(args.steps, 6) if args.cpu_smoke else args.steps
    name = "cpu-smoke-capture" if args.cpu_smoke else "h200-capture"
    result = run(cfg, steps)
    result["meta"] = run_meta()
    print(markdown(result))
    out = out_dir(args.out, smoke=args.cpu_smoke)
    if out:
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(result, f, indent=2)
        with open(os.path.join(out, f"{name}.md"), "w") as f:
            f.write(markdown(result))
        print(f"wrote {os.path.join(out, name)}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
