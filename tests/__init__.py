"""Tests. Without CUDA, Triton kernels run in Triton's interpreter, which is chosen when a
kernel is defined: set here, before any test module imports one."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
