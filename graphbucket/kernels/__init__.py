"""Triton split-KV MLA decode kernels and their host launchers."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels only run through its interpreter (on CPU tensors). The
# switch is read when kernels are decorated, so it must be set before they are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from graphbucket.kernels.launch import (  # noqa: E402
    SplitWorkspace,
    check_mla_decode_args,
    default_sm_scale,
    mla_decode,
)

__all__ = ["SplitWorkspace", "check_mla_decode_args", "default_sm_scale", "mla_decode"]
