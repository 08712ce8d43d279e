"""A minimal serving loop on graphbucket: admit, decode token by token, retire, report.

Requests of mixed prompt lengths arrive in a queue; up to ``--max-batch`` of them decode
together. Each step the scheduler hands the runner its host lengths and block table; the
runner picks the bucket graph for the batch's longest request (no device sync). Requests
cross bucket boundaries as they grow and leave when their output is done, freeing pages.
The key is printed as ``runner.selector.choose(lens)`` gives it: the same call an engine
that keeps its own graph dispatcher makes. Reports TPOT per step and replays per (padded
batch, bucket).

``--q-len N`` (N > 1) runs speculative decoding's verify steps: each step every request
verifies N tokens (its last token and N - 1 drafts) and accepts a random number of the
drafts (seeded). Only host lengths change from step to step: the graphs, captured for
q_len N, replay without a sync.

    python3 scripts/serve_loop.py               # CUDA: DeepSeek-V3 TP8 shapes, 2 layers
    python3 scripts/serve_loop.py --cpu         # tiny model through the Triton interpreter
    python3 scripts/serve_loop.py --q-len 3     # verify steps of 3 tokens per request
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not torch.cuda.is_available():  # the Triton kernels run in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from graphbucket.backends import get_backend  # noqa: E402
from graphbucket.ladder import BucketLadder, default_ladder  # noqa: E402
from graphbucket.models import MLADecoder, decode_batch, deepseek_v3_tp8, tiny  # noqa: E402
from graphbucket.runner import GraphBucketRunner  # noqa: E402


@dataclass
class Request:
    rid: int
    prompt_len: int
    output_len: int
    pages: list[int] = field(default_factory=list)
    generated: int = 0

    @property
    def seq_len(self) -> int:  # the token being decoded included
        return self.prompt_len + self.generated + 1

    def verify_len(self, q_len: int) -> int:
        """Length of a verify step: the last token and q_len - 1 drafts included."""
        return self.prompt_len + self.generated + q_len


class PagePool:
    """Free list of cache pages; a request holds enough pages for prompt + output."""

    def __init__(self, num_pages: int, page_size: int, rng: np.random.Generator, *,
                 q_len: int = 1) -> None:
        self.free = deque(int(p) for p in rng.permutation(num_pages))  # scattered pages
        self.page_size, self.q_len = page_size, q_len

    def admit(self, req: Request) -> bool:
        # A verify step stores q_len - 1 drafts past the last token, accepted or not.
        need = -(-(req.prompt_len + req.output_len + self.q_len - 1) // self.page_size)
        if need > len(self.free):
            return False
        req.pages = [self.free.popleft() for _ in range(need)]
        return True

    def retire(self, req: Request) -> None:
        self.free.extend(req.pages)


def fill_prompt(model: MLADecoder, req: Request, gen: torch.Generator) -> None:
    """Stand-in for prefill: seeded random latent rows for the prompt's pages."""
    idx = torch.tensor(req.pages[: -(-req.prompt_len // model.page_size)], dtype=torch.long,
                       device=model.device)
    for cache in model.kv_caches:
        rows = torch.randn(idx.numel(), model.page_size, cache.shape[2], generator=gen,
                           device=model.device)
        cache.index_copy_(0, idx, rows.to(cache.dtype))


def block_table(batch: list[Request]) -> np.ndarray:
    cols = max(len(r.pages) for r in batch)
    table = np.zeros((len(batch), cols), dtype=np.int32)
    for i, r in enumerate(batch):
        table[i, : len(r.pages)] = r.pages
    return table


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def serve(model: MLADecoder, runner: GraphBucketRunner, requests: list[Request],
          max_batch: int, seed: int, q_len: int = 1) -> dict:
    pool = PagePool(model.num_pages, model.page_size, np.random.default_rng(seed), q_len=q_len)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    accept = np.random.default_rng(seed + 1)  # stands in for the draft check
    waiting, running, step_ms, finished, tokens = deque(requests), [], [], 0, 0
    while waiting or running:
        while waiting and len(running) < max_batch and pool.admit(waiting[0]):
            req = waiting.popleft()
            fill_prompt(model, req, gen)
            running.append(req)
        lens = [r.verify_len(q_len) for r in running]
        hidden = torch.randn(len(running) * q_len, model.config.hidden_size, generator=gen,
                             device=model.device).to(model.dtype)
        batch = decode_batch(model, lens, block_table(running), hidden, q_len=q_len)
        key = runner.selector.choose(lens, q_len)  # what an engine's own dispatcher keys on
        sync(model.device)
        t0 = time.perf_counter()
        runner.step(batch)
        sync(model.device)  # a real engine syncs here anyway: it samples the next token
        step_ms.append((time.perf_counter() - t0) * 1e3)
        if len(step_ms) % 25 == 1:
            print(f"step {len(step_ms):>4}: batch {len(running)}, longest {max(lens):>6}, "
                  f"graph (padded batch {key.batch_size}, bucket {key.bucket}, hint "
                  f"{key.hint}), "
                  f"{step_ms[-1]:.2f} ms", flush=True)
        for r in running:  # one token, plus the drafts accepted (verify steps)
            n = 1 + int(accept.integers(0, q_len)) if q_len > 1 else 1
            n = min(n, r.output_len - r.generated)
            r.generated += n
            tokens += n
        for r in [r for r in running if r.generated >= r.output_len]:
            running.remove(r)
            pool.retire(r)
            finished += 1
    stats = runner.stats()
    return {"steps": len(step_ms), "finished": finished, "tokens": tokens,
            "tpot_ms_median": statistics.median(step_ms),
            "replays_by_bucket": dict(sorted(((k.batch_size, k.bucket), n)
                                             for k, n in stats.replays.items())),
            "eager_fallbacks": stats.eager_fallbacks}


def build(cpu: bool, layers: int, max_model_len: int, q_len: int = 1):
    if cpu:
        model = MLADecoder(tiny(num_layers=layers), num_pages=256, page_size=16,
                           dtype=torch.float32, device="cpu")
        backend = get_backend("triton", num_sms=8, kv_lora_rank=model.config.kv_lora_rank,
                              qk_rope_dim=model.config.qk_rope_dim)
    else:
        pages = 8 * (-(-max_model_len // 64))
        model = MLADecoder(deepseek_v3_tp8(num_layers=layers), num_pages=pages, device="cuda")
        backend = get_backend("triton", device="cuda")
    ladder = default_ladder(max_model_len)
    runner = GraphBucketRunner.for_model(model, max_model_len=max_model_len,
                                         batch_sizes=[1, 2, 4, 8], ladder=ladder, backend=backend,
                                         q_lens=(q_len,))
    return model, runner, ladder


def workload(cpu: bool, rng: np.random.Generator, ladder: BucketLadder,
             q_len: int = 1) -> list[Request]:
    if cpu:  # prompts that start just below the 64-token bound and cross it
        prompts, outputs = [50, 10, 58, 120, 30], [20, 30, 12, 10, 40]
    else:
        prompts = [60, 3000, 15000, 50, 60000, 100000, 500, 4000]
        outputs = [int(x) for x in rng.integers(40, 120, size=len(prompts))]
    top = ladder.max_model_len
    return [Request(i, min(p, top - o - q_len), o) for i, (p, o) in
            enumerate(zip(prompts, outputs, strict=True))]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true",
                    help="tiny model on the CPU through the Triton interpreter (also the "
                         "default when no CUDA GPU is present)")
    ap.add_argument("--layers", type=positive_int, default=2,
                    help="decoder layers of the model (default: %(default)s)")
    ap.add_argument("--max-batch", type=positive_int, default=4,
                    help="most requests decoding together in one step; graphs are captured "
                         "for batch 1, 2, 4 and 8, larger batches run eagerly "
                         "(default: %(default)s)")
    ap.add_argument("--q-len", type=positive_int, default=1,
                    help="tokens verified per request and step (1: plain decode; N > 1: the "
                         "last token and N - 1 drafts, a random number of them accepted; "
                         "default: %(default)s)")
    args = ap.parse_args(argv)
    cpu = args.cpu or not torch.cuda.is_available()
    model, runner, ladder = build(cpu, args.layers, 512 if cpu else 131072, args.q_len)
    print(runner.capture().describe())
    report = serve(model, runner, workload(cpu, np.random.default_rng(0), ladder, args.q_len),
                   args.max_batch, seed=0, q_len=args.q_len)
    runner.close()
    print(f"served {report['finished']} requests ({report['tokens']} tokens) in "
          f"{report['steps']} steps of q_len {args.q_len}; median step "
          f"{report['tpot_ms_median']:.2f} ms; eager fallbacks {report['eager_fallbacks']}")
    print("replays per (padded batch, bucket):", report["replays_by_bucket"])


if __name__ == "__main__":
    main()
