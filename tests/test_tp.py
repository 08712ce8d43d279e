"""Tensor parallelism on CPU: sharding, and multi-process decode over gloo.

Multi-process tests spawn one process per rank (gloo, Triton interpreter) and join them
against a deadline, so a hang (ranks waiting in different collectives) fails the test
instead of blocking CI. Ranks rendezvous through a FileStore in the test's tmp_path:
no TCP port to pick, so parallel runs never collide (gloo's own connections take
OS-assigned ports). Each rank's assertions run in its process; a failure comes back as
the rank's traceback.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphbucket.backends import get_backend
from graphbucket.batch import DecodeBatch
from graphbucket.distributed import (
    EAGER_BUCKET,
    KeyCheckedRunner,
    KeyMismatchError,
    capture_all,
    check_same_key,
    step_key,
    tp_session,
    with_key_check,
)
from graphbucket.graphs import GraphTable
from graphbucket.ladder import Bucket, BucketLadder
from graphbucket.models import (
    MLADecoder,
    TPMLADecoder,
    decode_batch,
    prefill_random,
    random_block_table,
    shard_config,
    shard_weights,
    tiny,
    tp_full_config,
)
from graphbucket.runner import GraphBucketRunner
from graphbucket.select import GraphKey, GraphSelector

PAGE, MAX_LEN, NUM_SMS = 16, 256, 16
# bs 1 and 2: one split below 32 tokens, four splits (stage 2) up to 256; bs 4 aliases.
LADDER = BucketLadder([Bucket(32, 1), Bucket(MAX_LEN, MAX_LEN)], MAX_LEN)
DEADLINE_S = 120.0
ROOT = Path(__file__).resolve().parents[1]
# Decode steps with growing lengths: bucket 0, across pages, into bucket 1, then one
# request alone (padded to the captured batch of 2: its padding row rides the all-reduces).
STEPS = [[20, 9], [21, 10], [40, 31], [41, 130], [42]]


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def make_runner(policy: str, model: MLADecoder, *, batch_sizes=(1, 2)) -> GraphBucketRunner:
    cfg = model.config
    backend = get_backend("triton", num_sms=NUM_SMS, kv_lora_rank=cfg.kv_lora_rank,
                          qk_rope_dim=cfg.qk_rope_dim)
    return GraphBucketRunner.for_policy(
        policy, model, spec=model.buffer_spec(MAX_LEN), batch_sizes=list(batch_sizes),
        max_model_len=MAX_LEN, sm_scale=cfg.sm_scale, backend=backend,
        ladder=LADDER if policy == "ladder" else None, progress=False)


def session(rank: int, world_size: int, tmp: str, name: str):
    torch.set_num_threads(1)  # several ranks share two cores
    return tp_session(backend="gloo", rank=rank, world_size=world_size,
                      init_method=f"file://{tmp}/{name}.store",
                      timeout=datetime.timedelta(seconds=DEADLINE_S))


def run_ranks(fn, world_size: int, tmp_path) -> None:
    """Run ``fn(rank, world_size, tmp)`` in one spawned process per rank, with a deadline."""
    ctx = mp.start_processes(fn, args=(world_size, str(tmp_path)), nprocs=world_size,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"{fn.__name__}: ranks still running after {DEADLINE_S:.0f} s "
                            "(a hang: ranks waiting in different collectives?)")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join()


def hidden_for(rng: np.random.Generator, batch: int, cfg) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal((batch, cfg.hidden_size))).float()


# ---- sharding (one process) --------------------------------------------------------------


def test_shard_config_splits_heads_and_mlp_columns():
    per_rank = shard_config(tiny(), 4)
    assert (per_rank.num_heads, per_rank.intermediate_size) == (2, 24)
    assert (per_rank.kv_dim, per_rank.q_lora_rank) == (tiny().kv_dim, tiny().q_lora_rank)
    full = tp_full_config(per_rank, 4)
    assert (full.num_heads, full.intermediate_size) == (8, 96)
    with pytest.raises(ValueError, match="num_heads=8 does not split over world_size=3"):
        shard_config(tiny(), 3)
    with pytest.raises(ValueError, match="rank=2 is outside"):
        TPMLADecoder(tiny(), rank=2, world_size=2, num_pages=4, page_size=PAGE, device="cpu")


@pytest.mark.parametrize("world_size", [2, 4])
def test_shards_reassemble_the_unsharded_weights(world_size):
    cfg = tiny(num_layers=1)
    full = MLADecoder(cfg, num_pages=4, page_size=PAGE, dtype=torch.float32, device="cpu")
    shards = [shard_weights(full.layers, r, world_size)[0] for r in range(world_size)]
    layer, inter = full.layers[0], cfg.intermediate_size
    cat = lambda name, dim: torch.cat([getattr(s, name) for s in shards], dim=dim)
    assert torch.equal(cat("w_q_b", 0), layer.w_q_b)          # rows are head-major
    assert torch.equal(cat("w_uk", 0), layer.w_uk)
    assert torch.equal(cat("w_uv", 0), layer.w_uv)
    assert torch.equal(cat("w_o", 1), layer.w_o)              # columns are head-major
    assert torch.equal(cat("w_down", 1), layer.w_down)
    gates = torch.cat([s.w_gate_up[: inter // world_size] for s in shards])
    ups = torch.cat([s.w_gate_up[inter // world_size:] for s in shards])
    assert torch.equal(torch.cat([gates, ups]), layer.w_gate_up)
    for name in ("attn_norm", "w_qkv_a", "q_a_norm", "kv_a_norm", "mlp_norm"):
        assert all(torch.equal(getattr(s, name), getattr(layer, name)) for s in shards), name
    assert all(s.w_o.untyped_storage().data_ptr() != layer.w_o.untyped_storage().data_ptr()
               for s in shards)                               # shards own their memory


@pytest.mark.interpreter
def test_one_rank_is_the_unsharded_model():
    full = MLADecoder(tiny(num_layers=1), num_pages=8, page_size=PAGE, dtype=torch.float32,
                      device="cpu", seed=3)
    tp = TPMLADecoder(tiny(num_layers=1), rank=0, world_size=1, num_pages=8, page_size=PAGE,
                      dtype=torch.float32, device="cpu", seed=3)
    table = random_block_table(1, 4, 8, np.random.default_rng(0))
    prefill_random(full, table, [40])
    prefill_random(tp, table, [40])
    batch = decode_batch(full, [40], table, torch.randn(1, 64))
    want, got = make_runner("eager", full), make_runner("eager", tp)
    assert torch.equal(got.step(batch), want.step(batch))
    with pytest.raises(NotImplementedError, match="unsharded MLADecoder"):
        tp.forward_reference(None)
    want.close()
    got.close()


def test_capture_order_is_largest_batch_first_with_equal_plans_once():
    backend = get_backend("triton", num_sms=NUM_SMS, kv_lora_rank=64, qk_rope_dim=16)
    # A top hint of 4 short tiles: one split at batch 4 (both buckets alias), two below.
    ladder = BucketLadder([Bucket(32, 1), Bucket(MAX_LEN, 128)], MAX_LEN)
    table = GraphTable(GraphSelector(ladder, [2, 4, 1]), backend, num_heads=4)
    order = table.capture_order()
    assert [bs for bs, _ in order] == [4, 2, 2, 1, 1]           # bs 4's buckets alias
    assert order[1][1] == table.plans[table.selector.key(2, 0)]
    assert order[2][1] == table.plans[table.selector.key(2, 1)]
    # Ranks that list their batch sizes differently still capture in the same order.
    again = GraphTable(GraphSelector(ladder, [1, 2, 4]), backend, num_heads=4)
    assert again.capture_order() == order


def test_the_key_check_is_off_by_default(monkeypatch):
    runner = make_runner("eager", MLADecoder(tiny(1), num_pages=4, page_size=PAGE,
                                             dtype=torch.float32, device="cpu"))
    monkeypatch.delenv("GRAPHBUCKET_CHECK_KEYS", raising=False)
    assert with_key_check(runner, group=None) is runner    # no group made, no collective
    assert step_key(runner, [5, 9]) is None                  # an eager runner replays nothing
    with pytest.raises(ValueError, match="above the ladder top"):
        step_key(runner, [5, MAX_LEN + 1])                   # but still rejects what step would
    runner.close()


# ---- (a) sharded numerics across ranks ----------------------------------------------------


def _numerics_rank(rank: int, world_size: int, tmp: str) -> None:
    with session(rank, world_size, tmp, "numerics") as s:
        cfg = tiny(num_layers=2)
        full = MLADecoder(cfg, num_pages=32, page_size=PAGE, dtype=torch.float32,
                          device="cpu", seed=7)
        rng = np.random.default_rng(0)  # every rank draws the same host inputs
        table = random_block_table(2, MAX_LEN // PAGE, full.num_pages, rng)
        prefill_random(full, table, [19, 8], seed=1)
        shards = [TPMLADecoder.from_full(full, rank=rank, world_size=world_size)
                  for _ in range(2)]
        reference = s.register(make_runner("eager", full))
        graphs = s.register(make_runner("ladder", shards[0], batch_sizes=(2,)))
        eager = s.register(make_runner("eager", shards[1]))
        capture_all([graphs], group=s.cpu_group)
        assert [(r.batch_size, r.plan) for r in graphs.records] == \
            graphs.graphs.capture_order()
        splits = [graphs.plan_for(graphs.selector.key(2, b)).num_kv_splits
                  for b in range(len(LADDER))]
        assert splits[0] == 1 < splits[1], splits  # frozen one-split and split + merge graphs
        for lens in STEPS:
            batch = decode_batch(full, lens, table[: len(lens)], hidden_for(rng, len(lens), cfg))
            want = reference.step(batch).clone()
            for name, runner in (("graphs", graphs), ("eager", eager)):
                got = runner.step(batch).clone()
                err = rel_l2(got, want)
                assert err < 1e-4, f"rank {rank} {name} lens={lens}: rel L2 {err:.2e}"
            outs = [torch.empty_like(got) for _ in range(world_size)]
            dist.all_gather(outs, got)
            assert all(torch.equal(o, outs[0]) for o in outs), "ranks hold different sums"
        replays = {(k.batch_size, k.bucket): n for k, n in graphs.stats().replays.items()}
        assert replays == {(2, 0): 2, (2, 1): 3}
        for shard in shards:  # the replicated latent cache: every rank wrote the same rows
            for mine, ref in zip(shard.kv_caches, full.kv_caches, strict=True):
                assert rel_l2(mine, ref) < 1e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_decode_matches_the_unsharded_model(world_size, tmp_path):
    run_ranks(_numerics_rank, world_size, tmp_path)


# ---- (b) every rank selects the same key -------------------------------------------------


def _replayed(runner, before: Counter) -> GraphKey | None:
    """The graph key the last step replayed, from the runner's counters (None: eager)."""
    diff = Counter(runner.stats().replays) - before
    assert len(diff) <= 1, diff
    return next(iter(diff), None)


