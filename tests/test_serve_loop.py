"""The serving-loop example on the CPU: requests cross a bucket bound, retire, free pages."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "serve_loop.py"


def load_script():
    spec = importlib.util.spec_from_file_location("serve_loop", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cpu, max_model_len", [
    pytest.param(True, 512, marks=pytest.mark.interpreter, id="cpu-tiny"),
    pytest.param(False, 4096, marks=pytest.mark.gpu, id="cuda-deepseek")])
def test_requests_cross_a_bucket_bound_and_retire(cpu, max_model_len):
    loop = load_script()
    model, runner, ladder = loop.build(cpu=cpu, layers=1, max_model_len=max_model_len)
    runner.capture()
    # Request 0 starts at 62 tokens and grows past the 64-token bound; request 1 is short.
    requests = [loop.Request(0, 61, 5), loop.Request(1, 9, 2)]
    report = loop.serve(model, runner, requests, max_batch=2, seed=0)
    runner.close()
    assert report["finished"] == 2 and report["steps"] == 5
    buckets = {bucket for (_, bucket) in report["replays_by_bucket"]}
    assert buckets == {0, 1}, report["replays_by_bucket"]
    assert report["eager_fallbacks"] == 0


def test_page_pool_admits_only_what_fits_and_takes_pages_back():
    loop = load_script()
    pool = loop.PagePool(num_pages=4, page_size=16, rng=np.random.default_rng(0))
    big, small = loop.Request(0, 60, 10), loop.Request(1, 10, 5)
    assert not pool.admit(big)  # 70 tokens = 5 pages > 4
    assert pool.admit(small) and len(small.pages) == 1 and len(pool.free) == 3
    pool.retire(small)
    assert sorted(pool.free) == [0, 1, 2, 3]



@pytest.mark.interpreter
def test_verify_steps_accept_random_drafts_and_replay_q_len_graphs():
    loop = load_script()
    model, runner, _ = loop.build(cpu=True, layers=1, max_model_len=512, q_len=3)
    runner.capture()
    requests = [loop.Request(0, 61, 7), loop.Request(1, 9, 4)]
    report = loop.serve(model, runner, requests, max_batch=2, seed=0, q_len=3)
    stats = runner.stats()
    runner.close()
    assert report["finished"] == 2 and report["tokens"] == 7 + 4
    # Some drafts were accepted (fewer steps than tokens of the longest), not all of them.
    assert 7 / 3 <= report["steps"] < 7
    assert {k.q_len for k in stats.replays} == {3} and report["eager_fallbacks"] == 0
    assert sum(stats.replays.values()) == report["steps"]
