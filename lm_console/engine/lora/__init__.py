"""LoRA adapters: the request type and the checks of an adapter's files (torch-free).

The model side (stacked adapter weights, the batched shrink/expand) lives in
lm_console/engine/models/lora.py and lm_console/kernels/lora_ops.py; the worker's resident slots
and host-memory LRU in lm_console/engine/worker/lora_manager.py.
"""

from lm_console.engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
