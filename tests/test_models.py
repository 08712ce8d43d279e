"""MLADecoder: Triton decode (kernels through the interpreter on CPU) against the float64
reference, the cache store through slot_mapping, multi-step decoding, runner capture."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from graphbucket import fp8
from graphbucket.backends import get_backend
from graphbucket.context import DecodeContext
from graphbucket.models import (
    MLADecoder,
    decode_batch,
    deepseek_v3_tp8,
    kimi_tp8,
    ops,
    prefill_random,
    random_block_table,
    slot_mapping_for,
    tiny,
    tiny_v32,
)
from graphbucket.models.step_reference import rotary_ref
from graphbucket.runner import GraphBucketRunner
from tests._toy import rel_l2

PAGE, PAGES = 16, 32


def tiny_model(dtype=torch.float32, **kw) -> MLADecoder:
    return MLADecoder(tiny(), num_pages=PAGES, page_size=PAGE, dtype=dtype, device="cpu", **kw)


def triton_backend(cfg, **kw):
    return get_backend("triton", kv_lora_rank=cfg.kv_lora_rank, qk_rope_dim=cfg.qk_rope_dim,
                       **kw)


def context(model, batch, *, hint: int, backend=None) -> DecodeContext:
    """An eager context over the batch's own tensors, planned with ``hint``."""
    cfg, dev = model.config, model.device
    backend = backend or triton_backend(cfg, num_sms=16)
    lens = torch.as_tensor(np.asarray(batch.seq_lens_cpu), dtype=torch.int32, device=dev)
    plan = backend.plan(lens.shape[0], cfg.num_heads, hint)
    return DecodeContext(
        batch_size=lens.shape[0], plan=plan, backend=backend, sm_scale=cfg.sm_scale,
        seq_lens=lens, block_table=torch.as_tensor(batch.block_table_cpu, device=dev),
        positions=(lens.long() - 1).clamp_min(0),
        inputs={k: v.to(dev) for k, v in batch.inputs.items()},
        workspace=backend.workspace_spec([plan]).allocate(dev))


def reference(model, batch, caches, **kw):
    lens = np.asarray(batch.seq_lens_cpu)
    return model.forward_reference(batch.inputs["hidden"], positions=np.maximum(lens - 1, 0),
                                   seq_lens=lens, block_table=batch.block_table_cpu,
                                   slot_mapping=batch.inputs["slot_mapping"], caches=caches,
                                   **kw)


def setup_batch(model, lens, *, seed=0, pages=8):
    rng = np.random.default_rng(seed)
    table = random_block_table(len(lens), pages, model.num_pages, rng)
    prefill_random(model, table, [pages * model.page_size] * len(lens), seed=seed)
    hidden = torch.from_numpy(rng.standard_normal((len(lens), model.config.hidden_size)))
    return decode_batch(model, lens, table, hidden.to(model.dtype))


def test_presets_have_the_per_rank_shapes():
    ds, kimi = deepseek_v3_tp8(), kimi_tp8(num_layers=61)
    assert (ds.num_heads, ds.hidden_size, ds.q_lora_rank, ds.kv_dim, ds.intermediate_size) \
        == (16, 7168, 1536, 576, 2304)
    assert ds.sm_scale == pytest.approx(1 / math.sqrt(192))
    assert kimi.num_heads == 12 and kimi.num_layers == 61 and kimi.kv_dim == 576
    assert 85e6 < ds.layer_params() < 87e6  # ~172 MB of bf16 weights per layer
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        tiny().__class__(**{**_fields(tiny()), "num_heads": 0})


def _fields(cfg):
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 1e-2)])
@pytest.mark.parametrize("hint", [1, 100])
def test_decode_matches_the_float_reference(dtype, tol, hint):
    model = tiny_model(dtype)
    batch = setup_batch(model, [40, 100])
    ref_caches = model.reference_caches()
    ctx = context(model, batch, hint=hint)
    assert (ctx.plan.num_kv_splits == 1) == (hint == 1), ctx.plan.describe()
    out = model(ctx)
    assert out.shape == (2, model.config.hidden_size) and out.dtype == dtype
    want = reference(model, batch, ref_caches)
    assert rel_l2(out, want) < tol
    for cache, ref_cache in zip(model.kv_caches, ref_caches, strict=True):
        assert rel_l2(cache, ref_cache) < tol


