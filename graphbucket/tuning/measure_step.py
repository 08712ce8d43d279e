"""Hints timed inside a whole decode step: the measuring side of ``tuning.step_ties``.

``StepTimer`` builds a small DeepSeek-V3-shaped decoder (2 layers: the per-rank TP8 shapes,
or the data-parallel preset's at 128 heads) with a random cache that holds ``max_batch``
requests of ``max_context`` tokens, and for one (batch, context) captures one runner per
hint (a one-bucket ladder at that hint, one capture size) and times their steps
interleaved: one sample of each per round, the order rotating, so that clock drift is
shared by every hint. Each sample is CUDA-event time over back-to-back ``runner.step``
calls (host selection, staging and replay included, as an engine's step). CUDA only.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from graphbucket import fp8
from graphbucket.ladder import Bucket, BucketLadder
from graphbucket.models import MLADecoder, decode_batch, prefill_random, random_block_table
from graphbucket.models.config import MLAConfig, deepseek_v3_dp, deepseek_v3_tp8
from graphbucket.runner import GraphBucketRunner

ROUNDS, SAMPLE_MS, MAX_STEPS = 7, 30.0, 200
FP8_TENSOR_AMAX = 8.0  # prefill_random's N(0, 1) rows fit it


def step_config(num_heads: int, num_layers: int = 2) -> MLAConfig:
    """The decoder a step is timed on: DeepSeek-V3's data-parallel shapes at 128 heads,
    its TP8 rank's with ``num_heads`` heads otherwise."""
    if num_heads == 128:
        return deepseek_v3_dp(num_layers)
    return dataclasses.replace(deepseek_v3_tp8(num_layers), num_heads=num_heads,
                               name=f"deepseek-v3-tp8-h{num_heads}")


class StepTimer:
    """``timer(batch, context, hints)`` -> ms per decode step of each hint's graph."""

    def __init__(self, num_heads: int, *, max_context: int, max_batch: int,
                 max_model_len: int, kv_cache: str = "bf16", q_len: int = 1,
                 page_size: int = 64, seed: int = 0, rounds: int = ROUNDS) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("StepTimer times CUDA decode steps and needs a CUDA GPU")
        self.config = step_config(num_heads)
        self.max_model_len, self.q_len, self.rounds = max_model_len, q_len, rounds
        pages = -(-max_context // page_size)
        scale = {"kv_scale": FP8_TENSOR_AMAX / fp8.FP8_MAX} if kv_cache == "fp8-tensor" else {}
        self.model = MLADecoder(self.config, num_pages=max_batch * pages, page_size=page_size,
                                dtype=torch.bfloat16, device="cuda", seed=seed,
                                kv_cache_format=fp8.check_format(kv_cache), **scale)
        self.table = random_block_table(max_batch, pages, self.model.num_pages,
                                        np.random.default_rng(seed))
        prefill_random(self.model, self.table, [pages * page_size] * max_batch, seed=seed)
        self.max_context, self.max_batch = pages * page_size, max_batch
        self._gen = torch.Generator(device="cuda").manual_seed(seed)

    def __call__(self, batch: int, context: int, hints: Sequence[int]) -> dict[int, float]:
        if batch > self.max_batch or context > self.max_context:
            raise ValueError(f"StepTimer holds {self.max_batch} x {self.max_context} tokens; "
                             f"asked for {batch} x {context}")
        cols = -(-context // self.model.page_size)
        hidden = torch.randn(batch * self.q_len, self.config.hidden_size, generator=self._gen,
                             device="cuda").to(torch.bfloat16)
        step = decode_batch(self.model, [context] * batch, self.table[:batch, :cols], hidden,
                            q_len=self.q_len)
        runners = {}
        try:
            for hint in dict.fromkeys(hints):
                ladder = BucketLadder((Bucket(self.max_model_len, hint),), self.max_model_len)
                runner = GraphBucketRunner.for_model(
                    self.model, max_model_len=self.max_model_len, batch_sizes=[batch],
                    ladder=ladder, progress=False, q_lens=(self.q_len,), copy_in_graph=False)
                runner.capture()
                runners[hint] = runner
            return paired_ms({h: (lambda r=r: r.step(step)) for h, r in runners.items()},
                             rounds=self.rounds)
        finally:
            for runner in runners.values():
                runner.close()

    def close(self) -> None:
        del self.model
        torch.cuda.empty_cache()


def interleaved_rounds(steps: Mapping[Any, Callable[[], object]], *, rounds: int = ROUNDS,
                       sample_ms: float = SAMPLE_MS, max_steps: int = MAX_STEPS
                       ) -> dict[Any, list[float]]:
    """ms per call of each step, one sample per round (CUDA events over n back-to-back
    calls, n sized to ``sample_ms``), the order rotating every round, so that clock drift is
    shared by every step and sample i of each comes from round i."""
    names = list(steps)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(name: Any, n: int) -> float:
        start.record()
        for _ in range(n):
            steps[name]()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / n

    counts = {}
    for name in names:
        for _ in range(3):
            steps[name]()
        torch.cuda.synchronize()
        counts[name] = max(3, min(max_steps, int(sample_ms / max(timed(name, 1), 1e-3))))
    samples: dict[Any, list[float]] = {name: [] for name in names}
    for rnd in range(rounds):
        shift = rnd % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(timed(name, counts[name]))
    return samples


def paired_ms(steps: Mapping[int, Callable[[], object]], *, rounds: int = ROUNDS
              ) -> dict[int, float]:
    """Median ms per call of each step over ``interleaved_rounds``."""
    return {name: statistics.median(v)
            for name, v in interleaved_rounds(steps, rounds=rounds).items()}
