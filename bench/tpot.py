"""TPOT per policy over context length: one full decode step of the MLA decoder, timed.

Policies (``graphbucket.policies``): ``eager`` (no graphs, planned from the live lengths
each step), ``fixed-1`` / ``fixed-max`` (one graph per batch size, hinted at 1 /
max_model_len), ``balanced-only`` (one balanced graph per batch size), ``ladder`` (one
graph per batch size and bucket of the ladder shipped for this GPU) and, here only,
``default-ladder`` (the field's five buckets, to compare the shipped ladder with). Every
policy runs the same model and kernels through ``GraphBucketRunner``, captured once.

TPOT = CUDA-event time of N back-to-back ``runner.step`` calls / N (host selection,
staging and replay included; for eager, the Python forward too), median of 7 runs, the
runs of every policy at one shape interleaved so that they share the clock's drift. The
model's weights (~172 MB per layer) are several times the 60 MB L2, so each step reads
them, and the context's KV, cold. ``floor_ms`` = bytes one step must read (weights, the
context's KV rows, activations) / the device-to-device copy bandwidth of the same run.

Cache formats (``--kv-cache``, ``graphbucket.fp8``): bf16, fp8-tensor (e4m3, one scale) and
fp8-v32 (DeepSeek-V3.2's 656-byte rows); several in one run build one model per format
in turn, and every row names its format (``kv_cache``) and the KV bytes its step reads
(``kv_mb``), from which ``scripts/tpot_report.py`` breaks the fp8 rows down against bf16.

Verify steps (``--q-len 1 2 4``: MTP / speculative decoding, q_len tokens per request;
the runners capture every q_len): each row then has ``q_len``, ``step_ms`` (the step) and
``tpot_ms`` = step_ms / q_len (time per token, every draft accepted); at q_len 1 both are
the step time. Contexts below q_len are skipped.

The output is h200-tpot{-preset}{-formats}{-mtp}.json (``output_name``): ``-formats`` is
absent for bf16 alone, the format's name for one fp8 format and ``-fp8`` for several;
``-mtp`` follows when any q_len other than 1 runs. Both options together combine the
suffixes (``--kv-cache bf16 fp8-tensor --q-len 1 2`` writes h200-tpot-fp8-mtp.json).

Without ``--out`` the rows are printed and nothing is written. The KV cache holds the
largest batch at the longest context in every layer (128 x 128K x 4 layers of bf16: 77 GB);
where that does not fit the free memory (less RESERVE_BYTES), the contexts are capped and
a note says which were skipped.

    python3 bench/tpot.py --layers 4 --out bench/results      # writes h200-tpot.json
    python3 bench/tpot.py --kv-cache bf16 fp8-tensor fp8-v32 --policies fixed-1 ladder \
        --out DIR                                             # writes h200-tpot-fp8.json
    python3 bench/tpot.py --layers 4 --q-len 1 2 4 --out DIR  # writes h200-tpot-mtp.json
    python3 bench/tpot.py --model bench.hf_tpot:deepseek_v3 --batches 1 8 --policies \
        fixed-1 fixed-max ladder --out DIR   # a user's model: h200-tpot-transformers.json
    python3 bench/tpot.py --layers 2 --batches 1 8 32 64 128 --contexts 256 4096 32768 \
        131072 --policies fixed-1 fixed-max balanced-only ladder --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.tpot_model import build_model, check_model  # noqa: E402
from graphbucket import fp8  # noqa: E402
from graphbucket.backends import get_backend  # noqa: E402
from graphbucket.batch import DecodeBatch  # noqa: E402
from graphbucket.ladder import BucketLadder, default_ladder  # noqa: E402
from graphbucket.models import (  # noqa: E402
    PRESETS,
    MLAConfig,
    MLADecoder,
    decode_batch,
    prefill_random,
    random_block_table,
)
from graphbucket.models.mla import PROJECTIONS  # noqa: E402
from graphbucket.plan import LaunchPlan  # noqa: E402
from graphbucket.policies import POLICIES  # noqa: E402
from graphbucket.runner import GraphBucketRunner  # noqa: E402

CONTEXTS = [1, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 100_000, 131072]
BATCHES = [1, 8]
MAX_MODEL_LEN = 131072
PAGE_SIZE = 64
LAYERS_ENV = "GRAPHBUCKET_TPOT_LAYERS"
DEFAULT_LAYERS = 4
BENCH_POLICIES = (*POLICIES, "default-ladder")
FP8_TENSOR_AMAX = 8.0
# Device memory kept free beside the KV cache: weights (0.2-0.4 GB a layer), workspaces,
# the graphs' pool, activations and the allocator's slack.
RESERVE_BYTES = 16 << 30


def cache_bytes(config: MLAConfig, max_batch: int, context: int, kv_cache: str) -> int:
    """The KV cache one model allocates: ``max_batch`` requests of ``context`` tokens
    (whole pages) in every layer."""
    pages = -(-context // PAGE_SIZE)
    return (max_batch * pages * PAGE_SIZE * config.num_layers
            * fp8.row_bytes(kv_cache, config.kv_dim, torch.bfloat16))


def fitting_context(config: MLAConfig, max_batch: int, max_model_len: int, kv_cache: str,
                    free_bytes: int) -> int:
    """The longest context (whole pages, at most ``max_model_len``) that every request of
    the largest batch can hold in ``free_bytes`` less RESERVE_BYTES (0: not one page)."""
    page_bytes = cache_bytes(config, max_batch, PAGE_SIZE, kv_cache)
    pages = max(0, free_bytes - RESERVE_BYTES) // page_bytes
    return min(max_model_len, pages * PAGE_SIZE)


def default_layers() -> int:
    return int(os.environ.get(LAYERS_ENV, DEFAULT_LAYERS))


@dataclass(eq=False)
class TpotBench:
    """One model, one scattered block table and one captured runner per policy."""

    model: MLADecoder
    runners: dict[str, GraphBucketRunner]
    block_table: np.ndarray           # int32 [max batch, max pages per request]
    hidden: dict[int, torch.Tensor]   # tokens (B x q_len) -> seeded inputs on the device
    max_model_len: int
    user: Any = None                  # a user's TpotModel (bench/tpot_model.py), or None

    @classmethod
    def for_user(cls, model, *, max_model_len: int = MAX_MODEL_LEN,
                 batches: list[int] = BATCHES, policies: tuple[str, ...] = POLICIES,
                 q_lens: tuple[int, ...] = (1,), seed: int = 0) -> TpotBench:
        """The bench over a user's ``TpotModel``: its cache filled by ``fill_cache`` over
        one scattered table, one runner per policy on its own ``decode_backend``."""
        check_model(model)
        pages = model.num_pages // max(batches)
        if pages * model.page_size < max_model_len:
            raise ValueError(f"{model.num_pages} pages of {model.page_size} hold "
                             f"{pages * model.page_size} tokens per request at batch "
                             f"{max(batches)}, below max_model_len={max_model_len}")
        table = random_block_table(max(batches), pages, model.num_pages,
                                   np.random.default_rng(seed))
        model.fill_cache(table, [pages * model.page_size] * max(batches), seed=seed)
        runners = captured_runners(model, policies, max_model_len=max_model_len,
                                   batches=batches, q_lens=q_lens)
        return cls(model, runners, table, {}, max_model_len, user=model)

    @classmethod
    def build(cls, config: MLAConfig, *, max_model_len: int = MAX_MODEL_LEN,
              batches: list[int] = BATCHES, policies: tuple[str, ...] = POLICIES,
              page_size: int = PAGE_SIZE, dtype: torch.dtype = torch.bfloat16,
              device: str = "cuda", seed: int = 0, backend_kwargs: dict | None = None,
              ladder: BucketLadder | None = None, projections: str = "auto",
              kv_cache: str = "bf16", q_lens: tuple[int, ...] = (1,),
              max_context: int | None = None) -> TpotBench:
        # The cache holds max_context tokens per request (default max_model_len); the
        # graphs still cover max_model_len.
        pages = -(-(max_context or max_model_len) // page_size)
        # fp8-tensor: the prefill's N(0, 1) rows and the new rows fit amax 8 (graphbucket.fp8).
        scale = {"kv_scale": FP8_TENSOR_AMAX / fp8.FP8_MAX} if kv_cache == "fp8-tensor" else {}
        model = MLADecoder(config, num_pages=max(batches) * pages, page_size=page_size,
                           dtype=dtype, device=device, seed=seed, projections=projections,
                           kv_cache_format=fp8.check_format(kv_cache), **scale)
        rng = np.random.default_rng(seed)
        table = random_block_table(max(batches), pages, model.num_pages, rng)
        prefill_random(model, table, [pages * page_size] * max(batches), seed=seed)
        gen = torch.Generator(device=device).manual_seed(seed)
        hidden = {n: torch.randn(n, config.hidden_size, generator=gen, device=device).to(dtype)
                  for n in sorted({b * q for b in batches for q in q_lens})}
        runners = captured_runners(
            model, policies, max_model_len=max_model_len, batches=batches, q_lens=q_lens,
            ladder=ladder, backend=lambda: get_backend(
                "triton", device=device, kv_lora_rank=config.kv_lora_rank,
                qk_rope_dim=config.qk_rope_dim, **(backend_kwargs or {})))
        return cls(model, runners, table, hidden, max_model_len)

    def batch(self, context: int, batch: int, q_len: int = 1) -> DecodeBatch:
        """``batch`` requests at ``context`` tokens each (the q_len decoded tokens included)."""
        cols = -(-context // self.model.page_size)
        if self.user is not None:
            return self.user.step_batch([context] * batch, self.block_table[:batch, :cols],
                                        q_len)
        return decode_batch(self.model, [context] * batch, self.block_table[:batch, :cols],
                            self.hidden[batch * q_len], q_len=q_len)

    def plan(self, policy: str, context: int, batch: int, q_len: int = 1) -> LaunchPlan:
        """The plan the policy's step launches for this shape (host arithmetic only)."""
        runner = self.runners[policy]
        if runner.is_eager:
            return runner.backend.plan(batch, self.model.config.num_heads * q_len, context)
        return runner.plan_for(runner.selector.choose([context] * batch, q_len))

    def floor_bytes(self, context: int, batch: int, q_len: int = 1) -> int:
        """Weights + the context's KV rows (every layer) + activations one step must read.

        Activations per layer and query token: the hidden state in and out, the MLA query
        and the attention output; split-KV partials are not counted (an algorithm's choice).
        """
        if self.user is not None:  # the model says what a step reads beside the KV
            return self.user.step_bytes(batch * q_len) + self.kv_bytes(context, batch)
        cfg, elt = self.model.config, self.model.dtype.itemsize
        act = cfg.num_layers * (2 * cfg.hidden_size + cfg.num_heads * (cfg.kv_dim
                                                                       + cfg.kv_lora_rank))
        return (self.model.weight_bytes() + self.kv_bytes(context, batch)
                + batch * q_len * act * elt)

    def kv_bytes(self, context: int, batch: int) -> int:
        """The context's cache rows over every layer, in the cache's format (a verify step
        reads them once per request, whatever its q_len)."""
        return batch * context * self.model.kv_row_bytes()

    def close(self) -> None:
        for runner in self.runners.values():
            runner.close()
        self.runners.clear()


