"""ModelRunner: turns a SchedulerOutput into one forward pass (seed: GPUModelRunner, 1559-1730)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.attention.layer import get_attention_layers, set_attention_backend
from engine.attention.metadata import AttentionMetadata
from engine.attention.selector import load_attention_backend, resolve_attention_backend
from engine.config import EngineConfig
from engine.distributed.kv_transfer.output import KVConnectorOutput
from engine.forward_context import set_forward_context
from engine.kv_cache_interface import KVCacheConfig, KVCacheSpec, get_kv_cache_config
from engine.model_runner_output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from engine.models.loader import load_model
from engine.platform import torch_device, torch_dtype
from engine.protocol import LogprobsLists
from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import Sampler
from engine.scheduler_output import SchedulerOutput
from engine.worker.cpu_gpu_buffer import CpuGpuBuffer, InputBuffers
from engine.worker.cuda_graph import CudaGraphRunner
from engine.worker.encoder_runner import EncoderRunner, maybe_create_encoder_runner
from engine.worker.input_batch import CachedRequestState, InputBatch
from engine.worker.kv_cache_groups import GroupAttentionMetadataBuilder, allocate_kv_caches, get_kv_cache_spec
from engine.worker.kv_connector_mixin import KVConnectorModelRunnerMixin


@dataclass(slots=True)
class ExecuteModelState:
    """What execute_model() leaves for sample_tokens() (seed: two-phase execution)."""

    req_ids: list[str]
    logits: torch.Tensor  # [num_reqs, vocab_size] float32
    sample_rows: list[bool]  # False for a partial prefill, whose sample is discarded


class ModelRunner(KVConnectorModelRunnerMixin):
    """Owns the model, the KV cache tensors, the persistent InputBatch and the Sampler.

    Inputs are staged in persistent CpuGpuBuffers (pinned and copied asynchronously on CUDA;
    the device tensor is the host tensor on CPU). On CUDA with the Triton backend, pure-decode
    steps replay CUDA graphs unless config.device_config.enforce_eager.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model, sched = config.model_config, config.scheduler_config
        self.device = torch_device(config.device_config.device)
        self.dtype = torch_dtype(model.dtype)
        self.block_size = config.cache_config.block_size
        self.max_model_len = model.max_model_len
        self.num_layers = model.num_layers  # a VLM's facts are its language model's
        self.num_kv_heads = model.num_kv_heads
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
        self.cuda_graphs: CudaGraphRunner | None = None
        self.sampler = Sampler()
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.kv_cache_config: KVCacheConfig | None = None
        self.group_metadata_builder: GroupAttentionMetadataBuilder | None = None  # hybrid models
        self._sampling_metadata: SamplingMetadata | None = None
        self._state: ExecuteModelState | None = None
        # Multimodal models: encoder_cache, encoder execution, embedding merge (encoder_runner.py).
        self.encoder_runner: EncoderRunner | None = None
        self._encoder_only_output: ModelRunnerOutput | None = None
        self.kv_connector = None  # the worker-side KV connector, set by the Worker
        self._kv_connector_output: KVConnectorOutput | None = None

    # -- set-up ---------------------------------------------------------------------------
    def load_model(self) -> None:
        model_config = self.config.model_config
        self.model = load_model(Path(model_config.model_dir), model_config.hf_config, self.dtype, self.device)
        if self.attention_backend != "torch":  # the layers default to the torch backend
            set_attention_backend(self.model,
                                  load_attention_backend(self.attention_backend, self.device))
        self.encoder_runner = maybe_create_encoder_runner(self.model, self.config)

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
        """Each attention layer's KVCacheSpec, by layer name (seed: get_kv_cache_specs)."""
        assert self.model is not None
        return get_kv_cache_spec(self.model, self.block_size)

    def get_kv_cache_block_bytes(self) -> int:
        """Bytes one block takes across the layers it spans (K and V): all layers for a single
        KV cache group, one layer per group for hybrid models (see engine/kv_cache_interface.py)."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        num_layers = get_kv_cache_config(self.get_kv_cache_spec(), 0).num_layers_per_block
        return 2 * num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size

    def initialize_kv_cache(self, num_blocks: int) -> None:
        assert self.model is not None
        self.kv_cache_config = get_kv_cache_config(self.get_kv_cache_spec(), num_blocks)
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        if num_groups > 1:  # one block table (and slot mapping) per KV cache group
            self.input_batch = InputBatch(self.config.scheduler_config.max_num_seqs, self.max_model_len,
                                          self.block_size, self.device, num_groups)
            self.buffers.block_table = self.input_batch.block_table[0].buffer
            self.group_metadata_builder = GroupAttentionMetadataBuilder(
                self.input_batch.block_table, self.buffers.input_ids.cpu.shape[0], self.device)
        self.kv_caches = allocate_kv_caches(self.model, self.kv_cache_config, self.block_size,
                                            self.dtype, self.device)
        if self.kv_connector is not None:
            if num_groups > 1:
                raise NotImplementedError("KV connectors support models with one KV cache group "
                                          "(full attention or one sliding window), not hybrid ones")
            self.kv_connector.register_kv_caches(
                {layer.layer_name: layer.kv_cache for layer in get_attention_layers(self.model)})
        # Decode graphs read group 0's block table only: hybrid models run eagerly.
        if (self.device.type == "cuda" and self.attention_backend == "triton"
                and not self.config.device_config.enforce_eager and num_groups == 1):
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
        if self.kv_connector is not None:
            self._kv_connector_begin(scheduler_output)
        if scheduler_output.is_empty:
            self._state = None
            if self.kv_connector is not None:  # seed: kv_connector_no_forward
                self._kv_connector_output = self._kv_connector_finish(scheduler_output)
            return
        batch = self.input_batch
        num_reqs = batch.num_reqs
        # Issue the block-table DMA first: it overlaps the CPU work below (seed 1828-1985).
        batch.block_table.commit_block_table(num_reqs)
        req_ids = batch.req_ids[:num_reqs]  # a slice: already a copy
        num_scheduled = np.array([scheduler_output.num_scheduled_tokens[r] for r in req_ids],
                                 dtype=np.int64)
        cu_num_tokens = np.cumsum(num_scheduled)
        total = int(cu_num_tokens[-1])
        max_query_len = int(num_scheduled.max())
        req_indices = np.repeat(np.arange(num_reqs), num_scheduled)
        offsets = np.arange(total) - np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
        num_computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        positions = num_computed[req_indices] + offsets
        seq_lens = num_computed + num_scheduled
        if encoder is not None and encoder.is_producer_only:  # ECConnector producer: no decoder
            self._state = None
            self._encoder_only_output = encoder.make_encoder_only_output(
                req_ids, (seq_lens >= batch.num_tokens[:num_reqs]).tolist())
            return

        bufs = self.buffers
        bufs.positions.np[:total] = positions
        bufs.input_ids.np[:total] = batch.token_ids_cpu[req_indices, positions]
        bufs.slot_mapping.np[:total] = batch.block_table[0].compute_slot_mapping(req_indices,
                                                                                positions)
        bufs.query_start_loc.np[0] = 0
        bufs.query_start_loc.np[1 : num_reqs + 1] = cu_num_tokens
        bufs.seq_lens.np[:num_reqs] = seq_lens
        input_ids = bufs.input_ids.copy_to_gpu(total)
        inputs_embeds = None
        if encoder is not None:
            inputs_embeds = encoder.get_inputs_embeds(input_ids, batch.states[:num_reqs], num_computed,
                                                      num_scheduled)
        graph_size = None
        if (self.cuda_graphs is not None and max_query_len == 1 and inputs_embeds is None
                and not (self.kv_connector is not None and self.kv_connector.has_pending_layer_loads())):
            graph_size = self.cuda_graphs.padded_size(num_reqs)
        if graph_size is not None:
            hidden_states = self.cuda_graphs.replay(num_reqs, graph_size)
        else:
            attn_metadata = AttentionMetadata(
                num_actual_tokens=total,
                num_reqs=num_reqs,
                query_start_loc=bufs.query_start_loc.copy_to_gpu(num_reqs + 1),
                seq_lens=bufs.seq_lens.copy_to_gpu(num_reqs),
                block_table=batch.block_table[0].get_device_tensor(num_reqs),
                slot_mapping=bufs.slot_mapping.copy_to_gpu(total),
                max_query_len=max_query_len,
                max_seq_len=int(seq_lens.max()),
                query_start_loc_cpu=[0, *cu_num_tokens.tolist()],
                seq_lens_cpu=seq_lens.tolist(),
                block_size=self.block_size,
            )
            if inputs_embeds is not None:  # image tokens this step: Gemma3 attends both ways within one
                attn_metadata.bidirectional_spans = encoder.bidirectional_spans(  # type: ignore[union-attr]
                    batch.states[:num_reqs], num_computed, num_scheduled)
            group_metadata = None
            if self.group_metadata_builder is not None:
                group_metadata = self.group_metadata_builder.build(attn_metadata, req_indices,
                                                                   positions)
            positions_gpu = bufs.positions.copy_to_gpu(total)
            with set_forward_context(attn_metadata, group_metadata, self.kv_connector):
                if inputs_embeds is None:
                    hidden_states = self.model(input_ids, positions_gpu)
                else:
                    hidden_states = self.model(input_ids, positions_gpu, inputs_embeds)
        bufs.logits_indices.np[:num_reqs] = cu_num_tokens - 1
        logits_indices = bufs.logits_indices.copy_to_gpu(num_reqs)
        logits = self.model.compute_logits(hidden_states[logits_indices])
        sample_rows = (seq_lens >= batch.num_tokens[:num_reqs]).tolist()
        if self.kv_connector is not None:
            self._kv_connector_output = self._kv_connector_finish(scheduler_output)
        self._state = ExecuteModelState(req_ids=req_ids, logits=logits, sample_rows=sample_rows)

    # -- step, phase 2 --------------------------------------------------------------------
    @torch.inference_mode()
    def sample_tokens(self) -> ModelRunnerOutput:
        """Sample from the stored logits; append the new tokens to the worker's own state."""
        state, self._state = self._state, None
        kv_connector_output, self._kv_connector_output = self._kv_connector_output, None
        if self._encoder_only_output is not None:
            output, self._encoder_only_output = self._encoder_only_output, None
            return output
        if state is None:
            if kv_connector_output is None:
                return EMPTY_MODEL_RUNNER_OUTPUT
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[],
                                     kv_connector_output=kv_connector_output)
        batch = self.input_batch
        sampler_output = self.sampler(state.logits, self._get_sampling_metadata())
        sampled = sampler_output.sampled_token_ids.tolist()
        sampled_token_ids: list[list[int]] = []
        for row, token_id in enumerate(sampled):
            if not state.sample_rows[row]:
                sampled_token_ids.append([])
                continue
            req_state = batch.states[row]
            assert req_state is not None
            req_state.output_token_ids.append(token_id)
            batch.append_token(row, token_id)
            sampled_token_ids.append([token_id])
        logprobs = self._logprobs_lists(state, sampler_output.logprobs_tensors)
        return ModelRunnerOutput(
            req_ids=state.req_ids,
            req_id_to_index={r: i for i, r in enumerate(state.req_ids)},
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            kv_connector_output=kv_connector_output,
        )

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
            self.requests.pop(req_id, None)
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
            )
            self.requests[new_req.req_id] = req_state
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