def _random_steps(rng: np.random.Generator, n: int) -> list[list[int]]:
    steps = []
    for _ in range(n):
        bs = int(rng.integers(1, 6))                  # 5 > the largest capture size: eager
        top = 32 if rng.random() < 0.4 else MAX_LEN
        steps.append(rng.integers(1, top + 1, size=bs).tolist())
    return steps


def _keys_rank(rank: int, world_size: int, tmp: str) -> None:
    with session(rank, world_size, tmp, "keys") as s:
        cfg = tiny(num_layers=1)
        model = TPMLADecoder(cfg, rank=rank, world_size=world_size, num_pages=96,
                             page_size=PAGE, dtype=torch.float32, device="cpu")
        runner = s.register(with_key_check(make_runner("ladder", model, batch_sizes=(1, 2, 4)),
                                           s.cpu_group, enabled=True))
        assert isinstance(runner, KeyCheckedRunner)
        capture_all([runner], group=s.cpu_group)
        table = random_block_table(5, MAX_LEN // PAGE, model.num_pages,
                                   np.random.default_rng(0))
        steps = [_random_steps(np.random.default_rng(11), 10) if rank == 0 else None]
        dist.broadcast_object_list(steps, src=0, group=s.cpu_group)  # the scheduler output

        def batch(lens):
            hidden = torch.ones(len(lens), cfg.hidden_size)
            return decode_batch(model, lens, table[: len(lens)], hidden)

        keys = []
        for lens in steps[0]:
            before = Counter(runner.stats().replays)
            runner.step(batch(lens))
            predicted = step_key(runner.runner, lens)
            assert _replayed(runner, before) == predicted, lens
            keys.append(predicted)
        every = [None] * world_size
        dist.all_gather_object(every, keys, group=s.cpu_group)
        assert all(k == keys for k in every), every
        assert len(set(keys)) >= 4 and runner.stats().eager_fallbacks >= 1, keys

        done = runner.stats().steps
        with_raises(KeyMismatchError, lambda: runner.step(batch([20] if rank == 0 else [200])),
                    "rank 0: padded batch 1, bucket 0; rank 1: padded batch 1, bucket 1")
        with_raises(KeyMismatchError, lambda: runner.step(batch([20] if rank == 0 else [21])),
                    "different host lengths")
        bad = batch([20]) if rank == 0 else DecodeBatch([MAX_LEN + 1], table[:1])
        with_raises(ValueError if rank else KeyMismatchError, lambda: runner.step(bad),
                    "above the ladder top" if rank else "rank 1: no key")
        assert runner.stats().steps == done, "a rejected step must not replay anything"

        # An engine with its own graphs runs the same check on its GraphKey (or pair).
        check_same_key(step_key(runner.runner, [20, 9]), s.cpu_group, seq_lens_cpu=[20, 9])
        with_raises(KeyMismatchError, lambda: check_same_key(
            (5, EAGER_BUCKET) if rank == 0 else step_key(runner.runner, [20]), s.cpu_group),
            "rank 0: batch 5, eager; rank 1: padded batch 1, bucket 0")