def captured_runners(model, policies, *, max_model_len: int, batches: list[int],
                     q_lens=(1,), ladder: BucketLadder | None = None,
                     backend: Callable[[], Any] | None = None) -> dict[str, GraphBucketRunner]:
    """One captured runner per policy over ``model``, each on its own backend
    (``backend()``, default the model's ``decode_backend``); ``default-ladder`` is the
    ladder policy on the field's default buckets, ``ladder`` replaces the ladder policy's."""
    runners = {}
    for policy in policies:
        which = "ladder" if policy == "default-ladder" else policy
        runners[policy] = GraphBucketRunner.for_model(
            model, policy=which, max_model_len=max_model_len, batch_sizes=batches,
            backend=backend() if backend else None, progress=False, q_lens=tuple(q_lens),
            ladder=default_ladder(max_model_len) if policy == "default-ladder"
            else ladder if policy == "ladder" else None)
        runners[policy].capture()
    return runners


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_tpot(step: Callable[[], object], *, reps: int = 5, min_ms: float = 30.0,
              max_steps: int = 200) -> float:
    """Median milliseconds per step over ``reps`` runs of n back-to-back steps (CUDA events)."""
    for _ in range(3):
        step()
    sync()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    stop.record()
    stop.synchronize()
    n = max(3, min(max_steps, int(min_ms / max(start.elapsed_time(stop), 1e-3))))
    samples = []
    for _ in range(reps):
        start.record()
        for _ in range(n):
            step()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) / n)
    return statistics.median(samples)


