"""``DeepseekDecoder`` (graphbucket.integrations.transformers) against transformers' forward.

The reference is an implementation no one here wrote: transformers' own
``DeepseekV3ForCausalLM`` / ``DeepseekV32ForCausalLM``, built from small random configs
(float32, yarn rope whose mscale changes both the softmax scale and the rope table, MoE
with groups), stepping with its own cache. graphbucket prefills with that forward, then
decodes a ragged batch through ``GraphBucketRunner`` (paged latent cache, one graph per
bucket of a small ladder, the batch crossing bucket bounds) while transformers decodes
each request alone; every step's logits must agree within 1e-4 (relative L2) and give
the same greedy token. V3.2 runs with top-k below the context, so the indexer's choice
matters, and its reference keeps index keys rounded as the e4m3 index cache holds them
(``round_new_index_keys``: transformers' indexer scores unrounded keys).

Mutation tests break one rule through a clearly named function (softmax scale, rope
layout, kv_b split, index rope) and assert that the same check fails. Host tests check
the pieces in float64: the rope permutation, the absorption, the optional import.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from graphbucket.integrations import MIN_TRANSFORMERS

transformers = pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)

from transformers import (  # noqa: E402  (after the importorskip)
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    DynamicCache,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    apply_rotary_pos_emb_interleave,
)

from graphbucket import Bucket, BucketLadder, GraphBucketRunner  # noqa: E402
from graphbucket.integrations import hf_indexer, hf_mla  # noqa: E402
from graphbucket.integrations.transformers import DeepseekDecoder  # noqa: E402
from graphbucket.models.sparse_mla import rope_first  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAGE, MAX_LEN = 8, 2048
# Hints above their buckets' tops (any hint is correct; it only changes speed) give each
# bucket its own topology at these short contexts: 1, 2 and 4 KV splits (V3), 1, 2 and 4
# indexer splits (V3.2).
DENSE_LADDER = BucketLadder((Bucket(40, 40), Bucket(44, 128), Bucket(64, 256),
                             Bucket(MAX_LEN, 256)), MAX_LEN)
SPARSE_LADDER = BucketLadder((Bucket(16, 16), Bucket(32, 512), Bucket(64, 1024),
                              Bucket(MAX_LEN, 2048)), MAX_LEN)
TOLERANCE = 1e-4
# mscale != mscale_all_dim: the rope table carries an attention factor (1.04) and the
# softmax scale mscale_all_dim's mscale^2 (1.36), so neither is the plain one.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
        "original_max_position_embeddings": MAX_LEN // 8, "mscale": 1.0, "mscale_all_dim": 0.7,
        "beta_fast": 32, "beta_slow": 1}
# Tiny dims keep the interpreter quick; the V3.2 latent, rope and indexer widths are the
# sparse kernels' (512, 64, 64 x 128). initializer_range 0.3 keeps greedy tokens clear.
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              n_shared_experts=1, n_routed_experts=8, n_group=2, topk_group=1,
              num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=32,
              qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=MAX_LEN,
              rope_parameters=YARN, initializer_range=0.3)


def v3_model(seed: int = 0, **overrides) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    config = DeepseekV3Config(**{**COMMON, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
                                 **overrides})
    return DeepseekV3ForCausalLM(config).eval()


def v32_model(seed: int = 0, topk: int = 16) -> DeepseekV32ForCausalLM:
    torch.manual_seed(seed)
    config = DeepseekV32Config(**COMMON, kv_lora_rank=512, qk_rope_head_dim=64,
                               index_topk=topk, index_head_dim=128, index_n_heads=64)
    return DeepseekV32ForCausalLM(config).eval()


@dataclass(frozen=True)
class Comparison:
    """A decode run against transformers: the worst step's relative L2 error of the
    logits, whether every greedy token agreed, and the buckets and plans it replayed."""

    worst: float
    tokens_agree: bool
    steps: int
    buckets: frozenset
    plans: frozenset
    # Steps x requests whose greedy token differed, and of those the ones where
    # transformers' top two logits lay further apart than the step's largest error.
    differing: int = 0
    clear_differing: int = 0

    @property
    def equivalent(self) -> bool:
        return self.worst <= TOLERANCE and self.tokens_agree


def decode_against_transformers(model, prompt_lens, steps: int, *, seed: int = 0,
                                round_index_keys: bool = False, ladder=None,
                                max_len: int = MAX_LEN, page: int = PAGE) -> Comparison:
    """Prefill each prompt with the model's forward, then decode all of them as one batch
    through the runner while transformers decodes each alone with its own cache; both
    continue with transformers' greedy token."""
    rng = np.random.default_rng(seed)
    per_request = max_len // page
    num_pages = len(prompt_lens) * per_request
    pages = rng.permutation(num_pages).astype(np.int32).reshape(len(prompt_lens), -1)
    decoder = DeepseekDecoder(model, num_pages=num_pages, page_size=page)
    on_gpu = model.device.type == "cuda"
    gen = torch.Generator().manual_seed(seed)
    caches, tokens = [], []
    for row, n in enumerate(prompt_lens):
        cache = DynamicCache(config=model.config)
        if round_index_keys:
            hf_indexer.round_new_index_keys(cache)
        logits, cache = decoder.prefill(torch.randint(0, model.config.vocab_size, (n,),
                                                      generator=gen), pages[row], cache=cache)
        caches.append(cache)
        tokens.append(int(logits.argmax()))
    worst, agree, lens, differing, clear = 0.0, True, list(prompt_lens), 0, 0
    if ladder is None:
        ladder = SPARSE_LADDER if decoder.config.sparse else DENSE_LADDER
    # warmup_iters=0 on the CPU: a captured graph is the recorded call, nothing to warm
    with GraphBucketRunner.for_model(decoder, max_model_len=max_len, batch_sizes=[1, 2, 3],
                                     ladder=ladder, warmup_iters=int(on_gpu),
                                     progress=False) as runner:
        runner.capture()
        for _ in range(steps):
            lens = [n + 1 for n in lens]
            step = decoder.decode_batch(lens, pages, tokens)
            if on_gpu:  # the step must not read the device (routing, lengths) on the host
                torch.cuda.set_sync_debug_mode("error")
            try:
                out = runner.step(step).clone()
            finally:
                if on_gpu:
                    torch.cuda.set_sync_debug_mode("default")
            with torch.no_grad():
                ref = torch.stack([model(torch.tensor([[t]], device=model.device), cache=c,
                                         use_cache=True).logits[0, -1]
                                   for t, c in zip(tokens, caches, strict=True)])
            out, ref = out.float(), ref.float()
            worst = max(worst, ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item())
            same = out.argmax(-1) == ref.argmax(-1)
            agree &= bool(same.all())
            top2 = ref.topk(2, dim=-1).values
            margin = top2[:, 0] - top2[:, 1]
            error = (out - ref).abs().max(dim=-1).values
            differing += int((~same).sum())
            clear += int((~same & (margin > error)).sum())
            tokens = ref.argmax(-1).tolist()
        keys = runner.stats().replays
        buckets = frozenset(key.bucket for key in keys)
        plans = frozenset(runner.plan_for(key) for key in keys)
    return Comparison(worst, agree, steps, buckets, plans, differing, clear)


