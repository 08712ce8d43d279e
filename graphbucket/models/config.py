"""Per-rank shapes of MLA decoders: DeepSeek-V3 and a Kimi-like model at tensor-parallel 8.

Only what one GPU of a TP8 deployment holds: the attention heads are split 8 ways
(128 -> 16 for DeepSeek-V3), the MLA low-rank projections (``q_lora_rank``, the 576-wide
latent ``kv_lora_rank + qk_rope_dim``) are replicated, and the MLP is a dense SwiGLU with
the per-rank share of DeepSeek-V3's dense intermediate size (18432 / 8 = 2304). MoE
layers, the all-reduces and the LM head are left out: a decode step of this model reads
what one rank's attention and dense MLP read.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Shapes of one tensor-parallel rank of an MLA decoder (absorbed decode).

    The latent KV cache row is ``kv_lora_rank + qk_rope_dim`` wide; queries are
    ``qk_nope_dim + qk_rope_dim`` per head before absorption. ``max_position`` bounds the
    rotary table: every decoded position must be below it.
    """

    name: str
    num_heads: int
    hidden_size: int
    q_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    kv_lora_rank: int
    v_head_dim: int
    intermediate_size: int
    num_layers: int = 4
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position: int = 131072

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or value < 1):
                raise ValueError(f"MLAConfig.{f.name} must be a positive int, got {value!r}")
        if self.qk_rope_dim % 2:
            raise ValueError(f"qk_rope_dim must be even (rotary pairs), got {self.qk_rope_dim}")

    @property
    def kv_dim(self) -> int:
        """Width of one latent cache row: the normalised latent, then the roped key part."""
        return self.kv_lora_rank + self.qk_rope_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    @property
    def sm_scale(self) -> float:
        """1/sqrt(qk_nope_dim + qk_rope_dim): absorption does not change the logits."""
        return 1.0 / math.sqrt(self.qk_head_dim)

    def with_layers(self, num_layers: int) -> MLAConfig:
        return dataclasses.replace(self, num_layers=num_layers)

    def layer_params(self) -> int:
        """Parameters of one decoder layer (norms included)."""
        h, heads = self.hidden_size, self.num_heads
        return (h * (self.q_lora_rank + self.kv_dim)                 # fused q_a | kv_a
                + self.q_lora_rank * heads * self.qk_head_dim        # q_b
                + heads * self.qk_nope_dim * self.kv_lora_rank       # W_UK
                + heads * self.kv_lora_rank * self.v_head_dim        # W_UV
                + heads * self.v_head_dim * h                        # o_proj
                + 3 * h * self.intermediate_size                     # gate, up, down
                + 2 * h + self.q_lora_rank + self.kv_lora_rank)      # RMSNorm weights


def deepseek_v3_tp8(num_layers: int = 4) -> MLAConfig:
    """DeepSeek-V3 per rank at TP8: 16 of 128 heads, hidden 7168, dense MLP 2304 (61 layers
    in the real model; the MoE layers are modelled as dense)."""
    return MLAConfig(name="deepseek-v3-tp8", num_heads=16, hidden_size=7168, q_lora_rank=1536,
                     qk_nope_dim=128, qk_rope_dim=64, kv_lora_rank=512, v_head_dim=128,
                     intermediate_size=2304, num_layers=num_layers)


def deepseek_v3_dp(num_layers: int = 4) -> MLAConfig:
    """DeepSeek-V3 with data-parallel attention: all 128 heads on one GPU (no head split),
    where the MLA decode is bound by the tensor cores; the MLP keeps the TP8 preset's
    per-GPU share (2304), so the step time stays attention-heavy."""
    return MLAConfig(name="deepseek-v3-dp", num_heads=128, hidden_size=7168,
                     q_lora_rank=1536, qk_nope_dim=128, qk_rope_dim=64, kv_lora_rank=512,
                     v_head_dim=128, intermediate_size=2304, num_layers=num_layers)


def kimi_tp8(num_layers: int = 4) -> MLAConfig:
    """Kimi-like per rank at TP8: DeepSeek-V3's MLA dims with 12 heads per rank (not an
    official Kimi configuration; it exercises a head count that is not a multiple of 16)."""
    return MLAConfig(name="kimi-like-tp8", num_heads=12, hidden_size=7168, q_lora_rank=1536,
                     qk_nope_dim=128, qk_rope_dim=64, kv_lora_rank=512, v_head_dim=128,
                     intermediate_size=2304, num_layers=num_layers, rope_theta=50000.0)


def tiny(num_layers: int = 2) -> MLAConfig:
    """A CPU-test model: small enough for the Triton interpreter, same structure."""
    return MLAConfig(name="tiny", num_heads=8, hidden_size=64, q_lora_rank=32, qk_nope_dim=16,
                     qk_rope_dim=16, kv_lora_rank=64, v_head_dim=16, intermediate_size=96,
                     num_layers=num_layers, max_position=4096)


def tiny_v32(num_layers: int = 2) -> MLAConfig:
    """``tiny`` with DeepSeek's 512 latent + 64 rope values per token: the shape the fp8-v32
    cache format fixes (``graphbucket.fp8``); 4 heads keep the interpreter quick."""
    return dataclasses.replace(tiny(num_layers), name="tiny-v32", num_heads=4,
                               kv_lora_rank=512, qk_rope_dim=64)


PRESETS = {"deepseek-v3-tp8": deepseek_v3_tp8, "deepseek-v3-dp": deepseek_v3_dp,
           "kimi-like-tp8": kimi_tp8, "tiny": tiny}