def time_tpot_rounds(steps: dict[str, Callable[[], object]], *, reps: int = 7,
                     min_ms: float = 30.0, max_steps: int = 200) -> dict[str, list[float]]:
    """``time_tpot`` for several runners of one shape, their runs interleaved (the order
    rotating every round), so that clock drift over the cell is shared by every policy and
    a ratio between two of them compares plans, not moments. ms per step of each runner,
    one sample per round (sample i of every runner comes from round i)."""
    from graphbucket.tuning.measure_step import interleaved_rounds

    return interleaved_rounds(steps, rounds=reps, sample_ms=min_ms, max_steps=max_steps)


def tpot_row(policy: str, context: int, batch: int, *, step_ms: float, floor_ms: float,
             splits: int, q_len: int = 1, kv_cache: str = "bf16",
             kv_mb: float | None = None, plan: str | None = None) -> dict:
    """One result row: ``tpot_ms`` is the time per token (step_ms / q_len); ``floor_ms``
    the step's floor (per token likewise); ``kv_cache`` the cache format and ``kv_mb`` the
    context's KV megabytes the step reads (per step, not per token); ``plan`` the decode
    plan the policy's graph replays (two policies replaying one plan differ by noise)."""
    row = {"policy": policy, "context": context, "batch": batch, "q_len": q_len,
           "tpot_ms": round(step_ms / q_len, 4), "step_ms": round(step_ms, 4),
           "floor_ms": round(floor_ms / q_len, 4), "splits": splits, "kv_cache": kv_cache}
    if kv_mb is not None:
        row["kv_mb"] = round(kv_mb, 4)
    if plan is not None:
        row["plan"] = plan
    return row


