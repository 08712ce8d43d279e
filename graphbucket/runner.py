"""``GraphBucketRunner``: wrap a decode forward, capture one graph per bucket, step it.

The forward is ``forward(ctx) -> tensor [bs, *output_shape]``; ``ctx`` is a
``DecodeContext`` (static buffer views, the captured ``LaunchPlan``, the backend and
sm_scale), so its attention layers call ``ctx.attend(q, kv_cache, out)`` with the plan the
graph was captured with. Policies (DESIGN.md) are ladders: ``fixed-1`` and ``fixed-max``
are one-bucket ladders hinted at 1 and at ``max_model_len``; ``eager`` captures nothing
and plans every step from the batch's longest host length.

    runner = GraphBucketRunner.for_policy("ladder", forward, spec=spec, batch_sizes=[1, 2, 4],
                                          max_model_len=131072, sm_scale=scale)
    runner.capture()
    out = runner.step(DecodeBatch(seq_lens_cpu, block_table_cpu, {"hidden": h}))
"""

from __future__ import annotations

import torch

from graphbucket.backends import get_backend
from graphbucket.backends.base import DecodeBackend
from graphbucket.batch import DecodeBatch
from graphbucket.buffers import BufferSpec, StaticBuffers
from graphbucket.capture import CaptureSummary, Forward, GraphCapture, GraphRecord, plan_table
from graphbucket.dispatch import Dispatcher, DispatchStats, EagerExecutor
from graphbucket.ladder import Bucket, BucketLadder, default_ladder
from graphbucket.tuned import find_tuned_ladder

POLICIES = ("eager", "fixed-1", "fixed-max", "ladder")
# Benchmark-only: the field's default ladder, to compare against a shipped tuned one.
BENCH_POLICIES = (*POLICIES, "default-ladder")


def device_ladder(spec: BufferSpec, max_model_len: int) -> BucketLadder:
    """The ladder tuned for this GPU and head count when one ships, else the default."""
    if spec.device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(spec.device)
        tuned = find_tuned_ladder(name, spec.num_heads, max_model_len)
        if tuned is not None:
            return tuned
    return default_ladder(max_model_len)


def policy_ladder(policy: str, max_model_len: int, ladder: BucketLadder | None = None, *,
                  spec: BufferSpec | None = None) -> BucketLadder | None:
    """The ladder a policy captures (None for ``eager``); ``ladder`` overrides the default.

    For ``ladder`` without an explicit one: the shipped tuned ladder of ``spec``'s GPU and
    head count (graphbucket/ladders/), else ``default_ladder``. ``default-ladder`` always
    takes the field's five-bucket default (benchmarks compare the two).
    """
    if policy == "eager":
        return None
    if policy == "fixed-1":
        return BucketLadder([Bucket(max_model_len, 1)], max_model_len, meta={"policy": policy})
    if policy == "fixed-max":
        return BucketLadder([Bucket(max_model_len, max_model_len)], max_model_len,
                            meta={"policy": policy})
    if policy == "default-ladder":
        return default_ladder(max_model_len)
    if policy == "ladder":
        if ladder is not None and ladder.max_model_len != max_model_len:
            raise ValueError(f"ladder covers 1..{ladder.max_model_len} but max_model_len="
                             f"{max_model_len}; pass a ladder that ends at max_model_len")
        if ladder is not None:
            return ladder
        return device_ladder(spec, max_model_len) if spec else default_ladder(max_model_len)
    raise ValueError(f"unknown policy {policy!r}; expected one of {BENCH_POLICIES}")


