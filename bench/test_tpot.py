"""TPOT suite (pytest-benchmark): one round = one full decode step of one policy.

On CUDA: the DeepSeek-V3 TP8-shaped model (``GRAPHBUCKET_TPOT_LAYERS`` layers, default 4;
the real model has 61; ``GRAPHBUCKET_TPOT_PRESET=deepseek-v3-dp`` for all 128 heads on one
GPU), bf16, page 64, max_model_len 128K, batch {1, 8} (``GRAPHBUCKET_TPOT_BATCHES=1,8,32,64,128``
for others; ``GRAPHBUCKET_TPOT_MODEL=bench.hf_tpot:deepseek_v3`` for a user's model,
``bench/tpot_model.py``) x context
{1 .. 128K} x policy {eager, fixed-1, fixed-max, ladder}. Each runner is captured once per
module. The benchmark's own statistics time one step plus a synchronize per round: the
latency of an isolated step, host launch and sync included (noisier, ~70 us above TPOT).
``extra_info["tpot_ms"]`` is the TPOT: CUDA-event time of back-to-back steps, what
``bench/tpot.py`` reports; ``extra_info`` also holds ``floor_ms`` and the split count.

Without CUDA: the tiny model through the Triton interpreter at contexts {1, 40, 100},
batch 1, all four policies; run with ``--benchmark-disable``. Either way every test checks
its policy's output: against the float64 reference on CPU, against eager on CUDA.

    python3 -m pytest bench/test_tpot.py --benchmark-disable            # CPU smoke
    python3 -m pytest bench/test_tpot.py --benchmark-json=tpot.json     # H200
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from bench.tpot import (
    BATCHES,
    CONTEXTS,
    MAX_MODEL_LEN,
    TpotBench,
    default_layers,
    sync,
    time_tpot,
)
from bench.tpot_model import build_model, check_model, load_factory
from graphbucket.integrations import MIN_TRANSFORMERS
from graphbucket.models import PRESETS, tiny, tiny_v32
from graphbucket.policies import POLICIES

ON_GPU = torch.cuda.is_available()
BATCHES_ENV, PRESET_ENV = "GRAPHBUCKET_TPOT_BATCHES", "GRAPHBUCKET_TPOT_PRESET"
MODEL_ENV = "GRAPHBUCKET_TPOT_MODEL"  # module:factory of a user's TpotModel (GPU)


def gpu_batches() -> list[int]:
    """``$GRAPHBUCKET_TPOT_BATCHES`` (comma-separated capture sizes, e.g. 1,8,32,64,128)."""
    text = os.environ.get(BATCHES_ENV)
    if not text:
        return BATCHES
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"${BATCHES_ENV}={text!r}: give positive batch sizes separated by "
                         "commas, e.g. 1,8,32,64,128")
    return sorted(set(values))


def gpu_preset() -> str:
    """``$GRAPHBUCKET_TPOT_PRESET``: a graphbucket.models.PRESETS name (default the TP8 one;
    deepseek-v3-dp for 128 heads)."""
    name = os.environ.get(PRESET_ENV, "deepseek-v3-tp8")
    if name not in PRESETS:
        raise ValueError(f"${PRESET_ENV}={name!r}: use one of {sorted(PRESETS)}")
    return name


if ON_GPU:
    contexts, batches = CONTEXTS, gpu_batches()
else:
    contexts, batches = [1, 40, 100], [1]


@pytest.fixture(scope="module")
def bench():
    if ON_GPU and os.environ.get(MODEL_ENV):
        pages = -(-MAX_MODEL_LEN // 64)
        b = TpotBench.for_user(build_model(os.environ[MODEL_ENV], num_pages=max(batches) * pages,
                                           page_size=64, device="cuda",
                                           num_layers=default_layers()),
                               max_model_len=MAX_MODEL_LEN, batches=batches)
    elif ON_GPU:
        b = TpotBench.build(PRESETS[gpu_preset()](num_layers=default_layers()),
                            max_model_len=MAX_MODEL_LEN, batches=batches)
    else:
        b = TpotBench.build(tiny(), max_model_len=128, batches=batches, page_size=16,
                            dtype=torch.float32, device="cpu", backend_kwargs={"num_sms": 2})
    yield b
    b.close()


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def want_output(bench: TpotBench, context: int, batch: int) -> torch.Tensor:
    """Float64 reference on CPU; the eager policy's output on CUDA.

    Computed after the policy's step, from the same cache: every step writes its new token
    into the shared cache, and a run spread over processes orders the tests differently, so
    a reference cached from an earlier cache state would compare different attention inputs.
    """
    decode = bench.batch(context, batch)
    if ON_GPU or bench.user is not None:
        return bench.runners["eager"].step(decode).clone()
    lens = np.asarray(decode.seq_lens_cpu)
    return bench.model.forward_reference(
        decode.inputs["hidden"], positions=lens - 1, seq_lens=lens,
        block_table=decode.block_table_cpu, slot_mapping=decode.inputs["slot_mapping"])


@pytest.mark.parametrize("batch", batches)
@pytest.mark.parametrize("context", contexts)
@pytest.mark.parametrize("policy", POLICIES)
def test_tpot(benchmark, bench, policy, context, batch):
    runner, decode = bench.runners[policy], bench.batch(context, batch)
    plan = bench.plan(policy, context, batch)
    benchmark.group = f"tpot bs={batch} ctx={context}"
    benchmark.extra_info.update(policy=policy, context=context, batch=batch,
                                splits=plan.num_kv_splits, layers=bench.model.config.num_layers)

    def step_and_sync():
        runner.step(decode)
        sync()

    rounds = 1  # CPU: the interpreter is slow and the timing meaningless
    if ON_GPU:
        tpot = time_tpot(lambda: runner.step(decode))
        rounds = max(3, min(20, int(300 / tpot)))
        benchmark.extra_info["tpot_ms"] = round(tpot, 4)
        benchmark.extra_info["floor_ms"] = round(
            bench.floor_bytes(context, batch) / (bench_copy_gbps() * 1e6), 4)
    benchmark.pedantic(step_and_sync, rounds=rounds, warmup_rounds=1, iterations=1)
    got = runner.step(decode).clone()
    want = want_output(bench, context, batch)
    assert torch.isfinite(got).all()
    assert rel_l2(got, want) < (2e-2 if ON_GPU else 1e-4), (policy, context, batch)


_COPY_GBPS: list[float] = []


def bench_copy_gbps() -> float:
    """The device-to-device copy bandwidth, measured once per session (for floor_ms)."""
    if not _COPY_GBPS:
        from bench.gpu_timing import copy_gbps

        _COPY_GBPS.append(copy_gbps())
    return _COPY_GBPS[0]


@pytest.mark.skipif(ON_GPU, reason="CPU check of the fp8 plumbing; the GPU numbers come from "
                    "bench/tpot.py --kv-cache fp8-tensor fp8-v32")
@pytest.mark.parametrize("kv_cache", ["fp8-tensor", "fp8-v32"])
def test_fp8_cache_bench_matches_its_reference(kv_cache):
    config = tiny() if kv_cache == "fp8-tensor" else tiny_v32()
    b = TpotBench.build(config, max_model_len=128, batches=[1], page_size=16,
                        dtype=torch.float16, device="cpu", backend_kwargs={"num_sms": 2},
                        policies=("ladder",), kv_cache=kv_cache)
    try:
        assert b.model.kv_caches[0].dtype == (torch.float8_e4m3fn if kv_cache == "fp8-tensor"
                                              else torch.uint8)
        # The breakdown's bytes: 576 (fp8-tensor) or 656 (fp8-v32) bytes per token and layer.
        row = config.kv_dim if kv_cache == "fp8-tensor" else 656
        assert b.kv_bytes(100, 1) == 100 * config.num_layers * row
        decode = b.batch(100, 1)
        lens = np.asarray(decode.seq_lens_cpu)
        want = b.model.forward_reference(
            decode.inputs["hidden"], positions=lens - 1, seq_lens=lens,
            block_table=decode.block_table_cpu, slot_mapping=decode.inputs["slot_mapping"])
        assert rel_l2(b.runners["ladder"].step(decode), want) < 2e-2
    finally:
        b.close()


@pytest.mark.skipif(ON_GPU, reason="CPU check of the verify-step plumbing; the GPU numbers "
                    "come from bench/tpot.py --q-len 1 2 4")
def test_verify_step_bench_matches_its_reference_and_rows_count_per_token():
    from bench.tpot import tpot_row

    b = TpotBench.build(tiny(), max_model_len=128, batches=[1], page_size=16,
                        dtype=torch.float32, device="cpu", backend_kwargs={"num_sms": 2},
                        policies=("fixed-1", "ladder"), q_lens=(1, 2))
    try:
        for policy, runner in b.runners.items():
            assert runner.q_lens == (1, 2)
            decode = b.batch(100, 1, q_len=2)
            assert b.plan(policy, 100, 1, q_len=2).num_heads == 2 * b.model.config.num_heads
            lens = np.asarray(decode.seq_lens_cpu)
            want = b.model.forward_reference(
                decode.inputs["hidden"], positions=[98, 99], seq_lens=lens,
                block_table=decode.block_table_cpu, slot_mapping=decode.inputs["slot_mapping"],
                q_len=2)
            got = runner.step(decode)
            assert got.shape == (2, b.model.config.hidden_size)
            assert rel_l2(got, want) < 1e-4, policy
        assert b.floor_bytes(100, 1, 2) > b.floor_bytes(100, 1, 1)
    finally:
        b.close()
    row = tpot_row("ladder", 100, 1, step_ms=3.0, floor_ms=1.0, splits=4, q_len=2)
    assert (row["step_ms"], row["tpot_ms"], row["floor_ms"], row["q_len"]) == (3.0, 1.5, 0.5, 2)
    one = tpot_row("ladder", 100, 1, step_ms=3.0, floor_ms=1.0, splits=4)
    assert one["tpot_ms"] == one["step_ms"] == 3.0  # q_len 1: the keys read as before


def test_rows_name_their_format_and_files_both_options():
    from bench.tpot import output_name, tpot_row

    row = tpot_row("ladder", 100, 1, step_ms=3.0, floor_ms=1.0, splits=4, q_len=2,
                   kv_cache="fp8-v32", kv_mb=1.23456)
    assert (row["kv_cache"], row["kv_mb"], row["q_len"], row["tpot_ms"]) == \
        ("fp8-v32", 1.2346, 2, 1.5)
    assert tpot_row("ladder", 100, 1, step_ms=3.0, floor_ms=1.0, splits=4)["kv_cache"] == "bf16"
    preset = "deepseek-v3-tp8"
    assert output_name(preset, ["bf16"], [1]) == "h200-tpot.json"
    assert output_name(preset, ["fp8-tensor"], [1]) == "h200-tpot-fp8-tensor.json"
    assert output_name(preset, ["bf16", "fp8-tensor", "fp8-v32"], [1]) == "h200-tpot-fp8.json"
    assert output_name(preset, ["bf16"], [1, 2, 4]) == "h200-tpot-mtp.json"
    assert output_name(preset, ["bf16", "fp8-v32"], [1, 2]) == "h200-tpot-fp8-mtp.json"
    assert output_name("tiny", ["bf16", "bf16"], [1, 1]) == "h200-tpot-tiny.json"


def test_the_gpu_suite_takes_its_batches_and_preset_from_the_environment(monkeypatch):
    monkeypatch.setenv(BATCHES_ENV, "64,1,8,64")
    monkeypatch.setenv(PRESET_ENV, "deepseek-v3-dp")
    assert gpu_batches() == [1, 8, 64]
    assert PRESETS[gpu_preset()](num_layers=2).num_heads == 128
    for bad in ("", "0,8", "1;8"):
        monkeypatch.setenv(BATCHES_ENV, bad)
        if bad:
            with pytest.raises(ValueError, match="positive batch sizes"):
                gpu_batches()
        else:
            assert gpu_batches() == BATCHES
    monkeypatch.setenv(PRESET_ENV, "deepseek-v4")
    with pytest.raises(ValueError, match="use one of"):
        gpu_preset()


def test_a_users_transformers_model_replays_every_policy_like_eager():
    # The TPOT suite's entry for a model it did not build (bench/tpot_model.py), with
    # transformers' DeepSeek-V3 (tiny, float32) behind it: each policy's graphs must give
    # the eager step's logits, and a step's bytes count each token's experts.
    pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)
    if ON_GPU:
        pytest.skip("the CPU check of the entry; on CUDA set GRAPHBUCKET_TPOT_MODEL")
    model = build_model("bench.hf_tpot:deepseek_v3_small", num_pages=16, page_size=16,
                        device="cpu")
    b = TpotBench.for_user(model, max_model_len=128, batches=[2], policies=POLICIES)
    try:
        for context in (1, 40, 100):
            want = b.runners["eager"].step(b.batch(context, 2)).clone()
            assert want.shape == (2, model.hf_model.config.vocab_size)
            for policy in POLICIES:
                got = b.runners[policy].step(b.batch(context, 2))
                assert rel_l2(got, want) < 1e-5, (policy, context)
        assert {b.plan(p, 100, 2).num_kv_splits for p in ("fixed-1", "fixed-max")} != {1}
    finally:
        b.close()
    params = sum(p.numel() * p.element_size() for p in model.hf_model.parameters())
    assert model.step_bytes(1) < model.step_bytes(2) < params == model.step_bytes(64)
    assert model.kv_row_bytes() == (64 + 16) * 4 * 2  # latent + rope, float32, 2 layers
    assert b.floor_bytes(100, 2) == model.step_bytes(2) + 2 * 100 * model.kv_row_bytes()


def test_a_bad_model_entry_names_the_fix():
    for bad in ("bench.hf_tpot", "no_such_module:f", "bench.hf_tpot:nothing",
                "bench.hf_tpot:NAME"):
        with pytest.raises(ValueError, match="--model"):
            load_factory(bad)
    with pytest.raises(TypeError, match="without .*fill_cache.*step_bytes"):
        check_model(tiny_model_without_feed(), "bench.test_tpot:tiny_model_without_feed")


def tiny_model_without_feed():
    """graphbucket's own decoder: a runner forward, but not a TpotModel (no fill_cache)."""
    from graphbucket.models import MLADecoder

    return MLADecoder(tiny(), num_pages=4, page_size=16, dtype=torch.float32, device="cpu")