def output_name(preset: str, formats: list[str], q_lens: list[int]) -> str:
    """The result file: h200-tpot.json for bf16 at q_len 1 on the default preset;
    ``-{preset}`` for another preset, then ``-{format}`` for one fp8 format or ``-fp8``
    for several, then ``-mtp`` when a q_len other than 1 runs (both: h200-tpot-fp8-mtp.json).
    """
    formats, q_lens = list(dict.fromkeys(formats)), list(dict.fromkeys(q_lens))
    suffix = "" if preset == "deepseek-v3-tp8" else f"-{preset}"
    if formats != ["bf16"]:
        suffix += f"-{formats[0]}" if len(formats) == 1 else "-fp8"
    suffix += "" if q_lens == [1] else "-mtp"
    return f"h200-tpot{suffix}.json"


def measure_rows(bench: TpotBench, policies, context: int, batch: int,
                 copy_gbps: float, q_len: int = 1) -> list[dict]:
    """Every policy's row at one shape, timed interleaved (``time_tpot_rounds``)."""
    decode = bench.batch(context, batch, q_len)
    steps = {policy: (lambda r=bench.runners[policy]: r.step(decode)) for policy in policies}
    rounds = time_tpot_rounds(steps)
    rows = [measure_row(bench, policy, context, batch, copy_gbps, q_len,
                        step_ms=statistics.median(rounds[policy])) for policy in policies]
    for row in rows:  # each round's sample, so that a ratio can be taken round by round
        row["step_ms_rounds"] = [round(ms, 4) for ms in rounds[row["policy"]]]
    return rows


def measure_row(bench: TpotBench, policy: str, context: int, batch: int,
                copy_gbps: float, q_len: int = 1, *, step_ms: float | None = None) -> dict:
    """One policy's row; timed on its own unless ``step_ms`` is given."""
    runner, decode = bench.runners[policy], bench.batch(context, batch, q_len)
    plan = bench.plan(policy, context, batch, q_len)
    if step_ms is None:
        step_ms = time_tpot(lambda: runner.step(decode))
    floor_ms = bench.floor_bytes(context, batch, q_len) / (copy_gbps * 1e6)
    return tpot_row(policy, context, batch, step_ms=step_ms, floor_ms=floor_ms,
                    splits=plan.num_kv_splits, q_len=q_len,
                    kv_cache=bench.model.kv_cache_format,
                    kv_mb=bench.kv_bytes(context, batch) / 1e6, plan=plan.describe())


