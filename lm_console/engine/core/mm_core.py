"""The engine core's multimodal parts: ProcessorCache receivers, the EncoderScheduler, the
scheduler-role ECConnector, and the KV manager of an encoder-only (EC producer) engine.

It follows vLLM's multimodal pipeline and its ECConnector producer mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lm_console.engine.core.kv_cache.manager import KVCacheManager
from lm_console.engine.core.kv_cache.manager import KVCacheBlocks
from lm_console.engine.core.sched.encoder_scheduling import EncoderScheduler
from lm_console.engine.errors import MultiModalNotSupportedError
from lm_console.engine.multimodal.processing import get_max_tokens_per_mm_item, requires_unsplit_mm_items
from lm_console.engine.multimodal.processor_cache import MultiModalReceiverCache

if TYPE_CHECKING:
    from lm_console.engine.config.engine_config import EngineConfig
    from lm_console.engine.protocol import EngineCoreRequest
    from lm_console.engine.request import Request


class MultiModalCore:
    """Everything multimodal that EngineCore owns; a no-op for text-only models."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.is_multimodal = config.model_config.is_multimodal
        self.ec_config = config.ec_transfer_config
        self.is_producer_only = self.ec_config is not None and self.ec_config.is_producer_only
        mm_config = config.mm_config
        self._cache_bytes = mm_config.processor_cache_bytes if mm_config is not None else 0
        self._receivers: dict[int, MultiModalReceiverCache] = {}  # one per frontend client
        self.encoder_scheduler: EncoderScheduler | None = None
        if self.is_multimodal:
            self.encoder_scheduler = self._make_encoder_scheduler()

    def _make_encoder_scheduler(self) -> EncoderScheduler:
        model, mm = self.config.model_config, self.config.mm_config
        connector = None
        if self.ec_config is not None:
            from lm_console.engine.distributed.ec_transfer.base import ECConnectorRole
            from lm_console.engine.distributed.ec_transfer.factory import ECConnectorFactory

            connector = ECConnectorFactory.create_connector(self.ec_config, ECConnectorRole.SCHEDULER)
        budget = self.config.scheduler_config.max_num_batched_tokens
        return EncoderScheduler(
            max_num_encoder_input_tokens=(mm.max_num_encoder_input_tokens if mm else None) or budget,
            encoder_cache_size=(mm.encoder_cache_size if mm else None) or budget,
            max_tokens_per_mm_item=get_max_tokens_per_mm_item(Path(model.model_dir), model.hf_config),
            max_num_batched_tokens=budget,
            # Bidirectional attention within an image (Gemma3) needs the image's tokens in one chunk.
            disable_chunked_mm_input=bool(mm and mm.disable_chunked_mm_input)
            or requires_unsplit_mm_items(model.architectures),
            ec_connector=connector)

    def preprocess_request(self, engine_request: EngineCoreRequest) -> None:
        """Fill in data the frontend left out (ProcessorCache hit); reject images for text models.

        Runs before any other check so that the receiver sees every request the sender sent.
        """
        features = engine_request.mm_features
        if not features:
            return
        if self._cache_bytes > 0:
            receiver = self._receivers.get(engine_request.client_index)
            if receiver is None:
                receiver = self._receivers[engine_request.client_index] = MultiModalReceiverCache(self._cache_bytes)
            for feature in features:
                receiver.get_and_update(feature)
        if not self.is_multimodal:
            raise MultiModalNotSupportedError(
                f"request {engine_request.request_id} has images but model {self.config.model_config.model_name} is "
                "text-only; use a vision-language model (e.g. --model demo-vlm).")

    def validate_request(self, request: Request) -> None:
        if self.encoder_scheduler is not None and request.mm_features:
            self.encoder_scheduler.validate(request)
        if self.is_producer_only:
            request.max_tokens = 1  # an encoder-only engine emits one placeholder token per request


class EncoderOnlyKVCacheManager(KVCacheManager):
    """The KV manager of an EC producer: it runs no decoder, so it holds no KV blocks."""

    def __init__(self, max_model_len: int, block_size: int) -> None:
        super().__init__(num_blocks=2, block_size=block_size, max_model_len=max_model_len,
                         enable_caching=False)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        return self.empty_kv_cache_blocks, 0

    def allocate_slots(self, request: Request, num_new_tokens: int, *args: object, **kwargs: object) -> KVCacheBlocks:
        return self.empty_kv_cache_blocks
