"""A KV connector on a hybrid model (Gemma3: sliding-window and global layers, two KV cache
groups) is refused by EngineArgs validation, before any process starts, with a message naming
the model and what to do; single-group models keep their connector."""

from __future__ import annotations

import json

import pytest

from lm_console.engine.config.engine_args import EngineArgs
from lm_console.engine.errors import InvalidEngineArgsError

OFFLOAD = {"kv_connector": "OffloadConnector", "kv_role": "kv_both"}


def test_a_connector_on_gemma3_is_refused_before_any_process_starts(tiny_gemma3_dir, monkeypatch) -> None:
    from lm_console.engine.frontend import engine_process

    def no_launch(self) -> None:  # noqa: ANN001
        raise AssertionError("an engine process was started")

    monkeypatch.setattr(engine_process.EngineProcess, "launch", no_launch)
    from lm_console.engine import LLM

    for multiprocess in (True, False):
        with pytest.raises(InvalidEngineArgsError, match=r"mix full_attention and sliding_attention.*--kv-offload"):
            LLM(str(tiny_gemma3_dir), kv_transfer_config=OFFLOAD, multiprocess=multiprocess)


def test_lmc_serve_refuses_it_with_one_line(tiny_gemma3_dir, tmp_path) -> None:
    from typer.testing import CliRunner

    from lm_console.cli import app

    result = CliRunner().invoke(app, ["serve", str(tiny_gemma3_dir), "--kv-offload", "--port", "0"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: kv_transfer_config cannot be used"), result.output


def test_single_group_models_keep_their_connector(tiny_llama_dir, tiny_mistral_dir, tmp_path) -> None:
    from lm_console.engine.config.engine_args import attention_kinds

    for model in (tiny_llama_dir, tiny_mistral_dir):
        EngineArgs(model=str(model), kv_transfer_config=OFFLOAD)._verify()
    assert attention_kinds(None) is None and attention_kinds("SmolLM2-135M-Instruct") is None
    # A Gemma3 config saved without layer_types: the 5:1 default pattern is hybrid.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "num_hidden_layers": 6,
                                                     "sliding_window": 512}))
    assert attention_kinds(str(legacy)) == {"full_attention", "sliding_attention"}
    one_layer = tmp_path / "one"
    one_layer.mkdir()
    (one_layer / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "num_hidden_layers": 1,
                                                        "sliding_window": 512}))
    EngineArgs(model=str(one_layer), kv_transfer_config=OFFLOAD)._verify()


def test_a_gemma3_gguf_is_recognised_from_its_metadata(tmp_path) -> None:
    """Without parsing its vocabulary or tensors (the layout scan's metadata)."""
    gguf = pytest.importorskip("gguf")
    from lm_console.engine.config.engine_args import attention_kinds

    def write(arch: str, **keys: int) -> str:
        path = tmp_path / f"{arch}.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_block_count(6)
        for key, value in keys.items():
            writer.add_uint32(f"{arch}.{key}", value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return str(path)

    hybrid = write("gemma3", **{"attention.sliding_window": 512})
    assert attention_kinds(hybrid) == {"full_attention", "sliding_attention"}
    with pytest.raises(InvalidEngineArgsError, match="mix full_attention and sliding_attention"):
        EngineArgs(model=hybrid, kv_transfer_config=OFFLOAD)._verify()
    assert attention_kinds(write("llama")) == {"full_attention"}
    # pattern 1: every layer global (as gguf_arch reads it)
    assert attention_kinds(write("gemma3", **{"attention.sliding_window": 512,
                                              "attention.sliding_window_pattern": 1})) == {"full_attention"}