class GraphBucketRunner:
    """Captures FULL graphs per (capture batch size, bucket) and replays them per step.

    ``ladder=None`` is eager mode: nothing is captured and each step plans from its live
    host lengths (benchmark baseline). Graph-safe: ``step`` is host-only selection, one
    pinned non-blocking copy and a replay; see ``graphbucket.dispatch``.
    """

    def __init__(self, forward: Forward, *, spec: BufferSpec, batch_sizes: list[int],
                 ladder: BucketLadder | None, sm_scale: float, max_model_len: int | None = None,
                 backend: DecodeBackend | None = None, select_key: str = "max",
                 warmup_iters: int = 1, progress: bool | None = None) -> None:
        self.batch_sizes = _check_batch_sizes(batch_sizes)
        self.max_model_len = ladder.max_model_len if ladder is not None else max_model_len
        if self.max_model_len is None or self.max_model_len > spec.max_context_len:
            raise ValueError(f"max_model_len={self.max_model_len} must be given (with "
                             "ladder=None) and at most the buffers' capacity "
                             f"{spec.max_context_len} (max_pages_per_seq x page_size)")
        self.spec, self.ladder = spec, ladder
        self.backend = backend if backend is not None else get_backend("triton",
                                                                       device=spec.device)
        self.plans = {} if ladder is None else plan_table(self.backend, ladder,
                                                          self.batch_sizes, spec.num_heads)
        self.buffers = StaticBuffers.allocate(
            spec, max_batch_size=self.batch_sizes[-1],
            workspace=self.backend.workspace_spec(self._workspace_plans()))
        self._eager = EagerExecutor(forward, self.backend, self.buffers, sm_scale=sm_scale,
                                    max_model_len=self.max_model_len)
        self._capture = None if ladder is None else GraphCapture(
            forward, self.buffers, self.backend, self.plans, sm_scale=sm_scale,
            warmup_iters=warmup_iters, progress=progress)
        self._closed = False
        # Eager mode still validates lengths against max_model_len through a one-bucket ladder.
        select_ladder = ladder or policy_ladder("fixed-max", self.max_model_len)
        self._dispatcher = Dispatcher(self.buffers, select_ladder, self.batch_sizes,
                                      self._capture, self._eager, select_key=select_key)

    def _workspace_plans(self) -> list:
        if self.plans:
            return list(self.plans.values())
        # Eager steps plan from live lengths: cover every batch size at the longest hint
        # (plans are monotone in the hint).
        return [self.backend.plan(b, self.spec.num_heads, self.max_model_len)
                for b in range(1, self.batch_sizes[-1] + 1)]

    @classmethod
    def for_policy(cls, policy: str, forward: Forward, *, spec: BufferSpec,
                   batch_sizes: list[int], max_model_len: int, sm_scale: float,
                   ladder: BucketLadder | None = None, **kwargs) -> GraphBucketRunner:
        """A runner for ``eager``, ``fixed-1``, ``fixed-max`` or ``ladder`` (see POLICIES)."""
        return cls(forward, spec=spec, batch_sizes=batch_sizes, sm_scale=sm_scale,
                   ladder=policy_ladder(policy, max_model_len, ladder, spec=spec),
                   max_model_len=max_model_len, **kwargs)

    @property
    def is_eager(self) -> bool:
        return self._capture is None

    @property
    def graphs(self) -> GraphCapture | None:
        """The capture orchestrator (graphs, plans, records); None in eager mode."""
        return self._capture

    @property
    def records(self) -> list[GraphRecord]:
        """Per-graph records (key, buckets served, pool bytes, seconds); empty when eager."""
        return [] if self._capture is None else list(self._capture.records)

    def capture(self) -> CaptureSummary | None:
        """Warm up and capture every graph (no-op returning None in eager mode)."""
        if self._capture is None:
            return None
        return self._capture.capture()

    def step(self, batch: DecodeBatch) -> torch.Tensor:
        """One decode step -> output [B, *output_shape], a view of the static output.

        Consume it (copy or use) before the next step: the next replay overwrites it.
        """
        if self._closed:
            raise RuntimeError("this runner was closed; build a new one")
        if self._capture is not None and self._capture.summary is None:
            raise RuntimeError("call capture() before step() (or build an eager runner)")
        return self._dispatcher.step(batch)

    def stats(self) -> DispatchStats:
        return self._dispatcher.stats()

    def close(self) -> None:
        """Release graphs, then the pool, then every buffer. The runner is unusable after."""
        if self._closed:
            return
        self._closed = True
        self._dispatcher.close()
        if self._capture is not None:
            self._capture.close()
        self._eager.close()
        self.buffers.close()

    def __enter__(self) -> GraphBucketRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_batch_sizes(batch_sizes: list[int]) -> list[int]:
    sizes = sorted(set(batch_sizes))
    if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes):
        raise ValueError(f"batch_sizes must be positive ints, got {batch_sizes!r}")
    return sizes
