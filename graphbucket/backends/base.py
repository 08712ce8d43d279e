"""The decode-attention backend protocol: plan on the host, run on the device.

A backend turns (batch size, heads, host hint) into a frozen ``Plan``, describes the
persistent workspace its kernels need for a set of plans, and launches one decode with a
given plan. ``plan`` is a pure host function; ``run`` only launches and never reads device
memory, so whatever ``run`` launches can be captured into a FULL CUDA graph. The backend
also owns the ladder its graphs are captured at by default (``default_ladder``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from graphbucket.bucket import DEFAULT_BALANCED_KERNEL

if TYPE_CHECKING:  # annotations only: the ladder and spec modules import no backend
    from graphbucket.ladder import BucketLadder
    from graphbucket.spec import BufferSpec


@runtime_checkable
class Plan(Protocol):
    """Every host decision of one decode launch; the graph key.

    A plan is frozen, hashable and equal by value: keys whose plans are equal alias one
    graph. The backend that made it sizes its workspace from plans
    (``DecodeBackend.workspace_spec``) and launches it unchanged. Implemented by
    ``graphbucket.plan.LaunchPlan`` (split-KV and balanced) and
    ``graphbucket.sparse.plan.SparsePlan``.
    """

    def describe(self) -> str:
        """One line naming the plan's topology (capture progress, logs, errors)."""
        ...


@runtime_checkable
class WorkspaceSpec(Protocol):
    """Shape of a backend's persistent workspace, sized for every plan it must serve."""

    @property
    def nbytes(self) -> int: ...

    def allocate(self, device: torch.device | str) -> Any:
        """Allocate once, before capture; ``None`` when no plan needs a workspace."""
        ...


@runtime_checkable
class DecodeBackend(Protocol):
    """A paged MLA decode implementation behind graphbucket's capture and dispatch.

    Shapes (B = batch, H = heads, D = kv_lora_rank + qk_rope_dim, R = kv_lora_rank):
    q [B, H, D]; kv_cache [num_pages, page_size, D]; block_table [>= B, max_pages] int32;
    seq_lens [>= B] int32 on the device; out [B, H, R]; lse [B, H] float32 or None.
    A verify step of ``q_len`` tokens per request runs folded: H = q_len x heads rows
    (token-major), planned with that many heads; token j attends to the positions before
    seq_len - q_len + j + 1.
    """

    name: str
    kv_lora_rank: int
    qk_rope_dim: int

    def plan(self, batch_size: int, num_heads: int, hint: int) -> Plan:
        """Every host decision for ``batch_size`` requests planned at context ``hint``."""
        ...

    def plan_balanced(self, batch_size: int, num_heads: int,
                      kernel: str = DEFAULT_BALANCED_KERNEL) -> Plan:
        """The plan of a ragged batch's graph (``Bucket.balanced_imbalance``), for any
        lengths, with one of ``balanced_kernels(num_heads)``; raises ValueError naming the
        fix where the backend has no such topology or no such kernel."""
        ...

    def balanced_kernels(self, num_heads: int) -> tuple[str, ...]:
        """The balanced kernels ``plan_balanced`` offers at ``num_heads``, the default
        first (``BucketLadder.balanced_kernels`` picks one per capture size)."""
        ...

    def default_ladder(self, max_model_len: int, spec: BufferSpec | None = None
                       ) -> BucketLadder:
        """The buckets the ``ladder`` policy captures with this backend when none is given
        (``spec``: the runner's buffers, whose device, heads and cache format may pick a
        tuned ladder)."""
        ...

    def default_q_ladder(self, max_model_len: int, spec: BufferSpec | None, q_len: int
                         ) -> BucketLadder | None:
        """The ladder tuned for verify steps of ``q_len`` tokens with this backend, or None
        (the ``default_ladder`` then serves that q_len too)."""
        ...

    def workspace_spec(self, plans: Iterable[Plan]) -> WorkspaceSpec:
        """The persistent workspace that serves every plan in ``plans``."""
        ...

    def partitions_once(self, plan: Plan) -> bool:
        """Whether ``run`` with ``plan`` first partitions the step on the device into the
        workspace from the lengths alone (a balanced plan's planner), so that the later
        layers of one step may pass ``partition_ready=True`` and skip it
        (``DecodeContext.begin_step``); False where ``run`` takes no such argument."""
        ...

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, out: torch.Tensor, workspace: Any, *, plan: Plan,
            sm_scale: float, lse: torch.Tensor | None = None, q_len: int = 1,
            **inputs: Any) -> torch.Tensor:
        """Launch one decode with ``plan``; graph-safe (no device reads, no host sync).
        ``inputs``: what the backend reads beside the cache (``kv_scale`` of an fp8
        cache; ``index`` of the sparse backend); a backend refuses inputs it does not
        take (TypeError)."""
        ...


class NoWorkspace:
    """A ``WorkspaceSpec`` for backends that keep no persistent state between launches."""

    nbytes = 0

    def allocate(self, device: torch.device | str) -> None:
        return None

    def __repr__(self) -> str:
        return "NoWorkspace()"


def check_balanced_kernel(backend: str, kernel: str, offered: tuple[str, ...]) -> None:
    """ValueError unless ``kernel`` is one of ``offered`` (a backend's balanced kernels)."""
    if kernel not in offered:
        raise ValueError(f"the {backend} backend has no balanced kernel {kernel!r} here; it "
                         f"offers {list(offered)} (a ladder's balanced_kernels names one per "
                         "capture size: tune the ladder for this backend and head count)")
