"""Engine hook: bucketed FULL graphs inside an engine's own graph dispatcher.

An engine that keeps its own CUDA-graph runner (one graph per padded batch size) adopts
bucketing with two host calls per decode step, no graphbucket runner needed:

    hook = BucketHook(ladder, capture_sizes=[1, 2, 4, 8, 16, 32, 64])
    # capture time: for every (padded_bs, bucket) in hook.capture_keys(), build the
    # attention metadata with the bucket's hint and capture under hook.graph_key(...)
    # decode step: one host call on the scheduler's lengths
    choice = hook.choose(seq_lens_cpu)
    graph = my_graphs[choice.key]            # key = (padded_bs, bucket index)
    metadata.min_kv_seq_len = choice.hint    # AITER MLA: the host hint the kernel plans with
    # Triton MLA / FlashInfer: metadata.max_seq_len = choice.hint (the host bound they plan
    # with); where a backend also trusts that bound as >= every live length, build the hook
    # on ladder.with_top_hints(): tuned hints may lie below a bucket's top.

Graph safety: ``choose`` is host arithmetic on host lengths (a bisect); it never touches
device memory, so the step stays sync-free.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from graphbucket.ladder import BucketLadder


@dataclass(frozen=True, slots=True)
class BucketChoice:
    """What one decode step replays: ``key`` extends an engine's per-batch-size graph key."""

    padded_batch_size: int
    bucket: int
    hint: int

    @property
    def key(self) -> tuple[int, int]:
        return (self.padded_batch_size, self.bucket)


class BucketHook:
    """Maps host lengths to (padded batch size, bucket, hint) for an engine's dispatcher.

    ``capture_sizes`` are the engine's graph batch sizes; a batch above the largest one is
    the engine's eager path (``choose`` returns None so the engine decides, as it already
    does for oversize batches).
    """

    def __init__(self, ladder: BucketLadder, capture_sizes: Sequence[int], *,
                 select_key: str = "max") -> None:
        sizes = sorted(set(int(s) for s in capture_sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"capture_sizes must be positive ints, got {list(capture_sizes)}")
        if select_key not in ("max", "min"):
            raise ValueError(f"select_key must be 'max' or 'min', got {select_key!r}")
        self.ladder = ladder
        self.capture_sizes = tuple(sizes)
        self.select_key = select_key

    def capture_keys(self) -> Iterator[tuple[int, int, int]]:
        """(padded batch size, bucket, hint) for every graph to capture, largest batch first."""
        for bs in reversed(self.capture_sizes):
            for bucket, hint in enumerate(self.ladder.hints_for(bs)):
                yield bs, bucket, hint

    def pad(self, batch_size: int) -> int | None:
        """Smallest capture size >= batch_size, or None when the batch needs the eager path."""
        i = bisect.bisect_left(self.capture_sizes, batch_size)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def choose(self, seq_lens_cpu: Any) -> BucketChoice | None:
        """The graph for this step from the scheduler's host lengths (list/numpy/CPU tensor).

        Raises ValueError for a length above the ladder's top (``max_model_len``); returns
        None for a batch above the largest capture size.
        """
        bucket = self.ladder.select(seq_lens_cpu, key=self.select_key)
        padded = self.pad(len(seq_lens_cpu))
        if padded is None:
            return None
        return BucketChoice(padded, bucket, self.ladder.hint_for(bucket, padded))
