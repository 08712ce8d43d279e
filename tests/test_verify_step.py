"""Verify steps end to end (MTP / speculative decoding, q_len tokens per request): the
model's step against its float64 reference and against q_len plain steps, the runner's
q_len graphs, and bad input rejected before anything is staged.

CPU tests run the tiny model through the interpreter in float32 (small: 2 layers, few
pages); GPU tests capture real CUDA graphs at q_len 1 and 2.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphbucket import DecodeBatch, GraphBucketRunner, fp8, get_backend
from graphbucket.context import DecodeContext
from graphbucket.ladder import Bucket, BucketLadder
from graphbucket.models import (
    MLADecoder,
    decode_batch,
    deepseek_v3_tp8,
    prefill_random,
    random_block_table,
    tiny,
    tiny_v32,
)
from graphbucket.models.ops import rope_cache, store_kv
from tests._toy import rel_l2

PAGE, PAGES = 16, 32


def tiny_model(**kw) -> MLADecoder:
    return MLADecoder(tiny(num_layers=2), num_pages=PAGES, page_size=PAGE,
                      dtype=torch.float32, device="cpu", **kw)


def token_positions(lens, q_len) -> np.ndarray:
    lens = np.asarray(lens, dtype=np.int64)
    pos = lens[:, None] - q_len + np.arange(q_len)
    return np.where(lens[:, None] > 0, pos, 0).reshape(-1)


def eager_context(model, batch: DecodeBatch, *, hint: int, num_sms: int = 16,
                  backend=None) -> DecodeContext:
    """A context over the batch's own tensors, planned with ``hint`` for q_len x heads."""
    cfg, q_len = model.config, batch.q_len
    backend = backend or get_backend("triton", kv_lora_rank=cfg.kv_lora_rank,
                                     qk_rope_dim=cfg.qk_rope_dim, num_sms=num_sms)
    lens = torch.as_tensor(np.asarray(batch.seq_lens_cpu), dtype=torch.int32)
    plan = backend.plan(lens.shape[0], cfg.num_heads * q_len, hint)
    return DecodeContext(
        batch_size=lens.shape[0], plan=plan, backend=backend, sm_scale=cfg.sm_scale,
        seq_lens=lens.to(model.device),
        block_table=torch.as_tensor(batch.block_table_cpu, device=model.device),
        positions=torch.from_numpy(token_positions(batch.seq_lens_cpu, q_len)).to(model.device),
        inputs={k: v.to(model.device) for k, v in batch.inputs.items()},
        workspace=backend.workspace_spec([plan]).allocate(model.device), q_len=q_len)


def reference(model, batch: DecodeBatch, caches) -> torch.Tensor:
    return model.forward_reference(
        batch.inputs["hidden"], positions=token_positions(batch.seq_lens_cpu, batch.q_len),
        seq_lens=batch.seq_lens_cpu, block_table=batch.block_table_cpu,
        slot_mapping=batch.inputs["slot_mapping"], caches=caches, q_len=batch.q_len)


def fresh_batch(model, lens, q_len, rng, *, pages=8):
    table = random_block_table(len(lens), pages, model.num_pages, rng)
    prefill_random(model, table, [pages * PAGE] * len(lens), seed=int(rng.integers(1 << 30)))
    hidden = torch.from_numpy(rng.standard_normal((len(lens) * q_len,
                                                   model.config.hidden_size))).to(model.dtype)
    return decode_batch(model, lens, table, hidden, q_len=q_len)


# ---- the model's verify step against float64 -------------------------------------------


def live_slots_only_changed(model, before, batch, q_len, lens) -> list[int]:
    """The cache rows of the batch's live tokens (q_len per request of nonzero length);
    asserts they, and no other row (padding included), changed in every layer's cache
    (compared as bytes, so any cache format)."""
    live = sorted(int(s) for s in batch.inputs["slot_mapping"] if s >= 0)
    assert len(live) == q_len * sum(1 for n in lens if n)
    for cache, old in zip(model.kv_caches, before, strict=True):
        width = cache.shape[-1]
        flat = cache.view(-1, width).view(torch.uint8)
        changed = (flat != old.view(-1, width).view(torch.uint8)).any(dim=-1)
        assert changed.nonzero().flatten().tolist() == live
    return live


