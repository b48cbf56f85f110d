"""Worker side of KV cache groups: layer specs, shared KV tensors, per-group block tables and metadata."""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoConfig

from lm_console.engine.attention import AttentionMetadata
from lm_console.engine.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec, get_kv_cache_config
from lm_console.engine.models.loader import load_model
from lm_console.engine.worker.block_table import MultiGroupBlockTable
from lm_console.engine.worker.kv_cache_groups import (
    GroupAttentionMetadataBuilder,
    allocate_kv_caches,
    get_attention_layers_by_name,
    get_kv_cache_spec,
)

CPU = torch.device("cpu")


def test_gemma3_layers_get_specs_groups_and_shared_tensors(tiny_gemma3_dir):
    config = AutoConfig.from_pretrained(tiny_gemma3_dir)
    model = load_model(tiny_gemma3_dir, config, torch.float32, CPU)
    specs = get_kv_cache_spec(model, block_size=16)
    assert list(specs.values()) == [SlidingWindowSpec(16, 24)] * 5 + [FullAttentionSpec(16)]
    kv_cache_config = get_kv_cache_config(specs, num_blocks=8)
    # 1 global and 5 local layers: groups of one layer, so one tensor shared by all six.
    assert len(kv_cache_config.kv_cache_groups) == 6 and len(kv_cache_config.kv_cache_tensors) == 1
    kv_caches = allocate_kv_caches(model, kv_cache_config, 16, torch.float32, CPU)
    layers = list(get_attention_layers_by_name(model).values())
    assert len(kv_caches) == 1 and all(layer.kv_cache is kv_caches[0] for layer in layers)
    # The global layer (index 5) is group 0; the local ones follow in layer order.
    assert [layer.kv_cache_group_id for layer in layers] == [1, 2, 3, 4, 5, 0]
    assert kv_caches[0].shape == (2, 8, 16, config.num_key_value_heads, config.head_dim)


def test_group_metadata_uses_each_groups_block_table():
    table = MultiGroupBlockTable(max_num_reqs=4, max_num_blocks_per_req=8, block_size=4, device=CPU,
                                 num_kv_cache_groups=3)
    table.add_row(([1, 2, 3], [0, 5, 6], [0, 0, 7]), 0)  # 0: null blocks behind a window
    table.add_row(([8], [9], [10]), 1)
    table.append_row(([11], [12], [13]), 1)
    table.move_row(1, 2)  # condense-style move keeps every group's row
    table.commit_block_table(3)
    req_indices = np.array([0, 0, 2])
    positions = np.array([9, 10, 5])
    common = AttentionMetadata(
        num_actual_tokens=3, num_reqs=3,
        query_start_loc=torch.tensor([0, 2, 2, 3], dtype=torch.int32),
        seq_lens=torch.tensor([11, 0, 6], dtype=torch.int32),
        block_table=table[0].get_device_tensor(3),
        slot_mapping=torch.from_numpy(table[0].compute_slot_mapping(req_indices, positions)),
        max_query_len=2, max_seq_len=11, query_start_loc_cpu=[0, 2, 2, 3], seq_lens_cpu=[11, 0, 6],
        block_size=4,
    )
    builder = GroupAttentionMetadataBuilder(table, max_num_tokens=16, device=CPU)
    group_md = builder.build(common, req_indices, positions)
    assert group_md[0] is common and len(group_md) == 3
    assert common.slot_mapping.tolist() == [3 * 4 + 1, 3 * 4 + 2, 11 * 4 + 1]
    assert group_md[1].slot_mapping.tolist() == [6 * 4 + 1, 6 * 4 + 2, 12 * 4 + 1]
    assert group_md[2].slot_mapping.tolist() == [7 * 4 + 1, 7 * 4 + 2, 13 * 4 + 1]
    assert group_md[2].block_table[0, :3].tolist() == [0, 0, 7]
    assert group_md[2].block_table[2, :2].tolist() == [10, 13]
    assert all(md.seq_lens_cpu == [11, 0, 6] for md in group_md[1:])
