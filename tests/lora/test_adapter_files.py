"""An adapter's files are checked before its weights are read: each fault is a clear
InvalidLoRARequestError naming what is wrong (torch-free checks, lm_console/engine/lora/)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lm_console.engine.config.lora import LoRAConfig
from lm_console.engine.errors import InvalidEngineArgsError, InvalidLoRARequestError
from lm_console.engine.lora.adapter_files import read_adapter
from lm_console.engine.lora.request import LoRARequest

from lora_helpers import BASE, DIMS, PREFIX, write_adapter


def test_a_sound_adapter_is_read_with_its_rank_scaling_and_modules(tmp_path) -> None:
    spec = read_adapter(str(write_adapter(tmp_path / "a", rank=4)), BASE, 16)
    assert (spec.rank, spec.lora_alpha, spec.scaling) == (4, 8.0, 2.0)
    assert sorted(spec.modules) == [(0, "q_proj"), (0, "v_proj"), (1, "q_proj"), (1, "v_proj")]
    rs = read_adapter(str(write_adapter(tmp_path / "rs", rank=4, config={"use_rslora": True})), BASE, 16)
    assert rs.scaling == pytest.approx(8.0 / 2.0)  # alpha / sqrt(r)


def _truncate(path: Path) -> None:
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])


def _huge_header(path: Path) -> None:
    weights = path / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])


def _lie_about_shape(path: Path) -> None:
    weights = path / "adapter_model.safetensors"
    data = weights.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [4, 100000]  # more bytes than its data_offsets hold
    raw = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


@pytest.mark.parametrize("fault, match", [
    ("no_dir", "not a directory"),
    ("no_config", "no adapter_config.json"),
    ("bad_json", "adapter_config.json is not JSON"),
    ("no_weights", "no adapter_model.safetensors"),
    ("truncated", "truncated or padded"),
    ("huge_header", "header declares"),
    ("shape_lie", "declares .* bytes for shape"),
    ("rank_too_large", "exceeds max_lora_rank=16"),
    ("other_hidden_size", "trained for another base model"),
    ("too_many_layers", "base model has 2 layers"),
    ("lm_head", "not one this engine applies"),
    ("dora", "DoRA"),
    ("bias", "trained biases"),
    ("modules_to_save", "modules_to_save"),
    ("config_rank_wrong", "expected \\[8, 64\\]"),
    ("missing_b", "lora_A without its lora_B"),
])
def test_bad_adapters_are_refused_with_the_reason(tmp_path, fault, match) -> None:
    path = tmp_path / "adapter"
    if fault != "no_dir":
        write_adapter(path, rank=32 if fault == "rank_too_large" else 4,
                      dims={**DIMS, "q_proj": (96, 64)} if fault == "other_hidden_size" else None,
                      layers=3 if fault == "too_many_layers" else 2,
                      extra={"base_model.model.lm_head.lora_A.weight": torch.randn(4, 64)} if fault == "lm_head" else None,
                      config={"use_dora": True} if fault == "dora" else
                      {"bias": "all"} if fault == "bias" else
                      {"modules_to_save": ["lm_head"]} if fault == "modules_to_save" else
                      {"r": 8} if fault == "config_rank_wrong" else None)
    if fault == "no_config":
        (path / "adapter_config.json").unlink()
    elif fault == "bad_json":
        (path / "adapter_config.json").write_text("{not json")
    elif fault == "no_weights":
        (path / "adapter_model.safetensors").unlink()
    elif fault == "truncated":
        _truncate(path)
    elif fault == "huge_header":
        _huge_header(path)
    elif fault == "shape_lie":
        _lie_about_shape(path)
    elif fault == "missing_b":
        from safetensors.torch import load_file
        tensors = load_file(str(path / "adapter_model.safetensors"))
        del tensors[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"]
        save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(InvalidLoRARequestError, match=match):
        read_adapter(str(path), BASE, 16)


@pytest.mark.parametrize("kwargs, match", [
    ({"lora_name": "", "lora_int_id": 1, "lora_path": "/x"}, "lora_name must be"),
    ({"lora_name": "a", "lora_int_id": 0, "lora_path": "/x"}, "lora_int_id must be an int >= 1"),
    ({"lora_name": "a", "lora_int_id": True, "lora_path": "/x"}, "lora_int_id must be an int >= 1"),
    ({"lora_name": "a", "lora_int_id": 1, "lora_path": ""}, "lora_path must name"),
])
def test_bad_lora_requests_are_refused(kwargs, match) -> None:
    with pytest.raises(InvalidLoRARequestError, match=match):
        LoRARequest(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_loras": 0}, r"max_loras=0 is invalid: it must be an integer >= 1 and <= 256"),
    ({"max_lora_rank": 0}, r"max_lora_rank=0 is invalid: it must be an integer >= 1 and <= 512"),
    ({"max_lora_rank": 1024}, r"max_lora_rank=1024 is invalid"),
    ({"max_cpu_loras": 0}, r"max_cpu_loras=0 is invalid: it must be an integer >= 1, or None"),
    ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras=2 is below max_loras=4"),
    ({"enable_lora": 1}, r"enable_lora=1 is invalid: it must be True or False"),
])
def test_lora_config_is_validated(kwargs, match) -> None:
    from lm_console.engine.config.engine_args import EngineArgs

    with pytest.raises(InvalidEngineArgsError, match=match):
        LoRAConfig(**{"enable_lora": True, **kwargs})
    # the same declaration checks the EngineArgs keywords before anything starts
    with pytest.raises(InvalidEngineArgsError, match=match):
        EngineArgs(**{"enable_lora": True, **kwargs})._verify()
    assert LoRAConfig(enable_lora=True, max_loras=2).cpu_capacity == 2


def test_lora_knobs_without_enable_lora_and_lora_with_tensor_parallelism_are_refused() -> None:
    from lm_console.engine.config.engine_args import EngineArgs

    with pytest.raises(InvalidEngineArgsError, match="max_loras apply only with enable_lora=True"):
        EngineArgs(max_loras=2)._verify()
    with pytest.raises(InvalidEngineArgsError, match="max_lora_rank, max_cpu_loras apply only with enable_lora"):
        LoRAConfig(max_lora_rank=8, max_cpu_loras=2)
    with pytest.raises(InvalidEngineArgsError, match="tensor-parallel rank only"):
        EngineArgs(enable_lora=True, tensor_parallel_size=2)._verify()
    assert EngineArgs().create_lora_config() is None
    config = EngineArgs(enable_lora=True, max_loras=3, max_lora_rank=8).create_lora_config()
    assert config is not None and (config.max_loras, config.max_lora_rank, config.cpu_capacity) == (3, 8, 3)


def test_lora_with_speculative_decoding_is_accepted() -> None:
    """The two combine (tests/lora/test_lora_spec_decode.py checks the output)."""
    from lm_console.engine.config.engine_args import EngineArgs

    spec = {"method": "ngram", "num_speculative_tokens": 2}
    EngineArgs(enable_lora=True, speculative_config=spec)._verify()


def test_lora_flags_come_from_the_declarations() -> None:
    from lm_console.engine_options import flag_declarations

    flags = {name: decl.flag for name, decl in flag_declarations().items()}
    assert {flags[k] for k in ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")} == {
        "--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras"}