def run(bench: TpotBench, *, policies, contexts, batches, copy_gbps: float,
        q_lens=(1,)) -> list[dict]:
    shapes = [(q, b, c) for q in q_lens for b in batches for c in contexts if c >= q]
    rows, total = [], len(policies) * len(shapes)
    for q_len, batch, context in shapes:
        for r in measure_rows(bench, policies, context, batch, copy_gbps, q_len):
            rows.append(r)
            policy = r["policy"]
            print(f"[{len(rows)}/{total}] {r['kv_cache']} q_len={q_len} bs={batch} "
                  f"ctx={context} {policy:<9} {r['step_ms']:.3f} ms/step "
                  f"{r['tpot_ms']:.3f} ms/token (floor {r['floor_ms']:.3f}, splits "
                  f"{r['splits']})", flush=True)
    return rows


def ladder_source(ladder: BucketLadder) -> str:
    """Which ladder the ladder policy captured: tuned for which cache format, or default."""
    if "kv_cache_fallback" in ladder.meta:
        return f"tuned for bf16 (no {ladder.meta['kv_cache_fallback']} ladder ships)"
    if ladder.meta.get("source") == "graphbucket.tuning":
        return f"tuned for {ladder.meta.get('kv_cache', 'bf16')}"
    return "default"


def meta_for(bench: TpotBench, args, copy_gbps: float) -> dict:
    from bench.gpu_timing import run_meta

    cfg, ladder = bench.model.config, bench.runners.get("ladder")
    captures = {p: r.capture().describe() for p, r in bench.runners.items() if not r.is_eager}
    meta = {**run_meta(), "num_heads": cfg.num_heads, "layers": cfg.num_layers,
            "copy_gbps": round(copy_gbps, 1), "page_size": bench.model.page_size,
            "kv_cache": bench.model.kv_cache_format,
            "kv_row_bytes": bench.model.kv_row_bytes(), "max_model_len": bench.max_model_len,
            "ladder": ladder.ladder.to_dict()["buckets"] if ladder else None,
            "ladder_source": ladder_source(ladder.ladder) if ladder else None,
            "captures": captures,
            "q_lens": list(next(iter(bench.runners.values())).q_lens),
            "timing": "CUDA events over back-to-back runner.step calls, median of 7 runs, "
                      "the policies' runs interleaved per shape (step_ms_rounds: each "
                      "round's sample); tpot_ms = step_ms / q_len"}
    if bench.user is not None:  # the model says what it is
        return {**meta, **bench.user.describe(), "model_factory": args.model}
    return {**meta, "model": cfg.name, "dtype": "bfloat16",
            "weights_mb": round(bench.model.weight_bytes() / 1e6, 1),
            "projections": bench.model.projections}


