"""ExampleConnector: a prompt's KV as safetensors files in a directory, for tests (after vLLM's example_connector).

A producer saves, layer by layer (save_kv_layer), the KV of a prompt's whole blocks once they
are computed: `<storage_path>/<sha256 of those tokens>/layer.<i>.safetensors`, tensor "kv" of
shape [2, num_tokens, num_kv_heads, head_dim]. A consumer whose prompt matches a saved one
loads it synchronously: start_load_kv opens the files, and each attention layer's
wait_for_layer_load copies its own layer just before it runs. A missing or unreadable file is
reported through get_block_ids_with_load_errors and the request is recomputed.
"""

from __future__ import annotations

import hashlib
import logging
import math
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_console.engine.distributed.stored_tensor_file import DTYPE_BYTES, check_single_tensor_file
from lm_console.engine.distributed.kv_transfer.base import (
    KVConnectorBase, KVConnectorMetadata, KVConnectorRole, extend_tracked_block_ids,
)

if TYPE_CHECKING:
    from lm_console.engine.config.engine_config import EngineConfig
    from lm_console.engine.kv_cache_interface import AllocatedBlocks
    from lm_console.engine.scheduler_output import SchedulerOutput
    from lm_console.engine.config.kv_transfer import KVTransferConfig
    from lm_console.engine.forward_context import ForwardContext
    from lm_console.engine.request import Request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ReqTransfer:
    """One request's prompt KV: tokens [0, num_tokens) in block_ids, stored under folder."""

    req_id: str
    folder: str
    num_tokens: int
    block_ids: list[int]


@dataclass
class ExampleConnectorMetadata(KVConnectorMetadata):
    loads: list[ReqTransfer] = field(default_factory=list)
    saves: list[ReqTransfer] = field(default_factory=list)


def prompt_key(token_ids: list[int]) -> str:
    """Folder name of a token prefix."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()[:32]


class ExampleConnector(KVConnectorBase):
    """Safetensors per layer and per prompt; synchronous loads pipelined layer by layer."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_transfer_config: KVTransferConfig) -> None:
        super().__init__(config, role, kv_transfer_config)
        path = kv_transfer_config.get_from_extra_config("storage_path", "/tmp/lmc_example_connector")
        self.storage_path = Path(path)
        self.block_size = config.cache_config.block_size
        self.is_producer = kv_transfer_config.is_kv_producer
        self.is_consumer = kv_transfer_config.is_kv_consumer
        # scheduler side
        self._loads: list[ReqTransfer] = []
        self._requests: dict[str, Request] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._saved: set[str] = set()
        # worker side
        self.kv_caches: dict[str, Any] = {}
        self._open_loads: list[tuple[ReqTransfer, Path]] = []
        self._invalid_block_ids: set[int] = set()

    def _num_prompt_tokens(self, request: Request) -> int:
        # Whole blocks, leaving the last prompt token to compute.
        return (request.num_prompt_tokens - 1) // self.block_size * self.block_size

    def _folder(self, request: Request) -> Path:
        return self.storage_path / prompt_key(request.prompt_token_ids[:self._num_prompt_tokens(request)])

    # -- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        num_tokens = self._num_prompt_tokens(request)
        if not self.is_consumer or num_tokens <= num_computed_tokens or request.num_output_tokens:
            return 0, False
        folder = self._folder(request)
        if not (folder / "layer.0.safetensors").is_file():
            return 0, False
        return num_tokens - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: AllocatedBlocks, num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        block_ids = list(blocks.get_block_ids()[0])
        self._block_ids[request.request_id] = block_ids
        if num_external_tokens > 0:
            num_tokens = self._num_prompt_tokens(request)
            self._loads.append(ReqTransfer(request.request_id, str(self._folder(request)), num_tokens,
                                           block_ids[:num_tokens // self.block_size]))
            self._saved.add(request.request_id)  # it is stored already

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ExampleConnectorMetadata:
        metadata = ExampleConnectorMetadata(loads=self._loads)
        self._loads = []
        extend_tracked_block_ids(self._block_ids, scheduler_output)
        if not self.is_producer:
            return metadata
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None or req_id in self._saved:
                continue
            num_tokens = self._num_prompt_tokens(request)
            if 0 < num_tokens <= request.num_computed_tokens + num_scheduled:
                self._saved.add(req_id)
                if not (self._folder(request) / "layer.0.safetensors").is_file():
                    metadata.saves.append(ReqTransfer(req_id, str(self._folder(request)), num_tokens,
                                                      self._block_ids[req_id][:num_tokens // self.block_size]))
        return metadata

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        for state in (self._requests, self._block_ids):
            state.pop(request.request_id, None)
        self._saved.discard(request.request_id)
        return False, None

    # -- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.kv_caches = kv_caches

    def _metadata(self) -> ExampleConnectorMetadata:
        metadata = self._get_connector_metadata()
        return metadata if isinstance(metadata, ExampleConnectorMetadata) else ExampleConnectorMetadata()

    def start_load_kv(self, forward_context: ForwardContext | None) -> None:
        self._open_loads = [(load, Path(load.folder)) for load in self._metadata().loads]

    def has_pending_layer_loads(self) -> bool:
        return bool(self._open_loads) or bool(self._metadata().saves)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._open_loads:
            return
        import torch
        from safetensors.torch import load_file

        kv_cache = self.kv_caches[layer_name]
        _, _, block_size, num_heads, head_dim = kv_cache.shape
        for load in list(self._open_loads):
            transfer, folder = load
            try:
                file = folder / f"{layer_name}.safetensors"
                # the header and size first: load_file would allocate whatever the file declares
                elements = 2 * len(transfer.block_ids) * math.prod(kv_cache.shape[2:])
                check_single_tensor_file(file, "kv", lambda shape, n=elements: math.prod(shape) == n,
                                         f"{elements} elements (2 x {len(transfer.block_ids)} blocks)",
                                         dtypes=tuple(DTYPE_BYTES))
                kv = load_file(str(file))["kv"]
                if (kv.dtype == torch.int8) != (kv_cache.dtype == torch.int8):
                    # the int8 cache's bytes are no float values: never convert between the two
                    raise ValueError(f"the files hold a {kv.dtype} KV cache, this engine's is {kv_cache.dtype}")
                num_blocks = len(transfer.block_ids)
                kv = kv.to(kv_cache.device, kv_cache.dtype).view(2, num_blocks, block_size, num_heads, head_dim)
                kv_cache[:, torch.tensor(transfer.block_ids, device=kv_cache.device)] = kv
            except Exception as exc:  # noqa: BLE001 - any unreadable file means: recompute
                logger.warning("ExampleConnector: cannot load %s (%s); recomputing", folder, exc)
                self._invalid_block_ids.update(transfer.block_ids)
                self._open_loads.remove(load)
                shutil.rmtree(folder, ignore_errors=True)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        saves = self._metadata().saves
        if not saves:
            return
        import torch
        from safetensors.torch import save_file

        for save in saves:
            folder = Path(save.folder)
            folder.mkdir(parents=True, exist_ok=True)
            index = torch.tensor(save.block_ids, device=kv_layer.device)
            kv = kv_layer[:, index].reshape(2, save.num_tokens, *kv_layer.shape[3:]).cpu().contiguous()
            save_file({"kv": kv}, str(folder / f"{layer_name}.safetensors"))

    def wait_for_save(self) -> None:
        """Saves are synchronous (save_kv_layer wrote each layer's file)."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        self._open_loads = []
        return invalid
