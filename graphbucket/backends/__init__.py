"""Decode backends behind one small protocol, looked up by name with lazy imports.

``get_backend("triton")`` (default), ``"dense"`` (plain torch, for tests), ``"sparse"``
(DeepSeek-V3.2 sparse decode: ``num_heads`` and ``max_len`` required) and ``"aiter"``
(ROCm; imported only when asked for, with an ImportError that says how to install it).
Every one is a ``DecodeBackend`` and plans ``Plan``s.
"""

from __future__ import annotations

import importlib

from graphbucket.backends.base import DecodeBackend, NoWorkspace, Plan, WorkspaceSpec

_REGISTRY: dict[str, tuple[str, str]] = {
    "triton": ("graphbucket.backends.triton", "TritonBackend"),
    "dense": ("graphbucket.backends.dense", "DenseBackend"),
    "sparse": ("graphbucket.sparse.backend", "SparseBackend"),
    "aiter": ("graphbucket.backends.aiter", "AiterBackend"),
}


def backend_names() -> tuple[str, ...]:
    """The names ``get_backend`` knows, in registration order."""
    return tuple(_REGISTRY)


def get_backend(name: str = "triton", **kwargs) -> DecodeBackend:
    """Construct the backend registered as ``name`` with ``kwargs``.

    Raises ValueError for an unknown name and ImportError (saying how to install it) for
    a backend whose optional dependency is missing.
    """
    try:
        module_name, class_name = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown decode backend {name!r}; expected one of {sorted(_REGISTRY)}"
        ) from None
    module = importlib.import_module(module_name)
    return getattr(module, class_name)(**kwargs)


__all__ = ["DecodeBackend", "NoWorkspace", "Plan", "WorkspaceSpec", "backend_names",
           "get_backend"]
