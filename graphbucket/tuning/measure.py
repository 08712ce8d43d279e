"""GPU timing of the MLA decode kernel: CUDA-graph replays over a cold L2 (CUDA only).

One graph holds R decode calls, each over its own random scatter of pages of one large
cache, with R chosen so that a replay touches several L2s worth of distinct KV; the time
per call is the replay time over R. Used by the ladder tuner (``graphbucket.tuning.choose``) and
the kernel sweep (``bench/kernel_sweep.py``). The cache is built in the format being tuned
(``graphbucket.fp8``: "bf16", "fp8-tensor" or "fp8-v32"), so an fp8 ladder is chosen from
the fp8 kernels' times.

Importing this module needs torch but no GPU; every function that runs needs CUDA.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from graphbucket import fp8
from graphbucket.kernels import SplitWorkspace, default_sm_scale, mla_decode
from graphbucket.plan import LaunchPlan, cdiv, plan_mla_decode

L2_FLUSH_BYTES = 4 * 60 * 1024 * 1024  # four H200 L2s: enough distinct bytes to evict it
MAX_ROTATIONS = 32
PAGE_SIZE, QK_DIM, KV_LORA_RANK = 64, 576, 512


# fp8-tensor caches hold N(0, 1) rows with this per-tensor scale (amax 8, as bench/tpot.py).
FP8_TENSOR_SCALE = 8.0 / fp8.FP8_MAX


def kv_bytes(context: int, batch: int, num_heads: int = 16, kv_cache: str = "bf16") -> int:
    """Bytes one decode call must move: the KV rows (in the cache format) plus q and out
    (bf16)."""
    q_and_out = batch * num_heads * (QK_DIM + KV_LORA_RANK) * 2
    return batch * context * fp8.row_bytes(kv_cache, QK_DIM, torch.bfloat16) + q_and_out


def warm_gpu(seconds: float = 1.0) -> None:
    """Bring clocks up from idle before measuring (idle SM clocks sit near 345 MHz)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(20):
            a @ a
        stop.record()
        stop.synchronize()
        if start.elapsed_time(stop) > seconds * 1e3:
            return


