"""ModelRunner: turns a SchedulerOutput into one forward pass (after vLLM's GPUModelRunner)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lm_console.engine.attention.layer import get_attention_layers, get_kv_cache_shape, set_attention_backend
from lm_console.engine.attention.metadata import AttentionMetadata
from lm_console.engine.attention.selector import load_attention_backend, resolve_attention_backend
from lm_console.engine.config.engine_config import EngineConfig
from lm_console.engine.distributed.kv_transfer.base import KVConnectorBase
from lm_console.engine.distributed.kv_transfer.output import KVConnectorOutput
from lm_console.engine.distributed.parallel_state import get_tp_group
from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.forward_context import set_forward_context
from lm_console.engine.kv_cache_interface import KVCacheConfig, KVCacheSpec, get_kv_cache_config
from lm_console.engine.model_runner_output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from lm_console.engine.models.loader import load_model
from lm_console.engine.models.lora import lora_step
from lm_console.engine.platform import torch_device, torch_dtype
from lm_console.engine.protocol import LogprobsLists
from lm_console.engine.sample.grammar_bitmask import apply_grammar_bitmask
from lm_console.engine.sample.metadata import SamplingMetadata
from lm_console.engine.sample.sampler import Sampler
from lm_console.engine.scheduler_output import SchedulerOutput
from lm_console.engine.worker.cpu_gpu_buffer import CpuGpuBuffer, InputBuffers
from lm_console.engine.worker.cuda_graph import CudaGraphRunner
from lm_console.engine.worker.draft_verifier import DraftVerifier
from lm_console.engine.worker.encoder_runner import EncoderRunner, maybe_create_encoder_runner
from lm_console.engine.worker.input_batch import CachedRequestState, InputBatch
from lm_console.engine.worker.kv_cache_groups import GroupAttentionMetadataBuilder, allocate_kv_caches, get_kv_cache_spec
from lm_console.engine.worker.kv_connector_lifecycle import KVConnectorLifecycle, NoKVConnectorLifecycle
from lm_console.engine.worker.pooling import Pooler
from lm_console.engine.worker.prompt_logprobs import PromptLogprobsChunk, compute_prompt_logprobs
from lm_console.engine.worker.step_inputs import (
    StepInputs,
    build_attention_metadata,
    prepare_inputs,
    verification_attention_metadata,
    verification_logits_indices,
)

if TYPE_CHECKING:
    from lm_console.engine.worker.lora_manager import LoRAManager


@dataclass(slots=True)
class ExecuteModelState:
    """What execute_model() leaves for sample_tokens() (vLLM's two-phase execute_model / sample_tokens)."""

    req_ids: list[str]
    logits: torch.Tensor  # [num_reqs, vocab_size] float32
    sample_rows: list[bool]  # False for a partial prefill, whose sample is discarded
    # Structured outputs: the constrained requests and their bitmask rows (SchedulerOutput's).
    structured_output_request_ids: list[str] | None = None
    grammar_bitmask: Any = None
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)  # this step's rows (prompt_logprobs.py)
    pooler_output: dict[str, list[float]] = field(default_factory=dict)  # embeddings finished this step (pooling.py)
    # Speculative decoding: each request's drafts ([] for none) when some request verifies
    # drafts this step; logits then hold len(drafts) + 1 rows per request, in request order.
    draft_token_ids: list[list[int]] | None = None