@pytest.mark.interpreter
def test_the_new_row_lands_at_its_slot_and_padding_rows_store_nothing():
    model = tiny_model()
    batch = setup_batch(model, [37, 0, 50])
    slots = batch.inputs["slot_mapping"].clone()
    slots[1] = 0            # a zero-padded row (as staged buffers pad): seq_len 0 masks it
    slots[2] = -1           # a live row that stores nothing
    batch.inputs["slot_mapping"] = slots
    before = [c.clone() for c in model.kv_caches]
    ref_caches = model.reference_caches()
    model(context(model, batch, hint=64))
    reference(model, batch, ref_caches)
    slot = int(slots[0])
    for cache, old, ref_cache in zip(model.kv_caches, before, ref_caches, strict=True):
        changed = (cache != old).any(dim=-1).flatten().nonzero().flatten().tolist()
        assert changed == [slot]
        row = cache.view(-1, cache.shape[-1])[slot]
        assert rel_l2(row, ref_cache.view(-1, cache.shape[-1])[slot]) < 1e-5


@pytest.mark.interpreter
def test_several_steps_with_growing_lengths_across_pages():
    model = tiny_model()
    rng = np.random.default_rng(3)
    table = random_block_table(2, 8, PAGES, rng)
    prefill_random(model, table, [15, 31], seed=3)
    ref_caches = model.reference_caches()
    for step, lens in enumerate([[15, 31], [16, 32], [17, 33], [18, 34]]):
        hidden = torch.from_numpy(rng.standard_normal((2, model.config.hidden_size))).float()
        batch = decode_batch(model, lens, table, hidden)
        out = model(context(model, batch, hint=max(lens)))
        assert rel_l2(out, reference(model, batch, ref_caches)) < 1e-5, step
    for cache, ref_cache in zip(model.kv_caches, ref_caches, strict=True):
        assert rel_l2(cache, ref_cache) < 1e-5


@pytest.mark.interpreter
def test_store_kv_rotates_with_the_table_at_large_positions():
    cfg = tiny()
    rope = ops.rope_cache(cfg.qk_rope_dim, cfg.max_position, cfg.rope_theta, device="cpu")
    kv = torch.randn(2, cfg.kv_dim)
    cache = torch.zeros(4, PAGE, cfg.kv_dim)
    pos = torch.tensor([4000, 4095])
    ops.store_kv(kv, torch.ones(cfg.kv_lora_rank), rope, pos, torch.tensor([5, 63]),
                 torch.tensor([1, 1], dtype=torch.int32), cache, cfg.rms_eps)
    rows = cache.view(-1, cfg.kv_dim)[[5, 63]]
    want = rotary_ref(kv[:, cfg.kv_lora_rank:].double(), pos, cfg.rope_theta)
    assert rel_l2(rows[:, cfg.kv_lora_rank:], want) < 1e-5


def test_slot_mapping_for_pages_and_negative_positions():
    table = np.array([[7, 3], [2, 9]], dtype=np.int32)
    assert slot_mapping_for(table, [17, -1], 16).tolist() == [3 * 16 + 1, -1]
    with pytest.raises(ValueError, match="allocate more pages"):
        random_block_table(3, 12, PAGES, np.random.default_rng(0))


@pytest.mark.interpreter
def test_runner_padding_rows_leave_the_cache_alone():
    """A batch of 1 replays the size-2 graph; the padded row's zeroed slot_mapping points
    at slot 0, which a live request owns: it must stay untouched."""
    model = tiny_model()
    table = np.arange(4, dtype=np.int32)[None, :]        # page 0 belongs to the request
    prefill_random(model, table, [64])
    backend = triton_backend(model.config, num_sms=2)
    runner = GraphBucketRunner.for_model(model, max_model_len=128, batch_sizes=[2],
                                         backend=backend, progress=False)
    before = [c.clone() for c in model.kv_caches]
    runner.capture()                                      # warm-up and capture store nothing
    assert all(torch.equal(c, b) for c, b in zip(model.kv_caches, before, strict=True))
    hidden = torch.randn(1, model.config.hidden_size)
    batch = decode_batch(model, [50], table, hidden)
    ref_caches = model.reference_caches()
    out = runner.step(batch)
    assert rel_l2(out, reference(model, batch, ref_caches)) < 1e-5
    slot = int(batch.inputs["slot_mapping"][0])
    for cache, old in zip(model.kv_caches, before, strict=True):
        changed = (cache != old).any(dim=-1).flatten().nonzero().flatten().tolist()
        assert changed == [slot] and slot != 0
    runner.close()


