"""fp8 latent caches (per-tensor and DeepSeek-V3.2 rows): the scale rules, the formats by
name, the store op and the decode kernels.

Kernels run through the Triton interpreter on the CPU (fp16 q there: the interpreter gets
bf16 dots wrong) and on the GPU where there is one (bf16 and fp16 q). The reference is
float64 attention over the dequantized cache.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from graphbucket import fp8
from graphbucket.kernels import SplitWorkspace, mla_decode, mla_decode_balanced
from graphbucket.kernels.tiles import E4M3_UNIT_BITS, e4m3_to_f16
from graphbucket.plan import plan_balanced_mla_decode, plan_mla_decode
from graphbucket.plan_streams import LONG_PAGE_AHEAD, TOKEN_STREAM, Fp8Stream
from graphbucket.reference import mla_decode_reference
from tests.kernel_cases import KV_LORA_RANK, SM_SCALE, make_case, rel_l2

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
Q_DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16]


# ---- the scale rule ---------------------------------------------------------------------


@pytest.mark.host
def test_quantize_saturates_rounds_and_dequantizes():
    scale = fp8.scale_for(2.0)
    assert scale.dtype == torch.float32 and scale.shape == (1,)
    assert torch.allclose(scale, torch.tensor([2.0 / 448]))
    x = torch.tensor([0.0, 2.0, -2.0, 5.0, -1e9, 1e-6])
    q = fp8.quantize(x, scale)
    assert q.dtype == torch.float8_e4m3fn
    back = fp8.dequantize(q, scale)
    assert back.dtype == torch.float64
    # amax maps to 448 exactly; beyond it saturates (no inf / nan in e4m3fn).
    assert back[1].item() == pytest.approx(2.0) and back[2].item() == pytest.approx(-2.0)
    assert back[3].item() == pytest.approx(2.0) and back[4].item() == pytest.approx(-2.0)
    assert torch.isfinite(back).all() and back[0] == 0
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 inside the normal range.
    # Inside +-amax (beyond it values saturate, tested above).
    y = (torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 0.5).clamp(-2, 2)
    err = (fp8.dequantize(fp8.quantize(y, scale), scale) - y.double()).abs()
    normal = y.abs() > scale.item() * 2 ** -6
    assert (err[normal] <= y.double().abs()[normal] * 2 ** -4 + 1e-12).all()


@pytest.mark.host
@pytest.mark.parametrize("amax", [0.0, -1.0, float("inf"), float("nan")])
def test_scale_for_rejects_unusable_amax(amax):
    with pytest.raises(ValueError, match="amax"):
        fp8.scale_for(amax)


# ---- decode kernels over an fp8 cache -------------------------------------------------------


def fp8_case(lens, heads, *, q_dtype, page_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    case = make_case(lens, heads, page_size=page_size, dtype=torch.float32, device="cpu",
                     gen=gen)
    scale = fp8.scale_for(case.kv_cache.abs().amax())
    cache = fp8.quantize(case.kv_cache, scale)
    return (case.q.to(q_dtype).to(DEVICE), cache.to(DEVICE), case.block_table.to(DEVICE),
            case.seq_lens.to(DEVICE), scale.to(DEVICE))


def reference(q, cache, table, lens, scale):
    return mla_decode_reference(q.cpu(), fp8.dequantize(cache.cpu(), scale.cpu()),
                                table.cpu(), lens.cpu(), kv_lora_rank=KV_LORA_RANK,
                                sm_scale=SM_SCALE)


def run(plan, q, cache, table, lens, scale, *, balanced=False):
    bs, heads = q.shape[0], q.shape[1]
    out = torch.full((bs, heads, KV_LORA_RANK), float("nan"), dtype=q.dtype, device=DEVICE)
    lse = torch.full((bs, heads), float("nan"), device=DEVICE)
    ws = SplitWorkspace.allocate(bs, heads, max(1, plan.num_kv_splits), KV_LORA_RANK, DEVICE,
                                 max_items=plan.max_work_items)
    launch = mla_decode_balanced if balanced else mla_decode
    launch(q, cache, table, lens, out, ws, plan=plan, sm_scale=SM_SCALE, lse=lse,
           kv_scale=scale)
    return out, lse


@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize("lens", [[1], [16, 17], [33, 0, 100, 5], [64, 63, 65]])
@pytest.mark.parametrize("splits", [1, 3])
def test_fp8_split_kv_matches_float64_over_the_dequantized_cache(q_dtype, lens, splits):
    q, cache, table, seq_lens, scale = fp8_case(lens, 16, q_dtype=q_dtype)
    plan = plan_mla_decode(len(lens), 16, 1, num_sms=8).with_splits(splits)
    out, lse = run(plan, q, cache, table, seq_lens, scale)
    ref, ref_lse = reference(q, cache, table, seq_lens, scale)
    assert rel_l2(out, ref) < 1e-2, (lens, splits)
    live = seq_lens.cpu() > 0
    assert (lse.cpu().double()[live] - ref_lse[live]).abs().max() < 2e-2
    assert (out[~live.to(out.device)] == 0).all()  # padding rows: zeros


@pytest.mark.parametrize("stream", [LONG_PAGE_AHEAD, TOKEN_STREAM])
@pytest.mark.parametrize("heads", [16, 128])
def test_fp8_other_streams_and_query_rows(stream, heads):
    q, cache, table, seq_lens, scale = fp8_case([70, 3], heads, q_dtype=Q_DTYPES[-1], seed=1)
    for plan in (plan_mla_decode(2, heads, 1, num_sms=4).with_splits(2),
                 plan_mla_decode(2, heads, 1, num_sms=4, stream=stream).with_splits(2)):
        out, _ = run(plan, q, cache, table, seq_lens, scale)
        assert rel_l2(out, reference(q, cache, table, seq_lens, scale)[0]) < 1e-2, \
            plan.describe()


@pytest.mark.parametrize("fmt", ["tensor", "v32"])
def test_fp8_tiles_copied_as_stored(fmt):
    # The shared-memory path (no register prefetch) stays correct for both formats.
    lens = [70, 0, 3]
    plan = dataclasses.replace(plan_mla_decode(len(lens), 16, 1, num_sms=4).with_splits(2),
                               fp8=Fp8Stream(register_prefetch=False))
    if fmt == "tensor":
        q, cache, table, seq_lens, scale = fp8_case(lens, 16, q_dtype=Q_DTYPES[-1], seed=3)
        out, _ = run(plan, q, cache, table, seq_lens, scale)
        ref = reference(q, cache, table, seq_lens, scale)[0]
    else:
        q, cache, table, seq_lens = v32_case(lens, 16, q_dtype=Q_DTYPES[-1], seed=3)
        out, _ = run(plan, q, cache, table, seq_lens, None)
        ref = v32_reference(q, cache, table, seq_lens)[0]
    assert rel_l2(out, ref) < 1e-2


def test_fp8_balanced_ragged_batch():
    lens = [130, 1, 0, 47]
    q, cache, table, seq_lens, scale = fp8_case(lens, 16, q_dtype=Q_DTYPES[-1], seed=2)
    plan = plan_balanced_mla_decode(len(lens), 16, num_sms=4)
    out, _ = run(plan, q, cache, table, seq_lens, scale, balanced=True)
    assert rel_l2(out, reference(q, cache, table, seq_lens, scale)[0]) < 1e-2


def test_fp8_error_against_the_unquantized_cache_is_small():
    # The fp8 result approximates attention over the original (float) cache.
    gen = torch.Generator().manual_seed(3)
    case = make_case([200, 31], 16, page_size=16, dtype=torch.float32, device="cpu", gen=gen)
    scale = fp8.scale_for(case.kv_cache.abs().amax())
    q = case.q.to(Q_DTYPES[-1]).to(DEVICE)
    cache = fp8.quantize(case.kv_cache, scale).to(DEVICE)
    plan = plan_mla_decode(2, 16, 1, num_sms=8).with_splits(2)
    out, _ = run(plan, q, cache, case.block_table.to(DEVICE), case.seq_lens.to(DEVICE),
                 scale.to(DEVICE))
    exact, _ = mla_decode_reference(q.cpu(), case.kv_cache, case.block_table, case.seq_lens,
                                    kv_lora_rank=KV_LORA_RANK, sm_scale=SM_SCALE)
    assert rel_l2(out, exact) < 0.1  # e4m3 rounding of the cache (reported in bench)


@pytest.mark.parametrize("bad", ["no_scale", "f16_scale", "two_scales", "fp32_q",
                                 "scale_for_bf16"])
def test_bad_fp8_inputs_raise_before_launch_and_write_nothing(bad):
    q, cache, table, seq_lens, scale = fp8_case([20], 16, q_dtype=Q_DTYPES[-1])
    plan = plan_mla_decode(1, 16, 1, num_sms=8)
    if bad == "no_scale":
        scale = None
    elif bad == "f16_scale":
        scale = scale.half()
    elif bad == "two_scales":
        scale = scale.repeat(2)
    elif bad == "fp32_q":
        q = q.float()
    else:
        cache = fp8.dequantize(cache, scale, torch.float32).to(q.dtype)
    out = torch.full((1, 16, KV_LORA_RANK), float("nan"), dtype=q.dtype, device=DEVICE)
    with pytest.raises(ValueError, match="kv_scale|dtypes"):
        mla_decode(q, cache, table, seq_lens, out, None, plan=plan, sm_scale=SM_SCALE,
                   kv_scale=scale)
    assert torch.isnan(out).all()


# ---- the store op -------------------------------------------------------------------------


def test_store_kv_quantizes_into_an_fp8_cache():
    from graphbucket.models.ops import store_kv

    gen = torch.Generator().manual_seed(4)
    r, p, page = 64, 16, 8
    kv_a = torch.randn(3, r + p, generator=gen).to(DEVICE)
    weight = (torch.rand(r, generator=gen) + 0.5).to(DEVICE)
    theta = torch.arange(p // 2, dtype=torch.float32) / (p // 2)
    angles = torch.arange(64, dtype=torch.float32)[:, None] * 10000.0 ** -theta
    rope = torch.cat([angles.cos(), angles.sin()], 1).to(DEVICE)
    pos = torch.tensor([5, 0, 63], device=DEVICE)
    slots = torch.tensor([3, 17, -1], device=DEVICE)  # the third row writes nothing
    lens = torch.tensor([6, 1, 64], dtype=torch.int32, device=DEVICE)
    plain = torch.zeros(4, page, r + p, device=DEVICE)
    store_kv(kv_a, weight, rope, pos, slots, lens, plain, 1e-6)
    scale = fp8.scale_for(plain.abs().amax().cpu()).to(DEVICE)
    packed = torch.zeros(4, page, r + p, device=DEVICE).to(fp8.FP8_DTYPE)
    store_kv(kv_a, weight, rope, pos, slots, lens, packed, 1e-6, kv_scale=scale)
    want_q = fp8.quantize(plain, scale)
    want, got = fp8.dequantize(want_q, scale), fp8.dequantize(packed, scale)
    check = torch.ones_like(plain, dtype=torch.bool)
    if not ON_GPU:
        # Triton 3.6's interpreter loses the carry when rounding to e4m3 crosses into the
        # next binade (124.8 -> 64, not 128); the GPU's conversion does not. Compare the
        # other values there.
        mag = want_q.float().abs()
        check = ~((mag > (plain / scale).abs()) & (mag == 2 ** torch.log2(mag).round()))
    # Same values up to one e4m3 step where float32 rounding lands on a tie.
    assert torch.allclose(got[check], want[check], rtol=2 ** -3, atol=1e-6)
    assert check.float().mean() > 0.9
    assert (got.view(-1, r + p)[[0, 1, 2, 4]] == 0).all()
    with pytest.raises(ValueError, match="kv_scale"):
        store_kv(kv_a, weight, rope, pos, slots, lens, packed, 1e-6)


# ---- DeepSeek-V3.2 format: per-token, per-128-group scales ---------------------------------


@pytest.mark.host
def test_pack_v32_layout_and_round_trip():
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(3, 7, 576, generator=gen)
    rows[0, 0, :128] = 0.0                       # a zero group
    rows[0, 1, 128:256] *= 1e4                   # groups of very different magnitude
    rows[0, 1, 256:384] *= 1e-4
    rows[0, 2, :512] = 0.0                       # a token whose latent is all zeros
    rows[1, 3, 384:512] = torch.linspace(-1, 1, 128) * 3e38  # near float32's limit
    packed = fp8.pack_v32(rows)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 7, fp8.V32_BYTES) == (3, 7, 656)
    # Bytes 512..527: the float32 group scales; 528..655: the rope in bf16.
    scales = packed[..., 512:528].contiguous().view(torch.float32)
    amax = rows[..., :512].reshape(3, 7, 4, 128).abs().amax(-1)
    assert torch.equal(scales, (amax / 448).clamp_min(2.0 ** -126))
    assert torch.equal(fp8.v32_scales(rows[..., :512]), scales)
    assert scales[0, 0, 0] == 2.0 ** -126 and (scales > 0).all() and torch.isfinite(scales).all()
    rope = packed[..., 528:].contiguous().view(torch.bfloat16)
    assert torch.equal(rope, rows[..., 512:].to(torch.bfloat16))
    stored = packed[..., :512].contiguous().view(torch.float8_e4m3fn).float()
    assert torch.isfinite(stored).all()  # saturated at +-448, never e4m3fn's nan
    assert torch.equal(stored.reshape(3, 7, 4, 128).abs().amax(-1)[amax > 0],
                       torch.full_like(amax[amax > 0], 448.0))

    back = fp8.unpack_v32(packed)
    assert back.dtype == torch.float64 and back.shape == (3, 7, 576)
    assert (back[0, 0, :128] == 0).all() and (back[0, 2, :512] == 0).all()
    assert torch.equal(back[..., 512:], rows[..., 512:].to(torch.bfloat16).double())
    # Each value within one e4m3 rounding of its group: 2^-4 relative in the normal range,
    # half a subnormal step (2^-10 of the scale) below it.
    x = rows[..., :512].double()
    step = scales.double().repeat_interleave(128, -1)
    err = (back[..., :512] - x).abs()
    assert (err <= torch.maximum(x.abs() * 2 ** -4, step * 2 ** -10) * (1 + 1e-6)).all()
    # The group's largest magnitude comes back to float32 rounding of the scale.
    big = x[1, 3, 384:512].abs().argmax()
    assert back[1, 3, 384 + big].item() == pytest.approx(x[1, 3, 384 + big].item(), rel=1e-6)
    # Rope values representable in bf16 are exact; packing the unpacked rows is a no-op.
    assert torch.equal(fp8.pack_v32(back.float()), packed)


@pytest.mark.host
def test_pack_v32_saturates_rather_than_producing_nan():
    # amax / 448 rounds down in float32 for some amax, so amax / scale can land just above
    # 448: it must saturate to 448 (e4m3fn has no infinity; beyond 464 its cast gives nan).
    vals = torch.tensor([1.0 + k * 2 ** -23 for k in range(1, 4096, 7)])
    rows = torch.zeros(len(vals), 576)
    rows[:, 0] = vals
    rows[:, 1] = -vals
    stored = fp8.pack_v32(rows)[:, :2].contiguous().view(torch.float8_e4m3fn).float()
    assert torch.equal(stored.abs(), torch.full_like(stored, 448.0))


@pytest.mark.host
@pytest.mark.parametrize("bad", ["width", "int"])
def test_pack_and_unpack_v32_reject_other_shapes(bad):
    with pytest.raises(ValueError, match="pack_v32"):
        fp8.pack_v32(torch.zeros(2, 512) if bad == "width" else torch.zeros(2, 576,
                                                                            dtype=torch.int32))
    with pytest.raises(ValueError, match="unpack_v32"):
        fp8.unpack_v32(torch.zeros(2, 576, dtype=torch.uint8) if bad == "width"
                       else torch.zeros(2, 656))


def v32_case(lens, heads, *, q_dtype, page_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    case = make_case(lens, heads, page_size=page_size, dtype=torch.float32, device="cpu",
                     gen=gen)
    # Groups of different magnitudes, so a wrong group scale shows in the error.
    case.kv_cache[..., :512] *= torch.tensor([0.05, 1.0, 8.0, 0.5]).repeat_interleave(128)
    return (case.q.to(q_dtype).to(DEVICE), fp8.pack_v32(case.kv_cache).to(DEVICE),
            case.block_table.to(DEVICE), case.seq_lens.to(DEVICE))


def v32_reference(q, cache, table, lens):
    return mla_decode_reference(q.cpu(), fp8.unpack_v32(cache.cpu()), table.cpu(), lens.cpu(),
                                kv_lora_rank=KV_LORA_RANK, sm_scale=SM_SCALE)


def check_v32(plan, q, cache, table, lens, *, balanced=False):
    out, lse = run(plan, q, cache, table, lens, None, balanced=balanced)
    ref, ref_lse = v32_reference(q, cache, table, lens)
    assert rel_l2(out, ref) < 1e-2, plan.describe()
    live = lens.cpu() > 0
    # The dequantized tile is rounded to q's dtype before the dot: a bf16 q carries a
    # relative error of a few 1e-3 into scores of magnitude ~20 at 128 heads.
    got, want = lse.cpu().double()[live], ref_lse[live]
    assert ((got - want).abs() <= 2e-2 + 3e-3 * want.abs()).all(), plan.describe()
    assert (out[~live.to(out.device)] == 0).all()


@pytest.mark.host
def test_fp8_tile_tokens():
    from graphbucket.kernels import launch
    from graphbucket.kernels.launch import kv_tile_tokens, tile_tokens

    cache = torch.zeros(1, 64, 656, dtype=torch.uint8)
    for heads in (16, 128):
        for stream in (None, LONG_PAGE_AHEAD, TOKEN_STREAM):
            kw = {} if stream is None else {"stream": stream}
            plan = plan_mla_decode(1, heads, 1, num_sms=8, **kw)
            # Head-major fp8 tiles stream through registers: the plan's fp8 tile tokens
            # at 16 rows, 16 above.
            want = max(16, plan.block_n // 2) if plan.token_major else \
                plan.fp8.tile_tokens if plan.block_h <= 16 else 16
            assert tile_tokens(plan, 1, v32=True) == want
            assert kv_tile_tokens(plan, cache) == want
            # Register-prefetched tiles at 16 rows run on the plan's fp8 warps; other
            # plans and 2-byte caches keep the plan's.
            prefetched = not plan.token_major and plan.block_h <= 16
            assert launch.stage1_warps(plan, 1) == \
                (plan.fp8.tile_warps if prefetched else plan.num_warps)
            assert launch.stage1_warps(plan, 2) == plan.num_warps
            # Without: V3.2 tiles are half the plan's.
            plain = dataclasses.replace(plan, fp8=Fp8Stream(register_prefetch=False))
            assert tile_tokens(plain, 1, v32=True) == max(16, plan.block_n // 2)


@pytest.mark.parametrize("lens", [[1], [16, 17], [33, 0, 100, 5]])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("splits", [1, 3])
def test_v32_split_kv_matches_float64_over_the_unpacked_cache(lens, page_size, splits):
    q, cache, table, seq_lens = v32_case(lens, 16, q_dtype=Q_DTYPES[-1], page_size=page_size)
    check_v32(plan_mla_decode(len(lens), 16, 1, num_sms=8).with_splits(splits),
              q, cache, table, seq_lens)


@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize(("lens", "splits"), [([33, 0, 100, 5], 1), ([100], 3)])
def test_v32_128_heads(q_dtype, lens, splits):
    # 64 query rows per program, half-token tiles. (The merge of 128 heads is slow in the
    # interpreter: fewer requests where there is one.)
    q, cache, table, seq_lens = v32_case(lens, 128, q_dtype=q_dtype, page_size=64, seed=6)
    check_v32(plan_mla_decode(len(lens), 128, 1, num_sms=8).with_splits(splits),
              q, cache, table, seq_lens)


@pytest.mark.parametrize("stream", [LONG_PAGE_AHEAD, TOKEN_STREAM])
@pytest.mark.parametrize("heads", [16, 128])
def test_v32_other_streams_and_query_rows(stream, heads):
    q, cache, table, seq_lens = v32_case([70, 3], heads, q_dtype=Q_DTYPES[-1], seed=7)
    # One split at 128 heads: the interpreter's merge of 128 heads is slow.
    splits = 2 if heads == 16 else 1
    check_v32(plan_mla_decode(2, heads, 1, num_sms=4, stream=stream).with_splits(splits),
              q, cache, table, seq_lens)


def test_v32_balanced_ragged_batch():
    lens = [130, 1, 0, 47]
    q, cache, table, seq_lens = v32_case(lens, 16, q_dtype=Q_DTYPES[-1], seed=8)
    check_v32(plan_balanced_mla_decode(len(lens), 16, num_sms=4), q, cache, table, seq_lens,
              balanced=True)


def test_v32_error_against_the_unquantized_cache_is_small():
    gen = torch.Generator().manual_seed(9)
    case = make_case([200, 31], 16, page_size=16, dtype=torch.float32, device="cpu", gen=gen)
    q = case.q.to(Q_DTYPES[-1]).to(DEVICE)
    plan = plan_mla_decode(2, 16, 1, num_sms=8).with_splits(2)
    out, _ = run(plan, q, fp8.pack_v32(case.kv_cache).to(DEVICE), case.block_table.to(DEVICE),
                 case.seq_lens.to(DEVICE), None)
    exact, _ = mla_decode_reference(q.cpu(), case.kv_cache, case.block_table, case.seq_lens,
                                    kv_lora_rank=KV_LORA_RANK, sm_scale=SM_SCALE)
    assert rel_l2(out, exact) < 0.1


@pytest.mark.parametrize("bad", ["kv_scale", "width_576", "width_660", "fp32_q", "misaligned",
                                 "balanced_kv_scale"])
def test_bad_v32_inputs_raise_before_launch_and_write_nothing(bad):
    q, cache, table, seq_lens = v32_case([20], 16, q_dtype=Q_DTYPES[-1])
    plan = plan_mla_decode(1, 16, 1, num_sms=8)
    launch, ws, scale, match = mla_decode, None, None, "kv_cache"
    if bad in ("kv_scale", "balanced_kv_scale"):
        scale, match = torch.ones(1, device=DEVICE), "kv_scale"
        if bad == "balanced_kv_scale":
            plan = plan_balanced_mla_decode(1, 16, num_sms=4)
            ws = SplitWorkspace.allocate(1, 16, 1, KV_LORA_RANK, DEVICE,
                                         max_items=plan.max_work_items)
            launch = mla_decode_balanced
    elif bad == "width_576":
        cache = cache[..., :576].contiguous()  # per-tensor width in bytes: not a V3.2 row
    elif bad == "width_660":
        cache = torch.nn.functional.pad(cache, (0, 4))
    elif bad == "fp32_q":
        q, match = q.float(), "dtypes"
    else:
        # 656-byte rows at a 660-byte stride: not 16-byte aligned.
        cache = torch.nn.functional.pad(cache, (0, 4))[..., :656]
    out = torch.full((1, 16, KV_LORA_RANK), float("nan"), dtype=q.dtype, device=DEVICE)
    with pytest.raises(ValueError, match=match) as err:
        launch(q, cache, table, seq_lens, out, ws, plan=plan, sm_scale=SM_SCALE,
               kv_scale=scale)
    if bad.startswith("width"):
        assert "656" in str(err.value) and "V3.2" in str(err.value)
    assert torch.isnan(out).all()


# ---- cache formats by name; the store op writes V3.2 rows -----------------------------------


@pytest.mark.host
def test_formats_rows_and_bytes():
    assert fp8.KV_CACHE_FORMATS == ("bf16", "fp8-tensor", "fp8-v32")
    assert fp8.cache_row("bf16", 576, torch.bfloat16) == (576, torch.bfloat16)
    assert fp8.cache_row("fp8-tensor", 80, torch.float16) == (80, torch.float8_e4m3fn)
    assert fp8.cache_row("fp8-v32", 576, torch.bfloat16) == (656, torch.uint8)
    assert [fp8.row_bytes(f, 576, torch.bfloat16) for f in fp8.KV_CACHE_FORMATS] == \
        [1152, 576, 656]
    with pytest.raises(ValueError, match="512 latent and 64 rope"):
        fp8.cache_row("fp8-v32", 80, torch.float16)
    with pytest.raises(ValueError, match="kv_cache_format must be one of"):
        fp8.check_format("fp8")
    assert fp8.format_of(torch.zeros(1, 2, 576, dtype=torch.bfloat16)) == "bf16"
    assert fp8.format_of(torch.zeros(1, 2, 576).to(fp8.FP8_DTYPE)) == "fp8-tensor"
    assert fp8.format_of(torch.zeros(1, 2, 656, dtype=torch.uint8)) == "fp8-v32"


@pytest.mark.host
def test_as_stored_and_dequantize_cache_agree_with_pack_and_quantize(seeded):
    gen = torch.Generator().manual_seed(seeded)
    rows = torch.randn(2, 3, 576, generator=gen, dtype=torch.float64)
    scale = fp8.scale_for(rows.abs().amax().float())
    assert torch.equal(fp8.as_stored(rows, "fp8-v32"), fp8.unpack_v32(fp8.pack_v32(rows.float())))
    assert torch.equal(fp8.as_stored(rows, "fp8-tensor", scale),
                       fp8.dequantize(fp8.quantize(rows, scale), scale))
    assert torch.equal(fp8.as_stored(rows, "bf16"), rows)
    assert torch.equal(fp8.dequantize_cache(fp8.pack_v32(rows.float())),
                       fp8.as_stored(rows, "fp8-v32"))
    assert torch.equal(fp8.dequantize_cache(fp8.quantize(rows, scale), scale),
                       fp8.as_stored(rows, "fp8-tensor", scale))
    # Within e4m3 rounding of the values (one group scale / the tensor scale).
    assert (fp8.as_stored(rows, "fp8-v32") - rows).abs().max() < rows.abs().max() * 2 ** -4


def store_inputs(seed: int, *, r: int = 512, p: int = 64):
    """kv_a [4, r + p] with latent groups of very different magnitudes, norm weight, rope
    table, positions, slots (row 2: negative slot, row 3: seq_len 0; both write nothing)."""
    from graphbucket.models.ops import rope_cache

    gen = torch.Generator().manual_seed(seed)
    kv_a = torch.randn(4, r + p, generator=gen)
    kv_a[:, :r] *= torch.tensor([1e-3, 1.0, 30.0, 0.2]).repeat_interleave(r // 4)
    weight = torch.rand(r, generator=gen) + 0.5
    rope = rope_cache(p, 64, 10000.0, device=DEVICE)
    pos = torch.tensor([5, 0, 63, 7], device=DEVICE)
    slots = torch.tensor([3, 17, -1, 9], device=DEVICE)
    lens = torch.tensor([6, 1, 64, 0], dtype=torch.int32, device=DEVICE)
    return kv_a.to(DEVICE), weight.to(DEVICE), rope, pos, slots, lens


def test_store_kv_writes_v32_rows_as_pack_v32(seeded):
    from graphbucket.models.ops import store_kv

    kv_a, weight, rope, pos, slots, lens = store_inputs(seeded)
    plain = torch.zeros(4, 8, 576, device=DEVICE)
    store_kv(kv_a, weight, rope, pos, slots, lens, plain, 1e-6)
    cache = torch.full((4, 8, 656), 0xAB, dtype=torch.uint8, device=DEVICE)
    store_kv(kv_a, weight, rope, pos, slots, lens, cache, 1e-6, kv_cache_format="fp8-v32")
    got, want = cache.cpu().view(32, 656), fp8.pack_v32(plain.cpu()).view(32, 656)
    written = torch.zeros(32, dtype=torch.bool)
    written[[3, 17]] = True
    assert (got[~written] == 0xAB).all()  # negative slot, padding row: nothing written
    got, want = got[written], want[written]
    if ON_GPU:
        assert torch.equal(got, want)  # the same bytes as pack_v32
        return
    # The interpreter: scales exact; rope within one bf16 step (it truncates instead of
    # rounding); the latent exact but where its e4m3 cast loses the carry (test above).
    assert torch.equal(got[:, 512:528], want[:, 512:528])
    rope_got = got[:, 528:].contiguous().view(torch.bfloat16).double()
    rope_want = want[:, 528:].contiguous().view(torch.bfloat16).double()
    assert ((rope_got - rope_want).abs() <= rope_want.abs() * 2 ** -7 + 1e-30).all()
    stored_want = want[:, :512].contiguous().view(fp8.FP8_DTYPE).double()
    stored_got = got[:, :512].contiguous().view(fp8.FP8_DTYPE).double()
    scales = want[:, 512:528].contiguous().view(torch.float32).double()
    exact = plain.cpu().view(32, 576)[written, :512].double() / scales.repeat_interleave(128, 1)
    mag = stored_want.abs()
    carry = (mag > exact.abs()) & (mag == 2 ** torch.log2(mag).round())
    # Below e4m3's smallest normal (2^-6) the interpreter's cast truncates: one subnormal
    # step (2^-9) toward zero (a few seeds in a hundred have such a value).
    subnormal = (exact.abs() < 2 ** -6) & ((stored_got - stored_want).abs() <= 2 ** -9)
    # A value at a rounding midpoint up to float32's last bit (the kernel scales by the
    # reciprocal, pack_v32 divides): one e4m3 step either way (a seed in a few hundred).
    top = torch.maximum(stored_got.abs(), stored_want.abs())
    step = 2 ** (torch.floor(torch.log2(top.clamp_min(2 ** -6))) - 3)
    midpoint = (stored_got.abs() + stored_want.abs()) / 2
    tie = ((stored_got - stored_want).abs() <= step) \
        & ((exact.abs() - midpoint).abs() <= exact.abs() * 2 ** -20)
    exempt = carry | subnormal | tie
    assert torch.equal(stored_got[~exempt], stored_want[~exempt])
    assert exempt.float().mean() < 0.1


@pytest.mark.gpu
def test_gpu_store_kv_v32_bytes_equal_pack_v32_over_many_rows(seeded):
    from graphbucket.models.ops import rope_cache, store_kv

    gen = torch.Generator(device="cuda").manual_seed(seeded)
    n = 4096
    kv_a = torch.randn(n, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv_a[::7, 128:256] = 0  # zero groups take the smallest scale and store zeros
    weight = torch.rand(512, generator=gen, device="cuda") + 0.5
    rope = rope_cache(64, 8192, 10000.0, device="cuda")
    pos = torch.randint(0, 8192, (n,), generator=gen, device="cuda")
    slots = torch.randperm(n, generator=gen, device="cuda")
    lens = torch.ones(n, dtype=torch.int32, device="cuda")
    plain = torch.zeros(n // 64, 64, 576, device="cuda")
    store_kv(kv_a, weight, rope, pos, slots, lens, plain, 1e-6)
    cache = torch.zeros(n // 64, 64, 656, dtype=torch.uint8, device="cuda")
    store_kv(kv_a, weight, rope, pos, slots, lens, cache, 1e-6, kv_cache_format="fp8-v32")
    want = fp8.pack_v32(plain)
    # Rope bytes are equal; group scales (amax / 448) agree to a float32 ulp (the H200:
    # a third of them differ in the last bit between the kernel's and torch's division),
    # and a latent value may round to the neighbouring e4m3 value (2 of 2M), never further.
    assert torch.equal(cache[..., 528:], want[..., 528:])
    got_s = cache[..., 512:528].contiguous().view(torch.float32)
    want_s = want[..., 512:528].contiguous().view(torch.float32)
    assert ((got_s - want_s).abs() <= 2.4e-7 * want_s).all()
    differ = cache[..., :512] != want[..., :512]
    assert differ.float().mean() < 1e-4
    # One e4m3 step: at most 1/8 of the value (normals), 2^-9 (subnormals).
    got8 = cache[..., :512].contiguous().view(torch.float8_e4m3fn).float()
    want8 = want[..., :512].contiguous().view(torch.float8_e4m3fn).float()
    step = torch.maximum(want8.abs() / 8, torch.full_like(want8, 2 ** -9))
    assert ((got8 - want8).abs() <= step)[differ].all()


@pytest.mark.host
@pytest.mark.parametrize("bad", ["v32_bf16_cache", "v32_width_576", "v32_width_660",
                                 "v32_scale", "v32_misaligned", "v32_small_latent",
                                 "tensor_no_scale", "tensor_two_scales", "tensor_f16_scale",
                                 "tensor_uint8_cache", "bf16_declared_e4m3_cache"])
def test_bad_store_kv_inputs_raise_before_launch_and_write_nothing(bad):
    from graphbucket.models.ops import store_kv

    kv_a, weight, rope, pos, slots, lens = store_inputs(0)
    fmt, scale, match = bad.split("_")[0], None, "format needs"
    fmt = {"v32": "fp8-v32", "tensor": "fp8-tensor"}.get(fmt, "bf16")
    cache = torch.full((4, 8, 656), 0xAB, dtype=torch.uint8, device=DEVICE)
    if bad == "v32_bf16_cache":
        cache = torch.full((4, 8, 576), 3.0, dtype=torch.bfloat16, device=DEVICE)
    elif bad == "v32_width_576":
        cache = cache[..., :576].contiguous()
    elif bad == "v32_width_660":
        cache = torch.nn.functional.pad(cache, (0, 4), value=0xAB)
    elif bad == "v32_scale":
        scale, match = torch.ones(1, device=DEVICE), "kv_scale"
    elif bad == "v32_misaligned":
        cache, match = torch.nn.functional.pad(cache, (0, 4), value=0xAB)[..., :656], "aligned"
    elif bad == "v32_small_latent":
        kv_a, weight, match = kv_a[:, 64:], weight[64:], "512 latent"
    elif bad.startswith("tensor"):
        cache = torch.full((4, 8, 576), 0xAB, dtype=torch.uint8, device=DEVICE)
        if bad != "tensor_uint8_cache":
            cache, match = cache.view(fp8.FP8_DTYPE), "kv_scale"
        scale = {"tensor_two_scales": torch.ones(2, device=DEVICE),
                 "tensor_f16_scale": torch.ones(1, dtype=torch.float16, device=DEVICE),
                 "tensor_uint8_cache": torch.ones(1, device=DEVICE)}.get(bad)
    else:  # an e4m3 cache declared unquantized
        cache = torch.full((4, 8, 576), 0xAB, dtype=torch.uint8, device=DEVICE).view(
            fp8.FP8_DTYPE)
    before = cache.view(torch.uint8).clone() if cache.dtype != torch.bfloat16 else cache.clone()
    with pytest.raises(ValueError, match=match) as err:
        store_kv(kv_a, weight, rope, pos, slots, lens, cache, 1e-6, kv_scale=scale,
                 kv_cache_format=fmt)
    if match == "format needs":  # names the declared format, the received cache and the fix
        assert fmt in str(err.value) and str(cache.dtype) in str(err.value)
    after = cache.view(torch.uint8) if cache.dtype != torch.bfloat16 else cache
    assert torch.equal(after, before)


def test_dense_backend_dequantizes_a_v32_cache(seeded):
    from graphbucket.backends import get_backend

    lens = [33, 0, 100]
    q, cache, table, seq_lens = v32_case(lens, 16, q_dtype=Q_DTYPES[-1], seed=seeded)
    backend = get_backend("dense", num_sms=8)
    plan = backend.plan(len(lens), 16, 64)
    out = torch.full((len(lens), 16, KV_LORA_RANK), float("nan"), dtype=q.dtype, device=DEVICE)
    backend.run(q, cache, table, seq_lens, out, None, plan=plan, sm_scale=SM_SCALE)
    assert rel_l2(out, v32_reference(q, cache, table, seq_lens)[0]) < 1e-2


@triton.jit
def _e4m3_probe_kernel(CODES, SCALES, OUT, MODE: tl.constexpr, SCALED: tl.constexpr):
    offs = tl.arange(0, 256)
    codes = tl.load(CODES + offs)
    if SCALED:
        out = e4m3_to_f16(codes, MODE, tl.load(SCALES + offs))
    else:
        out = e4m3_to_f16(codes, MODE)
    tl.store(OUT + offs, out)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bits", "cvt"])
@pytest.mark.parametrize("scaled", [False, True])
def test_gpu_e4m3_to_f16_is_exact_for_every_code(mode, scaled, seeded):
    # Every e4m3 code through the kernels' conversion: exactly the e4m3 value times the
    # mode's unit (and times an f16 scale, rounded once to f16, as torch's f16 product).
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).cuda()
    values = codes.view(torch.float8_e4m3fn).float()
    scales = (torch.rand(256, device="cuda") * 4 + 0.25).half()
    out = torch.empty(256, dtype=torch.float16, device="cuda")
    _e4m3_probe_kernel[(1,)](codes, scales, out, MODE=mode, SCALED=scaled)
    unit = E4M3_UNIT_BITS.value if mode == "bits" else 1.0
    want = (values * unit).half()
    if scaled:
        want = want * scales
    finite = ~torch.isnan(values)  # the NaN codes (never stored) read as +-480 x unit
    assert torch.equal(out[finite], want[finite])


@pytest.mark.host
def test_fp8_dequant_mode_falls_back_where_inline_assembly_cannot_run(monkeypatch):
    from graphbucket.kernels import launch

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    plan = plan_mla_decode(1, 16, 1000)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert launch.fp8_dequant(plan, cuda) == plan.fp8.dequant == "bits"
    assert launch.fp8_dequant(plan, cpu) == "float"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter has no inline assembly
    assert launch.fp8_dequant(plan, cuda) == "float"
    cvt = dataclasses.replace(plan, fp8=Fp8Stream(dequant="cvt"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert launch.fp8_dequant(cvt, cuda) == "cvt"
    with pytest.raises(ValueError, match="dequant='fast'"):
        Fp8Stream(dequant="fast")