# ---- host: the pieces, in float64 -------------------------------------------------------------


@pytest.mark.host
def test_permuted_rope_rows_make_half_split_rotation_equal_transformers_interleaved():
    rope, positions = 16, torch.arange(7)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope)
    angles = positions[:, None].double() * inv_freq
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q, k = torch.randn(2, 1, 7, rope, dtype=torch.float64).unbind(0)
    want_q, want_k = apply_rotary_pos_emb_interleave(q[None], k[None], cos[None], sin[None])
    order = hf_mla.rope_channel_order(rope, interleaved=True)

    def half_split(x):
        x1, x2 = x[..., :rope // 2], x[..., rope // 2:]
        c, s = angles.cos(), angles.sin()
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    assert torch.allclose(half_split(q[..., order]), want_q[0], atol=1e-12)
    assert torch.allclose(half_split(k[..., order]), want_k[0], atol=1e-12)
    assert torch.equal(hf_mla.rope_channel_order(rope, interleaved=False), torch.arange(rope))


@pytest.mark.host
def test_absorbed_kv_b_gives_the_expanded_attention_logits_and_output():
    heads, nope, v, latent, tokens = 3, 5, 4, 8, 6
    kv_b = torch.randn(heads * (nope + v), latent, dtype=torch.float64)
    cached = torch.randn(tokens, latent, dtype=torch.float64)
    q_nope = torch.randn(heads, nope, dtype=torch.float64)
    weights = torch.randn(heads, tokens, dtype=torch.float64)
    expanded = (cached @ kv_b.T).view(tokens, heads, nope + v)
    k_nope, values = expanded[..., :nope], expanded[..., nope:]
    w_uk, w_uv = hf_mla.absorb_kv_b(kv_b, heads, nope, v)
    absorbed_logits = torch.einsum("hr,tr->ht", torch.einsum("hn,hnr->hr", q_nope, w_uk), cached)
    assert torch.allclose(absorbed_logits, torch.einsum("hn,thn->ht", q_nope, k_nope))
    absorbed_out = torch.einsum("hr,hrv->hv", weights @ cached, w_uv)
    assert torch.allclose(absorbed_out, torch.einsum("ht,thv->hv", weights, values))


@pytest.mark.host
def test_the_softmax_scale_and_rope_table_are_the_models_yarn_ones():
    model = v3_model()
    decoder = DeepseekDecoder(model, num_pages=2, page_size=PAGE)
    attention = model.model.layers[0].self_attn
    assert decoder.config.sm_scale == attention.scaling
    assert decoder.config.sm_scale == pytest.approx(32 ** -0.5 * (0.07 * np.log(8) + 1) ** 2)
    factor = model.model.rotary_emb.attention_scaling
    assert factor != 1.0  # yarn's attention factor scales cos and sin
    cos_sin = decoder.rope[5]
    assert torch.allclose(cos_sin[:8] ** 2 + cos_sin[8:] ** 2, torch.full((8,), factor ** 2))


@pytest.mark.host
def test_a_sequence_dependent_rope_and_wrong_sparse_widths_are_refused():
    with pytest.raises(ValueError, match="dynamic"):
        DeepseekDecoder(v3_model(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                  "rope_theta": 10000.0}),
                        num_pages=2, page_size=PAGE)
    torch.manual_seed(0)
    narrow = DeepseekV32ForCausalLM(DeepseekV32Config(
        **COMMON, kv_lora_rank=64, qk_rope_head_dim=16, index_topk=8, index_head_dim=128,
        index_n_heads=64))
    with pytest.raises(ValueError, match="sparse kernels take"):
        DeepseekDecoder(narrow, num_pages=2, page_size=PAGE)