@pytest.mark.interpreter
@pytest.mark.parametrize("q_len, lens, hint", [
    (2, [33, 0, 17], 1),        # padded row, one split
    (3, [16, 17, 3], 64),       # the new tokens straddle a page boundary (16 | 17), splits
    (4, [100, 4], 100),         # shortest live length = q_len
])
def test_verify_step_matches_the_float64_reference(seeded, q_len, lens, hint):
    model = tiny_model(seed=seeded % 1000)
    batch = fresh_batch(model, lens, q_len, np.random.default_rng(seeded))
    ref_caches = model.reference_caches()
    before = [c.clone() for c in model.kv_caches]
    ctx = eager_context(model, batch, hint=hint)
    assert ctx.plan.num_heads == q_len * model.config.num_heads
    out = model(ctx)
    assert out.shape == (len(lens) * q_len, model.config.hidden_size)
    want = reference(model, batch, ref_caches)
    assert rel_l2(out, want) < 1e-5, ctx.plan.describe()
    # Every live token's row landed at its slot, as the reference stored it; nothing else.
    live = live_slots_only_changed(model, before, batch, q_len, lens)
    for cache, ref_cache in zip(model.kv_caches, ref_caches, strict=True):
        flat, ref_flat = cache.view(-1, cache.shape[-1]), ref_cache.view(-1, cache.shape[-1])
        assert rel_l2(flat[live], ref_flat[live]) < 1e-5


@pytest.mark.interpreter
def test_verify_step_equals_q_len_plain_steps():
    """Token j of a verify step sees exactly what a plain decode of it after tokens
    0..j-1 sees: the q_len outputs equal q_len one-token steps'."""
    q_len, lens = 3, [40, 21]
    model = tiny_model(seed=7)
    rng = np.random.default_rng(7)
    batch = fresh_batch(model, lens, q_len, rng)
    snapshot = [c.clone() for c in model.kv_caches]
    verify = model(eager_context(model, batch, hint=64)).view(2, q_len, -1)
    for c, s in zip(model.kv_caches, snapshot, strict=True):
        c.copy_(s)
    hidden = batch.inputs["hidden"].view(2, q_len, -1)
    for j in range(q_len):
        step_lens = [n - q_len + j + 1 for n in lens]
        plain = decode_batch(model, step_lens, batch.block_table_cpu, hidden[:, j].contiguous())
        out = model(eager_context(model, plain, hint=64))
        assert rel_l2(verify[:, j], out) < 1e-5, j
    # ... and a verify step is not q_len copies of the last token's answer.
    assert rel_l2(verify[:, 0], verify[:, -1]) > 1e-2


@pytest.mark.interpreter
def test_dense_backend_runs_verify_steps():
    model = tiny_model(seed=3)
    batch = fresh_batch(model, [30, 0, 9], 2, np.random.default_rng(3))
    ref_caches = model.reference_caches()
    cfg = model.config
    dense = get_backend("dense", kv_lora_rank=cfg.kv_lora_rank, qk_rope_dim=cfg.qk_rope_dim)
    out = model(eager_context(model, batch, hint=30, backend=dense))
    assert rel_l2(out, reference(model, batch, ref_caches)) < 1e-5


@pytest.mark.interpreter
def test_store_kv_masks_tokens_of_padding_requests():
    cfg = tiny()
    rope = rope_cache(cfg.qk_rope_dim, cfg.max_position, cfg.rope_theta, device="cpu")
    cache = torch.zeros(4, PAGE, cfg.kv_dim)
    kv = torch.randn(6, cfg.kv_dim)  # 3 requests x 2 tokens; request 1 is padding
    slots = torch.tensor([3, 4, 20, 21, 40, 41])
    store_kv(kv, torch.ones(cfg.kv_lora_rank), rope, torch.arange(6), slots,
             torch.tensor([5, 0, 9], dtype=torch.int32), cache, cfg.rms_eps, q_len=2)
    written = (cache.view(-1, cfg.kv_dim) != 0).any(dim=-1).nonzero().flatten().tolist()
    assert written == [3, 4, 40, 41]


# ---- verify steps over fp8 caches -------------------------------------------------------


