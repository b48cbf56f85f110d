"""ECConnector: config parsing, the factory (registered and dynamically loaded connectors), and
the example connector's producer -> consumer hand-off through a shared directory."""

from __future__ import annotations

import json

import pytest

from lm_console.engine import SamplingParams
from lm_console.engine.distributed.ec_transfer import ECConnectorFactory, ECConnectorRole, ECTransferConfig
from lm_console.engine.distributed.ec_transfer.example_connector import ECExampleConnector
from lm_console.engine.errors import InvalidEngineArgsError
from mm_factory import make_image

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = dict(multiprocess=False, dtype="float32", max_model_len=512, kv_cache_memory=1 << 24,
              enable_prefix_caching=False)


def test_config_from_dict_or_json_and_roles() -> None:
    config = ECTransferConfig.from_arg(json.dumps({"ec_role": "ec_producer",
                                                   "ec_connector_extra_config": {"shared_storage_path": "/x"}}))
    assert config.is_ec_producer and not config.is_ec_consumer and config.is_producer_only
    both = ECTransferConfig.from_arg({"ec_role": "ec_both"})
    assert both.is_ec_producer and both.is_ec_consumer and not both.is_producer_only
    with pytest.raises(InvalidEngineArgsError, match="ec_role"):
        ECTransferConfig.from_arg({"ec_role": "leader"})
    with pytest.raises(InvalidEngineArgsError, match="unknown key"):
        ECTransferConfig.from_arg({"ec_rol": "ec_consumer"})
    with pytest.raises(InvalidEngineArgsError, match="JSON"):
        ECTransferConfig.from_arg("{not json")


def test_factory_registered_and_dynamic_loading(tmp_path) -> None:
    extra = {"shared_storage_path": str(tmp_path)}
    config = ECTransferConfig(ec_connector_extra_config=extra)
    assert isinstance(ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER), ECExampleConnector)
    dynamic = ECTransferConfig(ec_connector="ECExampleConnector",
                               ec_connector_module_path="lm_console.engine.distributed.ec_transfer.example_connector",
                               ec_connector_extra_config=extra)
    connector = ECConnectorFactory.create_connector(dynamic, ECConnectorRole.WORKER)
    assert connector.role == ECConnectorRole.WORKER
    with pytest.raises(InvalidEngineArgsError, match="not registered"):
        ECConnectorFactory.create_connector(ECTransferConfig(ec_connector="Nope"), ECConnectorRole.WORKER)
    with pytest.raises(InvalidEngineArgsError, match="cannot load"):
        ECConnectorFactory.create_connector(
            ECTransferConfig(ec_connector="X", ec_connector_module_path="no.such.module"), ECConnectorRole.WORKER)


def _runner(llm):
    return llm.engine_core.engine_core.model_executor.worker.model_runner


def test_producer_writes_and_consumer_loads_instead_of_encoding(tiny_idefics3_dir, tmp_path, make_llm) -> None:
    storage = tmp_path / "ec"
    prompts = [{"prompt": "<image>What is it?", "multi_modal_data": {"image": make_image(1)}},
               {"prompt": "Two: <image><image>", "multi_modal_data": {"image": [make_image(2), make_image(1)]}}]
    baseline = make_llm(str(tiny_idefics3_dir), **ENGINE)
    expected = [o.outputs[0].token_ids for o in baseline.generate(prompts, GREEDY, use_tqdm=False)]

    producer = make_llm(str(tiny_idefics3_dir), **ENGINE, ec_transfer_config={
        "ec_role": "ec_producer", "ec_connector_extra_config": {"shared_storage_path": str(storage)}})
    assert producer.get_block_pool_state().num_blocks == 2  # no KV cache beyond the null block
    assert _runner(producer).kv_caches == []
    produced = producer.generate(prompts, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 1 for o in produced)  # one placeholder token each
    files = sorted(p.parent.name for p in storage.glob("*/encoder_cache.safetensors"))
    assert len(files) == 2 and _runner(producer).encoder_runner.num_encoder_runs == 2

    consumer = make_llm(str(tiny_idefics3_dir), **ENGINE, ec_transfer_config=json.dumps(
        {"ec_role": "ec_consumer", "ec_connector_extra_config": {"shared_storage_path": str(storage)}}))
    outputs = consumer.generate(prompts, GREEDY, use_tqdm=False)
    encoder = _runner(consumer).encoder_runner
    assert encoder.num_encoder_runs == 0 and encoder.ec_connector.num_loaded == 2
    assert consumer.get_stats().encoder_cache.num_external_loads == 2
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # An image no producer has seen is computed locally.
    consumer.generate({"prompt": "<image>", "multi_modal_data": {"image": make_image(3)}}, GREEDY, use_tqdm=False)
    assert encoder.num_encoder_runs == 1


def test_names_are_not_paths_and_a_bad_stored_file_means_recompute(tiny_idefics3_dir, tmp_path, make_llm) -> None:
    """Issue 18 item 3: on main "../../escaped" wrote outside the storage, and a corrupt or
    wrong-size file killed the engine core."""
    from lm_console.engine.distributed.ec_transfer.example_connector import storage_name

    assert storage_name("abc_DEF-123") == "abc_DEF-123"
    assert all(storage_name(n).startswith("h.") and "/" not in storage_name(n)
               for n in ("../../escaped", "/etc/passwd", "..", ".", "a" * 129, "x\udcff"))
    storage = tmp_path / "deep" / "ec"
    uuids = ["../../escaped", str(tmp_path / "absolute")]
    prompts = [{"prompt": "<image>What is it?", "multi_modal_data": {"image": make_image(1)},
                "multi_modal_uuids": [uuids[0]]},
               {"prompt": "<image>And this?", "multi_modal_data": {"image": make_image(2)},
                "multi_modal_uuids": [uuids[1]]}]
    baseline = make_llm(str(tiny_idefics3_dir), **ENGINE)
    expected = [o.outputs[0].token_ids for o in baseline.generate(prompts, GREEDY, use_tqdm=False)]
    producer = make_llm(str(tiny_idefics3_dir), **ENGINE, ec_transfer_config={
        "ec_role": "ec_producer", "ec_connector_extra_config": {"shared_storage_path": str(storage)}})
    producer.generate(prompts, GREEDY, use_tqdm=False)
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.safetensors"))
    assert len(written) == 2 and all(p.parts[:2] == ("deep", "ec") for p in written), written
    files = sorted(storage.glob("*/encoder_cache.safetensors"))
    files[0].write_bytes(b"not a safetensors file")  # corrupt
    import torch
    from safetensors.torch import save_file

    save_file({"ec_cache": torch.zeros(3, 8)}, str(files[1]))  # the wrong number of embeddings
    consumer = make_llm(str(tiny_idefics3_dir), **ENGINE, ec_transfer_config={
        "ec_role": "ec_consumer", "ec_connector_extra_config": {"shared_storage_path": str(storage)}})
    outputs = consumer.generate(prompts, GREEDY, use_tqdm=False)
    encoder = _runner(consumer).encoder_runner
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert encoder.ec_connector.num_load_failures == 2 and encoder.num_encoder_runs == 2
    assert not any(f.exists() for f in files), "the bad files are deleted"