def time_replays(fn: Callable[[], None], *, calls_per_graph: int, reps: int = 7,
                 min_ms: float = 20.0) -> float:
    """Median microseconds per call of ``fn`` (one graph holds ``calls_per_graph`` calls).

    ``fn`` must itself issue ``calls_per_graph`` calls over distinct inputs so that
    consecutive calls find a cold L2 when the inputs are large enough.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    stop.record()
    stop.synchronize()
    one_ms = max(start.elapsed_time(stop), 1e-3)
    replays = max(1, min(200, int(min_ms / one_ms)))
    samples = []
    for _ in range(reps):
        start.record()
        for _ in range(replays):
            graph.replay()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) * 1e3 / (replays * calls_per_graph))
    del graph
    return statistics.median(samples)


class Problem:
    """One cache of N(0, 1) rows in ``kv_cache``'s format, large enough for the biggest
    shape; R rotations of scattered tables."""

    def __init__(self, max_tokens: int, num_heads: int = 16, kv_cache: str = "bf16"):
        self.num_heads, self.kv_cache = num_heads, fp8.check_format(kv_cache)
        self.num_pages = cdiv(max_tokens, PAGE_SIZE)
        width, dtype = fp8.cache_row(kv_cache, QK_DIM, torch.bfloat16)
        self.cache = torch.empty(self.num_pages, PAGE_SIZE, width, dtype=dtype, device="cuda")
        self.kv_scale = None
        if kv_cache == "bf16":
            self.cache.normal_()
            return
        if kv_cache == "fp8-tensor":
            self.kv_scale = torch.tensor([FP8_TENSOR_SCALE], device="cuda")
        for i in range(0, self.num_pages, 1024):  # float32 rows in chunks of 64K tokens
            rows = torch.randn(min(1024, self.num_pages - i), PAGE_SIZE, QK_DIM, device="cuda")
            self.cache[i:i + 1024] = fp8.pack_v32(rows) if kv_cache == "fp8-v32" else \
                fp8.quantize(rows, self.kv_scale)

    def inputs(self, context: int, batch: int):
        """(block tables [R, batch, pages], q [R, batch, H, 576], out [R, batch, H, 512],
        seq_lens [batch]) for R rotations, each over pages no other rotation reads."""
        pages_per_req = cdiv(context, PAGE_SIZE)
        per_call = max(1, batch * pages_per_req)
        rotations = max(1, min(MAX_ROTATIONS,
                               L2_FLUSH_BYTES // kv_bytes(context, batch, self.num_heads,
                                                          self.kv_cache),
                               self.num_pages // per_call))
        perm = torch.randperm(self.num_pages, device="cuda", dtype=torch.int64)
        tables = perm[: rotations * per_call].to(torch.int32).view(rotations, batch,
                                                                   pages_per_req)
        heads = self.num_heads
        q = torch.randn(rotations, batch, heads, QK_DIM, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(rotations, batch, heads, KV_LORA_RANK, dtype=torch.bfloat16,
                          device="cuda")
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        return tables.contiguous(), q, out, seq_lens


def rotated_calls(problem: Problem, tables, q, out, seq_lens, ws: SplitWorkspace | None,
                  plan: LaunchPlan, scale: float) -> Callable[[], None]:
    """One decode call per rotation, each over its own pages: what one graph replay runs."""
    def call():
        for r in range(tables.shape[0]):
            mla_decode(q[r], problem.cache, tables[r], seq_lens, out[r], ws, plan=plan,
                       sm_scale=scale, kv_scale=problem.kv_scale, check=False)
    return call


def measure_split_times(contexts: Iterable[int], batches: Iterable[int],
                        splits_list: Sequence[int] | Mapping[int, Sequence[int]],
                        num_heads: int, *, progress: bool = True, seed: int = 0,
                        kv_cache: str = "bf16") -> dict[tuple[int, int, int], float]:
    """``{(context, batch, splits): us}``: the Triton MLA decode kernel, cold L2, graph replays.

    ``splits_list`` is one list for every batch or ``{batch: splits}`` (see
    ``graphbucket.tuning.choose.splits_to_measure``). Each shape runs the plan of
    ``plan_mla_decode(batch, num_heads, context)`` on this GPU with its split count replaced
    (``LaunchPlan.with_splits``: the merge tile follows the split count), so block sizes,
    pipeline depth and merge variant are the ones the runner captures. ``kv_cache``: the
    cache format timed (``graphbucket.fp8``).
    Prints one progress line per measurement unless ``progress`` is False. CUDA only.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("measure_split_times times CUDA-graph replays and needs a CUDA GPU; "
                           "choose from a saved table instead (tune_ladder.py --from-times)")
    contexts, batches = sorted(set(contexts)), sorted(set(batches))
    per_batch = {b: sorted(set(splits_list[b] if isinstance(splits_list, Mapping)
                               else splits_list)) for b in batches}
    num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    torch.manual_seed(seed)
    problem = Problem(contexts[-1] * batches[-1], num_heads, kv_cache)
    max_splits = max(max(s) for s in per_batch.values())
    ws = SplitWorkspace.allocate(batches[-1], num_heads, max_splits, KV_LORA_RANK, "cuda")
    scale, times = default_sm_scale(), {}
    total = len(contexts) * sum(len(s) for s in per_batch.values())
    warm_gpu()
    start = time.perf_counter()
    for context in contexts:
        for batch in batches:
            tables, q, out, seq_lens = problem.inputs(context, batch)
            base = plan_mla_decode(batch, num_heads, context, num_sms=num_sms)
            for splits in per_batch[batch]:
                plan = base.with_splits(splits)
                call = rotated_calls(problem, tables, q, out, seq_lens, ws, plan, scale)
                us = time_replays(call, calls_per_graph=tables.shape[0])
                times[(context, batch, splits)] = us
                if progress:
                    print(f"[{len(times)}/{total}] ctx={context} b={batch} splits={splits} "
                          f"{us:.2f} us ({time.perf_counter() - start:.0f} s)", flush=True)
    return times
