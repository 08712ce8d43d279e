"""bench/experiments/step_ahead.py on the CPU: both loops step one trajectory, every step
is a valid replay and the table grows as the steps say."""

from __future__ import annotations

import numpy as np
import pytest

from tests.script_modules import load_experiment

pytestmark = pytest.mark.interpreter


def test_both_loops_step_one_trajectory():
    import bench.capture_dispatch as cd
    from graphbucket import default_ladder

    exp = load_experiment("step_ahead")
    cfg = cd.SMOKE
    runner = cd.make_runner(cfg, cd.MLADecoder(cfg), default_ladder(cfg.max_model_len))
    runner.capture()
    try:
        res = exp.cell(runner, cfg, 2, 100, 120, rounds=2, steps=2, cuda=False)
        stats = runner.stats()
    finally:
        runner.close()
    for loop in exp.LOOPS:
        assert res[loop]["host_us_median"] > 0 and res[loop]["period_us_median"] > 0
    # 2 warm-up steps, then 2 rounds x 2 loops x 2 steps, each a graph replay.
    assert stats.errors == 0 and stats.eager_fallbacks == 0
    assert sum(stats.replays.values()) == stats.steps == 2 + 2 * 2 * 2
    assert np.isclose(res["gpu_idle_removed_us"], res["after"]["period_us_median"]
                      - res["ahead"]["period_us_median"], atol=0.02)
    text = exp.markdown({"gpu": "cpu", "torch": "t", "triton": "x", "command": "c"}, [res])
    assert "| 2 | 100-120 |" in text
