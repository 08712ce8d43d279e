"""Triton split-KV MLA decode kernels and their host launchers.

Without a GPU, Triton kernels run only through Triton's interpreter, on CPU tensors; the
interpreter is chosen when kernels are defined, so ``TRITON_INTERPRET=1`` must be in the
environment before graphbucket is imported. Importing graphbucket never sets it.
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

from graphbucket.kernels.launch import (
    SplitWorkspace,
    check_mla_decode_args,
    default_sm_scale,
    mla_decode,
)
from graphbucket.kernels.launch_balanced import mla_decode_balanced
from graphbucket.kernels.stage1 import mla_decode_stage1_kernel

INTERPRETED = isinstance(mla_decode_stage1_kernel, InterpretedFunction)


def kernel_device_error(device: torch.device | str) -> str | None:
    """Why Triton kernels cannot run on ``device`` in this process, and the fix; or None."""
    device = torch.device(device)
    if device.type == "cpu" and not INTERPRETED:
        return ("graphbucket's Triton kernels run on the CPU only in Triton's interpreter: set "
                "TRITON_INTERPRET=1 in the environment before importing graphbucket (e.g. "
                "`TRITON_INTERPRET=1 python3 script.py`), or use a CUDA device")
    if device.type == "cuda" and INTERPRETED:
        return ("TRITON_INTERPRET=1 is set, so Triton kernels run in the interpreter on CPU "
                "tensors only; unset it to run on CUDA")
    return None


__all__ = ["INTERPRETED", "SplitWorkspace", "check_mla_decode_args", "default_sm_scale",
           "kernel_device_error", "mla_decode", "mla_decode_balanced"]