def main() -> None:
    from bench.gpu_timing import add_out_argument, out_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=default_layers(),
                    help=f"decoder layers of the model (default: %(default)s, from "
                         f"${LAYERS_ENV} when set)")
    add_out_argument(ap, "the rows as h200-tpot[-preset][-formats][-mtp].json (what "
                         "scripts/tpot_report.py reads)")
    ap.add_argument("--preset", default="deepseek-v3-tp8", choices=sorted(PRESETS),
                    help="model shapes (graphbucket.models.PRESETS; default: %(default)s, "
                         "16 heads; deepseek-v3-dp: all 128 heads on one GPU)")
    ap.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS,
                    help="context lengths, the decoded token included (default: 1 .. 128K, "
                         f"{len(CONTEXTS)} points)")
    ap.add_argument("--batches", type=int, nargs="+", default=BATCHES,
                    help="batch sizes; each is a capture size (default: %(default)s)")
    ap.add_argument("--policies", nargs="+", default=list(BENCH_POLICIES),
                    choices=BENCH_POLICIES, metavar="POLICY",
                    help=f"graph policies to time, of {', '.join(BENCH_POLICIES)} "
                         "(default: all)")
    ap.add_argument("--kv-cache", nargs="+", default=["bf16"], choices=fp8.KV_CACHE_FORMATS,
                    help="latent cache formats, one model each (fp8-tensor: e4m3 with one "
                         "scale; fp8-v32: DeepSeek-V3.2's 656-byte rows)")
    ap.add_argument("--projections", default="auto", choices=PROJECTIONS,
                    help="skinny Triton products (auto on CUDA) or torch's GEMM/BMM")
    ap.add_argument("--q-len", type=int, nargs="+", default=[1], dest="q_lens",
                    help="query tokens per request (verify steps), e.g. 1 2 4; other than "
                         "1 alone writes h200-tpot-mtp.json (h200-tpot-fp8-mtp.json with "
                         "several cache formats)")
    ap.add_argument("--model", metavar="MODULE:FACTORY",
                    help="time a user's model instead of the preset: a factory returning a "
                         "TpotModel (bench/tpot_model.py), e.g. bench.hf_tpot:deepseek_v3 "
                         "(writes h200-tpot-transformers.json); bf16, q_len 1")
    args = ap.parse_args()
    if args.model and (args.kv_cache != ["bf16"] or args.q_lens != [1]):
        ap.error("--model times the model's own cache at q_len 1: drop --kv-cache / --q-len")
    if any(q < 1 for q in args.q_lens):
        ap.error(f"--q-len takes positive ints, got {args.q_lens}")
    if not torch.cuda.is_available():
        sys.exit("tpot.py times CUDA decode steps and needs a CUDA GPU; on CPU run "
                 "`python3 -m pytest bench/test_tpot.py --benchmark-disable`")
    from bench.gpu_timing import copy_gbps

    out = out_dir(args.out)  # a bad --out fails before the run, not after it
    gbps = copy_gbps()
    print(f"copy bandwidth {gbps:.0f} GB/s", flush=True)
    formats = list(dict.fromkeys(args.kv_cache))
    q_lens = list(dict.fromkeys(args.q_lens))
    if args.model:
        run_user_model(args, out, gbps)
        return
    rows, metas = [], []
    for kv_cache in formats:  # one model at a time: each holds max batch x 128K tokens
        config = PRESETS[args.preset](num_layers=args.layers)
        fit = fitting_context(config, max(args.batches), MAX_MODEL_LEN, kv_cache,
                              torch.cuda.mem_get_info()[0])
        contexts = [c for c in args.contexts if c <= fit]
        if fit < max(args.contexts):
            need = cache_bytes(config, max(args.batches), max(args.contexts), kv_cache)
            print(f"note: {max(args.batches)} x {max(args.contexts)} tokens x {args.layers} "
                  f"layers of {kv_cache} cache need {need / 1e9:.1f} GB, more than this GPU "
                  f"has free beside {RESERVE_BYTES >> 30} GiB; contexts capped at {fit} "
                  f"(skipped {[c for c in args.contexts if c > fit]}); pass fewer --layers "
                  "or a smaller largest batch to time them", flush=True)
        bench = TpotBench.build(config, batches=args.batches, policies=tuple(args.policies),
                                projections=args.projections, kv_cache=kv_cache,
                                q_lens=tuple(q_lens), max_context=max(contexts, default=1))
        rows += run(bench, policies=args.policies, contexts=contexts,
                    batches=args.batches, copy_gbps=gbps, q_lens=q_lens)
        metas.append(meta_for(bench, args, gbps))
        bench.close()
        del bench
        torch.cuda.empty_cache()
    meta = {**metas[0], "kv_caches": formats,
            "per_format": {m["kv_cache"]: {k: m[k] for k in ("ladder", "ladder_source",
                                                            "captures", "kv_row_bytes")}
                           for m in metas}}
    if out is None:
        print(json.dumps({"meta": meta, "rows": rows}, indent=1))
        return
    path = os.path.join(out, output_name(args.preset, formats, q_lens))
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {path}")


def run_user_model(args, out: str | None, gbps: float) -> None:
    """``--model``: the policies over the user's model, into h200-tpot-{slug}.json."""
    pages = -(-MAX_MODEL_LEN // PAGE_SIZE)
    model = build_model(args.model, num_pages=max(args.batches) * pages, page_size=PAGE_SIZE,
                        device="cuda", num_layers=args.layers)
    print(f"{model.describe()['model']}: capturing {', '.join(args.policies)}", flush=True)
    bench = TpotBench.for_user(model, batches=args.batches, policies=tuple(args.policies))
    rows = run(bench, policies=args.policies, contexts=args.contexts, batches=args.batches,
               copy_gbps=gbps)
    result = {"meta": meta_for(bench, args, gbps), "rows": rows}
    bench.close()
    if out is None:
        print(json.dumps(result, indent=1))
        return
    path = os.path.join(out, f"h200-tpot-{model.describe().get('slug', 'user')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