@pytest.mark.host
def test_the_v32_indexer_q_is_rounded_to_e4m3_only_when_asked():
    model = v32_model()
    exact = DeepseekDecoder(model, num_pages=2, page_size=PAGE).decode_backend(64)
    rounded = DeepseekDecoder(model, num_pages=2, page_size=PAGE, fp8_index_q=True)
    assert not exact.plan(2, 4, 64).indexer_fp8_q
    assert rounded.decode_backend(64).plan(2, 4, 64).indexer_fp8_q


@pytest.mark.host
def test_graphbucket_imports_without_transformers_and_the_adapter_says_what_to_install():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import graphbucket, graphbucket.models, graphbucket.integrations\n"
            "try:\n    import graphbucket.integrations.transformers\n"
            "except ImportError as e:\n    print('ImportError:', e)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pip install 'graphbucket[hf]'" in done.stdout


# ---- interpreter: decode steps against transformers -------------------------------------------


@pytest.mark.interpreter
def test_deepseek_v3_decodes_like_transformers_across_buckets():
    # Lengths 3, 9 and 16 grow to 33, 39 and 46: the batch's longest crosses 40 and 44.
    result = decode_against_transformers(v3_model(), (3, 9, 16), steps=30)
    assert result.equivalent, result
    assert len(result.buckets) == len(result.plans) == 3  # each its own split count


@pytest.mark.interpreter
def test_deepseek_v32_sparse_decode_picks_transformers_top_k():
    # top-k 16 below the longest context throughout (28 -> 36, crossing the bound at 32);
    # the short request (9 -> 17) crosses top-k on the last step.
    result = decode_against_transformers(v32_model(topk=16), (28, 9), steps=8,
                                         round_index_keys=True)
    assert result.equivalent, result
    assert len(result.buckets) == len(result.plans) == 2  # 1 and 2 indexer splits


@pytest.mark.interpreter
@pytest.mark.parametrize("variant", [{"q_lora_rank": None}, {"rope_interleave": False},
                                     {"attention_bias": True}], ids=str)
