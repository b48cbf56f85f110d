"""Kernel tests: on CPU under Triton's interpreter (small shapes), on a GPU at real sizes.

TRITON_INTERPRET must be set before a kernel module is imported (Triton reads it when a kernel
is decorated), so it is set here, at collection, before any test module of this folder loads.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
