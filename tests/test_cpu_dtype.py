"""On the CPU the kernels run in Triton's interpreter, whose bfloat16 ``tl.dot`` is wrong:
the model defaults to float32 there, and bfloat16 is refused before any kernel runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_cases import KV_LORA_RANK, SM_SCALE, make_case

from graphbucket.kernels import SplitWorkspace, mla_decode, mla_decode_balanced
from graphbucket.models import (
    MLADecoder,
    decode_batch,
    prefill_random,
    random_block_table,
    tiny,
    tiny_v32,
)
from graphbucket.plan import plan_balanced_mla_decode, plan_mla_decode
from graphbucket.runner import GraphBucketRunner

PAGE = 16


def test_the_cpu_default_is_float32_or_float16_over_an_fp8_cache():
    assert MLADecoder(tiny(), num_pages=4, page_size=PAGE, device="cpu").dtype == torch.float32
    fp8_tensor = MLADecoder(tiny(), num_pages=4, page_size=PAGE, device="cpu",
                            kv_cache_format="fp8-tensor", kv_scale=0.01)
    fp8_v32 = MLADecoder(tiny_v32(), num_pages=4, page_size=PAGE, device="cpu",
                         kv_cache_dtype=torch.uint8)
    assert fp8_tensor.dtype == fp8_v32.dtype == torch.float16


@pytest.mark.gpu
def test_the_cuda_default_is_bfloat16():
    assert MLADecoder(tiny(), num_pages=4, page_size=PAGE, device="cuda").dtype == torch.bfloat16


@pytest.mark.interpreter
def test_a_bfloat16_model_on_the_cpu_is_refused_before_any_kernel_runs():
    model = MLADecoder(tiny(num_layers=1), num_pages=8, page_size=PAGE, dtype=torch.bfloat16,
                       device="cpu")
    table = random_block_table(1, 4, model.num_pages, np.random.default_rng(0))
    prefill_random(model, table, [40])
    before = [c.clone() for c in model.kv_caches]
    runner = GraphBucketRunner.for_model(model, policy="eager", max_model_len=64,
                                         batch_sizes=[1], progress=False)
    batch = decode_batch(model, [41], table, torch.randn(1, 64).to(torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 on the CPU.*Use float32"):
        runner.step(batch)
    # The new token's cache row is the forward's first write: nothing ran.
    assert all(torch.equal(a, b) for a, b in zip(model.kv_caches, before, strict=True))
    runner.close()


@pytest.mark.interpreter
@pytest.mark.parametrize("balanced", [False, True])
def test_the_kernels_refuse_bfloat16_on_the_cpu_and_leave_out_untouched(balanced):
    case = make_case([37, 300], 16, page_size=PAGE, dtype=torch.bfloat16, device="cpu")
    if balanced:
        plan = plan_balanced_mla_decode(2, 16, num_sms=8)
        launch = mla_decode_balanced
    else:
        plan = plan_mla_decode(2, 16, 300, num_sms=8)
        launch = mla_decode
    assert balanced or plan.use_stage2, "a plan with splits: the workspace is checked too"
    workspace = SplitWorkspace.allocate(2, 16, max(1, plan.num_kv_splits), KV_LORA_RANK,
                                        "cpu", max_items=plan.max_work_items)
    out = torch.full((2, 16, KV_LORA_RANK), float("nan"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"q=torch.bfloat16.*float32.*float16"):
        launch(case.q, case.kv_cache, case.block_table, case.seq_lens, out, workspace,
               plan=plan, sm_scale=SM_SCALE)
    assert out.isnan().all()


@pytest.mark.interpreter
def test_float16_and_float32_pass_the_same_check():
    for dtype in (torch.float16, torch.float32):
        case = make_case([37], 16, page_size=PAGE, dtype=dtype, device="cpu")
        plan = plan_mla_decode(1, 16, 37, num_sms=8)
        out = torch.full((1, 16, KV_LORA_RANK), float("nan"), dtype=dtype)
        mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out, None,
                   plan=plan, sm_scale=SM_SCALE)
        assert not out.isnan().any()
