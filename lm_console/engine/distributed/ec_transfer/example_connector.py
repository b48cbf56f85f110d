"""ECExampleConnector: encoder outputs as safetensors files per mm_hash.

Layout: {shared_storage_path}/{name}/encoder_cache.safetensors holding {"ec_cache": tensor}.
Files are written to a temporary name and renamed, so a consumer's has_cache_item() never
sees half a file. Names are not paths: an identifier (a user's multi_modal_uuid may be one) is
the directory name only if it is plain ([A-Za-z0-9_-], at most 128 characters); any other is
hashed ("h." + sha256), so nothing is written outside shared_storage_path. A stored file that
cannot be read, or holds the wrong number of embeddings, is deleted and counted
(num_load_failures), and the worker runs the encoder instead. A file's safetensors header is
checked before its data is read (check_ec_file): one tensor "ec_cache" of [num_token, hidden],
a file size that matches it exactly, a bounded header, so a huge or sparse file costs no memory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_console.engine.distributed.ec_transfer.base import ECConnectorBase, ECConnectorMetadata, ECConnectorRole
from lm_console.engine.distributed.stored_tensor_file import check_single_tensor_file
from lm_console.engine.errors import InvalidEngineArgsError

if TYPE_CHECKING:
    from lm_console.engine.config.ec_transfer import ECTransferConfig
    from lm_console.engine.request import Request
    from lm_console.engine.scheduler_output import SchedulerOutput

_FILE = "encoder_cache.safetensors"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
_MAX_EMBED_DIM = 1 << 16  # when the model's hidden size is not known


def check_ec_file(file: Path, num_token: int, hidden_size: int | None) -> None:
    """Check a stored file's safetensors header and size before its data is read: one tensor
    "ec_cache" of [num_token, hidden_size] (hidden_size None: any width up to 65536) in a float
    dtype, and a file exactly as long as that tensor needs (InvalidStoredFileError otherwise)."""
    def shape_ok(shape: list[int]) -> bool:
        return (len(shape) == 2 and shape[0] == num_token
                and (shape[1] == hidden_size if hidden_size else 0 < shape[1] <= _MAX_EMBED_DIM))

    check_single_tensor_file(file, "ec_cache", shape_ok, f"[{num_token}, {hidden_size or 'hidden'}]")


logger = logging.getLogger(__name__)


def storage_name(identifier: str) -> str:
    """The directory name of an identifier: itself if plain, else "h." + its sha256 (no path tricks)."""
    if _PLAIN_NAME.fullmatch(identifier):
        return identifier
    return "h." + hashlib.sha256(identifier.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(slots=True)
class MMMeta:
    """One item to load: its hash and number of encoder embeddings."""

    mm_hash: str
    num_token: int


@dataclass
class ECExampleConnectorMetadata(ECConnectorMetadata):
    mm_datas: list[MMMeta] = field(default_factory=list)


class ECExampleConnector(ECConnectorBase):
    """Reference connector over a shared directory (debugging, tests, single-host EPD)."""

    def __init__(self, config: ECTransferConfig, role: ECConnectorRole) -> None:
        super().__init__(config, role)
        path = config.ec_connector_extra_config.get("shared_storage_path")
        if not path:
            raise InvalidEngineArgsError(
                "ECExampleConnector needs ec_connector_extra_config={'shared_storage_path': DIR}.")
        self.storage_path = Path(path)
        self.storage_path.mkdir(parents=True, exist_ok=True)
        self._mm_datas_need_loads: dict[str, int] = {}
        self._failed_loads: set[str] = set()
        self.num_saved = 0
        self.num_loaded = 0
        self.num_load_failures = 0

    def _file(self, mm_hash: str) -> Path:
        return self.storage_path / storage_name(mm_hash) / _FILE

    # -- worker role ---------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, Any], **kwargs: Any) -> None:
        from safetensors.torch import load_file

        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ECExampleConnectorMetadata)
        device = kwargs.get("device", "cpu")
        hidden_size = kwargs.get("hidden_size")  # the model's embedding width, when the worker knows it
        for meta in metadata.mm_datas:
            if meta.mm_hash in encoder_cache:
                continue
            file = self._file(meta.mm_hash)
            try:
                check_ec_file(file, meta.num_token, hidden_size)  # before load_file allocates
                tensor = load_file(str(file), device=str(device))["ec_cache"]
                if tensor.dim() != 2 or tensor.shape[0] != meta.num_token:
                    raise ValueError(f"it holds shape {tuple(tensor.shape)}, expected {meta.num_token} embeddings")
            except Exception as error:  # noqa: BLE001 - a bad stored file means "run the encoder"
                logger.warning("ECExampleConnector: %s cannot be loaded (%s: %s); it is deleted and recomputed",
                               file, type(error).__name__, error)
                self.num_load_failures += 1
                self._failed_loads.add(meta.mm_hash)
                try:
                    file.unlink()
                except OSError:
                    pass
                continue
            encoder_cache[meta.mm_hash] = tensor
            self.num_loaded += 1

    def take_failed_loads(self) -> set[str]:
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def save_caches(self, encoder_cache: dict[str, Any], mm_hash: str, **kwargs: Any) -> None:
        if not self.is_producer or self._file(mm_hash).exists():
            return
        from safetensors.torch import save_file

        directory = self.storage_path / storage_name(mm_hash)
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        try:
            save_file({"ec_cache": encoder_cache[mm_hash].detach().cpu().contiguous()}, tmp)
            os.replace(tmp, self._file(mm_hash))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self.num_saved += 1

    # -- scheduler role ------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        return self.is_consumer and self._file(identifier).exists()

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        self._mm_datas_need_loads[feature.identifier] = feature.num_embeds

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        metadata = ECExampleConnectorMetadata(
            [MMMeta(mm_hash, num_token) for mm_hash, num_token in self._mm_datas_need_loads.items()])
        self._mm_datas_need_loads = {}
        return metadata
