"""Capture policies as ladders (host only)."""

from __future__ import annotations

import pytest

from graphbucket import POLICIES, default_ladder
from graphbucket.policies import policy_ladder
from tests._toy import LADDER, toy_spec

pytestmark = pytest.mark.host


def test_each_policy_is_a_ladder():
    assert POLICIES == ("eager", "fixed-1", "fixed-max", "ladder")
    assert policy_ladder("eager", 320) is None
    assert policy_ladder("fixed-1", 320).hints == (1,)
    assert policy_ladder("fixed-max", 320).hints == (320,)
    assert policy_ladder("fixed-1", 320).bounds == policy_ladder("fixed-max", 320).bounds == (320,)
    assert policy_ladder("ladder", 320) == default_ladder(320)
    assert policy_ladder("ladder", 320, LADDER) is LADDER


def test_without_cuda_the_ladder_policy_is_the_default_ladder():
    # Tuned ladders are looked up by CUDA device name; a CPU spec has none.
    assert policy_ladder("ladder", 320, spec=toy_spec(max_pages=20)) == default_ladder(320)


def test_misuse_names_the_fix():
    with pytest.raises(ValueError, match="ends at max_model_len"):
        policy_ladder("ladder", 640, LADDER)
    with pytest.raises(ValueError, match="unknown policy 'fixed-2'"):
        policy_ladder("fixed-2", 320)
    with pytest.raises(ValueError, match="only with policy='ladder'"):
        policy_ladder("fixed-1", 320, LADDER)
