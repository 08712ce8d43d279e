"""Capture and dispatch costs of bucketed FULL graphs (H200): graphs, pool memory, host step.

Captures a small MLA-shaped decoder (token embedding, then per layer: q projection, paged
MLA decode through the Triton backend, output projection; heads 16, rank 512, rope 64,
bf16, page 64) for capture sizes 1..64, once with the default ladder and once with a
single bucket (hint = max_model_len), and measures:

- graphs captured / aliased, capture seconds, pool bytes of both captures;
- syncs on the replay path: steps under ``torch.cuda.set_sync_debug_mode("warn")``;
- host time of one step (validate + select + stage + replay launch) with the GPU idle,
  as a median over random batch sizes and lengths, and its breakdown.

    python3 bench/capture_dispatch.py --out bench/results      # CUDA: h200-capture.{json,md}
    python3 bench/capture_dispatch.py --cpu-smoke              # tiny CPU run of the same code
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphbucket.backends import get_backend  # noqa: E402
from graphbucket.batch import DecodeBatch, validate_batch  # noqa: E402
from graphbucket.buffers import BufferSpec, InputSpec  # noqa: E402
from graphbucket.context import DecodeContext  # noqa: E402
from graphbucket.ladder import BucketLadder, default_ladder  # noqa: E402
from graphbucket.runner import GraphBucketRunner  # noqa: E402

SEED = 0
TARGETS = {"syncs_on_replay": 0, "pool_ratio_max": 1.2, "step_host_us_median_max": 20.0}


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


def make_runner(cfg: Config, model: MLADecoder, ladder: BucketLadder) -> GraphBucketRunner:
    spec = BufferSpec(max_pages_per_seq=cfg.max_model_len // cfg.page, num_pages=cfg.num_pages,
                      page_size=cfg.page, num_heads=cfg.heads, output_shape=(cfg.hidden,),
                      output_dtype=cfg.dtype, inputs=(InputSpec("token_ids", (), torch.int64),),
                      device=cfg.device)
    backend = get_backend("triton", kv_lora_rank=cfg.rank, qk_rope_dim=cfg.rope,
                          num_sms=cfg.num_sms, device=cfg.device)
    return GraphBucketRunner(model, spec=spec, batch_sizes=list(cfg.batch_sizes), ladder=ladder,
                             sm_scale=(cfg.rank + cfg.rope) ** -0.5, backend=backend)


def random_batches(cfg: Config, ladder: BucketLadder, n: int) -> list[DecodeBatch]:
    """Random batch size in 1..max, a random bucket, lengths uniform inside that bucket."""
    rng = np.random.default_rng(SEED)
    batches = []
    for _ in range(n):
        bs = int(rng.integers(1, max(cfg.batch_sizes) + 1))
        lo, hi = ladder.ranges[int(rng.integers(len(ladder)))]
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


def count_syncs(runner: GraphBucketRunner, batches: list[DecodeBatch], cuda: bool) -> int:
    """Steps under sync debug mode "warn"; every synchronizing call warns once per call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for batch in batches:
                runner.step(batch)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def host_times(runner: GraphBucketRunner, batches: list[DecodeBatch], cuda: bool) -> dict:
    """Host microseconds per step with the GPU idle at each start, total and by phase."""
    graphs, ladder, buffers = runner.graphs, runner.ladder, runner.buffers
    sizes = sorted(runner.batch_sizes)
    total, check, stage, replay = [], [], [], []
    for batch in batches:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.step(batch)
        t1 = time.perf_counter()
        total.append((t1 - t0) * 1e6)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        host = validate_batch(batch, buffers.spec)
        bucket = ladder.bucket_for(host.max_len)
        padded = next(s for s in sizes if s >= host.batch_size)
        t1 = time.perf_counter()
        buffers.stage(host, padded)
        t2 = time.perf_counter()
        graphs.graph(padded, bucket).replay()
        t3 = time.perf_counter()
        check.append((t1 - t0) * 1e6)
        stage.append((t2 - t1) * 1e6)
        replay.append((t3 - t2) * 1e6)
    med = statistics.median
    return {"step_host_us_median": round(med(total), 2),
            "step_host_us_p90": round(float(np.percentile(total, 90)), 2),
            "step_host_us_breakdown_median": {"validate_select": round(med(check), 2),
                                              "stage": round(med(stage), 2),
                                              "replay_launch": round(med(replay), 2)}}


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
    result = {
        "buckets": [{"max_len": b.max_len, "hint": b.hint} for b in ladder],
        "batch_sizes": list(cfg.batch_sizes),
        **{k: ladder_rec[k] for k in ("graphs_captured", "graphs_aliased", "capture_s",
                                      "pool_bytes")},
        "pool_bytes_single_bucket": single_rec["pool_bytes"],
        "graphs_captured_single_bucket": single_rec["graphs_captured"],
        "syncs_on_replay": count_syncs(runner, batches, cuda),
        "replay_steps": len(batches),
        **host_times(runner, batches, cuda),
        "staging_waits": runner.stats().staging_waits,
        "max_rel_l2_vs_eager": max_error_vs_eager(cfg, model, runner, batches[:20]),
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
        ("syncs on replay", f"{result['syncs_on_replay']} in {result['replay_steps']} steps "
         "(target 0)"),
        ("host step us median / p90", f"{result['step_host_us_median']} / "
         f"{result['step_host_us_p90']} (target <= 20)"),
        ("host step breakdown us", ", ".join(f"{k} {v}" for k, v in
                                           result["step_host_us_breakdown_median"].items())),
        ("max rel L2 vs eager", f"{result['max_rel_l2_vs_eager']:.2e}"),
    ]
    meta = result["meta"]
    head = (f"# Capture and dispatch ({meta['gpu']}, torch {meta['torch']}, triton "
            f"{meta['triton']}, {meta['date']})\n\n`{meta['command']}`\n\n")
    return head + "| metric | value |\n| --- | --- |\n" + "".join(
        f"| {k} | {v} |\n" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output folder (default bench/results)")
    parser.add_argument("--steps", type=int, default=1000, help="random decode steps")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny CPU run, no CUDA needed")
    args = parser.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("capture_dispatch needs CUDA (run with --cpu-smoke for a tiny CPU check)")
        return 0
    cfg = SMOKE if args.cpu_smoke else Config()
    steps = min(args.steps, 6) if args.cpu_smoke else args.steps
    out = args.out or (os.path.join(tempfile.gettempdir(), "graphbucket-smoke")
                       if args.cpu_smoke else "bench/results")
    name = "cpu-smoke-capture" if args.cpu_smoke else "h200-capture"
    result = run(cfg, steps)
    # Imported late: it imports triton, which must come after graphbucket.kernels has
    # switched a CUDA-less machine to the Triton interpreter.
    from bench.gpu_timing import run_meta

    result["meta"] = run_meta()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
