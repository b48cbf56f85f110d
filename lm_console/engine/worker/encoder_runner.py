"""EncoderRunner: the worker's multimodal path.

Holds `encoder_cache: dict[str, Tensor]` (mm identifier -> encoder output [num_embeds, hidden]),
runs the encoder for the items the scheduler asked for, batched by modality
(_execute_mm_encoder), slices the embeddings of this step's tokens out of the cache
(_gather_mm_embeddings, exact under chunked prefill), and merges them into the token
embeddings (embed_input_ids, masked_scatter). It also drives the worker role of an ECConnector:
a consumer loads outputs instead of computing them, a producer saves what it computed.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from lm_console.engine.model_runner_output import ModelRunnerOutput
from lm_console.engine.platform import torch_device, torch_dtype

if TYPE_CHECKING:
    from lm_console.engine.distributed.ec_transfer.base import ECConnectorBase
    from lm_console.engine.scheduler_output import SchedulerOutput
    from lm_console.engine.worker.input_batch import CachedRequestState


class EncoderRunner:
    """encoder_cache + encoder execution + embedding gather/merge for one model."""

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype,
                 ec_connector: ECConnectorBase | None = None, hidden_size: int | None = None) -> None:
        self.model = model
        self.hidden_size = hidden_size  # encoder outputs' width: a stored output is checked against it
        self.device = device
        self.dtype = dtype
        self.ec_connector = ec_connector
        self.encoder_cache: dict[str, Tensor] = {}
        self.num_encoder_runs = 0  # items whose encoder this worker computed
        self.num_encoder_batches = 0  # model.embed_multimodal() calls

    @property
    def is_producer_only(self) -> bool:
        return self.ec_connector is not None and self.ec_connector.config.is_producer_only

    # -- per step ----------------------------------------------------------------------------
    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Drop the outputs the scheduler evicted."""
        for mm_hash in scheduler_output.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)

    @torch.inference_mode()
    def execute_mm_encoder(self, scheduler_output: SchedulerOutput,
                           requests: dict[str, CachedRequestState]) -> None:
        """Load (consumer) or compute the scheduled items into encoder_cache (after vLLM's _execute_mm_encoder)."""
        connector = self.ec_connector
        failed_loads: set[str] = set()
        if connector is not None and scheduler_output.ec_connector_metadata is not None:
            connector.bind_connector_metadata(scheduler_output.ec_connector_metadata)
            if connector.is_consumer:
                connector.start_load_caches(self.encoder_cache, device=self.device, hidden_size=self.hidden_size)
                failed_loads = connector.take_failed_loads()
        try:
            by_modality: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
            seen: set[str] = set()
            scheduled = [(req_id, [requests[req_id].mm_features[i] for i in input_ids])
                         for req_id, input_ids in scheduler_output.scheduled_encoder_inputs.items()]
            if failed_loads:  # a stored output that could not be loaded is computed here instead
                scheduled += [(req_id, [f for f in state.mm_features if f.identifier in failed_loads])
                              for req_id, state in requests.items()]
            for _, features in scheduled:
                for feature in features:
                    if feature.identifier in self.encoder_cache or feature.identifier in seen:
                        continue
                    if feature.data is None:
                        raise RuntimeError(f"mm item {feature.identifier} has no data to encode")
                    seen.add(feature.identifier)
                    by_modality[feature.modality].append((feature.identifier, feature.data))
            for items in by_modality.values():
                self._run_encoder(items)
        finally:
            if connector is not None:
                connector.clear_connector_metadata()

    def _run_encoder(self, items: list[tuple[str, dict[str, Any]]]) -> None:
        # One embed_multimodal call per modality: kwargs are lists with one tensor per item.
        kwargs: dict[str, list[Tensor]] = defaultdict(list)
        for _, data in items:
            for key, value in data.items():
                kwargs[key].append(_to_tensor(value, self.device))
        outputs = self.model.embed_multimodal(**kwargs)
        self.num_encoder_batches += 1
        for (mm_hash, _), output in zip(items, outputs, strict=True):
            self.encoder_cache[mm_hash] = output
            self.num_encoder_runs += 1
            if self.ec_connector is not None and self.ec_connector.is_producer:
                self.ec_connector.save_caches(self.encoder_cache, mm_hash)

    def gather_mm_embeddings(self, req_states: list[CachedRequestState], num_computed: np.ndarray,
                             num_scheduled: np.ndarray, total: int) -> tuple[Tensor | None, Tensor | None]:
        """The cached embeddings of this step's placeholder positions, in batch order, and the
        [total] bool mask of those positions (after vLLM's _gather_mm_embeddings)."""
        is_mm = np.zeros(total, dtype=bool)
        pieces: list[Tensor] = []
        start_in_batch = 0
        for row, state in enumerate(req_states):
            computed, scheduled = int(num_computed[row]), int(num_scheduled[row])
            for feature in state.mm_features:
                start_pos, length = feature.offset, feature.length
                if start_pos >= computed + scheduled:
                    break
                if start_pos + length <= computed:
                    continue
                # Overlap of [start_pos, start_pos + length) with [computed, computed + scheduled).
                start_idx = max(computed - start_pos, 0)
                end_idx = min(computed + scheduled - start_pos, length)
                if feature.is_embed is None:
                    mask = np.ones(end_idx - start_idx, dtype=bool)
                    first = start_idx
                else:
                    full = np.frombuffer(feature.is_embed, dtype=np.uint8).astype(bool)
                    mask = full[start_idx:end_idx]
                    first = int(full[:start_idx].sum())
                num_embeds = int(mask.sum())
                if num_embeds == 0:
                    continue
                output = self.encoder_cache.get(feature.identifier)
                if output is None:
                    raise RuntimeError(f"encoder output of {feature.identifier} is not in the encoder cache")
                pieces.append(output[first:first + num_embeds])
                batch_pos = start_in_batch + start_pos + start_idx - computed
                is_mm[batch_pos:batch_pos + len(mask)] = mask
            start_in_batch += scheduled
        if not pieces:
            return None, None
        return torch.cat(pieces), torch.from_numpy(is_mm).to(self.device)

    def get_inputs_embeds(self, input_ids: Tensor, req_states: list[CachedRequestState],
                          num_computed: np.ndarray, num_scheduled: np.ndarray) -> Tensor | None:
        """Merged text + image embeddings for this step, or None when no image token is scheduled."""
        if not any(state.mm_features for state in req_states):
            return None
        mm_embeds, is_mm = self.gather_mm_embeddings(req_states, num_computed, num_scheduled,
                                                     int(input_ids.shape[0]))
        if mm_embeds is None:
            return None
        return self.model.embed_input_ids(input_ids, multimodal_embeddings=mm_embeds, is_multimodal=is_mm)

    def bidirectional_spans(self, req_states: list[CachedRequestState], num_computed: np.ndarray,
                            num_scheduled: np.ndarray) -> dict[int, list[tuple[int, int]]] | None:
        """For a model attending both ways within an image (Gemma3): row -> the image-token runs
        (start, end positions) that this step's prefill tokens reach into; None when none do.

        The scheduler keeps the rest of such an image in one chunk (requires_unsplit_mm_items),
        so every key a span's query may see is in the cache or in this step.
        """
        if not getattr(self.model, "mm_bidirectional_attention", False):
            return None
        spans: dict[int, list[tuple[int, int]]] = {}
        for row, state in enumerate(req_states):
            begin, end = int(num_computed[row]), int(num_computed[row] + num_scheduled[row])
            if end - begin < 2:
                continue  # a single new token sees every earlier one anyway
            for feature in state.mm_features:
                if feature.offset >= end:
                    break
                if feature.offset + feature.length <= begin:
                    continue
                for start, stop in _embed_runs(feature):
                    if stop - start > 1 and start < end and stop > begin:
                        spans.setdefault(row, []).append((start, stop))
        return spans or None

    # -- producer-only engines -----------------------------------------------------------------
    def make_encoder_only_output(self, req_ids: list[str], prefill_done: list[bool]) -> ModelRunnerOutput:
        """A producer runs no decoder: a placeholder token (0) ends each request whose prompt is
        through (the engine caps producer requests at max_tokens=1)."""
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[0] if done else [] for done in prefill_done])


