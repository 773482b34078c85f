"""Tests. Without CUDA, Triton kernels run in Triton's interpreter, which is chosen when a
kernel is defined: set here, before any test module imports one. Engines (and the daemons the
tests start) run eagerly unless a test asks for decode graphs (`enforce_eager=False`): the
compiled CPU forward is tested on engines of its own (tests/test_compiled_forward.py)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("DEEPINFER_ENGINE_ENFORCE_EAGER", "1")
