"""TPOT of the sparse MLA decoder (DeepSeek-V3.2 TP8 shapes) per policy, and the dense one.

The ``SparseMLADecoder`` (dense MLA projections + indexer projections + sparse attention,
top-k 2048) runs the four policies (``eager``, ``fixed-1``, ``fixed-max``, ``ladder`` =
``sparse_ladder``) and ``seed-ladder``: the same buckets with vLLM ROCm's
``_sparse_decode_max_split`` count (``seed_max_splits``) for both the indexer and the
attention splits, so the plan's split choice is measured against the seed heuristic.
Batch 1 and 8, q_len 1 and 2 (verify steps run as flat rows), contexts 1K .. 128K; then
the dense ``MLADecoder`` (DeepSeek-V3 TP8) at 128K with the same policies. Timing as
``bench/tpot.py`` (``time_tpot``: CUDA events over back-to-back ``runner.step`` calls,
median of 5); ``tpot_ms`` = step_ms / q_len.

    python3 bench/tpot_sparse.py --layers 2 --out bench/results   # h200-sparse-tpot.{json,md}
    python3 bench/tpot_sparse.py --layers 2                        # prints only
    python3 -m pytest bench/test_tpot_sparse.py                    # CPU smoke (interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.tpot import TpotBench, time_tpot  # noqa: E402
from graphbucket.models import deepseek_v3_tp8, random_block_table  # noqa: E402
from graphbucket.models.sparse_mla import (  # noqa: E402
    SparseMLAConfig,
    SparseMLADecoder,
    deepseek_v32_tp8,
)
from graphbucket.policies import POLICIES  # noqa: E402
from graphbucket.runner import GraphBucketRunner  # noqa: E402
from graphbucket.sparse.backend import SparseBackend, sparse_ladder  # noqa: E402
from graphbucket.sparse.plan import SparsePlan, seed_max_splits  # noqa: E402

CONTEXTS = [1024, 16384, 65536, 100_000, 131072]
BATCHES = [1, 8]
Q_LENS = [1, 2]
MAX_MODEL_LEN = 131072
PAGE_SIZE = 64
SEED_POLICY = "seed-ladder"
# Sparse decode has no balanced topology, so balanced-only has no sparse graph to time.
BENCH_POLICIES = (*(p for p in POLICIES if p != "balanced-only"), SEED_POLICY)


class SeedSplitBackend(SparseBackend):
    """``SparseBackend`` with the seed's split count (``seed_max_splits`` of the hint) for
    the indexer and the attention: the baseline the plan's choice is measured against."""

    name = "sparse-seed"

    def plan(self, batch_size: int, num_heads: int, hint: int) -> SparsePlan:
        seed = seed_max_splits(hint, self.topk, self.num_sms)
        return super().plan(batch_size, num_heads, hint).with_splits(indexer=seed,
                                                                     attention=seed)


