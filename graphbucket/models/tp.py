"""Tensor-parallel ``MLADecoder``: heads and MLP columns split over ranks (Megatron style).

The split vLLM uses for DeepSeek MLA, for ``world_size`` ranks of an unsharded model with
H heads and MLP width I (rank r holds heads [r H/W, (r+1) H/W) and MLP columns likewise):

| weight | split | why |
| --- | --- | --- |
| ``w_qkv_a`` (q_a and kv_a), every RMSNorm | replicated | low-rank, shared by all heads |
| ``w_q_b`` rows, ``w_uk``, ``w_uv`` | by head (column-parallel) | per-head projections |
| ``w_o`` columns | by head (row-parallel) | partial sums -> all-reduce |
| ``w_gate_up`` rows (gate and up each) | by column (column-parallel) | per-column SwiGLU |
| ``w_down`` columns | by column (row-parallel) | partial sums -> all-reduce |

The latent KV cache (``kv_lora_rank + qk_rope_dim`` wide, one row per token for all
heads) is replicated: every rank computes the same kv_a and writes the same new row.
A decode step runs two all-reduces per layer (after o_proj, after the MLP down
projection) through ``torch.distributed`` on the model's group; under NCCL they are
captured inside each FULL graph, so every rank must replay the same graph sequence
(``graphbucket.distributed``). The per-rank shape of the DeepSeek-V3 TP8 preset (16
heads, MLP 2304) is the shard of ``tp_full_config(deepseek_v3_tp8(), 8)``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from graphbucket.models.config import MLAConfig
from graphbucket.models.mla import MLADecoder
from graphbucket.models.weights import MLALayerWeights, random_weights


def _check_world_size(world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")


def _check_divides(what: str, n: int, world_size: int) -> None:
    _check_world_size(world_size)
    if n % world_size:
        raise ValueError(f"{what}={n} does not split over world_size={world_size} ranks; "
                         f"pick a world size that divides {n}")


def shard_config(config: MLAConfig, world_size: int) -> MLAConfig:
    """One rank's shapes of the unsharded ``config``: H / W heads, I / W MLP columns."""
    _check_divides("num_heads", config.num_heads, world_size)
    _check_divides("intermediate_size", config.intermediate_size, world_size)
    return dataclasses.replace(config, name=f"{config.name}/tp{world_size}",
                               num_heads=config.num_heads // world_size,
                               intermediate_size=config.intermediate_size // world_size)


def tp_full_config(per_rank: MLAConfig, world_size: int) -> MLAConfig:
    """The unsharded model whose ``world_size``-way shard has ``per_rank``'s shapes
    (``tp_full_config(deepseek_v3_tp8(), 2)``: 32 heads, MLP 4608, 16 heads per rank)."""
    _check_world_size(world_size)
    return dataclasses.replace(per_rank, name=f"{per_rank.name}x{world_size}",
                               num_heads=per_rank.num_heads * world_size,
                               intermediate_size=per_rank.intermediate_size * world_size)


def _own(t: torch.Tensor) -> torch.Tensor:
    # A fresh allocation: a shard must not keep the unsharded weights alive.
    return t.clone(memory_format=torch.contiguous_format)


def shard_layer(layer: MLALayerWeights, rank: int, world_size: int) -> MLALayerWeights:
    """Rank ``rank``'s shard of one unsharded layer (shapes read off the tensors)."""
    heads, inter = layer.w_uk.shape[0], layer.w_down.shape[1]
    _check_divides("num_heads", heads, world_size)
    _check_divides("intermediate_size", inter, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
    hs = slice(rank * heads // world_size, (rank + 1) * heads // world_size)
    cs = slice(rank * inter // world_size, (rank + 1) * inter // world_size)
    dim = layer.w_o.shape[0]
    gate, up = layer.w_gate_up[:inter], layer.w_gate_up[inter:]
    return MLALayerWeights(
        attn_norm=_own(layer.attn_norm),
        w_qkv_a=_own(layer.w_qkv_a),
        q_a_norm=_own(layer.q_a_norm),
        w_q_b=_own(layer.w_q_b.view(heads, -1, layer.w_q_b.shape[1])[hs].flatten(0, 1)),
        kv_a_norm=_own(layer.kv_a_norm),
        w_uk=_own(layer.w_uk[hs]),
        w_uv=_own(layer.w_uv[hs]),
        w_o=_own(layer.w_o.view(dim, heads, -1)[:, hs].flatten(1)),
        mlp_norm=_own(layer.mlp_norm),
        w_gate_up=torch.cat([gate[cs], up[cs]]),   # gate rows first, as silu_mul expects
        w_down=_own(layer.w_down[:, cs]),
    )


def shard_weights(layers: list[MLALayerWeights], rank: int, world_size: int
                  ) -> list[MLALayerWeights]:
    """Rank ``rank``'s shard of every layer of an unsharded model (new tensors)."""
    return [shard_layer(layer, rank, world_size) for layer in layers]


class TPMLADecoder(MLADecoder):
    """One rank of a ``world_size``-way tensor-parallel ``MLADecoder``.

    ``config`` is the unsharded model's; ``self.config`` is this rank's shard
    (``shard_config``), so ``buffer_spec`` and the attention launch see H / W heads. The
    weights are the seeded unsharded draw (same seed -> same model on every rank), sliced
    to this rank; ``weights`` passes unsharded weights instead. ``group`` is the
    tensor-parallel process group (None: the default group), required at forward time
    when ``world_size > 1``.

    Graph-safe: the forward adds two in-place ``dist.all_reduce`` calls per layer on
    tensors of fixed shape [B, D]; with NCCL they are recorded in the captured graph.
    """

    def __init__(self, config: MLAConfig, *, rank: int, world_size: int,
                 group: dist.ProcessGroup | None = None, num_pages: int, page_size: int = 64,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 seed: int = 0,
                 weights: tuple[list[MLALayerWeights], torch.Tensor] | None = None) -> None:
        per_rank = shard_config(config, world_size)
        _check_group(group, rank, world_size)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if weights is None:
            weights = random_weights(config, seed=seed, device=device, dtype=dtype)
        layers, final_norm = weights
        super().__init__(per_rank, num_pages=num_pages, page_size=page_size, dtype=dtype,
                         device=device, weights=(shard_weights(layers, rank, world_size),
                                                 _own(final_norm)))
        self.full_config, self.rank, self.world_size, self.group = config, rank, world_size, group

    @classmethod
    def from_full(cls, model: MLADecoder, *, rank: int, world_size: int,
                  group: dist.ProcessGroup | None = None) -> TPMLADecoder:
        """This rank's shard of an unsharded ``model``, with a copy of its KV caches."""
        tp = cls(model.config, rank=rank, world_size=world_size, group=group,
                 num_pages=model.num_pages, page_size=model.page_size, dtype=model.dtype,
                 device=model.device, weights=(model.layers, model.final_norm))
        for dst, src in zip(tp.kv_caches, model.kv_caches, strict=True):
            dst.copy_(src)
        return tp

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(partial, group=self.group)
        return partial

    def forward_reference(self, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError(
            "a tensor-parallel shard has no single-rank float reference; compare its output "
            "with the unsharded MLADecoder (same seed) or that model's forward_reference")


def _check_group(group: dist.ProcessGroup | None, rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
    if world_size == 1 or not dist.is_initialized():
        return  # a shard may be built before the process group (checked at forward time)
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if (size, me) != (world_size, rank):
        raise ValueError(f"rank={rank}, world_size={world_size} but the process group is "
                         f"rank {me} of {size}; pass the tensor-parallel group's rank and size")
