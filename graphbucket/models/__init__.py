"""A small MLA decoder with DeepSeek-V3 / Kimi-like per-rank shapes, for benchmarks and
examples: seeded random weights, a paged latent cache, absorbed-MLA decode through the
backend with the context's frozen plan, a float64 reference path for tests, and its
tensor-parallel shard (``TPMLADecoder``: heads and MLP columns split, all-reduces inside)."""

from __future__ import annotations

from graphbucket.models.config import (
    PRESETS,
    MLAConfig,
    deepseek_v3_tp8,
    kimi_tp8,
    tiny,
    tiny_v32,
)
from graphbucket.models.mla import MLADecoder
from graphbucket.models.paging import (
    decode_batch,
    prefill_random,
    random_block_table,
    slot_mapping_for,
)
from graphbucket.models.step_reference import decode_reference
from graphbucket.models.tp import TPMLADecoder, shard_config, shard_weights, tp_full_config

__all__ = ["PRESETS", "MLAConfig", "MLADecoder", "TPMLADecoder", "decode_batch",
           "decode_reference", "deepseek_v3_tp8", "kimi_tp8", "prefill_random",
           "random_block_table", "shard_config", "shard_weights", "slot_mapping_for", "tiny",
           "tiny_v32", "tp_full_config"]