@dataclass(eq=False)
class SparseTpotBench(TpotBench):
    """One sparse model, one scattered block table, one captured runner per policy
    (``batch`` and ``plan`` as ``TpotBench``'s: the sparse backend plans SparsePlans)."""

    model: SparseMLADecoder

    @classmethod
    def build(cls, config: SparseMLAConfig, *, max_model_len: int = MAX_MODEL_LEN,
              batches=BATCHES, policies=BENCH_POLICIES, q_lens=Q_LENS,
              page_size: int = PAGE_SIZE, dtype: torch.dtype = torch.bfloat16,
              device: str = "cuda", seed: int = 0, num_sms: int | None = None
              ) -> SparseTpotBench:
        pages = -(-max_model_len // page_size)
        model = SparseMLADecoder(config, num_pages=max(batches) * pages, page_size=page_size,
                                 dtype=dtype, device=device, seed=seed)
        table = random_block_table(max(batches), pages, model.num_pages,
                                   np.random.default_rng(seed))
        model.prefill_random(table, [max_model_len] * max(batches), seed=seed)
        gen = torch.Generator(device=device).manual_seed(seed)
        hidden = {n: torch.randn(n, config.hidden_size, generator=gen, device=device).to(dtype)
                  for n in sorted({b * q for b in batches for q in q_lens})}
        runners = {}
        for policy in policies:
            backend = model.decode_backend(max_model_len, num_sms=num_sms)
            if policy == SEED_POLICY:
                backend = SeedSplitBackend(num_heads=backend.num_heads, max_len=max_model_len,
                                           topk=backend.topk, num_sms=backend.num_sms)
            runners[policy] = GraphBucketRunner.for_model(
                model, policy="ladder" if policy == SEED_POLICY else policy,
                max_model_len=max_model_len, batch_sizes=list(batches), backend=backend,
                q_lens=tuple(q_lens), progress=False,
                **({"ladder": sparse_ladder(max_model_len, topk=config.index_topk)}
                   if policy == SEED_POLICY else {}))
            runners[policy].capture()
        return cls(model, runners, table, hidden, max_model_len)


def row(model: str, policy: str, context: int, batch: int, q_len: int, step_ms: float,
        plan=None) -> dict:
    out = {"model": model, "policy": policy, "batch": batch, "q_len": q_len,
           "context": context, "tpot_ms": round(step_ms / q_len, 4),
           "step_ms": round(step_ms, 4)}
    if isinstance(plan, SparsePlan):
        out.update(indexer_splits=plan.indexer_splits, attention_splits=plan.attention_splits)
    elif plan is not None:
        out["splits"] = plan.num_kv_splits
    return out


def run_rows(bench: TpotBench, *, policies, contexts, batches, q_lens) -> list[dict]:
    """Time every (q_len, batch, context, policy) of ``bench``: the sparse or dense model."""
    rows, name = [], bench.model.config.name
    for q_len in q_lens:
        for batch in batches:
            for context in contexts:
                for policy in policies:
                    runner, decode = bench.runners[policy], bench.batch(context, batch, q_len)
                    ms = time_tpot(lambda: runner.step(decode))  # noqa: B023
                    rows.append(row(name, policy, context, batch, q_len, ms,
                                    bench.plan(policy, context, batch, q_len)))
                    print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    splits = (f"indexer {r['indexer_splits']} attention {r['attention_splits']}"
              if "indexer_splits" in r else f"splits {r.get('splits')}")
    return (f"{r['model']} q_len={r['q_len']} bs={r['batch']} ctx={r['context']} "
            f"{r['policy']:<11} {r['tpot_ms']:.3f} ms/token ({splits})")


def summary(rows: list[dict], dense_rows: list[dict]) -> dict:
    """The issue's checks: ladder vs fixed-1 at 100K (>= 3x), ladder never behind
    fixed-max, the plan vs the seed's splits, sparse vs dense at 128K."""
    at = {(r["policy"], r["batch"], r["q_len"], r["context"]): r["tpot_ms"] for r in rows}
    shapes = sorted({k[1:] for k in at})
    out: dict = {"ladder_over_fixed_1_at_100k": {}, "ladder_behind_fixed_max": [],
                 "seed_over_ladder": {}, "sparse_over_dense_128k": {}}
    for b, q, c in shapes:
        ladder = at.get(("ladder", b, q, c))
        if ladder is None:
            continue
        tag = f"bs{b}-q{q}-ctx{c}"
        if c == 100_000 and ("fixed-1", b, q, c) in at:
            out["ladder_over_fixed_1_at_100k"][tag] = round(at[("fixed-1", b, q, c)] / ladder, 2)
        fixed_max = at.get(("fixed-max", b, q, c))
        if fixed_max is not None and ladder > 1.03 * fixed_max:  # 3 %: above the noise
            out["ladder_behind_fixed_max"].append(tag)
        if (SEED_POLICY, b, q, c) in at:
            out["seed_over_ladder"][tag] = round(at[(SEED_POLICY, b, q, c)] / ladder, 2)
    dense = {(r["policy"], r["batch"], r["q_len"]): r["tpot_ms"] for r in dense_rows}
    for (policy, b, q), ms in dense.items():
        sparse = at.get((policy, b, q, dense_rows[0]["context"]))
        if sparse is not None:
            out["sparse_over_dense_128k"][f"{policy}-bs{b}-q{q}"] = round(sparse / ms, 2)
    return out


def markdown(result: dict) -> str:
    meta, lines = result["meta"], []
    lines += [f"# Sparse MLA TPOT ({meta.get('gpu', '?')}, {meta.get('layers')} layers)", "",
              "ms per token (step / q_len); policy columns.", ""]
    policies = list(dict.fromkeys(r["policy"] for r in result["rows"]))
    lines += ["| model | batch | q_len | context | " + " | ".join(policies) + " |",
              "|---" * (4 + len(policies)) + "|"]
    table: dict = {}
    for r in result["rows"] + result["dense_rows"]:
        table.setdefault((r["model"], r["batch"], r["q_len"], r["context"]), {})[
            r["policy"]] = r["tpot_ms"]
    for (model, b, q, c), by in table.items():
        cells = " | ".join(f"{by[p]:.3f}" if p in by else "-" for p in policies)
        lines.append(f"| {model} | {b} | {q} | {c} | {cells} |")
    lines += ["", "```", json.dumps(result["summary"], indent=1), "```", ""]
    return "\n".join(lines)


def main() -> None:
    from bench.gpu_timing import add_out_argument, out_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2,
                    help="decoder layers of both models (default: %(default)s)")
    add_out_argument(ap, "h200-sparse-tpot.{json,md}")
    ap.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS,
                    help="context lengths of the sparse model (default: %(default)s)")
    ap.add_argument("--batches", type=int, nargs="+", default=BATCHES,
                    help="batch sizes; each is a capture size (default: %(default)s)")
    ap.add_argument("--q-len", type=int, nargs="+", default=Q_LENS, dest="q_lens",
                    help="query tokens per request (verify steps; default: %(default)s)")
    ap.add_argument("--policies", nargs="+", default=list(BENCH_POLICIES),
                    choices=BENCH_POLICIES, metavar="POLICY",
                    help=f"graph policies to time, of {', '.join(BENCH_POLICIES)} "
                         "(default: all)")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense model at 128K")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tpot_sparse.py times CUDA decode steps; on CPU run "
                 "`python3 -m pytest bench/test_tpot_sparse.py`")
    from bench.gpu_timing import run_meta

    top = max(args.contexts)
    bench = SparseTpotBench.build(deepseek_v32_tp8(num_layers=args.layers),
                                  max_model_len=max(top, MAX_MODEL_LEN), batches=args.batches,
                                  policies=tuple(args.policies), q_lens=args.q_lens)
    captures = {p: r.capture().describe() for p, r in bench.runners.items() if not r.is_eager}
    rows = run_rows(bench, policies=args.policies, contexts=args.contexts,
                    batches=args.batches, q_lens=args.q_lens)
    bench.close()
    del bench
    torch.cuda.empty_cache()
    dense_rows = []
    if not args.no_dense:
        dense_policies = [p for p in args.policies if p in POLICIES]
        dense = TpotBench.build(deepseek_v3_tp8(num_layers=args.layers),
                                max_model_len=MAX_MODEL_LEN, batches=args.batches,
                                policies=tuple(dense_policies), q_lens=tuple(args.q_lens))
        dense_rows = run_rows(dense, policies=dense_policies, contexts=[MAX_MODEL_LEN],
                              batches=args.batches, q_lens=args.q_lens)
        dense.close()
    result = {"meta": {**run_meta(), "model": "deepseek-v32-tp8", "layers": args.layers,
                       "dense_model": "deepseek-v3-tp8", "page_size": PAGE_SIZE,
                       "topk": 2048, "captures": captures,
                       "timing": "CUDA events over back-to-back runner.step calls, median "
                                 "of 5 runs; tpot_ms = step_ms / q_len"},
              "rows": rows, "dense_rows": dense_rows, "summary": summary(rows, dense_rows)}
    print(json.dumps(result["summary"], indent=1))
    if out := out_dir(args.out):
        path = os.path.join(out, "h200-sparse-tpot.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.splitext(path)[0] + ".md", "w") as f:
            f.write(markdown(result))
        print(f"wrote {path} and its .md")


if __name__ == "__main__":
    main()
