"""How far balanced graphs are from eager and from float64, against a split-KV control.

Random ragged decode steps (one long request among short ones, so the ladder replays a
balanced graph) of a bf16 DeepSeek-V3-shaped decoder through three runners: the ladder,
eager (split-KV planned from the live lengths) and fixed-1 (one split: a split-KV
topology that is not eager's plan, the control). Each step is compared with the model's
float64 forward. If balanced graphs lost precision, their error to float64 would exceed
eager's; if they only differ from eager's rounding, fixed-1 differs from eager as much.

    python3 bench/experiments/balanced_numerics.py --steps 200     # H200, ~2-4 min
"""

from __future__ import annotations

import argparse


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="random ragged steps (default 200)")
    p.add_argument("--seed", type=int, default=25, help="seed of lengths, tables, inputs")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--preset", default="deepseek-v3-tp8",
                   help="graphbucket.models.PRESETS name (default deepseek-v3-tp8)")
    p.add_argument("--max-model-len", type=int, default=16384,
                   help="longest context (default 16384)")
    p.add_argument("--batch-sizes", default="2,8,32", help="capture sizes (default 2,8,32)")
    return p.parse_args()


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    args = parse_args()
    import numpy as np
    import torch

    from graphbucket import GraphBucketRunner
    from graphbucket.models import PRESETS, MLADecoder, decode_batch, prefill_random

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (bf16 kernels; the interpreter's bf16 dot is wrong)")
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    page, mml = 64, args.max_model_len
    pages_per_request = -(-mml // page)
    num_pages = pages_per_request * max(sizes)
    model = MLADecoder(PRESETS[args.preset](args.layers), num_pages=num_pages, page_size=page,
                       dtype=torch.bfloat16, device="cuda", seed=args.seed)
    prefill_random(model, np.arange(num_pages, dtype=np.int32)[None], [num_pages * page],
                   seed=args.seed)
    runners = {policy: GraphBucketRunner.for_model(model, max_model_len=mml, batch_sizes=sizes,
                                                   policy=policy, progress=False)
               for policy in ("ladder", "eager", "fixed-1")}
    for policy in ("ladder", "fixed-1"):
        runners[policy].capture()
    rng = np.random.default_rng(args.seed)
    rows = []
    for _ in range(args.steps):
        bs = int(rng.integers(2, max(sizes) + 1))
        lens = [int(rng.integers(mml // 4, mml + 1))] + rng.integers(1, 2048, bs - 1).tolist()
        table = rng.permutation(num_pages)[:bs * pages_per_request].reshape(bs, -1)
        hidden = torch.from_numpy(rng.standard_normal((bs, model.config.hidden_size))).to(
            torch.bfloat16)
        batch = decode_batch(model, lens, table.astype(np.int32), hidden)
        before = runners["ladder"].stats().replays
        out = {p: r.step(batch).clone() for p, r in runners.items()}
        balanced = any(k.balanced for k, n in runners["ladder"].stats().replays.items()
                       if n != before.get(k, 0))
        ref = model.forward_reference(hidden, positions=np.asarray(lens) - 1, seq_lens=lens,
                                      block_table=table,
                                      slot_mapping=batch.inputs["slot_mapping"]).cuda()
        rows.append((balanced, rel_l2(out["ladder"], ref), rel_l2(out["eager"], ref),
                     rel_l2(out["ladder"], out["eager"]), rel_l2(out["fixed-1"], ref),
                     rel_l2(out["fixed-1"], out["eager"])))
    names = ("ladder-f64", "eager-f64", "ladder-eager", "fixed1-f64", "fixed1-eager")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} {args.preset} "
          f"{args.layers} layers bf16, {args.steps} steps, seed {args.seed}")
    for flag in (True, False):
        sel = np.array([r[1:] for r in rows if r[0] == flag]).reshape(-1, len(names))
        print(f"{'balanced' if flag else 'split-KV'} steps: {len(sel)}")
        for i, name in enumerate(names):
            if len(sel):
                col = sel[:, i]
                print(f"  {name:13s} mean {col.mean():.3e} max {col.max():.3e} "
                      f"over 1e-2: {(col > 1e-2).sum()}")


if __name__ == "__main__":
    main()
