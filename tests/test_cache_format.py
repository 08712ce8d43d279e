"""Cache formats: the launch constexprs each format gives the decode kernels.

The expectations below are fixed numbers (tile tokens, warps, the format tag and the
fp8 switches per cache dtype and stream), so a change in what any format launches fails
here. The kernels run for real in the interpreter; a wrapper records what each launch
passes them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphbucket import fp8
from graphbucket.kernels import (
    SplitWorkspace,
    launch,
    launch_balanced,
    mla_decode,
    mla_decode_balanced,
)
from graphbucket.plan import plan_balanced_mla_decode, plan_mla_decode
from graphbucket.plan_streams import (
    LONG_STREAM,
    ROWS32_STREAM,
    ROWS_STREAM,
    TOKEN_STREAM,
    WIDE_FUSED,
    WIDE_STREAM,
)
from tests.kernel_cases import SM_SCALE, make_case

STREAMS = {"LONG": LONG_STREAM, "WIDE": WIDE_STREAM, "TOKEN": TOKEN_STREAM,
           "ROWS": ROWS_STREAM, "ROWS32": ROWS32_STREAM, "WIDE_FUSED": WIDE_FUSED}
# Per cache dtype: (KV_FORMAT, SCALED, DOT_PRECISION).
FORMAT_ARGS = {"float16": ("dense", False, "tf32"), "float32": ("dense", False, "ieee"),
               "e4m3": ("dense", True, "tf32"), "uint8": ("v32", False, "tf32")}
# (cache dtype, stream) -> (BLOCK_N, num_warps, REG_PREFETCH), with the fp8 register
# prefetch on (the default) and off (a benchmark variant).
TILES = {
    True: {
        ("float16", "LONG"): (64, 4, False), ("float16", "WIDE"): (32, 4, False),
        ("float16", "TOKEN"): (64, 4, False), ("float16", "ROWS"): (64, 8, False),
        ("float16", "ROWS32"): (32, 4, False), ("float16", "WIDE_FUSED"): (32, 4, False),
        ("float32", "LONG"): (32, 4, False), ("float32", "WIDE"): (16, 4, False),
        ("float32", "TOKEN"): (32, 4, False), ("float32", "ROWS"): (32, 8, False),
        ("float32", "ROWS32"): (16, 4, False), ("float32", "WIDE_FUSED"): (16, 4, False),
        ("e4m3", "LONG"): (32, 4, True), ("e4m3", "WIDE"): (32, 4, True),
        ("e4m3", "TOKEN"): (64, 4, False), ("e4m3", "ROWS"): (16, 8, True),
        ("e4m3", "ROWS32"): (16, 4, True), ("e4m3", "WIDE_FUSED"): (32, 4, True),
        ("uint8", "LONG"): (32, 4, True), ("uint8", "WIDE"): (32, 4, True),
        ("uint8", "TOKEN"): (32, 4, False), ("uint8", "ROWS"): (16, 8, True),
        ("uint8", "ROWS32"): (16, 4, True), ("uint8", "WIDE_FUSED"): (32, 4, True),
    },
    False: {
        ("float16", "LONG"): (64, 4, False), ("float16", "WIDE"): (32, 4, False),
        ("float16", "TOKEN"): (64, 4, False), ("float16", "ROWS"): (64, 8, False),
        ("float16", "ROWS32"): (32, 4, False), ("float16", "WIDE_FUSED"): (32, 4, False),
        ("float32", "LONG"): (32, 4, False), ("float32", "WIDE"): (16, 4, False),
        ("float32", "TOKEN"): (32, 4, False), ("float32", "ROWS"): (32, 8, False),
        ("float32", "ROWS32"): (16, 4, False), ("float32", "WIDE_FUSED"): (16, 4, False),
        ("e4m3", "LONG"): (64, 4, False), ("e4m3", "WIDE"): (32, 4, False),
        ("e4m3", "TOKEN"): (64, 4, False), ("e4m3", "ROWS"): (32, 8, False),
        ("e4m3", "ROWS32"): (32, 4, False), ("e4m3", "WIDE_FUSED"): (32, 4, False),
        ("uint8", "LONG"): (32, 4, False), ("uint8", "WIDE"): (16, 4, False),
        ("uint8", "TOKEN"): (32, 4, False), ("uint8", "ROWS"): (32, 8, False),
        ("uint8", "ROWS32"): (16, 4, False), ("uint8", "WIDE_FUSED"): (16, 4, False),
    },
}
RECORDED = ("BLOCK_N", "num_warps", "REG_PREFETCH", "KV_FORMAT", "SCALED", "DOT_PRECISION",
            "DEQUANT", "RAW_VEC")


class _Recorded:
    """A Triton kernel that records the keyword arguments of each launch, then runs."""

    def __init__(self, kernel, tag: str, calls: list):
        self.kernel, self.tag, self.calls = kernel, tag, calls

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            self.calls.append((self.tag, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch_


def _cache(kind: str, rows: torch.Tensor):
    if kind == "e4m3":
        scale = fp8.scale_for(rows.abs().amax())
        return fp8.quantize(rows, scale), scale, torch.float16
    if kind == "uint8":
        return fp8.pack_v32(rows), None, torch.float16
    return rows.to(getattr(torch, kind)), None, getattr(torch, kind)


def _prefetch(plan, on: bool):
    """``plan`` with the fp8 register prefetch on or off."""
    return dataclasses.replace(plan, fp8=dataclasses.replace(plan.fp8, register_prefetch=on))


@pytest.mark.interpreter
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("kind", list(FORMAT_ARGS))
def test_each_format_launches_the_same_constexprs(monkeypatch, kind, prefetch):
    calls: list = []
    for name, module in (("mla_decode_stage1_kernel", launch),
                         ("mla_decode_merge_kernel", launch),
                         ("balanced_stage1_kernel", launch_balanced)):
        monkeypatch.setattr(module, name, _Recorded(getattr(module, name), name, calls))
    tag, scaled, precision = FORMAT_ARGS[kind]
    for stream_name, stream in STREAMS.items():
        heads = 64 if stream.block_h == 64 else 16
        case = make_case([40], heads, page_size=16, dtype=torch.float32, device="cpu",
                         gen=torch.Generator().manual_seed(0))
        cache, scale, q_dtype = _cache(kind, case.kv_cache)
        q, out = case.q.to(q_dtype), torch.empty(1, heads, 512, dtype=q_dtype)
        block_n, warps, reg_prefetch = TILES[prefetch][(kind, stream_name)]
        want = (block_n, warps, reg_prefetch, tag, scaled, precision, "float", 8)

        # One split (the interpreter's merge is slow); the LONG plan runs two and the merge.
        hint = 128 if stream_name == "LONG" else 40
        plan = _prefetch(plan_mla_decode(1, heads, hint, stream=stream), prefetch)
        calls.clear()
        mla_decode(q, cache, case.block_table, case.seq_lens, out,
                   SplitWorkspace.allocate(1, heads, plan.num_kv_splits, 512, "cpu"),
                   plan=plan, sm_scale=SM_SCALE, kv_scale=scale)
        got = dict(calls)
        assert tuple(got["mla_decode_stage1_kernel"][k] for k in RECORDED) == want, \
            (kind, stream_name)
        assert got["mla_decode_stage1_kernel"]["TILE_IN_PAGE"] == (16 % block_n == 0)
        assert plan.merge_kernel == (stream_name == "LONG")
        if plan.merge_kernel:
            assert got["mla_decode_merge_kernel"]["BLOCK_N"] == block_n, (kind, stream_name)

        plan = _prefetch(plan_balanced_mla_decode(1, heads, stream=stream, programs=2),
                         prefetch)
        calls.clear()
        mla_decode_balanced(q, cache, case.block_table, case.seq_lens, out,
                            SplitWorkspace.allocate(1, heads, 1, 512, "cpu",
                                                    max_items=plan.max_work_items),
                            plan=plan, sm_scale=SM_SCALE, kv_scale=scale)
        got = dict(calls)["balanced_stage1_kernel"]
        assert tuple(got[k] for k in RECORDED) == want, (kind, stream_name, "balanced")


# ---- the registry ---------------------------------------------------------------------------


@pytest.mark.host
def test_formats_by_name_with_their_rows_scales_and_kernel_tags():
    rows = {name: (fmt.scale, fmt.kernel_tag, fmt.row_bytes(576, torch.bfloat16),
                   fmt.cache_row(576, torch.float16))
            for name, fmt in fp8.CACHE_FORMATS.items()}
    assert rows == {
        "bf16": ("none", "dense", 1152, (576, torch.float16)),
        "fp8-tensor": ("per-tensor", "dense", 576, (576, torch.float8_e4m3fn)),
        "fp8-v32": ("per-token-group", "v32", 656, (656, torch.uint8)),
    }
    assert fp8.get_cache_format("fp8-v32").quantized and not fp8.get_cache_format("bf16").quantized
    with pytest.raises(ValueError, match=r"one of \('bf16', 'fp8-tensor', 'fp8-v32'\), got 'fp8'"):
        fp8.get_cache_format("fp8")
    with pytest.raises(ValueError, match="scale must be one of"):
        fp8.CacheFormat("x", "per-row", "dense", (torch.bfloat16,))


@pytest.mark.host
def test_a_cache_dtype_names_its_format():
    names = {d: fp8.format_of_dtype(d).name for d in
             (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8)}
    assert names == {torch.bfloat16: "bf16", torch.float16: "bf16", torch.float32: "bf16",
                     torch.float8_e4m3fn: "fp8-tensor", torch.uint8: "fp8-v32"}
    assert fp8.format_of_size(4).name == fp8.format_of_size(2).name == "bf16"
    assert fp8.format_of_size(1).name == "fp8-tensor"
    assert fp8.format_of_size(1, v32=True).name == "fp8-v32"


@pytest.mark.host
@pytest.mark.parametrize("name", ["bf16", "fp8-tensor", "fp8-v32"])
def test_store_then_dequantize_is_what_the_reference_reads(name):
    fmt = fp8.get_cache_format(name)
    rows = torch.randn(3, 5, 576, generator=torch.Generator().manual_seed(1))
    scale = fp8.scale_for(rows.abs().amax()) if fmt.scale == "per-tensor" else None
    stored = fmt.store(rows, scale)
    assert stored.dtype == fmt.stored_dtype(torch.float32)
    assert stored.shape[-1] == fmt.cache_row(576, torch.float32)[0]
    back = fmt.dequantize(stored, scale)
    assert back.dtype == torch.float64 and back.shape == rows.shape
    assert torch.equal(back, fmt.as_stored(rows, scale))
    # e4m3 keeps 3 mantissa bits: at most 2^-4 of the largest value per row group.
    assert (back - rows.double()).abs().max() <= rows.abs().max() * 2 ** -4
