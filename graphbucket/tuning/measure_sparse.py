"""GPU timing of one sparse decode layer (DeepSeek-V3.2) for the ladder tuner (CUDA only).

The timed call is the attention of ``SparseMLADecoder.forward``: ``SparseBackend.run_sparse``
(verify steps flattened to one row per token), which runs the indexer's logits over the fp8
index-key cache, the top-k and the sparse attention with its merge
(``graphbucket.sparse.decode.sparse_mla_decode``). As ``graphbucket.tuning.measure`` does
for split-KV plans, one graph holds R such calls, each over its own random scatter of pages
of one large latent cache and one index cache paged alike, with R chosen so that a replay
touches several L2s of distinct bytes; the time per call is the replay time over R.

Importing this module needs torch but no GPU; every function that runs needs CUDA.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from graphbucket import fp8
from graphbucket.kernels import default_sm_scale
from graphbucket.plan import cdiv
from graphbucket.sparse.backend import SparseBackend
from graphbucket.sparse.decode import SparseWorkspace
from graphbucket.sparse.index_cache import INDEX_DIM, quantize_index_keys
from graphbucket.sparse.plan import INDEX_HEADS, SparsePlan
from graphbucket.tuning.measure import (
    COMPILE_S,
    EST_GBPS,
    HOST_S_PER_MEASUREMENT,
    KV_LORA_RANK,
    L2_FLUSH_BYTES,
    MAX_ROTATIONS,
    PAGE_SIZE,
    QK_DIM,
    SAMPLE_MS,
    TUNE_REPS,
    Problem,
    check_pages,
    time_replays_paired,
    warm_gpu,
)

INDEX_ROW_BYTES = INDEX_DIM + 4  # an e4m3 key and its float32 scale per token
# The indexer writes one float32 logit per token and the top-k reads it at least once.
LOGIT_BYTES = 2 * 4
# Cost model for --dry-run: the layer's nine launches (indexer, six top-k passes,
# attention, merge) cost about this much beside the bytes they move (H200: 46 us at 128K
# for one row, of which the bytes are 6 us; bench/results/h200-sparse.md).
SPARSE_FIXED_US = 30.0
SUPPORTED_CACHES = ("bf16", "fp8-v32")  # the latent caches sparse decode reads


def sparse_bytes(lens: Iterable[int], num_heads: int, *, topk: int, q_len: int = 1,
                 kv_cache: str = "bf16") -> int:
    """Bytes one sparse decode step moves for requests of ``lens`` (each with ``q_len``
    query tokens): index keys and logits over every live token, the latent rows of at most
    ``topk`` positions per token, and q, index q, head weights and out (bf16)."""
    latent = fp8.row_bytes(kv_cache, QK_DIM, torch.bfloat16)
    per_row = num_heads * (QK_DIM + KV_LORA_RANK) * 2 + INDEX_HEADS * (INDEX_DIM * 2 + 4)
    return sum(q_len * (n * (INDEX_ROW_BYTES + LOGIT_BYTES) + min(n, topk) * latent + per_row)
               for n in lens)


def rotations_for(step_bytes: int, pages_per_call: int, num_pages: int) -> int:
    """Calls one timing graph holds: enough distinct bytes to evict the L2, as many as the
    cache's pages allow, at most MAX_ROTATIONS."""
    return max(1, min(MAX_ROTATIONS, L2_FLUSH_BYTES // max(1, step_bytes),
                      num_pages // max(1, pages_per_call)))


def estimate_sparse_seconds(shapes: Iterable[tuple[int, int, int]], num_heads: int, *,
                            topk: int, num_pages: int, q_len: int = 1,
                            kv_cache: str = "bf16", compiles: int = 0) -> float:
    """Estimated GPU seconds to time ``(context, batch, plans)`` shapes as
    ``SparsePlanTimer`` does: per plan, 3 unrounded replays (warm-up, capture, probe) and
    TUNE_REPS samples of at least SAMPLE_MS."""
    total = compiles * COMPILE_S
    for context, batch, plans in shapes:
        step = sparse_bytes([context] * batch, num_heads, topk=topk, q_len=q_len,
                            kv_cache=kv_cache)
        call_ms = (SPARSE_FIXED_US + step / (EST_GBPS * 1e3)) / 1e3
        replay_ms = rotations_for(step, batch * cdiv(context, PAGE_SIZE), num_pages) * call_ms
        per_sample = max(1, min(200, int(SAMPLE_MS / replay_ms))) * replay_ms
        total += plans * (HOST_S_PER_MEASUREMENT + (3 * replay_ms + TUNE_REPS * per_sample)
                          / 1e3)
    return total


class SparseCaches:
    """A latent cache of N(0, 1) rows in ``kv_cache``'s format and an fp8 index cache of
    N(0, 1) keys with their scales, paged alike (one block table reads both)."""

    def __init__(self, max_tokens: int, kv_cache: str = "bf16", *,
                 max_requests: int = 1) -> None:
        if kv_cache not in SUPPORTED_CACHES:
            raise ValueError(f"sparse decode reads a {' or '.join(SUPPORTED_CACHES)} latent "
                             f"cache, got {kv_cache!r}; time another format with the dense "
                             "tuner (no --sparse)")
        latent = Problem(max_tokens, kv_cache=kv_cache, max_requests=max_requests)
        self.num_pages, self.latent = latent.num_pages, latent.cache
        self.index = torch.empty(self.num_pages, PAGE_SIZE, INDEX_DIM, dtype=fp8.FP8_DTYPE,
                                 device="cuda")
        self.scales = torch.empty(self.num_pages, PAGE_SIZE, device="cuda")
        for i in range(0, self.num_pages, 1024):  # float32 keys in chunks of 64K tokens
            n = min(1024, self.num_pages - i)
            self.index[i:i + n], self.scales[i:i + n] = quantize_index_keys(
                torch.randn(n, PAGE_SIZE, INDEX_DIM, device="cuda"))


class SparsePlanTimer:
    """Times sparse plans at uniform (context, batch) shapes (``time``) and at ragged
    lengths (``time_lens``), over one pair of caches for ``max_tokens`` tokens (default
    ``max_len x max_batch``) and one workspace (logits rows ``max_len`` wide, attention
    partials for ``max_splits`` splits). CUDA only."""

    def __init__(self, max_len: int, max_batch: int, num_heads: int, *, topk: int,
                 q_len: int = 1, kv_cache: str = "bf16", max_splits: int = 1,
                 max_tokens: int | None = None, seed: int = 0) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("SparsePlanTimer times CUDA-graph replays and needs a CUDA "
                               "GPU; choose from a saved table instead (tune_ladder.py "
                               "--from-times)")
        torch.manual_seed(seed)
        self.num_heads, self.topk, self.q_len, self.kv_cache = num_heads, topk, q_len, kv_cache
        self.caches = SparseCaches(max_tokens or max_len * max_batch, kv_cache,
                                   max_requests=max_batch)
        self.backend = SparseBackend(num_heads=num_heads, max_len=max_len, topk=topk)
        self.workspace = SparseWorkspace.allocate(max_batch * q_len, num_heads, max_len,
                                                  topk=topk, max_splits=max(1, max_splits),
                                                  device="cuda")
        self.scale = default_sm_scale()
        warm_gpu()

    def time(self, context: int, batch: int, plans: Mapping[str, SparsePlan]
             ) -> dict[str, float]:
        """``{label: us per call}`` of each plan at ``batch`` requests of ``context``."""
        return self.time_lens([context] * batch, plans)

    def time_lens(self, lens: list[int], plans: Mapping[str, SparsePlan],
                  reps: int | None = None) -> dict[str, float]:
        """``{label: us per call}`` of each plan over requests of lengths ``lens`` (``reps``
        samples each, default the tuner's)."""
        inputs = self._inputs(lens)
        return time_replays_paired({label: self._calls(inputs, plan)
                                    for label, plan in plans.items()},
                                   calls_per_graph=len(inputs), reps=reps or TUNE_REPS,
                                   min_ms=SAMPLE_MS)

    def _inputs(self, lens: list[int]) -> list[dict[str, torch.Tensor]]:
        """One call's tensors per rotation, each rotation over pages no other one reads
        (the rest of a table row page 0, never read)."""
        pages = [cdiv(n, PAGE_SIZE) for n in lens]
        step = sparse_bytes(lens, self.num_heads, topk=self.topk, q_len=self.q_len,
                            kv_cache=self.kv_cache)
        check_pages(sum(pages), self.caches.num_pages)
        rotations = rotations_for(step, sum(pages), self.caches.num_pages)
        perm = torch.randperm(self.caches.num_pages, device="cuda")[: rotations * sum(pages)]
        rows, heads = len(lens) * self.q_len, self.num_heads
        seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        calls = []
        for chunk in perm.int().split(sum(pages)):
            table = torch.zeros(len(lens), max(pages), dtype=torch.int32, device="cuda")
            for b, row in enumerate(chunk.split(pages)):
                table[b, :row.numel()] = row
            calls.append({
                "q": torch.randn(rows, heads, QK_DIM, device="cuda").to(torch.bfloat16),
                "index_q": torch.randn(rows, INDEX_HEADS, INDEX_DIM,
                                       device="cuda").to(torch.bfloat16),
                "index_weights": torch.randn(rows, INDEX_HEADS, device="cuda") / 8,
                "block_table": table, "seq_lens": seq_lens,
                "out": torch.empty(rows, heads, KV_LORA_RANK, dtype=torch.bfloat16,
                                   device="cuda")})
        return calls

    def _calls(self, inputs: list[dict[str, torch.Tensor]], plan: SparsePlan):
        """What one graph replay runs: the layer's sparse attention once per rotation."""
        caches, run = self.caches, self.backend.run_sparse

        def call() -> None:
            for c in inputs:
                run(c["q"], caches.latent, c["index_q"], c["index_weights"], caches.index,
                    caches.scales, c["block_table"], c["seq_lens"], c["out"], self.workspace,
                    plan=plan, sm_scale=self.scale, q_len=self.q_len)
        return call