def fp8_model(fmt: str, **kw) -> MLADecoder:
    """A float16 model over an fp8 cache (fp8-v32: the 512 + 64 latent the format fixes)."""
    config = tiny_v32() if fmt == "fp8-v32" else tiny(num_layers=2)
    scale = {"kv_scale": 8.0 / fp8.FP8_MAX} if fmt == "fp8-tensor" else {}
    return MLADecoder(config, num_pages=PAGES, page_size=PAGE, dtype=torch.float16,
                      device="cpu", kv_cache_format=fmt, **scale, **kw)


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt, backend", [("fp8-tensor", "triton"), ("fp8-v32", "triton"),
                                          ("fp8-v32", "dense")])
def test_fp8_cache_verify_step_matches_the_float64_reference(seeded, fmt, backend):
    q_len, lens = 2, [33, 0, 17]
    model = fp8_model(fmt, seed=seeded % 1000)
    cfg = model.config
    batch = fresh_batch(model, lens, q_len, np.random.default_rng(seeded))
    ref_caches = model.reference_caches()  # dequantized / unpacked, float64
    before = [c.clone() for c in model.kv_caches]
    backend = get_backend(backend, kv_lora_rank=cfg.kv_lora_rank, qk_rope_dim=cfg.qk_rope_dim,
                          num_sms=16)
    ctx = eager_context(model, batch, hint=64, backend=backend)
    out = model(ctx)
    assert out.shape == (len(lens) * q_len, cfg.hidden_size)
    want = reference(model, batch, ref_caches)
    # The new rows, computed in fp16 here and in float64 by the reference, can round to
    # neighbouring fp8 values, which the output shows at 1e-2 to a few 1e-2 depending on
    # the seed (scripts/demo.py allows 6e-2 for the same reason).
    assert rel_l2(out, want) < 6e-2, ctx.plan.describe()
    # Each live token's row landed at its own slot in the cache's format, as the reference
    # stored it to fp8 rounding: one e4m3 step is 6-12 % of a value, and the interpreter's
    # cast and the fp16 row put a few values a step apart (as at q_len 1: up to ~0.15 for
    # the per-tensor scale, ~0.06 for the per-token group scales). Padding tokens and every
    # other row stayed as they were.
    live = live_slots_only_changed(model, before, batch, q_len, lens)
    for cache, ref_cache in zip(model.kv_caches, ref_caches, strict=True):
        got = fp8.dequantize_cache(cache, model.kv_scale).view(-1, cfg.kv_dim)[live]
        tol = 0.25 if fmt == "fp8-tensor" else 0.1
        assert rel_l2(got, ref_cache.view(-1, cfg.kv_dim)[live]) < tol


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", ["fp8-tensor", "fp8-v32"])
def test_fp8_cache_verify_step_equals_q_len_plain_steps(fmt):
    """Over an fp8 cache too, token j of a verify step computes what a plain step after
    tokens 0..j-1 computes: the first layer stores the same bytes (same inputs, same store
    kernel); a later layer's new rows come from hidden states that differ in rounding (the
    verify step's attention folds its tokens into one kernel call), so they may sit one fp8
    step apart, and no other row changes."""
    q_len, lens = 2, [33, 17]
    model = fp8_model(fmt, seed=5)
    batch = fresh_batch(model, lens, q_len, np.random.default_rng(5))
    snapshot = [c.clone() for c in model.kv_caches]
    verify = model(eager_context(model, batch, hint=64)).view(len(lens), q_len, -1)
    stored = [c.clone() for c in model.kv_caches]
    for c, s in zip(model.kv_caches, snapshot, strict=True):
        c.copy_(s)
    hidden = batch.inputs["hidden"].view(len(lens), q_len, -1)
    for j in range(q_len):
        step_lens = [n - q_len + j + 1 for n in lens]
        plain = decode_batch(model, step_lens, batch.block_table_cpu, hidden[:, j].contiguous())
        out = model(eager_context(model, plain, hint=64))
        assert rel_l2(verify[:, j], out) < 1e-3, j
    assert torch.equal(model.kv_caches[0].view(torch.uint8), stored[0].view(torch.uint8))
    for got, want, old in zip(model.kv_caches[1:], stored[1:], snapshot[1:], strict=True):
        rows = (want.view(torch.uint8) != old.view(torch.uint8)).flatten(0, 1).any(-1)
        same = (got.view(torch.uint8) == want.view(torch.uint8)).flatten(0, 1).all(-1)
        assert rows.any() and same[~rows].all()  # new rows only, both ways
        new_got = fp8.dequantize_cache(got, model.kv_scale).flatten(0, 1)[rows]
        new_want = fp8.dequantize_cache(want, model.kv_scale).flatten(0, 1)[rows]
        assert rel_l2(new_got, new_want) < 2e-2