def test_config_variants_decode_like_transformers(variant):
    model = v3_model(**variant)
    with torch.no_grad():  # transformers initialises biases to zero; these must count
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.3)
    result = decode_against_transformers(model, (9,), steps=3)
    assert result.equivalent, result


def scale_without_mscale(attention) -> float:
    return attention.qk_head_dim ** -0.5


def pairs_read_as_halves(rope_dim: int, interleaved: bool) -> torch.Tensor:
    return torch.arange(rope_dim)


def values_before_keys(kv_b_weight, num_heads, nope_dim, v_dim):
    per_head = kv_b_weight.view(num_heads, nope_dim + v_dim, -1)
    return (per_head[:, v_dim:].contiguous(),
            per_head[:, :v_dim].transpose(1, 2).contiguous())


@pytest.mark.interpreter
@pytest.mark.parametrize("name, broken", [("softmax_scale", scale_without_mscale),
                                          ("rope_channel_order", pairs_read_as_halves),
                                          ("absorb_kv_b", values_before_keys)])
def test_a_broken_mla_rule_fails_the_equivalence_check(monkeypatch, name, broken):
    monkeypatch.setattr(hf_mla, name, broken)
    result = decode_against_transformers(v3_model(), (9,), steps=2)
    assert not result.equivalent
    assert result.worst > 100 * TOLERANCE, result


def index_rope_interleaved(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """The attention's interleaved pairs where the indexer rotates half-split ones."""
    rope = cos_sin.shape[1]
    order = torch.cat([hf_mla.rope_channel_order(rope, interleaved=True),
                       torch.arange(rope, x.shape[-1])])
    return rope_first(x[..., order], cos_sin)


@pytest.mark.interpreter
def test_a_broken_index_rope_picks_other_tokens_and_fails_the_check(monkeypatch):
    monkeypatch.setattr(hf_indexer, "index_rope", index_rope_interleaved)
    result = decode_against_transformers(v32_model(topk=16), (24,), steps=1,
                                         round_index_keys=True)
    assert not result.equivalent
    assert result.worst > 100 * TOLERANCE, result


# ---- GPU: bf16 at DeepSeek-V3's TP8 attention shapes ------------------------------------------


@pytest.mark.gpu
def test_h200_bf16_decode_matches_transformers_at_tp8_attention_shapes():
    # 16 heads, hidden 7168, q_lora 1536, kv_lora 512, rope 64, yarn as released; 2 layers,
    # 8 experts. Prompts 50 to ~1.4K decode 64 steps through the shipped 16-head H200 ladder (the
    # batch crosses a bucket bound); the runner's steps run under the sync check.
    from bench.hf_tpot import TP8_SHAPES
    from graphbucket.tuning.shipped import find_tuned_ladder

    torch.manual_seed(0)
    shapes = {**TP8_SHAPES, "n_routed_experts": 8, "n_group": 2, "topk_group": 1,
              "num_experts_per_tok": 2}
    with torch.device("cuda"):
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**shapes, num_hidden_layers=2))
        model = model.to(torch.bfloat16).eval()
    max_len = 4096
    spec = DeepseekDecoder(model, num_pages=1, page_size=64).buffer_spec(max_len)
    # The H200's ladder on any card: the numerics do not depend on the GPU a ladder was
    # tuned on, and a GPU without one (the default ladder) has no bound to cross here.
    ladder = find_tuned_ladder("NVIDIA H200", spec.num_heads, max_len)
    # The longest prompt starts 20 tokens below a bound, so the batch's bucket changes.
    bound = max(b for b in ladder.bounds if 700 < b <= max_len - 64)
    result = decode_against_transformers(model, (50, 700, bound - 20), steps=64,
                                         ladder=ladder, max_len=max_len, page=64)
    assert result.worst <= 2e-2, result
    assert result.clear_differing == 0, result  # a token differs only at a near tie
    assert len(result.buckets) >= 2, result


# ---- the README section ---------------------------------------------------------------------


def readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Wrap a transformers DeepSeek model", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```py\n(.*?)```", section, re.S)[0]


@pytest.mark.interpreter
def test_the_readme_section_runs_as_written(capsys):
    exec(compile(readme_block(), "README.md", "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out
    error = float(re.search(r"relative L2 error against transformers (\S+)", printed)[1])
    assert error <= TOLERANCE, printed