class ModelRunner:
    """Owns the model, the KV cache tensors, the persistent InputBatch and the Sampler.

    Inputs are staged in persistent CpuGpuBuffers (pinned and copied asynchronously on CUDA;
    the device tensor is the host tensor on CPU). On CUDA with the Triton backend, pure-decode
    steps replay CUDA graphs unless config.device_config.enforce_eager. A worker-side KV
    connector, if any, runs its lifecycle around each step through `kv_transfer`
    (kv_connector_lifecycle.py).
    """

    def __init__(self, config: EngineConfig, kv_connector: KVConnectorBase | None = None) -> None:
        self.config = config
        model, sched = config.model_config, config.scheduler_config
        self.device = torch_device(config.device_config.device)
        self.dtype = torch_dtype(model.dtype)
        # The KV cache's element type: the model's, or int8 (lm_console/engine/attention/int8_cache.py).
        # EngineArgs resolves "auto"; a config built by hand may leave it (the model's dtype).
        cache_dtype = config.cache_config.kv_cache_dtype
        if cache_dtype not in ("auto", "int8", model.dtype):
            raise ValueError(f"kv_cache_dtype {cache_dtype!r} is neither 'int8' nor the model's dtype "
                             f"{model.dtype!r} (EngineArgs resolves it: resolve_kv_cache_dtype)")
        self.kv_cache_dtype = torch.int8 if cache_dtype == "int8" else self.dtype
        self.block_size = config.cache_config.block_size
        self.max_model_len = model.max_model_len
        self.num_layers = model.num_layers  # a VLM's facts are its language model's
        # Tensor parallelism: this rank's KV heads only (its KV cache holds those).
        self.num_kv_heads = model.num_kv_heads // config.parallel_config.tensor_parallel_size
        self.head_dim = model.head_dim
        self.vocab_size = model.vocab_size
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(sched.max_num_seqs, self.max_model_len, self.block_size, self.device)
        max_num_tokens = max(sched.max_num_batched_tokens, sched.max_num_seqs)
        max_num_seqs = sched.max_num_seqs

        def buffer(*size: int, dtype: torch.dtype) -> CpuGpuBuffer:
            return CpuGpuBuffer(*size, dtype=dtype, device=self.device)

        self.buffers = InputBuffers(
            input_ids=buffer(max_num_tokens, dtype=torch.int64),
            positions=buffer(max_num_tokens, dtype=torch.int64),
            slot_mapping=buffer(max_num_tokens, dtype=torch.int64),
            query_start_loc=buffer(max_num_seqs + 1, dtype=torch.int32),
            seq_lens=buffer(max_num_seqs, dtype=torch.int32),
            block_table=self.input_batch.block_table[0].buffer,
            logits_indices=buffer(max_num_seqs, dtype=torch.int64),
        )
        self.attention_backend = resolve_attention_backend(config.device_config.attention_backend, self.device)
        self.attn_backend = load_attention_backend(self.attention_backend, self.device)
        self.cuda_graphs: CudaGraphRunner | None = None
        self.sampler = Sampler()
        self.draft_verifier = DraftVerifier(self.vocab_size, self.device)
        self.speculative = config.speculative_config is not None
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.kv_cache_config: KVCacheConfig | None = None
        self.group_metadata_builder: GroupAttentionMetadataBuilder | None = None  # hybrid models
        self._sampling_metadata: SamplingMetadata | None = None
        self._state: ExecuteModelState | None = None
        # Multimodal models: encoder_cache, encoder execution, embedding merge (encoder_runner.py).
        self.encoder_runner: EncoderRunner | None = None
        self._encoder_only_output: ModelRunnerOutput | None = None
        self.kv_transfer: KVConnectorLifecycle | NoKVConnectorLifecycle = (
            NoKVConnectorLifecycle() if kv_connector is None else KVConnectorLifecycle(kv_connector))
        self._kv_connector_output: KVConnectorOutput | None = None
        # Async scheduling: the previous step's samples stay on the device; the next step takes
        # a request's input token from here when the scheduler only had a placeholder for it
        # (vLLM's prev_sampled_token_ids), not from the host copy.
        self.async_scheduling = sched.async_scheduling
        self.prev_sampled_token_ids: torch.Tensor | None = None  # [num_prev_reqs] int64, device
        self.prev_sampled: dict[str, tuple[int, int]] = {}  # req_id -> (row there, token position)
        self._num_prompt_logprobs_reqs = 0  # requests asking for prompt logprobs (skip the scan when 0)
        self.lora_manager: LoRAManager | None = None  # enable_lora: the adapters' slots (lora_manager.py)
        self.pooler = Pooler()
        self._pooling_reqs: set[str] = set()  # requests asking for an embedding (skip the scan when empty)

    @property
    def kv_connector(self) -> KVConnectorBase | None:
        """The worker-side KV connector (None when none is configured)."""
        return self.kv_transfer.connector

    # -- set-up ---------------------------------------------------------------------------
    def load_model(self) -> None:
        model_config = self.config.model_config
        self.model = load_model(Path(model_config.model_dir), model_config.hf_config, self.dtype, self.device,
                                quantization=model_config.quantization)
        set_attention_backend(self.model, self.attn_backend)
        lora_config = self.config.lora_config
        if lora_config is not None:
            from lm_console.engine.worker.lora_manager import LoRAManager

            self.lora_manager = LoRAManager(self.model, lora_config, model_config, self.dtype, self.device)
        self.encoder_runner = maybe_create_encoder_runner(self.model, self.config)
        if self.speculative and self.encoder_runner is not None:
            raise InvalidEngineArgsError(
                "speculative_config is not supported with multimodal models yet (their image spans attend "
                "both ways, which per-draft verification rows do not express); drop speculative_config.")

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A cache-less forward of a full token budget, then logits and a sort (top-p) of
        max_num_seqs rows: the activation peak the KV cache must leave room for."""
        assert self.model is not None
        num_tokens = self.buffers.input_ids.cpu.shape[0]
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.max_model_len
        with set_forward_context(None):
            hidden_states = self.model(input_ids, positions)
        logits = self.model.compute_logits(hidden_states[: self.config.scheduler_config.max_num_seqs])
        torch.sort(logits, dim=-1, descending=True)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """Each attention layer's KVCacheSpec, by layer name (after vLLM's get_kv_cache_specs)."""
        assert self.model is not None
        return get_kv_cache_spec(self.model, self.block_size)

    def get_kv_cache_block_bytes(self) -> int:
        """Bytes one block takes across the layers it spans (K and V): all layers for a single
        KV cache group, one layer per group for hybrid models (see lm_console/engine/kv_cache_interface.py)."""
        num_layers = get_kv_cache_config(self.get_kv_cache_spec(), 0).num_layers_per_block
        shape = get_kv_cache_shape(1, self.block_size, self.num_kv_heads, self.head_dim,
                                   int8=self.kv_cache_dtype == torch.int8)
        return num_layers * math.prod(shape) * self.kv_cache_dtype.itemsize

    def initialize_kv_cache(self, num_blocks: int) -> None:
        assert self.model is not None
        self.kv_cache_config = get_kv_cache_config(self.get_kv_cache_spec(), num_blocks)
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        if num_groups > 1 and self.speculative:
            raise InvalidEngineArgsError(
                "speculative_config is not supported with hybrid (sliding-window + full attention) models yet: "
                "verification rows use one block table; drop speculative_config.")
        if num_groups > 1:  # one block table (and slot mapping) per KV cache group
            self.input_batch = InputBatch(self.config.scheduler_config.max_num_seqs, self.max_model_len,
                                          self.block_size, self.device, num_groups)
            self.buffers.block_table = self.input_batch.block_table[0].buffer
            self.group_metadata_builder = GroupAttentionMetadataBuilder(
                self.input_batch.block_table, self.buffers.input_ids.cpu.shape[0], self.device)
        self.kv_caches = allocate_kv_caches(self.model, self.kv_cache_config, self.block_size,
                                            self.kv_cache_dtype, self.device,
                                            prefault=self.config.cache_config.kv_cache_prefault)
        self.kv_transfer.register_kv_caches(
            {layer.layer_name: layer.kv_cache for layer in get_attention_layers(self.model)}, num_groups)
        # Decode graphs read group 0's block table only: hybrid models run eagerly. Tensor-parallel
        # ranks run eagerly too (their all-reduces are not captured in graphs yet).
        if (self.device.type == "cuda" and self.attention_backend == "triton"
                and not self.config.device_config.enforce_eager and num_groups == 1
                and self.config.parallel_config.tensor_parallel_size == 1):
            max_num_seqs = self.config.scheduler_config.max_num_seqs
            self.cuda_graphs = CudaGraphRunner(self.model, self.buffers, max_num_seqs,
                                               self.block_size, self.max_model_len)
            self.cuda_graphs.capture()

    # -- step, phase 1 --------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Run the forward pass and keep the last-token logits for sample_tokens()."""
        self._update_states(scheduler_output)
        encoder = self.encoder_runner
        if encoder is not None:
            encoder.update_states(scheduler_output)
            encoder.execute_mm_encoder(scheduler_output, self.requests)
        self.kv_transfer.begin(scheduler_output)
        self._state = None
        if scheduler_output.is_empty:  # the connector's lifecycle still runs (after vLLM's kv_connector_no_forward)
            self._kv_connector_output = self.kv_transfer.finish(scheduler_output)
            return
        if encoder is not None and encoder.is_producer_only:  # ECConnector producer: no decoder
            self._encoder_only_output = encoder.make_encoder_only_output(*self._encoder_only_rows(scheduler_output))
            return
        inputs = self._prepare_inputs(scheduler_output)
        hidden_states = self._forward(inputs)  # [num_tokens, hidden]
        logits_indices = inputs.logits_indices
        if inputs.draft_token_ids is not None:
            logits_indices = verification_logits_indices(inputs, self.device)
        logits = self.model.compute_logits(hidden_states[logits_indices])
        prompt_logprobs = {}
        if self._num_prompt_logprobs_reqs:
            prompt_logprobs = compute_prompt_logprobs(hidden_states, inputs, self.input_batch.states[:inputs.num_reqs],
                                                      self.model.compute_logits)
        pooler_output = {}
        if self._pooling_reqs:
            pooler_output = self.pooler.pool(hidden_states, inputs, self.input_batch.states[:inputs.num_reqs])
        self._kv_connector_output = self.kv_transfer.finish(scheduler_output)
        self._state = ExecuteModelState(req_ids=inputs.req_ids, logits=logits, sample_rows=inputs.sample_rows,
                                        structured_output_request_ids=scheduler_output.structured_output_request_ids,
                                        grammar_bitmask=scheduler_output.grammar_bitmask,
                                        prompt_logprobs=prompt_logprobs, pooler_output=pooler_output,
                                        draft_token_ids=inputs.draft_token_ids)

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        """The step's inputs staged in the persistent buffers, plus multimodal embeddings."""
        batch = self.input_batch
        inputs = prepare_inputs(batch, self.buffers, scheduler_output.num_scheduled_tokens)
        spec = scheduler_output.scheduled_spec_decode_tokens
        if spec:
            inputs.draft_token_ids = [spec.get(req_id, []) for req_id in inputs.req_ids]
        if self.prev_sampled:
            self._copy_prev_sampled_token_ids(inputs)
        if self.encoder_runner is not None:
            inputs.inputs_embeds = self.encoder_runner.get_inputs_embeds(
                inputs.input_ids, batch.states[:inputs.num_reqs], inputs.num_computed, inputs.num_scheduled)
        return inputs

    def _copy_prev_sampled_token_ids(self, inputs: StepInputs) -> None:
        """Input ids of the tokens the previous step sampled, copied on the device from its
        samples: a decoding request's last scheduled token is the one sampled just before."""
        src_rows: list[int] = []
        dst_indices: list[int] = []
        last_indices = inputs.cu_num_tokens - 1
        # Plain ints once for the batch: numpy scalar indexing per request costs more than the loop.
        last_positions = inputs.positions[last_indices].tolist()
        for req_id, last, position in zip(inputs.req_ids, last_indices.tolist(), last_positions):
            prev = self.prev_sampled.get(req_id)
            if prev is not None and position == prev[1]:
                src_rows.append(prev[0])
                dst_indices.append(last)
        if dst_indices:
            assert self.prev_sampled_token_ids is not None
            src = torch.tensor(src_rows, dtype=torch.int64).to(self.device, non_blocking=True)
            dst = torch.tensor(dst_indices, dtype=torch.int64).to(self.device, non_blocking=True)
            inputs.input_ids.index_copy_(0, dst, self.prev_sampled_token_ids.index_select(0, src))

    def _encoder_only_rows(self, scheduler_output: SchedulerOutput) -> tuple[list[str], list[bool]]:
        """(request ids, whether each request's prompt is complete after this step)."""
        batch = self.input_batch
        req_ids = batch.req_ids[:batch.num_reqs]
        seq_lens = batch.num_computed_tokens_cpu[:batch.num_reqs] + np.array(
            [scheduler_output.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        return req_ids, (seq_lens >= batch.num_tokens[:batch.num_reqs]).tolist()

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over the step's tokens: a CUDA graph replay for a pure-decode step that fits
        one, else an eager forward with the step's attention metadata. -> [num_tokens, hidden]"""
        lora_mapping = None
        if self.lora_manager is not None:
            states = self.input_batch.states[:inputs.num_reqs]
            lora_mapping = self.lora_manager.prepare_step([s.lora_request for s in states],  # type: ignore[union-attr]
                                                          inputs.num_scheduled.tolist())
        graph_size = self._cuda_graph_size(inputs) if lora_mapping is None else None  # graphs hold no adapters
        if graph_size is not None:
            return self.cuda_graphs.replay(inputs.num_reqs, graph_size)  # type: ignore[union-attr]
        attn_metadata, group_metadata = self._build_attention_metadata(inputs)
        positions = self.buffers.positions.copy_to_gpu(inputs.num_tokens)
        with set_forward_context(attn_metadata, group_metadata, self.kv_connector), lora_step(lora_mapping):
            if inputs.inputs_embeds is None:
                return self.model(inputs.input_ids, positions)
            return self.model(inputs.input_ids, positions, inputs.inputs_embeds)

    def _cuda_graph_size(self, inputs: StepInputs) -> int | None:
        """The captured batch size to replay, or None to run eagerly: graphs serve pure-decode
        steps of text tokens only, and skip the per-layer waits of a KV connector's loads."""
        if (self.cuda_graphs is None or inputs.max_query_len != 1 or inputs.inputs_embeds is not None
                or self.kv_transfer.has_pending_layer_loads()):
            return None
        return self.cuda_graphs.padded_size(inputs.num_reqs)

    def _build_attention_metadata(
            self, inputs: StepInputs) -> tuple[AttentionMetadata, list[AttentionMetadata] | None]:
        """Attention metadata of an eager step (and per KV cache group, for hybrid models)."""
        batch = self.input_batch
        if inputs.draft_token_ids is not None:
            # Each verified token becomes a decode row of its own (see verification_attention_metadata).
            return verification_attention_metadata(inputs, batch.block_table[0], self.block_size,
                                                   self.attn_backend.metadata_cls, self.device), None
        attn_metadata = build_attention_metadata(inputs, self.buffers, batch.block_table[0], self.block_size,
                                                 self.attn_backend.metadata_cls)
        if inputs.inputs_embeds is not None:  # image tokens this step: Gemma3 attends both ways within one
            attn_metadata.bidirectional_spans = self.encoder_runner.bidirectional_spans(  # type: ignore[union-attr]
                batch.states[:inputs.num_reqs], inputs.num_computed, inputs.num_scheduled)
        group_metadata = None
        if self.group_metadata_builder is not None:
            group_metadata = self.group_metadata_builder.build(attn_metadata, inputs.req_indices, inputs.positions)
        return attn_metadata, group_metadata

    # -- step, phase 2 --------------------------------------------------------------------
    @torch.inference_mode()
    def sample_tokens(self) -> ModelRunnerOutput:
        """Sample from the stored logits; append the new tokens to the worker's own state."""
        state, self._state = self._state, None
        kv_connector_output, self._kv_connector_output = self._kv_connector_output, None
        self.prev_sampled = {}  # only the step just before the next one counts
        if self._encoder_only_output is not None:
            output, self._encoder_only_output = self._encoder_only_output, None
            return output
        if state is None:
            if kv_connector_output is None:
                return EMPTY_MODEL_RUNNER_OUTPUT
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[],
                                     kv_connector_output=kv_connector_output)
        batch = self.input_batch
        if state.draft_token_ids is not None:
            return self._verify_drafts(state, kv_connector_output)
        if state.grammar_bitmask is not None:
            row_of = {r: i for i, r in enumerate(state.req_ids)}
            apply_grammar_bitmask(state.logits, state.grammar_bitmask,
                                  [row_of[r] for r in state.structured_output_request_ids or []])
        sampler_output = self.sampler(state.logits, self._get_sampling_metadata())
        # Every TP rank samples from the same gathered logits; rank 0's tokens are taken by all,
        # so no rank's state can drift (e.g. a sampler that draws from the global generator).
        get_tp_group().broadcast(sampler_output.sampled_token_ids, src=0)
        if self.async_scheduling:
            self.prev_sampled_token_ids = sampler_output.sampled_token_ids.reshape(-1)  # [num_reqs]
        sampled = sampler_output.sampled_token_ids.tolist()
        sampled_token_ids: list[list[int]] = []
        for row, token_id in enumerate(sampled):
            if not state.sample_rows[row]:
                sampled_token_ids.append([])
                continue
            req_state = batch.states[row]
            assert req_state is not None
            if self.async_scheduling:
                self.prev_sampled[req_state.req_id] = (row, int(batch.num_tokens[row]))
            req_state.output_token_ids.append(token_id)
            batch.append_token(row, token_id)
            sampled_token_ids.append([token_id])
        logprobs = self._logprobs_lists(state, sampler_output.logprobs_tensors)
        return self._runner_output(state, sampled_token_ids, logprobs, kv_connector_output)

    @staticmethod
    def _runner_output(state: ExecuteModelState, sampled_token_ids: list[list[int]],
                       logprobs: dict[str, LogprobsLists],
                       kv_connector_output: KVConnectorOutput | None) -> ModelRunnerOutput:
        """The step's ModelRunnerOutput: the tokens each row emitted, with the step's side outputs."""
        return ModelRunnerOutput(
            req_ids=state.req_ids,
            req_id_to_index={r: i for i, r in enumerate(state.req_ids)},
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            kv_connector_output=kv_connector_output,
            prompt_logprobs=state.prompt_logprobs,
            pooler_output=state.pooler_output,
        )

    def _verify_drafts(self, state: ExecuteModelState,
                       kv_connector_output: KVConnectorOutput | None) -> ModelRunnerOutput:
        """sample_tokens for a step that verifies drafts (DraftVerifier); the accepted tokens
        join the worker's state."""
        batch = self.input_batch
        assert state.draft_token_ids is not None
        token_ids, verified_logprobs = self.draft_verifier.verify(
            state.logits, state.req_ids, state.draft_token_ids, self.requests, state.grammar_bitmask,
            state.structured_output_request_ids)
        sampled_token_ids: list[list[int]] = []
        logprobs: dict[str, LogprobsLists] = {}
        for row_index, (req_id, tokens) in enumerate(zip(state.req_ids, token_ids)):
            if not state.sample_rows[row_index]:
                sampled_token_ids.append([])
                continue
            req_state = batch.states[row_index]
            assert req_state is not None and req_state.req_id == req_id
            for token_id in tokens:
                req_state.output_token_ids.append(token_id)
                batch.append_token(row_index, token_id)
            sampled_token_ids.append(tokens)
            if req_id in verified_logprobs:
                logprobs[req_id] = verified_logprobs[req_id]
        return self._runner_output(state, sampled_token_ids, logprobs, kv_connector_output)

    def _logprobs_lists(self, state: ExecuteModelState, tensors) -> dict[str, LogprobsLists]:  # type: ignore[no-untyped-def]
        if tensors is None:
            return {}
        ids = tensors.logprob_token_ids.tolist()
        values = tensors.logprobs.tolist()
        ranks = tensors.selected_token_ranks.tolist()
        result: dict[str, LogprobsLists] = {}
        for row, req_id in enumerate(state.req_ids):
            num_logprobs = self.requests[req_id].sampling_params.logprobs
            if num_logprobs is None or not state.sample_rows[row]:
                continue
            width = num_logprobs + 1
            result[req_id] = LogprobsLists([ids[row][:width]], [values[row][:width]], [ranks[row]])
        return result

    # -- persistent state -----------------------------------------------------------------
    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the scheduler's diffs to self.requests and the persistent batch."""
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            gone = self.requests.pop(req_id, None)
            if gone is not None and gone.sampling_params.prompt_logprobs is not None:
                self._num_prompt_logprobs_reqs -= 1
            self._pooling_reqs.discard(req_id)
            self.pooler.forget(req_id)
            batch.remove_request(req_id)
        # A running request the scheduler skipped this step leaves the batch but keeps its state.
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in list(batch.req_id_to_index):
            if req_id not in scheduled:
                batch.remove_request(req_id)
        for new_req in scheduler_output.scheduled_new_reqs:
            params = new_req.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            req_state = CachedRequestState(
                req_id=new_req.req_id,
                prompt_token_ids=new_req.prompt_token_ids,
                output_token_ids=list(new_req.output_token_ids),
                sampling_params=params,
                generator=generator,
                block_ids=tuple(list(ids) for ids in new_req.block_ids),
                num_computed_tokens=new_req.num_computed_tokens,
                mm_features=new_req.mm_features,
                lora_request=new_req.lora_request,
            )
            if new_req.req_id in self.requests:  # re-sent (e.g. resumed): counted once
                self._num_prompt_logprobs_reqs -= self.requests[new_req.req_id].sampling_params.prompt_logprobs is not None
            self.requests[new_req.req_id] = req_state
            self._num_prompt_logprobs_reqs += params.prompt_logprobs is not None
            if params.pooling is not None:
                self._pooling_reqs.add(new_req.req_id)
            batch.add_request(req_state)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req_state = self.requests[req_id]
            req_state.num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            if new_block_ids is not None:
                for ids, new_ids in zip(req_state.block_ids, new_block_ids):
                    ids.extend(new_ids)
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                batch.add_request(req_state)
                continue
            batch.num_computed_tokens_cpu[row] = req_state.num_computed_tokens
            if new_block_ids is not None:
                batch.block_table.append_row(new_block_ids, row)
        batch.condense()
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            # The drafts are the inputs after the last real token; num_tokens does not count them.
            row = batch.req_id_to_index[req_id]
            start = int(batch.num_tokens[row])
            batch.token_ids_cpu[row, start:start + len(drafts)] = drafts

    def _get_sampling_metadata(self) -> SamplingMetadata:
        batch = self.input_batch
        if batch.batch_changed or self._sampling_metadata is None:
            states = batch.states[:batch.num_reqs]
            self._sampling_metadata = SamplingMetadata.from_params(
                [s.sampling_params for s in states],
                [s.output_token_ids for s in states],
                [s.prompt_token_ids for s in states],
                {i: s.generator for i, s in enumerate(states) if s.generator is not None},
                self.vocab_size,
                self.device,
            )
            batch.batch_changed = False
        return self._sampling_metadata