@pytest.mark.interpreter
def test_store_kv_v32_stores_each_token_of_a_request_at_its_slot():
    cfg = tiny_v32()
    rope = rope_cache(cfg.qk_rope_dim, cfg.max_position, cfg.rope_theta, device="cpu")
    kv = torch.randn(6, cfg.kv_dim)  # 3 requests x 2 tokens; request 1 is padding
    kv[1, :cfg.kv_lora_rank] *= 50.0  # token 1 of request 0: its own, larger group scales
    slots = torch.tensor([3, 4, 20, 21, 40, 41])
    lens = torch.tensor([5, 0, 9], dtype=torch.int32)
    plain = torch.zeros(4, PAGE, cfg.kv_dim)
    store_kv(kv, torch.ones(cfg.kv_lora_rank), rope, torch.arange(6), slots, lens, plain,
             cfg.rms_eps, q_len=2)
    cache = torch.zeros(4, PAGE, fp8.V32_BYTES, dtype=torch.uint8)
    store_kv(kv, torch.ones(cfg.kv_lora_rank), rope, torch.arange(6), slots, lens, cache,
             cfg.rms_eps, q_len=2, kv_cache_format="fp8-v32")
    rows = cache.view(-1, fp8.V32_BYTES)
    written = (rows != 0).any(dim=-1).nonzero().flatten().tolist()
    assert written == [3, 4, 40, 41]
    # Per-token group scales: the same as pack_v32 of the plain rows, token by token.
    want = plain.view(-1, cfg.kv_dim)[written]
    scales = rows[written, 512:528].contiguous().view(torch.float32)
    assert torch.equal(scales, fp8.v32_scales(want[:, :512]))
    assert rel_l2(fp8.unpack_v32(rows[written]), want) < 0.1


def test_decode_batch_rejects_lengths_below_q_len():
    model = tiny_model()
    table = np.arange(2, dtype=np.int32)[None, :]
    hidden = torch.zeros(3, model.config.hidden_size)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 2 is below q_len 3"):
        decode_batch(model, [2], table, hidden, q_len=3)
    with pytest.raises(ValueError, match="positive int"):
        decode_batch(model, [5], table, hidden, q_len=0)
    batch = decode_batch(model, [17], table, hidden, q_len=3)
    # Tokens at 14, 15, 16: the last one crosses into the second page.
    assert batch.inputs["slot_mapping"].tolist() == [14, 15, PAGE + 0]
    assert batch.q_len == 3


# ---- the runner: one graph set per q_len -----------------------------------------------

LADDER = BucketLadder([Bucket(32, 32), Bucket(128, 128)], 128)


def cpu_runner(model, *, q_lens=(1, 2), sizes=(1, 2), policy="ladder"):
    cfg = model.config
    backend = get_backend("triton", kv_lora_rank=cfg.kv_lora_rank,
                          qk_rope_dim=cfg.qk_rope_dim, num_sms=2)
    runner = GraphBucketRunner.for_model(model, max_model_len=128, batch_sizes=list(sizes),
                                         policy=policy, backend=backend, progress=False,
                                         q_lens=q_lens,
                                         ladder=LADDER if policy == "ladder" else None)
    runner.capture()
    return runner


