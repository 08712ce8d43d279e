"""transformers' DeepSeek-V3 as a ``TpotModel`` (bench/tpot_model.py): the TPOT suite on a
model graphbucket did not write.

``deepseek_v3`` builds a ``DeepseekV3ForCausalLM`` with random weights at DeepSeek-V3's
per-rank shapes under TP8 (16 heads, hidden 7168, q_lora 1536, kv_lora 512, rope 64,
yarn rope as the released config; the MLPs and vocabulary at an eighth of the model's, as
tensor parallelism splits them; 32 routed experts, 8 per token), bf16 on CUDA, and wraps
it in ``graphbucket.integrations.transformers.DeepseekDecoder``; ``deepseek_v3_small`` is
a tiny float32 one for the CPU. Needs transformers (``pip install 'graphbucket[hf]'``)::

    python3 bench/tpot.py --model bench.hf_tpot:deepseek_v3 --layers 4 --batches 1 8 \
        --policies fixed-1 fixed-max ladder --out DIR     # writes h200-tpot-transformers.json
"""

from __future__ import annotations

import numpy as np
import torch

from graphbucket.batch import DecodeBatch
from graphbucket.models.paging import prefill_random

NAME = "transformers"
# DeepSeek-V3's released config, per rank at TP8 where tensor parallelism splits a width.
TP8_SHAPES = dict(vocab_size=129280 // 8, hidden_size=7168, intermediate_size=18432 // 8,
                  moe_intermediate_size=2048 // 8, num_attention_heads=128 // 8,
                  num_key_value_heads=128 // 8, n_shared_experts=1, n_routed_experts=32,
                  n_group=4, topk_group=2, num_experts_per_tok=8, first_k_dense_replace=1,
                  q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                  qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                   "original_max_position_embeddings": 4096, "mscale": 1.0,
                                   "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
SMALL_SHAPES = dict(vocab_size=96, hidden_size=64, intermediate_size=96,
                    moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                    n_shared_experts=1, n_routed_experts=8, n_group=2, topk_group=1,
                    num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=32,
                    kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16,
                    v_head_dim=16, max_position_embeddings=2048)


class HFDeepseekTpot:
    """A ``DeepseekDecoder`` with what the TPOT suite asks of a model (``TpotModel``)."""

    kv_cache_format = "bf16"

    def __init__(self, model, *, num_pages: int, page_size: int) -> None:
        from graphbucket.integrations.transformers import DeepseekDecoder

        self.hf_model = model
        self.decoder = DeepseekDecoder(model, num_pages=num_pages, page_size=page_size)
        self.config, self.page_size, self.num_pages = (self.decoder.config, page_size,
                                                       num_pages)

    def __call__(self, ctx):
        return self.decoder.forward(ctx)

    def buffer_spec(self, max_model_len: int):
        return self.decoder.buffer_spec(max_model_len)

    def decode_backend(self, max_model_len: int, **kwargs):
        return self.decoder.decode_backend(max_model_len, **kwargs)

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.decoder.kv_caches

    def fill_cache(self, block_table: np.ndarray, seq_lens, *, seed: int = 0) -> None:
        """Seeded N(0, 1) latent rows on every page the first ``seq_lens`` tokens use, as
        for graphbucket's own decoder (a stand-in for prefilling 128K tokens)."""
        prefill_random(self, block_table, seq_lens, seed=seed)

    def step_batch(self, seq_lens, block_table: np.ndarray, q_len: int = 1) -> DecodeBatch:
        if q_len != 1:
            raise ValueError(f"q_len={q_len}: DeepseekDecoder decodes one token per request")
        rng = np.random.default_rng(len(seq_lens))
        tokens = rng.integers(0, self.hf_model.config.vocab_size, size=len(seq_lens))
        return self.decoder.decode_batch(seq_lens, block_table, tokens)

    def step_bytes(self, tokens: int) -> int:
        """Parameters one step of ``tokens`` tokens reads: all but the routed experts, and
        per MoE layer the experts the tokens can reach (at most tokens x experts per token)."""
        total, experts = 0, 0
        for name, param in self.hf_model.named_parameters():
            if ".mlp.experts." in name:
                experts += param.numel() * param.element_size()
            else:
                total += param.numel() * param.element_size()
        cfg = self.hf_model.config
        moe_layers = sum(1 for layer in self.decoder.decoder_layers
                         if hasattr(layer.mlp, "experts"))
        if moe_layers:
            per_expert = experts // (moe_layers * cfg.n_routed_experts)
            reached = min(cfg.n_routed_experts, tokens * cfg.num_experts_per_tok)
            total += moe_layers * reached * per_expert
        return total

    def kv_row_bytes(self) -> int:
        cache = self.decoder.kv_caches[0]
        return cache.shape[-1] * cache.element_size() * len(self.decoder.kv_caches)

    def describe(self) -> dict:
        cfg = self.hf_model.config
        keys = (*TP8_SHAPES, "num_hidden_layers", "rms_norm_eps")
        return {"model": f"{NAME} {type(self.hf_model).__name__}", "slug": NAME,
                "hf_config": {k: getattr(cfg, k) for k in keys if hasattr(cfg, k)},
                "transformers": __import__("transformers").__version__,
                "weights_mb": round(self.step_bytes(1) / 1e6, 1),
                "weights_note": "parameters one token reads (routed experts: 8 per token)"}


def _build(shapes: dict, *, num_pages: int, page_size: int, device: str,
           num_layers: int | None, dtype: torch.dtype, seed: int = 0) -> HFDeepseekTpot:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(**shapes, num_hidden_layers=num_layers or 4)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(config).to(dtype).eval()
    return HFDeepseekTpot(model, num_pages=num_pages, page_size=page_size)


def deepseek_v3(*, num_pages: int, page_size: int, device: str = "cuda",
                num_layers: int | None = None) -> HFDeepseekTpot:
    """DeepSeek-V3's TP8 per-rank shapes, random weights, bf16 (``TP8_SHAPES``)."""
    return _build(TP8_SHAPES, num_pages=num_pages, page_size=page_size, device=device,
                  num_layers=num_layers, dtype=torch.bfloat16)


def deepseek_v3_small(*, num_pages: int, page_size: int, device: str = "cpu",
                      num_layers: int | None = None) -> HFDeepseekTpot:
    """A tiny float32 DeepSeek-V3 (``SMALL_SHAPES``, 2 layers) for the CPU interpreter."""
    return _build(SMALL_SHAPES, num_pages=num_pages, page_size=page_size, device=device,
                  num_layers=num_layers or 2, dtype=torch.float32)