def with_raises(exc_type: type, fn, match: str) -> None:
    try:
        fn()
    except exc_type as exc:
        assert match in str(exc), str(exc)
        return
    raise AssertionError(f"expected {exc_type.__name__} matching {match!r}")


@pytest.mark.interpreter
def test_every_rank_selects_the_same_key(tmp_path):
    run_ranks(_keys_rank, 2, tmp_path)


# ---- (c) runners close before the process group -----------------------------------------


class _Recorded:
    """Registers like a runner; logs whether the process group was alive at close()."""

    def __init__(self, runner: GraphBucketRunner, log: list) -> None:
        self.runner, self.log = runner, log

    def close(self) -> None:
        self.log.append(dist.is_initialized())
        self.runner.close()


def _close_rank(rank: int, world_size: int, tmp: str) -> None:
    model = TPMLADecoder(tiny(num_layers=1), rank=rank, world_size=world_size, num_pages=8,
                         page_size=PAGE, dtype=torch.float32, device="cpu")
    table = random_block_table(1, 2, 8, np.random.default_rng(0))
    batch = decode_batch(model, [20], table, torch.ones(1, 64))
    log: list[bool] = []
    with session(rank, world_size, tmp, "close") as s:
        graphs = make_runner("ladder", model)
        s.register(_Recorded(graphs, log))
        capture_all([graphs], group=s.cpu_group)
        graphs.step(batch)
    assert log == [True] and not dist.is_initialized()
    with_raises(RuntimeError, lambda: graphs.step(batch), "closed")

    class Boom(Exception):
        pass

    eager = make_runner("eager", model)
    try:  # an exception inside the session: runners still close first, the group goes
        with session(rank, world_size, tmp, "close-again") as s:
            s.register(_Recorded(eager, log))
            eager.step(batch)
            raise Boom
    except Boom:
        pass
    assert log == [True, True] and not dist.is_initialized()
    with_raises(RuntimeError, lambda: eager.step(batch), "closed")


@pytest.mark.interpreter
def test_session_closes_runners_before_the_process_group(tmp_path):
    run_ranks(_close_rank, 2, tmp_path)


# ---- the multi-GPU script's CPU path ------------------------------------------------------


@pytest.mark.interpreter
def test_tp_decode_script_cpu_smoke(tmp_path):
    """scripts/tp_decode.py --cpu: gloo ranks, numerics vs TP=1, both policies stepped."""
    cmd = [sys.executable, str(ROOT / "scripts" / "tp_decode.py"), "--cpu", "--world-size",
           "2", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE_S, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "cpu-tp2-tpot.json").read_text())
    assert max(result["numerics_rel_l2"].values()) < 1e-4
    splits = {(r["policy"], r["context"]): r["splits"] for r in result["rows"]}
    assert splits[("fixed-1", 200)] == 1 < splits[("ladder", 200)]
