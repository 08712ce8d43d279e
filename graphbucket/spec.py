"""What the static buffers hold per request: geometry of seq_info, inputs and output.

A ``BufferSpec`` is fixed before capture; ``StaticBuffers`` (``graphbucket.buffers``)
allocates it once at the largest batch and ``BatchValidator`` (``graphbucket.batch``)
checks every host batch against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from graphbucket.fp8 import check_format


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One per-request model input, e.g. ``InputSpec("hidden", (7168,), torch.bfloat16)``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """Per-request geometry of the static buffers; the batch capacity is given separately.

    ``num_pages`` is the KV cache's page count (block-table entries must lie in
    [0, num_pages)); ``output_shape``/``output_dtype`` describe one request's output row.
    ``kv_cache_format`` names the latent cache's format (``graphbucket.fp8``: "bf16",
    "fp8-tensor" or "fp8-v32"); the ``ladder`` policy looks its tuned ladder up by it.
    """

    max_pages_per_seq: int
    num_pages: int
    page_size: int
    num_heads: int
    output_shape: tuple[int, ...]
    output_dtype: torch.dtype
    inputs: tuple[InputSpec, ...] = ()
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    kv_cache_format: str = "bf16"

    def __post_init__(self) -> None:
        check_format(self.kv_cache_format)
        object.__setattr__(self, "device", _concrete(torch.device(self.device)))
        object.__setattr__(self, "output_shape", tuple(self.output_shape))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        for name in ("max_pages_per_seq", "num_pages", "page_size", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BufferSpec.{name} must be a positive int, got {value!r}")
        names = [s.name for s in self.inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"BufferSpec.inputs repeats a name: {names}")

    @property
    def max_context_len(self) -> int:
        return self.max_pages_per_seq * self.page_size


def _concrete(device: torch.device) -> torch.device:
    # "cuda" and "cuda:0" compare unequal; pin the index so device checks are exact.
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device