def _embed_runs(feature: Any) -> list[tuple[int, int]]:
    """The contiguous runs of embedding positions of one item, as absolute (start, end)."""
    if feature.is_embed is None:
        return [(feature.offset, feature.offset + feature.length)]
    runs: list[tuple[int, int]] = []
    start = None
    for i, flag in enumerate(feature.is_embed):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((feature.offset + start, feature.offset + i))
            start = None
    if start is not None:
        runs.append((feature.offset + start, feature.offset + len(feature.is_embed)))
    return runs


def _to_tensor(value: Any, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        return value.to(device)
    array = np.ascontiguousarray(value)
    if not array.flags.writeable:  # a view of a received ZMQ frame: torch wants writable memory
        array = array.copy()
    return torch.from_numpy(array).to(device)


def maybe_create_encoder_runner(model: Any, config: Any) -> EncoderRunner | None:
    """An EncoderRunner for a model with embed_multimodal, with the worker-role ECConnector."""
    if not hasattr(model, "embed_multimodal"):
        return None
    connector = None
    if config.ec_transfer_config is not None:
        from lm_console.engine.distributed.ec_transfer.base import ECConnectorRole
        from lm_console.engine.distributed.ec_transfer.factory import ECConnectorFactory

        connector = ECConnectorFactory.create_connector(config.ec_transfer_config, ECConnectorRole.WORKER)
    return EncoderRunner(model, torch_device(config.device_config.device), torch_dtype(config.model_config.dtype),
                         connector, hidden_size=getattr(config.model_config, "hidden_size", None))
