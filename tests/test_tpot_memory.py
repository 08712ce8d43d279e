"""bench/tpot.py's KV-cache sizing (host arithmetic)."""

from __future__ import annotations

import pytest

from bench.tpot import PAGE_SIZE, RESERVE_BYTES, cache_bytes, fitting_context
from graphbucket.models import PRESETS

pytestmark = pytest.mark.host
H200_FREE = 139 << 30


@pytest.mark.parametrize("preset", ["deepseek-v3-tp8", "deepseek-v3-dp"])
def test_batch_128_at_128k_fits_an_h200_at_four_layers_not_eight(preset):
    four = PRESETS[preset](num_layers=4)
    assert cache_bytes(four, 128, 131072, "bf16") == 128 * 131072 * 4 * 1152  # 77 GB
    assert fitting_context(four, 128, 131072, "bf16", H200_FREE) == 131072
    eight = PRESETS[preset](num_layers=8)
    fit = fitting_context(eight, 128, 131072, "bf16", H200_FREE)
    assert fit % PAGE_SIZE == 0 and 0 < fit < 131072
    assert cache_bytes(eight, 128, fit, "bf16") <= H200_FREE - RESERVE_BYTES
    assert cache_bytes(eight, 128, fit + PAGE_SIZE, "bf16") > H200_FREE - RESERVE_BYTES
    # fp8 rows are half the bytes: eight layers fit again.
    assert fitting_context(eight, 128, 131072, "fp8-tensor", H200_FREE) == 131072
    assert fitting_context(eight, 128, 131072, "bf16", RESERVE_BYTES) == 0
