"""Test-wide set-up.

Triton decides at decoration time whether a kernel is compiled or interpreted, so the interpreter
switch must be set before any `kernels` module is imported: on machines without a CUDA GPU every
Triton kernel runs in the interpreter (float32 only; bf16 is broken there).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
