"""Triton kernels for the GPU path, each file laid out like the Triton tutorials.

Every module holds a torch reference first, then its `@triton.jit` kernels (`_x_kernel`), then
a launcher `x()` that checks shapes, strides and dtypes. Importing a kernel module imports
Triton; the CPU engine path never does. With `TRITON_INTERPRET=1` set before a kernel module is
imported, its kernels run on CPU tensors under Triton's interpreter (see `common.py`).

One kernel serves the CPU path instead: `cpu_attention.py` loads a small C kernel
(`cpu/paged_attention.c`, compiled on first use) that attends decode rows over the
paged cache in place; without a C compiler the engine keeps its torch path.
"""
