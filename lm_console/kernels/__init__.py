"""Triton kernels for the GPU path, each file laid out like the Triton tutorials.

Every module holds a torch reference first, then its `@triton.jit` kernels (`_x_kernel`), then
a launcher `x()` that checks shapes, strides and dtypes. Importing a kernel module imports
Triton; the CPU engine path never does. With `TRITON_INTERPRET=1` set before a kernel module is
imported, its kernels run on CPU tensors under Triton's interpreter (see `common.py`).

The CPU path has C kernels instead: `cpu_attention.py` loads `cpu/paged_attention.c` (decode
rows) and `cpu/paged_prefill.c` (prefill chunks), compiled on first use into one library, which
attend over the paged cache in place; without a C compiler the engine keeps its torch path.
"""
