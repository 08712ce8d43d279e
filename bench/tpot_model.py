"""A user's model in the TPOT suite: what ``bench/tpot.py`` and ``bench/test_tpot.py`` need
from a decoder that is not graphbucket's own ``MLADecoder``.

A ``TpotModel`` is a ``GraphBucketRunner`` forward (``GraphBucketRunner.for_model`` takes
it: ``__call__(ctx)``, ``buffer_spec``, ``decode_backend``, ``config.sm_scale``) that
also says how to fill its cache, how to build one step's batch and what a step reads::

    class MyModel:
        config            # .name, .num_heads, .num_layers, .sm_scale
        page_size: int; num_pages: int; kv_cache_format: str
        def __call__(self, ctx): ...                      # the decode step (graph-safe)
        def buffer_spec(self, max_model_len): ...          # graphbucket.BufferSpec
        def decode_backend(self, max_model_len): ...       # e.g. TritonBackend(...)
        def fill_cache(self, block_table, seq_lens, *, seed): ...  # stand-in for prefill
        def step_batch(self, seq_lens, block_table, q_len): ...    # -> DecodeBatch
        def step_bytes(self, tokens): ...   # bytes one step of `tokens` reads beside the KV
        def kv_row_bytes(self): ...         # cache bytes per token over every layer
        def describe(self): ...             # dict recorded in the results' meta

A factory builds it for the suite's cache size: ``factory(num_pages=, page_size=, device=,
num_layers=)``. Name it as ``module:function``: ``python3 bench/tpot.py --model
bench.hf_tpot:deepseek_v3`` (or ``GRAPHBUCKET_TPOT_MODEL=bench.hf_tpot:deepseek_v3`` for
the pytest-benchmark suite). ``bench/hf_tpot.py`` wraps transformers' DeepSeek-V3.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

REQUIRED = ("config", "page_size", "num_pages", "kv_cache_format", "buffer_spec",
            "decode_backend", "fill_cache", "step_batch", "step_bytes", "kv_row_bytes",
            "describe")


def load_factory(name: str) -> Callable[..., Any]:
    """The factory ``module:function`` names (ValueError naming the fix otherwise)."""
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"--model {name!r}: name a factory as module:function, e.g. "
                         "bench.hf_tpot:deepseek_v3")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--model {name!r}: cannot load {attr} from {module}: {e}") from e
    if not callable(factory):
        raise ValueError(f"--model {name!r}: {attr} is not callable")
    return factory


def build_model(name: str, *, num_pages: int, page_size: int, device: str,
                num_layers: int | None = None) -> Any:
    """Build the user's model with the suite's cache size; TypeError naming what a
    ``TpotModel`` lacks."""
    model = load_factory(name)(num_pages=num_pages, page_size=page_size, device=device,
                               num_layers=num_layers)
    check_model(model, name)
    return model


def check_model(model: Any, name: str = "the model") -> None:
    missing = [attr for attr in REQUIRED if not hasattr(model, attr)]
    if missing or not callable(model):
        what = missing + ([] if callable(model) else ["__call__"])
        raise TypeError(f"{name} gave a {type(model).__name__} without {', '.join(what)}: "
                        "the TPOT suite needs a TpotModel (bench/tpot_model.py)")
    if model.num_pages < 1 or model.page_size < 1:
        raise ValueError(f"{name}: num_pages and page_size must be positive, got "
                         f"{model.num_pages} and {model.page_size}")
