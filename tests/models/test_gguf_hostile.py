"""Malformed and hostile GGUF files: each is refused with InvalidGGUFError naming what is wrong,
before anything is allocated from its declared sizes, and nothing is cached for it.

The files are tiny 2-layer llama GGUFs written with the `gguf` package's GGUFWriter, then given
one defect: in the metadata (block_count 1000000, context_length 0, head_count 0, eps as a
string, eos id out of range, a shape that disagrees) or in the bytes (truncated, bad magic,
version 99, huge counts, 2**31 lengths, deeply nested arrays).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from lm_console.engine.errors import InvalidGGUFError  # noqa: E402
from lm_console.engine.models.embedded import resolve_model_path  # noqa: E402

pytestmark = pytest.mark.hostile

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 32, 4, 2, 8, 64, 64, 2
BASE_META: dict[str, Any] = {
    "block_count": LAYERS, "context_length": 256, "embedding_length": HIDDEN, "feed_forward_length": FFN,
    "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS,
    "attention.layer_norm_rms_epsilon": 1e-5,
}


def _tensors(layers: int = LAYERS) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:  # GGUF order: innermost dimension first, numpy [out, in]
        return rng.standard_normal(shape).astype(np.float32)

    tensors = {"token_embd.weight": w(VOCAB, HIDDEN), "output_norm.weight": np.ones(HIDDEN, np.float32)}
    for i in range(layers):
        tensors.update({
            f"blk.{i}.attn_norm.weight": np.ones(HIDDEN, np.float32),
            f"blk.{i}.ffn_norm.weight": np.ones(HIDDEN, np.float32),
            f"blk.{i}.attn_q.weight": w(HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_k.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": w(HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_gate.weight": w(FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": w(FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": w(HIDDEN, FFN),
        })
    return tensors


TOKENS = ["a", "b", "ab", *(f"t{i}" for i in range(3, VOCAB))]


def write_tiny_gguf(path: Path, meta: dict[str, Any] | None = None, tensors: dict[str, np.ndarray] | None = None,
                    eos: Any = 2, extra: dict[str, Any] | None = None, tokenizer: dict[str, Any] | None = None) -> Path:
    """A 2-layer llama GGUF; `meta` overrides llama.* keys (None drops one), `extra` adds raw keys,
    `tokenizer` overrides the tokenizer's model / tokens / types / merges."""
    tok = {"model": "gpt2", "tokens": TOKENS, "types": [1] * VOCAB, "merges": ["a b"], **(tokenizer or {})}
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {**BASE_META, **(meta or {})}.items():
        name = f"llama.{key}"
        if value is None:
            continue
        if isinstance(value, str):
            writer.add_string(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_uint32(name, value)
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    writer.add_tokenizer_model(tok["model"])
    writer.add_token_merges(tok["merges"])
    if isinstance(eos, str):
        writer.add_string("tokenizer.ggml.eos_token_id", eos)
    else:
        writer.add_eos_token_id(eos)
    for key, value in (extra or {}).items():
        writer.add_array(key, value) if isinstance(value, list) else writer.add_uint32(key, value)
    for name, array in (tensors if tensors is not None else _tensors()).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _assert_nothing_cached(cache: Path) -> None:
    models = cache / "models"
    left = [p.name for p in models.iterdir() if p.name != "index.json"] if models.exists() else []
    assert left == [], f"an invalid conversion was cached: {left}"


def _refused(path: Path, cache: Path, match: str) -> InvalidGGUFError:
    with pytest.raises(InvalidGGUFError, match=match) as info:
        resolve_model_path(str(path))
    assert str(path) in str(info.value)  # the message names the file
    _assert_nothing_cached(cache)
    return info.value


def test_the_valid_base_file_converts(tmp_path, private_cache):
    from lm_console.engine.models.gguf_check import check_gguf

    _, config = check_gguf(write_tiny_gguf(tmp_path / "ok.gguf"))
    assert config["num_hidden_layers"] == LAYERS and config["vocab_size"] == VOCAB
    converted = resolve_model_path(str(tmp_path / "ok.gguf"))
    assert (converted / "config.json").is_file() and (converted / "gguf_checked.json").is_file()


@pytest.mark.parametrize(("tokenizer", "match"), [
    ({"model": "klingon"}, r"tokenizer metadata cannot be read \(ValueError: .*'klingon'"),
    ({"merges": ["zz qq"]}, r"tokenizer metadata cannot be read"),
    ({"types": [1, 1, 1]}, r"tokenizer.ggml.token_type has 3 entries for 64 tokens"),
    ({"tokens": TOKENS[:10]}, r"tokenizer.ggml.tokens has 10 tokens but token_embd has 64 rows"),
])
def test_an_unusable_tokenizer_is_refused_on_one_line(tmp_path, private_cache, tokenizer, match):
    error = _refused(write_tiny_gguf(tmp_path / "bad.gguf", tokenizer=tokenizer), private_cache, match)
    assert "\n" not in str(error)


# -- metadata that disagrees with the tensors -------------------------------------------------

@pytest.mark.parametrize(("meta", "match"), [
    ({"block_count": 1_000_000}, r"block_count is 1000000 but the file holds layers 0-1"),
    ({"block_count": 1}, r"block_count is 1 but the file holds layers 0-1"),
    ({"context_length": 0}, r"context_length is 0"),
    ({"attention.head_count": 0}, r"head_count is 0"),
    ({"attention.head_count_kv": 0}, r"num_key_value_heads .* is 0"),
    ({"attention.head_count_kv": 3}, r"not a multiple of head_count_kv 3"),
    ({"attention.layer_norm_rms_epsilon": "abc"}, r"layer_norm_rms_epsilon is 'abc', not a number"),
    ({"attention.layer_norm_rms_epsilon": "1e-5"}, r"layer_norm_rms_epsilon is '1e-5', not a number"),
    ({"attention.layer_norm_rms_epsilon": 0.0}, r"layer_norm_rms_epsilon is 0.0"),
    ({"embedding_length": 48}, r"has shape"),
    ({"feed_forward_length": 1 << 30}, r"blk.0.ffn_\w+.weight has shape .* implies \[32, 1073741824\]"),
    ({"block_count": "2"}, r"block_count is '2', not an integer"),
    ({"context_length": None}, r"no llama.context_length key"),
])
def test_metadata_disagreeing_with_tensors_is_refused(tmp_path, private_cache, meta, match):
    _refused(write_tiny_gguf(tmp_path / "bad.gguf", meta), private_cache, match)


@pytest.mark.parametrize(("eos", "match"), [
    (VOCAB, r"eos_token_id is 64, not a token id in \[0, 64\)"),
    (2**31, r"eos_token_id is 2147483648"),
    ("2", r"eos_token_id is '2'"),
])
def test_token_ids_outside_the_vocabulary_are_refused(tmp_path, private_cache, eos, match):
    _refused(write_tiny_gguf(tmp_path / "bad.gguf", eos=eos), private_cache, match)


def test_a_missing_layer_tensor_is_refused(tmp_path, private_cache):
    tensors = _tensors()
    del tensors["blk.1.ffn_down.weight"]
    _refused(write_tiny_gguf(tmp_path / "bad.gguf", tensors=tensors), private_cache,
             r"layer 1 lacks tensor\(s\) blk.1.ffn_down.weight")


# -- bytes that are not a GGUF file -----------------------------------------------------------

def _patched(tmp_path: Path, edit: Any) -> Path:
    path = write_tiny_gguf(tmp_path / "bad.gguf")
    data = bytearray(path.read_bytes())
    data = edit(data) or data
    path.write_bytes(bytes(data))
    return path


def _set(data: bytearray, offset: int, fmt: str, value: int) -> None:
    struct.pack_into(fmt, data, offset, value)


def _tokens_array_count_offset(data: bytearray) -> int:
    key = b"tokenizer.ggml.tokens"
    return data.index(key) + len(key) + 4 + 4  # value type ARRAY, item type STRING, then the count


@pytest.mark.parametrize(("edit", "match"), [
    (lambda d: d[:len(d) // 2], r"truncated"),
    (lambda d: d[:20], r"shorter than a GGUF header"),
    (lambda d: d.__setitem__(slice(0, 4), b"GGUX"), r"bad magic"),
    (lambda d: _set(d, 4, "<I", 99), r"GGUF version 99 is not supported"),
    (lambda d: _set(d, 8, "<Q", 2**40), r"declares \d+ metadata entries and 1099511627776 tensors"),
    (lambda d: _set(d, 16, "<Q", 2**62), r"declares 4611686018427387904 metadata entries"),
    (lambda d: _set(d, 24, "<Q", 2**31), r"metadata key #0 declares 2147483648 bytes"),
    (lambda d: _set(d, _tokens_array_count_offset(d), "<Q", 2**31), r"tokenizer.ggml.tokens.*2147483648 items"),
])
def test_malformed_bytes_are_refused(tmp_path, private_cache, edit, match):
    _refused(_patched(tmp_path, edit), private_cache, match)


def test_deeply_nested_metadata_arrays_are_refused(tmp_path, private_cache):
    nested: Any = [1]
    for _ in range(10):
        nested = [nested]
    path = write_tiny_gguf(tmp_path / "bad.gguf", extra={"general.nested": nested})
    _refused(path, private_cache, r"nests arrays deeper than")


def test_a_conversion_cached_before_the_checks_is_rechecked_and_removed(tmp_path, private_cache):
    """A directory converted from an invalid file by an earlier version (no checks marker) is
    deleted on the next resolve instead of being loaded."""
    from lm_console.engine.models import embedded

    bad = write_tiny_gguf(tmp_path / "bad.gguf", {"block_count": 1_000_000})
    stale = embedded._converted_dir(bad, "bad")
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    with pytest.raises(InvalidGGUFError, match="block_count"):
        resolve_model_path(str(bad))
    assert not stale.exists()


def test_lmc_refuses_a_bad_gguf_with_one_line_and_exit_2(tmp_path, private_cache):
    from typer.testing import CliRunner

    from lm_console.cli import app

    bad = write_tiny_gguf(tmp_path / "bad.gguf", {"context_length": 0})
    for args in (["models", "path", str(bad)], ["generate", "hi", "--model", str(bad)]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "context_length is 0" in lines[0], result.output
        assert "Traceback" not in result.output
    _assert_nothing_cached(private_cache)


def test_a_model_directory_with_zero_positions_is_refused_at_load(tiny_llama_dir, tmp_path):
    """Item 9's other door: a converted or hand-made directory whose config says 0 positions is
    refused when the engine loads it, not by the first request (which ended the engine)."""
    import json
    import shutil

    from lm_console.engine.config.engine_args import EngineArgs
    from lm_console.engine.errors import InvalidModelConfigError

    model = tmp_path / "zero"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 0}))
    with pytest.raises(InvalidModelConfigError, match="max_position_embeddings=0"):
        EngineArgs(model=str(model), multiprocess=False, dtype="float32").create_engine_config()


def test_lmc_chat_and_batch_refuse_a_bad_gguf_without_a_traceback(tmp_path, private_cache):
    from typer.testing import CliRunner

    from lm_console.cli import app

    bad = write_tiny_gguf(tmp_path / "bad.gguf", {"block_count": 1_000_000})
    source = tmp_path / "in.jsonl"
    source.write_text('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}\n')
    for args in (["chat", "--plain", "--model", str(bad)],
                 ["batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--model", str(bad)]):
        result = CliRunner().invoke(app, args, input="hi\n")
        assert result.exit_code == 2, (args, result.output)
        assert "Traceback" not in result.output and "block_count is 1000000" in result.output.splitlines()[0]
    _assert_nothing_cached(private_cache)