@pytest.mark.interpreter
def test_runner_replays_each_q_len_graph_and_matches_the_reference():
    model = tiny_model(seed=11)
    runner = cpu_runner(model)
    keys = runner.selector.keys()
    assert {k.q_len for k in keys} == {1, 2}
    assert all(runner.plan_for(k).num_heads == k.q_len * model.config.num_heads for k in keys)
    assert {r.q_len for r in runner.records} == {1, 2}
    rng = np.random.default_rng(11)
    table = random_block_table(2, 8, model.num_pages, rng)
    prefill_random(model, table, [128, 128], seed=11)
    ref_caches = model.reference_caches()
    for lens, q_len in (([40, 7], 2), ([9], 1), ([100], 2), ([2, 0], 2)):
        hidden = torch.from_numpy(rng.standard_normal((len(lens) * q_len,
                                                       model.config.hidden_size))).float()
        batch = decode_batch(model, lens, table[:len(lens)], hidden, q_len=q_len)
        out = runner.step(batch)
        assert out.shape == (len(lens) * q_len, model.config.hidden_size)
        assert rel_l2(out, reference(model, batch, ref_caches)) < 1e-5, (lens, q_len)
    replays = {(k.batch_size, k.bucket, k.q_len): n for k, n in runner.stats().replays.items()}
    assert replays == {(2, 1, 2): 1, (1, 0, 1): 1, (1, 1, 2): 1, (2, 0, 2): 1}
    # The padded row of the [2, 0] step (and the q_len 1 step's unused token rows) stayed 0.
    assert runner.buffers.seq_lens[1].item() == 0
    assert runner.stats().eager_fallbacks == 0
    runner.close()


def _bad_verify_batches(model, table):
    hidden = torch.zeros(4, model.config.hidden_size)
    ok = decode_batch(model, [40, 7], table, hidden, q_len=2)

    def bad(**kw):
        return DecodeBatch(**{"seq_lens_cpu": ok.seq_lens_cpu, "block_table_cpu": table,
                              "inputs": ok.inputs, "q_len": 2, **kw})

    return {
        "q_len above the captured": (bad(q_len=4, inputs={
            "hidden": torch.zeros(8, model.config.hidden_size),
            "slot_mapping": torch.zeros(8, dtype=torch.int64)}), "above the largest captured"),
        "q_len not captured": (bad(q_len=1, inputs={
            "hidden": hidden[:2], "slot_mapping": ok.inputs["slot_mapping"][:2]}),
            r"q_len=1 has no graphs: this selector captures q_lens \[2\]"),
        "q_len zero": (bad(q_len=0), "positive int"),
        "q_len float": (bad(q_len=2.0), "positive int"),
        "length below q_len": (bad(seq_lens_cpu=[40, 1]), "below q_len 2"),
        "one row per request": (bad(q_len=2, inputs={
            "hidden": hidden[:2], "slot_mapping": ok.inputs["slot_mapping"][:2]}),
            r"expected \(4, 64\)"),
        "positions per request": (bad(positions_cpu=[39, 6]), "one per query token"),
        "position past its request": (bad(positions_cpu=[38, 39, 5, 7]), r"positions_cpu\[3\]"),
    }


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["q_len above the captured", "q_len not captured",
                                  "q_len zero", "q_len float", "length below q_len",
                                  "one row per request", "positions per request",
                                  "position past its request"])
def test_bad_verify_batches_raise_before_anything_is_staged(case):
    model = tiny_model(seed=5)
    runner = cpu_runner(model, q_lens=(2,), sizes=(2,))  # verify steps only
    table = random_block_table(2, 4, model.num_pages, np.random.default_rng(5))
    runner.step(decode_batch(model, [40, 7], table, torch.zeros(4, model.config.hidden_size),
                             q_len=2))
    bufs = runner.buffers
    static = (bufs.seq_lens, bufs.positions, bufs.block_table, bufs.output,
              *bufs.inputs.values(), *model.kv_caches)
    before = [t.clone() for t in static]
    batch, match = _bad_verify_batches(model, table)[case]
    with pytest.raises(ValueError, match=match):
        runner.step(batch)
    assert all(torch.equal(a, b) for a, b in zip(before, static, strict=True))
    stats = runner.stats()
    assert (stats.errors, stats.steps) == (1, 1)
    runner.close()