@pytest.mark.interpreter
def test_skinny_projections_match_the_reference():
    model = tiny_model(projections="skinny-bmm")
    assert tiny_model().projections == "torch"  # "auto" on the CPU
    batch = setup_batch(model, [40, 100])
    ref_caches = model.reference_caches()
    out = model(context(model, batch, hint=100))
    assert rel_l2(out, reference(model, batch, ref_caches)) < 1e-5


def test_unknown_projections_rejected():
    with pytest.raises(ValueError, match="projections must be one of"):
        tiny_model(projections="cublas")


def test_decode_batch_names_lengths_its_table_cannot_hold():
    model = tiny_model()
    table = np.arange(2, dtype=np.int32)[None, :]  # 2 pages of PAGE tokens
    hidden = torch.zeros(1, model.config.hidden_size)
    with pytest.raises(ValueError, match=rf"seq_lens\[0\] = {2 * PAGE + 1} is outside"):
        decode_batch(model, [2 * PAGE + 1], table, hidden)
    with pytest.raises(ValueError, match="outside"):
        decode_batch(model, [-3], table, hidden)
    with pytest.raises(ValueError, match="block_table must be integers"):
        decode_batch(model, [5, 6], table, hidden)
    assert decode_batch(model, [2 * PAGE], table, hidden).seq_lens_cpu.tolist() == [2 * PAGE]


def test_runner_for_model_takes_every_dimension_from_the_model():
    model = tiny_model()
    runner = GraphBucketRunner.for_model(model, max_model_len=128, batch_sizes=[1],
                                         policy="fixed-1")
    cfg = model.config
    assert (runner.backend.kv_lora_rank, runner.backend.qk_rope_dim) == (cfg.kv_lora_rank,
                                                                         cfg.qk_rope_dim)
    assert runner.sm_scale == cfg.sm_scale and runner.spec == model.buffer_spec(128)
    (plan,) = runner.graphs.plans.values()
    assert plan.kv_lora_rank == cfg.kv_lora_rank and plan.num_heads == cfg.num_heads
    runner.close()


# ---- GPU: the real per-rank shapes in bf16 ----------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 8])
def test_gpu_skinny_and_torch_projections_agree(bs):
    cfg = deepseek_v3_tp8(num_layers=2)
    skinny, torch_proj = (MLADecoder(cfg, num_pages=64, page_size=64, device="cuda",
                                     projections=p) for p in ("skinny-bmm", "torch"))
    lens = [100 + 50 * i for i in range(bs)]
    outs = []
    for model in (skinny, torch_proj):
        batch = setup_batch(model, lens, pages=8)
        outs.append(model(context(model, batch, hint=512,
                                  backend=get_backend("triton", device="cuda"))))
    assert rel_l2(outs[0], outs[1]) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("preset", [deepseek_v3_tp8, kimi_tp8])
def test_gpu_preset_bf16_matches_the_reference(preset):
    cfg = preset(num_layers=2)
    model = MLADecoder(cfg, num_pages=256, page_size=64, dtype=torch.bfloat16, device="cuda")
    batch = setup_batch(model, [700, 3000], pages=64)
    ref_caches = model.reference_caches()
    backend = get_backend("triton", device="cuda")
    for hint in (1, 3000):
        out = model(context(model, batch, hint=hint, backend=backend))
        assert torch.isfinite(out).all()
        assert rel_l2(out, reference(model, batch, ref_caches)) < 2e-2, hint


@pytest.mark.gpu
def test_gpu_graph_replays_sync_free_and_match_eager():
    model = MLADecoder(deepseek_v3_tp8(num_layers=2), num_pages=512, page_size=64,
                       device="cuda")
    kw = dict(spec=model.buffer_spec(8192), batch_sizes=[1, 4], max_model_len=8192,
              sm_scale=model.config.sm_scale)
    ladder = GraphBucketRunner.for_policy("ladder", model, **kw)
    eager = GraphBucketRunner.for_policy("eager", model, **kw)
    ladder.capture()
    rng = np.random.default_rng(0)
    table = random_block_table(4, 128, 512, rng)
    prefill_random(model, table, [8192] * 4)
    for lens in ([1], [63, 64, 65], [5000, 100, 8000, 4097]):
        hidden = torch.randn(len(lens), 7168, dtype=torch.bfloat16, device="cuda")
        batch = decode_batch(model, lens, table[: len(lens)], hidden)
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = ladder.step(batch).clone()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert rel_l2(got, eager.step(batch)) < 1e-2, lens
    ladder.close()
    eager.close()


