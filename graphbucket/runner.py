"""``GraphBucketRunner``: wrap a decode forward, capture one graph per bucket, step it.

The forward is ``forward(ctx) -> tensor [bs, *output_shape]``; ``ctx`` is a
``DecodeContext`` (static buffer views, the captured ``Plan``, the backend and
sm_scale), so its attention layers call ``ctx.attend(q, kv_cache, out)`` with the plan
the graph was captured with. One step is::

    batch = validate(DecodeBatch)           # host checks; bad input raises here
    key = selector.key_for(lengths, q_len)  # host bisect: (padded batch, bucket, hint, q_len)
    slot = buffers.stage(batch, key.batch_size, in_graph=True)  # numpy writes to a slot
    graphs.replay(key, slot)                # its graph copies the slot in, then decodes
                                            # (device inputs: the stage copies, no slot)
    return buffers.output[:batch_size * q_len]

Nothing on that path reads device memory or synchronizes. Block tables: a batch carries
a plain ``[B, num_cols]`` array (checked and copied whole every step) or the runner's
persistent ``runner.block_table`` (a ``BlockTable``, edited by the engine with ``assign``
/ ``append`` / ``release`` as requests change): pages are checked as they enter, a step
checks each length against its row's page count and stages only the changed entries,
which every graph scatters in before its forward (``graphbucket.block_table``).

Eager path (documented, counted, logged once): a batch above the largest capture size
runs the forward eagerly, planned from its live host lengths, on overflow buffers sized
for it; an eager runner (``ladder=None``) runs every step that way.

Multi-token steps (MTP / speculative verification): ``q_lens=(1, 2, 4)`` captures every
(batch size, bucket) graph once per q_len, planned with q_len x heads rows; a
``DecodeBatch(..., q_len=2)`` replays its q_len's graph and returns one output row per
query token. A q_len the runner was not built with raises ValueError before anything is
staged (no silent eager path: a verify step cannot be padded to more tokens).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from graphbucket.backends import get_backend
from graphbucket.backends.base import DecodeBackend, Plan
from graphbucket.batch import BatchValidator, CheckedBatch, DecodeBatch
from graphbucket.block_table import BlockTable
from graphbucket.buffers import StaticBuffers
from graphbucket.graphs import CaptureSummary, Forward, GraphRecord, GraphTable
from graphbucket.ladder import Bucket, BucketLadder
from graphbucket.policies import Policy, policy_ladder
from graphbucket.select import GraphKey, GraphSelector, SelectRule
from graphbucket.spec import BufferSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunnerStats:
    """Counts since construction. ``replays[key]``: replays of the graph serving ``key``."""

    steps: int
    replays: dict[GraphKey, int]
    eager_steps: int
    eager_fallbacks: int
    errors: int
    staging_waits: int


class GraphBucketRunner:
    """Captures FULL graphs per (capture batch size, bucket) and replays them per step.

    ``ladder=None`` is eager mode: nothing is captured and each step plans from its live
    host lengths (a benchmark baseline). The backend defaults to the Triton one, built with
    ``kv_lora_rank``/``qk_rope_dim`` (those of the model, which ``for_model`` reads).
    ``q_lens``: the query tokens per request steps may have (default 1; e.g. (1, 2, 4)
    for a verify step of up to 3 draft tokens), each captured; the static buffers hold
    the largest; ``q_ladders``: ladders of their own for some q_lens above 1 (the
    ``ladder`` policy's default: each q_len's tuned ladder where one ships,
    ``backend.default_q_ladder``). ``block_table``: the persistent host table (one row
    per batch slot, up to the largest capture size) a ``DecodeBatch`` may carry instead
    of an array;
    ``max_table_changes``: the entries one such step stages as a list (more are copied
    row by row; default ``buffers.default_max_table_changes``).
    ``copy_in_graph``: also capture every graph once per staging slot with that slot's
    seq_info copy as its first node, so a step enqueues no copy of its own (steps that
    carry device inputs still do, and replay the graph without one); False captures
    only the latter, for a third of the graphs. ``copy_kernel``: that first node is the
    slot-copy kernel where it can read pinned memory (False: a memcpy node and an event
    node).
    Graph-safe: ``step`` is host-only selection, numpy writes into a pinned staging slot
    and the replay of that slot's graph, which copies the slot in as its first node.
    """

    def __init__(self, forward: Forward, *, spec: BufferSpec, batch_sizes: list[int],
                 ladder: BucketLadder | None, sm_scale: float, max_model_len: int | None = None,
                 backend: DecodeBackend | None = None, kv_lora_rank: int = 512,
                 qk_rope_dim: int = 64, rule: SelectRule = "max", warmup_iters: int = 1,
                 progress: bool = True, q_lens: tuple[int, ...] = (1,),
                 q_ladders: Mapping[int, BucketLadder] | None = None,
                 max_table_changes: int | None = None, copy_in_graph: bool = True,
                 copy_kernel: bool = True) -> None:
        if ladder is None and max_model_len is None:
            raise ValueError("an eager runner (ladder=None) needs max_model_len")
        top = ladder.max_model_len if ladder is not None else max_model_len
        if max_model_len is not None and max_model_len != top:
            raise ValueError(f"ladder covers 1..{top} but max_model_len={max_model_len}; pass "
                             "a ladder that ends at max_model_len")
        if top > spec.max_context_len:
            raise ValueError(f"max_model_len={top} is above the buffers' capacity "
                             f"{spec.max_context_len} (max_pages_per_seq x page_size); build "
                             "the spec for this max_model_len")
        self.spec, self.ladder, self.max_model_len = spec, ladder, top
        self.forward, self.sm_scale = forward, sm_scale
        self.warmup_iters, self.progress = warmup_iters, progress
        self.backend = backend if backend is not None else _default_backend(
            spec, kv_lora_rank, qk_rope_dim)
        # An eager runner still validates lengths against max_model_len: a one-bucket
        # selector whose keys it never captures.
        if q_ladders and ladder is None:
            raise ValueError("q_ladders needs a ladder: an eager runner captures no graphs")
        self.selector = GraphSelector(ladder or BucketLadder((Bucket(top, top),), top),
                                      batch_sizes, rule=rule, q_lens=q_lens,
                                      q_ladders=q_ladders)
        self.graphs = None if ladder is None else GraphTable(
            self.selector, self.backend, spec.num_heads, copy_in_graph=copy_in_graph)
        max_q = self.selector.max_q_len
        self.buffers = StaticBuffers.allocate(
            spec, max_batch_size=self.selector.max_batch_size, max_q_len=max_q,
            workspace=self.backend.workspace_spec(self._workspace_plans()),
            max_table_changes=max_table_changes, copy_kernel=copy_kernel)
        self.block_table = BlockTable(spec, self.selector.max_batch_size)
        self._validate = BatchValidator(spec, max_q_len=max_q, block_table=self.block_table)
        # Output views by token count (batch x q_len), so a step slices nothing.
        self._outputs = [self.buffers.output[:n] for n in range(self.buffers.output.shape[0] + 1)]
        self._overflow: StaticBuffers | None = None
        self._replays: Counter[GraphKey] = Counter()
        self._steps = self._eager_steps = self._fallbacks = self._errors = 0
        self._warned = self._closed = False

    @classmethod
    def for_policy(cls, policy: Policy, forward: Forward, *, spec: BufferSpec,
                   batch_sizes: list[int], max_model_len: int, sm_scale: float,
                   ladder: BucketLadder | None = None, **kwargs) -> GraphBucketRunner:
        """A runner for ``eager``, ``fixed-1``, ``fixed-max`` or ``ladder`` (``POLICIES``).
        ``ladder`` replaces the ``ladder`` policy's default, the backend's
        ``default_ladder`` (the Triton one's: ``policies.device_ladder``)."""
        backend = kwargs.pop("backend", None) or _default_backend(
            spec, kwargs.pop("kv_lora_rank", 512), kwargs.pop("qk_rope_dim", 64))
        if policy == "ladder" and ladder is None:
            ladder = backend.default_ladder(max_model_len, spec)
            if "q_ladders" not in kwargs:  # each q_len's tuned ladder, where one ships
                found = {q: backend.default_q_ladder(max_model_len, spec, q)
                         for q in kwargs.get("q_lens", (1,)) if q > 1}
                kwargs["q_ladders"] = {q: lad for q, lad in found.items() if lad is not None}
        return cls(forward, spec=spec, batch_sizes=batch_sizes, sm_scale=sm_scale,
                   backend=backend,
                   ladder=policy_ladder(policy, max_model_len, ladder, spec=spec),
                   max_model_len=max_model_len, **kwargs)

    @classmethod
    def for_model(cls, model, *, max_model_len: int, batch_sizes: list[int],
                  policy: Policy = "ladder", **kwargs) -> GraphBucketRunner:
        """A runner for a model with ``config`` (an ``MLAConfig``), ``buffer_spec`` and
        ``decode_backend``, such as ``graphbucket.models.MLADecoder``: spec and sm_scale
        come from the model, the backend from ``model.decode_backend(max_model_len)``
        unless passed here, and the ladder policy's default ladder from that backend
        (``SparseMLADecoder``: ``SparseBackend``, ``sparse_ladder``)."""
        if kwargs.get("backend") is None:
            kwargs["backend"] = model.decode_backend(max_model_len)
        return cls.for_policy(policy, model, spec=model.buffer_spec(max_model_len),
                              batch_sizes=batch_sizes, max_model_len=max_model_len,
                              sm_scale=model.config.sm_scale, **kwargs)

    def _workspace_plans(self) -> list[Plan]:
        if self.graphs is not None:
            return list(self.graphs.plans.values())
        return self._eager_plans(self.selector.max_batch_size)

    def _eager_plans(self, max_batch_size: int) -> list[Plan]:
        # Eager steps plan from live lengths: cover every batch size and q_len at the
        # longest hint (plans are monotone in the hint).
        return [self.backend.plan(b, self.spec.num_heads * q, self.max_model_len)
                for b in range(1, max_batch_size + 1) for q in self.selector.q_lens]

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return self.selector.capture_sizes

    @property
    def q_lens(self) -> tuple[int, ...]:
        return self.selector.q_lens

    @property
    def is_eager(self) -> bool:
        return self.graphs is None

    @property
    def records(self) -> list[GraphRecord]:
        """Per-graph records (keys served, plan, pool bytes, seconds); empty when eager."""
        return [] if self.graphs is None else list(self.graphs.records)

    def plan_for(self, key: GraphKey) -> Plan:
        """The plan the graph serving ``key`` was (or will be) captured with."""
        if self.graphs is None:
            raise ValueError("an eager runner captures no graphs; it plans every step")
        return self.graphs.plans[key]

    def capture(self) -> CaptureSummary | None:
        """Warm up and capture every graph (no-op returning None in eager mode)."""
        self._check_open()
        if self.graphs is None:
            return None
        return self.graphs.capture(self.forward, self.buffers, sm_scale=self.sm_scale,
                                   warmup_iters=self.warmup_iters, progress=self.progress)

    def step(self, batch: DecodeBatch) -> torch.Tensor:
        """One decode step -> output [B x q_len, *output_shape], a view of the static output
        (one row per query token: token j of request b at row b x q_len + j).

        Raises TypeError/ValueError before staging anything for a bad batch (length above
        max_model_len, block table outside the cache, wrong dtype/device/shape, a q_len
        not captured, a live length below q_len). Consume the result (copy or use) before
        the next step: the next replay overwrites it. A step may be issued while earlier
        ones still run on the GPU (it waits only for a staging slot the GPU still reads);
        then consume each output on the stream before issuing the next step.
        """
        if self._closed:  # _check_open(), without a call (each costs on cold caches)
            self._check_open()
        if self.graphs is not None and self.graphs.summary is None:
            raise RuntimeError("call capture() before step() (or build an eager runner)")
        try:
            host = self._validate(batch)
            key = self.selector.key_for(host.batch_size, host.min_len, host.max_len,
                                        host.lengths, host.q_len)
            eager = self.graphs is None or key is None
            buffers = self._buffers_for(host.batch_size) if eager else self.buffers
            # A graph copies its staging slot itself, unless device inputs must land after
            # that copy (their copies are enqueued here).
            in_graph = not eager and self.graphs.copy_in_graph and not host.device_inputs
            slot = buffers.stage(host, host.batch_size if eager else key.batch_size,
                                 in_graph=in_graph)
        except (TypeError, ValueError):
            self._errors += 1
            raise
        self._steps += 1
        if self.graphs is None:
            self._eager_steps += 1
            return self._run_eager(host, buffers)
        if key is None:
            return self._fallback(host, buffers)
        self.graphs.replay(key, slot if in_graph else None)
        self._replays[key] += 1
        return self._outputs[host.batch_size * host.q_len]

    def stats(self) -> RunnerStats:
        waits = self.buffers.staging_waits + (self._overflow.staging_waits
                                              if self._overflow is not None else 0)
        return RunnerStats(steps=self._steps, replays=dict(self._replays),
                           eager_steps=self._eager_steps, eager_fallbacks=self._fallbacks,
                           errors=self._errors, staging_waits=waits)

    # ---- eager path ---------------------------------------------------------------------

    def _fallback(self, host: CheckedBatch, buffers: StaticBuffers) -> torch.Tensor:
        self._fallbacks += 1
        if not self._warned:
            self._warned = True
            logger.warning(
                "graphbucket: batch of %d requests exceeds the largest capture size %d; "
                "running it eagerly (slow path; logged once, counted in "
                "stats().eager_fallbacks). Capture a larger batch size to avoid it.",
                host.batch_size, self.selector.max_batch_size)
        return self._run_eager(host, buffers)

    def _run_eager(self, host: CheckedBatch, buffers: StaticBuffers) -> torch.Tensor:
        """The forward without graphs on staged ``buffers``, planned from the batch's
        longest host length."""
        bs, q_len = host.batch_size, host.q_len
        plan = self.backend.plan(bs, self.spec.num_heads * q_len, max(1, host.max_len))
        out = buffers.output[:bs * q_len]
        buffers.apply_table_changes()  # as every graph body does first
        ctx = buffers.context(bs, plan, self.backend, self.sm_scale, q_len=q_len)
        ctx.begin_step()
        result = self.forward(ctx)
        if result.data_ptr() != out.data_ptr():
            out.copy_(result)
        return out

    def _buffers_for(self, bs: int) -> StaticBuffers:
        """The static buffers, or for a batch above their capacity overflow buffers (never
        the graphs' addresses), allocated on first need at a power-of-two capacity."""
        if bs <= self.buffers.max_batch_size:
            return self.buffers
        if self._overflow is None or self._overflow.max_batch_size < bs:
            capacity = 1 << (bs - 1).bit_length()
            if self._overflow is not None:
                self._overflow.close()
            self._overflow = StaticBuffers.allocate(
                self.spec, max_batch_size=capacity, max_q_len=self.selector.max_q_len,
                workspace=self.backend.workspace_spec(self._eager_plans(capacity)))
        return self._overflow

    # ---- lifetime -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this runner was closed; build a new one")

    def close(self) -> None:
        """Release graphs, then the pool, then every buffer. The runner is unusable after."""
        if self._closed:
            return
        self._closed = True
        if self.graphs is not None:
            self.graphs.close()
        if self._overflow is not None:
            self._overflow.close()
        self._outputs.clear()
        self.buffers.close()

    def __enter__(self) -> GraphBucketRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _default_backend(spec: BufferSpec, kv_lora_rank: int, qk_rope_dim: int) -> DecodeBackend:
    return get_backend("triton", kv_lora_rank=kv_lora_rank, qk_rope_dim=qk_rope_dim,
                       device=spec.device)