@pytest.mark.interpreter
def test_eager_runner_and_oversized_batches_run_verify_steps():
    model = tiny_model(seed=2)
    eager = cpu_runner(model, policy="eager", sizes=(1,))
    ladder = cpu_runner(model, sizes=(1,))
    rng = np.random.default_rng(2)
    table = random_block_table(2, 8, model.num_pages, rng)
    prefill_random(model, table, [128, 128], seed=2)
    ref_caches = model.reference_caches()
    hidden = torch.from_numpy(rng.standard_normal((4, model.config.hidden_size))).float()
    batch = decode_batch(model, [70, 12], table, hidden, q_len=2)
    want = reference(model, batch, ref_caches)
    snapshot = [c.clone() for c in model.kv_caches]
    for runner in (eager, ladder):  # batch 2 is above the ladder's one capture size
        for c, s in zip(model.kv_caches, snapshot, strict=True):
            c.copy_(s)
        assert rel_l2(runner.step(batch), want) < 1e-5
    assert eager.stats().eager_steps == 1 and ladder.stats().eager_fallbacks == 1
    eager.close()
    ladder.close()


# ---- GPU: real graphs at q_len 1 and 2 (DeepSeek-V3 TP8 attention shapes) ---------------

GPU_MML, GPU_PAGE = 8192, 64


@pytest.fixture(scope="module")
def gpu_setup():
    model = MLADecoder(deepseek_v3_tp8(num_layers=2), num_pages=4 * GPU_MML // GPU_PAGE,
                       page_size=GPU_PAGE, device="cuda")
    kw = dict(max_model_len=GPU_MML, batch_sizes=[1, 4], q_lens=(1, 2), progress=False)
    runners = {"ladder": GraphBucketRunner.for_model(model, policy="ladder", **kw),
               "eager": GraphBucketRunner.for_model(model, policy="eager", **kw)}
    runners["ladder"].capture()
    rng = np.random.default_rng(0)
    table = random_block_table(4, GPU_MML // GPU_PAGE, model.num_pages, rng)
    prefill_random(model, table, [GPU_MML] * 4)
    yield model, runners, table
    for runner in runners.values():
        runner.close()


def _gpu_batch(model, table, lens, q_len, rng, *, input_device="cpu"):
    hidden = torch.from_numpy(rng.standard_normal((len(lens) * q_len,
                                                   model.config.hidden_size)))
    return decode_batch(model, lens, table[:len(lens)],
                        hidden.to(torch.bfloat16).to(input_device), q_len=q_len)


@pytest.mark.gpu
def test_gpu_q_len_graphs_match_eager_and_the_reference(gpu_setup):
    model, runners, table = gpu_setup
    rng = np.random.default_rng(1)
    for lens, q_len in (([2], 2), ([63, 64, 65], 2), ([5000, 100, 8000, 4097], 2),
                        ([700, 3000], 1), ([8192], 2)):
        batch = _gpu_batch(model, table, lens, q_len, rng)
        snapshot = [c.clone() for c in model.kv_caches]
        ref_caches = model.reference_caches()
        got = runners["ladder"].step(batch).clone()
        for c, s in zip(model.kv_caches, snapshot, strict=True):
            c.copy_(s)
        eager = runners["eager"].step(batch).clone()
        assert got.shape == (len(lens) * q_len, model.config.hidden_size)
        assert rel_l2(got, eager) < 1e-2, (lens, q_len)
        assert rel_l2(got, reference(model, batch, ref_caches)) < 2e-2, (lens, q_len)
    assert {k.q_len for k in runners["ladder"].stats().replays} == {1, 2}


@pytest.mark.gpu
def test_gpu_random_q_len_steps_are_sync_free(gpu_setup):
    """A serving loop accepting a random number of drafts: only host lengths and q_len
    change per step; no step synchronizes."""
    model, runners, table = gpu_setup
    runner, eager = runners["ladder"], runners["eager"]
    rng = np.random.default_rng(2)
    for step in range(300):
        q_len = int(rng.integers(1, 3))
        bs = int(rng.integers(1, 5))
        lens = rng.integers(q_len, GPU_MML + 1, size=bs).tolist()
        batch = _gpu_batch(model, table, lens, q_len, rng,
                           input_device="cuda" if step % 2 else "cpu")
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = runner.step(batch).clone()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        if step % 25 == 0:
            assert rel_l2(got, eager.step(batch)) < 1e-2, (step, lens, q_len)
    stats = runner.stats()
    assert stats.errors == 0 and stats.eager_fallbacks == 0
    assert {k.q_len for k in stats.replays} == {1, 2}