@pytest.mark.interpreter
@pytest.mark.parametrize("hint", [1, 100])
def test_fp8_cache_decode_matches_the_reference_over_the_fp8_cache(hint):
    model = tiny_model(torch.float16, kv_cache_dtype=torch.float8_e4m3fn, kv_scale=4.0 / 448)
    assert model.kv_caches[0].dtype == torch.float8_e4m3fn
    assert model.kv_row_bytes() == model.config.num_layers * model.config.kv_dim
    batch = setup_batch(model, [40, 100])
    ref_caches = model.reference_caches()  # dequantized, float64
    out = model(context(model, batch, hint=hint))
    want = reference(model, batch, ref_caches)
    assert rel_l2(out, want) < 2e-2
    # The new rows were quantized by the store op as the reference quantized them.
    for cache, ref_cache in zip(model.kv_caches, ref_caches, strict=True):
        assert rel_l2(fp8.dequantize(cache, model.kv_scale), ref_cache) < 2e-2


def test_fp8_cache_needs_its_scale_and_a_16_bit_model():
    with pytest.raises(ValueError, match="kv_scale"):
        tiny_model(torch.float16, kv_cache_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_scale"):
        tiny_model(torch.float16, kv_scale=0.01)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        tiny_model(torch.float32, kv_cache_dtype=torch.float8_e4m3fn, kv_scale=0.01)


def v32_model(**kw) -> MLADecoder:
    return MLADecoder(tiny_v32(), num_pages=PAGES, page_size=PAGE, dtype=torch.float16,
                      device="cpu", kv_cache_format="fp8-v32", **kw)


@pytest.mark.interpreter
@pytest.mark.parametrize("hint", [1, 100])
def test_v32_cache_decode_matches_the_reference_over_the_v32_cache(hint, seeded):
    model = v32_model(seed=seeded)
    cfg = model.config
    assert model.kv_caches[0].dtype == torch.uint8
    assert model.kv_caches[0].shape == (PAGES, PAGE, fp8.V32_BYTES)
    assert model.kv_row_bytes() == cfg.num_layers * 656
    assert model.buffer_spec(128).kv_cache_format == "fp8-v32"
    batch = setup_batch(model, [40, 100], seed=seeded)
    ref_caches = model.reference_caches()  # unpacked, float64
    assert ref_caches[0].shape == (PAGES, PAGE, cfg.kv_dim)
    out = model(context(model, batch, hint=hint))
    # Over the rows the store op wrote: the attention and the model's compute. A row stored
    # from the fp16 model's values can sit one fp8 step from the reference's own where the
    # rounding falls differently, so the whole float64 step (it stores its own rows) gets
    # a looser bound, and the rows are checked on their own below.
    stored = model.reference_caches()
    assert rel_l2(out, reference(model, batch, stored, store_new_rows=False)) < 1e-2
    want = reference(model, batch, ref_caches)
    assert rel_l2(out, want) < 0.15
    # The store op packed each new row by the V3.2 rule, checked exactly on what it stored:
    # every nonzero group's largest code is 448 (its scale is amax / 448).
    # Against the reference's rows: layer 0 matches to the fp16 model's rounding; past it
    # the rows carry the attention's fp8 error (the output's, up to 0.15 above), which can
    # move a group's largest value, and so its scale, by as much.
    slots = batch.inputs["slot_mapping"]
    for i, (cache, ref_cache) in enumerate(zip(model.kv_caches, ref_caches, strict=True)):
        rows = cache.view(-1, fp8.V32_BYTES)[slots]
        want_rows = ref_cache.view(-1, cfg.kv_dim)[slots]
        scales = rows[:, 512:528].contiguous().view(torch.float32).double()
        codes = rows[:, :512].contiguous().view(fp8.FP8_DTYPE).double().reshape(-1, 4, 128)
        nonzero = scales > fp8.V32_MIN_SCALE
        assert nonzero.any()
        assert torch.equal(codes.abs().amax(-1)[nonzero],
                           torch.full_like(scales[nonzero], fp8.FP8_MAX))
        assert torch.allclose(scales, fp8.v32_scales(want_rows[:, :512]).double(),
                              rtol=5e-3 if i == 0 else 6e-2)
        assert rel_l2(fp8.unpack_v32(rows), want_rows) < 0.1


def test_cache_formats_are_named_and_checked_at_construction():
    assert tiny_model(torch.float16).kv_cache_format == "bf16"
    old = tiny_model(torch.float16, kv_cache_dtype=torch.float8_e4m3fn, kv_scale=0.01)
    new = tiny_model(torch.float16, kv_cache_format="fp8-tensor", kv_scale=0.01)
    assert old.kv_cache_format == new.kv_cache_format == "fp8-tensor"
    assert old.kv_caches[0].dtype == new.kv_caches[0].dtype == torch.float8_e4m3fn
    assert new.kv_row_bytes() == new.config.num_layers * new.config.kv_dim
    assert MLADecoder(tiny_v32(), num_pages=4, page_size=PAGE, dtype=torch.bfloat16,
                      device="cpu", kv_cache_dtype=torch.uint8).kv_cache_format == "fp8-v32"
    with pytest.raises(ValueError, match="512 latent and 64 rope"):
        tiny_model(torch.float16, kv_cache_format="fp8-v32")
    with pytest.raises(ValueError, match="kv_cache_format must be one of"):
        tiny_model(torch.float16, kv_cache_format="fp8")
    with pytest.raises(ValueError, match="kv_scale"):
        v32_model(kv_scale=0.01)
    with pytest.raises(ValueError, match="kv_scale"):
        tiny_model(torch.float16, kv_cache_format="fp8-tensor")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        MLADecoder(tiny_v32(), num_pages=4, page_size=PAGE, dtype=torch.float32, device="cpu",
                   kv_cache_format="fp8-v32")
    with pytest.raises(ValueError, match="pass only kv_cache_format"):
        tiny_model(torch.float16, kv_cache_dtype=torch.float8_e4m3fn, kv_scale=0.01,
                   kv_cache_format="fp8-v32")
    with pytest.raises(ValueError, match="kv_cache_dtype=torch.float32"):
        tiny_model(torch.float16, kv_cache_dtype=torch.float32)


@pytest.mark.interpreter
@pytest.mark.parametrize("bad", ["v32_bf16_cache", "v32_width", "tensor_scale_shape",
                                 "tensor_scale_missing"])
def test_a_cache_or_scale_of_the_wrong_format_raises_before_any_launch(bad):
    model = v32_model() if bad.startswith("v32") else tiny_model(
        torch.float16, kv_cache_format="fp8-tensor", kv_scale=0.01)
    ctx = context(model, setup_batch(model, [40, 100]), hint=1)
    match = "kv_caches\\[1\\]: the fp8-v32 format needs a torch.uint8 cache"
    if bad == "v32_bf16_cache":
        model.kv_caches[1] = torch.zeros(PAGES, PAGE, 576, dtype=torch.float16)
    elif bad == "v32_width":
        model.kv_caches[1] = torch.zeros(PAGES, PAGE, 660, dtype=torch.uint8)
    else:
        model.kv_scale = torch.ones(2) if bad == "tensor_scale_shape" else None
        match = "kv_caches\\[0\\]: kv_scale: got (None|torch.float32 \\(2,\\))"
    before = [c.view(torch.uint8).clone() for c in model.kv_caches]
    with pytest.raises(ValueError, match=match):
        model(ctx)
    for cache, old in zip(model.kv_caches, before, strict=True):
        assert torch.equal(cache.view(torch.uint8), old)  # no layer stored its new row


@pytest.mark.parametrize("fmt, scale", [("bf16", None), ("fp8-tensor", 8.0 / 448)])
def test_prefill_random_fills_exactly_the_used_pages_in_chunks(monkeypatch, fmt, scale):
    from graphbucket.models import paging

    monkeypatch.setattr(paging, "_PREFILL_CHUNK_PAGES", 3)  # several chunks, a partial last
    model = tiny_model(torch.bfloat16, kv_cache_format=fmt, kv_scale=scale)
    table = random_block_table(3, 4, PAGES, np.random.default_rng(5))
    lens = [4 * PAGE, 2 * PAGE + 1, 0]  # 4, 3 and 0 pages used
    prefill_random(model, table, lens, seed=5)
    used = {int(p) for p in table[0]} | {int(p) for p in table[1, :3]}
    for cache in model.kv_caches:
        filled = {p for p in range(PAGES) if cache[p].view(torch.uint8).any()}
        assert filled == used
        assert len({cache[p].view(torch.uint8).sum().item() for p in used}) == len(used)
